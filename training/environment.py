"""What the launcher exported, read once into a frozen `Environment`: the ranks, the accelerate config's precision,
its family (FSDP or DeepSpeed) with its FSDP_* settings and DeepSpeed file, and its `parallelism_config` block.

`accelerate launch` turns the YAML into these variables; torchrun and the deepspeed launcher export WORLD_SIZE alone.
The training scripts read them from their own environment (`Environment.read`); the tools that take a YAML instead
(the doctor, recipes/compare.py) have accelerate's own launcher code turn the file into the same variables
(`Environment.of_accelerate_config`), so both readings are accelerate's. Nothing else in the project reads them.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from training.paths import ROOT

BLOCK_PREFIX = "PARALLELISM_CONFIG_"


@dataclass(frozen=True)
class Environment:
    """The launcher's variables, as read at start-up."""

    world: int = 1
    """Ranks the launcher started (WORLD_SIZE: torchrun, accelerate and deepspeed all export it)."""
    precision: str = "no"
    """The accelerate config's mixed_precision (ACCELERATE_MIXED_PRECISION; "no" without one)."""
    fsdp: bool = False
    """An FSDP accelerate config (ACCELERATE_USE_FSDP)."""
    deepspeed: bool = False
    """A DeepSpeed accelerate config (ACCELERATE_USE_DEEPSPEED)."""
    deepspeed_config_file: str | None = None
    """The accelerate config's deepspeed_config_file (ACCELERATE_DEEPSPEED_CONFIG_FILE); None: inline fields."""
    fsdp_env: Mapping[str, str] = field(default_factory=dict)
    """accelerate's FSDP_* variables: the YAML's fsdp_config."""
    block: Mapping[str, str] | None = None
    """The YAML's `parallelism_config` block (ACCELERATE_USE_PARALLELISM_CONFIG and PARALLELISM_CONFIG_*, keys
    lower-cased without the prefix: `tp_size`, `dp_shard_size`, `sp_backend`, ...); None without one."""
    local_rank: int = 0
    """This rank's index on its node (LOCAL_RANK)."""
    local_world: int | None = None
    """Ranks on this node (LOCAL_WORLD_SIZE: torchrun, accelerate and deepspeed export it); None: not launched."""
    restart: int = 0
    """Which generation of workers this is (TORCHELASTIC_RESTART_COUNT: torchrun and `accelerate launch` with
    --max-restarts start a new one after a rank dies); 0: the first, or no torch elastic."""
    variables: Mapping[str, str] = field(default_factory=dict, compare=False, repr=False)
    """Every variable accelerate's config exported (for the tools that run accelerate's readers under them)."""

    @classmethod
    def read(cls, environ: Mapping[str, str] | None = None) -> Environment:
        """The environment of this process (or `environ`)."""
        env = os.environ if environ is None else environ

        def flag(name: str) -> bool:
            return env.get(name, "false").lower() == "true"

        block = None
        if flag("ACCELERATE_USE_PARALLELISM_CONFIG"):
            block = {k[len(BLOCK_PREFIX) :].lower(): v for k, v in env.items() if k.startswith(BLOCK_PREFIX)}
        exported = {k: v for k, v in env.items() if k.startswith(("ACCELERATE_", "FSDP_", BLOCK_PREFIX))}
        return cls(
            world=int(env.get("WORLD_SIZE", "1")), precision=env.get("ACCELERATE_MIXED_PRECISION", "no"),
            fsdp=flag("ACCELERATE_USE_FSDP"), deepspeed=flag("ACCELERATE_USE_DEEPSPEED"),
            deepspeed_config_file=env.get("ACCELERATE_DEEPSPEED_CONFIG_FILE") or None,
            fsdp_env={k: v for k, v in env.items() if k.startswith("FSDP_")}, block=block,
            local_rank=int(env.get("LOCAL_RANK", "0")), variables=exported,
            local_world=int(env["LOCAL_WORLD_SIZE"]) if env.get("LOCAL_WORLD_SIZE") else None,
            restart=int(env.get("TORCHELASTIC_RESTART_COUNT") or 0),
        )  # fmt: skip

    @classmethod
    def of_accelerate_config(cls, path: str | os.PathLike, num_processes: int | None = None) -> Environment:
        """The environment `accelerate launch --config_file path [--num_processes N]` gives its ranks, made by
        accelerate's own launcher code from the YAML (`_validate_launch_command` fills the arguments from the file,
        `prepare_multi_gpu_env` / `prepare_deepspeed_cmd_env` export them), without launching anything. A DeepSpeed
        file named relative to the repository (as the shipped YAMLs name theirs) is found there."""
        from accelerate.commands.launch import _validate_launch_command, launch_command_parser
        from accelerate.utils.launch import prepare_deepspeed_cmd_env, prepare_multi_gpu_env

        argv = ["--config_file", str(path)] + (["--num_processes", str(num_processes)] if num_processes else [])
        args, defaults, precision_from_config = _validate_launch_command(launch_command_parser().parse_args(
            [*argv, "recipes/train.py"]))  # fmt: skip
        if args.use_deepspeed:
            # what `launch_command` adds before it hands the arguments to the deepspeed launcher
            fields = list(defaults.deepspeed_config.keys()) if defaults else []
            args.deepspeed_fields_from_accelerate_config = ",".join(
                fields + (["mixed_precision"] if precision_from_config else [])
            )
            _, env = prepare_deepspeed_cmd_env(args)
        else:
            env = prepare_multi_gpu_env(args)
        launched = {k: v for k, v in env.items() if os.environ.get(k) != v}  # what the launch adds or changes
        file = launched.get("ACCELERATE_DEEPSPEED_CONFIG_FILE")
        if file and not Path(file).exists() and (ROOT / file).exists():  # the shipped YAMLs name ds_configs/...
            launched["ACCELERATE_DEEPSPEED_CONFIG_FILE"] = str(ROOT / file)
        return cls.read({**launched, "WORLD_SIZE": str(args.num_processes or 1)})

    # ------------------------------------------------------------------------------------------ the block

    def block_degree(self, key: str, default: int = 1) -> int:
        """The block's `parallelism_config_<key>` (`default` without the block or the key), refused unless a whole
        number of at least 1."""
        value = (self.block or {}).get(key) or str(default)
        if not value.strip().isdigit() or int(value) < 1:
            raise ValueError(f"the accelerate config's parallelism_config_{key} is {value!r}: set a whole number of "
                             "ranks, 1 or more")  # fmt: skip
        return int(value)

    @property
    def fsdp_version(self) -> int:
        """`accelerate launch` exports FSDP_VERSION from the YAML's fsdp_version; a YAML without it is FSDP1. 0
        outside an FSDP config."""
        return int(self.fsdp_env.get("FSDP_VERSION", "1")) if self.fsdp else 0

"""DeepSpeed ZeRO-1/2/3, with CPU or NVMe offload: accelerate's `prepare` hands the model, the optimizer and the
resolved JSON to `deepspeed.initialize`, whose engine partitions the optimizer states (ZeRO-1), the gradients too
(ZeRO-2) and the parameters too (ZeRO-3) over the data-parallel ranks, reduces the gradients, clips and steps.

What the project does around that call, in order:
- the strategy from the JSON the launch names, its "auto" values resolved from the flags
  (training/deepspeed_config.py), and the ops the engine will compile said before they are (`check_start`);
- the Accelerator: DeepSpeed's plugin with the resolved dict; ZeRO-3's partitions kept in fp32 on CPU ranks and
  DeepSpeed's Muon import skipped (training/compat.py); Ulysses' groups registered where the JSON gives the degree;
- the model: under ZeRO-3 built inside `zero.Init`, partitioned module by module as it is built, each module gathered
  for the moment its weights are drawn (`fresh_model`), so every rank holds its partitions only;
- the gradient norm: the engine's own (fp64, inside its step), after its clipping;
- what is in force: the engine, its stage, its partitions, where its offloads live, its precision;
- checkpoints: the engine's own files (`pytorch_model/`, a folder per tag), read offline as DeepSpeed's universal
  checkpoint (`ds_to_universal`), loaded through DeepSpeed's setters; NVMe's swap files are not converted; the export
  gathers ZeRO-3's partitions (`accelerator.get_state_dict`).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from contextlib import contextmanager
from pathlib import Path

import torch
from torch import nn

from training.compat import keep_zero3_param_dtype, skip_deepspeed_muon
from training.config import RunConfig
from training.core.family import MOMENTS, STATES, Family, meta_model
from training.deepspeed_config import DeepSpeedJSON, resolve_deepspeed
from training.environment import Environment
from training.strategy import Strategy, deepspeed_strategy


class ZeRO(Family):
    """A DeepSpeed engine around the whole model."""

    # ------------------------------------------------------------------ the launch

    def strategy(self, cfg: RunConfig, env: Environment, degrees: dict, ds: DeepSpeedJSON | None) -> Strategy:
        """The JSON's stage, offloads and degrees, every "auto" resolved from the flags (`cfg`); on CPU ranks its
        GPU-sized buckets capped."""
        hidden = cfg.model_config().hidden_size  # ZeRO's "auto" buckets are sized from it, as the HF Trainer does
        resolved = resolve_deepspeed(ds.raw, cfg, env.world, hidden, ds.source, cpu_ranks=not torch.cuda.is_available())
        if cfg.optim == "muon":  # the project's Muon is DeepSpeed's client optimizer, outside its tested list
            resolved = {**resolved, "zero_allow_untested_optimizer": True}
        return deepspeed_strategy(resolved, env.world, ds.source)

    def check_start(self, strategy: Strategy) -> None:
        """Before any process group: refuse a launch whose ranks would wait forever on a lock left by a killed
        build of a DeepSpeed op, and say which ops this launch compiles (minutes, otherwise silent)."""
        from training.core.ops import check_op_cache, launch_ops

        to_build = check_op_cache(launch_ops(strategy.deepspeed, torch.cuda.is_available()))
        if to_build and int(os.environ.get("LOCAL_RANK", "0")) == 0:  # one line per node
            ops = f"{', '.join(to_build)} op{'s' if len(to_build) > 1 else ''}"
            ahead = "`python recipes/doctor.py --build-ops` compiles ahead"
            print(f"DeepSpeed compiles its {ops} now, on first use here: minutes with no output, cached for later "
                  f"launches ({ahead})", file=sys.stderr, flush=True)  # fmt: skip

    def accelerator_kwargs(self, cfg: RunConfig, strategy: Strategy, env: Environment) -> dict:
        from accelerate.utils import DeepSpeedPlugin

        keep_zero3_param_dtype()
        skip_deepspeed_muon(strategy.deepspeed)  # 2.7 s of CPU a rank otherwise (training/compat.py)
        # The YAML's inline fields (and its mixed_precision) are already resolved into the config; without this,
        # accelerate refuses a config dict beside them ("the following accelerate config variables will be ignored").
        os.environ["ACCELERATE_CONFIG_DS_FIELDS"] = ""
        # Ulysses from the JSON's sequence_parallel_size: the parallelism config with which `prepare` registers
        # DeepSpeed's sequence-parallel attention and groups (an accelerate YAML's own block is read by accelerate).
        return {"deepspeed_plugin": DeepSpeedPlugin(hf_ds_config=strategy.deepspeed),
                "parallelism_config": ulysses_parallelism_config(strategy, env)}  # fmt: skip

    # ------------------------------------------------------------------ the model

    def fresh_model(self, config):
        """Under ZeRO-3 (accelerate's DeepSpeed plugin has set transformers' HfDeepSpeedConfig) the model is built
        inside `zero.Init`, partitioned module by module as it is built, and each module's partitions are gathered
        while its weights are drawn (collective); ZeRO-1/2 build it whole."""
        from transformers.integrations.deepspeed import deepspeed_config, is_deepspeed_zero3_enabled

        if not is_deepspeed_zero3_enabled():
            return None
        import deepspeed
        from transformers import initialization as init

        from model import ShardGPTForCausalLM
        from training.core.build import initialize

        with deepspeed.zero.Init(config_dict_or_path=deepspeed_config()), init.no_init_weights():
            net = ShardGPTForCausalLM(config)
        net.tie_weights()  # no_init_weights also skips the tie that post_init makes
        initialize(net, gathered_whole)  # collective: each module's partitions are gathered in turn
        return net

    # ------------------------------------------------------------------ a step, what is in force, the export

    def clips_itself(self) -> bool:
        return True  # from the JSON's gradient_clipping; the norm is read after its step (`get_global_grad_norm`)

    def verify(self, accelerator, model, unwrapped, strategy: Strategy, local: int, total: int, refuse) -> None:
        from deepspeed import DeepSpeedEngine

        if not isinstance(model, DeepSpeedEngine):
            refuse(f"the prepared model is a {type(model).__name__}, not a DeepSpeedEngine")
        if model.zero_optimization_stage() != strategy.zero_stage:
            refuse(f"the engine runs ZeRO stage {model.zero_optimization_stage()}")
        world = strategy.world_size
        if strategy.zero_stage == 3 and world > 1 and local > total / world * 1.05 + 1024:
            refuse(f"this rank holds {local} of {total} parameters (ZeRO-3 should hold about 1/{world})")
        if (model.autotp_size() or 1) != strategy.tp_size:  # an engine that splits layers of its own accord
            refuse(f"the engine splits layers over {model.autotp_size() or 1} ranks")

    def observe(self, model, optimizer) -> dict:
        """The engine's stage, where its partitions and optimizer states live, its precision."""
        from training.core.wrapped import parameter_count

        zero = model.optimizer
        _, accum = model.get_data_types()  # (the model's dtype, the gradient accumulation dtype)
        seen = {"deepspeed_precision": {
            "bf16": model.bfloat16_enabled(), "fp16": model.fp16_enabled(),
            "communication_data_type": str(model.communication_data_type).removeprefix("torch."),
            "grad_accum_dtype": str(accum).removeprefix("torch."),
        }, "zero_stage": model.zero_optimization_stage()}  # fmt: skip
        if seen["zero_stage"] == 3:
            seen["offload_param"] = device(zero.offload_param, zero.params_in_nvme_and_cpu)
            # DeepSpeed swaps only partitions of 1 MiB or more; smaller ones stay in host memory.
            on_nvme = [p.ds_tensor.ds_numel for p in model.module.parameters() if on_nvme_disk(p.ds_tensor)]
            seen["local_parameter_fraction_on_nvme"] = round(sum(on_nvme) / parameter_count(model), 4)
            seen["offload_optimizer"] = device(zero.offload_optimizer, zero.swap_optimizer)
            seen["gradients_partitioned_in_backward"] = True
        else:
            seen["offload_optimizer"] = device(getattr(zero, "cpu_offload", False), False)
            # ZeRO-1 in bf16 with fp32 gradient accumulation runs DeepSpeed's BF16_Optimizer, which has no such
            # flag: like ZeRO-1, it reduces whole gradients in the backward.
            seen["gradients_partitioned_in_backward"] = bool(getattr(zero, "partition_gradients", False))
        return seen

    def full_state_dict(self, accelerator, model) -> dict:
        return accelerator.get_state_dict(model)  # collective: ZeRO-3's partitions gathered

    def export_parts(self, accelerator, model):
        """ZeRO-3 (without AutoTP, whose slices accelerate consolidates): a module's partitions at a time; ZeRO-1/2
        hold the whole model on every rank."""
        autotp = accelerator.deepspeed_config.get("tensor_parallel", {}).get("autotp_size", 0) > 1
        if model.zero_optimization_stage() == 3 and not autotp:
            from training.core.gather import zero3_parts

            return zero3_parts(accelerator, model)
        return super().export_parts(accelerator, model)

    # ------------------------------------------------------------------ checkpoints

    def muon_refusal(self, strategy: Strategy) -> str | None:
        """The project's Muon reaches DeepSpeed as its client optimizer (`zero_allow_untested_optimizer`, set by the
        resolved JSON): not with an optimizer the JSON defines, or a layout other than the data-parallel partitions in
        order (round-robin gradients, AutoTP, Ulysses)."""
        where = f"--optim muon under {strategy.name} ({strategy.deepspeed_source})"
        ds = strategy.deepspeed or {}
        if "optimizer" in ds:
            kind = ds["optimizer"].get("type", "?")
            return (
                f'{where}: the DeepSpeed JSON defines its own optimizer ({kind}); remove its "optimizer" '
                "section, so the project's Muon is stepped, or drop --optim muon"
            )
        if (ds.get("zero_optimization") or {}).get("round_robin_gradients"):
            return (
                f"{where}: round_robin_gradients reorders the partitions' parameters, which Muon's layout "
                "(training/muon.py's ZeroLayout) does not read; set it to false, or --optim adamw_torch"
            )
        if strategy.tp_size > 1 or strategy.sp_size > 1:
            return (
                f"{where}: AutoTP and Ulysses partition the optimizer over a group other than the data-parallel "
                "ranks, which Muon's gather does not read; drop tensor_parallel/sequence_parallel_size, or "
                "--optim adamw_torch"
            )
        return None

    def muon_layout(self, strategy: Strategy):
        from training.muon import ZeroLayout

        return ZeroLayout(strategy.zero_stage, strategy.world_size)

    def async_refusal(self, strategy: Strategy) -> str | None:
        return (
            f"--save_async under {strategy.name}: DeepSpeed's own background writer (checkpoint.writer.decoupled) "
            "hands its writer process the live state, not a copy, fails under ZeRO-1/2, and its default writer needs "
            "a GPU (docs/checkpoints.md); drop --save_async, or save in the background under DDP or FSDP2"
        )

    def checkpoint_format(self, strategy: Strategy) -> str:
        """The stage and offload decide the files (the offload JSONs hand the schedule to the engine, which saves
        it elsewhere): the strategy itself."""
        return strategy.name

    def converts(self, strategy: Strategy) -> bool:
        return strategy.offload_device != "nvme"  # NVMe's swap files are not converted

    def read_neutral(self, path: Path, state: dict) -> dict:
        """DeepSpeed's universal checkpoint: one folder per parameter with fp32.pt, exp_avg.pt and exp_avg_sq.pt.
        accelerate's save path does not record the `universal_checkpoint_info` DeepSpeed asks for; its defaults (no
        tensor or pipeline parallelism) are what `inject_missing_state` fills in. ZeRO-3's come flat: reshaped."""
        from deepspeed.checkpoint.ds_to_universal import main as ds_to_universal

        from training.checkpoints.safety import safe_load

        if state["run_config"].get("optim") == "muon":  # ds_to_universal reads Adam's moments only
            return read_muon_partitions(path, safe_load)
        tag = (path / "latest").read_text().strip()
        shapes = {name: p.shape for name, p in meta_model(state).named_parameters()}
        with tempfile.TemporaryDirectory() as tmp:
            ds_to_universal(argparse.Namespace(
                input_folder=str(path / tag), output_folder=tmp, num_extract_workers=1, num_merge_workers=1,
                keep_temp_folder=False, strict=True, inject_missing_state=True,
            ))  # fmt: skip
            zero = Path(tmp) / "zero"
            neutral = {"weights": {}, "exp_avg": {}, "exp_avg_sq": {}}
            # A tied weight (lm_head.weight) gets a folder of its own without moments: its parameter is the embedding.
            for folder in sorted(p for p in zero.iterdir() if (p / "exp_avg.pt").is_file()):
                for key, file in (("weights", "fp32"), *((m, m) for m in MOMENTS)):
                    saved = safe_load(folder / f"{file}.pt")
                    saved = saved["param"] if isinstance(saved, dict) else saved
                    neutral[key][folder.name] = saved.float().reshape(shapes[folder.name]).contiguous()
            step_files = sorted(zero.glob("*/step.pt"))
            if step_files:  # ZeRO-1/2: a step per parameter, all equal
                step = safe_load(step_files[0])
            else:  # ZeRO-3: in the common optimizer state
                common = safe_load(zero / "optimizer_state.pt")
                step = common["optimizer_state_dict"]["state"][0]["step"]
        return {"step": int(step), **neutral}

    def load_neutral(self, engine, optimizer, neutral: dict) -> None:
        """ZeRO-3 parameters are set through `GatheredParameters` (rank 0's full value re-partitioned); ZeRO-1/2 keep
        whole parameters on every rank. The fp32 master copy and the moments go through DeepSpeed's setters, each
        rank keeping its partition."""
        from deepspeed import zero
        from deepspeed.utils import safe_set_full_fp32_param, safe_set_full_optimizer_state

        from training.core.wrapped import optimizer_chain

        inner = optimizer_chain(optimizer)[-1]  # the torch (or DeepSpeed CPU) Adam over this rank's fp32 partitions
        init_zero_adam_state(engine.optimizer, inner)
        stage3 = engine.zero_optimization_stage() == 3
        for name, param in engine.module.named_parameters():
            full = neutral["weights"][name]
            with zero.GatheredParameters([param], modifier_rank=0, enabled=stage3):  # collective under ZeRO-3
                param.data.copy_(full.view_as(param).to(param.dtype))
            safe_set_full_fp32_param(param, full)
            for key in state_keys(inner, name):
                safe_set_full_optimizer_state(param, neutral[key][name], key)
        for state in inner.state.values():
            if "step" not in state:  # Muon's matrices count no steps
                continue
            step = state.get("step")
            state["step"] = (
                torch.tensor(float(neutral["step"]), dtype=step.dtype) if torch.is_tensor(step) else neutral["step"]
            )

    def gather_neutral(self, net, optimizer) -> dict:
        """The neutral form of the engine's partitions on every rank (collective per parameter)."""
        from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

        from training.core.wrapped import optimizer_chain

        inner = optimizer_chain(optimizer)[-1]
        neutral = {"step": int(next(s["step"] for s in inner.state.values() if "step" in s)), "weights": {}}
        for name, param in net.module.named_parameters():  # collective per parameter
            neutral["weights"][name] = safe_get_full_fp32_param(param).cpu()
            for key in state_keys(inner, name):
                neutral.setdefault(key, {})[name] = safe_get_full_optimizer_state(param, key).cpu()
        return neutral

    def scheduler_state(self, path: Path) -> dict:
        """accelerate's `scheduler.bin`, or, when the engine owned the scheduler (a JSON that defines the
        optimizer, as the offload configs do), the `lr_scheduler` entry of the engine's model states."""
        from training.checkpoints.safety import safe_load

        if (path / "scheduler.bin").is_file():
            return super().scheduler_state(path)
        tag = (path / "latest").read_text().strip()
        states = sorted((path / tag).glob("*model_states.pt"))
        return safe_load(states[0])["lr_scheduler"]


FAMILY = ZeRO()


# ---------------------------------------------------------------------------------------------- helpers


def ulysses_parallelism_config(strategy: Strategy, env: Environment):
    """The accelerate `ParallelismConfig` that turns Ulysses on in `prepare` for a launch whose degree came from
    the DeepSpeed JSON (no accelerate YAML block): the launch's mesh, sp over consecutive ranks, the rest
    data-parallel. None where the YAML's own block is in force (accelerate reads it) or without sequence
    parallelism (training/axes/ulysses.py)."""
    if strategy.sp_size == 1 or env.block is not None:
        return None
    from accelerate.parallelism_config import ParallelismConfig
    from accelerate.utils import DeepSpeedSequenceParallelConfig

    return ParallelismConfig(
        dp_shard_size=strategy.data_parallel_size, sp_size=strategy.sp_size, sp_backend="deepspeed",
        sp_handler=DeepSpeedSequenceParallelConfig(sp_attn_implementation="sdpa"),
    )  # fmt: skip


@contextmanager
def gathered_whole(module: nn.Module, names: list[str]):
    """ZeRO-3: the partitions gathered while the module is initialised; rank 0's values are kept (collective). The
    draws go into whole fp32 temporaries on the CPU, as a whole model's do, and are copied into the gathered
    parameters: under `zero.Init` those live on the GPU in the run's precision, where the CUDA generator and bf16
    would draw other weights than every other strategy."""
    import deepspeed

    from training.core.build import temporaries

    params = {name: getattr(module, name) for name in names}
    with deepspeed.zero.GatheredParameters(list(params.values()), modifier_rank=0, enabled=bool(params)):
        with temporaries(module, names, torch.float32) as temps:
            yield
        for name, p in params.items():
            p.data.copy_(temps[name])


def init_zero_adam_state(zero_optimizer, inner: torch.optim.Optimizer) -> None:
    """Adam creates its moments at its first step, and this engine has not stepped yet, so DeepSpeed's setters have
    nothing to write into. Created here as Adam would, zero, on the fp32 partitions they are keyed by (ZeRO-3 puts
    its partitions in the optimizer's groups only during the step, so torch's state_dict API cannot create them);
    ZeRO-1/2 then link each parameter to its share of them, as at their first step."""
    flats = (
        getattr(zero_optimizer, "fp32_partitioned_groups_flat", None)  # ZeRO-3's
        or getattr(zero_optimizer, "single_partition_of_fp32_groups", None)  # ZeRO-1/2's
        or zero_optimizer.fp32_groups_flat_partition  # ZeRO-1 in bf16 with fp32 accumulation: BF16_Optimizer's
    )
    groups = getattr(zero_optimizer, "sub_group_to_group_id", None)  # ZeRO-3: a flat per sub-group
    for i, flat in enumerate(flats):
        if inner.state.get(flat):
            continue
        if inner.param_groups[groups[i] if groups else i].get("use_muon"):  # --optim muon's matrices: a momentum
            inner.state[flat] = {"momentum_buffer": torch.zeros_like(flat)}
            continue
        # torch's Adam (and the project's Muon's AdamW) keep the step as a float tensor; DeepSpeed's CPU Adam an int
        step = 0 if type(inner).__module__.startswith("deepspeed") else torch.tensor(0.0)
        inner.state[flat] = {"step": step, **{key: torch.zeros_like(flat) for key in MOMENTS}}
    if hasattr(zero_optimizer, "_lazy_init_hp_params_optimizer_state"):  # ZeRO-1/2
        zero_optimizer._lazy_init_hp_params_optimizer_state()


def state_keys(inner: torch.optim.Optimizer, name: str) -> tuple[str, ...]:
    """The optimizer states a parameter has: Muon's momentum for --optim muon's matrices, else Adam's moments."""
    muon = {n for g in inner.param_groups if g.get("use_muon") for n in g["names"]}
    return ("momentum_buffer",) if name in muon else MOMENTS


def read_muon_partitions(path: Path, safe_load) -> dict:
    """The neutral form of a --optim muon checkpoint, from each rank's optimizer file: its groups carry their
    parameters' names and shapes, which with the stage and the ranks place every matrix in the flat partitions
    (training/muon.py's `ZeroLayout`)."""
    from training.muon import ZeroLayout

    tag = (path / "latest").read_text().strip()
    files = sorted((path / tag).glob("zero_pp_rank_*_mp_rank_00_optim_states.pt"),
                   key=lambda f: int(f.name.split("_")[3]))  # fmt: skip
    ranks = [safe_load(f)["optimizer_state_dict"] for f in files]
    inner = [r.get("base_optimizer_state") or r["optimizer_state_dict"] for r in ranks]
    flats = [r.get("single_partition_of_fp32_groups") or r["fp32_flat_groups"] for r in ranks]
    layout = ZeroLayout(3 if "fp32_flat_groups" in ranks[0] else 1, len(files))
    neutral, step = {"weights": {}}, None
    for g, group in enumerate(inner[0]["param_groups"]):
        kinds = {"weights": [f[g] for f in flats]}
        kinds |= {k: [r["state"][g][k] for r in inner] for k in STATES if k in inner[0]["state"][g]}
        step = inner[0]["state"][g].get("step", step)
        for kind, parts in kinds.items():
            whole = layout.unpartition(group["shapes"], parts)
            neutral.setdefault(kind, {}).update(zip(group["names"], (t.float() for t in whole), strict=True))
    return {"step": int(step), **neutral}


def device(offloaded: bool, to_nvme: bool) -> str:
    return "nvme" if offloaded and to_nvme else "cpu" if offloaded else "none"


def on_nvme_disk(partition: torch.Tensor) -> bool:
    location = getattr(partition, "final_location", None)
    return getattr(location, "value", location) == "nvme"

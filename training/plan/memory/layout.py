"""The model as the memory planner sees it: every parameter's shape on a rank (under AutoTP, its split), the
groups AdamW makes of them, and the `zero_optimization` section of each planned ZeRO strategy: the launch's resolved
JSON, or the one the shipped accelerate config of that strategy launches, its "auto" buckets sized as the training
script sizes them and DeepSpeed's defaults where it leaves a key out (training/deepspeed_config.py).
"""

from __future__ import annotations

import copy
import fnmatch
import functools
import math
from dataclasses import dataclass
from pathlib import Path

import torch

from model import ShardGPTConfig, ShardGPTForCausalLM
from training.adamw import param_groups
from training.deepspeed_config import auto_buckets, cpu_capped, gradient_reduction_dtype, load_json, zero_defaults
from training.paths import ROOT
from training.strategy import Strategy, deepspeed_strategy

# The strategies the planner models, by name (`Strategy.name`); each ZeRO one with the JSON its shipped accelerate
# config launches (`shipped_json`).
STRATEGIES = (
    "ddp", "fsdp", "fsdp-shard-grad-op", "fsdp-offload", "zero1", "zero2", "zero2-offload-cpu", "zero3",
    "zero3-offload-cpu", "zero3-offload-nvme", "zero1-autotp",
)  # fmt: skip
BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
GiB = 2**30


# ---------------------------------------------------------------------------------------------- the model


@dataclass
class Layout:
    """The parameters as the training script builds them: sizes in `named_parameters()` order, the optimizer's
    groups (decay / no decay, indices into `numels`), FSDP's units and the modules ZeRO-3 gathers."""

    config: ShardGPTConfig
    names: list[str]
    numels: list[int]
    rows: list[int]  # dim 0, which FSDP2 shards
    groups: list[list[int]]
    root: list[int]  # the FSDP root unit: parameters outside every decoder layer
    layer_numel: int  # one decoder layer (every layer has the same shape)
    largest_module: int  # the most parameters one module owns (ZeRO-3 gathers module by module)
    muon: frozenset[int] = frozenset()  # --optim muon: the matrices Muon steps (one momentum each, no Adam moments)

    @property
    def psi(self) -> int:
        return sum(self.numels)


_LAYOUTS: dict[tuple[str, bool, int, str], Layout] = {}  # by the config's JSON: the step-time planner asks often


def layout(config: ShardGPTConfig, decay_embeddings: bool = False, tp: int = 1, optim: str = "adamw_torch") -> Layout:
    """The whole model's layout, or with `tp` > 1 one tensor-parallel rank's: its slice of every split weight, under
    the model's `tp_plan` (the decoder's matrices, and the embedding and head by vocabulary rows), which AutoTP and
    the DTensor plan (training/axes/tensor/plan.py) both apply; the norms whole."""
    key = (config.to_json_string(use_diff=False), decay_embeddings, tp, optim)
    if key not in _LAYOUTS:
        _LAYOUTS[key] = _build_layout(config, decay_embeddings, tp, optim)
    return copy.deepcopy(_LAYOUTS[key])


def _build_layout(config: ShardGPTConfig, decay_embeddings: bool, tp: int, optim: str) -> Layout:
    with torch.device("meta"):  # shapes only: no memory, fast for any size
        net = ShardGPTForCausalLM(config)
    named = list(net.named_parameters())  # tied lm_head / embedding listed once, as DeepSpeed and DDP see them
    index = {id(p): i for i, (_, p) in enumerate(named)}
    made = param_groups(net, 0.1, decay_embeddings)
    if optim == "muon":  # the Muon group first, as training/muon.py orders them
        from types import SimpleNamespace

        from training.muon import muon_param_groups

        flags = SimpleNamespace(decay_embeddings=decay_embeddings, learning_rate=1e-3, muon_learning_rate=None,
                                weight_decay=0.1, muon_weight_decay=0.1)  # fmt: skip
        made = muon_param_groups(net, flags)
    groups = [[index[id(p)] for p in g["params"]] for g in made]
    muon = frozenset(index[id(p)] for g in made if g.get("use_muon") for p in g["params"])
    root = [i for i, (name, _) in enumerate(named) if ".layers." not in f".{name}"]
    shapes = [tensor_parallel_shape(name, tuple(p.shape), net.tp_plan, tp) for name, p in named]
    layer = sum(math.prod(s) for (name, _), s in zip(named, shapes, strict=True) if name.startswith("model.layers.0."))
    by_module: dict[str, int] = {}
    for (name, _), shape in zip(named, shapes, strict=True):
        module = name.rpartition(".")[0]
        by_module[module] = by_module.get(module, 0) + math.prod(shape)
    return Layout(
        config, [n for n, _ in named], [math.prod(s) for s in shapes], [s[0] for s in shapes],
        [g for g in groups if g], root, layer, max(by_module.values()), muon,
    )  # fmt: skip


def tensor_parallel_shape(name: str, shape: tuple[int, ...], plan: dict[str, str], tp: int) -> tuple[int, ...]:
    """What one of `tp` ranks holds of parameter `name`: a module of the plan keeps 1/tp of its rows ("colwise",
    the vocabulary-parallel embedding and head) or of its columns ("rowwise"); the rest (the norms) stays whole."""
    module = name.rpartition(".")[0]
    style = next((s for pattern, s in plan.items() if fnmatch.fnmatchcase(module, pattern)), None)
    if tp == 1 or style is None:
        return shape
    dim = 1 if style == "rowwise" else 0
    if shape[dim] % tp:
        raise ValueError(f"{name} has {shape[dim]} {'columns' if dim else 'rows'}, which {tp} ranks cannot split")
    return tuple(n // tp if d == dim else n for d, n in enumerate(shape))


def repo_json(strategy: Strategy) -> dict:
    """The DeepSpeed JSON a ZeRO strategy the planner models launches with (`shipped_json`), as written."""
    return load_json(shipped_json()[strategy.name])


@functools.cache
def shipped_json() -> dict[str, Path]:
    """The DeepSpeed JSON of each single-node DeepSpeed config of accelerate_configs/ without a parallelism block, by
    the name of the strategy it runs (zero2_offload.yaml's ds_configs/zero2_offload.json: `zero2-offload-cpu`): what
    a user launches for that strategy, read from the configs, not kept beside them."""
    import yaml

    found = {}
    for path in sorted((ROOT / "accelerate_configs").glob("*.yaml")):
        launch = yaml.safe_load(path.read_text()) or {}
        file = (launch.get("deepspeed_config") or {}).get("deepspeed_config_file")
        if launch.get("num_machines", 1) == 1 and file and not launch.get("parallelism_config"):
            found.setdefault(deepspeed_strategy(load_json(ROOT / file), 2).name, ROOT / file)
    return found


# ---------------------------------------------------------------------------------------------- DeepSpeed config


def zero_config(strategy: Strategy, config: ShardGPTConfig, world: int, precision: str, micro_batch: int,
                ds_config: dict | None = None, bf16_gradient_reduction: bool = False,
                cpu_ranks: bool = False) -> dict:  # fmt: skip
    """The `zero_optimization` section in force: `ds_config` (the shipped JSON for `strategy` when None) with its
    "auto" buckets sized from the model as the training script sizes them and DeepSpeed's defaults where it leaves a
    key out (training/deepspeed_config.py: `auto_buckets`, `zero_defaults`), plus `grad_accum_bytes`: the bytes per
    element of `data_types.grad_accum_dtype`, in which ZeRO-3 keeps its gradient partitions (the training script sets
    it to fp32, or bf16 under --bf16_gradient_reduction). `world` and `micro_batch` do not change the section."""
    if ds_config is None:  # the shipped JSON, as a launch would resolve it (a launch's own is resolved already)
        ds_config = repo_json(strategy)
        if cpu_ranks:
            zero = ds_config["zero_optimization"]
            zero.update(cpu_capped(zero))
    accum = (ds_config.get("data_types") or {}).get("grad_accum_dtype", "auto")
    if accum == "auto":
        accum = gradient_reduction_dtype(precision == "bf16", bf16_gradient_reduction)
    accum_bytes = {"fp32": 4, "float32": 4, "bf16": 2, "bfloat16": 2, "fp16": 2, "float16": 2}[accum]
    zero = copy.deepcopy(ds_config.get("zero_optimization") or {})
    zero.update(auto_buckets(zero, config.hidden_size))
    return {**zero_defaults(zero), "grad_accum_bytes": accum_bytes}


def offload_device(zero: dict, key: str) -> str:
    return (zero.get(key) or {}).get("device", "none")


def ranks_to_check(strategy: Strategy, world: int) -> list[int]:
    """The data-parallel ranks whose states can differ (ZeRO-1/2 partitions, FSDP2 shards), else rank 0 alone."""
    if (strategy.zero_stage in (1, 2) and not strategy.offloads) or strategy.family == "fsdp":
        return list(range(world)) if world <= 64 else [0, world - 1]  # the differences sit at the ends
    return [0]

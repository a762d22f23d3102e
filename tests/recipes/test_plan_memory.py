"""The memory planner, without launching: formulas, DeepSpeed's partition rules, activations against the
tensors autograd really saves (CPU), DeepSpeed's own estimators, and the command line."""

from __future__ import annotations

import json
import math
from dataclasses import replace

import pytest
import torch

from model import ShardGPTConfig, ShardGPTForCausalLM
from recipes import plan_memory
from training.deepspeed_config import load_json
from training.paths import ROOT
from training.plan.memory import planner as pm
from training.plan.memory.activations import activation_bytes, saved_loss_bytes
from training.plan.memory.layout import Layout, layout, zero_config
from training.plan.memory.stages import in_flight
from training.plan.memory.states import persistent, zero3_groups, zero12_partitions
from training.strategy import Strategy

GB = 1e9
named = Strategy.from_name


def test_paper_formulas_reproduce_the_zero_papers_figure_1():
    """ZeRO paper, figure 1: 7.5B parameters, 64 GPUs, mixed precision Adam: 120, 31.4, 16.6 and 1.9 GB."""
    psi, nd = 7.5e9, 64
    figures = [pm.zero_paper(psi, nd, stage, "bf16") / GB for stage in range(4)]
    assert figures == pytest.approx([120, 31.4, 16.6, 1.875], abs=0.05)
    # fp32 without a master copy: 4 + 4 + 8 bytes, the same 16 psi unsharded, sharded differently
    assert pm.zero_paper(psi, nd, 0, "fp32") == 16 * psi
    assert pm.zero_paper(psi, nd, 1, "fp32") == 8 * psi + 8 * psi / nd
    assert pm.zero_paper(psi, nd, 2, "fp32") == 4 * psi + 12 * psi / nd
    assert pm.zero_paper(psi, nd, 3, "fp32") == 16 * psi / nd


def toy_layout(numels: list[int]) -> Layout:
    config = ShardGPTConfig.from_preset("debug")
    return Layout(config, [f"p{i}" for i in range(len(numels))], numels, numels, [list(range(len(numels)))],
                     [], 0, max(numels))  # fmt: skip


def test_zero12_partitions_keep_every_gradient_that_touches_the_partition_whole():
    # 20 elements on 2 ranks: partitions [0, 10) and [10, 20). The 7-element parameter at [7, 14) touches both.
    lay = toy_layout([7, 7, 6])
    assert zero12_partitions(lay, 2, 0) == [(20, 10, 7 + 7)]
    assert zero12_partitions(lay, 2, 1) == [(20, 10, 7 + 6)]
    # 21 elements on 2 ranks: the flat buffer is padded to 24 (a multiple of 2 x world); the last rank's
    # partition [12, 24) holds 9 real elements and 3 of padding, whose zeros it flattens with its gradients.
    lay = toy_layout([7, 7, 7])
    assert zero12_partitions(lay, 2, 0) == [(24, 12, 14)]
    assert zero12_partitions(lay, 2, 1) == [(24, 12, 14 + 3)]


def saved_activation_bytes(config: ShardGPTConfig, dtype: torch.dtype, batch: int, seq: int) -> int:
    """Bytes of the tensors autograd saves in one forward, each storage once, parameters excluded."""
    torch.manual_seed(0)
    net = ShardGPTForCausalLM(config).to(dtype).train()
    net.config.use_cache = False
    params = {p.untyped_storage().data_ptr() for p in net.parameters()}
    saved: dict[int, int] = {}

    def pack(t):
        s = t.untyped_storage()
        if s.data_ptr() not in params:
            saved[s.data_ptr()] = s.nbytes()
        return t

    x = torch.randint(0, config.vocab_size, (batch, seq))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        net(x, shift_labels=x, num_items_in_batch=batch * seq)
    return sum(saved.values())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("layers", [1, 3])
def test_activation_formula_is_what_autograd_saves(dtype, layers):
    """The per-layer formula e(6h + 2g + 4f) + 8h + 4a + 8, exact on CPU for the debug preset (grouped-query
    attention, SDPA), in fp32 and bf16 weights (DeepSpeed's bf16). On GPUs, flash attention saves the same
    tensors; allocator rounding and kernels' workspaces are not in the formula (still to be measured)."""
    config = ShardGPTConfig.from_preset("debug", num_hidden_layers=layers)
    e = 2 if dtype == torch.bfloat16 else 4
    batch, seq = 2, 48
    expected = activation_bytes(config, batch, seq, e, False) + saved_loss_bytes(config, batch, seq, e)
    assert saved_activation_bytes(config, dtype, batch, seq) == expected


@pytest.mark.slow
@pytest.mark.multiproc
@pytest.mark.skipif(
    not hasattr(torch.utils.checkpoint.SelectiveCheckpointContext(is_recompute=False), "op_output"),
    reason="the policy's view of an op's output (SelectiveCheckpointContext.op_output) is torch 2.13's",
)
@pytest.mark.parametrize(("tp", "sequence_parallel"), [(1, False), (2, True), (2, False)])
def test_selective_recomputation_keeps_what_the_per_op_policy_saves(tp, sequence_parallel):
    """Each decoder layer under torch's selective activation checkpointing with torchtitan's per-op policy keeps, per
    token and on each rank, the planner's selective count: the layer's input, q, v, gate and down's outputs,
    attention's output and log-sum-exp, e (4h + g + f) + 4a for the `debug` preset in fp32 (not the norms' outputs
    nor k, which it recomputes); split by the model's plan over 2 ranks, q, v, gate and attention's over tp, down's
    output whole (its partial sum before the reduction) and, under sequence parallelism, the input a sequence shard
    and the two reduce-scatters' outputs kept."""
    from training.measure.tensor_memory import measure

    row = measure(tp, sequence_parallel, "debug", 2, 64, selective=True)
    assert row["per_token"] == row["selective_per_token"], row
    assert len(set(row["layer_bytes_per_rank"][0])) == 1 and len({r[-1] for r in row["layer_bytes_per_rank"]}) == 1
    if tp == 1:
        config = ShardGPTConfig.from_preset("debug")
        h, f, a, g = (config.hidden_size, config.intermediate_size, config.num_attention_heads,
                      config.num_key_value_heads * config.head_dim)  # fmt: skip
        assert row["per_token"] == 4 * (4 * h + g + f) + 4 * a


@pytest.mark.slow
def test_the_whole_logits_loss_saves_its_log_probabilities_eager_and_its_logits_compiled():
    """A cross-entropy on the whole bf16 logits upcast to fp32 (torchtitan's): eager it saves the fp32
    log-probabilities, 4 bytes an entry; compiled (inductor fuses the upcast and the softmax) the bf16 logits
    themselves, 2, and a log-sum-exp a token. With the logits and their gradient: the planner's (e + 8) and 2e."""
    from training.measure.saved import HeldBytes
    from training.plan.memory.activations import whole_logits_bytes

    def loss(pred, labels):
        return torch.nn.functional.cross_entropy(pred.flatten(0, 1).float(), labels.flatten(0, 1))

    tokens, vocab = 256, 1000
    saved = {}
    for name, fn in (("eager", loss), ("compiled", torch.compile(loss))):
        pred = torch.randn(1, tokens, vocab, dtype=torch.bfloat16, requires_grad=True)
        held = HeldBytes()
        with held.saving():
            out = fn(pred, torch.randint(0, vocab, (1, tokens)))  # its graph holds the saved tensors
        saved[name] = held.now
        del out
    assert saved["eager"] // (tokens * vocab) == 4 and saved["compiled"] // (tokens * vocab) == 2, saved
    config = ShardGPTConfig.from_preset("debug", vocab_size=vocab)
    per_entry = {c: whole_logits_bytes(config, 1, tokens, 2, c) // (tokens * vocab) for c in (False, True)}
    assert per_entry == {False: 2 + 4 + 4, True: 2 + 2}  # the logits, what is saved, the gradient


def test_activation_checkpointing_keeps_one_input_per_layer():
    config = ShardGPTConfig.from_preset("llama-1b")
    full = activation_bytes(config, 1, 2048, 2, False)
    ckpt = activation_bytes(config, 1, 2048, 2, True)
    layer = 2 * (6 * 2048 + 2 * 8 * 64 + 4 * 8192) + 8 * 2048 + 4 * 32 + 8  # 8 key/value heads of 64
    assert full - ckpt == 2048 * (config.num_hidden_layers - 1) * layer - 2048 * config.num_hidden_layers * 2 * 2048


def test_predict_every_strategy():
    config = ShardGPTConfig.from_preset("llama-1b")
    preds = {s: pm.predict(config, named(s, 8), "bf16", 1, 2048) for s in pm.STRATEGIES}
    for s, p in preds.items():
        parts = ("params", "grads", "optimizer_states", "activations", "logits", "temporary")
        assert p["total"] == sum(p[k] for k in parts), s
        assert p["model_states"] == p["params"] + p["grads"] + p["optimizer_states"]
    ms = {s: p["model_states"] for s, p in preds.items()}
    assert ms["zero3"] < ms["zero2"] < ms["zero1"] < ms["ddp"]
    psi = preds["ddp"]["inputs"]["psi"]
    tensors = len(layout(config).numels)  # 146: embedding, 16 x 9 per layer, final norm
    assert ms["ddp"] == 20 * psi + 4 * tensors  # + DDP's buckets, + a 4-byte Adam step counter per tensor
    assert ms["fsdp"] == pytest.approx(16 * psi / 8, rel=1e-6)
    # Offload moves model states to the host (and to NVMe), not to nothing; ZeRO-3 keeps its persistent
    # small parameters (the RMSNorm weights) on the GPU.
    norms = 2 * (2 * config.num_hidden_layers + 1) * config.hidden_size
    assert preds["fsdp-offload"]["model_states"] == 0
    for s in ("fsdp-offload", "zero3-offload-cpu", "zero3-offload-nvme"):
        assert preds[s]["model_states"] == (0 if s.startswith("fsdp") else norms) and preds[s]["host_ram"] > 0
    # The bf16 weights stay, with the flat gradient partition the offload path reduces into (fp32: Ψ/N x 4).
    offload = preds["zero2-offload-cpu"]
    assert offload["model_states"] == preds["zero2"]["params"] + offload["grads"]
    assert offload["grads"] == pytest.approx(4 * psi / 8, rel=1e-6)
    assert preds["zero3-offload-nvme"]["nvme"] > 16 * psi / 8
    # The chunked loss: the saved gradients of the hidden states and of the head, one chunk's logits in fp32
    # and bf16, one chunk's weight-gradient product; far below the 12 bytes per token and vocabulary entry of
    # full fp32 logits, log-probabilities and their gradients.
    v, h = config.vocab_size, config.hidden_size
    assert preds["zero3"]["logits"] == 2 * 2048 * h + 4 * v * h + 6 * 1024 * v + 2 * v * h
    assert preds["zero3"]["logits"] < 12 * 2048 * v


def test_predict_matches_deepspeeds_estimators():
    """DeepSpeed's own estimates for ZeRO-2 and ZeRO-3 (no offload), llama-1b on 8 GPUs: 2 psi + 18 psi / Nd
    and 4 x largest layer + 18 psi / Nd. The planner's parameters and optimizer states are DeepSpeed's, exactly.
    Overall they differ by what the estimates leave out (docs/memory.md): ZeRO-2 within 10% (measured 8.1%);
    ZeRO-3 within 20% (measured 16.8%: the planner adds the step's fp32 copy of a sub-group's gradients and sizes
    the gathered parameters as the largest module plus the prefetch bucket, where DeepSpeed's estimate takes 4 x
    the largest layer). The planner itself is held to measured memory in tests/recipes/test_memory.py."""
    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs
    from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs

    config = ShardGPTConfig.from_preset("llama-1b")
    lay = layout(config)
    psi = lay.psi
    z2 = pm.predict(config, named("zero2", 8), "bf16", 1, 2048)
    _, ds_z2 = estimate_zero2_model_states_mem_needs(psi, 8, 1, cpu_offload=False)
    assert z2["params"] == 2 * psi  # the flat bf16 buffer: psi is a multiple of 16 here, no padding
    assert z2["optimizer_states"] == 12 * psi / 8 + 4 * 2  # fp32 master, exp_avg, exp_avg_sq; step counters
    ours = z2["model_states"] + z2["detail"]["gpu:buffers.fp32_grad_partition"]
    assert ours == pytest.approx(ds_z2, rel=0.10)
    _, ds_z3, _ = estimate_zero3_model_states_mem_needs(psi, lay.largest_module, 8, 1, cpu_offload=False,
                                                        cpu_offload_params=False)  # fmt: skip
    # DeepSpeed's estimate counts the gradient partitions in the model's dtype (its default grad_accum_dtype).
    ds = load_json(ROOT / "ds_configs" / "zero3.json")
    ds["data_types"]["grad_accum_dtype"] = "bf16"
    # DeepSpeed's estimate leaves its buckets out: the comparison holds them at 1e7 elements, as measured.
    ds["zero_optimization"].update(reduce_bucket_size=10_000_000, stage3_prefetch_bucket_size=10_000_000)
    z3 = pm.predict(config, named("zero3", 8), "bf16", 1, 2048, ds_config=ds)
    assert z3["model_states"] + z3["temporary"] == pytest.approx(ds_z3, rel=0.20)
    # Offloaded: the GPU keeps the bf16 weights (ZeRO-2) or only what is gathered (ZeRO-3).
    _, ds_z2_off = estimate_zero2_model_states_mem_needs(psi, 8, 1, cpu_offload=True)
    assert pm.predict(config, named("zero2-offload-cpu", 8), "bf16")["params"] == ds_z2_off  # + the gradient partition


def test_zero3_persistence_and_sub_groups_follow_the_json():
    config = ShardGPTConfig.from_preset("gpt2-124m")
    lay = layout(config)
    zero = zero_config(named("zero3"), config, 8, "bf16", 1)
    shipped = json.loads((ROOT / "ds_configs" / "zero3.json").read_text())["zero_optimization"]
    assert zero["stage3_param_persistence_threshold"] == 10 * config.hidden_size  # "auto" resolved as training
    for key in ("reduce_bucket_size", "stage3_prefetch_bucket_size"):
        assert zero[key] == shipped[key]  # GPU-sized in the JSON; the planner plans GPUs, uncapped
    norms = (2 * config.num_hidden_layers + 1) * config.hidden_size
    assert sum(lay.numels[i] for i in persistent(lay, zero)) == norms
    assert len(zero3_groups(lay, 8, zero["sub_group_size"])) == 2  # decay, no decay
    assert len(zero3_groups(lay, 1, 10_000_000)) > 2  # small sub_group_size: the groups split


def test_rank_figures_differ_only_where_deepspeed_splits():
    config = ShardGPTConfig.from_preset("tiny")
    ranks = [pm.predict(config, named("zero2", 2), "fp32", rank=r)["grads"] for r in (0, 1)]
    assert ranks[0] != ranks[1]
    assert pm.predict(config, named("zero2", 2), "fp32")["grads"] == max(ranks)


def test_command_line_table(capsys):
    plan_memory.main(["--preset", "gpt2-350m", "--num_gpus", "8", "--strategy", "all", "--gpu_memory_gb", "16",
             "--seq_len", "1024", "--micro_batch", "4"])  # fmt: skip
    out = capsys.readouterr().out
    assert "gpt2-350m" in out and "fits 16 GiB" in out
    assert all(f"\n{s} |" in out for s in pm.STRATEGIES)
    assert "| yes" in out


def test_command_line_overrides_and_json(capsys):
    import json

    plan_memory.main(["--preset", "llama-1b", "--hidden_size", "1024", "--num_attention_heads", "16", "--strategy",
             "zero2-offload", "--num_gpus", "4", "--json"])  # fmt: skip
    out = json.loads(capsys.readouterr().out)
    assert out["inputs"]["strategy"] == "zero2-offload-cpu"  # the device an -offload leaves out is CPU
    expected = ShardGPTConfig.from_preset("llama-1b", hidden_size=1024, num_attention_heads=16)
    assert out["inputs"]["psi"] == layout(expected).psi
    assert math.isclose(out["host_ram_at_start"], 4 * out["inputs"]["psi"])


def test_bad_input_is_one_line(capsys):
    with pytest.raises(SystemExit) as e:
        plan_memory.main(["--strategy", "zero4"])
    assert e.value.code == 2
    assert "zero4" in capsys.readouterr().err


def test_zero3_and_fsdp_build_partitioned_at_start():
    """Under zero.Init and FSDP2's meta-device build a rank holds its fp32 partition and the module being built;
    under DDP, the whole model."""
    config = ShardGPTConfig.from_preset("llama-1b")
    lay = layout(config)
    for strategy in ("zero3", "fsdp"):
        built = pm.predict(config, named(strategy, 8))["host_ram_at_start"]
        assert built == 4 * (math.ceil(lay.psi / 8) + lay.largest_module)
    assert pm.predict(config, named("ddp", 8))["host_ram_at_start"] == 4 * lay.psi


def test_autotp_splits_the_planned_matrices_and_shards_adam_over_data_parallel_ranks():
    """zero1-autotp (ds_configs/autotp.json, tensor-parallel size 2) on 8 GPUs: a rank holds half of every matrix
    of the plan (and of the tied embedding), the whole norms, and ZeRO-1's quarter of the fp32 master copy and of
    Adam's moments over the 4 data-parallel ranks (measured to the byte on CPU ranks: tests/recipes/test_memory.py)."""
    config = ShardGPTConfig.from_preset("llama-1b")
    psi = layout(config).psi
    norms = (2 * config.num_hidden_layers + 1) * config.hidden_size
    local = (psi - norms) // 2 + norms
    assert layout(config, tp=2).psi == local
    pred = pm.predict(config, named("zero1-autotp", 8), "bf16")
    assert pred["inputs"]["tensor_parallel_size"] == 2 and pred["inputs"]["psi"] == psi
    assert pred["model_states"] == 2 * local + 2 * local + (4 + 8) * local // 4 + 4 * 2
    assert pred["model_states"] < pm.predict(config, named("zero1", 8), "bf16")["model_states"]
    with pytest.raises(ValueError, match="tensor_parallel.autotp_size = 2 does not divide the 3 launched ranks"):
        pm.predict(config, named("zero1-autotp", 3))


def test_zero3_gradient_partitions_follow_grad_accum_dtype_and_nvme_keeps_max_in_cpu_in_host():
    """ZeRO-3 keeps its gradient partitions in data_types.grad_accum_dtype: fp32 as the training script sets it,
    bf16 under --bf16_gradient_reduction. With parameters on NVMe, offload_param.max_in_cpu elements of the
    partition stay in host memory."""
    config = ShardGPTConfig.from_preset("gpt2-124m")
    part = sum(math.ceil(n / 2) for n in layout(config).numels)
    assert pm.predict(config, named("zero3", 2), "bf16")["detail"]["gpu:grads.grad_partitions"] == 4 * part
    ds = load_json(ROOT / "ds_configs" / "zero3.json")
    ds["data_types"]["grad_accum_dtype"] = "auto"
    for low, size in ((False, 4), (True, 2)):
        detail = pm.predict(config, named("zero3", 2), "bf16", ds_config=ds, bf16_gradient_reduction=low)["detail"]
        assert detail["gpu:grads.grad_partitions"] == size * part
    ds = load_json(ROOT / "ds_configs" / "zero3_offload_nvme.json")
    ds["zero_optimization"]["offload_param"]["max_in_cpu"] = 10**7
    detail = pm.predict(config, named("zero3-offload-nvme", 2), "bf16", ds_config=ds)["detail"]
    assert detail["host:params.partitions_in_cpu"] == 2 * 10**7
    assert detail["nvme:params.partitions"] == 2 * (part - 10**7)


def test_command_line_largest(capsys):
    plan_memory.main(["--largest", "--strategy", "zero3", "--num_gpus", "2", "--seq_len", "128", "--vocab_size",
                      "8192", "--host_memory_gb", "12", "--activation_checkpointing"])  # fmt: skip
    out = capsys.readouterr().out
    assert "host RAM 12.0 GiB" in out
    assert "zero3: --preset llama-1b --config_overrides num_hidden_layers=" in out


def test_zero3_with_parameters_on_nvme_builds_into_the_swap_buffers():
    """zero.Init swaps each partition out as it is built: at start a rank holds the parameter swap buffers, the
    max_in_cpu share and the fp32 module being built, not its fp32 partition."""
    config = ShardGPTConfig.from_preset("llama-3b", vocab_size=8192)
    ds = load_json(ROOT / "ds_configs" / "zero3_offload_nvme_small_host.json")
    swap = ds["zero_optimization"]["offload_param"]
    assert swap["max_in_cpu"] == 0
    built = pm.predict(config, named("zero3-offload-nvme", 2), "bf16", ds_config=ds)["host_ram_at_start"]
    assert built == 4 * layout(config).largest_module + 2 * swap["buffer_count"] * swap["buffer_size"]


def test_unfused_adam_holds_two_fp32_temporaries_of_the_largest_tensor_it_steps():
    """CPU ranks step torch's unfused AdamW: two fp32 temporaries the size of the largest tensor it steps at once
    (a parameter under DDP, a ZeRO-3 sub-group); none for DeepSpeed's in-place CPU Adam."""
    config = ShardGPTConfig.from_preset("gpt2-124m")
    lay = layout(config)

    def extra(strategy: str) -> int:  # what CPU ranks add for AdamW (they also cap the JSON's buckets)
        detail = pm.predict(config, named(strategy, 2), "bf16", cpu_ranks=True)["detail"]
        assert "gpu:buffers.adam_temporaries" not in pm.predict(config, named(strategy, 2), "bf16")["detail"]
        return detail.get("gpu:buffers.adam_temporaries", 0)  # none under DeepSpeed's in-place CPU Adam

    assert extra("ddp") == 8 * max(lay.numels)
    zero = zero_config(named("zero3"), config, 2, "bf16", 1)
    assert extra("zero3") == 8 * max(zero3_groups(lay, 2, zero["sub_group_size"]))
    assert extra("zero3-offload-cpu") == 0


def test_zero2_offload_keeps_a_gradient_partition_on_the_device_in_the_accumulation_dtype():
    """Measured with recipes/measure/measure_memory.py (llama-1b with 2 layers, 2 ranks, bf16): besides the host's fp32
    gradient partition, DeepSpeed's offload path reduces into a flat partition in data_types.grad_accum_dtype on
    the device (`averaged_gradients`), fp32 as the training script sets it."""
    config = ShardGPTConfig.from_preset("llama-1b", vocab_size=8192, num_hidden_layers=2)
    part = sum(p for _, p, _ in zero12_partitions(layout(config), 2, 0))
    detail = pm.predict(config, named("zero2-offload-cpu", 2), "bf16")["detail"]
    assert detail["gpu:grads.averaged_gradients"] == 4 * part == detail["host:grads.fp32_partition.grad"]


def pipeline(name: str, world: int, pp: int, schedule: str = "1F1B") -> Strategy:
    return replace(named(name, world).with_degrees(pp=pp), pp_schedule=schedule)


def test_pipeline_stages_hold_their_layers_and_the_tied_embedding_on_the_first_and_last():
    """llama-1b in 4 stages of 4 layers on 8 GPUs: the first stage holds the embedding, the last the norm and a copy
    of the tied embedding as its head; each stage's states whole per rank (ddp) or halved over its 2 ranks (fsdp)."""
    config = ShardGPTConfig.from_preset("llama-1b")
    lay = layout(config)
    embedding, norm = config.vocab_size * config.hidden_size, config.hidden_size
    stages = pm.predict(config, pipeline("ddp", 8, 4), "bf16", micro_batches=8)["stages"]
    psi = [s["inputs"]["stage_psi"] for s in stages]
    assert psi == [embedding + 4 * lay.layer_numel, 4 * lay.layer_numel, 4 * lay.layer_numel,
                   4 * lay.layer_numel + norm + embedding]  # fmt: skip
    assert sum(psi) == lay.psi + embedding  # the tied weight twice
    for stage, n in zip(stages, psi, strict=True):
        assert stage["params"] == stage["grads"] == 4 * n
        assert stage["detail"]["gpu:buffers.gradient_all_reduce"] == 4 * n  # 2 pipelines average their gradients
    sharded = pm.predict(config, pipeline("fsdp", 8, 4), "bf16", micro_batches=8)["stages"]
    assert [s["params"] for s in sharded] == [2 * n for n in psi]  # every row count here is even
    # torch's pipelining syncs FSDP2's gradients after the last backward only: by then the stage is gathered (bf16)
    # and its gradients accumulated whole in fp32, the reduce dtype (FSDP2's unsharded_accumulated_grad)
    for stage, n in zip(sharded, psi, strict=True):
        assert stage["detail"]["gpu:buffers.unsharded_params"] == 2 * n
        assert stage["detail"]["gpu:buffers.unsharded_accumulated_grads"] == 4 * n
    assert all(s["logits"] == 0 for s in stages[:-1]) and stages[-1]["logits"] > 0


def test_gpipe_holds_every_micro_batch_and_1f1b_at_most_the_stages_after():
    """GPipe's activations grow with M on every stage; 1F1B's stop at min(M, P - s) micro batches on stage s."""
    config = ShardGPTConfig.from_preset("tiny", num_hidden_layers=4)

    def held(schedule: str, m: int) -> list[int]:
        stages = pm.predict(config, pipeline("ddp", 4, 4, schedule), "fp32", 1, 128, micro_batches=m)["stages"]
        return [s["held_for_backward"] for s in stages]

    assert [in_flight("1F1B", 4, 8, s) for s in range(4)] == [4, 3, 2, 1]
    assert [in_flight("GPipe", 4, 8, s) for s in range(4)] == [8] * 4
    assert held("1F1B", 4)[1:] == held("1F1B", 16)[1:]  # the first stage's token ids grow with the step
    assert all(g8 > g4 for g4, g8 in zip(held("GPipe", 4), held("GPipe", 8), strict=True))
    assert all(gpipe > ours for gpipe, ours in zip(held("GPipe", 8), held("1F1B", 8), strict=True))
    with pytest.raises(ValueError, match="fewer micro batches than the 4 stages of 1F1B"):
        held("1F1B", 2)
    with pytest.raises(ValueError, match="does not model zero2-pp2"):
        pm.predict(config, pipeline("zero2", 2, 2), micro_batches=2)


def test_command_line_pipeline(capsys):
    flags = ["--preset", "llama-1b", "--num_gpus", "8", "--pipeline_parallel_degree", "4",
             "--pipeline_parallel_schedule", "GPipe", "--gradient_accumulation_steps", "8"]  # fmt: skip
    plan_memory.main(flags)
    out = capsys.readouterr().out
    assert "pipeline: 4 stages, GPipe, 8 micro batches a step" in out
    assert all(f"\n{s}-pp4 stage {i} |" in out for s in ("ddp", "fsdp") for i in range(4))
    plan_memory.main([*flags, "--strategy", "fsdp", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert [s["inputs"]["stage"] for s in out["stages"]] == [0, 1, 2, 3]
    assert out["total"] == max(s["total"] for s in out["stages"])
    with pytest.raises(SystemExit) as e:  # 1F1B needs a micro batch per stage: one line, the fix named
        plan_memory.main([*flags[:7], "1F1B", "--gradient_accumulation_steps", "3"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "pass --gradient_accumulation_steps 4 or more" in err and err.count("\n") == 1


@pytest.mark.slow
@pytest.mark.multiproc
def test_ulysses_activations_are_what_each_rank_holds():
    """Under Ulysses (sp 2, DeepSpeed's attention registered as training registers it) each rank holds what the
    planner plans for seq_len / sp positions: measured within 1e-5 here (recipes/measure/sequence_memory.py, the
    docs' table: within 0.2 % at micro batch 1), and about half of one process's."""
    from training.measure.ulysses import measure

    one, split = measure(1, "debug", 2, 128), measure(2, "debug", 2, 128)
    for row in (one, split):
        assert abs(row["error"]) < 1e-5, row
    assert split["held_per_rank"][0] == split["held_per_rank"][1]
    assert 0.5 < split["held_bytes"] / one["held_bytes"] < 0.56, (split, one)


@pytest.mark.slow
@pytest.mark.multiproc
@pytest.mark.matrix
@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_tensor_parallel_activations_are_what_each_layer_saves(sequence_parallel):
    """At tp 2 (the model's plan, and Megatron's sequence parallelism as FSDP2 x TP runs it) each decoder layer saves
    what `layer_activation_bytes` says, to the byte, on both ranks; the most a rank holds for its backward is the
    planner's activations and loss within the forward's scalars. Under sequence parallelism the column-split
    projections keep their input's sequence shard and gather it again in the backward (Megatron-LM's layout), so a
    layer saves Korthikanti et al.'s all-over-tp, less than torch's styles (which keep the gathered input whole): a
    planner that counted those would miss here."""
    from training.measure.tensor_memory import measure

    row = measure(2, sequence_parallel, "debug", 2, 64)
    assert row["per_token"] == row["planned_per_token"], row
    assert row["layer_bytes_per_rank"][0] == row["layer_bytes_per_rank"][1], row
    assert 0 <= row["peak_bytes"] - row["planned_peak_bytes"] <= 64, row
    assert (row["gathered_per_token"] > row["planned_per_token"]) == sequence_parallel, row

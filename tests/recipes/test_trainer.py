"""recipes/trainer.py (the HF Trainer's loop) trains exactly the model recipes/train.py trains.

Each case launches both scripts with the same launcher and flags and compares every step's loss, gradient norm
(before clipping) and learning rate, the evaluations, the strategy in force, the DeepSpeed config and the exported
weights. Tolerance: both paths run the same float operations in the same order (the Trainer's extra multiply and
divide by the world size are exact for powers of two), and every measured difference on 2 CPU cores was 0
(bit-identical, `pytest tests/recipes/test_trainer.py`, 12 steps). The tests allow 1e-6 relative (a few fp32 ulps,
for a last-bit difference on other kernels); a wrong normalisation (losses or gradients off by the accumulation or
world size, micro batches weighted instead of tokens) moves them by far more. Gradient norms are compared too:
under Adam and clipping a constant gradient scale would leave the losses almost unchanged.
"""

from __future__ import annotations

import json

import pytest
import torch
from communication import SCALARS
from hub import assert_loads_as_the_hub_does
from launching import launch, launcher_command
from parity import cell_args, cell_run
from transformers import AutoModelForCausalLM

from training.deepspeed_config import cpu_capped

STEPS = 12
TRAIN = [
    "--preset=debug", f"--max_steps={STEPS}", "--warmup_steps=2", "--learning_rate=3e-3", "--logging_steps=1",
    "--eval_steps=6", "--max_eval_batches=4", "--save_steps=0", "--sample_max_new_tokens=0",
]  # fmt: skip
RTOL = 1e-6
# Keys the Trainer adds to the DeepSpeed config: the optimizer is ours (not a DeepSpeed one), and its logging.
TRAINER_DS_KEYS = {"zero_allow_untested_optimizer", "steps_per_print"}

CASES = [
    # One process, 2 micro batches of 4 per step: accumulation.
    pytest.param("python", None, ["--per_device_train_batch_size=4", "--gradient_accumulation_steps=2"], id="python"),
    # 2 ranks x 2 micro batches of 2: accumulation across ranks, ZeRO-2 under torchrun and ZeRO-3 (parameters sharded)
    # under the deepspeed launcher. recipes/train.py's half is tests/recipes/parity.py's cell (20 steps, evaluation
    # every 10); the Trainer's launch takes its flags.
    pytest.param("torchrun", "zero2", None, id="torchrun-zero2", marks=pytest.mark.multiproc),
    pytest.param("deepspeed", "zero3", None, id="deepspeed-zero3", marks=pytest.mark.multiproc),
    # DeepSpeed AutoTP: both ranks split every layer and train on the same micro batches of 4 (2 accumulated).
    pytest.param(
        "deepspeed", "autotp", ["--per_device_train_batch_size=4", "--gradient_accumulation_steps=2"],
        id="deepspeed-autotp", marks=[pytest.mark.multiproc, pytest.mark.matrix],
    ),
]  # fmt: skip


def by_step(run, key: str) -> dict[int, float]:
    return {r["step"]: r[key] for r in run.records if key in r}


@pytest.mark.slow
@pytest.mark.parametrize(("launcher", "config", "split"), CASES)
def test_trainer_trains_what_train_py_trains(launcher, config, split, corpus, tmp_path, tmp_path_factory):
    if split is None:  # recipes/train.py's half: the parity cell
        ref = cell_run(launcher, config, corpus, tmp_path_factory)
        args = cell_args(launcher, config, corpus, tmp_path)
    else:
        args = [*corpus["flags"], *TRAIN, *split]
        if config:
            args.append(f"--deepspeed=ds_configs/{config}.json")
        ref = launch(launcher_command(launcher, script="train.py"), args, tmp_path / "train")
    # One process: the Trainer's run also records --profile's trace (its callback), which must change no loss.
    profile = ["--profile", "--profile_steps=2-3"] if launcher == "python" else []
    run = launch(launcher_command(launcher, script="trainer.py"), [*args, *profile], tmp_path / "trainer")
    if profile:
        assert len(list((run.output_dir / "profile" / "rank0").glob("rank0.*.pt.trace.json"))) == 1
        assert "profile of steps 2-3 (rank 0, top ops by self time)" in run.stdout

    # Both write the same records, for every step.
    assert sorted(run.losses) == sorted(ref.losses) == list(range(1, max(ref.losses) + 1))
    assert run.records[0].keys() == ref.records[0].keys()
    # The same strategy in force, and the same collectives in the counted step (the third; the fourth where --profile
    # records the second and third): what each rank sent, kind by kind, to the byte, but for the scalars'
    # all-reduces (the script reduces the step's loss in the step, the Trainer when it logs).
    seen, seen_there = run.strategy, ref.strategy  # each read of .strategy loads the file
    ours, theirs = seen.pop("communication"), seen_there.pop("communication")
    assert seen == seen_there
    assert (ours["step"], theirs["step"]) == (4 if profile else 3, 3) and ours["world_size"] == theirs["world_size"]
    for mine, other in zip(ours["per_rank"], theirs["per_rank"], strict=True):
        sent, sent_there = ({k: c["payload_bytes"] for k, c in r["kinds"].items()} for r in (mine, other))
        scalars = sent.pop("all_reduce", 0) - sent_there.pop("all_reduce", 0)
        assert sent == sent_there and abs(scalars) <= SCALARS, (mine, other)

    # The same training: per-step loss, gradient norm, learning rate (after the step), evaluations.
    for key in ("loss", "grad_norm", "lr", "eval_loss"):
        ours, theirs = by_step(run, key), by_step(ref, key)
        assert ours.keys() == theirs.keys(), key
        for step, value in theirs.items():
            assert ours[step] == pytest.approx(value, rel=RTOL), f"{key} at step {step}"

    # The DeepSpeed JSON as the Trainer resolved it equals recipes/train.py's resolution of it.
    if config:
        ds_ref, ds_run = (json.loads((r.output_dir / "ds_config.json").read_text()) for r in (ref, run))
        # Under AutoTP the Trainer calls deepspeed.tp_model_init, which records its tp_size in the config it was
        # given (deepspeed/runtime/tensor_parallel/init_utils.py): the same size, written twice.
        assert ds_run.get("tensor_parallel", {}).pop("tp", {"tp_size": 2}) == {"tp_size": 2}
        if not torch.cuda.is_available():  # CPU ranks: the training script caps the JSON's GPU-sized buckets
            ds_run["zero_optimization"].update(cpu_capped(ds_run["zero_optimization"]))  # the Trainer's are as shipped
        assert {k: v for k, v in ds_run.items() if k not in TRAINER_DS_KEYS} == {
            k: v for k, v in ds_ref.items() if k not in TRAINER_DS_KEYS
        }

    # The exports are the same model, and the Trainer's loads as users load it (its save_model writes the model's
    # own code: model/export.py).
    assert_loads_as_the_hub_does(run.output_dir, ref.output_dir, atol=1e-5)
    ours = AutoModelForCausalLM.from_pretrained(run.output_dir, trust_remote_code=True).state_dict()
    theirs = AutoModelForCausalLM.from_pretrained(ref.output_dir, trust_remote_code=True).state_dict()
    assert ours.keys() == theirs.keys()
    for name, tensor in ours.items():
        torch.testing.assert_close(tensor, theirs[name], rtol=1e-5, atol=1e-7, msg=name)


def test_micro_batches_are_weighted_by_tokens(tmp_path):
    """Micro batches with different numbers of targets: the gradient of one optimizer step is that of the token
    mean over all of them (the packed blocks of the launches above have no ignored targets, so this checks it)."""
    from accelerate.state import AcceleratorState
    from transformers import TrainingArguments

    from model import ShardGPTConfig, ShardGPTForCausalLM
    from training.config import RunConfig
    from training.loop.hf_trainer import ShardGPTTrainer
    from training.strategy import Strategy

    torch.manual_seed(0)
    net = ShardGPTForCausalLM(ShardGPTConfig.from_preset("debug"))
    reference = ShardGPTForCausalLM(net.config)
    reference.load_state_dict(net.state_dict())
    ids = torch.randint(0, net.config.vocab_size, (4, 17))
    inputs, labels = ids[:, :-1], ids[:, 1:].clone()
    labels[2:, 4:] = -100  # the second micro batch has a quarter of the first one's targets
    micro = [{"input_ids": inputs[i : i + 2], "shift_labels": labels[i : i + 2]} for i in (0, 2)]
    args = TrainingArguments(
        output_dir=str(tmp_path), per_device_train_batch_size=2, gradient_accumulation_steps=2, report_to="none"
    )
    cfg = RunConfig(output_dir=str(tmp_path), per_device_train_batch_size=2, gradient_accumulation_steps=2)
    try:
        trainer = ShardGPTTrainer(model=net, args=args, run_config=cfg, strategy=Strategy("single"), fused_adamw=False)
        batches, count = trainer.get_batch_samples(iter(micro), 2, torch.device("cpu"))
        assert count.item() == (labels != -100).sum().item() == 2 * 16 + 2 * 4
        loss = sum(trainer.training_step(net, batch, count) for batch in batches)
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)

    expected = reference(input_ids=inputs, shift_labels=labels).loss  # mean over every target of the step
    expected.backward()
    torch.testing.assert_close(loss, expected.detach())
    for (name, p), q in zip(net.named_parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, msg=name)

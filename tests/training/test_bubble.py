"""The bubble measurement (training/measure/bubble.py) on 2 fixed-cost stages: what the schedules hold is exact, and a
step can only be longer than the papers' (M + P - 1) x (forward + backward). The bubble's size against
(P - 1) / (M + P - 1) is a measured number: recipes/measure/pipeline_bubble.py prints it (docs/strategies.md).
On the model's own 2 stages, the bytes each holds for its backward are the memory planner's, to the byte."""

from __future__ import annotations

import pytest

from training.measure.bubble import measure, summarize, theory


@pytest.mark.slow
@pytest.mark.multiproc
def test_gpipe_holds_every_micro_batch_and_1f1b_at_most_one_per_stage():
    seconds, m, pp = 0.01, 4, 2
    rows = {r["schedule"]: r for r in summarize(measure(pp, [("GPipe", m), ("1F1B", m)], seconds, steps=1))}
    assert rows["GPipe"]["peak_micro_batches_held"] == m
    assert rows["1F1B"]["peak_micro_batches_held"] == pp
    for row in rows.values():
        assert row["step_seconds"] >= (m + pp - 1) * 3 * seconds  # sleeps never end early
        assert row["bubble"] >= theory(pp, m) > 0


@pytest.mark.slow
@pytest.mark.multiproc
def test_interleaved_1f1b_holds_its_warm_up_and_one_more_on_each_rank():
    """torch's Interleaved1F1B, two fixed-cost stages a rank on 2 and 4 ranks: the most stage-micro-batches each rank
    holds at once is the planner's count (warm-up forwards, then one more; every one of them where the micro batches
    are no more than the ranks), which the step-time planner's interleaved memory takes."""
    from training.plan.memory.stages import interleaved_in_flight

    for pp, micro_batches in ((2, (2, 4, 8)), (4, (4, 8))):
        for r in measure(pp, [("Interleaved1F1B", m) for m in micro_batches], 0.002, steps=1):
            want = interleaved_in_flight(pp, 2, r["micro_batches"], r["stage"])
            assert r["peak_micro_batches_held"] == want, r
    assert interleaved_in_flight(4, 2, 4, 0) == 8 < 4 * (1 + 3 / 8) * 2  # capped: every micro batch in both stages
    assert interleaved_in_flight(4, 2, 8, 0) == 4 * (1 + 3 / 8) * 2  # Korthikanti et al.'s, M a multiple of P


@pytest.mark.slow
@pytest.mark.multiproc
@pytest.mark.parametrize("tp", [1, 2])
def test_the_models_stages_hold_for_their_backward_what_the_planner_predicts(tp):
    """The `debug` model in 2 stages (a layer each, the tied embedding on both), 4 micro batches of 2 x 32 tokens,
    fp32: the peak bytes each stage holds for its backward (autograd's saved tensors and the stage's kept outputs,
    counted live) equal the planner's to the byte, under GPipe (4 micro batches in flight) and 1F1B (2, then 1);
    with tp 2 on each of the stage's two ranks, its layers split by the model's plan with sequence parallelism."""

    from model import ShardGPTConfig
    from training.measure.bubble import ModelCase, measure_model
    from training.plan.memory import planner as pm
    from training.strategy import Strategy

    case, m = ModelCase("debug", {}, micro_batch=2, seq_len=32), 4
    records = measure_model(2, [("GPipe", m), ("1F1B", m)], case, steps=1, timeout=180, tp=tp)
    assert len(records) == 2 * 2 * tp  # a record per schedule and rank
    config = ShardGPTConfig.from_preset(case.preset)
    held = {}
    for schedule in ("GPipe", "1F1B"):
        strategy = Strategy.of("single", 2 * tp, pp=2, tp=tp, pp_schedule=schedule)
        stages = pm.predict(config, strategy, "fp32", case.micro_batch, case.seq_len, micro_batches=m)["stages"]
        for r in (r for r in records if r["schedule"] == schedule):
            assert r["peak_held_bytes"] == stages[r["stage"]]["held_for_backward"], r
            assert r["held_after_step"] == 0, r  # every backward released what its forward held
            held[schedule, r["stage"]] = r["peak_held_bytes"]
    assert held["GPipe", 0] > held["1F1B", 0] and held["GPipe", 1] > held["1F1B", 1]

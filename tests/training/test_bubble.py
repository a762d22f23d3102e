"""The bubble measurement (training/bubble.py) on 2 fixed-cost stages: what the schedules hold is exact, and a
step can only be longer than the papers' (M + P - 1) x (forward + backward). The bubble's size against
(P - 1) / (M + P - 1) is a measured number: recipes/measure/pipeline_bubble.py prints it (docs/strategies.md)."""

from __future__ import annotations

import pytest

from training.bubble import measure, summarize, theory


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

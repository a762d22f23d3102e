"""The axes table (training/axes/table.py) is what its readers act on: the launch checks refuse an axis under a
wrapper the table does not list and let the listed ones through, and the planners, recipes/compare.py and the doctor
say what it says."""

from __future__ import annotations

import sys
from types import SimpleNamespace

import pytest

from training.axes.table import AXES, DEEPSPEED, WRAPPERS, composes, wrapper
from training.config import RunConfig
from training.environment import Environment
from training.paths import ROOT

CFG = {"output_dir": "/nonexistent/shardgpt-test"}


@pytest.mark.parametrize("held_by", DEEPSPEED)
def test_a_pipeline_under_a_deepspeed_engine_is_refused_as_the_table_says(held_by):
    from training.axes.pipeline.checks import check_pipeline_with_deepspeed
    from training.deepspeed_config import DeepSpeedJSON

    raw = {"zero_optimization": {"stage": int(held_by[4])}}
    cfg = RunConfig(**CFG, pipeline_parallel_degree=2)
    assert not composes("pp", held_by)
    with pytest.raises(ValueError, match=r"--pipeline_parallel_degree 2 with the DeepSpeed config"):
        check_pipeline_with_deepspeed(cfg, DeepSpeedJSON(raw, "ds.json"))


@pytest.mark.parametrize("held_by", WRAPPERS)
def test_sequence_parallelism_trains_under_the_wrappers_the_table_lists(held_by):
    from model import ShardGPTConfig
    from training.axes.ulysses import check_sequence_parallel

    config = ShardGPTConfig.from_preset("debug")
    cfg = RunConfig(**CFG)
    if composes("sp", held_by):
        check_sequence_parallel(cfg, config, 2, 2, held_by, Environment())  # no refusal
    else:
        with pytest.raises(ValueError, match=r"sequence parallelism \(sp_size 2\) needs DeepSpeed"):
            check_sequence_parallel(cfg, config, 2, 2, held_by, Environment())


@pytest.mark.parametrize("held_by", WRAPPERS)
def test_context_parallelism_trains_under_the_wrappers_the_table_lists(held_by):
    from training.axes.context import check_context_parallel

    cfg = RunConfig(**CFG, block_size=64)
    if composes("cp", held_by):
        check_context_parallel(cfg, 2, held_by, 2, cuda=True)  # no refusal (the CUDA check passed as on a GPU)
    else:
        with pytest.raises(ValueError, match=r"parallelism_config_cp_size: 2 needs FSDP2"):
            check_context_parallel(cfg, 2, held_by, 2, cuda=True)


def test_the_planners_model_what_the_table_trains():
    from training.plan import step_layout as st
    from training.plan.memory.stages import models_pipeline
    from training.strategy import Strategy

    for family, extra in (("ddp", {}), ("fsdp", {"fsdp_version": 2}), ("deepspeed", {"zero_stage": 1}),
                          ("deepspeed", {"zero_stage": 3})):  # fmt: skip
        strategy = Strategy.of(family, 4, pp=2, **extra)
        stage = extra.get("zero_stage")
        assert models_pipeline(strategy) == composes("pp", wrapper(family, stage)), strategy.name
    assert set(st.PIPELINE_HERE) == {n for n in st.DP_STRATEGIES if st.WRAPPER[n] in AXES["pp"].trains_under}
    assert set(st.WITH_SEQUENCE_PARALLEL) == {n for n in st.DP_STRATEGIES if n.startswith(AXES["sp"].trains_under)}
    here = {n for n in st.WITH_TENSOR_PARALLEL if st.WRAPPER[n] in AXES["tp"].trains_under}
    assert set(st.WITH_TENSOR_PARALLEL) - here == set(AXES["tp"].published_under)


def test_compare_refuses_a_pipeline_under_a_wrapper_the_table_does_not_list(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "recipes"))
    sys.modules.pop("compare", None)
    import compare

    zero2, ddp = compare.make_specs("zero2+pp2,ddp+pp2", 4, False)
    assert zero2.error == (
        "zero2+pp2: pipeline parallelism does not train under zero2 (it trains under single, ddp, fsdp): pick one of "
        "those configs"
    )
    assert ddp.error is None and ddp.pp == 2


def test_the_doctor_reads_the_table():
    from training.doctor.launch import axes
    from training.doctor.report import Report
    from training.strategy import Strategy

    report = Report()
    axes(report, Strategy.of("fsdp", 4, pp=2), 2)
    axes(report, Strategy.of("deepspeed", 4, zero_stage=3, sp=2), 1)
    axes(report, Strategy.of("ddp", 4), 1)  # no model-parallel axis: no line
    axes(report, Strategy.of("fsdp", 8, pp=2, tp=2, fsdp_version=2), 2)  # FSDP2 x TP x PP: composed (COMPOSED)
    lines = [(c.name, c.status, c.detail) for c in report.checks]
    assert lines == [
        ("parallel axes", "OK", "pipeline parallelism 2 under fsdp"),
        ("parallel axes", "OK", "sequence parallelism (Ulysses) 2 under zero3"),
        (
            "parallel axes",
            "OK",
            "pipeline parallelism 2 under fsdp, tensor parallelism (DeepSpeed AutoTP, or DTensor "
            "under FSDP2) 2 under fsdp",
        ),
    ]
    bad = Report()
    axes(bad, SimpleNamespace(family="ddp", zero_stage=None, tp_size=1, sp_size=2, cp_size=1), 2)
    (check,) = bad.checks
    assert check.status == "FAIL" and check.detail == (
        "sequence parallelism (Ulysses) does not train under ddp (it trains under zero1, zero2, zero3); "
        "pipeline parallelism with sequence parallelism (Ulysses): these axes do not train together under ddp"
    )


def test_the_docs_table_is_the_table():
    """docs/strategies.md prints the axes table as training/axes/table.py holds it."""
    from training.axes.table import markdown

    assert markdown() in (ROOT / "docs" / "strategies.md").read_text()

"""Every script answers a mistyped choice or flag with one `error:` line naming the close matches, exit status 2."""

from __future__ import annotations

import re

import pytest

from recipes import compare, doctor, plan_memory, train, trainer

ENTRY_POINTS = {
    "train": train.main,
    "trainer": trainer.main,
    "compare": compare.parse_args,
    "plan_memory": plan_memory.main,
    "doctor": doctor.parse_args,
}


def one_error_line(capsys, parse, argv: list[str]) -> str:
    with pytest.raises(SystemExit) as stopped:
        parse(argv)
    assert stopped.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), lines
    return lines[0]


@pytest.mark.parametrize("script", ["train", "trainer", "compare", "plan_memory"])
def test_a_mistyped_preset_names_the_close_presets(script, capsys):
    line = one_error_line(capsys, ENTRY_POINTS[script], ["--preset", "gpt5"])
    assert "--preset: invalid choice 'gpt5' (did you mean gpt2-350m or gpt2-124m?): choose from debug, tiny" in line


def test_a_choice_with_no_close_match_lists_them_all(capsys):
    line = one_error_line(capsys, train.main, ["--lr_scheduler_type", "banana"])
    assert "invalid choice 'banana': choose from cosine, linear, constant" in line


def test_a_misspelt_flag_is_one_line_too(capsys):
    assert "unrecognized arguments: --num_procs" in one_error_line(capsys, doctor.parse_args, ["--num_procs", "2"])
    with pytest.raises(ValueError, match=r"unknown flag --lr_schedular_type \(did you mean --lr_scheduler_type\?\)"):
        train.main(["--lr_schedular_type", "cosine"])  # run_rank prints it as `error: ...`
    close = r"\(did you mean --learning_rate or --muon_learning_rate\?\): "
    with pytest.raises(ValueError, match=r"unknown flag --learning_rte " + close):
        train.main(["--learning_rte=0.001"])


@pytest.mark.parametrize("flag", ["--pipeline_parallel_degree", "--pipeline_parallel_virtual_stages"])
@pytest.mark.parametrize("value", ["0", "-2"])
def test_a_degree_below_one_is_refused_when_parsed(flag, value):
    """Before anything divides by it (a pipeline degree of 0 once ended in a ZeroDivisionError traceback)."""
    from training.arguments import parse_run_config

    with pytest.raises(ValueError, match=rf"^{flag} {value} must be at least 1"):
        parse_run_config([flag, value])


def test_a_json_arguments_file_is_parsed_as_strictly_as_flags(tmp_path, capsys):
    """`python recipes/train.py args.json` (run_clm's convention): the file's keys are the flags, its choices are
    checked like the command line's (transformers' parse_json_file would skip them), null sets a field to None, and
    flags after the file win."""
    from training.arguments import parse_run_config

    args = tmp_path / "pipeline.json"
    args.write_text('{"preset": "debug", "pipeline_parallel_degree": 2, "bf16": true, "max_eval_batches": null}')
    cfg = parse_run_config(["--local_rank=0", str(args), "--preset", "tiny"])  # the deepspeed launcher's first flag
    assert (cfg.preset, cfg.pipeline_parallel_degree, cfg.bf16, cfg.max_eval_batches) == ("tiny", 2, True, None)
    assert parse_run_config(["--deepspeed", "ds_configs/zero3.json"]).deepspeed == "ds_configs/zero3.json"
    args.write_text('{"pipeline_parallel_schedule": "1f1b"}')
    line = one_error_line(capsys, train.main, [str(args)])
    assert "--pipeline-parallel-schedule: invalid choice '1f1b' (did you mean 1F1B?)" in line
    args.write_text('{"pipline_parallel_degree": 2}')
    expected = f"key 'pipline_parallel_degree' of the arguments file '{args}' (did you mean 'pipeline_parallel_degree'"
    with pytest.raises(ValueError, match=re.escape(expected)):
        parse_run_config([str(args)])
    with pytest.raises(FileNotFoundError, match="arguments file 'missing.json': no such file"):
        parse_run_config(["missing.json"])

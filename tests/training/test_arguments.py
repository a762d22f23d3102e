"""Every script answers a mistyped choice or flag with one `error:` line naming the close matches, exit status 2."""

from __future__ import annotations

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
    with pytest.raises(ValueError, match=r"not used by the HfArgumentParser: \['--lr_schedular_type'"):
        train.main(["--lr_schedular_type", "cosine"])  # run_rank prints it as `error: ...`

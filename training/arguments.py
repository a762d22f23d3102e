"""The scripts' argument parsers: a mistyped choice or flag ends in one line, `error: ...`, as every other bad input
does, naming the close matches (argparse alone prints the whole usage first, 44 lines for recipes/train.py).

`ArgumentParser` serves the argparse scripts; `parse_run_config` parses `RunConfig` (recipes/train.py, trainer.py,
the doctor's training flags) through transformers' `HfArgumentParser` with the same errors.
"""

from __future__ import annotations

import argparse
import difflib
import json
import sys
from collections.abc import Callable, Sequence
from dataclasses import fields, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

if TYPE_CHECKING:  # the doctor imports this module at start-up; transformers and torch load where they are used
    from training.config import RunConfig


def invalid_choice(value: str, choices: Sequence[Any]) -> str:
    """What is wrong with `value`, naming the choices spelt like it (difflib's close matches) and all of them."""
    close = difflib.get_close_matches(str(value), [str(c) for c in choices], n=3, cutoff=0.4)
    hint = f" (did you mean {' or '.join(close)}?)" if close else ""
    return f"invalid choice {value!r}{hint}: choose from {', '.join(map(str, choices))}"


def checked_choice(convert: Callable[[str], Any] | None, choices: Sequence[Any]) -> Callable[[str], Any]:
    """An argparse `type` that converts as `convert` does and refuses a value outside `choices` naming the close
    ones (argparse's own check, which runs after it, then always passes)."""

    def parse(text: str) -> Any:
        value = convert(text) if convert is not None else text
        if value not in choices:
            raise argparse.ArgumentTypeError(invalid_choice(text, choices))
        return value

    parse.__name__ = getattr(convert, "__name__", "str")  # argparse names the type in its other messages
    return parse


class OneLineErrors:
    """For an argparse parser: every parsing error ends the process with one line on stderr and exit status 2, and
    a choice outside `choices` names the close matches."""

    def add_argument(self, *args, **kwargs):
        if kwargs.get("choices") is not None:
            kwargs["type"] = checked_choice(kwargs.get("type"), tuple(kwargs["choices"]))
        return super().add_argument(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        print(f"error: {message} (`{self.prog} --help` lists the flags)", file=sys.stderr, flush=True)
        sys.exit(2)


class ArgumentParser(OneLineErrors, argparse.ArgumentParser):
    """`argparse.ArgumentParser` with one-line errors."""


def parse_run_config(
    argv: list[str] | None = None, remaining: bool = False, prog: str | None = None
) -> RunConfig | tuple[RunConfig, list[str]]:
    """`RunConfig` from the command line (`argv`, else sys.argv). A flag no field has raises ValueError (transformers'
    message, which `run_rank` prints as one line) unless `remaining`, which returns the unknown strings too."""
    from transformers import HfArgumentParser

    from training.config import RunConfig

    class RunConfigParser(OneLineErrors, HfArgumentParser):
        pass

    parser = RunConfigParser(RunConfig, prog=prog)
    argv, nulls, source = flags_from_json_file(list(sys.argv[1:] if argv is None else argv))
    parsed = parser.parse_args_into_dataclasses(args=argv, return_remaining_strings=True)
    if parsed[-1] and not remaining:
        raise ValueError(unknown_flags(parsed[-1], [f.name for f in fields(RunConfig)], parser.prog, source))
    if nulls:  # JSON's null for a field whose default is not None (--max_eval_batches: every validation block)
        unknown = sorted(set(nulls) - {f.name for f in fields(RunConfig)})
        if unknown:
            raise ValueError(f"the arguments file sets {unknown} to null, which are no flags of {parser.prog}")
        parsed = (replace(parsed[0], **dict.fromkeys(nulls)), *parsed[1:])
    return tuple(parsed) if remaining else parsed[0]


def unknown_flags(strings: list[str], names: list[str], prog: str, source: dict[str, str]) -> str:
    """What is wrong with the command line's `strings` that no flag took: each unknown flag with the flags spelt like
    it, named as the user wrote it (`source`: the flags an arguments file gave, by the file and key they came from)."""
    wrong = [a.split("=", 1)[0] for a in strings if a.startswith("-")] or strings
    described = []
    for flag in wrong:
        name, where = flag.lstrip("-"), source.get(flag)
        close = difflib.get_close_matches(name, names, n=3, cutoff=0.6)
        spell = (lambda c: repr(c)) if where else (lambda c: f"--{c}")  # a file's keys are written without dashes
        hint = f" (did you mean {' or '.join(spell(c) for c in close)}?)" if close else ""
        what = f"key {name!r} of the arguments file {where}" if where else f"unknown flag {flag}"
        described.append(f"{what}{hint}")
    return f"{'; '.join(described)}: {prog} has no such flag (`{prog} --help` lists them)"


def flags_from_json_file(argv: list[str]) -> tuple[list[str], list[str], dict[str, str]]:
    """`python recipes/train.py args.json` (run_clm's convention): a lone `.json` argument holds the flags, one key
    per flag, and becomes those flags, before any others on the command line (which then win). Every value goes
    through the command line's parser, so a JSON file's choices are checked as strictly as flags are
    (HfArgumentParser's own `parse_json_file` skips argparse's choices). Returns the flags, the keys set to null,
    and the file each flag it gave came from (`--key` -> the file's name), for the messages."""
    files = [a for a in argv if a.endswith(".json") and not a.startswith("-")]
    if not files:
        return argv, [], {}
    before = argv[argv.index(files[0]) - 1] if argv.index(files[0]) > 0 else ""
    if len(files) > 1 or (before.startswith("-") and "=" not in before):
        return argv, [], {}  # a flag's value (--deepspeed ds_configs/zero3.json), not an arguments file
    path = Path(files[0])
    if not path.is_file():
        raise FileNotFoundError(f"arguments file {files[0]!r}: no such file; pass a JSON file of flags, or the flags")
    try:
        values = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"arguments file {files[0]!r} is not valid JSON: {e}") from None
    if not isinstance(values, dict):
        raise ValueError(f"arguments file {files[0]!r} holds a {type(values).__name__}: write one object of flags")
    flags, nulls = [], []
    for key, value in values.items():
        if value is None:
            nulls.append(key)
        elif isinstance(value, bool):
            flags.append(f"--{key}={str(value).lower()}")
        elif isinstance(value, (list, dict)):
            raise ValueError(f"arguments file {files[0]!r}: {key} is a {type(value).__name__}; write it as a string")
        else:
            flags.append(f"--{key}={value}")
    rest = [a for a in argv if a != files[0]]
    return [*flags, *rest], nulls, {f"--{key}": repr(files[0]) for key in values}

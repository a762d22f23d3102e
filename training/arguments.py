"""The scripts' argument parsers: a mistyped choice or flag ends in one line, `error: ...`, as every other bad input
does, naming the close matches (argparse alone prints the whole usage first, 44 lines for recipes/train.py).

`ArgumentParser` serves the argparse scripts; `parse_run_config` parses `RunConfig` (recipes/train.py, trainer.py,
the doctor's training flags) through transformers' `HfArgumentParser` with the same errors.
"""

from __future__ import annotations

import argparse
import difflib
import sys
from collections.abc import Callable, Sequence
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
    parsed = parser.parse_args_into_dataclasses(args=argv, return_remaining_strings=remaining)
    return tuple(parsed) if remaining else parsed[0]

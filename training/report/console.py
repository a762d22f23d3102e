"""What a run prints: the project's own lines on rank 0, every warning that matters, and none of the third-party
messages the project knows to be harmless here, each silenced by its logger and text (`KNOWN_HARMLESS`).

Third-party INFO lines stay off: accelerate logs five of them per checkpoint (`Saving current state to ...`, `Model
weights saved in ...`), which `save_checkpoint` replaces with one line of its own (`saved checkpoint-200 (63 MB) to
runs/tiny`).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager

import transformers

logger = logging.getLogger("shardgpt")  # every line of the project's own

# (logger, text its message contains): warnings a user can do nothing about, and why each is harmless.
KNOWN_HARMLESS = (
    # lm_head ties the embedding on purpose: accelerate stores the one tensor once and load_state ties it again.
    ("accelerate.utils.other", "Removed shared tensor {'lm_head.weight'} while saving"),
    # DeepSpeed's guess, once per rank, on a machine without a GPU: the CPU is where this run was asked to train,
    # and the end-of-run summary names the device (a GPU torch cannot see is the doctor's check).
    ("DeepSpeed", "Setting accelerator to CPU"),
)


class DropMessage(logging.Filter):
    def __init__(self, text: str):
        super().__init__()
        self.text = text

    def filter(self, record: logging.LogRecord) -> bool:
        return self.text not in record.getMessage()


def configure_console() -> None:
    """On every rank, before anything logs: third-party loggers at WARNING, the project's at INFO on rank 0 (the
    launchers' RANK; 0 without one), and the `KNOWN_HARMLESS` messages filtered out."""
    logging.basicConfig(format="%(asctime)s %(levelname)s %(message)s", level=logging.WARNING)
    logger.setLevel(logging.INFO if int(os.environ.get("RANK", "0")) == 0 else logging.WARNING)
    for name, text in KNOWN_HARMLESS:
        target = logging.getLogger(name)
        if not any(isinstance(f, DropMessage) and f.text == text for f in target.filters):  # once per process
            target.addFilter(DropMessage(text))


@contextmanager
def no_transformers_bars() -> Iterator[None]:
    """Without transformers' progress bars (`Writing model shards`, `Loading weights`): for the export and the
    sample, folders of this disk written or read in well under a second, where a bar is noise."""
    was_on = transformers.utils.logging.is_progress_bar_enabled()
    transformers.utils.logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_on:
            transformers.utils.logging.enable_progress_bar()

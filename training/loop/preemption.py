"""Preemption: SIGTERM (what SLURM, Kubernetes and spot instances send before the kill) and SIGUSR1 (what SLURM's
`--signal` sends ahead of a job's time limit) end the run after a complete checkpoint, with exit status
`PREEMPTED` (75).

The signal may reach every rank at a different moment, one rank only, or only the launcher: torchrun and
`accelerate launch` (both run torch elastic's launcher) forward SIGTERM to every rank and SIGKILL them
TORCH_ELASTIC_SHUTDOWN_TIMEOUT seconds later (30 by default); the single-node `deepspeed` launcher forwards
SIGTERM and SIGINT and kills 30 seconds later. A SIGUSR1 sent to those launchers kills the launcher (torchrun
handles it only when listed in TORCHELASTIC_SIGNALS_TO_HANDLE), so SLURM's should go to the ranks or be turned
into a SIGTERM (recipes/slurm/*.sbatch). A rank's handler only records the signal. After every optimizer step the
ranks all-reduce what they recorded, so every rank stops after the same step, finishes the checkpoint and exits.
"""

from __future__ import annotations

import os
import signal

import torch

from training.core.ranks import PREEMPTED, Preempted, all_ranks_max

SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
__all__ = ["PREEMPTED", "SIGNALS", "Preempted", "PreemptionWatch", "stop_message"]


class PreemptionWatch:
    """Records SIGTERM and SIGUSR1 from the moment it is created; `agreed` tells every rank whether to stop."""

    def __init__(self) -> None:
        self.received = 0
        for sig in SIGNALS:
            signal.signal(sig, self._record)

    def _record(self, signum: int, frame) -> None:
        self.received = self.received or signum  # the first signal names the stop; a repeat changes nothing

    def agreed(self, device: torch.device) -> signal.Signals | None:
        """The signal some rank received, or None: the same answer on every rank (a collective when the process
        group exists; one all-reduce of one integer per optimizer step)."""
        (received,) = all_ranks_max([self.received], device)  # collective: every rank, after every step
        return signal.Signals(received) if received else None


def stop_message(sig: signal.Signals, step: int, checkpoint: os.PathLike | str) -> str:
    return (
        f"preempted by {sig.name} after step {step}: saved {checkpoint}; run the same command with "
        f"--resume_from_checkpoint auto to continue (exit status {PREEMPTED})"
    )

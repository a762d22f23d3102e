"""Launching the training script as users do, on CPU with 2 gloo ranks, under a hard timeout."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
TIMEOUT = 600  # seconds per launch; a hang fails the test instead of stalling the suite


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# What a launch must not print: third-party messages the project silences or replaces (training/console.py).
NOISE = (
    "Saving current state", "Model weights saved in", "Random states saved in", "Removed shared tensor",
    "Setting accelerator to CPU", "Downloading data", "Generating train split", "Writing model shards",
    "Loading weights", "MFU n/a",
)  # fmt: skip


# DeepSpeed's warning in the launchers' own processes, which import it before any rank starts (measured: accelerate
# launch 1, the deepspeed launcher 2); the ranks filter theirs.
LAUNCHER_CPU_WARNINGS = {"python": 0, "torchrun": 0, "accelerate": 1, "deepspeed": 2}


def quiet_console_problems(console: str, launcher: str = "python") -> list[str]:
    """The lines of `console` (a launch's stdout and stderr) that hold a `NOISE` message, but for the warnings the
    launcher's own processes print."""
    found = [line for line in console.splitlines() if any(noise in line for noise in NOISE)]
    launchers = [line for line in found if "Setting accelerator to CPU" in line][: LAUNCHER_CPU_WARNINGS[launcher]]
    return [line for line in found if line not in launchers]


def metrics_lines(output_dir: Path) -> list[str]:
    path = output_dir / "metrics.jsonl"
    return path.read_text().splitlines() if path.exists() else []


@dataclass
class Run:
    output_dir: Path
    stdout: str
    stderr: str
    returncode: int
    records_before: int = 0  # lines metrics.jsonl already held when this launch started (a resumed run appends)

    @property
    def records(self) -> list[dict]:
        return [json.loads(line) for line in metrics_lines(self.output_dir)]

    @property
    def losses(self) -> dict[int, float]:
        return {r["step"]: r["loss"] for r in self.records if "loss" in r}

    @property
    def own_losses(self) -> dict[int, float]:
        """The losses this launch logged itself, one per step (a resumed run's, not those it continued from)."""
        steps = [r["step"] for r in self.records[self.records_before :] if "loss" in r]
        assert len(steps) == len(set(steps)), f"steps logged twice: {steps}"
        return {r["step"]: r["loss"] for r in self.records[self.records_before :] if "loss" in r}

    @property
    def strategy(self) -> dict:
        return json.loads((self.output_dir / "strategy.json").read_text())


def launcher_command(launcher: str, config: str | None = None, nproc: int = 2, script: str = "train.py") -> list[str]:
    """The command line a user types, for `launcher` in python, torchrun, accelerate, deepspeed, running
    `script` of recipes/."""
    script = str(ROOT / "recipes" / script)
    port = str(free_port())
    if launcher == "python":
        return [sys.executable, script]
    if launcher == "torchrun":
        return [str(BIN / "torchrun"), f"--nproc_per_node={nproc}", f"--master_port={port}", script]
    if launcher == "accelerate":
        cfg = str(ROOT / "accelerate_configs" / f"{config}.yaml")
        return [str(BIN / "accelerate"), "launch", "--config_file", cfg, "--main_process_port", port, script]
    if launcher == "deepspeed":
        return [str(BIN / "deepspeed"), "--num_gpus", str(nproc), "--master_port", port, script]
    raise ValueError(launcher)


def accelerate_with(config: str) -> list[str]:
    """`accelerate launch` with the accelerate config file at `config` (a user's, not one of accelerate_configs/)."""
    cmd = launcher_command("accelerate", "ddp")
    cmd[cmd.index("--config_file") + 1] = config
    return cmd


def launch(
    cmd: list[str], args: list[str], output_dir: Path, check: bool = True, timeout: int = TIMEOUT, env=None
) -> Run:
    """Run `cmd args --output_dir output_dir` in a fresh environment (plus `env`); fail the test with the
    workers' stderr if it fails (unless `check=False`) or outlives `timeout`."""
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "PYTHONUNBUFFERED": "1",
        **(env or {}),
    }
    env["PYTHONPATH"] = f"{ROOT}{os.pathsep}{env.get('PYTHONPATH', '')}"
    before = len(metrics_lines(Path(output_dir)))
    # A session of its own, so a timeout kills the ranks too, not only the launcher that started them.
    p = subprocess.Popen(
        [*cmd, *args, "--output_dir", str(output_dir)],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
    )  # fmt: skip
    try:
        stdout, stderr = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        stdout, stderr = p.communicate()
        pytest.fail(
            f"launch timed out after {timeout}s: {' '.join(cmd + args)}\n"
            f"--- stdout tail ---\n{stdout[-4000:]}\n--- stderr tail ---\n{stderr[-6000:]}"
        )
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
    run = Run(output_dir, stdout, stderr, p.returncode, before)
    if check and p.returncode != 0:
        pytest.fail(f"launch failed ({p.returncode}): {' '.join(cmd + args)}\n--- stderr tail ---\n{stderr[-8000:]}")
    return run

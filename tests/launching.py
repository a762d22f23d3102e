"""Launching the training script as users do, on CPU with 2 gloo ranks, under a hard timeout."""

from __future__ import annotations

import atexit
import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
TIMEOUT = 600  # seconds per launch; a hang fails the test instead of stalling the suite
# One JSON line per launch (the test, the command, its wall time and rank 0's phases), summarised at the end of the
# session (tests/conftest.py): where the suite's time goes.
LAUNCH_LOG = Path(os.environ.get("SHARDGPT_LAUNCH_LOG", ROOT / ".launches.jsonl"))
CURRENT_TEST = None  # the running test's item (tests/conftest.py)
_ops_ready: set[str] = set()  # the DeepSpeed ops compiled or loaded in this process


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# What a launch must not print: third-party messages the project silences or replaces (training/report/console.py).
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


def launch_env(env: dict | None = None) -> dict:
    """The environment of a launch: this process's, with one thread per rank, no W&B uploads, and the project
    importable, plus `env`."""
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "PYTHONUNBUFFERED": "1",
        "WANDB_MODE": "offline",  # a launch that reports to W&B writes its run under output_dir, never online
        "WANDB_SILENT": "true",
        **(env or {}),
    }
    env["PYTHONPATH"] = f"{ROOT}{os.pathsep}{env.get('PYTHONPATH', '')}"
    return env


def launch(
    cmd: list[str], args: list[str], output_dir: Path, check: bool = True, timeout: int = TIMEOUT, env=None
) -> Run:
    """Run `cmd args --output_dir output_dir` in a fresh environment (plus `env`); fail the test with the
    workers' stderr if it fails (unless `check=False`) or outlives `timeout`."""
    env = launch_env(env)
    if cmd[0] != sys.executable and CURRENT_TEST is not None and not CURRENT_TEST.get_closest_marker("multiproc"):
        pytest.fail(f"{CURRENT_TEST.nodeid} launches ranks ({Path(cmd[0]).name}) but is not marked multiproc: "
                    "pytest-xdist would run it beside another launch")  # fmt: skip
    build_deepspeed_ops(deepspeed_ops(cmd, args))
    before = len(metrics_lines(Path(output_dir)))
    started, wall_started = time.perf_counter(), time.time()
    argv = [*cmd, *args, "--output_dir", str(output_dir)]
    if cmd[0] == sys.executable and (ranks := rank_server()):  # one process, `python train.py`: from the rank server
        argv[0] = ranks["python"]
        env.update(ranks["env"])
    stdout, stderr, returncode = (served_launch if served(cmd) else plain_launch)(argv, env, timeout)
    run = Run(output_dir, stdout, stderr, returncode, before)
    log_launch(cmd, args, run, time.perf_counter() - started)
    if returncode == 0:
        check_new_checkpoints(Path(output_dir), wall_started)
    if check and returncode != 0:
        pytest.fail(f"launch failed ({returncode}): {' '.join(cmd + args)}\n--- stderr tail ---\n{stderr[-8000:]}")
    return run


def check_new_checkpoints(output_dir: Path, since: float) -> None:
    """Every checkpoint a launch wrote (recipes/train.py's, with their marker, and the HF Trainer's) passes the check
    a resume makes of it: none names a global outside the allowlist (training/checkpoints/safety.py)."""
    from training.checkpoints.safety import check_checkpoint

    for checkpoint in sorted(output_dir.glob("checkpoint-*")):
        if checkpoint.is_dir() and checkpoint.stat().st_mtime >= since - 1:
            check_checkpoint(checkpoint, what=f"a checkpoint the suite wrote ({checkpoint.name})")


def timed_out(argv: list[str], timeout: int, stdout: str, stderr: str):
    pytest.fail(
        f"launch timed out after {timeout}s: {' '.join(argv)}\n"
        f"--- stdout tail ---\n{stdout[-4000:]}\n--- stderr tail ---\n{stderr[-6000:]}"
    )


def plain_launch(argv: list[str], env: dict, timeout: int) -> tuple[str, str, int]:
    """`argv` as a new process, in a session of its own, so a timeout kills the ranks too, not only the launcher
    that started them."""
    p = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         start_new_session=True)  # fmt: skip
    try:
        stdout, stderr = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        timed_out(argv, timeout, *p.communicate())
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
    return stdout, stderr, p.returncode


# ---------------------------------------------------------------------------------------------- the launch server
# `accelerate launch`, torchrun and the deepspeed launcher spend most of their time before the first rank importing
# torch, accelerate and deepspeed (5.0 s, 3.1 s and 9.6 s of a no-op launch on the 2-core machines, the last with a
# second process of its own): tests/launch_server.py pays the imports once per test process and forks a launcher
# per launch, which runs the launcher's own main and starts fresh ranks as always.
# SHARDGPT_LAUNCH_SERVER=0 launches every command as a new process instead.

# The ranks such a launcher starts come from tests/rank_server.py, which pays a rank's imports once (about 6 of a
# rank's 10 seconds of start-up on the slower machine) and forks each rank from there, through the `python` it
# writes (the launcher's sys.executable), and so does a one-process launch (`python train.py`). SHARDGPT_RANK_SERVER=0
# starts every rank as a fresh interpreter instead.

_server: tuple[subprocess.Popen, str, bytes] | None = None
_rank_server: tuple[subprocess.Popen, Path] | None = None


def start_server(argv: list[str], key: bytes = b"") -> subprocess.Popen:
    """Start a server of tests/ and wait for its "ready" line (after the libraries' start-up messages)."""
    server = subprocess.Popen(argv, cwd=ROOT, env=launch_env(), stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    server.stdin.write(key + b"\n")
    server.stdin.close()
    for line in server.stdout:
        if line.strip() == b"ready":
            break
    else:
        raise RuntimeError(f"{argv[1]} did not start (exit status {server.wait()})")
    atexit.register(server.kill)
    return server


def rank_server() -> dict:
    """The environment that sends a launcher's ranks to the rank server (started on first use): its socket, the real
    interpreter, and PYTHON_EXEC, which torchrun (and `accelerate launch` through it) starts ranks with; and the
    `python` a served launcher is to take as its sys.executable. Empty if SHARDGPT_RANK_SERVER=0."""
    global _rank_server
    if os.environ.get("SHARDGPT_RANK_SERVER", "1") == "0":
        return {}
    if _rank_server is None or _rank_server[0].poll() is not None:
        directory = Path(tempfile.mkdtemp(prefix="shardgpt-ranks-"))  # short: AF_UNIX allows 107
        _rank_server = (start_server([sys.executable, str(ROOT / "tests" / "rank_server.py"), str(directory)]),
                        directory)  # fmt: skip
    directory = _rank_server[1]
    client = str(directory / "python")
    env = {"SHARDGPT_RANK_SERVER": str(directory / "rank.sock"), "SHARDGPT_RANK_PYTHON": sys.executable}
    return {"python": client, "env": {**env, "PYTHON_EXEC": client}}


def served(cmd: list[str]) -> bool:
    """Whether `cmd` is a launcher the server runs: `accelerate launch`, torchrun or deepspeed."""
    if os.environ.get("SHARDGPT_LAUNCH_SERVER", "1") == "0":
        return False
    name = Path(cmd[0]).name
    return (name == "accelerate" and cmd[1:2] == ["launch"]) or name in ("torchrun", "deepspeed")


def ask(request: dict):
    """Send `request` to this process's launch server (started on first use) and return its answer."""
    from multiprocessing.connection import Client

    global _server
    if _server is None or _server[0].poll() is not None:
        address = os.path.join(tempfile.mkdtemp(prefix="shardgpt-"), "launch.sock")  # short: AF_UNIX allows 107
        key = secrets.token_hex(16).encode()
        _server = (start_server([sys.executable, str(ROOT / "tests" / "launch_server.py"), address], key), address, key)
    with Client(_server[1], family="AF_UNIX", authkey=_server[2]) as conn:
        conn.send(request)
        return conn.recv()


def served_launch(argv: list[str], env: dict, timeout: int) -> tuple[str, str, int]:
    """`argv` run by the launch server: its stdout and stderr (through files), and its exit status."""
    entry = "accelerate-launch" if Path(argv[0]).name == "accelerate" else Path(argv[0]).name
    rest = argv[2:] if entry == "accelerate-launch" else argv[1:]  # the launcher's arguments
    with tempfile.TemporaryDirectory(prefix="shardgpt-launch-") as scratch:
        out, err = os.path.join(scratch, "stdout"), os.path.join(scratch, "stderr")
        ranks = rank_server()
        request = {"op": "start", "argv": [entry, *rest], "env": {**env, **ranks.get("env", {})}, "cwd": str(ROOT),
                   "stdout": out, "stderr": err, "python": ranks.get("python", sys.executable)}  # fmt: skip
        pid = ask(request)
        deadline = time.monotonic() + timeout
        while (returncode := ask({"op": "poll", "pid": pid})) is None:
            if time.monotonic() > deadline:
                os.killpg(pid, signal.SIGKILL)  # the launcher's session: its ranks too
                while ask({"op": "poll", "pid": pid}) is None:
                    time.sleep(0.05)
                timed_out(argv, timeout, *(Path(f).read_text(errors="replace") for f in (out, err)))
            time.sleep(0.05)
        stdout, stderr = (Path(f).read_text(errors="replace") for f in (out, err))
    return stdout, stderr, returncode


def log_launch(cmd: list[str], args: list[str], run: Run, wall: float) -> None:
    """Append the launch to `LAUNCH_LOG`: the test that made it, the launcher, config and script, its wall time and
    exit status, and the phases rank 0 recorded (train.py's last metrics record: start-up, set-up, training,
    export)."""
    phases = next((r for r in reversed(run.records[run.records_before :]) if "wall_s" in r), {})
    phases = {k if k != "wall_s" else "wall_s_rank0": v for k, v in phases.items() if k.endswith("_s")}
    script = next((Path(a).name for a in reversed(cmd) if a.endswith(".py")), Path(cmd[0]).name)
    config = next((Path(a).stem for a in [*cmd, *args] if a.endswith((".yaml", ".json"))), None)
    line = {
        "test": os.environ.get("PYTEST_CURRENT_TEST", "").rsplit(" (", 1)[0],
        "worker": os.environ.get("PYTEST_XDIST_WORKER", "main"), "started": round(time.time() - wall, 1),
        "launcher": Path(cmd[0]).name if Path(cmd[0]).name != Path(sys.executable).name else "python",
        "config": config, "script": script, "wall_s": round(wall, 2), "returncode": run.returncode,
        **phases,
    }  # fmt: skip
    with open(LAUNCH_LOG, "a") as f:
        f.write(json.dumps(line) + "\n")


def uses_deepspeed(cmd: list[str], args: list[str]) -> bool:
    """Whether a launch runs DeepSpeed: its launcher, a --deepspeed JSON, or an accelerate config of DeepSpeed."""
    if Path(cmd[0]).name == "deepspeed" or any(a.startswith("--deepspeed") for a in args):
        return True
    configs = [Path(a) for a in cmd if a.endswith(".yaml")]
    return any(p.is_file() and "distributed_type: DEEPSPEED" in p.read_text() for p in configs)


def deepspeed_ops(cmd: list[str], args: list[str]) -> tuple[str, ...]:
    """The DeepSpeed ops a launch loads on CPU ranks: those its DeepSpeed JSON needs (--deepspeed's, which wins as
    in the training script, else its accelerate config's deepspeed_config_file, read as recipes/compare.py reads
    it); none for a JSON that cannot be read (the launch refuses it first); every CPU op where no JSON is named."""
    from training.core.ops import CPU_OPS, launch_ops
    from training.environment import Environment
    from training.launch import Launched

    if not uses_deepspeed(cmd, args):
        return ()
    named = [a.split("=", 1)[1] for a in args if a.startswith("--deepspeed=")]
    named += [args[i + 1] for i, a in enumerate(args[:-1]) if a == "--deepspeed"]
    configs = [Path(a) for a in cmd if a.endswith(".yaml")]
    try:
        env = Environment.of_accelerate_config(configs[0]) if configs and not named else Environment()
        ds = Launched.read(named[-1] if named else None, env).deepspeed
    except (OSError, ValueError):
        return ()
    if ds is None:
        return CPU_OPS
    return launch_ops(ds.raw, on_gpu=False) if isinstance(ds.raw, dict) else ()


def build_deepspeed_ops(ops: tuple[str, ...]) -> None:
    """Compile DeepSpeed's C++ `ops` before the launch that loads them (minutes the first time, cached in the
    environment's torch_extensions/ after): inside a launch that time would count against the launch's timeout, and
    a build killed midway leaves a lock file on which every later load waits forever; a lock left so is removed.
    Only the ops this launch loads, so that a launch that needs none (a JSON refused before DeepSpeed starts) does
    not wait on another worker's build of the others."""
    missing = tuple(op for op in ops if op not in _ops_ready)
    if not missing:
        return
    from training.doctor.machine import build_ops
    from training.doctor.report import Report

    report = Report()
    build_ops(report, missing, remove_stale_locks=True)
    for check in report.checks:
        print(f"DeepSpeed ops: {check.name}: {check.status} {check.detail}", file=sys.stderr)
    _ops_ready.update(missing)

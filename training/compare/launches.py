"""Running one launch as a child process group: a free port, the group's teardown, its peak
resident memory sampled while it runs, and the error a failed launch printed.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from training.paths import ROOT

SAMPLE_EVERY_S = 0.25


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Sampler:
    """Peak resident memory of every worker process (the descendants running the training script)."""

    def __init__(self, root_pid: int, script: Path):
        self.root_pid, self.script = root_pid, str(script)
        self.peak: dict[int, int] = {}  # pid -> bytes
        self.rank: dict[int, int] = {}

    def sample(self) -> None:
        import psutil

        try:
            procs = psutil.Process(self.root_pid).children(recursive=True)
        except psutil.Error:
            return
        for p in procs:
            try:
                if p.pid not in self.rank:
                    if p.ppid() in self.rank or not any(a.endswith(self.script) for a in p.cmdline()):
                        continue  # the launcher, or a worker's own forked helper (same command line)
                    env = p.environ()
                    self.rank[p.pid] = int(env.get("RANK", env.get("LOCAL_RANK", len(self.rank))))
                self.peak[p.pid] = max(self.peak.get(p.pid, 0), p.memory_info().rss)
            except (psutil.Error, ValueError):
                continue

    def per_rank_gb(self) -> list[float]:
        by_rank = sorted((self.rank[pid], rss) for pid, rss in self.peak.items())
        return [round(rss / 1e9, 3) for _, rss in by_rank]


@dataclass
class Launch:
    code: int  # 124: timed out
    wall_s: float
    sampler: Sampler
    stderr: str
    error: str | None  # None when it succeeded


def run_process(cmd: list[str], out: Path, timeout: float, script: Path) -> Launch:
    """Run `cmd` in its own session (its whole process group is killed on timeout), sampling memory. The
    launch's stdout and stderr go to `<out>.stdout.log` / `<out>.stderr.log` beside `out`."""
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1"}
    env.setdefault("OMP_NUM_THREADS", "1")
    env["PYTHONPATH"] = f"{ROOT}{os.pathsep}{env.get('PYTHONPATH', '')}"
    out.mkdir(parents=True, exist_ok=True)
    err_log = out.parent / f"{out.name}.stderr.log"
    t0 = time.perf_counter()
    with open(out.parent / f"{out.name}.stdout.log", "w") as so, open(err_log, "w") as se:
        p = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=so, stderr=se, start_new_session=True)
        sampler, timed_out = Sampler(p.pid, script), False
        while p.poll() is None and not timed_out:
            sampler.sample()
            timed_out = time.perf_counter() - t0 > timeout
            if timed_out:
                stop_group(p)
            time.sleep(SAMPLE_EVERY_S)
    wall = time.perf_counter() - t0
    stderr = err_log.read_text(errors="replace")
    code = 124 if timed_out else p.returncode
    error = None if code == 0 else f"timed out after {timeout:.0f} s" if code == 124 else last_error(stderr, code)
    return Launch(code, wall, sampler, stderr, error)


def stop_group(p: subprocess.Popen) -> None:
    """SIGTERM the launch's process group (the launcher and its workers), SIGKILL after 10 s."""
    for sig, wait in ((signal.SIGTERM, 10), (signal.SIGKILL, 5)):
        try:
            os.killpg(p.pid, sig)
        except ProcessLookupError:
            return
        try:
            p.wait(wait)
            return
        except subprocess.TimeoutExpired:
            continue


def last_error(stderr: str, returncode: int) -> str:
    """The line that says what went wrong: the training script's `error: ...` line, else the last exception
    line (not the launcher's CalledProcessError), else the last line of stderr."""
    lines = [re.sub(r"^\[(rank|default)\d+\]:\s*", "", s).strip() for s in stderr.splitlines()]
    lines = [s for s in lines if s]
    for s in reversed(lines):
        if s.startswith("error:"):
            return s
    for s in reversed(lines):
        if re.match(r"^[\w.]*(Error|Exception)\b", s) and "CalledProcessError" not in s:
            return s
    return lines[-1] if lines else f"exit code {returncode}"

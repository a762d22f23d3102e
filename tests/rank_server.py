"""A rank's start-up, paid once per test process: this server imports what every rank of the project imports first
(torch, transformers' modeling code, accelerate, deepspeed: about 6 of the 10 seconds a rank of a 2-rank
launch spent starting on the project's slower 2-core machine, times two ranks, times some 200 launches a CI run
makes) and then forks one child per rank a launcher starts, which becomes that rank: the launcher's command line,
environment, working directory and standard streams, its script run as `__main__`.

The launchers are unchanged: tests/launch_server.py gives the launcher it forks `sys.executable` = a small client
(tests/rank_client.py behind a `#!python -IS` line, written next to this server's socket), so `accelerate launch`,
torchrun and the deepspeed launcher start their ranks as always, through that client: it hands the server its
command line and its standard streams, forwards the signals it gets to the rank, and exits with the rank's status
(or dies of the rank's signal). A client killed outright has its rank killed by the server. A rank's parent is
this server, not its launcher: a signal a rank sends its parent (a preemption reaching the launcher, as the fault
tests send it) is passed on to the launcher that started its client.

A rank is run fresh (`python` itself) when this server cannot stand in for it: a command line other than
`python [-u] script args` or `python [-u] -m module args`, or an environment that differs from the server's in what
the imported libraries read at import time (`IMPORT_TIME_ENV`). Two things a forked rank shares with its siblings
that fresh interpreters do not: the string hash seed and the warnings already shown during the imports.

    python tests/rank_server.py DIRECTORY    # tests/launching.py starts it; DIRECTORY gets rank.sock and python
"""

from __future__ import annotations

import contextlib
import json
import os
import runpy
import selectors
import signal
import socket
import struct
import sys
from pathlib import Path

# What the preloaded libraries read from the environment while they import (thread pools, log levels, caches,
# offline switches, accelerator detection): a rank whose environment differs here is run fresh. (CUDA_VISIBLE_DEVICES,
# which the deepspeed launcher sets per rank, is not here: the server serves a CPU build of torch alone.)
IMPORT_TIME_ENV = (
    "OMP_", "MKL_", "KMP_", "GOMP_", "TORCH_LOGS", "TORCH_CPP", "TORCHDYNAMO", "TORCHINDUCTOR", "TORCH_COMPILE",
    "HF_", "HUGGINGFACE_", "TRANSFORMERS_", "DATASETS_", "TOKENIZERS_", "DS_", "DEEPSPEED_", "XLA_", "USE_",
    "WANDB_", "LD_", "PYTHONHASHSEED", "PYTHONWARNINGS", "PYTHONUNBUFFERED", "PYTHONDONTWRITEBYTECODE",
)  # fmt: skip
# Read when used, not on import: torchrun gives each rank an inductor cache of its own.
READ_WHEN_USED = {"TORCHINDUCTOR_CACHE_DIR"}
HEADER = struct.Struct("!q")
# Signals the server takes from its queue (blocked, then read with their sender): one a rank sends to its parent (a
# preemption sent to the launcher, as the fault tests do) goes to the rank's launcher, the client's parent.
SIGNALS = {signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2}


def preload() -> str | None:
    """Import what every rank imports first; None if the server can fork afterwards, else why not."""
    import torch

    if torch.version.cuda or torch.version.hip:  # deepspeed's import asks CUDA for its devices: no fork after that
        return f"torch {torch.__version__} is a GPU build: ranks fork only from a CPU build's imports"
    import accelerate  # noqa: F401
    import deepspeed  # noqa: F401
    import torch.distributed  # noqa: F401
    import transformers.modeling_utils  # noqa: F401

    # Not datasets: pyarrow starts jemalloc's background thread as it loads.
    threads = len(os.listdir("/proc/self/task"))
    return None if threads == 1 else f"the imports started {threads - 1} threads: forking would copy none of them"


def import_time_env(env: dict) -> dict:
    return {k: v for k, v in env.items() if k.startswith(IMPORT_TIME_ENV) and k not in READ_WHEN_USED}


def why_fresh(request: dict, fds: list[int], own: dict) -> str | None:
    """Why this server cannot stand in for the rank `request` describes, or None."""
    if len(fds) != 3:
        return f"{len(fds)} standard streams received"
    theirs = import_time_env(request["env"])
    differ = sorted(k for k in {*own, *theirs} if own.get(k) != theirs.get(k))
    return f"the environment differs in {', '.join(differ)}" if differ else None


def receive(conn: socket.socket) -> tuple[dict, list[int]]:
    """One request: an 8-byte length with the client's standard streams attached, then that many bytes of JSON."""
    head, fds, _, _ = socket.recv_fds(conn, HEADER.size, 3)
    (size,) = HEADER.unpack(head)
    body = b""
    while len(body) < size:
        chunk = conn.recv(size - len(body))
        if not chunk:
            raise ConnectionError("the client left mid-request")
        body += chunk
    return json.loads(body), fds


def become(request: dict, fds: list[int], client: str, base_path: list[str]) -> None:
    """In the forked child: become the rank `request` describes, and run it. Returns when its script returns; the
    interpreter then exits as any other would (atexit handlers, non-daemon threads joined)."""
    signal.pthread_sigmask(signal.SIG_SETMASK, [])  # the server's blocked signals are the rank's again
    for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGCHLD, signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
        os.close(fd)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    sys.executable = client  # what this rank starts with sys.executable comes back here too
    extra = [p for p in request["env"].get("PYTHONPATH", "").split(os.pathsep) if p]
    if "module" in request:
        sys.path[:] = [request["cwd"], *extra, *base_path]
        sys.argv = [request["module"], *request["args"]]
        runpy.run_module(request["module"], run_name="__main__", alter_sys=True)
    else:
        script = os.path.abspath(request["script"])
        sys.path[:] = [os.path.dirname(os.path.realpath(script)), *extra, *base_path]
        sys.argv = [script, *request["args"]]
        runpy.run_path(script, run_name="__main__")


def serve(directory: Path) -> tuple[dict, list[int]] | None:
    """Answer requests until the parent test process is gone (returns None), or, in a forked child, return the
    request it is to become."""
    refused = preload()
    if refused:
        print(f"rank server: running every rank fresh: {refused}", file=sys.stderr, flush=True)
    own = import_time_env(os.environ)
    parent = os.getppid()
    signal.pthread_sigmask(signal.SIG_BLOCK, SIGNALS)
    children: dict[int, tuple[socket.socket, int]] = {}  # rank: its client's connection, and the client's parent
    selector = selectors.DefaultSelector()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(directory / "rank.sock"))
    listener.listen(64)
    selector.register(listener, selectors.EVENT_READ)
    print("ready", flush=True)
    os.dup2(os.open(os.devnull, os.O_WRONLY), 1)  # nobody reads the pipe from here on
    while os.getppid() == parent:
        for key, _ in selector.select(timeout=0.05):
            if key.fileobj is listener:
                conn, _ = listener.accept()
                try:
                    request, fds = receive(conn)
                except (OSError, ValueError):
                    conn.close()
                    continue
                why = refused or why_fresh(request, fds, own)
                if why:
                    with open(directory / "fresh.log", "a") as log:  # which ranks ran fresh, and why
                        print(f"{request.get('script') or request.get('module')}: {why}", file=log)
                    for fd in fds:
                        os.close(fd)
                    conn.sendall(HEADER.pack(0))  # run it fresh
                    conn.close()
                    continue
                pid = os.fork()
                if pid == 0:
                    selector.close()
                    listener.close()
                    for other, _ in children.values():
                        other.close()
                    conn.close()
                    return request, fds
                for fd in fds:
                    os.close(fd)
                conn.sendall(HEADER.pack(pid))
                children[pid] = conn, request["parent"]
                selector.register(conn, selectors.EVENT_READ, pid)
            elif not key.fileobj.recv(64):  # the client is gone (killed): so goes its rank
                selector.unregister(key.fileobj)
                with contextlib.suppress(ProcessLookupError):
                    os.kill(key.data, signal.SIGKILL)
        while (info := signal.sigtimedwait(SIGNALS, 0)) is not None:
            if info.si_pid not in children:  # not from a rank: the server's own, as if never blocked
                sys.exit(128 + info.si_signo)
            with contextlib.suppress(ProcessLookupError):
                os.kill(children[info.si_pid][1], info.si_signo)
        reap(children, selector)
    return None


def reap(children: dict[int, tuple[socket.socket, int]], selector: selectors.BaseSelector) -> None:
    """Tell each finished rank's client its exit status (negative: the signal that ended it)."""
    while children:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        if pid not in children:
            continue
        conn, _ = children.pop(pid)
        with contextlib.suppress(KeyError):  # unregistered already if its client left
            selector.unregister(conn)
        with contextlib.suppress(OSError):
            conn.sendall(HEADER.pack(os.waitstatus_to_exitcode(status)))
        conn.close()


def main(directory: Path) -> None:
    client = directory / "python"
    source = (Path(__file__).parent / "rank_client.py").read_text()
    client.write_text(f"#!{sys.executable} -IS\n{source}")
    client.chmod(0o755)
    base_path = [p for p in sys.path[1:] if p not in os.environ.get("PYTHONPATH", "").split(os.pathsep)]
    forked = serve(directory)
    if forked is not None:
        become(*forked, str(client), base_path)


if __name__ == "__main__":
    main(Path(sys.argv[1]))

"""The launchers' start-up, paid once per test process: this server imports the entry points of `accelerate
launch`, torchrun and the deepspeed launcher (torch, accelerate and deepspeed with them: most of the 5 seconds
`accelerate launch` takes before its first rank starts, on the project's 2-core machines) and then, for each launch
the tests ask for, forks a child that runs that launcher's own `main` with the launch's command line, environment,
working directory and output files, in a session of its own. The launcher starts its ranks as always, with its
`sys.executable`, which the request names: tests/rank_server.py's client, which has them forked from a process
that has paid their imports (or the real interpreter). The server itself runs no tensor operation (a fork after
one is unsafe), and handles one request at a time: "start" forks and answers the child's pid, "poll" answers its
exit status once it has one.

    python tests/launch_server.py SOCKET_PATH      # tests/launching.py starts it, with its authentication key on stdin
"""

from __future__ import annotations

import os
import signal
import sys
import traceback
from multiprocessing.connection import Listener

import accelerate.commands.launch
import deepspeed.launcher.runner
import torch.distributed.run

ENTRY_POINTS = {
    "accelerate-launch": accelerate.commands.launch.main,
    "torchrun": torch.distributed.run.main,
    "deepspeed": deepspeed.launcher.runner.main,
}


def run_child(request: dict) -> None:
    """In the forked child: become the launcher `request` names, as if started from a shell, and exit with its
    status. Never returns."""
    code = 1
    try:
        os.setsid()  # a session of its own: a timeout kills the launcher and its ranks together
        for fd, path in ((1, request["stdout"]), (2, request["stderr"])):
            os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644), fd)
        sys.stdout = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115 (the process's own stdout)
        sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGCHLD):
            signal.signal(sig, signal.SIG_DFL)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        sys.argv = request["argv"]
        sys.executable = request["python"]  # what the launcher starts its ranks with (tests/rank_server.py)
        ENTRY_POINTS[request["argv"][0]]()
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def serve(path: str, authkey: bytes) -> None:
    statuses: dict[int, int] = {}
    with Listener(path, family="AF_UNIX", authkey=authkey) as listener:
        print("ready", flush=True)
        os.dup2(os.open(os.devnull, os.O_WRONLY), 1)  # nobody reads the pipe from here on
        while True:
            with listener.accept() as conn:
                request = conn.recv()
                if request["op"] == "start":
                    pid = os.fork()
                    if pid == 0:
                        listener.close()
                        conn.close()
                        run_child(request)
                    conn.send(pid)
                elif request["op"] == "poll":
                    pid = request["pid"]
                    if pid not in statuses:
                        done, status = os.waitpid(pid, os.WNOHANG)
                        if done:
                            statuses[pid] = os.waitstatus_to_exitcode(status)
                    conn.send(statuses.pop(pid, None))
                elif request["op"] == "stop":
                    conn.send(True)
                    return


if __name__ == "__main__":
    serve(sys.argv[1], sys.stdin.buffer.readline().strip())

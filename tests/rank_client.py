"""The `python` that launchers served by tests/launch_server.py start their ranks with (tests/rank_server.py writes
it, behind a `#!<python> -IS` line, and explains why). `python [-u] script args` and `python [-u] -m module args`
are handed, with this process's standard streams, to the rank server, which forks the rank; this process forwards
the signals it gets to the rank and ends as the rank ended. Anything else, or a refusal, runs the real interpreter
in this process's place. Standard library only, and nothing but what it needs: it runs once per rank."""

import contextlib
import json
import os
import signal
import socket
import struct
import sys

HEADER = struct.Struct("!q")
PYTHON = os.environ["SHARDGPT_RANK_PYTHON"]


def fresh():
    os.execv(PYTHON, [PYTHON, *sys.argv[1:]])


def read_header(conn):
    data = b""
    while len(data) < HEADER.size:
        chunk = conn.recv(HEADER.size - len(data))
        if not chunk:
            raise ConnectionError("the rank server is gone")
        data += chunk
    return HEADER.unpack(data)[0]


def main():
    args = sys.argv[1:]
    while args[:1] == ["-u"]:
        args = args[1:]
    if not args or (args[0].startswith("-") and args[0] != "-m") or args[:1] == ["-m"] and len(args) < 2:
        fresh()
    request = {"cwd": os.getcwd(), "env": dict(os.environ), "parent": os.getppid()}
    if args[0] == "-m":
        request.update(module=args[1], args=args[2:])
    else:
        request.update(script=args[0], args=args[1:])
    body = json.dumps(request).encode()
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        conn.connect(os.environ["SHARDGPT_RANK_SERVER"])
        socket.send_fds(conn, [HEADER.pack(len(body))], [0, 1, 2])
        conn.sendall(body)
        pid = read_header(conn)
    except OSError:
        conn.close()
        fresh()
    if pid <= 0:
        conn.close()
        fresh()

    def forward(sig, frame):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(sig, forward)
    code = read_header(conn)
    if code < 0:  # killed by signal -code: so is this process, for the launcher to report it
        signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    os._exit(code)


main()

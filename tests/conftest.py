"""Shared by the whole suite: the repository and tests/ on the import path, a fixed seed per test, the launches
grouped for pytest-xdist and timed, and the small corpus the launched tests train on."""

import os
import random
import shutil
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # the suite also runs from a clone that was not pip-installed
    sys.path.insert(0, str(ROOT))
if str(ROOT / "tests") not in sys.path:  # the helpers every test folder shares (launching.py)
    sys.path.insert(0, str(ROOT / "tests"))

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def cpu_times() -> tuple[float, float] | None:
    """The machine's busy and idle CPU seconds since boot (/proc/stat; None where there is none)."""
    try:
        fields = [float(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    except (OSError, ValueError):
        return None
    tick = os.sysconf("SC_CLK_TCK")
    idle = fields[3] + fields[4]  # idle and iowait
    return (sum(fields[:8]) - idle) / tick, idle / tick


SESSION = {"cpu": None, "busy": {}}  # the controlling process's: CPU times at the start, each worker's test time


def pytest_sessionstart(session):
    """A new launch log for this session (tests/launching.py), begun by the controlling process only."""
    if not hasattr(session.config, "workerinput"):  # pytest-xdist's workers have it
        from launching import LAUNCH_LOG

        LAUNCH_LOG.unlink(missing_ok=True)
        SESSION["cpu"] = cpu_times()


def pytest_runtest_logreport(report):
    """Each pytest-xdist worker's time in tests (set-up, call, teardown), for the summary: which worker the session
    waited for."""
    node = getattr(report, "node", None)  # set on the controlling process's copy of a worker's report
    worker = node.gateway.id if node is not None else "main"
    SESSION["busy"][worker] = SESSION["busy"].get(worker, 0.0) + report.duration


def pytest_terminal_summary(terminalreporter, config):
    """Where the launches' time went: their count and wall time, the phases rank 0 recorded, the slowest ones."""
    from launching import LAUNCH_LOG

    if hasattr(config, "workerinput"):
        return
    write = terminalreporter.write_line
    started, now = SESSION["cpu"], cpu_times()
    if started and now and SESSION["busy"]:
        busy, idle = (b - a for a, b in zip(started, now, strict=True))
        terminalreporter.section("where the time went")
        workers = ", ".join(f"{w} {s / 60:.1f} min" for w, s in sorted(SESSION["busy"].items()))
        write(f"time in tests per worker: {workers}; the machine's {os.cpu_count()} CPUs "
              f"{100 * busy / max(busy + idle, 1e-9):.0f}% busy over the session")  # fmt: skip
    if not LAUNCH_LOG.is_file():
        return
    import json

    launches = [json.loads(line) for line in LAUNCH_LOG.read_text().splitlines()]
    wall = sum(r["wall_s"] for r in launches)
    terminalreporter.section("launches")
    write(f"{len(launches)} launches, {wall / 60:.1f} min of wall time in all ({LAUNCH_LOG})")
    timed = [r for r in launches if "wall_s" in r and "startup_s" in r]
    if timed:
        phases = ("startup_s", "setup_s", "train_s", "export_s")
        means = ", ".join(f"{p[:-2]} {sum(r.get(p, 0) for r in timed) / len(timed):.1f} s" for p in phases)
        launcher = sum(r["wall_s"] - r["wall_s_rank0"] for r in timed) / len(timed)
        write(f"mean of the {len(timed)} that trained to the end: {means}, rank 0's; the launcher and teardown "
              f"{launcher:.1f} s")  # fmt: skip
    for r in sorted(launches, key=lambda r: -r["wall_s"])[:10]:
        write(f"{r['wall_s']:7.1f} s  {r['launcher']} {r['config'] or ''} {r['script']}  {r['test']}")


# SHARDGPT_TEST_BUDGET_S: a session's time budget in seconds (.ci/run gives the matrix cells what CI's limit leaves).
# A test that would start past it is skipped, saying so; one already running finishes.
BUDGET_S = float(os.environ.get("SHARDGPT_TEST_BUDGET_S") or 0)
STARTED = time.monotonic()


def pytest_runtest_setup(item):
    if BUDGET_S and time.monotonic() - STARTED > BUDGET_S:
        pytest.skip(f"past this session's time budget (SHARDGPT_TEST_BUDGET_S={BUDGET_S:.0f} s)")


@pytest.fixture(autouse=True)
def _seed():
    import torch

    torch.manual_seed(0)


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist reads the groups off the markers
def pytest_collection_modifyitems(config, items):
    """Under pytest-xdist (`make test` runs 2 workers): the tests that launch ranks (marked `multiproc`) form one
    group that one worker runs one after another, so that two launches never share the 2 cores; the in-process tests
    and the one-process launches take the other worker meanwhile."""
    for item in items:
        if item.get_closest_marker("multiproc"):
            item.add_marker(pytest.mark.xdist_group("launches"))


def pytest_configure(config):
    if hasattr(config, "workerinput"):  # a pytest-xdist worker: one core of its own; the other runs the launches
        import torch

        torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _current_test(request):
    """The running test, for `launching.launch`'s check that a test launching ranks is marked `multiproc`."""
    import launching

    launching.CURRENT_TEST = request.node
    yield
    launching.CURRENT_TEST = None


@pytest.fixture(scope="session")
def corpus(tmp_path_factory) -> dict:
    """A small text corpus, its trained tokenizer and packed cache, built once for every launch."""
    from data import DataArguments, prepare_data

    root = tmp_path_factory.mktemp("corpus")
    rng = random.Random(0)
    words = ["def", "class", "return", "import", "for", "while", "if", "else", "print", "self", "value"]
    words += ["index", "list", "dict", "None", "True"]
    lines = [" ".join(rng.choice(words) for _ in range(rng.randint(5, 40))) for _ in range(3000)]
    (root / "train.txt").write_text("\n".join(lines[:2800]) + "\n")
    (root / "valid.txt").write_text("\n".join(lines[2800:]) + "\n")
    args = dict(
        train_file=str(root / "train.txt"), validation_file=str(root / "valid.txt"),
        tokenizer_vocab_size=300, block_size=64, cache_dir=str(root / "cache"),
    )  # fmt: skip
    prepare_data(DataArguments(**args))
    flags = [f"--{k}={v}" for k, v in args.items()]
    return {"root": root, "flags": flags}


@pytest.fixture
def fresh_dir(tmp_path):
    path = tmp_path / "out"
    yield path
    shutil.rmtree(path, ignore_errors=True)

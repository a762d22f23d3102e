"""What a core launch loads: the project modules (and their lines) a one-step launch of one process, DDP, FSDP2 and
ZeRO-2 imports, whether any model-parallel axis's runtime is among them, and how often each rank opens the DeepSpeed
JSON.

    python recipes/measure/launch_imports.py                 # the four launches, 2 CPU ranks each but one process
    python recipes/measure/launch_imports.py --modules       # and every module each imports, with its lines

Each launch runs `recipes/train.py --preset debug --max_steps 1` as a user would (`python`, or `accelerate launch
--config_file accelerate_configs/<config>.yaml`) under `PYTHONPROFILEIMPORTTIME=1`, whose lines name every module a
rank imports; an audit hook (`sys.addaudithook`, put in each rank by a `sitecustomize` on PYTHONPATH) counts the
rank's opens of JSON files under ds_configs/. The axes' runtimes are the modules of training/axes/ but its table
(training/axes/table.py) and the pipeline schedules' facts (training/axes/pipeline/schedules.py).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
PACKAGES = ("training", "data", "model", "recipes")
PLAIN_AXES = {"training.axes", "training.axes.table", "training.axes.pipeline", "training.axes.pipeline.schedules"}
LAUNCHES = {"one process": None, "ddp.yaml": "ddp", "fsdp.yaml": "fsdp", "zero2.yaml": "zero2"}
HOOK = """import os, sys
if os.environ.get("RANK") is not None or os.environ.get("SHARDGPT_COUNT_SINGLE"):
    path = os.path.join(os.environ["SHARDGPT_OPENS_DIR"], "rank" + os.environ.get("RANK", "0"))
    open(path, "w").close()
    def count(event, args):  # appended at each open: the ranks leave by os._exit, past any atexit hook
        if event == "open" and str(args[0]).endswith(".json") and "ds_configs" in str(args[0]) and args[0] != path:
            with open(path, "a") as f:
                f.write(str(args[0]) + "\\n")
    sys.addaudithook(count)
"""


def module_lines(name: str) -> int:
    path = ROOT / Path(*name.split("."))
    file = path.with_suffix(".py") if path.with_suffix(".py").is_file() else path / "__init__.py"
    return len(file.read_text().splitlines()) if file.is_file() else 0


def launch(config: str | None, scratch: Path) -> dict:
    """One one-step launch: its project modules and each rank's opens of a DeepSpeed JSON."""
    out, opens = scratch / f"run-{config or 'single'}", scratch / f"opens-{config or 'single'}"
    opens.mkdir()
    (scratch / "hook").mkdir(exist_ok=True)
    (scratch / "hook" / "sitecustomize.py").write_text(HOOK)
    flags = ["--preset", "debug", "--max_steps", "1", "--eval_steps", "0", "--save_steps", "0",
             "--sample_max_new_tokens", "0", "--output_dir", str(out)]  # fmt: skip
    script = str(ROOT / "recipes" / "train.py")
    if config is None:
        cmd = [sys.executable, script, *flags]
    else:
        cmd = [str(BIN / "accelerate"), "launch", "--config_file", str(ROOT / "accelerate_configs" / f"{config}.yaml"),
               "--num_processes", "2", script, *flags]  # fmt: skip
    env = {**os.environ, "PYTHONPROFILEIMPORTTIME": "1", "SHARDGPT_OPENS_DIR": str(opens), "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(scratch / "hook"), os.environ.get("PYTHONPATH", "")]),
           "SHARDGPT_COUNT_SINGLE": "1" if config is None else ""}  # fmt: skip
    run = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    if run.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed ({run.returncode}):\n{run.stderr[-3000:]}")
    names = set(re.findall(r"^import time:\s+\d+ \|\s+\d+ \|\s*(\S+)", run.stderr, re.M))
    modules = sorted(n for n in names if n.split(".")[0] in PACKAGES and module_lines(n))
    per_rank = {p.name: len(p.read_text().splitlines()) for p in sorted(opens.glob("rank*"))}
    return {"modules": modules, "lines": sum(module_lines(n) for n in modules),
            "axes_runtimes": [n for n in modules if n.startswith("training.axes") and n not in PLAIN_AXES],
            "json_opens_per_rank": per_rank}  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--modules", action="store_true", help="list every module each launch imports, with its lines")
    p.add_argument("--json", action="store_true", help="print the measurements as JSON")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        found = {name: launch(config, Path(tmp)) for name, config in LAUNCHES.items()}
    if args.json:
        print(json.dumps(found, indent=2))
        return
    print(f"{'launch':<12} {'modules':>7} {'lines':>7}  axes' runtimes  DeepSpeed JSON opens per rank")
    for name, f in found.items():
        opens = ", ".join(f"{rank} {n}" for rank, n in f["json_opens_per_rank"].items()) or "-"
        axes = ", ".join(f["axes_runtimes"]) or "none"
        print(f"{name:<12} {len(f['modules']):>7} {f['lines']:>7}  {axes:<14}  {opens}")
        if args.modules:
            print("\n".join(f"    {m} {module_lines(m)}" for m in f["modules"]))


if __name__ == "__main__":
    main()

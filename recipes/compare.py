"""One command compares every strategy: same model, data and global batch, each in its own process group.

    python recipes/compare.py --preset debug --strategies all --steps 20 --nproc 2
    python recipes/compare.py --strategies ddp,zero2,fsdp --steps 5 --output_dir runs/quick \\
        --train_file 'corpus/*.txt' --tokenizer_vocab_size 300 --block_size 64
    python recipes/compare.py --strategies ddp,fsdp,zero2 --precisions fp32,bf16   # every strategy in both

With `--precisions`, every strategy runs once per precision ("ddp bf16", "ddp fp32", ...): the loss difference
is taken from DDP in the same precision, and a column gives each run's difference from the same strategy in fp32
(what bf16 costs in loss; docs/precision.md).

Every single-node config of `accelerate_configs/` (or the names given) is launched with `accelerate launch`
under a hard timeout and a free port, then, when `recipes/trainer.py` exists, the HF Trainer path for ZeRO-2
and ZeRO-3 with `torchrun --deepspeed`. The report folder holds `report.md` (a table with throughput, MFU,
step time, memory per rank, checkpoint size, save and load time, final loss and the loss difference from
DDP, plus the memory planner's prediction when `recipes/plan_memory.py` exists), `results.json`, PNG plots
(memory, throughput, loss curves) and each run's logs under `runs/`. A strategy that fails is reported with
its error; the others still run. Unrecognised flags are passed to every training launch (data flags,
`--block_size`, `--learning_rate`, `--bf16`, ...).

How each number is measured (the report repeats it):
- tokens/s and step time: medians over the logged steps after the first (logging every step); the training
  script times the training step only (no evaluation, saving or start-up).
- peak memory per rank: every worker's resident host memory, sampled by this script every 0.25 s over the
  whole run (start-up, training, save, export); on GPUs also `torch.cuda.max_memory_allocated` of rank 0.
- checkpoint: the run saves once, at its last step (`--save_steps STEPS`). Size: the bytes under
  `checkpoint-STEPS/`. Save time: from the last write of `metrics.jsonl` (the final evaluation, just
  before the save) to the checkpoint's completion marker, which is written after every rank's shard.
- load time: a second launch resumes from that checkpoint for one more step; the time between its log lines
  "strategy in force" and "resumed from" is `load_checkpoint` (rank 0's clock, millisecond log stamps).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
CONFIGS = ROOT / "accelerate_configs"
# Row order of the report: the baselines first, then by how much is sharded.
ORDER = [
    "single", "ddp", "fsdp_shard_grad_op", "fsdp", "fsdp_offload", "zero1", "zero2", "zero2_offload", "zero3",
    "zero3_offload_cpu", "zero3_offload_nvme",
]  # fmt: skip
# Left out of "all": their tensor-parallel ranks share a batch, so with the same micro batch they would train on
# 1/tp of the others' global batch (autotp), or they are refused (fsdp_tp: docs/strategies.md).
TENSOR_PARALLEL = ("autotp", "fsdp_tp")
TRAINER_STAGES = ("zero2", "zero3")  # run also through recipes/trainer.py when it exists
# Flags this script sets on every launch; passing them through would break the comparison.
OWNED = (
    "output_dir", "max_steps", "save_steps", "logging_steps", "resume_from_checkpoint", "overwrite_output_dir",
    "preset", "per_device_train_batch_size", "gradient_accumulation_steps", "deepspeed", "save_total_limit",
)  # fmt: skip
SAMPLE_EVERY_S = 0.25
LOG_STAMP = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) INFO (strategy in force|resumed from)")


# ---------------------------------------------------------------------------------------------- the runs


@dataclass
class Spec:
    """One row of the report: what to launch."""

    name: str
    launcher: str  # "accelerate" or "torchrun"
    script: Path
    config: Path | None = None  # the accelerate YAML
    deepspeed: str | None = None  # the DeepSpeed JSON (torchrun)
    nproc: int = 2
    error: str | None = None  # why it cannot be launched at all
    precision: str | None = None  # with --precisions: fp32, bf16 or fp16, also the end of `name`

    @property
    def launcher_label(self) -> str:
        return f"{'torchrun' if self.launcher == 'torchrun' else 'accelerate'} + {self.script.name}"

    @property
    def uses_train_py(self) -> bool:
        return self.script.name == "train.py"


@dataclass
class Result:
    name: str
    launcher: str
    command: str
    precision: str | None = None
    ok: bool = False
    error: str | None = None
    strategy: str | None = None  # the strategy in force (strategy.json)
    local_parameter_fraction: float | None = None
    world_size: int | None = None
    tokens_per_sec: float | None = None
    mfu: float | None = None
    step_time_s: float | None = None
    peak_rss_gb: list[float] = field(default_factory=list)  # per rank, sampled
    train_rss_gb: float | None = None  # rank 0, max over the logged steps
    gpu_max_allocated_gb: float | None = None  # rank 0
    predicted_gb: float | None = None
    prediction: dict | None = None
    prediction_note: str | None = None
    checkpoint_mb: float | None = None
    save_s: float | None = None
    load_s: float | None = None
    load_note: str | None = None
    final_loss: float | None = None
    final_eval_loss: float | None = None
    loss_diff_vs_ddp: float | None = None
    loss_diff_vs_fp32: float | None = None  # with --precisions: from the same strategy in fp32
    losses: dict[int, float] = field(default_factory=dict)
    wall_s: float | None = None
    load_average: float | None = None  # the machine's 1-minute load average as the run ended

    @property
    def peak_memory_gb(self) -> float | None:
        """The memory plotted and compared with the planner: GPU allocated on GPUs, host RSS otherwise."""
        if self.gpu_max_allocated_gb is not None:
            return self.gpu_max_allocated_gb
        return max(self.peak_rss_gb) if self.peak_rss_gb else self.train_rss_gb


def single_node_configs() -> list[str]:
    """The accelerate configs that run on one machine, in report order."""
    from recipes.doctor import read_launch_config

    names = [
        p.stem
        for p in CONFIGS.glob("*.yaml")
        if read_launch_config(p).get("num_machines", 1) == 1 and p.stem not in TENSOR_PARALLEL
    ]
    return sorted(names, key=lambda n: (ORDER.index(n) if n in ORDER else len(ORDER), n))


def make_specs(strategies: str, nproc: int, trainer: bool) -> list[Spec]:
    from recipes.doctor import read_launch_config

    script = ROOT / "recipes" / "train.py"
    names = single_node_configs() if strategies == "all" else [s.strip() for s in strategies.split(",") if s.strip()]
    specs = []
    for name in names:
        path = Path(name) if name.endswith((".yaml", ".yml")) else CONFIGS / f"{name}.yaml"
        label = path.stem if name.endswith((".yaml", ".yml")) else name
        spec = Spec(label, "accelerate", script, config=path, nproc=nproc)
        if not path.is_file():
            known = ", ".join(single_node_configs())
            spec.error = (
                f"no such config {path.relative_to(ROOT) if path.is_relative_to(ROOT) else path}; known: {known}"
            )
        else:
            launch = read_launch_config(path)
            if launch.get("num_machines", 1) != 1:
                spec.error = (
                    f"{path.name} is a multi-node config ({launch['num_machines']} machines): launch it per node"
                )
            elif launch.get("num_processes", 1) == 1 or launch.get("distributed_type") == "NO":
                spec.nproc = 1  # one process: its micro batch is scaled up to keep the global batch
        specs.append(spec)
    trainer_script = ROOT / "recipes" / "trainer.py"
    if trainer and trainer_script.is_file():
        for stage in TRAINER_STAGES:
            if stage in names:
                specs.append(
                    Spec(
                        f"{stage} (HF Trainer)",
                        "torchrun",
                        trainer_script,
                        deepspeed=f"ds_configs/{stage}.json",
                        nproc=nproc,
                    )
                )
    return specs


PRECISION_FLAGS = {"fp32": [], "bf16": ["--bf16"], "fp16": ["--fp16"]}


def per_precision(specs: list[Spec], precisions: list[str]) -> list[Spec]:
    """Each spec once per precision, named "<strategy> <precision>"."""
    return [replace(s, name=f"{s.name} {p}", precision=p) for s in specs for p in precisions]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_command(spec: Spec, port: int | None) -> list[str]:
    """The launcher's command line; without a port, as shown in the report (the launcher by its name)."""
    exe = (lambda name: str(BIN / name)) if port else (lambda name: name)
    script = str(spec.script) if port else rel(spec.script)
    if spec.launcher == "torchrun":
        return [exe("torchrun"), f"--nproc_per_node={spec.nproc}", *([f"--master_port={port}"] if port else []), script]
    return [
        exe("accelerate"), "launch", "--config_file", str(spec.config) if port else rel(spec.config),
        "--num_processes", str(spec.nproc), *(["--main_process_port", str(port)] if port else []), script,
    ]  # fmt: skip


def train_flags(args, spec: Spec, extra: list[str]) -> list[str]:
    """The same model, data and global batch for every spec (a single process takes the whole batch)."""
    micro = args.per_device_train_batch_size * (args.nproc // spec.nproc)
    flags = [
        f"--preset={args.preset}", f"--max_steps={args.steps}", f"--per_device_train_batch_size={micro}",
        f"--gradient_accumulation_steps={args.gradient_accumulation_steps}", "--logging_steps=1",
        f"--warmup_steps={args.steps // 10}", "--eval_steps=0", "--max_eval_batches=4", "--sample_max_new_tokens=0",
        f"--save_steps={0 if args.no_save else args.steps}", "--save_total_limit=1",
    ]  # fmt: skip
    if spec.deepspeed:
        flags.append(f"--deepspeed={spec.deepspeed}")
    flags += PRECISION_FLAGS[spec.precision] if spec.precision else []
    return [*flags, *extra]  # later flags win: the passed-through ones override the defaults above


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


def read_records(out: Path) -> list[dict]:
    path = out / "metrics.jsonl"
    return [json.loads(s) for s in path.read_text().splitlines() if s.strip()] if path.exists() else []


def median_after_first(records: list[dict], key: str) -> float | None:
    values = [r[key] for r in records if r.get(key) is not None]
    values = values[1:] if len(values) > 1 else values  # the first step pays for warm-up and allocation
    return statistics.median(values) if values else None


def dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def checkpoint_measures(out: Path, steps: int) -> tuple[float | None, float | None]:
    """(size in MB, save seconds) of the checkpoint written at the last step, see the module docstring."""
    ckpt = out / f"checkpoint-{steps}"
    if not ckpt.is_dir():
        return None, None
    size = dir_bytes(ckpt) / 1e6
    marker, metrics = ckpt / "checkpoint_complete", out / "metrics.jsonl"
    if not (marker.is_file() and metrics.is_file()):
        return size, None
    dt = marker.stat().st_mtime - metrics.stat().st_mtime
    return size, (dt if dt >= 0 else None)


def load_seconds(stderr: str) -> float | None:
    stamps = {}
    for line in stderr.splitlines():
        m = LOG_STAMP.match(line)
        if m:
            stamps[m.group(2)] = datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f")
    if {"strategy in force", "resumed from"} <= stamps.keys():
        return (stamps["resumed from"] - stamps["strategy in force"]).total_seconds()
    return None


def run_spec(spec: Spec, args, extra: list[str], runs: Path) -> Result:
    out = runs / spec.name.replace(" ", "_").replace("(", "").replace(")", "")
    cmd = launch_command(spec, free_port())
    flags = train_flags(args, spec, extra)
    nvme = None
    if not any(f.startswith("--nvme_path") for f in extra):
        nvme = out.parent / f"{out.name}.nvme"
        flags.append(f"--nvme_path={nvme}")
    shown = " ".join([*launch_command(spec, None), *flags, f"--output_dir={out}"]).replace(f"{ROOT}{os.sep}", "")
    res = Result(spec.name, spec.launcher_label, shown, spec.precision)
    if spec.error:
        res.error = spec.error
        return res
    for path in (out, out.with_name(out.name + "-resume")):
        shutil.rmtree(path, ignore_errors=True)
    if nvme is not None:
        nvme.mkdir(parents=True, exist_ok=True)
    try:
        run = run_process([*cmd, *flags, f"--output_dir={out}"], out, args.timeout, spec.script)
        res.wall_s, res.load_average = round(run.wall_s, 2), round(os.getloadavg()[0], 2)
        if run.error:
            res.error = run.error
            return res
        collect(res, out, run.sampler, args)
        if not spec.uses_train_py:
            res.load_note = f"save and load not timed: {spec.script.name} logs no save or resume boundary"
        elif not args.no_save and not args.no_resume:
            measure_load(res, spec, flags, out, args)
        res.ok = True
        return res
    finally:
        if nvme is not None:
            shutil.rmtree(nvme, ignore_errors=True)
        if not args.keep_checkpoints:  # measured: the weights can be large, the logs and metrics stay
            for path in (*out.glob("checkpoint-*"), *out.glob("*.safetensors")):
                shutil.rmtree(path, ignore_errors=True) if path.is_dir() else path.unlink()


def collect(res: Result, out: Path, sampler: Sampler, args) -> None:
    records = read_records(out)
    train = [r for r in records if "loss" in r]
    res.losses = {r["step"]: r["loss"] for r in train}
    res.final_loss = train[-1]["loss"] if train else None
    evals = [r["eval_loss"] for r in records if "eval_loss" in r]
    res.final_eval_loss = evals[-1] if evals else None
    res.tokens_per_sec = median_after_first(train, "tokens_per_sec")
    res.step_time_s = median_after_first(train, "step_time_s")
    res.mfu = median_after_first(train, "mfu")
    rss = [r["cpu_rss_gb"] for r in train if r.get("cpu_rss_gb") is not None]
    res.train_rss_gb = max(rss) if rss else None
    gpu = [r["gpu_max_allocated_gb"] for r in train if r.get("gpu_max_allocated_gb") is not None]
    res.gpu_max_allocated_gb = max(gpu) if gpu else None
    res.peak_rss_gb = sampler.per_rank_gb()
    if (out / "strategy.json").is_file():
        seen = json.loads((out / "strategy.json").read_text())
        res.strategy, res.world_size = seen.get("strategy"), seen.get("world_size")
        res.local_parameter_fraction = seen.get("local_parameter_fraction")
    res.checkpoint_mb, res.save_s = checkpoint_measures(out, args.steps)
    predict_memory(res, out, args)


def measure_load(res: Result, spec: Spec, flags: list[str], out: Path, args) -> None:
    """A second launch resumes from the checkpoint for one more step; see the module docstring."""
    ckpt = out / f"checkpoint-{args.steps}"
    if not ckpt.is_dir():
        res.load_note = "no checkpoint to resume from"
        return
    resume_out = out.with_name(out.name + "-resume")
    more = [f"--resume_from_checkpoint={ckpt}", f"--max_steps={args.steps + 1}", "--save_steps=0"]
    cmd = launch_command(spec, free_port())
    run = run_process([*cmd, *flags, *more, f"--output_dir={resume_out}"], resume_out, args.timeout, spec.script)
    if run.error:
        res.load_note = f"resume failed: {run.error}"
        return
    res.load_s = load_seconds(run.stderr)
    if res.load_s is None:
        res.load_note = "the launch does not log 'strategy in force' / 'resumed from'"
    if not any(r.get("step") == args.steps + 1 for r in read_records(resume_out)):
        res.load_note = f"the resumed run logged no step {args.steps + 1}"
    (resume_out / "model.safetensors").unlink(missing_ok=True)


def predict_memory(res: Result, out: Path, args) -> None:
    """The memory planner's prediction for this run, when `recipes/plan_memory.py` exists."""
    try:
        from recipes.plan_memory import predict
    except ImportError:
        res.prediction_note = "recipes/plan_memory.py not found"
        return
    if res.strategy == "single":
        res.prediction_note = "single: the planner models multi-rank strategies only"
        return
    try:
        import model as shardgpt

        config = shardgpt.ShardGPTConfig.from_pretrained(out)
        run = json.loads((out / "run_config.json").read_text())
        ds = json.loads((out / "ds_config.json").read_text()) if (out / "ds_config.json").is_file() else None
        precision = "bf16" if run["bf16"] else "fp16" if run["fp16"] else "fp32"
        pred = predict(
            config, res.strategy, res.world_size, precision, run["per_device_train_batch_size"], run["block_size"],
            run["gradient_checkpointing"], ds_config=ds,
        )  # fmt: skip
        res.prediction = {k: v for k, v in pred.items() if k != "detail"}
        # On GPUs the planner's "total" is the GPU's share; on CPU ranks the host holds that and the offload too.
        on_host = pred.get("host_ram", 0) if config_device() == "cpu" else 0
        res.predicted_gb = (pred["total"] + on_host) / 1e9
    except Exception as e:  # the planner is another module: its failure must not lose the measurement
        res.prediction_note = f"plan_memory.predict failed: {type(e).__name__}: {e}"


def config_device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def strategy_of(r: Result) -> str:
    return r.name.removesuffix(f" {r.precision}") if r.precision else r.name


def baseline(results: list[Result], strategy: str, precision: str | None) -> Result | None:
    """The run of `strategy` in `precision` that a run is compared with (None: it did not run). DDP's own row is
    compared with itself: 0, as the report has always shown it."""
    found = (b for b in results if b.ok and strategy_of(b) == strategy and b.precision == precision)
    return next(found, None)


def max_loss_difference(r: Result, base: Result | None) -> float | None:
    common = sorted(set(r.losses) & set(base.losses)) if base and r.ok else []
    return max(abs(r.losses[s] - base.losses[s]) for s in common) if common else None


def add_loss_differences(results: list[Result]) -> None:
    for r in results:
        r.loss_diff_vs_ddp = max_loss_difference(r, baseline(results, "ddp", r.precision))
        if r.precision not in (None, "fp32"):
            r.loss_diff_vs_fp32 = max_loss_difference(r, baseline(results, strategy_of(r), "fp32"))


def rel(path: Path) -> str:
    path = Path(path)
    return str(path.relative_to(ROOT)) if path.is_absolute() and path.is_relative_to(ROOT) else str(path)


# ---------------------------------------------------------------------------------------------- the report


def fmt(v, spec: str = ".3g", none: str = "n/a") -> str:
    if v is None or (isinstance(v, float) and not math.isfinite(v)):
        return none
    return format(v, spec)


def load_range(results: list[Result]) -> str:
    loads = [r.load_average for r in results if r.load_average is not None]
    return f"{min(loads):.1f} to {max(loads):.1f}" if loads else "n/a"


def table(results: list[Result]) -> str:
    gpu = any(r.gpu_max_allocated_gb is not None for r in results)
    planned = any(r.predicted_gb is not None for r in results)
    head = ["strategy", "launcher", "in force (params/rank)", "tokens/s", "MFU", "step time (s)"]
    head += ["GPU max alloc. rank 0 (GB)"] * gpu + ["peak RSS per rank (GB)"] + ["predicted (GB)"] * planned
    precisions = any(r.precision for r in results)
    head += ["checkpoint (MB)", "save (s)", "load (s)", "final loss"]
    head += ["max abs loss diff vs ddp" + " (same precision)" * precisions] + ["max abs loss diff vs fp32"] * precisions
    rows = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in results:
        if not r.ok:
            err = (r.error or "failed").replace("|", "\\|")[:240]
            cells = [r.name, r.launcher, f"**FAILED**: {err}"] + [""] * (len(head) - 3)
        else:
            held = f"{r.strategy} ({fmt(100 * r.local_parameter_fraction, '.0f')}%)" if r.strategy else "n/a"
            cells = [
                r.name,
                r.launcher,
                held,
                fmt(r.tokens_per_sec, ",.0f"),
                fmt(r.mfu, ".1%"),
                fmt(r.step_time_s, ".4f"),
            ]
            cells += [fmt(r.gpu_max_allocated_gb, ".3f")] * gpu
            cells += [" / ".join(f"{v:.3f}" for v in r.peak_rss_gb) or fmt(r.train_rss_gb, ".3f")]
            cells += [fmt(r.predicted_gb, ".3f")] * planned
            cells += [fmt(r.checkpoint_mb, ".2f"), fmt(r.save_s, ".3f"), fmt(r.load_s, ".3f")]
            cells += [fmt(r.final_loss, ".4f"), fmt(r.loss_diff_vs_ddp, ".1e")]
            cells += [fmt(r.loss_diff_vs_fp32, ".1e", none="")] * precisions
        rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows)


def write_report(results: list[Result], args, extra: list[str], out: Path, machine: dict, plots: list[str]) -> None:
    planner_notes = [f"- {r.name}: {r.prediction_note}" for r in results if r.prediction_note]
    load_notes = [f"- {r.name}: {r.load_note}" for r in results if r.load_note]
    on_gpu = machine["device"] != "cpu"
    lines = [
        "# Strategy comparison",
        "",
        f"Command: `{args.invocation}`",
        "",
        f"Machine: {machine['device_name']}, {machine['cpus']} CPU cores, torch {machine['torch']}, "
        f"deepspeed {machine['deepspeed']}, {machine['date']}. Preset `{args.preset}`, {args.steps} steps, "
        f"{args.nproc} ranks x micro batch {args.per_device_train_batch_size} x accumulation "
        f"{args.gradient_accumulation_steps} (a one-process config takes the whole global batch). "
        f"1-minute load average as each run ended: {load_range(results)} (its own {args.nproc} ranks count "
        f"{args.nproc}; more means other work shared the machine and the throughput is noisier).",
        "",
        table(results),
        "",
        "How the columns are measured:",
        "",
        "- **in force**: the strategy the training script verified after `prepare` and read from the prepared "
        "objects at its first step (`strategy.json`), and the share of the parameters one rank holds.",
        "- **tokens/s**, **step time**, **MFU**: medians over the logged steps after the first (the script "
        "times the training step only, logging every step); MFU is n/a on CPU (no peak FLOP/s).",
        "- **peak RSS per rank**: each worker's resident host memory, sampled every "
        f"{SAMPLE_EVERY_S} s over the whole run (start-up, training, save, export), ranks in order. It includes "
        "the Python, torch and DeepSpeed runtime of each process, so on a small model the differences between "
        "strategies are a small part of it."
        + (" **GPU max alloc.**: `torch.cuda.max_memory_allocated` on rank 0, from `metrics.jsonl`." if on_gpu else ""),
        "- **checkpoint**: the bytes of `checkpoint-<steps>/`, saved once at the last step; **save**: from the "
        "last write of `metrics.jsonl` (the final evaluation, just before the save) to the checkpoint's "
        "completion marker (written after every rank's shard): the whole `save_checkpoint` call, file mtimes.",
        "- **load**: a second launch resumes from that checkpoint for one more step; the time between its "
        "log lines `strategy in force` and `resumed from` (rank 0, millisecond stamps) is `load_checkpoint`.",
        "- **max abs loss diff vs ddp**: the largest |loss - DDP's loss| over every logged step.",
    ]
    if any(r.predicted_gb is not None for r in results):
        where = "the GPU's share" if on_gpu else "everything one rank holds in host memory (GPU share + offload)"
        lines += [
            "",
            f"**predicted**: `recipes/plan_memory.predict(...)`, {where}, for the run's model, strategy, world "
            "size, precision, micro batch and sequence length: model states, activations, logits and temporary "
            "buffers. It does not count the runtime (Python, torch, DeepSpeed, the data) that RSS includes.",
        ]
    if planner_notes:
        lines += ["", "Memory planner notes:", "", *planner_notes]
    if load_notes:
        lines += ["", "Load-time notes:", "", *load_notes]
    if extra:
        lines += ["", f"Flags passed to every launch: `{' '.join(extra)}`"]
    lines += ["", "Each run's exact command, logs and metrics: `results.json` and `runs/`.", ""]
    lines += [f"![{p}]({p})" for p in plots]
    (out / "report.md").write_text("\n".join(lines) + "\n")


def plot(results: list[Result], out: Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    ok = [r for r in results if r.ok]
    if not ok:
        return []
    names = [r.name.replace(" (HF Trainer)", "\n(Trainer)") for r in ok]
    x = list(range(len(ok)))
    files = []
    on_gpu = any(r.gpu_max_allocated_gb is not None for r in ok)

    fig, ax = plt.subplots(figsize=(8, 4))
    measured = [r.peak_memory_gb or 0 for r in ok]
    predicted = [r.predicted_gb for r in ok]
    width = 0.4 if any(p is not None for p in predicted) else 0.7
    label = "measured: GPU max allocated, rank 0" if on_gpu else "measured: peak RSS (incl. runtime), largest rank"
    bars = ax.bar([i - width / 2 * (width < 0.7) for i in x], measured, width, label=label, color="tab:blue")
    ax.bar_label(bars, fmt="%.2f", fontsize=7)
    if width < 0.7:
        known = [(i, p) for i, p in zip(x, predicted, strict=True) if p is not None]
        xs, ys = [i + width / 2 for i, _ in known], [p for _, p in known]
        bars = ax.bar(xs, ys, width, label="planner: model states + activations", color="tab:orange")
        ax.bar_label(bars, fmt="%.2f", fontsize=7)
    ax.set_ylabel("GB per rank")
    ax.set_title("Peak memory per rank")
    finish(ax, x, names, fig, out / "memory.png", legend=True)
    files.append("memory.png")

    fig, ax = plt.subplots(figsize=(8, 4))
    bars = ax.bar(x, [r.tokens_per_sec or 0 for r in ok], 0.7, color="tab:green")
    ax.bar_label(bars, fmt="%.0f", fontsize=7)
    ax.set_ylabel("tokens/s (median)")
    ax.set_title("Training throughput, all ranks together")
    finish(ax, x, names, fig, out / "throughput.png")
    files.append("throughput.png")

    ddp = next((r for r in ok if strategy_of(r) == "ddp"), None)
    fig, axes = plt.subplots(2 if ddp else 1, 1, figsize=(8, 6 if ddp else 4), sharex=True, squeeze=False)
    styles, colors = ["-", "--", ":", "-."], plt.get_cmap("tab20").colors
    for i, r in enumerate(ok):  # one color and line style per strategy, the same in both panels
        look = dict(linestyle=styles[i % 4], color=colors[(2 * i) % 20 + (2 * i) // 20 % 2])
        steps = sorted(r.losses)
        axes[0][0].plot(steps, [r.losses[s] for s in steps], label=r.name, linewidth=1.2, **look)
        base = baseline(ok, "ddp", r.precision)
        if base is not None and base is not r:  # DDP's own difference is 0 everywhere: nothing to draw
            common = [s for s in steps if s in base.losses]
            diffs = [max(abs(r.losses[s] - base.losses[s]), 1e-10) for s in common]
            axes[1][0].plot(common, diffs, marker=".", linewidth=1, **look)
    axes[0][0].set_ylabel("training loss")
    axes[0][0].set_title("Loss curves (the strategies train the same model: the curves overlap)")
    axes[0][0].legend(fontsize=7, ncol=3)
    if ddp:
        axes[1][0].set_yscale("log")
        axes[1][0].set_ylabel("|loss - DDP loss|")
        same = " in the same precision" if ddp.precision else ""
        axes[1][0].set_title(f"Difference from DDP's loss{same} (drawn at 1e-10 where bitwise equal)", fontsize=9)
    axes[-1][0].set_xlabel("step")
    axes[-1][0].xaxis.set_major_locator(MaxNLocator(integer=True))
    for ax in axes[:, 0]:
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out / "loss.png", dpi=90)
    plt.close(fig)
    files.append("loss.png")
    return files


def finish(ax, x, names, fig, path: Path, legend: bool = False) -> None:
    import matplotlib.pyplot as plt

    ax.set_xticks(x, names, rotation=30, ha="right", fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    ax.margins(y=0.15)
    if legend:
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def machine_info() -> dict:
    import deepspeed
    import torch

    gpu = torch.cuda.is_available()
    return {
        "device": "cuda" if gpu else "cpu",
        "device_name": f"{torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}"
        if gpu
        else platform.processor() or platform.machine(),
        "cpus": os.cpu_count(),
        "torch": torch.__version__,
        "deepspeed": deepspeed.__version__,
        "python": platform.python_version(),
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
    }


# ---------------------------------------------------------------------------------------------- main


def parse_args(argv: list[str] | None):
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], epilog="Other flags are passed to every training launch."
    )
    p.add_argument("--preset", default="debug", help="Model size (train.py --preset).")
    p.add_argument(
        "--strategies", default="all", help="'all' (every single-node config) or names/YAML paths, comma-separated."
    )
    p.add_argument("--steps", type=int, default=20, help="Optimizer steps per run.")
    p.add_argument("--nproc", type=int, default=2, help="Ranks per run (GPUs, or CPU processes).")
    p.add_argument("--per_device_train_batch_size", type=int, default=4, help="Micro batch per rank.")
    p.add_argument("--gradient_accumulation_steps", type=int, default=1)
    p.add_argument("--output_dir", default="runs/compare", help="The report folder.")
    p.add_argument("--timeout", type=float, default=900, help="Hard limit per launch, seconds.")
    p.add_argument("--no_save", action="store_true", help="Skip the checkpoint (and load) measurement.")
    p.add_argument("--no_resume", action="store_true", help="Skip the second launch that times the load.")
    p.add_argument(
        "--no_trainer", action="store_true", help="Skip the HF Trainer path even if recipes/trainer.py exists."
    )
    p.add_argument(
        "--precisions", default=None, help="Run every strategy in each of these, comma-separated: fp32, bf16, fp16."
    )
    p.add_argument("--keep_checkpoints", action="store_true", help="Keep each run's checkpoint and exported weights.")
    args, extra = p.parse_known_args(argv)
    extra = [e for e in extra if e != "--"]
    for flag in extra:
        name = flag.lstrip("-").split("=")[0]
        if flag.startswith("--") and name in OWNED:
            p.error(f"--{name} is set by compare.py for every run (use its own --steps/--preset/... flags)")
    if args.precisions is not None:
        args.precisions = [x.strip() for x in args.precisions.split(",") if x.strip()]
        unknown = [x for x in args.precisions if x not in PRECISION_FLAGS]
        if unknown or not args.precisions:
            p.error(f"--precisions {unknown or 'is empty'}: choose from {', '.join(PRECISION_FLAGS)}")
        if {"--bf16", "--fp16"} & set(extra):
            p.error("--precisions sets --bf16/--fp16 for each run: do not pass them too")
    if args.steps < 1 or args.nproc < 1 or args.timeout <= 0:
        p.error("--steps, --nproc and --timeout must be positive")
    args.invocation = " ".join(["python", "recipes/compare.py", *(argv if argv is not None else sys.argv[1:])])
    return args, extra


def main(argv: list[str] | None = None) -> int:
    from tqdm.auto import tqdm

    args, extra = parse_args(argv)
    out = Path(args.output_dir).resolve()  # the launches run in the repository root
    runs = out / "runs"
    runs.mkdir(parents=True, exist_ok=True)
    specs = make_specs(args.strategies, args.nproc, not args.no_trainer)
    if args.precisions:
        specs = per_precision(specs, args.precisions)
    machine = machine_info()
    results = []
    bar = tqdm(specs, desc="compare", unit="run")
    for spec in bar:
        bar.set_postfix_str(spec.name)
        res = run_spec(spec, args, extra, runs)
        results.append(res)
        summary = f"{fmt(res.tokens_per_sec, ',.0f')} tok/s, loss {fmt(res.final_loss, '.4f')}" if res.ok else ""
        summary = summary or f"FAILED: {res.error}"
        bar.write(f"{spec.name}: {summary}")
    add_loss_differences(results)
    plots = plot(results, out)
    write_report(results, args, extra, out, machine, plots)
    payload = {
        "command": args.invocation,
        "machine": machine,
        "settings": {k: v for k, v in vars(args).items() if k != "invocation"},
        "train_flags": extra,
        "runs": [{**asdict(r), "peak_memory_gb": r.peak_memory_gb} for r in results],
    }
    (out / "results.json").write_text(json.dumps(payload, indent=2))
    print(f"report: {out / 'report.md'} ({sum(r.ok for r in results)}/{len(results)} strategies ran)")
    return 0 if any(r.ok for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())

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
its error; the others still run. A tensor-parallel config (`autotp`: DeepSpeed AutoTP) runs with a micro
batch autotp_size times larger, which its tensor-parallel ranks share: the same global batch as the others. A
pipeline is named `<config>+pp<P>` (`ddp+pp2`: 2 stages, DDP over the pipelines; `fsdp+pp2`: FSDP2 per stage): the
config's launch with --pipeline_parallel_degree P and P times the accumulation, the same global batch again.
Unrecognised flags are passed to every training launch (data flags, `--block_size`, `--learning_rate`,
`--bf16`, ...).

How each number is measured (the report repeats it):
- tokens/s and step time: medians over the logged steps after the first (logging every step); the training
  script times the training step only (no evaluation, saving or start-up).
- peak memory per rank: every worker's resident host memory, sampled by this script every 0.25 s over the
  whole run (start-up, training, save, export); on GPUs also `torch.cuda.max_memory_allocated` of rank 0.
- checkpoint: the run saves once, at its last step (`--save_steps STEPS`). Size: the bytes under
  `checkpoint-STEPS/`. Save time: the training script's own clock around the save (rank 0's, until the
  checkpoint's completion marker, written after every rank's shard), `checkpoint_save_s` in `metrics.jsonl`.
- load time: a second launch resumes from that checkpoint for one more step; the time between its log lines
  "strategy in force" and "resumed from" is `load_checkpoint` (rank 0's clock, millisecond log stamps).
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import sys
from dataclasses import asdict, replace
from datetime import datetime, timezone
from pathlib import Path

from model import PRESETS
from training.arguments import ArgumentParser
from training.compare.launches import Sampler, free_port, run_process
from training.compare.logs import checkpoint_measures, load_seconds, median_after_first, read_records
from training.compare.report import (
    PRECISION_FLAGS,
    Result,
    Spec,
    add_loss_differences,
    fmt,
    per_precision,
    plot,
    rel,
    write_report,
)
from training.paths import ROOT

BIN = Path(sys.executable).parent
CONFIGS = ROOT / "accelerate_configs"
# Row order of the report: the baselines first, then by how much is sharded.
ORDER = [
    "single", "ddp", "fsdp_shard_grad_op", "fsdp", "fsdp_offload", "zero1", "zero2", "zero2_offload", "zero3",
    "zero3_offload_cpu", "zero3_offload_nvme", "autotp",
]  # fmt: skip
# Left out of "all": composed layouts whose YAML fixes more ranks than a row's --nproc (fsdp_tp: dp_shard 2 x tp 2).
COMPOSED = ("fsdp_tp",)
TRAINER_STAGES = ("zero2", "zero3")  # run also through recipes/trainer.py when it exists
# Flags this script sets on every launch; passing them through would break the comparison.
OWNED = (
    "output_dir", "max_steps", "save_steps", "logging_steps", "resume_from_checkpoint", "overwrite_output_dir",
    "preset", "per_device_train_batch_size", "gradient_accumulation_steps", "deepspeed", "save_total_limit",
)  # fmt: skip


def single_node_configs() -> list[str]:
    """The accelerate configs that run on one machine, in report order."""
    from training.doctor.launch import read_launch_config

    names = [
        p.stem
        for p in CONFIGS.glob("*.yaml")
        if read_launch_config(p).get("num_machines", 1) == 1 and p.stem not in COMPOSED
    ]
    return sorted(names, key=lambda n: (ORDER.index(n) if n in ORDER else len(ORDER), n))


def make_specs(strategies: str, nproc: int, trainer: bool) -> list[Spec]:
    from training.axes.table import AXES, composes
    from training.doctor.launch import read_launch_config

    script = ROOT / "recipes" / "train.py"
    names = single_node_configs() if strategies == "all" else [s.strip() for s in strategies.split(",") if s.strip()]
    specs = []
    for name in names:
        config, _, pipeline = name.partition("+pp")  # `ddp+pp2`: ddp.yaml with 2 pipeline stages
        path = Path(config) if config.endswith((".yaml", ".yml")) else CONFIGS / f"{config}.yaml"
        label = f"{path.stem}+pp{pipeline}" if pipeline else path.stem if config.endswith((".yaml", ".yml")) else name
        spec = Spec(label, "accelerate", script, config=path, nproc=nproc)
        if pipeline and (not pipeline.isdigit() or int(pipeline) < 2 or nproc % int(pipeline)):
            spec.error = f"{name}: a pipeline is spelled <config>+pp<P>, P of 2 or more dividing --nproc {nproc}"
        spec.pp = int(pipeline) if pipeline.isdigit() else 1
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
            read = launched(path, spec.nproc)
            degrees = read.degrees() if read is not None else {"tp": 1, "sp": 1}
            spec.tp = degrees["tp"] * degrees["sp"]  # ranks that share one micro batch
            held_by = read.wrapper if read is not None and spec.pp > 1 else None
            if held_by is not None and not spec.error and not composes("pp", held_by):
                spec.error = (f"{name}: {AXES['pp'].name} does not train under {held_by} (it trains under "
                              f"{', '.join(AXES['pp'].trains_under)}): pick one of those configs")  # fmt: skip
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


def launched(path: Path, nproc: int):
    """What an accelerate config launches on `nproc` ranks, read as the training script reads it
    (training/launch.py's `Launched`, from the environment accelerate's launcher makes of the YAML); None where its
    DeepSpeed JSON cannot be read (the launch itself fails and reports why)."""
    from training.environment import Environment
    from training.launch import Launched

    try:
        return Launched.read(None, Environment.of_accelerate_config(path, nproc))
    except (OSError, ValueError):
        return None


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
    """The same model, data and global batch for every spec: a single process takes the whole global batch, the tp
    ranks of a tensor-parallel group share one micro batch, tp times larger, and the pp ranks of a pipeline run pp
    times the micro batches."""
    micro = args.per_device_train_batch_size * (args.nproc // spec.nproc) * spec.tp
    accumulation = args.gradient_accumulation_steps * spec.pp
    flags = [
        f"--preset={args.preset}", f"--max_steps={args.steps}", f"--per_device_train_batch_size={micro}",
        f"--gradient_accumulation_steps={accumulation}", "--logging_steps=1",
        f"--warmup_steps={args.steps // 10}", "--eval_steps=0", "--max_eval_batches=4", "--sample_max_new_tokens=0",
        f"--save_steps={0 if args.no_save else args.steps}", "--save_total_limit=1",
    ]  # fmt: skip
    if spec.deepspeed:
        flags.append(f"--deepspeed={spec.deepspeed}")
    if spec.pp > 1:
        flags.append(f"--pipeline_parallel_degree={spec.pp}")
    flags += PRECISION_FLAGS[spec.precision] if spec.precision else []
    return [*flags, *extra]  # later flags win: the passed-through ones override the defaults above


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
    seen = json.loads((out / "strategy.json").read_text()) if (out / "strategy.json").is_file() else {}
    comm = seen.get("communication")
    # The step whose collectives were counted ran slower (every operator through the counter): not timed here.
    timed = [r for r in train if not comm or r["step"] != comm["step"]]
    res.tokens_per_sec = median_after_first(timed, "tokens_per_sec")
    res.step_time_s = median_after_first(timed, "step_time_s")
    res.mfu = median_after_first(timed, "mfu")
    rss = [r["cpu_rss_gb"] for r in train if r.get("cpu_rss_gb") is not None]
    res.train_rss_gb = max(rss) if rss else None
    gpu = [r["gpu_max_allocated_gb"] for r in train if r.get("gpu_max_allocated_gb") is not None]
    res.gpu_max_allocated_gb = max(gpu) if gpu else None
    res.peak_rss_gb = sampler.per_rank_gb()
    if seen:
        res.strategy, res.world_size = seen.get("strategy"), seen.get("world_size")
        res.local_parameter_fraction = seen.get("local_parameter_fraction")
    if comm:  # the busiest rank's bytes in the counted step
        res.volume_mb, res.sent_mb = (max(r[k] for r in comm["per_rank"]) / 1e6 for k in ("volume_bytes", "wire_bytes"))
    res.checkpoint_mb, res.save_s = checkpoint_measures(out, args.steps, records)
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
        from training.plan.memory.planner import predict
    except ImportError:
        res.prediction_note = "recipes/plan_memory.py not found"
        return
    from training.strategy import Strategy

    try:
        strategy = Strategy.from_name(res.strategy, res.world_size)  # what the run recorded in strategy.json
        if strategy.family == "single" and strategy.pp_size == 1:
            res.prediction_note = "single: the planner models multi-rank strategies only"
            return
        import model as shardgpt

        config = shardgpt.ShardGPTConfig.from_pretrained(out)
        run = json.loads((out / "run_config.json").read_text())
        if strategy.pp_size > 1:  # planned stage by stage: the run's schedule and micro batches
            strategy = pipeline_strategy(strategy, run)
            if strategy is None:
                res.prediction_note = f"{res.strategy}: the planner models GPipe and 1F1B pipelines only"
                return
        ds = json.loads((out / "ds_config.json").read_text()) if (out / "ds_config.json").is_file() else None
        precision = "bf16" if run["bf16"] else "fp16" if run["fp16"] else "fp32"
        pred = predict(
            config, strategy, precision, run["per_device_train_batch_size"], run["block_size"],
            run["gradient_checkpointing"], ds_config=ds, micro_batches=run["gradient_accumulation_steps"],
        )  # fmt: skip
        res.prediction = {k: v for k, v in pred.items() if k != "detail"}
        # On GPUs the planner's "total" is the GPU's share; on CPU ranks the host holds that and the offload too.
        on_host = pred.get("host_ram", 0) if config_device() == "cpu" else 0
        res.predicted_gb = (pred["total"] + on_host) / 1e9
    except Exception as e:  # the planner is another module: its failure must not lose the measurement
        res.prediction_note = f"plan_memory.predict failed: {type(e).__name__}: {e}"


def pipeline_strategy(strategy, run: dict):
    """`strategy` with the schedule and stages per rank of the run's flags (`run_config.json`), or None where the
    planner does not model that pipeline."""
    from training.axes.pipeline.schedules import stages_per_rank
    from training.plan.memory.stages import models_pipeline

    schedule = run["pipeline_parallel_schedule"]
    per_rank = stages_per_rank(schedule, run.get("pipeline_parallel_virtual_stages"))
    strategy = replace(strategy, pp_schedule=schedule, pp_stages_per_rank=per_rank)
    return strategy if models_pipeline(strategy) else None


def config_device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


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
    p = ArgumentParser(description=__doc__.split("\n\n")[0], epilog="Other flags are passed to every training launch.")
    p.add_argument("--preset", default="debug", choices=tuple(PRESETS), help="Model size (train.py --preset).")
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

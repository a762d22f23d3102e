"""The comparison's results and how they are shown: one row per launch, loss differences from
the baseline, the markdown report and its plots.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from pathlib import Path

from training.compare.launches import SAMPLE_EVERY_S
from training.paths import ROOT

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
    tp: int = 1  # ranks that share one micro batch (each layer or each sequence split over them): tp times larger
    pp: int = 1  # pipeline stages' ranks; they share the data-parallel share, run as pp times more micro batches

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
    volume_mb: float | None = None  # a step's communication volume (the ZeRO paper's), the busiest rank
    sent_mb: float | None = None  # what that rank sends in a step on a ring
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


PRECISION_FLAGS = {"fp32": [], "bf16": ["--bf16"], "fp16": ["--fp16"]}


def per_precision(specs: list[Spec], precisions: list[str]) -> list[Spec]:
    """Each spec once per precision, named "<strategy> <precision>"."""
    return [replace(s, name=f"{s.name} {p}", precision=p) for s in specs for p in precisions]


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
    head += ["comm. volume/step (MB)", "sent/rank/step (MB)", "checkpoint (MB)", "save (s)", "load (s)", "final loss"]
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
            cells += [fmt(r.volume_mb, ".3f"), fmt(r.sent_mb, ".3f")]
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
        f"{args.gradient_accumulation_steps} (a one-process config takes the whole global batch, a tensor-parallel one "
        "a micro batch tp times larger: its tp ranks share it). "
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
        "times the training step only, logging every step), but for the step whose collectives were counted; MFU "
        "is n/a on CPU (no peak FLOP/s).",
        "- **comm. volume/step**, **sent/rank/step**: every collective of the third step (the last, in a shorter "
        "run), counted by training/loop/comms.py on every rank (`strategy.json`, `communication`), the busiest rank: "
        "the "
        "ZeRO paper's volume (an all-reduce of S bytes counts 2S, any other collective S, point-to-point what is "
        "sent) and what the rank sends on a ring ((n - 1) / n of it).",
        "- **peak RSS per rank**: each worker's resident host memory, sampled every "
        f"{SAMPLE_EVERY_S} s over the whole run (start-up, training, save, export), ranks in order. It includes "
        "the Python, torch and DeepSpeed runtime of each process, so on a small model the differences between "
        "strategies are a small part of it."
        + (" **GPU max alloc.**: `torch.cuda.max_memory_allocated` on rank 0, from `metrics.jsonl`." if on_gpu else ""),
        "- **checkpoint**: the bytes of `checkpoint-<steps>/`, saved once at the last step; **save**: the whole "
        "save as the training script times it on rank 0, until the completion marker (written after every "
        "rank's shard): `checkpoint_save_s` in `metrics.jsonl`.",
        "- **load**: a second launch resumes from that checkpoint for one more step; the time between its "
        "log lines `strategy in force` and `resumed from` (rank 0, millisecond stamps) is `load_checkpoint`.",
        "- **max abs loss diff vs ddp**: the largest |loss - DDP's loss| over every logged step.",
    ]
    if any(r.predicted_gb is not None for r in results):
        where = "the GPU's share" if on_gpu else "everything one rank holds in host memory (GPU share + offload)"
        lines += [
            "",
            f"**predicted**: the planner's `predict(...)`, {where}, for the run's model, strategy, world "
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

"""Bytes each rank sends per step, per parameter, at 2, 4 and 8 ranks for every data-parallel strategy, measured by
the training script and plotted against the ZeRO paper's volumes.

    python recipes/measure/comm_scaling.py --output_dir runs/comm_scaling                 # launch, measure, plot
    python recipes/measure/comm_scaling.py --output_dir runs/comm_scaling --no_launch     # plot what is there

Each point is one `accelerate launch --config_file accelerate_configs/<config>.yaml --num_processes N recipes/train.py
--preset debug --max_steps 3 ...` in fp32 on a small generated corpus (written to the output folder; more ranks than
cores is fine, only bytes are counted), which records its third step's collectives on every rank in strategy.json
(training/loop/comms.py). Plotted: what the busiest rank sends on a ring (the paper's volume x (N - 1) / N) per
parameter, against the paper's 2 Psi (DDP, ZeRO-1/2) and 3 Psi (ZeRO-3, FSDP) at 4 bytes each; beside the shipped JSONs,
the two DeepSpeed settings that change the traffic (`use_multi_rank_bucket_allreduce: false`, ZeRO-3's live parameters
and reuse distance at 0).
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

from recipes.measure.memory_scaling import report, run_launch, scaling_parser
from training.paths import ROOT
from training.report.figures import save_against_ranks

# (label, accelerate config, changes to its DeepSpeed JSON's zero_optimization, the paper's volume in Psi)
NO_MULTI_RANK = {"use_multi_rank_bucket_allreduce": False}
NO_LIVE = {"stage3_max_live_parameters": 0, "stage3_max_reuse_distance": 0}
LAUNCHES = [
    ("ddp", "ddp", {}, 2),
    ("fsdp", "fsdp", {}, 3),
    ("fsdp-shard-grad-op", "fsdp_shard_grad_op", {}, 2),
    ("zero1", "zero1", {}, 2),
    ("zero2", "zero2", {}, 2),
    ("zero2 (multi-rank all-reduce off)", "zero2", NO_MULTI_RANK, 2),
    ("zero3", "zero3", {}, 3),
    ("zero3 (live parameters 0)", "zero3", NO_LIVE, 3),
]
TRAIN = ["--preset=debug", "--max_steps=3", "--warmup_steps=1", "--per_device_train_batch_size=2",
         "--logging_steps=1", "--eval_steps=0", "--max_eval_batches=1", "--save_steps=0",
         "--sample_max_new_tokens=0", "--block_size=64", "--tokenizer_vocab_size=300"]  # fmt: skip


def accelerate_config_with(config: str, zero: dict, folder: Path) -> Path:
    """accelerate_configs/<config>.yaml, or a copy of it in `folder` pointing at its DeepSpeed JSON with `zero`
    applied to zero_optimization."""
    yaml = ROOT / "accelerate_configs" / f"{config}.yaml"
    if not zero:
        return yaml
    ds = json.loads((ROOT / "ds_configs" / f"{config}.json").read_text())
    ds["zero_optimization"].update(zero)
    (folder / "ds.json").write_text(json.dumps(ds))
    (folder / "launch.yaml").write_text(yaml.read_text().replace(f"ds_configs/{config}.json", str(folder / "ds.json")))
    return folder / "launch.yaml"


def corpus(out: Path) -> list[str]:
    """A small corpus of random words (its content does not change what a step sends), and the flags that read it."""
    rng = random.Random(0)
    words = [f"word{i}" for i in range(16)]
    lines = [" ".join(rng.choice(words) for _ in range(rng.randint(5, 40))) for _ in range(3000)]
    (out / "corpus").mkdir(parents=True, exist_ok=True)
    for name, part in (("train", lines[:2800]), ("valid", lines[2800:])):
        (out / "corpus" / f"{name}.txt").write_text("\n".join(part) + "\n")
    return [f"--train_file={out / 'corpus' / 'train.txt'}", f"--validation_file={out / 'corpus' / 'valid.txt'}",
            f"--cache_dir={out / 'corpus' / 'cache'}"]  # fmt: skip


def run_dir(out: Path, index: int, world: int) -> Path:
    return out / f"{index}_{LAUNCHES[index][1]}_n{world}"


def measure(out: Path, world_sizes: list[int]) -> None:
    data = corpus(out)
    for world in world_sizes:
        for i, (label, config, zero, _) in enumerate(LAUNCHES):
            folder = run_dir(out, i, world)
            folder.mkdir(parents=True, exist_ok=True)
            print(f"measuring {label} on {world} ranks -> {folder}", flush=True)
            cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
                   str(accelerate_config_with(config, zero, folder)), "--num_processes", str(world),
                   str(ROOT / "recipes" / "train.py"), *TRAIN, *data, f"--output_dir={folder}"]  # fmt: skip
            run_launch(cmd, f"{label} on {world} ranks")


def points(out: Path, world_sizes: list[int]) -> list[dict]:
    """Per launch and world size: the busiest rank's bytes sent and the paper's volume, per parameter."""
    rows = []
    for i, (label, _, _, paper) in enumerate(LAUNCHES):
        for world in world_sizes:
            seen = json.loads((run_dir(out, i, world) / "strategy.json").read_text())
            psi, ranks = seen["parameters"], seen["communication"]["per_rank"]
            busiest = max(ranks, key=lambda r: r["wire_bytes"])
            rows.append({"launch": label, "world": world, "psi": psi, "volume": busiest["volume_bytes"] / psi,
                         "sent": busiest["wire_bytes"] / psi, "paper_volume": 4 * paper,
                         "paper_sent": 4 * paper * (world - 1) / world})  # fmt: skip
    return rows


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    worlds = sorted({r["world"] for r in rows})
    # Launches that send the same bytes at every N (to 0.01 B/Ψ: the scalars' all-reduces aside) share one line.
    lines: dict[tuple, list[str]] = {}
    for label, *_ in LAUNCHES:
        sent = tuple(round(r["sent"], 2) for r in rows if r["launch"] == label)
        lines.setdefault(sent, []).append(label)
    for i, (sent, labels) in enumerate(lines.items()):
        ax.plot(worlds, sent, "o-", color=f"C{i}", label=" = ".join(labels), linewidth=2)
    for units, color in ((2, "black"), (3, "grey")):
        ax.plot(worlds, [4 * units * (n - 1) / n for n in worlds], "--", color=color,
                label=f"paper {units}Ψ" + (" (DDP, ZeRO-1/2)" if units == 2 else " (ZeRO-3, FSDP)"))  # fmt: skip
    title = f"Sent on a ring per step, fp32, Ψ = {rows[0]['psi']:,} (measured: solid, paper: dashed)"
    save_against_ranks(fig, ax, rows, "bytes sent per parameter per rank per step", title, path, legend_columns=1)


def format_table(rows: list[dict]) -> str:
    lines = ["| launch | N | volume B/Ψ | paper B/Ψ | sent B/Ψ | paper sent B/Ψ |", "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['launch']} | {r['world']} | {r['volume']:.3f} | {r['paper_volume']:.0f} | "
                     f"{r['sent']:.3f} | {r['paper_sent']:.3f} |")  # fmt: skip
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    args = scaling_parser(__doc__, "comm_scaling", [2, 4, 8]).parse_args(argv)
    out = Path(args.output_dir)
    if not args.no_launch:
        measure(out, args.world_sizes)
    report(points(out, args.world_sizes), plot, format_table, args.plot)


if __name__ == "__main__":
    main()

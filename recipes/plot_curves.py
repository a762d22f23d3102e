"""Draw a run's training curves (loss, learning rate, tokens/s against the step) from its metrics.jsonl.

    python recipes/plot_curves.py runs/tiny/metrics.jsonl                 # writes runs/tiny/training_curves.png
    python recipes/plot_curves.py runs/tiny/metrics.jsonl --out curves.png

recipes/train.py draws the same picture at the end of every run.
"""

from __future__ import annotations

from training.arguments import ArgumentParser
from training.core.ranks import run_rank
from training.report.curves import plot_training_curves


def main(argv: list[str] | None = None) -> None:
    p = ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("metrics", help="a run's metrics.jsonl")
    p.add_argument("--out", default=None, help="the PNG to write (default: training_curves.png beside metrics)")
    args = p.parse_args(argv)
    print(f"training curves: {plot_training_curves(args.metrics, args.out)}")


if __name__ == "__main__":
    run_rank(main)  # a missing file or one without records ends in one `error:` line

"""The measuring recipes' figures of a per-rank quantity against a degree (ranks, tp), drawn the same way."""

from __future__ import annotations

from pathlib import Path


def save_against_ranks(fig, ax, rows: list[dict], ylabel: str, title: str, path: Path, legend_columns: int = 2,
                       key: str = "world", xlabel: str = "ranks N") -> None:  # fmt: skip
    """The figure of a per-rank quantity against the ranks (`rows`' `key`), on a log-2 axis from 0 up, saved to
    `path`."""
    worlds = sorted({r[key] for r in rows})
    ax.set_xscale("log", base=2)
    ax.set_xticks(worlds, [str(w) for w in worlds])
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_ylim(bottom=0)
    ax.set_title(title)
    ax.title.set_fontsize(9)
    ax.legend(ncol=legend_columns, fontsize=7)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)

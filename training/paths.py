"""Where the project's own files are: the repository root, beside `ds_configs/` and `accelerate_configs/`."""

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

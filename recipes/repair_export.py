"""Repair an exported model folder that does not load where the project is not installed.

    python recipes/repair_export.py runs/fsdp

Folders that shardgpt exported under FSDP2 (accelerate_configs/fsdp*.yaml) before this fix name
`_fsdp_init.FSDPShardGPTForCausalLM` in config.json's `auto_map` and hold copies of torch's FSDP2 sources
(`_fsdp_*.py`) in place of `modeling_shardgpt.py`; loading them with `trust_remote_code=True` ends in
"RuntimeError: Tried to register an operator (fsdp::copy_ ...) with the same name and overload name multiple times".
This writes the model's own two source files, points `auto_map` at them and removes the copies; the weights, the
tokenizer and every other file stay as they are. Running it on a folder that loads already changes nothing it
needs. No GPU, no process group.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from model.export import write_model_code


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder", type=Path, help="the exported model folder (holding config.json)")
    args = parser.parse_args(argv)
    if not (args.folder / "config.json").is_file():
        print(f"error: {args.folder} holds no config.json: pass the folder recipes/train.py exported", file=sys.stderr)
        return 2
    try:
        removed = write_model_code(args.folder)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    what = f"removed {', '.join(removed)}; " if removed else ""
    print(f"{args.folder}: {what}wrote configuration_shardgpt.py and modeling_shardgpt.py; auto_map names them")
    return 0


if __name__ == "__main__":
    sys.exit(main())

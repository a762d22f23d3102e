"""What to check before a big launch: this machine, and the launch's resolved config.

    python recipes/doctor.py                                           # the machine alone
    python recipes/doctor.py --config_file accelerate_configs/zero3.yaml -- --preset gpt2-124m --bf16
    python recipes/doctor.py --deepspeed ds_configs/zero3_offload_nvme.json --num_processes 8 \\
        --nvme_path /local_nvme -- --per_device_train_batch_size 4 --output_dir runs/big

Checks: GPUs and their memory, the NCCL/gloo process groups (a one-rank all-reduce), bf16, which DeepSpeed
ops can be built here (`is_compatible()`; `--build-ops` compiles the ones the configs use), libaio, pinned
host memory, an NVMe path's free space and measured write speed, and, given a launch (an accelerate YAML
and/or a DeepSpeed JSON, plus the training flags after `--`), the training script's own checks
(`RunConfig.validate`, `resolve_deepspeed` with the launch's world size) and the resolved values that
decide memory and speed. Prints a table (OK / WARN / FAIL / n/a per check); exits 1 when a check FAILs.
"""

from __future__ import annotations

import contextlib
import json
import sys

from training.arguments import ArgumentParser
from training.core.ops import CPU_OPS, GPU_OPS
from training.doctor.launch import check_launch_config, check_training
from training.doctor.machine import (
    check_bf16,
    check_gpus,
    check_libaio,
    check_nvme,
    check_ops,
    check_pinned_memory,
    check_process_groups,
    check_versions,
    gpus,
)
from training.doctor.report import Report, render

# ---------------------------------------------------------------------------------------------- main


def run_checks(args) -> Report:
    report = Report()
    check_versions(report)
    found = gpus()
    check_gpus(report, found)
    check_process_groups(report, found)
    bf16_ok = check_bf16(report, found)
    check_ops(report, args.build_ops)
    check_pinned_memory(report, found)
    launch = None
    if args.config_file:
        launch = check_launch_config(report, args.config_file, args.num_processes, found)
    args.nvme_need = None
    asked = args.config_file or args.deepspeed or args.train_flags
    if asked and not (args.config_file and launch is None):  # a YAML that cannot be read has its FAIL already
        check_training(report, args, launch, found, bf16_ok)
    nvme = bool(report.deepspeed and "nvme" in json.dumps(report.deepspeed.get("zero_optimization", {})))
    check_libaio(report, needed=nvme)
    if args.nvme_path:
        check_nvme(report, args.nvme_path, "--nvme_path", args.write_mb, args.nvme_need)
    return report


def parse_args(argv: list[str] | None):
    argv = list(sys.argv[1:] if argv is None else argv)
    train_flags = []
    if "--" in argv:
        i = argv.index("--")
        argv, train_flags = argv[:i], argv[i + 1 :]
    p = ArgumentParser(
        description=__doc__.split("\n\n")[0], epilog="Training flags (recipes/train.py --help) go after `--`."
    )
    p.add_argument("--config_file", help="The accelerate YAML of the launch (accelerate_configs/*.yaml).")
    p.add_argument("--deepspeed", help="A DeepSpeed JSON, as given to train.py under the deepspeed launcher/torchrun.")
    p.add_argument("--num_processes", type=int, help="World size (default: the YAML's num_processes, else GPUs or 1).")
    p.add_argument("--nvme_path", help="A directory for NVMe offload: free space and a measured write speed.")
    p.add_argument("--write_mb", type=int, default=64, help="MiB written by the NVMe write test.")
    p.add_argument(
        "--build-ops", "--build_ops", dest="build_ops", action="store_true",
        help=f"Compile (or load) the DeepSpeed ops launches use (GPUs: {', '.join(GPU_OPS)}; CPU ranks: "
        f"{', '.join(CPU_OPS)}): minutes the first time, cached in <virtualenv>/torch_extensions.",
    )  # fmt: skip
    p.add_argument("--json", action="store_true", help="Print the checks as JSON instead of a table.")
    p.add_argument("--show_ds_config", action="store_true", help="Also print the whole resolved DeepSpeed JSON.")
    args = p.parse_args(argv)
    args.train_flags = train_flags
    if args.num_processes is not None and args.num_processes < 1:
        p.error(f"--num_processes {args.num_processes} must be at least 1")
    if args.write_mb < 1:
        p.error(f"--write_mb {args.write_mb} must be at least 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    with contextlib.redirect_stdout(sys.stderr):  # the libraries' own prints: stdout is the table (or JSON)
        report = run_checks(args)
    if args.json:
        print(json.dumps({"checks": [c.__dict__ for c in report.checks], "resolved": report.resolved,
                          "deepspeed": report.deepspeed, "failed": report.failed}, indent=2, default=str))  # fmt: skip
    else:
        print(render(report))
        if args.show_ds_config and report.deepspeed is not None:
            print("\nresolved DeepSpeed JSON:\n" + json.dumps(report.deepspeed, indent=2))
    return 1 if report.failed else 0


if __name__ == "__main__":
    sys.exit(main())

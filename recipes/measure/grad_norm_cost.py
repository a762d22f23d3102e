"""What summing the gradient norm in float64 costs a step, against torch's float32 norm, on this machine.

    python recipes/measure/grad_norm_cost.py                          # tiny and gpt2-124m, micro 8 x block 256
    python recipes/measure/grad_norm_cost.py --presets llama-1b --micro 1 --block 512

For each preset: one forward and backward in one process fills every gradient; then the norm of all of them, timed
`--repeats` times each way: training/core/gradnorm.py's (every rank's squares summed in float64, chunk by chunk;
what every strategy logs and clips by) and torch's `get_total_norm` (float32, foreach), with the step's own forward and
backward time beside them and each norm's value (the float32 one reads low on CPU: pytorch issue 151761).
"""

from __future__ import annotations

import statistics
import time

import torch

from model import ShardGPTConfig, ShardGPTForCausalLM
from training.arguments import ArgumentParser
from training.core.gradnorm import grad_norm


def timed(fn, repeats: int) -> tuple[float, object]:
    """The median seconds of `repeats` calls of `fn`, and its last result."""
    seconds, result = [], None
    for _ in range(repeats):
        t0 = time.perf_counter()
        result = fn()
        seconds.append(time.perf_counter() - t0)
    return statistics.median(seconds), result


def measure(preset: str, micro: int, block: int, repeats: int) -> dict:
    torch.manual_seed(0)
    net = ShardGPTForCausalLM(ShardGPTConfig.from_preset(preset)).train()
    tokens = torch.randint(0, net.config.vocab_size, (micro, block + 1))
    t0 = time.perf_counter()
    net(input_ids=tokens[:, :-1], shift_labels=tokens[:, 1:]).loss.backward()
    step = time.perf_counter() - t0
    params = [p for p in net.parameters() if p.grad is not None]
    cpu = torch.device("cpu")
    ours, fp64 = timed(lambda: grad_norm(params, cpu).item(), repeats)
    theirs, fp32 = timed(lambda: torch.nn.utils.get_total_norm([p.grad for p in params]).item(), repeats)
    return {
        "preset": preset, "parameters": sum(p.numel() for p in params), "forward_backward_s": step,
        "float64_s": ours, "float32_s": theirs, "float64_norm": fp64, "float32_norm": fp32,
    }  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    p = ArgumentParser(prog="recipes/measure/grad_norm_cost.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--presets", nargs="+", default=["tiny", "gpt2-124m"])
    p.add_argument("--micro", type=int, default=8, help="Sequences in the forward and backward that fill the grads.")
    p.add_argument("--block", type=int, default=256, help="Tokens per sequence.")
    p.add_argument("--repeats", type=int, default=5, help="Timed calls of each norm (the median is shown).")
    args = p.parse_args(argv)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; micro {args.micro} x block {args.block}")
    print("| preset | parameters | forward + backward | float64 norm | float32 norm | extra per step | relative gap |")
    print("|---|---|---|---|---|---|---|")
    for preset in args.presets:
        r = measure(preset, args.micro, args.block, args.repeats)
        extra = (r["float64_s"] - r["float32_s"]) / r["forward_backward_s"]
        gap = r["float64_norm"] / r["float32_norm"] - 1  # what the float32 sum loses
        ms = {k: f"{r[k] * 1e3:,.1f} ms" for k in ("forward_backward_s", "float64_s", "float32_s")}
        print(f"| {preset} | {r['parameters']:,} | {ms['forward_backward_s']} | {ms['float64_s']} | {ms['float32_s']} "
              f"| {extra:+.2%} | {gap:+.2e} |", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()

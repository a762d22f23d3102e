"""--optim and Muon's flags (training/muon.py), a part of `RunConfig` (training/config.py) of their own."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Literal, get_args

from data.arguments import flag

NS_DTYPES = ("bfloat16", "float32")
"""The Newton-Schulz iteration's precision: torch's (bfloat16), or float32 (parity to the last bits)."""
ADJUST_LR = ("match_rms_adamw", "original")
"""How Muon's learning rate is scaled per matrix (torch's `adjust_lr_fn`): to AdamW's update RMS (Moonshot's,
0.2 sqrt(max(A, B)), which lets Muon reuse AdamW's learning rate and weight decay) or Keller Jordan's sqrt(max(1,
A / B))."""
Optim = Literal["adamw_torch", "muon"]  # transformers' `optim` names; muon: Muon for the matrices, AdamW the rest
AdjustLR = Literal[ADJUST_LR]
NSDtype = Literal[NS_DTYPES]


@dataclass(frozen=True)
class OptimArguments:
    """The optimizer: AdamW everywhere, or Muon for the decoder layers' matrices (AdamW keeps its flags for the
    rest)."""

    optim: Optim = flag(
        "adamw_torch",
        "The optimizer: adamw_torch (AdamW for every parameter), or muon: Muon for the decoder layers' matrices, "
        "AdamW (--learning_rate, --weight_decay, the adam_* flags) for the embedding, the head and the norms "
        "(docs/training.md).",
    )
    muon_learning_rate: float | None = flag(
        None,
        "Muon's peak learning rate (the schedule scales it as AdamW's). Default: --learning_rate, which "
        "--muon_adjust_lr match_rms_adamw makes a fit.",
    )
    muon_weight_decay: float = flag(0.1, "Muon's decoupled weight decay of the matrices.")
    muon_momentum: float = flag(0.95, "Muon's momentum.")
    muon_nesterov: bool = flag(True, "Muon's Nesterov momentum (--no_muon_nesterov: plain momentum).")
    muon_ns_steps: int = flag(5, "Newton-Schulz iterations that orthogonalize each matrix's update.")
    muon_ns_dtype: NSDtype = flag(
        "bfloat16",
        "The Newton-Schulz iteration's precision: bfloat16 (torch.optim.Muon's) or float32 (slower; the same "
        "update on every strategy to fp32's rounding).",
    )
    muon_adjust_lr: AdjustLR = flag(
        "match_rms_adamw",
        "How each matrix's Muon learning rate is scaled (torch.optim.Muon's adjust_lr_fn): match_rms_adamw "
        "(0.2 sqrt(max(rows, cols)): AdamW's update RMS, Moonshot's) or original (sqrt(max(1, rows / cols))).",
    )

    def check_optim(self) -> None:
        """--optim and Muon's flags; which strategies Muon runs under is the launch's check (training/launch.py)."""
        if self.optim not in get_args(Optim):
            raise ValueError(f"--optim {self.optim!r} is unknown: choose one of {', '.join(get_args(Optim))}")
        if self.muon_ns_dtype not in NS_DTYPES:
            raise ValueError(f"--muon_ns_dtype {self.muon_ns_dtype!r}: choose one of {', '.join(NS_DTYPES)}")
        if self.muon_adjust_lr not in ADJUST_LR:
            raise ValueError(f"--muon_adjust_lr {self.muon_adjust_lr!r}: choose one of {', '.join(ADJUST_LR)}")
        if self.muon_learning_rate is not None and not self.muon_learning_rate > 0:
            raise ValueError(f"--muon_learning_rate {self.muon_learning_rate} must be positive")
        if not 0 <= self.muon_momentum < 1 or self.muon_weight_decay < 0 or not 1 <= self.muon_ns_steps < 100:
            raise ValueError(
                f"--muon_momentum {self.muon_momentum} must be in [0, 1), --muon_weight_decay "
                f"{self.muon_weight_decay} 0 or more, --muon_ns_steps {self.muon_ns_steps} from 1 to 99"
            )
        given = [f.name for f in fields(self) if f.name.startswith("muon_") and getattr(self, f.name) != f.default]
        if self.optim != "muon" and given:
            raise ValueError(f"--{given[0]} without --optim muon: pass --optim muon, or drop the muon_* flags")

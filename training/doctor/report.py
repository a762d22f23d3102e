"""A doctor's report: checks, each with a status, what was found and the fix, and their rendering."""

from __future__ import annotations

from dataclasses import dataclass, field

OK, WARN, FAIL, NA = "OK", "WARN", "FAIL", "n/a"


@dataclass
class Check:
    name: str
    status: str
    detail: str


@dataclass
class Report:
    checks: list[Check] = field(default_factory=list)
    resolved: dict = field(default_factory=dict)  # key values of the launch, printed under the table
    deepspeed: dict | None = None  # the resolved DeepSpeed JSON

    def add(self, name: str, status: str, detail: str) -> None:
        self.checks.append(Check(name, status, detail))

    @property
    def failed(self) -> bool:
        return any(c.status == FAIL for c in self.checks)


def size(n: float) -> str:
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def render(report: Report) -> str:
    width = max(len(c.name) for c in report.checks)
    lines = [f"{'check':<{width}}  status  detail", f"{'-' * width}  ------  {'-' * 40}"]
    lines += [f"{c.name:<{width}}  {c.status:<6}  {c.detail}" for c in report.checks]
    if report.resolved:
        lines += ["", "resolved launch:"]
        key_width = max(len(k) for k in report.resolved)
        lines += [f"  {k:<{key_width}}  {v}" for k, v in report.resolved.items()]
    counts = {s: sum(c.status == s for c in report.checks) for s in (OK, WARN, FAIL)}
    verdict = "blocking problems: fix the FAIL lines before launching" if report.failed else "nothing blocks a launch"
    lines += ["", f"{counts[OK]} OK, {counts[WARN]} WARN, {counts[FAIL]} FAIL: {verdict}"]
    return "\n".join(lines)

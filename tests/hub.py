"""Loading an exported folder as someone who downloaded it does: in a fresh Python process where this project cannot
be imported (its folder off the path, its packages blocked even if pip-installed), with transformers alone."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# The first lines of every such process.
HIDE_PROJECT = f"""
import sys
sys.path = [p for p in sys.path if p not in ("", {str(ROOT)!r})]
for name in ("model", "data", "recipes", "training"):  # the project unimportable, even if pip-installed
    sys.modules[name] = None
"""

# `from_pretrained` with trust_remote_code, the model card's own `pipeline(...)` line, and each weight's largest
# difference from the reference folder's model.safetensors.
LOAD_EXPORT = """
import io, json, contextlib, torch
from pathlib import Path
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM
folder = Path({folder!r})
net = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)
card = (folder / "README.md").read_text() if (folder / "README.md").is_file() else ""
lines = [l.strip() for l in card.splitlines() if "pipeline(" in l and "text-generation" in l]
# The model card's line; a folder without a card (the Trainer's) gets the line train.py's run summary prints.
summary = 'print(pipeline("text-generation", "{{}}", trust_remote_code=True)("def ")[0]["generated_text"])'
line = lines[0] if lines else summary.format(folder)
printed = io.StringIO()
with contextlib.redirect_stdout(printed):
    exec("from transformers import pipeline\\n" + line)
theirs = load_file(Path({reference!r}) / "model.safetensors") if {reference!r} else {{}}
ours = net.state_dict()
missing = sorted(set(theirs) - set(ours))
diff = {{k: (ours[k].float() - v.float()).abs().max().item() for k, v in theirs.items() if k in ours}}
print(json.dumps({{"class": type(net).__name__, "module": type(net).__module__, "generated": printed.getvalue(),
                  "card_line": bool(lines),
                  "files": sorted(p.name for p in folder.glob("*.py")), "max_abs_diff": max(diff.values(), default=0.0),
                  "missing": missing}}))
"""


def load_as_the_hub_does(folder: Path, reference: Path | None = None, timeout: int = 300) -> dict:
    """Load the exported `folder` in a fresh process without the project, run its model card's `pipeline(...)` line,
    and compare its weights with `reference`'s export: the class loaded, its module, what the line printed, the
    folder's Python files and the largest absolute difference of any weight."""
    code = HIDE_PROJECT + LOAD_EXPORT.format(folder=str(folder), reference=str(reference) if reference else "")
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], cwd=folder, capture_output=True, text=True, timeout=timeout
    )
    assert done.returncode == 0, f"{folder} does not load as the Hub loads it:\n{done.stderr[-4000:]}"
    return json.loads(done.stdout.strip().splitlines()[-1])


def assert_loads_as_the_hub_does(folder: Path, reference: Path | None, atol: float) -> dict:
    """`load_as_the_hub_does`, then: the model's own class from its own source files, a generated text, and every
    weight of `reference`'s export within `atol`."""
    seen = load_as_the_hub_does(folder, reference)
    assert seen["class"] == "ShardGPTForCausalLM" and seen["module"].endswith(".modeling_shardgpt"), seen
    assert seen["files"] == ["configuration_shardgpt.py", "modeling_shardgpt.py"], seen
    assert seen["generated"].strip() and not seen["missing"], seen
    assert seen["card_line"] == (folder / "README.md").is_file(), seen  # a model card holds the line it runs
    assert seen["max_abs_diff"] <= atol, f"exported weights differ from the reference's by up to {seen['max_abs_diff']}"
    return seen

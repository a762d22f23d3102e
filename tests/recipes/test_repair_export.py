"""An FSDP2 export written as shardgpt wrote it before its fix does not load where users load it, and
`python recipes/repair_export.py FOLDER` repairs it in place: the model's own code, the same weights."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import textwrap

import pytest
from hub import load_as_the_hub_does
from launching import ROOT, free_port

# What `save_pretrained` on the FSDP2-wrapped model wrote (recipes/train.py did so until the fix): fully_shard swaps
# the model's class for FSDPShardGPTForCausalLM, defined in torch's FSDP2 package, whose sources it then copies.
OLD_EXPORT = """
import torch, torch.distributed as dist
from torch.distributed.fsdp import fully_shard
from model import ShardGPTConfig, ShardGPTForCausalLM
dist.init_process_group("gloo", init_method="tcp://127.0.0.1:{port}", rank=0, world_size=1)
torch.manual_seed(0)
net = ShardGPTForCausalLM(ShardGPTConfig.from_preset("debug"))
net.save_pretrained({reference!r})
fully_shard(net)
state = {{k: v.full_tensor() for k, v in net.state_dict().items()}}
net.save_pretrained({folder!r}, state_dict=state)
dist.destroy_process_group()
"""


@pytest.mark.slow
def test_an_old_fsdp2_export_is_repaired_by_one_command(corpus, tmp_path, capsys):
    folder, reference = tmp_path / "fsdp", tmp_path / "one_process"
    code = OLD_EXPORT.format(port=free_port(), folder=str(folder), reference=str(reference))
    subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=ROOT, check=True, timeout=300)
    for name in ("tokenizer.json", "tokenizer_config.json"):  # the export's tokenizer: the corpus's
        shutil.copy(next((corpus["root"] / "cache" / "tokenizers").glob(f"*/{name}")), folder / name)
    config = json.loads((folder / "config.json").read_text())
    assert config["auto_map"]["AutoModelForCausalLM"] == "_fsdp_init.FSDPShardGPTForCausalLM", config["auto_map"]
    with pytest.raises(AssertionError, match="Tried to register an operator"):  # the error users met
        load_as_the_hub_does(folder)

    done = subprocess.run([sys.executable, "recipes/repair_export.py", str(folder)], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "removed _fsdp_" in done.stdout and "auto_map names them" in done.stdout, done.stdout
    seen = load_as_the_hub_does(folder, reference)
    assert (seen["class"], seen["max_abs_diff"], seen["missing"]) == ("ShardGPTForCausalLM", 0.0, []), seen
    assert seen["files"] == ["configuration_shardgpt.py", "modeling_shardgpt.py"] and seen["generated"].strip(), seen

    from recipes import repair_export

    assert repair_export.main([str(folder)]) == 0  # a repaired folder stays as it is
    assert "removed" not in capsys.readouterr().out
    assert repair_export.main([str(tmp_path)]) == 2  # not an export: one line
    assert capsys.readouterr().err.startswith(f"error: {tmp_path} holds no config.json")

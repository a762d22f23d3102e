"""transformers' model contract, item by item, against `LlamaForCausalLM` holding the same weights.

Each item runs in a subprocess where this project cannot be imported (`contract_worker.py`), on the exported
folder loaded with `trust_remote_code=True`, as a user of the export would load it. The quick items share one
subprocess; the slow ones (flex_attention and compiled generation, which compile; continuous batching) get one
each. An item the worker cannot run here
(flash attention and hub kernels without a GPU, caches that need CUDA or an optional package, or anything
Llama itself fails on here) is skipped with the reason, never passed.
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from model import ShardGPTConfig, ShardGPTForCausalLM
from model.export import save_llama

WORKER = Path(__file__).with_name("contract_worker.py")
QUICK = [
    "output_hidden_states",
    "output_attentions_eager",
    "return_dict_false",
    "inputs_embeds",
    "logits_to_keep",
    "position_ids",
    "left_padded_generation",
    *(
        f"attn_implementation={impl}{what}"
        for impl in ("eager", "sdpa", "flash_attention_2", "flash_attention_3", "kernels-community/flash-attn2")
        for what in ("", " generate")
    ),
    "cache_implementation=dynamic",
    "cache_implementation=static",
    "cache_implementation=offloaded",
    "cache_implementation=offloaded_static",
    "cache_implementation=quantized",
    "cache_implementation=sliding_window",
    "cache_implementation=hybrid",
    "cache_implementation=hybrid_chunked",
    "cache_implementation=offloaded_hybrid",
    "cache_implementation=offloaded_hybrid_chunked",
]
SLOW = [
    "attn_implementation=flex_attention",
    "attn_implementation=flex_attention generate",
    "cache_implementation=paged",
    "compiled_static_generation",
]


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """The debug preset with grouped-query attention, its norms perturbed so that a swapped or missing norm
    cannot pass, saved as shardgpt (remote code) and as Llama."""
    torch.manual_seed(0)
    net = ShardGPTForCausalLM(ShardGPTConfig.from_preset("debug", num_key_value_heads=2))
    with torch.no_grad():
        for name, p in net.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    root = tmp_path_factory.mktemp("contract")
    net.save_pretrained(root / "shardgpt")
    save_llama(net, root / "llama")
    return root


def run_contract(root: Path, items: list[str]) -> dict:
    out = root / f"results-{len(items)}-{items[0].replace('/', '_')}.json"
    args = [sys.executable, str(WORKER), str(root / "shardgpt"), str(root / "llama"), str(out), *items]
    subprocess.run(args, cwd=root, check=True, timeout=900, stdin=subprocess.DEVNULL)
    return json.loads(out.read_text())


def report(result: dict) -> None:
    if result["status"] == "skip":
        pytest.skip(result["detail"])
    if result["status"] == "fail":
        pytest.fail(result["detail"], pytrace=False)


@pytest.fixture(scope="module")
def quick_results(exported):
    return run_contract(exported, QUICK)


def test_every_item_the_worker_knows_is_tested(quick_results):
    assert sorted(quick_results["every item"]) == sorted(QUICK + SLOW)


@pytest.mark.parametrize("item", QUICK)
def test_contract(item, quick_results):
    report(quick_results[item])


@pytest.mark.slow
@pytest.mark.parametrize("item", SLOW)
def test_contract_slow(item, exported):
    report(run_contract(exported, [item])[item])

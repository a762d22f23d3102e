"""Checks transformers' model contract on an exported shardgpt folder against `LlamaForCausalLM` holding the same
weights, in a process where this project cannot be imported: the folder's own copy of the modeling code
(`trust_remote_code=True`) is what runs, as it would for any user of the export.

    python contract_worker.py OURS_DIR LLAMA_DIR RESULTS_JSON ITEM [ITEM ...]

Writes {item: {"status": "pass" | "fail" | "skip", "detail": str}} and, under "every item", the names of all
the items it knows. An item is skipped, with the reason, only
where it cannot run here (no GPU, a missing optional package) or where `LlamaForCausalLM` itself fails on it:
then there is nothing to compare with.
"""

from __future__ import annotations

import importlib.util
import itertools
import json
import sys
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path = [p for p in sys.path if p and Path(p).resolve() not in (ROOT, Path(__file__).resolve().parent)]
for name in ("model", "data", "recipes"):  # unimportable, even if pip-installed
    sys.modules[name] = None

import torch  # noqa: E402
from transformers import AutoModelForCausalLM, CompileConfig  # noqa: E402
from transformers.generation.configuration_utils import ALL_CACHE_IMPLEMENTATIONS  # noqa: E402

VOCAB, PAD = 512, 0
NEW_TOKENS = 8


class Skip(Exception):
    """The item cannot run here; the message says why."""


def load(folder: str, **kwargs):
    net = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True, **kwargs).eval()
    expected = "LlamaForCausalLM" if folder == LLAMA else "ShardGPTForCausalLM"
    assert type(net).__name__ == expected, f"{folder} loaded as {type(net).__name__}, expected {expected}"
    if folder == OURS:  # the folder's copy of the code, not the project's
        assert type(net).__module__.startswith("transformers_modules."), type(net).__module__
    return net


def pair(**kwargs):
    return load(OURS, **kwargs), load(LLAMA, **kwargs)


def tokens(batch: int = 2, length: int = 11, seed: int = 0) -> torch.Tensor:
    return torch.randint(1, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


def left_padded() -> tuple[torch.Tensor, torch.Tensor]:
    """Three prompts of 11, 7 and 4 tokens, left-padded to 11, and their attention mask."""
    ids, mask = tokens(3), torch.ones(3, 11, dtype=torch.long)
    for row, pad in ((1, 4), (2, 7)):
        ids[row, :pad], mask[row, :pad] = PAD, 0
    return ids, mask


def greedy(net, ids, **kwargs) -> torch.Tensor:
    return net.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=PAD, **kwargs)


def close(a, b, what: str) -> None:
    torch.testing.assert_close(a, b, msg=lambda m: f"{what}: {m}")


def equal(a, b, what: str) -> None:
    assert torch.equal(a, b), f"{what} differ:\nshardgpt {a.tolist()}\nllama    {b.tolist()}"


def llama_first(fn, *args, **kwargs):
    """`fn(*args, **kwargs)` run on the Llama side, or Skip if Llama itself cannot run the item here."""
    try:
        return fn(*args, **kwargs)
    except Exception as e:  # noqa: BLE001 - any failure of the reference means there is nothing to compare with
        first_line = str(e).splitlines()[0][:300] if str(e) else ""
        raise Skip(f"LlamaForCausalLM fails on it here too: {type(e).__name__}: {first_line}") from e


def check_hidden_states():
    ours, llama = pair()
    x = tokens()
    a, b = ours(x, output_hidden_states=True), llama(x, output_hidden_states=True)
    assert a.hidden_states is not None, "no hidden_states returned"
    assert len(a.hidden_states) == len(b.hidden_states) == ours.config.num_hidden_layers + 1
    for i, (p, q) in enumerate(zip(a.hidden_states, b.hidden_states, strict=True)):
        close(p, q, f"hidden_states[{i}]")
    # Selected layers only, as transformers lets one ask.
    a, b = ours(x, output_hidden_states=[-1]), llama(x, output_hidden_states=[-1])
    assert len(a.hidden_states) == len(b.hidden_states)


def check_attentions_eager():
    ours, llama = pair(attn_implementation="eager")
    x, mask = left_padded()
    a = ours(x, attention_mask=mask, output_attentions=True)
    b = llama(x, attention_mask=mask, output_attentions=True)
    assert a.attentions is not None and len(a.attentions) == ours.config.num_hidden_layers, "attentions missing"
    for i, (p, q) in enumerate(zip(a.attentions, b.attentions, strict=True)):
        assert p.shape == (3, ours.config.num_attention_heads, 11, 11), p.shape
        close(p, q, f"attentions[{i}]")


def check_return_dict_false():
    ours, llama = pair()
    x = tokens()
    a, b = ours(x, labels=x, return_dict=False), llama(x, labels=x, return_dict=False)
    assert type(a) is tuple and len(a) == len(b), f"got {type(a).__name__} of {len(a)}, Llama a tuple of {len(b)}"
    close(a[0], b[0], "loss")
    close(a[1], b[1], "logits")
    assert type(a[2]).__name__ == type(b[2]).__name__, "cache"
    a, b = ours.model(x, return_dict=False), llama.model(x, return_dict=False)
    assert type(a) is tuple and len(a) == len(b), "base model with return_dict=False"
    close(a[0], b[0], "last_hidden_state")


def check_inputs_embeds():
    ours, llama = pair()
    x = tokens()
    embeds = ours.get_input_embeddings()(x).detach()
    close(ours(inputs_embeds=embeds).logits, llama(inputs_embeds=embeds).logits, "logits from inputs_embeds")
    close(ours(inputs_embeds=embeds).logits, ours(x).logits, "inputs_embeds vs input_ids")
    a, b = greedy(ours, None, inputs_embeds=embeds), greedy(llama, None, inputs_embeds=embeds)
    equal(a, b, "generate(inputs_embeds)")


def check_logits_to_keep():
    ours, llama = pair()
    x = tokens()
    full = ours(x).logits
    for keep in (1, 4, torch.tensor([0, 5, 10])):
        a, b = ours(x, logits_to_keep=keep).logits, llama(x, logits_to_keep=keep).logits
        assert a.shape == b.shape, f"logits_to_keep={keep}: {a.shape} vs {b.shape}"
        close(a, b, f"logits_to_keep={keep}")
        close(a, full[:, -keep:] if isinstance(keep, int) else full[:, keep], f"logits_to_keep={keep} vs full")


def check_position_ids():
    ours, llama = pair()
    x = tokens(length=12)
    shifted = torch.arange(12).expand(2, 12) + 5
    packed = torch.cat([torch.arange(5), torch.arange(7)]).expand(2, 12)  # two documents in one row
    # Without a cache transformers reads packed documents from the position ids and keeps them apart.
    for (name, pos), use_cache in itertools.product((("shifted", shifted), ("packed", packed)), (True, False)):
        a = ours(x, position_ids=pos, use_cache=use_cache).logits
        close(a, llama(x, position_ids=pos, use_cache=use_cache).logits, f"position_ids {name}, use_cache={use_cache}")


def check_left_padded_generation():
    ours, llama = pair()
    x, mask = left_padded()
    close(ours(x, attention_mask=mask).logits, llama(x, attention_mask=mask).logits, "padded forward")
    together = greedy(ours, x, attention_mask=mask)
    equal(together, greedy(llama, x, attention_mask=mask), "left-padded batched generation")
    # Each row also continues as it would alone, without padding.
    for row, start in ((0, 0), (1, 4), (2, 7)):
        alone = greedy(ours, x[row : row + 1, start:])
        equal(together[row, 11:], alone[0, 11 - start :], f"row {row} batched vs alone")


def attention_check(impl: str, generate: bool):
    def check():
        if impl.startswith("flash") or "/" in impl:
            if not torch.cuda.is_available():
                raise Skip(f"attn_implementation={impl!r} needs a CUDA GPU; none here")
            needed = FLASH_PACKAGES.get(impl, "kernels")
            if importlib.util.find_spec(needed) is None and importlib.util.find_spec("kernels") is None:
                raise Skip(f"attn_implementation={impl!r} needs the {needed} (or kernels) package; not installed")
            kwargs = dict(attn_implementation=impl, dtype=torch.bfloat16, device_map="cuda")
            tolerance = dict(rtol=2e-2, atol=2e-2)
        else:
            kwargs, tolerance = dict(attn_implementation=impl), {}
        llama = llama_first(load, LLAMA, **kwargs)
        ours = load(OURS, **kwargs)
        # Flash attention may resolve to a hub kernel when its package is missing: the same one for both.
        chosen = ours.config._attn_implementation
        assert chosen == llama.config._attn_implementation, f"{chosen} vs Llama's {llama.config._attn_implementation}"
        assert chosen == impl or impl.startswith("flash"), f"asked for {impl}, got {chosen}"
        x, mask = (t.to(ours.device) for t in left_padded())
        if generate:
            b = llama_first(greedy, llama, x, attention_mask=mask)
            equal(greedy(ours, x, attention_mask=mask), b, f"{impl} generation")
            return
        # Row 0 alone is unpadded: the kernels' causal path; the batch adds the padding mask.
        for name, kw in (("unpadded", dict(input_ids=x[:1])), ("left-padded", dict(input_ids=x, attention_mask=mask))):
            b = llama_first(llama, **kw).logits
            torch.testing.assert_close(ours(**kw).logits, b, **tolerance, msg=f"{impl} {name} logits differ")

    return check


def cache_check(impl: str):
    def check():
        ours, llama = pair()
        x, mask = left_padded()
        b = llama_first(greedy, llama, x, attention_mask=mask, cache_implementation=impl)
        equal(greedy(ours, x, attention_mask=mask, cache_implementation=impl), b, f"cache_implementation={impl!r}")

    return check


def check_compiled_static_generation():
    ours, llama = pair()
    x, mask = left_padded()
    # `_compile_all_devices` is transformers' switch for compiling generation on a CPU; fullgraph proves there
    # is no graph break in the forward.
    config = CompileConfig(fullgraph=True, mode="default")
    config._compile_all_devices = True
    reference = greedy(llama, x, attention_mask=mask, cache_implementation="static")
    out = greedy(ours, x, attention_mask=mask, cache_implementation="static", compile_config=config)
    assert hasattr(ours, "_compiled_call"), "generate did not compile the forward"
    equal(out, reference, "compiled static-cache generation")


ATTENTION = [
    "eager",
    "sdpa",
    "flex_attention",
    "flash_attention_2",
    "flash_attention_3",
    "kernels-community/flash-attn2",
]
FLASH_PACKAGES = {"flash_attention_2": "flash_attn", "flash_attention_3": "flash_attn_interface"}
CACHES = [*ALL_CACHE_IMPLEMENTATIONS, "paged"]
CHECKS = {
    "output_hidden_states": check_hidden_states,
    "output_attentions_eager": check_attentions_eager,
    "return_dict_false": check_return_dict_false,
    "inputs_embeds": check_inputs_embeds,
    "logits_to_keep": check_logits_to_keep,
    "position_ids": check_position_ids,
    "left_padded_generation": check_left_padded_generation,
    "compiled_static_generation": check_compiled_static_generation,
    **{f"attn_implementation={impl}": attention_check(impl, generate=False) for impl in ATTENTION},
    **{f"attn_implementation={impl} generate": attention_check(impl, generate=True) for impl in ATTENTION},
    **{f"cache_implementation={impl}": cache_check(impl) for impl in CACHES},
}


def run(item: str) -> dict:
    try:
        with torch.no_grad():  # flex_attention has no backward on a CPU; gradients are tested elsewhere
            CHECKS[item]()
    except Skip as e:
        return {"status": "skip", "detail": str(e)}
    except Exception:  # noqa: BLE001 - reported to the test, which fails with it
        return {"status": "fail", "detail": traceback.format_exc(limit=4)}
    return {"status": "pass", "detail": ""}


if __name__ == "__main__":
    OURS, LLAMA, results_path, *items = sys.argv[1:]
    results = {item: run(item) for item in items}
    results["every item"] = list(CHECKS)
    Path(results_path).write_text(json.dumps(results, indent=1))

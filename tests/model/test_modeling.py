"""The model against transformers' Llama, its own eager path, its cache, and save/load."""

import ast
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, LlamaForCausalLM

import model
from model import ShardGPTConfig, ShardGPTForCausalLM
from model.export import save_llama, to_llama

VARIANTS = {
    "tied-gqa": dict(tie_word_embeddings=True, num_key_value_heads=2),
    "untied-mha": dict(tie_word_embeddings=False, num_key_value_heads=4),
    "untied-mqa": dict(tie_word_embeddings=False, num_key_value_heads=1),
}


def build(**overrides) -> ShardGPTForCausalLM:
    return ShardGPTForCausalLM(ShardGPTConfig.from_preset("debug", **overrides)).eval()


@pytest.fixture(params=list(VARIANTS))
def pair(request):
    ours = build(**VARIANTS[request.param])
    # Perturb the norms so a swapped or missing norm weight cannot pass unnoticed.
    with torch.no_grad():
        for name, p in ours.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    llama = to_llama(ours).eval()
    assert isinstance(llama, LlamaForCausalLM)
    return ours, llama


def test_state_dict_loads_into_llama_strictly():
    ours = build(tie_word_embeddings=False)
    llama = LlamaForCausalLM(model.export.to_llama_config(ours.config))
    llama.load_state_dict(ours.state_dict(), strict=True)
    assert list(ours.state_dict()) == list(llama.state_dict())


def test_logits_and_loss_match_llama(pair):
    ours, llama = pair
    x = torch.randint(0, ours.config.vocab_size, (3, 40))
    a, b = ours(x, labels=x), llama(x, labels=x)
    torch.testing.assert_close(a.logits, b.logits)
    torch.testing.assert_close(a.loss, b.loss)


def test_gradients_match_llama(pair):
    ours, llama = pair
    x = torch.randint(0, ours.config.vocab_size, (2, 33))
    labels = x.clone()
    labels[:, :5] = -100  # ignored positions must not contribute
    ours(x, labels=labels).loss.backward()
    llama(x, labels=labels).loss.backward()
    theirs = dict(llama.named_parameters())
    for name, p in ours.named_parameters():
        torch.testing.assert_close(p.grad, theirs[name].grad, msg=name)


def test_greedy_generate_matches_llama(pair):
    ours, llama = pair
    prompt = torch.randint(0, ours.config.vocab_size, (2, 7))
    kw = dict(max_new_tokens=20, do_sample=False, pad_token_id=0)
    assert torch.equal(ours.generate(prompt, **kw), llama.generate(prompt, **kw))


def test_cached_decoding_equals_uncached():
    ours = build()
    prompt = torch.randint(0, ours.config.vocab_size, (2, 5))
    kw = dict(max_new_tokens=24, do_sample=False, pad_token_id=0)
    cached = ours.generate(prompt, use_cache=True, **kw)
    uncached = ours.generate(prompt, use_cache=False, **kw)
    assert torch.equal(cached, uncached)
    # And the logits of one cached step equal the full forward's last position.
    full = ours(cached).logits[:, -1]
    out = ours(cached[:, :-1], use_cache=True)
    step = ours(cached[:, -1:], cache=out.cache, use_cache=True).logits[:, -1]
    torch.testing.assert_close(step, full)


def test_left_padded_batch_matches_unpadded_rows():
    ours = build()
    a = torch.randint(1, ours.config.vocab_size, (1, 12))
    b = torch.randint(1, ours.config.vocab_size, (1, 8))
    batch = torch.cat([a, torch.cat([torch.zeros(1, 4, dtype=torch.long), b], 1)])
    mask = torch.ones_like(batch)
    mask[1, :4] = 0
    kw = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)
    together = ours.generate(batch, attention_mask=mask, **kw)
    assert torch.equal(together[0, 12:], ours.generate(a, **kw)[0, 12:])
    assert torch.equal(together[1, 12:], ours.generate(b, **kw)[0, 8:])


def test_sdpa_and_eager_agree():
    ours = build()
    x = torch.randint(0, ours.config.vocab_size, (2, 30))
    sdpa = ours(x).logits
    ours.config._attn_implementation = "eager"
    torch.testing.assert_close(ours(x).logits, sdpa)


def test_loss_ignores_minus_100_and_sums_with_num_items():
    ours = build()
    x = torch.randint(0, ours.config.vocab_size, (4, 16))
    labels = x.clone()
    labels[0, 3:9] = -100
    labels[2, :] = -100
    shift = torch.nn.functional.pad(labels, (0, 1), value=-100)[:, 1:]
    mean = ours(x, labels=labels).loss
    torch.testing.assert_close(ours(x, shift_labels=shift).loss, mean)
    # Token-weighted halves: two micro batches with different token counts add up to the full mean.
    n = (shift != -100).sum()
    halves = sum(ours(x[i : i + 2], shift_labels=shift[i : i + 2], num_items_in_batch=n).loss for i in (0, 2))
    torch.testing.assert_close(halves, mean)


def test_gradient_checkpointing_gives_the_same_gradients():
    ours = build().train()
    x = torch.randint(0, ours.config.vocab_size, (2, 24))
    ours(x, labels=x).loss.backward()
    plain = {n: p.grad.clone() for n, p in ours.named_parameters()}
    ours.zero_grad()
    ours.activation_checkpointing_enable()
    assert all(layer.gradient_checkpointing for layer in ours.model.layers)
    ours(x, labels=x).loss.backward()
    for n, p in ours.named_parameters():
        torch.testing.assert_close(p.grad, plain[n], msg=n)


def test_residual_projections_are_scaled_by_depth():
    ours = ShardGPTForCausalLM(ShardGPTConfig.from_preset("tiny", num_hidden_layers=8))
    std = ours.config.initializer_range
    layer = ours.model.layers[0]
    assert abs(layer.self_attn.q_proj.weight.std().item() - std) < 0.1 * std
    for proj in (layer.self_attn.o_proj, layer.mlp.down_proj):
        assert abs(proj.weight.std().item() - std / 4) < 0.1 * std / 4
    assert torch.all(layer.input_layernorm.weight == 1)


def test_no_split_modules_names_the_decoder_layer():
    ours = build()
    names = {type(m).__name__ for m in ours.modules()}
    assert ours._no_split_modules == {"ShardGPTDecoderLayer"} and "ShardGPTDecoderLayer" in names


def test_save_and_auto_load_give_identical_logits(tmp_path):
    ours = build(tie_word_embeddings=False)
    ours.save_pretrained(tmp_path)
    again = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert type(again) is ShardGPTForCausalLM
    x = torch.randint(0, ours.config.vocab_size, (2, 20))
    assert torch.equal(again(x).logits, ours(x).logits)


LOAD_WITHOUT_PROJECT = """
import sys
sys.path = [p for p in sys.path if p not in ("", {root!r})]
for name in ("model", "data", "recipes"):  # make the project unimportable, even if pip-installed
    sys.modules[name] = None
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM
net = AutoModelForCausalLM.from_pretrained({path!r}, trust_remote_code={remote})
assert type(net).__name__ == {cls!r}, type(net)
x = torch.load({inputs!r})
torch.save(net.eval()(x).logits, {out!r})
"""


def run_without_project(tmp_path, path, remote, cls):
    x = torch.randint(0, 512, (2, 20))
    torch.save(x, tmp_path / "x.pt")
    code = LOAD_WITHOUT_PROJECT.format(
        root=str(Path(__file__).resolve().parents[2]), path=str(path), remote=remote, cls=cls,
        inputs=str(tmp_path / "x.pt"), out=str(tmp_path / "logits.pt"),
    )  # fmt: skip
    subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=tmp_path, check=True, timeout=120)
    return x, torch.load(tmp_path / "logits.pt")


def test_trust_remote_code_load_in_a_process_without_the_project(tmp_path):
    ours = build()
    ours.save_pretrained(tmp_path / "ckpt")
    assert {"modeling_shardgpt.py", "configuration_shardgpt.py"} <= {p.name for p in (tmp_path / "ckpt").iterdir()}
    x, logits = run_without_project(tmp_path, tmp_path / "ckpt", True, "ShardGPTForCausalLM")
    assert torch.equal(logits, ours(x).logits)


def test_llama_export_loads_without_remote_code(tmp_path):
    ours = build(tie_word_embeddings=False, num_key_value_heads=2)
    save_llama(ours, tmp_path / "llama")
    x, logits = run_without_project(tmp_path, tmp_path / "llama", False, "LlamaForCausalLM")
    torch.testing.assert_close(logits, ours(x).logits)


def test_model_package_imports_nothing_from_the_rest_of_the_project():
    forbidden = {"data", "recipes", "accelerate", "deepspeed"}
    for path in Path(model.__file__).parent.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                roots = {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                roots = {node.module.split(".")[0]}
            else:
                continue
            assert not roots & forbidden, f"{path.name} imports {roots & forbidden}"


# ---------------------------------------------------------------------------------------------- chunked loss


def losses_and_grads(net, x, **kw) -> tuple[torch.Tensor, dict[str, torch.Tensor], object]:
    net.zero_grad(set_to_none=True)
    out = net(x, **kw)
    out.loss.backward()
    return out.loss.detach(), {n: p.grad.clone() for n, p in net.named_parameters()}, out


def chunked_and_plain(net, x, **kw):
    """The loss and gradients of the training forward (chunked) and of the eval forward (full logits,
    transformers' loss) on the same weights: the debug model has no dropout, so the modes differ only there."""
    chunked = losses_and_grads(net.train(), x, **kw)
    plain = losses_and_grads(net.eval(), x, **kw)
    return chunked, plain


@pytest.mark.parametrize("variant", ["tied-gqa", "untied-mha"])
@pytest.mark.parametrize("targets", ["labels", "shift_labels+num_items_in_batch"])
def test_chunked_loss_and_gradients_equal_the_plain_path(variant, targets):
    """In fp32 to the default tolerances: several chunks with a partial last one (7 tokens per chunk over
    3 x 40), ignored positions, tied and untied heads; the training forward holds no logits."""
    torch.manual_seed(0)
    net = build(**VARIANTS[variant])
    net.lm_head.chunk_size = 7
    x = torch.randint(0, net.config.vocab_size, (3, 40))
    labels = x.clone()
    labels[:, :5] = -100
    kw = dict(labels=labels) if targets == "labels" else dict(shift_labels=labels, num_items_in_batch=77)
    (loss, grads, out), (plain_loss, plain_grads, plain_out) = chunked_and_plain(net, x, **kw)
    assert out.logits is None and plain_out.logits.shape == (3, 40, net.config.vocab_size)
    torch.testing.assert_close(loss, plain_loss)
    for name, g in grads.items():
        torch.testing.assert_close(g, plain_grads[name], msg=name)


@pytest.mark.parametrize("precision", ["autocast-bf16", "bf16-weights"])
def test_chunked_loss_in_bf16_is_the_plain_loss(precision):
    """Under autocast (DDP/FSDP --bf16) and with bf16 weights (DeepSpeed --bf16) the loss is fp32 and equals
    the plain path's up to bf16 rounding of the matmuls; the head's gradient keeps the weight's dtype."""
    torch.manual_seed(0)
    net = build()
    net.lm_head.chunk_size = 16
    if precision == "bf16-weights":
        net = net.to(torch.bfloat16)
    x = torch.randint(0, net.config.vocab_size, (2, 40))
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "autocast-bf16"):
        (loss, grads, _), (plain_loss, plain_grads, _) = chunked_and_plain(net, x, labels=x)
    assert loss.dtype == torch.float32
    torch.testing.assert_close(loss, plain_loss.float(), rtol=1e-2, atol=1e-2)
    assert net.lm_head.weight.grad.dtype == net.lm_head.weight.dtype
    for name, g in grads.items():
        cos = F.cosine_similarity(g.float().flatten(), plain_grads[name].float().flatten(), dim=0)
        assert cos > 0.99, f"{name}: cosine {cos:.4f}"


@pytest.mark.parametrize("precision", ["fp32", "autocast-bf16"])
@pytest.mark.parametrize("variant", ["tied-gqa", "untied-mha"])
@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_compiled_loss_and_gradients_equal_eager(backend, variant, precision):
    """torch.compile gives the eager training loss and every gradient (ignored targets, a partial last chunk): the
    chunked loss is one opaque operator to the compiler, so no torch version's tracing of its in-place chunk loop can
    change the gradients (torch 2.11 zeroed them all when the loop was traced). fp32 to the default tolerances; under
    bf16 autocast to bf16's, the compiler being free to fuse the casts around the matmuls."""
    torch.manual_seed(0)
    net = build(**VARIANTS[variant]).train()
    net.lm_head.chunk_size = 16
    x = torch.randint(0, net.config.vocab_size, (2, 40))
    labels = x.clone()
    labels[:, :5] = -100
    tol = {} if precision == "fp32" else dict(rtol=2e-2, atol=2e-3)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision != "fp32"):
        loss, grads, _ = losses_and_grads(net, x, labels=labels)
        torch._dynamo.reset()
        net.zero_grad(set_to_none=True)
        compiled_loss = torch.compile(net, backend=backend)(x, labels=labels).loss
        compiled_loss.backward()
    compiled_loss, compiled_grads = compiled_loss.detach(), {n: p.grad for n, p in net.named_parameters()}
    assert compiled_loss.dtype == torch.float32
    torch.testing.assert_close(compiled_loss, loss, **tol)
    for name, g in grads.items():
        assert compiled_grads[name].abs().sum() > 0, f"{name}: every gradient is zero under {backend}"
        torch.testing.assert_close(compiled_grads[name], g, msg=name, **tol)


@pytest.mark.parametrize("shard_bytes", [1 << 40, 200_000], ids=["one file", "sharded"])
def test_a_streamed_export_holds_a_shard_at_a_time_and_loads_as_the_hub_does(tmp_path, shard_bytes):
    """`save_model_folder_streamed` writes weights as they arrive, part by part (as FSDP2 and ZeRO-3 gather them), in
    save_pretrained's files: `model.safetensors` when they fit one shard, else numbered shards and their index; the
    tied head is stored once. A process without the project loads it to the model's logits."""
    from safetensors.torch import load_file

    from model.export import save_model_folder_streamed

    ours = build()
    weights = ours.state_dict()
    parts = iter([{name: tensor} for name, tensor in weights.items()])  # one part a parameter
    count = save_model_folder_streamed(tmp_path / "ckpt", ours.config, parts, shard_bytes=shard_bytes)
    assert count == sum(p.numel() for p in ours.parameters())  # tied: counted once, as parameters() counts it
    files = sorted(p.name for p in (tmp_path / "ckpt").glob("*.safetensors"))
    if shard_bytes > 1 << 30:
        assert files == ["model.safetensors"] and not (tmp_path / "ckpt" / "model.safetensors.index.json").exists()
    else:
        assert len(files) > 1 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
        index = json.loads((tmp_path / "ckpt" / "model.safetensors.index.json").read_text())
        assert set(index["weight_map"].values()) == set(files)
    stored = {k: v for f in files for k, v in load_file(tmp_path / "ckpt" / f).items()}
    assert "lm_head.weight" not in stored and stored.keys() == weights.keys() - {"lm_head.weight"}
    assert all(torch.equal(stored[k], weights[k]) for k in stored)
    x, logits = run_without_project(tmp_path, tmp_path / "ckpt", True, "ShardGPTForCausalLM")
    assert torch.equal(logits, ours(x).logits)

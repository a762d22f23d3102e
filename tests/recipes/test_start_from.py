"""--model_name_or_path: training starts from a `LlamaForCausalLM` folder (written here, offline), loaded under
DDP, FSDP and ZeRO-3 on 2 CPU ranks: the first step's loss is the one that Llama model computes on the same
global batch. A checkpoint of another architecture is refused in one line naming the field."""

from __future__ import annotations

import json
import math

import pytest
import torch
from launching import launch, launcher_command
from transformers import HfArgumentParser, LlamaConfig, LlamaForCausalLM

from data import DataArguments, ShardedLoader, prepare_data
from training.pretrained import start_config

SEED = 42
MICRO, WORLD = 4, 2
# fp32 throughout; two ranks sum their partial losses in another order than one batched forward (a few ulps).
RTOL = 1e-6


@pytest.fixture(scope="module")
def llama_folder(corpus, tmp_path_factory):
    """A `LlamaForCausalLM` of the debug preset's shape (untied, norms not at 1, so every tensor is checked)
    with the corpus's tokenizer, and the loss it computes on the first global batch of the run."""
    (args,) = HfArgumentParser(DataArguments).parse_args_into_dataclasses(args=corpus["flags"])
    packed = prepare_data(args)
    tokenizer = packed.tokenizer
    config = LlamaConfig(
        vocab_size=128 * math.ceil(len(tokenizer) / 128), hidden_size=64, intermediate_size=176,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        tie_word_embeddings=False, rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    )  # fmt: skip
    torch.manual_seed(0)
    llama = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in llama.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    folder = tmp_path_factory.mktemp("llama")
    llama.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    # The global batch of the run's first step, as one micro batch: sum of CE over its targets / their count.
    (micro,) = next(iter(ShardedLoader(packed.train, MICRO * WORLD, 1, 1, 0, SEED)))
    with torch.no_grad():
        logits = llama(micro["input_ids"]).logits
    ce = torch.nn.functional.cross_entropy(logits.flatten(0, 1), micro["shift_labels"].flatten(), reduction="sum")
    return folder, (ce / micro["num_items_in_batch"]).item()


def first_loss(corpus, folder, config: str, out) -> float:
    args = [
        *corpus["flags"], f"--model_name_or_path={folder}", "--max_steps=1", f"--per_device_train_batch_size={MICRO}",
        "--warmup_steps=0", "--logging_steps=1", "--max_eval_batches=1", "--save_steps=0",
        "--sample_max_new_tokens=0", f"--seed={SEED}",
    ]  # fmt: skip
    run = launch(launcher_command("accelerate", config), args, out)
    assert json.loads((out / "run_config.json").read_text())["tokenizer_name"] == str(folder)
    return run.losses[1]


@pytest.mark.slow
@pytest.mark.multiproc
@pytest.mark.parametrize("config", ["ddp", "fsdp", "zero3"])
def test_first_step_loss_is_the_llama_models(config, corpus, llama_folder, tmp_path):
    folder, expected = llama_folder
    assert first_loss(corpus, folder, config, tmp_path / "out") == pytest.approx(expected, rel=RTOL)


@pytest.mark.parametrize(
    "change, field",
    [
        ({"hidden_act": "gelu"}, "hidden_act = 'gelu'"),
        ({"mlp_bias": True}, "mlp_bias = True"),
        ({"head_dim": 32}, "head_dim = 32"),
        (
            {"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}},
            "rope_parameters.rope_type = 'linear'",
        ),
    ],
)
def test_another_architecture_is_refused_naming_the_field(change, field, tmp_path):
    LlamaConfig(hidden_size=64, num_attention_heads=4, **change).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=f"config.json {field}") as e:
        start_config(str(tmp_path))
    assert "\n" not in str(e.value)


def test_another_model_type_is_refused(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    with pytest.raises(ValueError, match="model_type = 'gpt2'"):
        start_config(str(tmp_path))
    with pytest.raises(ValueError, match="pass a folder with a config.json"):
        start_config(str(tmp_path / "missing"))


def test_a_llama_config_translates_field_for_field():
    llama = LlamaConfig(
        vocab_size=384, hidden_size=64, intermediate_size=176, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-6, tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 5e5},
    )  # fmt: skip
    from model.export import from_llama_config, to_llama_config

    back = to_llama_config(from_llama_config(llama))
    for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                 "num_key_value_heads", "max_position_embeddings", "rms_norm_eps", "tie_word_embeddings"):  # fmt: skip
        assert getattr(back, name) == getattr(llama, name), name
    assert back.rope_parameters["rope_theta"] == 5e5


def test_the_checkpoints_tokenizer_unless_tokenizer_name_says_otherwise(tmp_path):
    from training.config import RunConfig

    LlamaConfig(hidden_size=64, num_attention_heads=4).save_pretrained(tmp_path / "bare")
    cfg = RunConfig(model_name_or_path=str(tmp_path / "bare"), output_dir=str(tmp_path / "out")).resolve(1)
    assert cfg.tokenizer_name is None  # no tokenizer in the folder: the BPE trained on the corpus
    (tmp_path / "bare" / "tokenizer.json").write_text("{}")
    cfg = RunConfig(model_name_or_path=str(tmp_path / "bare"), output_dir=str(tmp_path / "out")).resolve(1)
    assert cfg.tokenizer_name == str(tmp_path / "bare")
    cfg = RunConfig(model_name_or_path=str(tmp_path / "bare"), tokenizer_name="other", output_dir=str(tmp_path / "o"))
    assert cfg.resolve(1).tokenizer_name == "other"
    with pytest.raises(ValueError, match="--config_overrides 'num_hidden_layers=2' with --model_name_or_path"):
        RunConfig(model_name_or_path=str(tmp_path / "bare"), config_overrides="num_hidden_layers=2").validate(1)

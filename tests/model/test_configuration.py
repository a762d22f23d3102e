import pytest

from model import PRESETS, ShardGPTConfig
from model.__main__ import count_parameters


def test_presets_build_and_have_the_advertised_sizes():
    sizes = {name: count_parameters(ShardGPTConfig.from_preset(name)) for name in PRESETS}
    assert sizes["debug"] < 200_000
    assert 1e6 < sizes["tiny"] < 10e6
    assert abs(sizes["gpt2-124m"] - 124e6) / 124e6 < 0.02
    assert abs(sizes["gpt2-350m"] - 350e6) / 350e6 < 0.05
    assert 0.9e9 < sizes["llama-1b"] < 1.3e9
    assert 2.7e9 < sizes["llama-3b"] < 3.3e9
    assert 6.5e9 < sizes["llama-7b"] < 7.0e9


def test_preset_overrides_and_defaults():
    c = ShardGPTConfig.from_preset("debug", vocab_size=1000)
    assert c.vocab_size == 1000 and c.hidden_size == PRESETS["debug"]["hidden_size"]
    assert ShardGPTConfig(num_attention_heads=8, hidden_size=256).num_key_value_heads == 8


def test_roundtrip_through_dict():
    c = ShardGPTConfig.from_preset("debug", tie_word_embeddings=False)
    again = ShardGPTConfig.from_dict(c.to_dict())
    assert again.to_dict() == c.to_dict()


@pytest.mark.parametrize(
    ("kwargs", "field", "hint"),
    [
        (dict(hidden_size=100, num_attention_heads=8), "hidden_size=100", "choose num_attention_heads from"),
        (dict(hidden_size=96, num_attention_heads=32), "head_dim=3", "even head_dim"),
        (
            dict(num_attention_heads=4, num_key_value_heads=3),
            "num_key_value_heads=3",
            "valid values: [1, 2, 4]",
        ),
        (dict(num_hidden_layers=0), "num_hidden_layers=0", "positive integer"),
        (dict(vocab_size=-5), "vocab_size=-5", "positive integer"),
        (dict(intermediate_size=2.5), "intermediate_size=2.5", "positive integer"),
        (dict(rms_norm_eps=0.0), "rms_norm_eps=0.0", "positive number"),
    ],
)
def test_invalid_configs_name_the_field_value_and_fix(kwargs, field, hint):
    with pytest.raises(ValueError) as err:
        ShardGPTConfig(**kwargs)
    assert field in str(err.value) and hint in str(err.value)


def test_unknown_preset_lists_the_valid_ones():
    with pytest.raises(ValueError, match=r"preset='gpt5' is unknown; valid presets: debug, tiny, gpt2-124m"):
        ShardGPTConfig.from_preset("gpt5")

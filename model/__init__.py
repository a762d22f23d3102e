"""shardgpt's model: `import model` registers it with transformers' Auto classes.

import model
from transformers import AutoConfig, AutoModelForCausalLM
net = AutoModelForCausalLM.from_config(AutoConfig.for_model("shardgpt", **model.PRESETS["debug"]))
"""

from transformers import AutoConfig, AutoModelForCausalLM

from .configuration_shardgpt import PRESETS, ShardGPTConfig
from .modeling_shardgpt import ShardGPTForCausalLM, ShardGPTModel, ShardGPTPreTrainedModel

AutoConfig.register(ShardGPTConfig.model_type, ShardGPTConfig, exist_ok=True)
AutoModelForCausalLM.register(ShardGPTConfig, ShardGPTForCausalLM, exist_ok=True)
# `save_pretrained` then writes `auto_map` and copies the two modeling files beside the weights, so
# `from_pretrained(dir, trust_remote_code=True)` works where this package is not installed.
ShardGPTConfig.register_for_auto_class()
ShardGPTForCausalLM.register_for_auto_class("AutoModelForCausalLM")

__all__ = ["PRESETS", "ShardGPTConfig", "ShardGPTForCausalLM", "ShardGPTModel", "ShardGPTPreTrainedModel"]

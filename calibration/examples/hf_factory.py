"""A ``memplan calibrate --module`` factory for a Hugging Face model, built from its config.

    memplan calibrate --device cpu --module calibration/examples/hf_factory.py:build

No weights are downloaded: the model is built from a config with random initialisation, under
the fake-tensor mode memplan enters before calling ``build``, so even a full-size model takes
no memory. memplan reads the spec (layers, widths, heads, vocabulary) from ``model.config``;
pass ``--model`` with a spec when the config's family is not one memplan reads.
"""

import torch
from transformers import LlamaConfig, LlamaForCausalLM

CONFIG = LlamaConfig(
    vocab_size=1024, hidden_size=128, intermediate_size=352, num_hidden_layers=4,
    num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=256,
    attn_implementation="eager",  # or "sdpa": the profile measures what the model runs
)


def build(*, dtype: torch.dtype, device: torch.device | str = "cpu") -> torch.nn.Module:
    # the weights are made in the training dtype on the device directly: no second copy, and
    # no .to() that would have to swap parameters created under fake tensors
    with torch.device(device):
        return LlamaForCausalLM._from_config(CONFIG, dtype=dtype)

"""The model transformers builds from a ``config.json`` dict, on the meta device (no memory,
every parameter's shape): its exact parameter count and whether every decoder layer has a
self-attention module (``memplan.hf.fallback``). torch and transformers are imported here
only, when called."""

from __future__ import annotations

import re
from typing import Any, NamedTuple

# a decoder layer's self-attention module, as transformers names it (LlamaDecoderLayer.
# self_attn and the families built on it)
_SELF_ATTN = re.compile(r"(?:^|\.)layers\.(\d+)\.self_attn\.")


class MetaBuild(NamedTuple):
    num_params: int
    attention_layers: int  # decoder layers holding a self_attn module
    transformers_version: str
    config: dict[str, Any]  # the configuration class's to_dict(): every default written out


def meta_build(data: dict[str, Any]) -> MetaBuild:
    """``AutoConfig.for_model(**data)`` built by ``AutoModelForCausalLM.from_config`` on the
    meta device; tied weights counted once (``parameters()``). Raises ImportError without
    torch or transformers, ValueError for a model type transformers does not know."""
    import torch
    import transformers

    keep = {k: v for k, v in data.items() if k not in ("quantization_config", "auto_map")}
    config = transformers.AutoConfig.for_model(**keep)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    layers = {m.group(1) for name, _ in model.named_parameters()
              if (m := _SELF_ATTN.search(name))}
    return MetaBuild(sum(p.numel() for p in model.parameters()), len(layers),
                     transformers.__version__, config.to_dict())

"""The model transformers builds from a ``config.json`` dict, on the meta device (no memory,
every parameter's shape): its exact parameter count, every parameter tensor's name and shape,
and whether every decoder layer has a self-attention module (``memplan.hf.fallback``). torch
and transformers are imported here only, when called; a config is built once per process
(the same dict read again, by a plan's many estimates, reuses it)."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from contextlib import contextmanager
from functools import lru_cache
from typing import Any, NamedTuple

# a decoder layer's self-attention module, as transformers names it (LlamaDecoderLayer.
# self_attn and the families built on it)
_SELF_ATTN = re.compile(r"(?:^|\.)layers\.(\d+)\.self_attn\.")


class MetaBuild(NamedTuple):
    num_params: int
    attention_layers: int  # decoder layers holding a self_attn module
    transformers_version: str
    config: dict[str, Any]  # the configuration class's to_dict(): every default written out
    tensors: tuple[tuple[str, tuple[int, ...]], ...] = ()  # named_parameters(): each tensor
    #                                 once (a tied one under its first name), in order
    fp32_elements: int = 0  # elements of tensors built in fp32 in a model built in bf16


def meta_build(data: dict[str, Any]) -> MetaBuild:
    """``AutoConfig.for_model(**data)`` built by ``AutoModelForCausalLM.from_config`` on the
    meta device, in bf16 (a module that makes its parameter in fp32 whatever the model's dtype
    shows so); tied weights counted once (``parameters()``). Raises ImportError without
    torch or transformers, ValueError for a model type transformers does not know."""
    try:
        key = json.dumps(data, sort_keys=True)
    except TypeError:  # a to_dict() holding objects JSON cannot write: built uncached
        return _build(data)
    return _cached(key)


@lru_cache(maxsize=16)
def _cached(text: str) -> MetaBuild:
    return _build(json.loads(text))


@contextmanager
def _quiet() -> Iterator[None]:
    """Third-party warnings and log records below ERROR held back while torch and
    transformers are imported and the model is built: importing transformers' integrations
    imports torchao where it is installed, whose import logs its unloaded CUDA extensions
    (``torchao/__init__.py``) and torch's deprecation of ``register_constant`` on enums
    (``torch/utils/_pytree.py``); a command's answer (an error's one line among them) is
    memplan's own. The logging level disabled before is restored after."""
    import logging
    import warnings

    before = logging.root.manager.disable
    logging.disable(max(before, logging.WARNING))
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        logging.disable(before)


def _build(data: dict[str, Any]) -> MetaBuild:
    with _quiet():
        return _build_quietly(data)


def _build_quietly(data: dict[str, Any]) -> MetaBuild:
    import torch
    import transformers

    keep = {k: v for k, v in data.items() if k not in ("quantization_config", "auto_map")}
    config = config_for_model(keep)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    named = list(model.named_parameters())
    layers = {m.group(1) for name, _ in named if (m := _SELF_ATTN.search(name))}
    fp32 = sum(p.numel() for _, p in named if p.dtype == torch.float32)
    return MetaBuild(sum(p.numel() for p in model.parameters()), len(layers),
                     transformers.__version__, config.to_dict(),
                     tuple((name, tuple(p.shape)) for name, p in named), fp32)


def config_for_model(data: dict[str, Any]) -> Any:
    """``transformers.AutoConfig.for_model(**data)``, an int given for a field the
    configuration class declares bool read as its truth value: transformers 5.4 on validate
    the fields' types (huggingface_hub's strict dataclasses), and published configs carry
    such ints (Llama 4's ``attn_temperature_tuning: 4``) that earlier releases, and the
    modeling code (``if self.attn_temperature_tuning``), read as true."""
    import dataclasses

    import transformers

    try:
        cls = transformers.CONFIG_MAPPING[data.get("model_type", "")]
    except KeyError:  # for_model names the unknown type
        cls = None
    if cls is not None and dataclasses.is_dataclass(cls):
        bools = {f.name for f in dataclasses.fields(cls) if f.type in (bool, "bool")}
        data = {k: bool(v) if k in bools and type(v) is int else v for k, v in data.items()}
    return transformers.AutoConfig.for_model(**data)

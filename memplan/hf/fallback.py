"""A ``config.json`` of a model type memplan has no reader for.

With transformers installed, transformers' own configuration class builds the model on the
meta device (``memplan.profile.hf_meta``): its parameter count is exact and stated as such
(``ModelSpec.exact_num_params``). The estimate itself reads the config as the nearest block
memplan knows, Llama's pre-norm layer (grouped-query attention, a gated MLP; the keys every
Llama-style config names alike: ``memplan.hf.config.llama_fields``), and says it is approximate
(``ModelSpec.approximate``). A model whose decoder layers transformers builds without a
self-attention module (state-space, recurrent and hybrid mixers) is near no known block and is
refused. Without transformers, one line names the model type and how to count it.
"""

from __future__ import annotations

from typing import Any

from memplan.hf.config import ConfigKeys, llama_fields


def _unsupported(model_type: str, supported: tuple[str, ...]) -> str:
    return f"unsupported value {model_type!r} (memplan reads {', '.join(supported)})"


def fallback_fields(cfg: ConfigKeys, model_type: str, supported: tuple[str, ...],
                    name: str, where: str) -> dict[str, Any]:
    """The ``ModelSpec`` fields of an unknown model type, approximate, or a one-line error."""
    from memplan.profile.hf_meta import meta_build

    try:
        built = meta_build(cfg.data)
    except ImportError:
        raise cfg.error("model_type", _unsupported(model_type, supported) + "; install "
                        "transformers (pip install transformers) for its exact parameter "
                        "count from transformers' own config class, with an approximate "
                        "estimate") from None
    except (ValueError, KeyError, TypeError) as err:
        first = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise cfg.error("model_type", _unsupported(model_type, supported)
                        + f"; transformers cannot build it either: {first}") from None
    num_layers = cfg.get_int("num_hidden_layers")
    if built.attention_layers != num_layers:
        raise cfg.error("model_type", _unsupported(model_type, supported) + f"; transformers "
                        f"builds {built.attention_layers} of its {num_layers} layers with a "
                        "self-attention module (layers.N.self_attn): no block memplan knows "
                        f"is near it (transformers counts {built.num_params:,} parameters)")
    # the keys as the family's configuration class completes them (its head_dim, tied
    # embeddings, vocabulary defaults), errors naming the file
    full = ConfigKeys({**built.config, **cfg.data}, cfg.where)
    fields = llama_fields(full, head_dim_default=None, tie_default=False)
    fields.update(
        use_cache=full.get_bool("use_cache", True), name=name,
        source=f"Hugging Face config.json ({model_type}) at {where}: approximate",
        exact_num_params=built.num_params,
        approximate=(f"memplan has no reader for {model_type!r}: its layers are estimated as "
                     f"Llama's (attention, gated MLP) from the config's keys; the exact count, "
                     f"{built.num_params:,} parameters, is transformers "
                     f"{built.transformers_version}'s own build on the meta device"))
    return fields

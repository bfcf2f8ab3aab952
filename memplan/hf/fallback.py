"""A ``config.json`` of a model type memplan has no reader for.

With transformers installed, transformers' own configuration class builds the model on the
meta device (``memplan.profile.hf_meta``): its parameter count is exact and stated as such
(``ModelSpec.exact_num_params``). The estimate itself reads the config as the nearest block
memplan knows, Llama's pre-norm layer (grouped-query attention, a gated MLP; the keys every
Llama-style config names alike: ``memplan.hf.config.llama_fields``), and says it is approximate
(``ModelSpec.approximate``). Its weights, gradients and optimizer states follow the tensors
transformers builds, layer by layer (``ModelSpec.param_table``, ``memplan.hf.param_table``: exact
per layer, per pipeline stage, and per TP shard under the split rules stated there); the
blocks' own tensors are used only where those tensors do not fit the config's embedding and
head, and the line says so. A hybrid whose decoder layers transformers builds in part
without a self-attention module (state-space mixers: Granite 4.0-H) is
read so too, every layer as an attention layer, and its approximation says how many are not;
an activation memplan has no kernel for (xIELU) is read as SiLU, and said so. A model without
any self-attention layer (Mamba, RWKV) is near no known block and is refused. Without
transformers, one line names the model type and how to count it.
"""

from __future__ import annotations

from typing import Any

from memplan.hf.config import KERNEL_ACTIVATIONS, ConfigKeys, llama_fields
from memplan.hf.param_table import RULES, ParamTable, table_from_build


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
    except Exception as err:  # noqa: BLE001 - the configuration class's own validators
        # raise their own types (huggingface_hub's StrictDataclassClassValidationError)
        first = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise cfg.error("model_type", _unsupported(model_type, supported)
                        + f"; transformers cannot build it either: {first}") from None
    num_layers = cfg.get_int("num_hidden_layers")
    # the keys as the family's configuration class completes them (its head_dim, tied
    # embeddings, vocabulary defaults), errors naming the file
    data = {**built.config, **cfg.data}
    notes = []
    if built.attention_layers == 0:
        raise cfg.error("model_type", _unsupported(model_type, supported) + f"; transformers "
                        f"builds none of its {num_layers} layers with a self-attention module "
                        "(layers.N.self_attn): no block memplan knows is near it (transformers "
                        f"counts {built.num_params:,} parameters)")
    if built.attention_layers != num_layers:
        notes.append(f"transformers builds {built.attention_layers} of its {num_layers} layers "
                     "with a self-attention module (layers.N.self_attn), the others with "
                     "another mixer (state-space, convolution), estimated as attention too")
    other = _other_mixers(built.tensors)
    if other and built.attention_layers == num_layers:
        notes.append(f"its layers hold {', '.join(sorted(other))} beside the self-attention, "
                     "whose activations are not estimated")
    act = str(data.get("hidden_act", "silu")).lower()
    if act not in KERNEL_ACTIVATIONS:
        data["hidden_act"] = "silu"
        notes.append(f"its activation {act!r} is estimated as SiLU's")
    full = ConfigKeys(data, cfg.where)
    fields = llama_fields(full, head_dim_default=None, tie_default=False)
    table = _table(built, fields)
    if isinstance(table, ParamTable):
        # the tensors decide: a head transformers ties is tied whatever the key says
        fields["tied_embeddings"] = not any(n.startswith("lm_head.") for n, _ in built.tensors)
        states = ("; its weights, gradients and optimizer states follow those tensors, layer "
                  f"by layer ({RULES}); its activations, and what acts per projection (LoRA's "
                  "adapters, float8 casts), are the approximate blocks'")
        if table.fp32_elements:
            states += (f"; {table.fp32_elements:,} of its parameters transformers makes in fp32 "
                       "whatever the model's dtype are counted in the weights' dtype")
        fields["param_table"] = table
    else:
        states = f"; transformers' tensors are not used ({table})"
    fields.update(
        use_cache=full.get_bool("use_cache", True), name=name,
        source=f"Hugging Face config.json ({model_type}) at {where}: approximate",
        exact_num_params=built.num_params,
        approximate=(f"memplan has no reader for {model_type!r}: its layers are estimated as "
                     f"Llama's (attention, gated MLP) from the config's keys"
                     + "".join(f"; {note}" for note in notes)
                     + f"; the exact count, {built.num_params:,} parameters, is transformers "
                     f"{built.transformers_version}'s own build on the meta device" + states))
    return fields


# a decoder layer's modules that Llama's blocks stand for: the attention, the MLP (dense,
# experts, shared), the norms
_LLAMA_PARTS = ("self_attn", "mlp", "feed_forward", "block_sparse_moe", "shared_mlp")


def _other_mixers(tensors: tuple[tuple[str, tuple[int, ...]], ...]) -> set[str]:
    """The names of a layer's modules no approximate block stands for (Falcon-H1's mamba
    beside its attention), from transformers' tensor names (``layers.N.<module>.``)."""
    out = set()
    for name, _ in tensors:
        head, sep, rest = name.partition(".layers.")
        module = rest.split(".")[1] if sep and rest.count(".") >= 2 else ""
        if module and module not in _LLAMA_PARTS and "norm" not in module:
            out.add(module)
    return out


def _table(built: Any, fields: dict[str, Any]) -> ParamTable | str:
    """The tensors transformers built, as the spec's table, or why they do not fit it."""
    if not built.tensors:
        return "the build listed no tensors"
    tied = not any(name.startswith("lm_head.") for name, _ in built.tensors)
    return table_from_build(list(built.tensors), fields["num_layers"], fields["vocab_size"],
                            fields["hidden_size"], tied, built.fp32_elements)

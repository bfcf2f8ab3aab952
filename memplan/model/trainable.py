"""The trainable-parameter policy: which parameter groups of a stage hold gradients and
optimizer states (``memplan.model.model_states`` reads it).

Every parameter trains by default (``ALL``). Freezing a group (``requires_grad_(False)``: no
gradient is made for it, and the optimizer is built over the others, so it keeps no states
for it) is a selection here; the weights themselves are held either way. With LoRA
(``memplan.model.adapters``) every base weight is frozen and only the adapters train
(``adapters``: their tensors; peft's ``get_peft_model`` calls ``requires_grad_(False)`` on
everything but them, ``_mark_only_adapters_as_trainable``), in fp32; the frozen base linears
may be stored quantized (``stored_less_bytes``). Under ZeRO-3 / FSDP the policy also says, per
layer, what a unit shards and gathers (``layer_adapters``, ``layer_quantized``,
``layer_quant_data_bytes``) and what every rank keeps whole (``quant_state_bytes``):
``memplan.model.model_states.lora_params_bytes`` and ``unit_bytes``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple, Protocol

from memplan.choices import PlainEnum
from memplan.spec import ModelSpec
from memplan.workload import BaseQuant, Workload


class StageParams(Protocol):
    """What the policy reads of a stage's parameter counts
    (``memplan.model.model_states.StageParams`` has these fields)."""

    dense: int
    expert: int
    embedding: int
    head: int
    tensor_sizes: tuple[int, ...]
    tensor_shapes: tuple[tuple[int, ...], ...]
    embedding_tensors: int
    head_tensors: int


class ParamGroup(PlainEnum):
    """The parameter groups of a pipeline stage, in registration order."""

    EMBEDDING = "embedding"  # token (and position) embedding, first stage
    LAYERS = "layers"  # the decoder layers (dense and expert parameters)
    HEAD = "head"  # final norm and output projection, last stage


class Trained(NamedTuple):
    """Parameters of one rank that hold gradients and optimizer states, before ZeRO."""

    dense: int
    expert: int
    tensor_sizes: tuple[int, ...]  # elements of each trained tensor, in registration order
    tensor_shapes: tuple[tuple[int, ...], ...] = ()  # ... their shapes


class TrainablePolicy(NamedTuple):
    """The frozen parameter groups (none: every parameter trains)."""

    frozen: frozenset[ParamGroup] = frozenset()
    adapters: tuple[int, ...] = ()  # LoRA: elements of each adapter tensor, all that trains
    stored_less_bytes: int = 0  # bytes the frozen base linears' storage saves (quantized)
    # per layer of the stage, for FSDP's units: adapter elements, quantized base elements, and
    # of those the bytes FSDP shards and gathers (``adapters.quant_data_bytes``); the stage's
    # quantization state (scales, absmax), whole on every rank
    layer_adapters: tuple[int, ...] = ()
    layer_quantized: tuple[int, ...] = ()
    layer_quant_data_bytes: tuple[int, ...] = ()
    quant_state_bytes: int = 0
    # the most bytes quantizing one base weight holds at the model's load, on the device
    # (``adapters.torchao_quantize_bytes``; 0 where the load is not modelled)
    quantize_bytes: int = 0
    # per layer of the stage, the elements of each base weight torchao 0.1's ``to_nf4``
    # quantizes, in registration order, where the set-up is modelled (``memplan.model.nf4_init``)
    nf4_weights: tuple[tuple[int, ...], ...] = ()
    # torchao since 0.3: per layer of the stage, the elements of each base weight the load's
    # ``copy_`` quantizes, in registration order (its working set replayed once per weight:
    # ``alloc_sequence._setup``)
    nf4_loads: tuple[tuple[int, ...], ...] = ()

    @property
    def quantized(self) -> int:
        """Elements of the stage's quantized base weights."""
        return sum(self.layer_quantized)

    @property
    def quant_data_bytes(self) -> int:
        """Bytes of the quantized base weights' own data (sharded by ZeRO-3)."""
        return sum(self.layer_quant_data_bytes)

    def trained(self, params: StageParams) -> Trained:
        """What of ``params`` trains: its dense and expert counts and its tensors, without
        the frozen groups' (with adapters: the adapters alone)."""
        if self.adapters:
            return Trained(sum(self.adapters), 0, self.adapters)
        if not self.frozen:
            return Trained(params.dense, params.expert, params.tensor_sizes,
                           params.tensor_shapes)
        sizes = params.tensor_sizes
        emb_n, head_n = params.embedding_tensors, params.head_tensors
        groups = {ParamGroup.EMBEDDING: slice(0, emb_n),
                  ParamGroup.LAYERS: slice(emb_n, len(sizes) - head_n),
                  ParamGroup.HEAD: slice(len(sizes) - head_n, len(sizes))}
        counts = {ParamGroup.EMBEDDING: (params.embedding, 0),
                  ParamGroup.LAYERS: (params.dense - params.embedding - params.head,
                                      params.expert),
                  ParamGroup.HEAD: (params.head, 0)}
        kept = [g for g in ParamGroup if g not in self.frozen]
        return Trained(sum(counts[g][0] for g in kept), sum(counts[g][1] for g in kept),
                       tuple(n for g in kept for n in sizes[groups[g]]),
                       tuple(s for g in kept for s in params.tensor_shapes[groups[g]]))


ALL = TrainablePolicy()


def lora_policy(spec: ModelSpec, wl: Workload, layers: Sequence[int], t: int,
                param_bytes: int, last: bool = False) -> TrainablePolicy:
    """The trainable policy of a stage holding ``layers`` under LoRA (``ALL`` without): the
    adapters of each layer's adapted projections on one TP rank (and, on the ``last`` stage,
    the output projection's, registered after the layers': ``--lora-targets output``), and
    what storing the base linears quantized saves against ``param_bytes`` per weight
    element."""
    from memplan.model.adapters import adapters_of

    ad = adapters_of(wl, spec.fused_qkv or wl.fused_qkv)
    if ad is None:  # every parameter trains (the common case: no further import)
        return ALL
    from memplan.model.adapters import (base_weight_bytes, quant_data_bytes,
                                        torchao_chunked_quantize_bytes, torchao_quantize_bytes)
    from memplan.model.layer import layer_linears
    from memplan.model.linear import adapter_sizes, local_widths
    sizes: list[int] = []
    per_layer: list[tuple[int, int, int]] = []  # adapters, quantized, their data bytes
    nf4: list[tuple[int, ...]] = []  # torchao 0.1's NF4 weights per layer (elements each)
    less = state = largest = 0
    for i in layers:
        linears = layer_linears(spec, spec.is_moe_layer(i),
                                "linear" if spec.is_linear_layer(i) else "")
        own = adapter_sizes(linears, ad, t)
        sizes += own
        quantized = data = 0
        weights: list[int] = []
        for lin in linears:
            d_in, d_out = local_widths(lin, t)
            if not ad.quantizes(lin):
                continue
            stored = base_weight_bytes(ad.quant, d_in, d_out, param_bytes)
            less += d_in * d_out * param_bytes - stored
            if ad.quant is not BaseQuant.NONE:
                quantized += d_in * d_out
                data += quant_data_bytes(ad.quant, d_in, d_out)
                state += stored - quant_data_bytes(ad.quant, d_in, d_out)
                largest = max(largest, d_in * d_out)
                weights.append(d_in * d_out)
        per_layer.append((sum(own), quantized, data))
        nf4.append(tuple(weights))
    if last and not spec.tied_embeddings:
        from memplan.model.head import head_linear
        sizes += adapter_sizes([head_linear(spec, t)], ad, t)
    return TrainablePolicy(adapters=tuple(sizes), stored_less_bytes=less,
                           layer_adapters=tuple(a for a, _, _ in per_layer),
                           layer_quantized=tuple(q for _, q, _ in per_layer),
                           layer_quant_data_bytes=tuple(d for _, _, d in per_layer),
                           quant_state_bytes=state,
                           quantize_bytes=(torchao_quantize_bytes(largest)
                                           if ad.quant is BaseQuant.NF4_TORCHAO_01 else
                                           torchao_chunked_quantize_bytes(largest)
                                           if ad.quant is BaseQuant.NF4_TORCHAO else 0),
                           nf4_weights=(tuple(nf4) if ad.quant is BaseQuant.NF4_TORCHAO_01
                                        else ()),
                           nf4_loads=(tuple(nf4) if ad.quant is BaseQuant.NF4_TORCHAO
                                      else ()))

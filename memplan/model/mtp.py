"""Multi-token prediction (DeepSeek-V3's MTP; Megatron-LM's ``--mtp-num-layers D``): D
modules on the last pipeline stage, each predicting one more token ahead.

Read from megatron-core 0.16.1. ``transformer/multi_token_prediction.py``: without a custom
pipeline layout all D modules sit on the last stage (``mtp_on_this_rank``,
``get_mtp_num_layers_to_build``); each ``MultiTokenPredictionLayer`` holds ``enorm`` and
``hnorm`` (h each), ``eh_proj`` (column-parallel 2h -> h, no bias), a transformer layer of the
decoder's last layer's spec (``models/gpt/gpt_layer_specs.py`` ``get_gpt_mtp_block_spec_for_
backend``: ``spec.layer_specs[-1]``) and ``final_layernorm``. ``models/gpt/gpt_model.py``
``GPTModel.__init__`` builds the embedding on the last stage too (``if self.pre_process or
self.mtp_process``): under PP it is a copy of the first stage's (``shared_embedding_or_
output_weight`` returns it as the output weight when tied).

Per depth in forward (``MultiTokenPredictionLayer.forward``): the rolled ids' embedding, the
two norms, their concatenation [s, b, 2h] into ``eh_proj`` (which saves it), a gather over TP
(and a scatter under SP), the layer, the final norm. ``MultiTokenPredictionBlock.forward``
concatenates the main and the D hidden states into one new (1 + D) x [s, b, h] tensor;
``GPTModel._postprocess`` runs the shared output layer on each chunk (which saves the chunk, a
view of it), then the vocab-parallel loss per depth (its fp32 softmax saved to the backward),
the rolled loss mask (saved by the product) and the scaled [b, s] loss (saved by
``MTPLossAutoScaler``); the main logits and loss come last, so every depth's loss is alive at
the main loss's forward and its backward, which runs first.

What memplan does with them: each depth's transformer layer is one more layer of the last
stage's runs (``memplan.model.stage_parts.build_kinds``), so its saved terms, moments and
gradients are a decoder layer's; the rest of a depth is parameters of the head
(``memplan.model.model_states.count_stage_params``) and saved terms the head carries
(``memplan.model.head.head_terms``), freed at the main loss's backward. Two simplifications:
a depth's own terms (norm inputs, the concatenation, the embedding's ids: about 5 x [rows, h]
in the compute dtype) are freed at the loss's backward rather than at its layer's, so the
MTP layers' backward moments are low by them (the loss's backward, with every softmax alive,
is the larger moment); and the dense gradient of the MTP embedding's weight ([V / t, h] in the
compute dtype at its backward) is not a moment of its own (the head projection's backward
holds a logits-sized gradient beside the weight's, larger at every T > h).
"""

from __future__ import annotations

import math

from memplan.model import linear as lin
from memplan.model import norm
from memplan.model.dims import FP32_BYTES, Dims, Term
from memplan.model.embedding import embedding_terms
from memplan.model.linear import Linear
from memplan.spec import ModelSpec, norm_params
from memplan.workload import Recompute, Workload


def eh_proj(spec: ModelSpec) -> Linear:
    """``eh_proj``: column-parallel 2h -> h, no bias (``MultiTokenPredictionLayer.__init__``)."""
    return Linear("eh_proj", "mtp", 2 * spec.hidden_size, spec.hidden_size)


def mtp_layer_index(spec: ModelSpec) -> int:
    """The decoder layer whose kind each MTP depth's transformer layer has: the last
    (``get_gpt_mtp_block_spec_for_backend``: ``spec.layer_specs[-1]``)."""
    return spec.num_layers - 1


def mtp_recompute(wl: Workload) -> Recompute:
    """The MTP layers' recompute policy (``MultiTokenPredictionLayer._checkpointed_forward``):
    full recompute's uniform method checkpoints the whole depth (norms, ``eh_proj``, layer,
    final norm); the block method (``recompute_layers``) warns and runs it without; selective
    recompute applies inside the transformer layer as in the decoder's."""
    if wl.recompute is Recompute.FULL and (wl.recompute_layers is not None
                                           or wl.recompute_every is not None):
        return Recompute.NONE
    return wl.recompute


def depth_params(spec: ModelSpec, t: int) -> int:
    """Parameters of one depth beside its transformer layer, on one TP rank: enorm, hnorm
    and the final norm (``norm_params`` each, replicated) and ``eh_proj``'s shard 2h*h/t."""
    return 3 * norm_params(spec) + lin.weight_elements(eh_proj(spec), t)


def depth_tensor_shapes(spec: ModelSpec, t: int) -> list[tuple[int, ...]]:
    """Shapes of one depth's tensors beside its transformer layer, in registration order:
    enorm, hnorm, ``eh_proj`` (then the layer), final norm; the layer's are listed apart."""
    one = [(spec.hidden_size,)] * (2 if spec.norm_bias else 1)
    return [*one, *one, *lin.tensor_shapes(eh_proj(spec), t), *one]


def depth_tensor_sizes(spec: ModelSpec, t: int) -> list[int]:
    """Elements of ``depth_tensor_shapes``."""
    return [math.prod(shape) for shape in depth_tensor_shapes(spec, t)]


def embedding_copy(spec: ModelSpec, vocab_rows: int, position: int, pp: int) -> int:
    """Parameters the last stage adds for MTP's embedding: under PP its own
    ``LanguageModelEmbedding`` (``vocab_rows``: the rank's word-embedding shard, and the
    learned ``position`` table), less a tied head's word embedding, which the stage already
    holds (the output layer then has no weight); nothing without PP (the first stage's)."""
    if pp == 1:
        return 0
    return position + (0 if spec.tied_embeddings else vocab_rows)


def depth_terms(spec: ModelSpec, wl: Workload, dm: Dims, loss: list[Term]) -> list[Term]:
    """Saved terms of one depth for one micro-batch on one rank of the last stage, beside its
    transformer layer's (a layer kind of the stage, ``mtp_recompute``) and the main head's:
    the rolled ids' embedding (``embedding_terms``), enorm's and hnorm's inputs and
    statistics (norm terms but the output, which the concatenation copies), the
    concatenation [rows, 2h] ``eh_proj`` saves, the final norm's input and statistics, the
    depth's chunk [rows, h] of the concatenated hidden states (saved by the output layer),
    and ``loss``: the depth's loss terms (the head's), its rolled loss mask and scaled
    [b, s] loss in fp32. Under the uniform full recompute the checkpoint keeps only its two
    inputs: the embedding's output (the layer kind's saved input stands for it) and the
    incoming hidden state (hnorm's input)."""
    h = spec.hidden_size

    def normed(name: str) -> list[Term]:
        return [Term(f"mtp.{name}{t.name.removeprefix('final_norm')}", t.size_bytes)
                for t in norm.norm_terms("final_norm", spec, wl, dm)
                if not t.name.endswith(".output")]

    own = [Term(f"mtp.{t.name}", t.size_bytes) for t in embedding_terms(spec, dm)]
    chunk = [Term("mtp.hidden_states", dm.rows * h * dm.e)]
    batch = [Term("mtp.loss_mask", dm.tokens * FP32_BYTES),
             Term("mtp.loss", dm.tokens * FP32_BYTES)]
    if mtp_recompute(wl) is Recompute.FULL:
        inputs = [Term("mtp.hnorm.input", dm.rows * h * dm.stream_e)]
        return [*own, *inputs, *chunk, *loss, *batch]
    return [*own, *normed("enorm"), *normed("hnorm"),
            Term("mtp.eh_proj.input", dm.linear_rows * 2 * h * dm.e),
            *normed("final_layernorm"), *chunk, *loss, *batch]


def mtp_flops_per_token(spec: ModelSpec, layer: float, head: float) -> float:
    """Forward FLOPs of one token through one depth: its transformer layer's (``layer``),
    the output layer's (``head``, ``memplan.model.flops.head_flops_per_token``),
    ``eh_proj``'s 2 per weight and the three norms' 2 per parameter."""
    return (layer + head + lin.flops_per_token([eh_proj(spec)])
            + 3 * norm.Norm("final_norm").flops_per_token(spec, 0))

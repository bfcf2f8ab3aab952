"""A transformer layer composed of its blocks in execution order, and what it holds.

A pre-norm layer is two residual sub-layers, each a norm then a mixer (attention, then the MLP
or MoE feed-forward). The blocks (``memplan.model.block``) report their own bytes; this module
adds them up in order, so at each block's moment the saved bytes of the blocks before it and
the gradients of the blocks after it are running sums:

- forward, saving: each block's moments on top of what the blocks before it saved, beside the
  residual stream when no norm saves it (an upcast norm in low precision saves an fp32 copy);
- forward, checkpointed (full recompute): the layer saves only its input; between blocks it
  holds that input and, after the attention sub-layer, the post-attention residual; a mixer
  also reads its norm's output;
- backward, in reverse order: each block's moments on top of the saved bytes of the blocks
  before it, beside the incoming residual-stream gradient, with the gradients of the blocks
  after it made. Full recompute first rebuilds the whole layer (its checkpointed input stays
  alive), selective recompute rebuilds the attention core at the attention's moments.

Every moment was read off traces of the reference model with the exact tracker
(``memplan trace``; ``docs/ground_truth.md``).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import lru_cache
from typing import NamedTuple

from memplan.model.attention import (
    Attention,
    NopeAttention,
    WindowAttention,
    attention_linears,
    eager_held_item,
    eager_kept_moments,
    eager_rerun_softmax,
    held_weights_bytes,
    windowed,
)
from memplan.model import (compiled, compiled_order, linear, sac_conv, sac_falcon, sac_mamba,
                           sac_moe, sac_ops)
from memplan.model.deltanet import cache_states_bytes
from memplan.model.block import BackwardMoment, Block
from memplan.model.deltanet import DeltaNet, deltanet_linears
from memplan.model.dims import FP32_BYTES, MASK_BYTES, Dims, Term, total
from memplan.model.linear import Linear, Split, shares_input
from memplan.model.mla import Mla, mla_linears
from memplan.model.mlp import (Mlp, lora_working_steps, mlp_linears, rerun_pending_bytes,
                               rerun_stop_bytes, working_steps)
from memplan.model.moe import BEFORE_LOOP, MoE, down_biases_bytes, weights_width
from memplan.model.short_conv import ShortConv, conv_cache_bytes, short_conv_linears
from memplan.model.mamba import Mamba, mamba_cache_bytes, mamba_linears
from memplan.model.mamba import kernel as mamba_kernel
from memplan.model import falcon_h1, moe_titan
from memplan.model.falcon_h1 import ParallelMamba
from memplan.model.norm import Norm, StreamInput
from memplan.model.sac import sac_terms
from memplan.spec import ActivationImpl, ModelSpec, NormPlacement, PositionKind, QkNorm
from memplan.workload import Attention as Kernel
from memplan.workload import MambaKernel, MoeImpl, NormImpl, Recompute, SelectiveImpl, Workload

_ATTENTION, _WINDOW, _MLA, _MLP, _MOE = Attention(), WindowAttention(), Mla(), Mlp(), MoE()
_DELTANET = DeltaNet()
_SHORT_CONV = ShortConv()
_MAMBA = Mamba()
_NOPE = NopeAttention()
_PARALLEL_MAMBA = ParallelMamba()
def _attention_inputs(spec: ModelSpec) -> tuple[Linear, ...]:
    """The projections reading the attention norm's output: a plain attention's q/k/v (not
    MLA's, nor a parallel layer's, whose MLP reads it too: those not known here, none)."""
    if spec.mla is not None or spec.parallel_block:
        return ()
    return attention_linears(spec)[:-1]


def _mlp_inputs(spec: ModelSpec) -> tuple[Linear, ...]:
    return mlp_linears(spec, spec.ffn_hidden_size)[:-1] if spec.moe is None else ()


_PRE = {"attn": Norm("attn_norm", _attention_inputs), "mlp": Norm("mlp_norm", _mlp_inputs)}
_MOE_NORM = Norm("mlp_norm", _mlp_inputs, moe=True)  # before an MoE block (norm.moe_output_unread)
_INPUT = {"attn": StreamInput("attn_input"), "mlp": StreamInput("mlp_input")}
_POST = {"attn": Norm("attn_post_norm"), "mlp": Norm("mlp_post_norm")}
MIXERS = (Attention, Mla, Mlp, MoE, DeltaNet, ShortConv, Mamba, ParallelMamba)


def _sublayer(placement: NormPlacement, place: str, mixer: Block) -> tuple[Block, ...]:
    pre = ((_MOE_NORM if mixer is _MOE else _PRE[place]) if placement.pre_norm
           else _INPUT[place])
    return (pre, mixer, _POST[place]) if placement.post_norm else (pre, mixer)


_ATTENTIONS = {"mla": _MLA, "window": _WINDOW, "full": _ATTENTION, "linear": _DELTANET,
               "nope": _NOPE, "conv": _SHORT_CONV, "mamba": _MAMBA}
_BLOCKS = {(placement, attention, moe): (_sublayer(placement, "attn", _ATTENTIONS[attention])
                                         + _sublayer(placement, "mlp", _MOE if moe else _MLP))
           for placement in NormPlacement for attention in _ATTENTIONS for moe in (False, True)}
# a short-convolution or Mamba layer's norm feeds in_proj alone (Lfm2DecoderLayer.
# operator_norm, GraniteMoeHybridDecoderLayer.input_layernorm)
_IN_NORMS = {"conv": Norm("attn_norm", lambda spec: short_conv_linears(spec)[:1], copies=1),
             "mamba": Norm("attn_norm", lambda spec: mamba_linears(spec)[:1], copies=1)}
for _key, _blocks in list(_BLOCKS.items()):
    if _key[1] in _IN_NORMS and _key[0].pre_norm:
        _BLOCKS[_key] = (_IN_NORMS[_key[1]], *_blocks[1:])
# a parallel layer (``ModelSpec.parallel_block``): one norm, then both mixers reading its output
_PARALLEL = {(attention, moe): (_PRE["attn"], _ATTENTIONS[attention], _MOE if moe else _MLP)
             for attention in _ATTENTIONS for moe in (False, True)}
# Falcon-H1's layer (``MambaSpec.parallel_attention``): one norm, the Mamba2 mixer and
# attention side by side on it, then the MLP sub-layer (memplan.model.falcon_h1)
_FALCON_H1 = {(placement, moe): (falcon_h1.NORM, _PARALLEL_MAMBA)
              + _sublayer(placement, "mlp", _MOE if moe else _MLP)
              for placement in NormPlacement for moe in (False, True)}


# every block object a layer can have (each exposes ``memplan.model.block.Block``)
ALL_BLOCKS = tuple({id(b): b for blocks in (*_BLOCKS.values(), *_FALCON_H1.values())
                    for b in blocks}.values())


def layer_blocks(spec: ModelSpec, moe_layer: bool, variant: str = "") -> tuple[Block, ...]:
    """The blocks of a layer in execution order: per sub-layer its norm (or, without one, the
    stream input the mixer reads), its mixer, and a norm on the mixer's output where the
    placement has one (``NormPlacement``). ``variant``: "window", a sliding-window layer's
    attention (``memplan.model.attention.WindowAttention``), or a RoPE layer of a model whose
    q/k norm runs on those alone (``rope_normed``; the others of such a model have none,
    ``memplan.model.attention.NopeAttention``); "linear", a layer without attention: gated
    DeltaNet (``memplan.model.deltanet.DeltaNet``) or, with ``short_conv``, LFM2's short
    convolution (``memplan.model.short_conv.ShortConv``); "" the model's attention."""
    linear_mixer = ("conv" if spec.short_conv is not None else "mamba" if spec.mamba is not None
                    else "linear")
    attention = (linear_mixer if variant == "linear" else "mla" if spec.mla is not None
                 else "window" if variant == "window" else "full")
    if attention == "full" and rope_normed(spec):
        attention = "nope"
    if spec.parallel_block:
        return _PARALLEL[(attention, moe_layer)]
    if falcon_h1.parallel(spec):
        return _FALCON_H1[(spec.norm_placement, moe_layer)]
    return _BLOCKS[(spec.norm_placement, attention, moe_layer)]


def has_nope_layers(spec: ModelSpec) -> bool:
    """Whether some layers of a RoPE model attend without it (``ModelSpec.
    nope_layer_interval``: Llama 4, SmolLM3, Command R7B): under ``Recompute.OPS`` their ops
    differ (no rotation; Llama 4's temperature tuning), so an emitted policy counts them
    apart (``ops_variants``)."""
    return spec.nope_layer_interval > 0 and spec.position is PositionKind.ROPE


def rope_normed(spec: ModelSpec) -> bool:
    """Whether the q/k norm runs on the RoPE layers alone, the NoPE layers without it
    (``QkNorm.L2`` with ``nope_layer_interval``): those layers are a kind of their own."""
    return spec.qk_norm is QkNorm.L2 and spec.nope_layer_interval > 0


def sublayers(blocks: tuple[Block, ...]) -> list[tuple[Block, ...]]:
    """The blocks of each residual sub-layer: from its norm (or stream input) to the block
    before the next one's."""
    starts = [i for i, b in enumerate(blocks) if isinstance(b, (Norm, StreamInput))
              and not b.name.endswith("_post_norm")]
    return [blocks[a:b] for a, b in zip(starts, starts[1:] + [len(blocks)])]


def unsaved_stream(spec: ModelSpec, wl: Workload, dm: Dims) -> int:
    """The residual stream beside a sub-layer until its add, when nothing saves that tensor:
    an upcast norm in low precision saves an fp32 copy of its input, not the input itself
    (fp32 runs save the input itself, as does a norm under autocast, where the stream is
    fp32); a mixer reading the stream directly (no norm) saves it, but for the casts of an
    fp32 stream under autocast."""
    stream = dm.stream(spec.hidden_size)
    if not spec.norm_placement.pre_norm:
        return stream if dm.autocast else 0
    return stream if wl.norm_impl.upcast and dm.stream_e < FP32_BYTES else 0


class ForwardMoment(NamedTuple):
    """A local peak inside a layer's forward: this layer's tensors alive (saved so far, or the
    working set of a checkpointed layer) and transients such as the residual stream."""

    name: str
    alive_bytes: int
    transient_bytes: int
    block: str = ""  # the block it runs in (``Block.name``)


class LayerMoment(NamedTuple):
    """One moment inside a layer's backward where its bytes peak locally.

    ``alive_bytes``: this layer's saved (or recomputed) tensors still alive; ``transient_bytes``:
    gradients in flight, the residual-stream gradient included; ``grads_before``: parameter
    groups of this layer whose gradients already exist (``grad_group_params``);
    ``fresh_params``: of those, a weight whose gradient was just made, still in the compute
    dtype (an fp32 main gradient is made from it after).
    """

    name: str
    alive_bytes: int
    transient_bytes: int
    grads_before: tuple[str, ...]
    fresh_params: int = 0
    hook_freed: int = 0  # freed before the fresh gradient's hook runs (BackwardMoment's)


def layer_terms(spec: ModelSpec, wl: Workload, dm: Dims, *, moe_layer: bool,
                recompute: Recompute, variant: str = "",
                saved: tuple[list[Term], ...] | None = None) -> list[Term]:
    """Saved terms of one transformer layer under ``recompute`` (FULL keeps only its input).
    ``saved``: each block's ``saved`` terms for these inputs, where the caller made them."""
    wl = compiled.layer_workload(wl)
    if recompute is Recompute.FULL:
        return [Term("layer.input", dm.rows * spec.hidden_size * dm.stream_e)]
    if saved is None:
        saved = tuple(block.saved(spec, wl, dm, recompute)
                      for block in layer_blocks(spec, moe_layer, variant))
    return [term for terms in saved for term in terms]


def _parallel_first_output(spec: ModelSpec, dm: Dims) -> int:
    """Compiled, a parallel layer's attention output (its o_proj's), a buffer of its own
    until the one kernel summing the input and both branches writes into it: beside the MLP
    in a forward that saves (traced: tests/traced/test_compile_trace.py
    ``test_compiled_parallel_layer``, Cohere's layer, at the down projection's matmul);
    0 elsewhere."""
    return dm.rows * spec.hidden_size * dm.e if dm.compiled and spec.parallel_block else 0


def forward_moments(spec: ModelSpec, wl: Workload, dm: Dims, *, moe_layer: bool,
                    recompute: Recompute, variant: str = "",
                    saved: tuple[list[Term], ...] | None = None) -> list[ForwardMoment]:
    """Local peaks of one layer's forward (the module docstring); ``saved``: ``layer_terms``'."""
    wl = compiled.layer_workload(wl)
    blocks = layer_blocks(spec, moe_layer, variant)
    stream = dm.stream(spec.hidden_size)
    out: list[ForwardMoment] = []
    if recompute is Recompute.FULL and compiled.in_checkpoint(wl):
        return forward_moments(spec, wl, dm, moe_layer=moe_layer, recompute=Recompute.NONE,
                               variant=variant)
    rope = None if moe_layer else compiled_order.rebuilt_rope_bytes(spec, wl, dm, recompute)
    if (recompute is Recompute.FULL and not moe_layer
            and (peak := compiled.autocast_checkpointed_forward_bytes(spec, dm)) is not None):
        return [ForwardMoment("mlp", stream + peak, 0, "mlp"),
                *([ForwardMoment("rope", stream + rope, 0, "attn")] if rope else [])]
    if recompute is Recompute.FULL:
        held = stream  # the checkpointed input
        for norm, mixer, *post in sublayers(blocks):
            out += [ForwardMoment(m.name, held + m.transient_bytes, 0, norm.name)
                    for m in norm.working_set(spec, wl, dm)]
            # the casts of the mixer's weights join the cache as its linears run: at its
            # working set's peaks all but the output projection's (``last_weight``)
            casts = cast_cache_bytes(spec, wl, dm, mixer, recompute)
            working = mixer.working_set(spec, wl, dm)
            mixer_in = _mixer_input_bytes(spec, dm, norm, stream)
            out += [ForwardMoment(m.name, held + cast + (rope if m.name == "rope" and rope else
                                  mixer_in + m.transient_bytes), 0, mixer.name)
                    for m, cast in zip(working, _casts_so_far(spec, wl, dm, mixer, casts),
                                       strict=True)]
            # what the layer keeps of the mixer's return beside its output: eager
            # attention's probabilities, to the layer's end (``held_weights_bytes``)
            kept = held_weights_bytes(spec, wl, dm, mixer)
            out += [ForwardMoment(m.name, held + casts + kept + _beside_second(spec, b, stream)
                                  + m.transient_bytes, 0, b.name)
                    for b in post for m in b.working_set(spec, wl, dm)]
            # the residual sum joins the input (or what it is recomputed from)
            held += casts + stream + kept + compiled.sandwich_sum_stats_bytes(spec, dm)
            # Falcon-H1's scaled mixer outputs, the layer's locals to its return
            held += falcon_h1.held_bytes(spec, dm) if isinstance(mixer, ParallelMamba) else 0
        return out
    unsaved_input = unsaved_stream(spec, wl, dm)
    norm_out = _norm_output_beside(spec, dm)
    prior = 0
    # past the first sub-layer's add the layer's input is alive beside the residual sum the
    # next add reads, held by its caller's loop until the layer returns (transformers
    # modeling_llama.py LlamaModel.forward; torchtitan models/llama3/model.py TransformerBlock.
    # forward keeps x). Traced: tests/traced/test_hf_moe_families.py, test_finetune.py
    later = {id(b) for part in sublayers(blocks)[1:] for b in part}
    for i, block in enumerate(blocks):
        prior += cast_cache_bytes(spec, wl, dm, block, recompute)
        beside = (unsaved_input * (2 if id(block) in later else 1)
                  + (falcon_h1.held_bytes(spec, dm) if id(block) in later else 0)
                  + (norm_out if isinstance(block, MIXERS) else 0)
                  + (_parallel_first_output(spec, dm) if isinstance(block, (Mlp, MoE)) else 0))
        out += [ForwardMoment(m.name, prior + m.own_bytes, beside + m.transient_bytes,
                              block.name)
                for m in block.forward_moments(spec, wl, dm, recompute)]
        prior += total(saved[i] if saved else block.saved(spec, wl, dm, recompute))
    return out


def _mixer_input_bytes(spec: ModelSpec, dm: Dims, norm: Block, stream: int) -> int:
    """A checkpointed forward's mixer input beside its working set: its norm's output, none
    where it reads the stream itself (Olmo2DecoderLayer.forward) or where, compiled, every
    reader is a ``Float8Linear`` whose casts Inductor fuses the norm into
    (``compiled.float8_input_fused``)."""
    if isinstance(norm, StreamInput) or (
            isinstance(norm, Norm) and norm.readers is not None
            and compiled.float8_input_fused(norm.readers(spec), dm)):
        return 0
    return stream


def _norm_output_beside(spec: ModelSpec, dm: Dims) -> int:
    """Under autocast no linear saves a norm's (fp32) output, the casts of it instead; the
    output is the mixer's argument, alive until the mixer returns (under DTensor sequence
    parallelism the mixer's input all-gathered to the full sequence, once for its linears).
    Without a norm before the mixer its argument is the stream, counted as unsaved
    (``unsaved_stream``). Compiled, the norm's pointwise ops and autocast's cast are one
    Inductor kernel, which writes the cast alone (``compiled.norm_output_fused``)."""
    if not dm.autocast or not spec.norm_placement.pre_norm or compiled.norm_output_fused(dm):
        return 0
    return dm.linear_rows * spec.hidden_size * dm.stream_e


def _beside_second(spec: ModelSpec, block: Block, stream: int) -> int:
    """What a parallel layer's second mixer (``ModelSpec.parallel_block``: the MLP after the
    attention, both reading one norm's output) runs beside in a checkpointed forward: that
    norm's output, its input, and the attention's output, a local of the layer until the sum
    (models/cohere2/modeling_cohere2.py Cohere2DecoderLayer.forward: ``hidden_states_mlp =
    self.mlp(hidden_states)`` while ``hidden_states_attention`` waits for ``residual +
    hidden_states_attention + hidden_states_mlp``). Traced: Cohere2 narrowed, 2 x 1,024
    tokens, full recompute's forward was two streams under (-8.6% in bf16)."""
    return 2 * stream if spec.parallel_block and isinstance(block, MIXERS) else 0


def _casts_so_far(spec: ModelSpec, wl: Workload, dm: Dims, mixer: Block,
                  casts: int) -> list[int]:
    """Of a checkpointed mixer's weight casts (``casts``), those in autocast's cache at each
    of its working set's moments: all but the output projection's (``last_weight``), made as
    its linears run; Falcon-H1's two mixers cast theirs one after the other
    (``ParallelMamba.working_casts``)."""
    if isinstance(mixer, ParallelMamba):
        return mixer.working_casts(spec, wl, dm)
    late = last_weight(spec, dm, mixer) * dm.e if casts else 0
    return [casts - late] * len(mixer.working_set(spec, wl, dm))


def cast_cache_bytes(spec: ModelSpec, wl: Workload, dm: Dims, block: Block,
                     recompute: Recompute) -> int:
    """Bytes of a block's casts that autocast's cache holds until the forward ends, beyond
    what autograd saves: the low-precision copies of its linears' biases, which no backward
    reads, and in a checkpointed layer, whose forward saves nothing, of its weights too. The
    cache keeps every cast of an fp32 leaf that requires grad (``cached_cast`` in
    ``aten/src/ATen/autocast_mode.cpp``, whatever the grad mode) until the outermost autocast
    region exits (``torch.autocast.__exit__`` clears it)."""
    if not dm.autocast or compiled.casts_in_graph(dm) or not isinstance(block, MIXERS):
        return 0
    # a Mamba2 mixer casts some of its tensors only (``Mamba.cast_sizes``)
    casts = sum(block.cast_sizes(spec, wl, dm.tp) if isinstance(block, (Mamba, ParallelMamba))
                else block.tensor_sizes(spec, dm.tp, 1)) * dm.e
    if recompute is Recompute.FULL:
        return casts
    return casts - sum(t.size_bytes for t in block.saved(spec, wl, dm, recompute)
                       if t.name.endswith(".weight_casts"))


def kv_cache_bytes(spec: ModelSpec, wl: Workload, dm: Dims, recompute: Recompute,
                   variant: str = "") -> int:
    """A key/value cache the training forward fills (``Workload.kv_cache``: transformers with
    use_cache, which gradient checkpointing turns off): its copies of K and V replace the
    projections' outputs, except under autocast, where they are made in the fp32 key's dtype
    (``DynamicLayer.lazy_initialization``) and autograd saves casts of them: both fp32 copies
    stay until the forward's output is dropped. Eager attention with grouped K/V saves the
    copies ``repeat_kv`` makes for every query head, not the cache's K and V, which stay as
    long (traced: tests/traced/test_frameworks.py gemma2 eager), as does SDPA in a
    sliding-window layer given a mask (``memplan.model.attention.windowed``)."""
    if not (wl.kv_cache and recompute is Recompute.NONE):
        return 0
    if falcon_h1.parallel(spec):
        # Falcon-H1: transformers 5.3's FalconH1Model.forward makes no cache unless given one;
        # 5.23's makes a DynamicCache (use_cache): the attention's and the mixer's states
        if mamba_kernel(spec, wl) is not MambaKernel.TORCH_EINSUM:
            return 0
        return _attention_cache_bytes(spec, wl, dm, variant) + mamba_cache_bytes(spec, wl, dm)
    if spec.short_conv is not None:  # every layer's conv state, and attention's own
        conv = conv_cache_bytes(spec, dm)
        return conv if variant == "linear" else conv + _attention_cache_bytes(spec, wl, dm,
                                                                              variant)
    if variant == "linear" and spec.mamba is not None:
        # transformers 5.3's GraniteMoeHybridModel.forward makes no cache when none is passed:
        # its Mamba layers get cache_params None; 5.23's makes one (mamba_einsum.cache_bytes)
        return mamba_cache_bytes(spec, wl, dm)
    if variant == "linear":
        return cache_states_bytes(spec, wl, dm)
    return _attention_cache_bytes(spec, wl, dm, variant)


def _attention_cache_bytes(spec: ModelSpec, wl: Workload, dm: Dims, variant: str) -> int:
    """``kv_cache_bytes`` of an attention layer."""
    if dm.autocast:
        # RoPE that keeps the low dtype hands the cache low-precision K, which SDPA saves
        return (2 * dm.tokens * spec.kv_size // dm.tp * dm.stream_e
                if spec.rope_fp32_under_autocast else 0)
    repeated = wl.attention is Kernel.EAGER or (variant == "window" and windowed(spec, wl))
    if repeated and spec.num_kv_heads < spec.num_attention_heads:
        return 2 * dm.tokens * spec.kv_size // dm.tp * dm.e
    return 0


def last_weight(spec: ModelSpec, dm: Dims, mixer: Block) -> int:
    """Elements of a mixer's output projection weight on this rank (its last matmul)."""
    if isinstance(mixer, DeltaNet):
        return linear.weight_elements(deltanet_linears(spec)[-1], dm.tp)
    if isinstance(mixer, ShortConv):
        return linear.weight_elements(short_conv_linears(spec)[-1], dm.tp)
    if isinstance(mixer, Mamba):
        return linear.weight_elements(mamba_linears(spec)[-1], dm.tp)
    return spec.attn_out_size * spec.hidden_size // dm.tp if isinstance(
        mixer, (Attention, Mla, ParallelMamba)) \
        else spec.ffn_hidden_size * spec.hidden_size // dm.tp


def layer_cast_cache_bytes(spec: ModelSpec, wl: Workload, dm: Dims, moe_layer: bool,
                           recompute: Recompute, variant: str = "") -> int:
    return sum(cast_cache_bytes(spec, wl, dm, b, recompute)
               for b in layer_blocks(spec, moe_layer, variant))


def backward_moments(spec: ModelSpec, wl: Workload, dm: Dims, *, moe_layer: bool,
                     recompute: Recompute, variant: str = "",
                     host_saved: Callable[[Block, BackwardMoment], int] | None = None,
                     saved_terms: tuple[list[Term], ...] | None = None) -> list[LayerMoment]:
    """The local peaks of one layer's backward, in backward order (see the module docstring).
    ``host_saved``: its saved tensors wait in host memory (``memplan.model.offload``): at a
    block's moment the blocks before it hold nothing on the GPU and the block holds what
    ``host_saved(block, moment)`` says its running node copied back. ``saved_terms``:
    ``layer_terms``' (not read under FULL, whose rerun saves its own)."""
    wl = compiled.layer_workload(wl)
    blocks = layer_blocks(spec, moe_layer, variant)
    policy = Recompute.NONE if recompute is Recompute.FULL else recompute  # what is rebuilt
    if recompute is Recompute.FULL:
        dm = compiled.rerun_dims(dm)
        wl = rerun_workload(wl)
    stream = dm.stream(spec.hidden_size)
    incoming = stream  # the residual-stream gradient, alive through the layer
    saved = ([total(terms) for terms in saved_terms]
             if saved_terms is not None and recompute is not Recompute.FULL
             else [total(block.saved(spec, wl, dm, policy)) for block in blocks])
    prior = [sum(saved[:i]) for i in range(len(blocks))]
    # The checkpointed input stays while the layer is rebuilt, unless the rebuilt norm saves
    # that very tensor (a fused norm's input; an fp32 stream, where the upcast is a no-op,
    # but for a LayerNorm centring twice, which saves its two differences and not its input:
    # Cohere2LayerNorm.forward; traced: Cohere2 narrowed, 2 x 1,024 tokens, full recompute's
    # backward was one fp32 stream under in fp32 and amp-bf16).
    input_is_saved = (wl.norm_impl is NormImpl.FUSED
                      or (dm.stream_e >= FP32_BYTES and not spec.norm_centres_twice)
                      or not (spec.norm_placement.pre_norm or dm.autocast))
    extra = stream if recompute is Recompute.FULL and not input_is_saved else 0
    out = (_rerun_moments(spec, wl, dm, blocks, saved, prior, extra, input_is_saved)
           if _rebuilt_whole(recompute, wl, dm, moe_layer) else [])
    later: tuple[str, ...] = ()  # the blocks whose backward has run: all their gradients
    rerun = recompute is Recompute.FULL  # the rerun's tensors, dropped as they are unpacked
    mlp_first = _mlp_first(spec, wl, dm, recompute, moe_layer)
    if mlp_first:  # the MLP's moments hold the norm's rebuilt tensors, not the attention's
        prior = [sum(n for b, n in zip(blocks[:i], saved) if not isinstance(b, MIXERS))
                 if isinstance(block, Mlp) else p
                 for i, (block, p) in enumerate(zip(blocks, prior))]
    for block, before in reversed(list(zip(blocks, prior))):
        waiting = _first_output_grad(spec, dm, block)
        out += [LayerMoment(m.name, extra + (host_saved(block, m) if host_saved
                                             else before + m.own_bytes - rerun * m.rerun_freed),
                            incoming + waiting + m.transient_bytes, later + m.grads,
                            m.fresh_params,
                            0 if host_saved else m.hook_freed)
                for m in block.backward_moments(spec, wl, dm, policy)]
        later += (block.name,)
    if moe_layer:
        return out
    return _compiled_schedule(out, spec, wl, dm, recompute, variant, incoming, later,
                              mlp_first)


def _compiled_schedule(out: list[LayerMoment], spec: ModelSpec, wl: Workload, dm: Dims,
                       recompute: Recompute, variant: str, incoming: int,
                       later: tuple[str, ...], mlp_first: bool) -> list[LayerMoment]:
    """A dense layer's backward moments (``backward_moments``' ``out``, ``later``: every
    block's gradient group) as Inductor schedules the compiled layer's backward, unchanged
    where it is not compiled."""
    # compiled under autocast, the MLP's weight gradients at the end
    out = compiled.with_deferred_mlp(out, spec, wl, dm)
    # compiled post norms: the MLP post norm's weight gradient with the attention's
    out = compiled.with_post_norm_schedule(out, spec, wl, dm, recompute)
    # compiled under autocast, a parallel layer's attention backward before the MLP's kernel
    out = compiled_order.with_parallel_attention_first(out, spec, dm, recompute)
    # compiled, not checkpointed around the graph: the norms' weight gradients after the
    # attention's backward
    out = compiled_order.with_norm_reductions_last(out, spec, wl, dm, recompute)
    # compiled with per-head q/k norms: the attention's weight gradients after its inputs'
    out = compiled_order.with_qk_norm_input_grads(out, spec, wl, dm, recompute)
    if (end := compiled.autocast_end_bytes(spec, dm)) is not None:
        # the compiled backward's end: every weight gradient made (``compiled.
        # autocast_end_bytes``), the saved set freed
        out.append(LayerMoment("compiled_end", 0, incoming + end, later))
    if compiled.rebuilt_attention_schedule(spec, wl, dm, recompute):
        # the compiled attention's backward as Inductor orders it
        out += [LayerMoment(*m) for m in compiled.attention_backward_moments(spec, dm)]
        # Inductor's wrapper holds the SDPA output's gradient only where its estimate allows
        out = compiled.with_sdpa_grad_reuse(out, spec, dm,
                                            grad_group_params(spec, dm.tp, 1, False, variant))
    if copy := compiled.rerun_output_copy_bytes(spec, wl, dm, recompute):
        # transformers' rerun's output copy, made by the attention's rerun: after the MLP's
        # backward in a parallel layer (``mlp_first``)
        copied = compiled.with_output_copy(out, copy)
        out = [m if mlp_first and m.name.startswith("mlp") else c
               for m, c in zip(out, copied, strict=True)]
    return out


def _mlp_first(spec: ModelSpec, wl: Workload, dm: Dims, recompute: Recompute,
               moe_layer: bool) -> bool:
    """A dense parallel layer (``ModelSpec.parallel_block``) rebuilt inside the compiled
    graph: Inductor reruns and differentiates the MLP branch, which reads the norm's output
    alone, before it reruns the attention (traced: tests/traced/test_compile_trace.py
    ``test_compiled_parallel_layer``, Cohere's layer: the whole rebuilt set counted at the
    MLP's kernel was +15.4%)."""
    return (recompute is Recompute.FULL and dm.compiled and spec.parallel_block
            and not compiled.in_checkpoint(wl) and not moe_layer)


@lru_cache(maxsize=1024)
def rerun_workload(wl: Workload) -> Workload:
    """The workload a checkpointed layer's rerun rebuilds its saved tensors under: without a
    training forward's cache (``Workload.kv_cache``), which transformers turns off under
    gradient checkpointing (modeling_layers.py GradientCheckpointingLayer.__call__: with
    gradient checkpointing in training, ``use_cache`` False and ``past_key_values`` None)."""
    return wl.model_copy(update={"kv_cache": False}) if wl.kv_cache else wl


def _branch_grad(spec: ModelSpec, dm: Dims) -> int:
    """Under autocast, the gradient of a sub-layer's low-precision output added to the fp32
    stream: the add's backward casts the stream's gradient to the branch's dtype (the
    engine's validate_outputs), a new tensor of the stream's rows in the compute dtype; 0
    where the stream is in the compute dtype (the add passes the gradient itself)."""
    return dm.rows * spec.hidden_size * dm.e if dm.autocast and dm.e < dm.stream_e else 0


def _rebuilt_whole(recompute: Recompute, wl: Workload, dm: Dims, moe_layer: bool) -> bool:
    """Whether a layer's backward begins with a rerun that holds its rebuilt saved set whole
    (``_rerun_moments``): under full recompute, but for torchtitan's MoE block compiled with
    the checkpoint inside its graph, where Inductor's partitioner recomputes within the
    backward graph and its scheduler interleaves the rerun with the gradients
    (``moe_titan_compiled.full_ac_backward``, traced)."""
    return recompute is Recompute.FULL and not (
        moe_layer and dm.compiled and wl.moe_impl is MoeImpl.TITAN)


def _first_output_grad(spec: ModelSpec, dm: Dims, block: Block) -> int:
    """A parallel layer's attention output gradient, alive through its MLP's backward under
    autocast: the layer's sum ``residual + hidden_states_attention + hidden_states_mlp``
    (Cohere2DecoderLayer.forward) adds the mixers' low-precision outputs to the fp32 stream,
    and each add's backward casts the fp32 gradient to its bf16 operand's dtype. The inner
    add (residual + attention) ran after the MLP, so its node runs before the MLP's backward
    (autograd's ready queue takes the highest sequence number first), and its cast waits for
    the attention's backward. Traced: Cohere2 narrowed, 2 x 1,024 tokens, amp-bf16: full
    recompute's backward was one bf16 stream under (-1.5%). Without autocast the adds pass
    the gradient itself. Compiled, both branches read one cast of the incoming gradient
    (the graph's first kernel: traced, Command R's layer, amp-bf16, 2 x 256 tokens)."""
    return (_branch_grad(spec, dm) if spec.parallel_block and isinstance(block, (Mlp, MoE))
            and not dm.compiled else 0)


def _rerun_in(spec: ModelSpec, wl: Workload, dm: Dims, blocks: tuple[Block, ...]
              ) -> tuple[int, bool, bool]:
    """What waits through a fully recomputed layer's rerun (``_rerun_moments``): the
    residual stream's gradient and what the layer's first backward nodes made before the
    one that reruns it; and whether its mixers rerun beside their norm's fp32 output under
    autocast (an attention layer's; Granite 4.0-H's Mamba2 layer on the einsum scan)."""
    stream = dm.stream(spec.hidden_size)
    mlp = any(isinstance(b, Mlp) for b in blocks)
    # the sub-layer's scaled output (``ModelSpec.scaled_residual``): its scalar product's
    # backward ran before the node that reruns the layer, its gradient copy waits beside the
    # stream's (traced: Granite 4.0-H on transformers 5.23, tests/unit/test_mamba_einsum.py;
    # Falcon-H1's ``down_proj(y) * down_multiplier``, FalconH1MLP.forward, keeping the
    # attention's and MLP's outputs in fp32, tests/unit/test_sac_mamba_einsum.py: one T h
    # fp32 above before; under autocast its rebuild moments hold their rerun's context);
    # an adapted down projection's sum's gradients (``mlp.rerun_pending_bytes``)
    # Under autocast the last sub-layer's add casts the stream's gradient to the branch's
    # dtype (``_branch_grad``) before the branch's first node, which reruns the layer (traced:
    # the reference GPT under amp-bf16, full recompute: a bf16 stream-sized tensor made before
    # the rerun's first op, alive through it); not in layers with a Mamba mixer, whose
    # rebuild moments hold their rerun's context (Falcon-H1's, traced on 5.3 and 5.23)
    amp = dm.autocast and not any(isinstance(b, (Mamba, ParallelMamba)) for b in blocks)
    branch_grad = _branch_grad(spec, dm) if amp else 0
    scaled = spec.scaled_residual or (mlp and falcon_h1.parallel(spec) and not dm.autocast)
    # Granite 4.0-H's Mamba2 layer on 5.23's einsum scan under autocast: the scaled output's
    # gradient waits in the branch's dtype (the scalar product's, of the cast gradient), and
    # the mixer reruns beside its norm's fp32 output, its argument, as an attention layer's
    # does (traced, full recompute, 2 x 512 tokens: the stream's fp32 gradient, the bf16
    # product and the norm's fp32 output beside the rerun's scan output, the backward's
    # peak 250,496 B above the estimate before, 11,648 B below it now). Not on 5.3's naive
    # scan, untraced there: its backward's peak is elsewhere (the same toy, full recompute:
    # the peak is the same with or without them), and Falcon-H1's moments hold its context
    einsum_amp = (dm.autocast and any(isinstance(b, Mamba) for b in blocks)
                  and mamba_kernel(spec, wl) is MambaKernel.TORCH_EINSUM)
    scaled_bytes = _branch_grad(spec, dm) if einsum_amp else stream
    rerun_in = (stream + branch_grad + (scaled_bytes if scaled else 0)
                + (rerun_pending_bytes(spec, dm) if mlp else 0))
    return rerun_in, amp, einsum_amp


def _rerun_moments(spec: ModelSpec, wl: Workload, dm: Dims, blocks: tuple[Block, ...],
                   saved: list[int], prior: list[int], extra: int,
                   input_is_saved: bool) -> list[LayerMoment]:
    """A fully recomputed layer's rerun, before its backward's moments (``backward_moments``):
    its stop and its blocks' own rerun moments, beside the gradients made before it began."""
    stream = dm.stream(spec.hidden_size)
    incoming = stream  # the residual-stream gradient, alive through the layer
    mlp = any(isinstance(b, Mlp) for b in blocks)
    rerun_in, amp, einsum_amp = _rerun_in(spec, wl, dm, blocks)
    # The rerun stops once the last saved tensor is packed: after the MLP's output dropout
    # (its mask), or its second linear, whose output is alive then (and dropout's), with
    # everything the layer saves and the post-attention residual when no norm saves it.
    mixer_out = dm.rows * spec.hidden_size * dm.e  # a mixer's output (the compute dtype)
    rerun_out = mixer_out * (2 if spec.dropout > 0 else 1) + (0 if input_is_saved else incoming)
    if dm.autocast and spec.dropout == 0 and not compiled.norm_output_fused(dm):
        # Under autocast the last tensor packed is the second linear's weight cast, made
        # before it runs: its output does not exist yet, its norm's fp32 output (the MLP's
        # argument, all-gathered under DTensor sequence parallelism) still does (traced);
        # compiled, Inductor's norm kernel writes the cast alone (Gemma 2's layer, amp-bf16,
        # full recompute inside the graph, 2 x 1,024 tokens: the rerun's end 26,517,504 B
        # with the held output, memplan 2 T h x 4 B over there, +0.25% over the peak)
        rerun_out = dm.linear_rows * spec.hidden_size * dm.stream_e
    if mlp:
        rerun_out += rerun_stop_bytes(spec, dm)  # an adapted down projection's
    out = [LayerMoment("rebuild_out", extra + sum(saved), rerun_in + rerun_out, ())]
    # Under autocast a mixer reruns beside its norm's fp32 output, its argument (the linears
    # save casts of it), and autocast's cache holds its biases' casts (``cast_cache_bytes``),
    # as in a forward that saves (``forward_moments``; traced: the reference GPT under
    # amp-bf16 with eager attention, full recompute, at the rerun's value matmul)
    norm_out = (dm.linear_rows * spec.hidden_size * dm.stream_e
                if (amp or einsum_amp) and spec.norm_placement.pre_norm else 0)
    cached = 0
    for block, before in zip(blocks, prior):
        cached += cast_cache_bytes(spec, wl, dm, block, Recompute.NONE) if amp else 0
        # inside the rerun's MLP the post-attention residual is alive too where no norm saves
        # it (its fp32 copy is what the norm saves: the same condition as the layer's input;
        # traced: peft LoRA under gradient checkpointing, at up's adapter sum)
        residual = extra if isinstance(block, Mlp) else 0
        beside = norm_out if isinstance(block, MIXERS) else 0
        out += [LayerMoment(m.name, extra + before + cached + m.own_bytes,
                            rerun_in + residual + beside + m.transient_bytes, ())
                for m in block.rebuild_moments(spec, wl, dm)]
    return out


class LayerKind(NamedTuple):
    """What one layer of a kind (MoE or dense, recompute policy) holds for one micro-batch."""

    terms: tuple[Term, ...]
    saved_bytes: int
    moments: tuple[LayerMoment, ...]
    forward_peak_bytes: int  # largest alive + transient inside its forward
    cached_bytes: int = 0  # autocast's casts held from its forward to the forward's end
    forward_blocks: tuple[tuple[str, int], ...] = ()  # (block, its largest alive +
    #                                                   transient) in forward order; () where
    #                                                   not resolved by block


def layer_kind(spec: ModelSpec, wl: Workload, dm: Dims, moe: bool,
               policy: Recompute, variant: str = "") -> LayerKind:
    """A layer's saved terms and moments (``memplan.model.memo`` caches it per kind);
    ``variant``: a sliding-window or linear-attention layer (``layer_blocks``,
    ``memplan.model.stage_parts.layer_keys``)."""
    wl = compiled.layer_workload(wl)
    if policy is Recompute.OPS:
        return ops_kind(spec, wl, dm, moe, variant)
    if policy is Recompute.SELECTIVE and wl.selective_impl is SelectiveImpl.OP:
        return _op_sac_kind(spec, wl, dm, moe, variant)
    # each block's saved terms, made once for the terms and both walks
    saved = (None if policy is Recompute.FULL else
             tuple(b.saved(spec, wl, dm, policy) for b in layer_blocks(spec, moe, variant)))
    terms = tuple(layer_terms(spec, wl, dm, moe_layer=moe, recompute=policy, variant=variant,
                              saved=saved))
    moments = backward_moments(spec, wl, dm, moe_layer=moe, recompute=policy, variant=variant,
                               saved_terms=saved)
    if policy is Recompute.FULL and not moe:  # Inductor's choice of order, by its estimates
        moments = compiled_order.with_full_ac_order(
            moments, spec, wl, dm, grad_group_params(spec, dm.tp, 1, False, variant))
    if not moe:  # below the MLP's weight-gradient threshold: lpmf's order, where surely kept
        moments = compiled_order.with_mlp_grads_last(
            moments, spec, wl, dm, grad_group_params(spec, dm.tp, 1, False, variant))
    forward = forward_moments(spec, wl, dm, moe_layer=moe, recompute=policy, variant=variant,
                              saved=saved)
    return LayerKind(terms, total(terms), tuple(moments),
                     max(m.alive_bytes + m.transient_bytes for m in forward),
                     layer_cast_cache_bytes(spec, wl, dm, moe, policy, variant)
                     + kv_cache_bytes(spec, wl, dm, policy, variant),
                     by_block(forward, mlp_steps(spec, wl, dm, moe, policy)))


def _op_sac_kind(spec: ModelSpec, wl: Workload, dm: Dims, moe: bool,
                 variant: str) -> LayerKind:
    """Per-op SAC's layer kind (``layer_kind``): a fully recomputed layer that also keeps its
    save list's outputs, which the rerun reuses (so its backward is the full recompute's)."""
    full = layer_kind(spec, wl, dm, moe, Recompute.FULL, variant)
    fused = wl.fused_qkv or spec.fused_qkv
    # torchtitan's MoE block: its counted matmuls and the router's topk
    titan = moe and wl.moe_impl is MoeImpl.TITAN
    kept = moe_titan.sac_terms(spec, dm, fused) if titan else sac_terms(spec, dm, fused)
    kept = tuple(compiled.sac_kept(kept, spec, dm, fused) if wl.compile else kept)
    # the recomputed layer's forward peaks in the MLP, before the down projection, whose
    # output (kept) does not exist yet; compiled with the checkpoint inside the graph,
    # at the up projection's matmul (``compiled.checkpointed_mlp_working_bytes``), which
    # holds the gate's output, the very tensor the policy keeps (traced: torchtitan's
    # block, 2 x 64 and 2 x 1,024 tokens, benchmarks/compiled_backward.py: one T x f over;
    # under autocast at the MLP's activation kernel, gate and up beside it: traced,
    # tests/traced/test_compile_trace.py, 2 x 256 and 2 x 1,024, exact)
    in_graph = not moe and not compiled.in_checkpoint(wl)
    linears = mlp_linears(spec, spec.ffn_hidden_size)
    gate_held = in_graph and (
        compiled.checkpointed_mlp_working_bytes(spec, dm, linears) is not None
        or compiled.autocast_checkpointed_forward_bytes(spec, dm) is not None
        or compiled.float8_gate_held(spec, dm, linears))
    late = sum(t.size_bytes for t in kept
               if t.name == "sac.mlp.w2" or (t.name == "sac.mlp.w1" and gate_held)
               or t.name.startswith("sac.moe.shared."))  # after the routed combine
    moments = full.moments
    if in_graph and compiled.sac_schedule(spec, dm):  # traced kernel, Inductor's own order
        baseline = backward_moments(spec, wl, dm, moe_layer=moe, recompute=Recompute.FULL,
                                    variant=variant)  # before full AC's choice of order
        moments = compiled_order.with_sac_schedule(
            baseline, spec, wl, dm, _attention_rebuilt(spec, wl, dm, variant), kept,
            grad_group_params(spec, dm.tp, 1, False, variant))
    elif in_graph and (amp := compiled.autocast_sac_deferred(
            moments, spec, dm, _attention_rebuilt(spec, wl, dm, variant),
            kept)) is not None:  # under autocast, the traced kernel
        moments = amp
    if in_graph:  # tensorwise float8 in torchtitan's block: lpmf's order
        moments = compiled_order.with_float8_sac_lpmf(
            moments, spec, wl, dm, linears, kept, total(full.terms) + total(kept))
    if not moe:  # below the MLP's weight-gradient threshold, as without the kept outputs
        moments = compiled_order.with_mlp_grads_last(
            moments, spec, wl, dm, grad_group_params(spec, dm.tp, 1, False, variant))
    return full._replace(terms=full.terms + kept,
                         saved_bytes=full.saved_bytes + total(kept),
                         forward_peak_bytes=full.forward_peak_bytes + total(kept) - late,
                         forward_blocks=(), moments=moments)


def _attention_rebuilt(spec: ModelSpec, wl: Workload, dm: Dims, variant: str) -> list[Term]:
    """The terms a full recompute rebuilds of a dense layer's blocks before its MLP norm (the
    attention norm's and the attention's; ``compiled.sac_deferred``)."""
    blocks = layer_blocks(spec, False, variant)
    mixer = next((i for i, b in enumerate(blocks) if b.name == "mlp_norm"), 0)
    rerun = compiled.rerun_dims(dm)
    return [t for b in blocks[:mixer]
            for t in b.saved(spec, rerun_workload(wl), rerun, Recompute.NONE)]


def mlp_steps(spec: ModelSpec, wl: Workload, dm: Dims, moe: bool,
              policy: Recompute) -> tuple[tuple[str, int], ...]:
    """A checkpointed dense layer's MLP working set module by module (``mlp.
    working_steps``); () otherwise."""
    if (policy is not Recompute.FULL or moe or compiled.in_checkpoint(wl)
            or compiled.autocast_checkpointed_forward_bytes(spec, dm) is not None):
        return ()
    return working_steps(spec, wl, dm) or lora_working_steps(spec, wl, dm)


def by_block(moments: list[ForwardMoment],
             steps: tuple[tuple[str, int], ...] = ()) -> tuple[tuple[str, int], ...]:
    """Each block's largest alive + transient among ``moments``, the blocks in the order they
    run (what a per-module mechanism pairs with its bytes at that block: ZeRO-3's gathered
    weights, ``memplan.model.sharding.DataParallel.layer_forward``). With ``steps`` (the
    checkpointed MLP's working set by module, ``mlp_steps``) the MLP's one moment is given
    as those, each ``mlp.<step>``: its alive bytes beside each step's transient. LoRA's
    adapter sum of the MLP (``mlp_lora``, ``mlp._frozen_forward``) is given apart, as
    ``mlp.lora``: it runs outside every module of its own (peft's ``Linear.forward`` adds
    ``lora_B(...) * scaling`` after ``lora_B`` returned)."""
    out: dict[str, int] = {}
    for m in moments:
        if steps and m.block == "mlp":
            # the moment is the MLP's working set, its adapters' sums included
            # (``mlp._lora_working_bytes``: the most of mlp.lora_working_steps' ``_lora``)
            base = m.alive_bytes + m.transient_bytes - max(t for _, t in steps)
            out.update((f"mlp.{name}", base + t) for name, t in steps)
            continue
        if m.name == "mlp_lora" and not steps:
            out["mlp.lora"] = m.alive_bytes + m.transient_bytes
            continue
        out[m.block] = max(out.get(m.block, 0), m.alive_bytes + m.transient_bytes)
    return tuple(out.items())


@lru_cache(maxsize=1024)
def ops_items(spec: ModelSpec, wl: Workload, dm: Dims, moe: bool | None = None,
              variant: str | None = None) -> tuple[sac_ops.Item, ...]:
    """What a layer under ``Recompute.OPS`` can keep (``memplan.model.sac_ops``): a dense
    layer's, or with ``moe`` an MoE layer's; by default the model's searched kind
    (``searched_moe``); ``variant`` "linear": a short-convolution layer's (``sac_conv``)
    or a Mamba2 layer's (``sac_mamba``).
    Cached: a plan asks per fit and probe."""
    sac_ops.check_supported(spec, wl)
    moe = sac_ops.searched_moe(spec) if moe is None else moe
    saved, ops = _layer_ops(spec, wl, dm, moe, variant)
    items = tuple(i for i in ops if i.name)
    if not moe:
        return items
    return items + sac_moe.moe_items(spec, dm, {t.name: t.size_bytes for t in saved},
                                     sac_ops.counts(ops), wl.moe_impl)


def _layer_ops(spec: ModelSpec, wl: Workload, dm: Dims, moe: bool, variant: str | None
               ) -> tuple[tuple[Term, ...], tuple[sac_ops.Item, ...]]:
    """A layer's saved terms without recompute and its ops a policy counts (``sac_ops.
    layer_ops``): a short-convolution layer's (``variant`` "linear", or None where all the
    model's layers are: ``sac_conv.conv_layer_ops``) or the model's attention layer's. In a
    model whose RoPE layers alone norm q and k (``rope_normed``: Llama 4) the attention
    layer's is a RoPE layer's (``layer_blocks``' "window" variant), and ``variant`` "nope"
    a NoPE layer's."""
    if variant is None:
        variant = sac_ops.kind_variant(sac_ops.default_kind(spec))
    terms_variant = "window" if rope_normed(spec) and variant == "" else ""
    saved = tuple(layer_terms(spec, wl, dm, moe_layer=moe, recompute=Recompute.NONE,
                              variant=terms_variant))
    ops = sac_ops.layer_ops(spec, wl, dm, saved, moe, variant == "nope")
    if falcon_h1.parallel(spec):  # the Mamba2 mixer beside the attention (sac_falcon)
        return saved, sac_falcon.falcon_layer_ops(spec, wl, dm, saved, ops)
    if variant != "linear" or sac_ops.linear_kind(spec) is None:
        return saved, ops
    lin = tuple(layer_terms(spec, wl, dm, moe_layer=moe, recompute=Recompute.NONE,
                            variant="linear"))
    build = (sac_conv.conv_layer_ops if spec.short_conv is not None
             else sac_mamba.mamba_layer_ops)
    return lin, build(spec, wl, dm, lin, ops)


def ops_kinds(spec: ModelSpec) -> tuple[tuple[str, bool, int], ...]:
    """The layer kinds of ``spec`` a save list scopes (``sac_ops.KINDS``), as (kind, MoE
    layer, how many layers): one where its layers are all alike. A model with
    short-convolution or Mamba2 layers (LFM2, Granite 4.0-H: ``sac_ops.linear_kind``): its
    attention layers, then its other layers, both MoE layers where every layer is (Granite
    4.0-H Tiny and Small; ``sac_ops.mamba_refusal`` refuses MoE blocks on some layers only)."""
    linear = sac_ops.linear_kind(spec)
    if linear is not None:
        kinds = [sac_ops.layer_kind_of(spec, i) for i in range(spec.num_layers)]
        return tuple((kind, sac_ops.searched_moe(spec), kinds.count(kind))
                     for kind in ("attn", linear) if kind in kinds)
    if spec.moe is None or sac_ops.searched_moe(spec):
        return (("moe" if spec.moe is not None else "dense", spec.moe is not None,
                 spec.num_layers),)
    n_moe = sum(spec.is_moe_layer(i) for i in range(spec.num_layers))
    return (("dense", False, spec.num_layers - n_moe), ("moe", True, n_moe))


def ops_variants(spec: ModelSpec, kind: str, n: int) -> tuple[tuple[str, int], ...]:
    """The ``ops_items`` variants of a kind's ``n`` layers, each with its count: one, or in a
    model with NoPE layers (``has_nope_layers``) the RoPE layers' ("") and the NoPE layers'
    ("nope")."""
    variant = sac_ops.kind_variant(kind)
    if not has_nope_layers(spec) or variant:
        return ((variant, n),)
    nope = sum(spec.is_nope_layer(i) and sac_ops.layer_kind_of(spec, i) == kind
               for i in range(spec.num_layers))
    return tuple((v, c) for v, c in (("", n - nope), ("nope", nope)) if c)


def ops_kept(spec: ModelSpec, wl: Workload, dm: Dims, moe: bool, variant: str, kind: str,
             save: tuple[str, ...]) -> tuple[tuple[sac_ops.Item, ...], tuple[sac_ops.Item, ...]]:
    """A layer's items (``ops_items`` of ``variant``) and those ``save`` keeps in a layer of
    ``kind`` (``sac_ops.resolve``). A NoPE layer ("nope") keeps what it has of the list, which
    names the RoPE layers' items (its own less the q/k norms')."""
    items = ops_items(spec, wl, dm, moe, variant)
    if variant != "nope":
        return items, sac_ops.resolve(items, save, spec, kind)
    names = {i.name for i in sac_ops.resolve(ops_items(spec, wl, dm, moe, ""), save, spec,
                                             kind)}
    return items, tuple(i for i in items if i.name in names)


@lru_cache(maxsize=256)
def ops_search_items(spec: ModelSpec, wl: Workload, dm: Dims) -> tuple[sac_ops.Item, ...]:
    """The items ``--recompute auto`` searches (``memplan.planning.save_sets.frontier``):
    one layer's (``ops_items``) where the layers are all of one kind; for a model of dense
    and MoE layers each kind's, named ``KIND:name`` (a save list per kind, ``sac_ops.
    resolve``), their bytes and FLOPs times the kind's layer count (what keeping one costs
    and saves over the model, so that one knapsack weighs the kinds); so where only some of
    a kind's layers have an item (Llama 4's q/k norms, on its RoPE layers: ``ops_variants``),
    each item times the layers that have it."""
    kinds = ops_kinds(spec)
    if len(kinds) == 1 and not rope_normed(spec):
        return ops_items(spec, wl, dm)
    out = []
    for kind, moe, n in kinds:
        have: dict[str, int] = {}
        for variant, count in ops_variants(spec, kind, n):
            for i in ops_items(spec, wl, dm, moe, variant):
                have[i.name] = have.get(i.name, 0) + count
        out += [i._replace(name=f"{kind}:{i.name}" if len(kinds) > 1 else i.name,
                           size_bytes=i.size_bytes * have.get(i.name, 0),
                           flops_per_token=i.flops_per_token * have.get(i.name, 0))
                for i in ops_items(spec, wl, dm, moe, sac_ops.kind_variant(kind))]
    return tuple(out)


@lru_cache(maxsize=256)
def ops_unkept(spec: ModelSpec, wl: Workload, dm: Dims, moe: bool | None = None,
               variant: str | None = None) -> tuple[tuple[str, int], ...]:
    """The (family, width) of a layer's ops that no item keeps and a policy counts, so that
    the items' indices hold (``memplan.report.sac_policy.torch_policy``): ``sac_ops.
    layer_ops``' unnamed ops of an item's family and width, and an MoE block's
    (``sac_moe.moe_policy_ops``)."""
    moe = sac_ops.searched_moe(spec) if moe is None else moe
    block = sac_moe.moe_policy_ops(spec, dm, wl.moe_impl) if moe else []
    keys = {(i.op, i.width) for i in ops_items(spec, wl, dm, moe, variant)} | set(block)
    return tuple([(i.op, i.width) for i in _layer_ops(spec, wl, dm, moe, variant)[1]
                  if not i.name and (i.op, i.width) in keys] + block)


def ops_kind(spec: ModelSpec, wl: Workload, dm: Dims, moe: bool, variant: str) -> LayerKind:
    """Op-level checkpointing (``memplan.model.sac_ops``): the fully recomputed layer, which
    also keeps the outputs its save list names; the rerun serves them from the cache, so its
    backward is the full recompute's. What does not read the save list (the full layer, the
    items) is built from ``wl`` without it, so the sets a plan probes share it."""
    base = _unsaved(wl)
    full = _full_kind(spec, base, dm, moe, variant)
    linear = sac_ops.linear_kind(spec)
    lin = variant == "linear" and linear is not None  # (sac_ops.kind_variant)
    items = ops_items(spec, base, dm, moe, "linear" if lin else "")
    kind = (linear if lin else "attn") if linear is not None else (
        "moe" if moe else "dense")
    if rope_normed(spec) and variant == "":  # a NoPE layer (``_layer_ops``)
        items, kept = ops_kept(spec, base, dm, moe, "nope", kind, wl.recompute_save)
    else:
        kept = sac_ops.resolve(items, wl.recompute_save, spec, kind)
    sac_ops.check_kept(kept, dm, items)
    terms = sac_ops.kept_terms(kept)
    peak = ops_forward_peak(_ops_forward(spec, base, dm, moe, variant), items, kept)
    return full._replace(terms=full.terms + terms, saved_bytes=full.saved_bytes + total(terms),
                         forward_peak_bytes=peak, forward_blocks=(),
                         moments=_cached_at_rerun(
                             spec, wl, dm, variant, _clamped_rerun(spec, wl, dm, _cached_ahead(
                                 spec, wl, full.moments, kept), items, kept), items, kept))


@lru_cache(maxsize=1024)
def _full_kind(spec: ModelSpec, wl: Workload, dm: Dims, moe: bool, variant: str) -> LayerKind:
    """The fully recomputed layer ``ops_kind`` builds on (``wl`` without its save list)."""
    return layer_kind(spec, wl, dm, moe, Recompute.FULL, variant)


def _cached_ahead(spec: ModelSpec, wl: Workload, moments: tuple[LayerMoment, ...],
                  kept: tuple[sac_ops.Item, ...]) -> tuple[LayerMoment, ...]:
    """The fully recomputed layer's backward ``moments`` with the kept outputs the rerun
    has not reached yet: alive from the forward (the checkpoint's cache) at the grouped
    block's rerun unsort (``memplan.model.moe.grouped_rerun``), where shared experts that run
    last are not rebuilt yet (traced: transformers' DeepSeek-V3 narrowed, bf16, 2 x 256
    tokens, the shared MLP's four outputs kept: 262,144 B at the rerun's unsort, which set
    the backward's peak, -1.59% before)."""
    if wl.moe_impl is MoeImpl.LOOP:
        # an MoE loop's rerun at the expert before the last's combine: the last expert's
        # kept outputs and the shared MLP's, which runs after the loop, still in the cache
        # (``memplan.model.moe.loop_rerun``), its gate's too
        ahead = sum(i.size_bytes // i.repeat for i in kept if i.repeat > 1) + sum(
            i.size_bytes for i in kept if i.name.startswith("moe.shared"))
        return tuple(m._replace(alive_bytes=m.alive_bytes + ahead)
                     if m.name == "moe_rerun_combine" else m for m in moments)
    if spec.moe is None or not spec.moe.shared_experts_last:
        return moments
    ahead = sum(i.size_bytes for i in kept if i.name.startswith("moe.shared."))
    return tuple(m._replace(alive_bytes=m.alive_bytes + ahead) if m.name == "moe_rerun" else m
                 for m in moments)


def _clamped_rerun(spec: ModelSpec, wl: Workload, dm: Dims, moments: tuple[LayerMoment, ...],
                   items: tuple[sac_ops.Item, ...], kept: tuple[sac_ops.Item, ...]
                   ) -> tuple[LayerMoment, ...]:
    """GPT-OSS's biased, clamped experts (``sac_moe._clamped_ops``) rerun in backward with
    kept outputs: torch/utils/checkpoint.py's ``_CachedTorchDispatchMode`` pops each cached
    output when its op reruns, so the kept outputs of the ops after the rerun's moment are
    alive beside it. Two moments besides the rerun's unsort (``moe.grouped_rerun``: X, the
    block's saved terms S, its gathered down biases D, the weighted rows W and the gradient's
    copy): the gate/up projection's bias add (its output, input and gathered bias, 2 R f
    each: X - S - D - W + 6 R f) and the product ``(up + 1) * glu`` (the gate/up output, its
    gathered bias, the clamped gate and up, the sigmoid, glu, up + 1 and the product, 10 R f:
    X - S - D - W + 10 R f), S = 7 R f + R h (the gate/up output, the clamped gate, sigmoid,
    glu, up + 1 and product, the biased down projection's output). Under full recompute
    neither is above X where f <= h (GPT-OSS: equal at the product). Traced: transformers'
    GPT-OSS narrowed (f = h = 128), bf16, 2 x 64 tokens, keeping the clamped gate, sigmoid,
    up + 1 and down projection: the rerun's product with the cached down projection's output
    the backward's peak, +65,536 B above X (tests/traced/test_sac_policy.py). Grouped
    experts only: the reference loop's rerun (``moe.loop_rerun``) stops before any of this."""
    moe = spec.moe
    if (moe is None or not moe.clamped_swiglu or not kept
            or wl.moe_impl is MoeImpl.LOOP):
        return moments
    rows, h, e = dm.tokens * moe.top_k, spec.hidden_size, dm.e
    inner = rows * moe.expert_ffn_hidden_size // dm.experts().tp * e
    width = max(e, weights_width(moe, dm))
    drop = 7 * inner + rows * h * e + down_biases_bytes(spec, dm) + rows * h * width
    names = [i.name for i in items]
    kept_at = {names.index(i.name): i.size_bytes for i in kept}

    def later(name: str) -> int:
        at = names.index(name)
        return sum(size for k, size in kept_at.items() if k > at)

    out = []
    for m in moments:
        out.append(m)
        if m.name == "moe_rerun":
            for name, held in (("moe.expert.gate_up", 6), ("moe.expert.prod", 10)):
                out.append(m._replace(name=f"moe_rerun_{name.split('.')[-1]}",
                                      alive_bytes=m.alive_bytes - drop + held * inner
                                      + later(name)))
    return tuple(out)


def _gelu_new_rerun(spec: ModelSpec, dm: Dims, moments: tuple[LayerMoment, ...],
                    items: tuple[sac_ops.Item, ...], kept: tuple[sac_ops.Item, ...]
                    ) -> tuple[LayerMoment, ...]:
    """A gelu_new MLP's rerun at ``pow`` (``sac_ops._gelu_new_ops``): the rerun runs every op
    of the formula, the cached ones served, so there its output and its product with 0.044715
    (``mlp._gelu_new_working_bytes``) are made beside what the layer saves up to it and the
    kept outputs of the later ops, still in the cache (torch/utils/checkpoint.py
    ``_CachedTorchDispatchMode`` pops each as its op reruns): the rerun's stop ("rebuild_out":
    everything saved) less what tanh, its sum and the product save, with the kept ones back
    (traced: GPT-2 narrowed keeping its MLP, before 503,296 B under in bf16)."""
    later = ("mlp.gelu_tanh", "mlp.gelu_one_plus_tanh", "mlp.act", "mlp.down")
    if spec.activation_impl is not ActivationImpl.GELU_NEW or not any(
            i.name in later for i in kept):
        return moments
    stop = next(m for m in moments if m.name == "rebuild_out")
    unmade = sum(i.size_bytes for i in items if i.name in later[:3] and i.terms)
    cached = sum(i.size_bytes for i in kept if i.name in later)
    elements = dm.tokens * spec.ffn_hidden_size // dm.tp
    chain = 2 * elements * (FP32_BYTES if dm.autocast else dm.e)
    return moments + (LayerMoment("rebuild_gelu", stop.alive_bytes - unmade + cached,
                                  dm.stream(spec.hidden_size) + chain, ()),)


def _cached_at_rerun(spec: ModelSpec, wl: Workload, dm: Dims, variant: str,
                     moments: tuple[LayerMoment, ...], items: tuple[sac_ops.Item, ...],
                     kept: tuple[sac_ops.Item, ...]) -> tuple[LayerMoment, ...]:
    """The fully recomputed layer's rerun moments (the first of its moments,
    ``_rerun_moments``: "rebuild_out", then each block's in order) with the kept outputs the
    rerun has not reached there: torch/utils/checkpoint.py's ``_CachedTorchDispatchMode`` pops
    each cached output when its op reruns, so at a block's rerun moment the cache still holds
    the kept outputs of the items from the first op not rerun yet on (``_rerun_ahead``: the
    block's later ops', the later blocks'). Traced: Llama narrowed, eager, the MLP kept: the
    rerun's softmax beside the layer's four cached MLP outputs, 454,272 B above the estimate
    before; Granite 4.0-H narrowed on transformers 5.23, bf16, 2 x 512 tokens, the MLP norm's
    four tensors kept: the rerun's scan output beside them the backward's peak, 353,280 B
    above before. With a 16-bit input an eager core's rerun softmax (``attention.
    eager_rerun_softmax``) is a moment of its own, beside the cast and dropout after it."""
    moments = _gelu_new_rerun(spec, dm, moments, items, kept)
    ahead = _rerun_ahead(spec, wl, dm, variant, items, kept) if kept else {}
    if not ahead:
        return moments
    softmax_up, value_out = eager_rerun_softmax(spec, wl, dm)
    out = []
    for k, m in enumerate(moments):
        if k and m.name not in ahead:  # the rerun's moments come first; no backward moment
            return tuple(out) + moments[k:]  # is named after a rerun's in that prefix
        m = m._replace(alive_bytes=m.alive_bytes + ahead.get(m.name, 0))
        if m.name == "rebuild" and softmax_up:  # the cast and dropout after the softmax
            cast = sum(i.size_bytes for i in kept
                       if i.name in ("attn.softmax_cast", "attn.dropout"))
            out.append(m._replace(name="rebuild_softmax",
                                  alive_bytes=m.alive_bytes + softmax_up + cast,
                                  transient_bytes=m.transient_bytes - value_out))
        out.append(m)
    return tuple(out)


# a Mamba2 mixer's rerun moments at its scan and gated norm (``Mamba.rebuild_moments``: 5.3's
# naive scan, 5.23's einsums), before out_proj's input is made
_MAMBA_SCAN_MOMENTS = frozenset({"ssd_diag", "ssd_states", "mamba.segsum", "mamba.states",
                                 "mamba.scan_out", "mamba.norm"})


def _rerun_ahead(spec: ModelSpec, wl: Workload, dm: Dims, variant: str,
                 items: tuple[sac_ops.Item, ...], kept: tuple[sac_ops.Item, ...]
                 ) -> dict[str, int]:
    """Each rerun moment's kept bytes still in the cache (``_cached_at_rerun``), by the
    items' execution order: at an eager core's rerun ("rebuild", not under autocast, where
    none was traced above) those from the context's bmm on (``attn.context``,
    ``attn.o_proj``, the later blocks'); at a Mamba2 mixer's scan and gated norm those from
    out_proj's input on (``mamba.out``, ``mamba.out_proj``, the later blocks': Falcon-H1's
    attention, the MLP norm's, the MLP's), at out_proj's output ("mamba") those after it."""
    names = [i.name for i in items]
    mine = {i.name for i in kept}
    sizes = [i.size_bytes if i.name in mine else 0 for i in items]

    def after(name: str, skip: int = 0) -> int:
        return sum(sizes[names.index(name) + skip:])

    ahead = {}
    if wl.attention is Kernel.EAGER and not dm.autocast and "attn.context" in names:
        ahead["rebuild"] = after("attn.context")
    mixer = spec.mamba is not None and (variant == "linear" or falcon_h1.parallel(spec))
    if mixer and "mamba.out_proj" in names:
        # (under autocast out_proj's input is autocast's cast, no item: from out_proj on)
        first = "mamba.out" if "mamba.out" in names else "mamba.out_proj"
        ahead |= dict.fromkeys(_MAMBA_SCAN_MOMENTS, after(first))
        ahead["mamba"] = after("mamba.out_proj", 1)
    return ahead


@lru_cache(maxsize=1024)
def _unsaved(wl: Workload) -> Workload:
    """``wl`` without its save list: one object per workload for ``_ops_forward``'s cache."""
    return wl.model_copy(update={"recompute_save": ()}) if wl.recompute_save else wl


class _OpsForward(NamedTuple):
    """A checkpointed layer's forward moments, whatever it keeps (``ops_forward_peak``):
    ``(block, alive + transient)`` of its blocks' working sets but a grouped MoE block's,
    what the layer holds at a dense MLP's down projection beside the MLP's tensors
    (``sac_ops.forward_peak``'s ``mlp_end``), and an MoE block's two moments (its base
    added) with the kept items each holds (``moe.grouped_kept_moments``)."""

    pairs: tuple[tuple[str, int], ...]
    mlp_end: int
    moe: tuple[tuple[int, frozenset[str]], ...]
    parallel: bool = False  # a parallel layer (``ModelSpec.parallel_block``)
    # an eager core's moments in place of the attention's (``sac_ops.core_peak``)
    core: tuple[tuple[int, tuple[tuple[str, int], ...]], ...] = ()
    # the kept item the blocks after the attention hold anyway (``sac_ops.forward_peak``)
    held: tuple[str, int] = ("", 0)
    out_mask: int = 0  # the mask of dropout on the MLP's output, which mlp_end counts


@lru_cache(maxsize=1024)
def _ops_forward(spec: ModelSpec, wl: Workload, dm: Dims, moe: bool,
                 variant: str) -> _OpsForward:
    moments = forward_moments(spec, wl, dm, moe_layer=moe, recompute=Recompute.FULL,
                              variant=variant)
    owners = [b.name for b in layer_blocks(spec, moe, variant)
              for _ in b.working_set(spec, wl, dm)]
    assert len(owners) == len(moments)
    if falcon_h1.parallel(spec):  # the mixer's moments run before the attention's
        owners = _falcon_owners(spec, wl, dm, owners)
    pairs = tuple((o, m.alive_bytes + m.transient_bytes) for o, m in zip(owners, moments))
    # at the down projection: the MLP's first moment less its working set, with its output
    mlp = next(b for b in layer_blocks(spec, moe, variant) if b.name == "mlp")
    base = pairs[owners.index("mlp")][1] - mlp.working_set(spec, wl, dm)[0].transient_bytes
    if not moe:
        # under autocast the down projection's weight cast, which the working set's moments
        # precede (``last_weight``), exists there: autocast casts it before the matmul
        # (traced: the reference model h 256, f 896 keeping the gate, SiLU and up outputs,
        # before 458,752 B, the cast, under the forward's peak)
        late = (last_weight(spec, dm, mlp) * dm.e
                if cast_cache_bytes(spec, wl, dm, mlp, Recompute.FULL) else 0)
        pairs, core = _eager_core(spec, wl, dm, pairs)
        held = eager_held_item(spec, wl, dm) if core else ("", 0)
        # with dropout on the MLP's output, its output, mask and the projection's output
        # together (traced: GPT-2 narrowed keeping its gelu_new MLP, before 647,160 B under)
        mask = dm.rows * spec.hidden_size * MASK_BYTES if spec.dropout > 0 else 0
        drop = dm.rows * spec.hidden_size * dm.e + mask if mask else 0
        # Falcon-H1's ``down_proj(y) * down_multiplier`` (FalconH1MLP.forward): the output and
        # its product together (traced on transformers 5.23, fp32, 2 x 200 tokens keeping the
        # MLP's outputs: the product was the forward's peak, one T h fp32 above before)
        drop += dm.rows * spec.hidden_size * dm.e if falcon_h1.parallel(spec) else 0
        return _OpsForward(pairs, base + dm.rows * spec.hidden_size * dm.e + late + drop, (),
                           spec.parallel_block, core, held, mask)
    from memplan.model.moe import grouped_kept_moments, loop_kept_moments

    # an eager core (GPT-OSS's: sac_ops.eager_refusal) as in a dense layer
    pairs, core = _eager_core(spec, wl, dm, tuple(p for p in pairs if p[0] != "mlp"))
    kept_moments = (loop_kept_moments(spec, dm) if wl.moe_impl is MoeImpl.LOOP
                    else grouped_kept_moments(spec, dm, wl.moe_impl))
    return _OpsForward(pairs, 0, tuple((base + value, adds) for value, adds in kept_moments),
                       spec.parallel_block, core,
                       eager_held_item(spec, wl, dm) if core else ("", 0))


def _falcon_owners(spec: ModelSpec, wl: Workload, dm: Dims, owners: list[str]) -> list[str]:
    """Falcon-H1's block of both mixers (``falcon_h1.ParallelMamba``, "attn"): its first
    moments, the Mamba2 mixer's working set, are the mixer's items' block (``sac_falcon.
    BLOCK``), run before the attention's."""
    n = len(Mamba().working_set(spec, wl, dm))
    at = owners.index("attn")
    return owners[:at] + [sac_falcon.BLOCK] * n + owners[at + n:]


def _eager_core(spec: ModelSpec, wl: Workload, dm: Dims, pairs: tuple[tuple[str, int], ...]
                ) -> tuple[tuple[tuple[str, int], ...], tuple]:
    """An eager core's moments (``attention.eager_kept_moments``) in place of the
    attention's working-set moment (its first), which they make up; SDPA's: as they are."""
    if wl.attention is not Kernel.EAGER:
        return pairs, ()
    at = [name for name, _ in pairs].index("attn")
    value = pairs[at][1]
    core = tuple((value + delta, adds) for delta, adds in eager_kept_moments(spec, wl, dm))
    return pairs[:at] + pairs[at + 1:], core


def ops_forward_peak(fw: _OpsForward, items: tuple[sac_ops.Item, ...],
                     kept: tuple[sac_ops.Item, ...]) -> int:
    """The forward peak of a checkpointed layer keeping ``kept`` (``LayerKind.
    forward_peak_bytes`` under ``Recompute.OPS``): ``sac_ops.forward_peak``, an eager core's
    moments (``sac_ops.core_peak``), and an MoE block's moments each with the kept items it
    holds, beside those of the blocks before."""
    peak = sac_ops.forward_peak(fw.pairs, items, kept, fw.mlp_end, fw.parallel, fw.held,
                                fw.out_mask)
    if fw.core:
        peak = max(peak, sac_ops.core_peak(fw.core, items, kept, fw.parallel))
    if not fw.moe:
        return peak
    # the MoE block's moments hold an eager core's returned probabilities anyway
    before = -sac_ops.input_held(kept, "mlp", fw.parallel) - min(
        next((i.size_bytes for i in kept if i.name == fw.held[0]), 0), fw.held[1])
    for i in kept:
        if i.block != "mlp":
            before += i.size_bytes
    for value, adds in fw.moe:
        at = value + before
        for i in kept:
            if i.name in adds:
                at += i.size_bytes
            elif i.repeat > 1 and BEFORE_LOOP not in adds:
                # an MoE loop's: the experts' before the running one
                at += i.size_bytes - i.size_bytes // i.repeat
        peak = max(peak, at)
    return peak


@lru_cache(maxsize=256)
def ops_forward_peaks(spec: ModelSpec, wl: Workload, dm: Dims,
                      sets: tuple) -> tuple:
    """Each save set's layer forward peak (``ops_forward_peak``) for the model's searched
    kind (``sac_ops.searched_moe``): what ``memplan.planning.save_sets.choose`` orders sets
    by beside their bytes, without an estimate. ``sets``: the frontier
    (``memplan.planning.save_sets.Choice``, each with its ``kept`` names). For a model of
    dense and MoE layers (``ops_search_items``), each set's (dense bytes, MoE bytes, dense
    forward peak, MoE forward peak) per layer: a stage's peak rises with each. Cached: a
    plan asks per fit."""
    kinds = ops_kinds(spec)
    variants = _ops_variants(spec, wl)
    if len(kinds) == 1 and len(variants) == 1:
        moe, variant = kinds[0][1], sac_ops.kind_variant(kinds[0][0]) or variants[0]
        items = ops_items(spec, wl, dm, moe, sac_ops.kind_variant(kinds[0][0]))
        fw = _ops_forward(spec, _unsaved(wl), dm, moe, variant)
        by_name = {i.name: i for i in items}
        return tuple([ops_forward_peak(fw, items, tuple([by_name[n] for n in c.kept]))
                      for c in sets])
    # per kind its kept bytes, then per kind and variant its forward peak: a set is ruled
    # out only by one it is no lower than in every one (``save_sets.choose``)
    sizes, peaks = [], []
    for kind, moe, _ in kinds:
        items = ops_items(spec, wl, dm, moe, sac_ops.kind_variant(kind))
        by_name = ({i.name: i for i in items} if len(kinds) == 1
                   else {f"{kind}:{i.name}": i for i in items})
        kept = [tuple(by_name[n] for n in c.kept if n in by_name) for c in sets]
        sizes.append([sum(i.size_bytes for i in k) for k in kept])
        # (a short-convolution layer is its own variant: ``layer_blocks``)
        for variant in ((sac_ops.kind_variant(kind),) if sac_ops.kind_variant(kind)
                        else variants):
            fw = _ops_forward(spec, _unsaved(wl), dm, moe, variant)
            mine, kept_here = items, kept
            if rope_normed(spec) and variant == "":  # a NoPE layer: its own items
                mine = ops_items(spec, wl, dm, moe, "nope")
                kept_here = [tuple(i for i in mine if i.name in {j.name for j in k})
                             for k in kept]
            peaks.append([ops_forward_peak(fw, mine, k) for k in kept_here])
    return tuple(zip(*sizes, *peaks))


def _ops_variants(spec: ModelSpec, wl: Workload) -> tuple[str, ...]:
    """The layer variants a save list applies to (``memplan.model.stage_parts.layer_keys``):
    the model's attention, and where a sliding window gets its explicit mask
    (``windowed``) the sliding layers' own; in a model whose RoPE layers alone norm q and k
    (``rope_normed``) the NoPE layers' ("") and the RoPE layers' ("window")."""
    if rope_normed(spec):
        return ("", "window")
    if not windowed(spec, wl):
        return ("",)
    sliding = [spec.is_sliding_layer(i) for i in range(spec.num_layers)]
    return ("window",) if all(sliding) else ("", "window") if any(sliding) else ("",)


def grad_group_params(spec: ModelSpec, t: int, ep: int, moe: bool,
                      variant: str = "") -> dict[str, int]:
    """Parameters on one rank of the groups whose gradients appear during a layer's backward."""
    groups: dict[str, int] = {}
    for block in layer_blocks(spec, moe, variant):
        groups.update(block.grad_groups(spec, t, ep))
    return groups


def moment_params(groups: dict[str, int], kind: LayerKind) -> tuple[int, ...]:
    """Parameters whose gradients exist at each backward moment of a layer of ``kind``."""
    return tuple(sum(groups[g] for g in m.grads_before) for m in kind.moments)


def float8_gather_saving(spec: ModelSpec, t: int, e: int) -> int:
    """Bytes fewer FSDP2 gathers for a dense layer when its converted linears' weights are
    all-gathered in float8 (torchao ``float8/fsdp_utils.py``:
    ``WeightWithDynamicFloat8CastTensor.fsdp_pre_all_gather`` casts the shard and returns its
    float8 data, ``fsdp_post_all_gather`` wraps the gathered data as a ``Float8TrainingTensor``):
    one byte an element instead of ``e``; the norms stay in ``e``. Each weight's fp32 scale
    (one per tensor, the ``metadata`` beside the data, not gathered) is not counted."""
    return sum(linear.weight_elements(lin, t) * (e - linear.FLOAT8_BYTES)
               for lin in layer_linears(spec, False) if linear.convertible(lin))


def layer_linears(spec: ModelSpec, moe_layer: bool, variant: str = "") -> tuple[Linear, ...]:
    """A layer's projections that are ``nn.Linear`` modules (what LoRA adapts and bitsandbytes
    quantizes): the attention's (or a linear-attention layer's), and a dense layer's MLP
    (stacked experts are not)."""
    linear_mixer = (short_conv_linears if spec.short_conv is not None
                    else mamba_linears if spec.mamba is not None else deltanet_linears)
    attn = (linear_mixer(spec) if variant == "linear" else mla_linears(spec)
            if spec.mla is not None else attention_linears(spec))
    if falcon_h1.parallel(spec):  # the Mamba2 mixer's beside the attention's
        attn = mamba_linears(spec) + attn
    return attn + (() if moe_layer else mlp_linears(spec, spec.ffn_hidden_size))


def frozen_input_terms(spec: ModelSpec, dm: Dims, first_layer: tuple[Term, ...],
                       embed: tuple[Term, ...]) -> list[Term]:
    """With frozen weights and no checkpointing (LoRA without ``enable_input_require_grads``)
    the embedding's output does not require grad, so what the first layer's input norm, the
    embedding's dropout and the dropout of the adapters reading the norm's output would save
    is not saved (what the adapters save of their own input is): negative terms, beside the
    embedding's (autograd saves for an input only when some input requires grad)."""
    # (an adapter's lora_A saves the norm's output itself, if it does, all the same: its
    # weight trains)
    readers = [lin for lin in layer_linears(spec, False) if lin.group == "attn"
               and lin.split is not Split.ROW and (dm.adapters and dm.adapters.adapts(lin))]
    kept = shares_input(dm) and bool(readers)
    unsaved = [t for t in first_layer if t.name.startswith("attn_norm.")
               and not (kept and t.name.endswith(".output"))]
    unsaved += [t for t in embed if t.name == "embedding.dropout_mask"]
    if dm.adapters and dm.adapters.dropout > 0:
        masks = sum(dm.tokens * lin.d_in * MASK_BYTES for lin in readers)
        unsaved.append(Term("lora.dropout_mask", masks))
    return [Term(f"first_layer.{t.name}", -t.size_bytes) for t in unsaved if t.size_bytes]


def layer_tensor_sizes(spec: ModelSpec, t: int, ep: int, moe_layer: bool,
                       variant: str = "") -> list[int]:
    """Elements of a layer's parameter tensors on one TP rank, in registration order (norm,
    q/k/v/o, norm, MLP up/gate/down; the router and experts for an MoE layer)."""
    return [n for block in layer_blocks(spec, moe_layer, variant)
            for n in block.tensor_sizes(spec, t, ep)]


def layer_tensor_shapes(spec: ModelSpec, t: int, ep: int, moe_layer: bool,
                        variant: str = "") -> list[tuple[int, ...]]:
    """Shapes of ``layer_tensor_sizes``' tensors, in the same order."""
    return [shape for block in layer_blocks(spec, moe_layer, variant)
            for shape in block.tensor_shapes(spec, t, ep)]


def merge_terms(groups: tuple[tuple[int, tuple[Term, ...]], ...]) -> tuple[Term, ...]:
    """Sum ``count`` copies of each term list by name."""
    sums: dict[str, int] = {}
    for count, terms in groups:
        for term in terms:
            sums[term.name] = sums.get(term.name, 0) + count * term.size_bytes
    return tuple(Term(name, size) for name, size in sums.items())

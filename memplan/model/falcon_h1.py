"""Falcon-H1's mixers: a Mamba2 mixer and attention side by side on one norm's output, as
transformers runs them on its torch path (models/falcon_h1/modeling_falcon_h1.py,
FalconH1DecoderLayer.forward), the mixer's scan as ``Workload.mamba_kernel`` says: 5.3's
FalconH1Mixer.torch_forward, the naive chunked scan of Granite 4.0-H's
(``memplan.model.mamba``), or 5.23's FalconH1Mixer.forward, causal_conv1d_fn's torch fallback
and mamba2_chunk_scan's einsums (``memplan.model.mamba_einsum``), both without mamba_ssm and
causal-conv1d (on CUDA with them mamba_ssm's fused kernels run, not modelled; under
autocast 5.23's einsums run in bf16, as ``memplan.model.mamba_einsum`` counts them). The
layer's parts below are the same on both versions; 5.23's model also makes a cache with
use_cache (``memplan.model.layer.kv_cache_bytes``). The mixer's scan output goes through
FalconH1RMSNormGated with
mamba_rms_norm (``MambaSpec.gated_norm``: Granite's gated norm's sizes, an rsqrt per group),
else ``y * silu(gate)``.

The layer, per micro-batch on a rank (T tokens, h wide, e the compute dtype):

    x = input_layernorm(residual)
    m = mamba(x) * ssm_out_multiplier           # torch_forward: x * ssm_in_multiplier first,
                                                # in_proj(...) * mup_vector
    a = self_attn(x * attention_in_multiplier) * attention_out_multiplier
    residual = residual + (m + a)
    out = residual + feed_forward(pre_ff_layernorm(residual))

Every muP multiplier is applied with ``*``, which makes a new tensor whatever its value (1.0
too). Multiplying by a Python scalar saves nothing; by the ``mup_vector`` buffer (1, 1,
2 d + 2 G n + H), which needs no gradient, it saves the buffer alone. So:

- nobody saves the norm's output ``x``; each mixer's first linears save their own scalar copy
  of it (in_proj the ``ssm_in_multiplier`` copy, q/k/v the ``attention_in_multiplier`` copy):
  two T h copies, the first counted as the norm's output (``NORM``), the second as the
  block's ``attn.input_copy`` (under autocast each linear saves its own cast, the fp32 copies
  are locals); ``x`` itself is a local of the layer until ``m + a`` is bound, beside both
  mixers;
- in_proj's output is freed once multiplied by ``mup_vector``: the product is what the
  conv, the gate and dt view (the ``in_proj_out`` term, the same size); the key's
  ``key_multiplier`` copy replaces k_proj's output before RoPE, which saves neither; the
  mixers' scaled outputs ``m`` and ``a`` are locals of the layer to its return, beside the
  feed-forward (``held_bytes``);
- FalconH1MLP's ``gate_proj(x) * gate_multiplier`` is what the activation saves, the same size
  as the gate's output; ``down_proj(y) * down_multiplier`` a transient; FalconH1Model's
  ``embed_tokens(ids) * embedding_multiplier`` and FalconH1ForCausalLM's
  ``lm_head(h) * lm_head_multiplier`` likewise (nothing saved). These four scalar copies
  and their backward's have no moments of their own: traced where the MLP's backward and the
  loss set the peaks (tests/traced/test_hf_heldout.py ``falcon_h1-narrow``), every phase
  within 0.06% without them.

In backward the attention's nodes run first (made after the mixer's, so later in the
engine's sequence order), then the mixer's, while the norm-output gradient the attention made
(T h) waits for the mixer's; the scalar products' backward make a scaled copy of the
gradient they pass on (the output multipliers' at each mixer's output projection, the
``mup_vector``'s of in_proj's output gradient, T (2 d + 2 G n + H), beside it). Under
autocast the fp32 ``mup_vector`` promotes the product to fp32 (``memplan.model.mamba.Sizes.
mup_e``). Not traced: eager attention (its probabilities, which the layer binds to its end,
are not counted beside the MLP), tensor parallelism.
"""

from __future__ import annotations

import math

from memplan.model import linear
from memplan.model.attention import Attention
from memplan.model.block import BackwardMoment, Moment
from memplan.model.dims import Dims, Term, total
from memplan.model.mamba import Mamba, kernel, mamba_linears, sizes
from memplan.model.linear import input_copies
from memplan.model.norm import Norm, consumers
from memplan.spec import ModelSpec
from memplan.workload import MambaKernel, Recompute, Workload

_MAMBA, _ATTENTION = Mamba(), Attention()
# the norm's output as in_proj reads it: its ssm_in_multiplier copy (the module docstring)
NORM = Norm("attn_norm", lambda spec: mamba_linears(spec)[:1], copies=1)


def parallel(spec: ModelSpec) -> bool:
    """Whether ``spec``'s layers are Falcon-H1's (``MambaSpec.parallel_attention``)."""
    return spec.mamba is not None and spec.mamba.parallel_attention


def held_bytes(spec: ModelSpec, dm: Dims) -> int:
    """The mixers' scaled outputs ``m`` and ``a``, locals of FalconH1DecoderLayer.forward
    until it returns: alive beside the feed-forward sub-layer."""
    return 2 * dm.rows * spec.hidden_size * dm.e if parallel(spec) else 0


def mup_buffer_bytes(spec: ModelSpec, wl: Workload, num_layers: int) -> int:
    """FalconH1Model.__init__ registers a copy of ``compute_mup_vector(config)`` on every
    layer's mixer (``register_buffer("mup_vector", ...)``, non-persistent): (1, 1, 2 d + 2 G n
    + H) in the weights' dtype, the whole width on every rank."""
    if not parallel(spec):
        return 0
    assert spec.mamba is not None
    return num_layers * spec.mamba.width * wl.precision.policy.params.itemsize


def _copy_bytes(spec: ModelSpec, wl: Workload, dm: Dims) -> int:
    """What q, k and v save of the norm output's attention_in_multiplier copy: the copy
    itself, under autocast each projection's cast of it (``memplan.model.norm.consumers``)."""
    copies = input_copies(consumers("attn_norm", spec, wl), dm)
    return copies * dm.linear_rows * spec.hidden_size * dm.e


def _stream(spec: ModelSpec, dm: Dims) -> int:
    """A mixer's output (and its scaled copy ``m`` or ``a``): the compute dtype."""
    return dm.rows * spec.hidden_size * dm.e


def _normed(spec: ModelSpec, dm: Dims) -> int:
    """The norm's output ``x``, in the stream's dtype (fp32 under autocast)."""
    return dm.rows * spec.hidden_size * dm.stream_e


def _unsaved_copy(spec: ModelSpec, dm: Dims) -> int:
    """Under autocast a mixer's scalar copy of ``x`` is fp32 and saved by no one (its
    linears save their casts): alive while that mixer runs (torch_forward's ``input_states``,
    the attention's argument)."""
    return _normed(spec, dm) if dm.autocast else 0


# the mixer's gradient groups renamed beside the attention's (``grad_groups``): each group
# is cumulative, in backward order
_MAMBA_GROUPS = {"attn_out": "mamba_out", "attn": "attn"}
_ATTENTION_GROUPS = {"attn_out": "attn_out", "attn": "attn_qkv"}


class ParallelMamba:
    """The Mamba2 mixer and attention of a Falcon-H1 layer, as one block (the module
    docstring): the mixer's and the attention's saved tensors, and their moments in the
    order the layer runs them."""

    name = "attn"

    def saved(self, spec: ModelSpec, wl: Workload, dm: Dims, recompute: Recompute) -> list[Term]:
        """The mixer's, the attention's input (the norm output's attention_in_multiplier
        copy, which q, k and v save) and the attention's."""
        copy = Term("attn.input_copy", _copy_bytes(spec, wl, dm))
        return (_MAMBA.saved(spec, wl, dm, recompute) + [copy]
                + _ATTENTION.saved(spec, wl, dm, recompute))

    def forward_moments(self, spec: ModelSpec, wl: Workload, dm: Dims,
                        recompute: Recompute) -> list[Moment]:
        """The mixer's moments beside the norm's output, then the attention's beside the
        mixer's saved tensors, its input copy, the norm's output and ``m``; then ``m``,
        ``a``, their sum and the norm's output before it is unbound."""
        stream, x, copy = _stream(spec, dm), _normed(spec, dm), _unsaved_copy(spec, dm)
        mamba = total(_MAMBA.saved(spec, wl, dm, recompute)) + _copy_bytes(spec, wl, dm)
        out = [m._replace(transient_bytes=m.transient_bytes + x + copy)
               for m in _MAMBA.forward_moments(spec, wl, dm, recompute)]
        out += [Moment(m.name, mamba + m.own_bytes, m.transient_bytes + x + copy + stream)
                for m in _ATTENTION.forward_moments(spec, wl, dm, recompute)]
        out.append(Moment("mixers_sum", total(self.saved(spec, wl, dm, recompute)),
                          x + 3 * stream))
        return out

    def working_set(self, spec: ModelSpec, wl: Workload, dm: Dims) -> list[Moment]:
        """In a checkpointed layer: the mixer's beside its input's ``ssm_in_multiplier`` copy
        (in the stream's dtype: fp32 under autocast) where it is still bound, the attention's
        beside its copy and ``m``; then the sum's four. 5.3's torch_forward binds the copy
        (``input_states``) to its return; 5.23's forward rebinds ``hidden_states`` to x at
        the split after the conv, so the copy is gone before the scan (traced: bf16 and
        autocast, full recompute, were +0.83% and +0.56% over in the forward)."""
        stream = _stream(spec, dm)
        copy = _normed(spec, dm) if kernel(spec, wl) is MambaKernel.TORCH else 0
        return ([Moment(m.name, 0, m.transient_bytes + copy)
                 for m in _MAMBA.working_set(spec, wl, dm)]
                + [Moment(m.name, 0, m.transient_bytes + 2 * stream)
                   for m in _ATTENTION.working_set(spec, wl, dm)]
                + [Moment("mixers_sum", 0, 3 * stream)])

    def working_casts(self, spec: ModelSpec, wl: Workload, dm: Dims) -> list[int]:
        """Under autocast, the bytes of this block's weight casts in autocast's cache at each
        ``working_set`` moment (a checkpointed layer saves none; the cache keeps each to the
        forward's end: ``memplan.model.layer.cast_cache_bytes``): FalconH1DecoderLayer.forward
        runs the mixer first, so its scan has cast in_proj and the conv only; the attention
        runs beside all of the mixer's and q, k and v (its o_proj cast after); the sum beside
        all. Traced: Falcon-H1 on transformers 5.23 under autocast with full recompute
        (tests/traced/test_hf_heldout.py), whose forward peaks in the scan: was +2.87%, the
        attention's and out_proj's casts counted there."""
        if not dm.autocast:
            return [0] * len(self.working_set(spec, wl, dm))
        e = dm.e
        mamba = _MAMBA.cast_sizes(spec, wl, dm.tp)
        out_proj = linear.all_tensor_shapes(mamba_linears(spec)[-1:], dm.tp)
        scan = (sum(mamba) - sum(math.prod(s) for s in out_proj)) * e
        attention = sum(_ATTENTION.tensor_sizes(spec, dm.tp, 1)) * e
        o_proj = spec.attn_out_size * spec.hidden_size // dm.tp * e
        whole = sum(mamba) * e + attention
        return ([scan] * len(_MAMBA.working_set(spec, wl, dm))
                + [whole - o_proj] * len(_ATTENTION.working_set(spec, wl, dm)) + [whole])

    def cast_sizes(self, spec: ModelSpec, wl: Workload, t: int) -> list[int]:
        """The mixer's casts (``Mamba.cast_sizes``), then the attention's (every weight)."""
        return _MAMBA.cast_sizes(spec, wl, t) + _ATTENTION.tensor_sizes(spec, t, 1)

    def backward_moments(self, spec: ModelSpec, wl: Workload, dm: Dims,
                         recompute: Recompute) -> list[BackwardMoment]:
        """The attention's (beside the mixer's saved tensors, its output gradient's scaled
        copy), then the mixer's beside the norm-output gradient the attention made, with the
        ``mup_vector`` product's backward before in_proj's."""
        stream = _stream(spec, dm)
        mamba = total(_MAMBA.saved(spec, wl, dm, recompute))
        out = [m._replace(own_bytes=mamba + m.own_bytes,
                          transient_bytes=m.transient_bytes + stream,
                          grads=tuple(_ATTENTION_GROUPS[g] for g in m.grads))
               for m in _ATTENTION.backward_moments(spec, wl, dm, recompute)]
        mixer = [m._replace(transient_bytes=m.transient_bytes + stream,
                            grads=("attn_qkv",) if not m.grads else
                            tuple(_MAMBA_GROUPS[g] for g in m.grads))
                 for m in _MAMBA.backward_moments(spec, wl, dm, recompute)]
        assert spec.mamba is not None
        z = sizes(spec.mamba, dm)
        mup = BackwardMoment("mamba_mup", 0, 2 * z.tokens * z.width * dm.e + stream,
                             ("mamba_out",))
        return out + mixer[:-1] + [mup, mixer[-1]]

    def rebuild_moments(self, spec: ModelSpec, wl: Workload, dm: Dims) -> list[Moment]:
        """The mixer's rerun beside the norm's output (and under autocast its unsaved copy),
        as in the forward, then the attention's beside the mixer's saved tensors."""
        mamba = total(_MAMBA.saved(spec, wl, dm, Recompute.NONE))
        x = _normed(spec, dm) + _unsaved_copy(spec, dm)
        return ([m._replace(transient_bytes=m.transient_bytes + x)
                 for m in _MAMBA.rebuild_moments(spec, wl, dm)]
                + [m._replace(own_bytes=mamba + m.own_bytes)
                   for m in _ATTENTION.rebuild_moments(spec, wl, dm)])

    def tensor_sizes(self, spec: ModelSpec, t: int, ep: int) -> list[int]:
        return _MAMBA.tensor_sizes(spec, t, ep) + _ATTENTION.tensor_sizes(spec, t, ep)

    def tensor_shapes(self, spec: ModelSpec, t: int, ep: int) -> list[tuple[int, ...]]:
        """The mixer's (FalconH1DecoderLayer registers ``mamba`` before ``self_attn``)."""
        return _MAMBA.tensor_shapes(spec, t, ep) + _ATTENTION.tensor_shapes(spec, t, ep)

    def grad_groups(self, spec: ModelSpec, t: int, ep: int) -> dict[str, int]:
        """Cumulative in backward order: ``attn_out`` (o_proj), ``attn_qkv`` (the
        attention), ``mamba_out`` (and out_proj), ``attn`` (all)."""
        attn = _ATTENTION.grad_groups(spec, t, ep)
        mamba = _MAMBA.grad_groups(spec, t, ep)
        whole = attn["attn"]
        return {"attn_out": attn["attn_out"], "attn_qkv": whole,
                "mamba_out": whole + mamba["attn_out"], "attn": whole + mamba["attn"]}

    def flops_per_token(self, spec: ModelSpec, seq_len: int) -> float:
        return (_MAMBA.flops_per_token(spec, seq_len)
                + _ATTENTION.flops_per_token(spec, seq_len))

    def core_flops_per_token(self, spec: ModelSpec, seq_len: int) -> float:
        return (_MAMBA.core_flops_per_token(spec, seq_len)
                + _ATTENTION.core_flops_per_token(spec, seq_len))

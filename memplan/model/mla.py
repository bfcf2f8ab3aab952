"""Multi-head latent attention (``MlaSpec``): DeepSeek-V2/V3's attention block.

As transformers runs it (``models/deepseek_v3/modeling_deepseek_v3.py``
``DeepseekV3Attention.forward``, transformers 5.3):

- queries: ``q_a_proj`` (h -> q_lora_rank, replicated by TP), ``q_a_layernorm`` on its
  output, ``q_b_proj`` (-> heads * (nope + rope)); without q_lora_rank one ``q_proj``. The
  q_b output is split into its no-RoPE and RoPE parts, the RoPE part rotated, both
  concatenated into the query the core saves: the q_b output itself is saved by no one.
- keys and values: ``kv_a_proj_with_mqa`` (h -> kv_lora_rank + rope, replicated), the
  kv_lora_rank part through ``kv_a_layernorm`` and ``kv_b_proj`` (-> heads * (nope + v)),
  the rope part rotated once and expanded to every head. The key is a concatenation (a new
  tensor); the value a view of the kv_b output, so the core's saved value keeps that whole
  output alive (``mla.kv_up``), unless a key/value cache filled by the training forward
  (``Workload.kv_cache``) hands the core its copies of k and v (5.3; 5.23 caches the latents
  and rebuilds k and v from them, the value still a view: ``Workload.mla_cache``).
- the core: with the value head narrower than the query/key head, CUDA's SDPA runs its
  memory-efficient kernel (flash needs equal head dims), which saves q, k, v, its output and
  an fp32 logsumexp per query and head; its output is the one the output projection saves
  (``transpose(1, 2).contiguous()`` of the kernel's output is a view).

The two norms follow the layer norms' implementation (``memplan.model.norm``): their input's
fp32 copy, per-row statistics, the normalised tensor and the output the up projection saves.
Eager attention is modelled as the generic block's core (``memplan.model.eager``) with q, k
and v at the query/key head width.
"""

from __future__ import annotations

import math

from functools import lru_cache

from memplan.model import eager, linear
from memplan.model.block import BackwardMoment, Moment
from memplan.model.dims import FP32_BYTES, Dims, Term, residual_dropout_mask, total
from memplan.model.linear import Linear, Split
from memplan.model.norm import norm_terms
from memplan.spec import MlaSpec, ModelSpec
from memplan.workload import Attention as Kernel
from memplan.workload import MlaCache, Recompute, Workload


def _mla(spec: ModelSpec) -> MlaSpec:
    assert spec.mla is not None, "an MLA block needs spec.mla"
    return spec.mla


def _latent_norm(prefix: str, width: int, spec: ModelSpec, wl: Workload,
                 dm: Dims) -> list[Term]:
    """A low-rank norm's terms: the layer norm's over ``width`` elements per token, on every
    token (the down projections are not sequence-parallel)."""
    whole = dm._replace(res_tokens_div=1, gathered_linear_input=False)
    return norm_terms(prefix, _narrow(spec, width), wl, whole)


@lru_cache(maxsize=64)
def _narrow(spec: ModelSpec, width: int) -> ModelSpec:
    """``spec`` as the low-rank norm of ``width`` elements sees it (one object per width)."""
    return spec.model_copy(update={"hidden_size": width, "norm_bias": False})


def _widths(spec: ModelSpec, t: int) -> tuple[int, int, int]:
    """Per token on one TP rank: the query (= key) width, the kv_b output's width and the
    attention output's width."""
    mla, a = _mla(spec), spec.num_attention_heads // t
    return (a * spec.head_dim, a * (mla.qk_nope_head_dim + mla.v_head_dim),
            a * mla.v_head_dim)


def mla_terms(spec: ModelSpec, wl: Workload, dm: Dims, recompute: Recompute) -> list[Term]:
    """The MLA block's saved terms (see the module docstring), with its output's dropout."""
    mla, e = _mla(spec), dm.e
    qk, kv_up, out = _widths(spec, dm.tp)
    terms = []
    if mla.q_lora_rank:
        terms += _latent_norm("mla.q_norm", mla.q_lora_rank, spec, wl, dm)
    kv_norm = _latent_norm("mla.kv_norm", mla.kv_lora_rank, spec, wl, dm)
    if wl.norm_impl.upcast and e >= FP32_BYTES:
        # in fp32 the upcast is the input itself, a slice of the kv_a output: all of it kept
        kv_norm = [Term(t.name, t.size_bytes * (mla.kv_lora_rank + mla.qk_rope_head_dim)
                        // mla.kv_lora_rank) if t.name.endswith("input_fp32") else t
                   for t in kv_norm]
    terms += kv_norm
    terms += [Term("mla.q", dm.tokens * qk * e), Term("mla.k", dm.tokens * qk * e)]
    if wl.kv_cache and recompute is Recompute.NONE and wl.mla_cache is MlaCache.EXPANDED:
        # a key/value cache filled by the training forward hands the core its copies of k and
        # v (transformers 5.3's DynamicLayer.update): the kv_b output is not kept; 5.23
        # caches the latents and rebuilds v as a view of it (``Workload.mla_cache``)
        terms.append(Term("mla.v", dm.tokens * out * e))
    else:
        terms.append(Term("mla.kv_up", dm.tokens * kv_up * e))
    terms.append(linear.saved_input("mla.out", mla_linears(spec)[-1], dm.tokens, dm))
    if recompute is Recompute.NONE:
        heads = spec.num_attention_heads // dm.tp
        if wl.attention is Kernel.FLASH:
            terms.append(Term("mla.lse", dm.b * heads * dm.s * FP32_BYTES))
        else:
            scores = dm.b * heads * dm.s * dm.s_kv
            fp32 = dm.autocast or (wl.softmax_fp32 and e < FP32_BYTES)
            terms.append(Term("mla.softmax", scores * (FP32_BYTES if fp32 else e)))
            if fp32:
                terms.append(Term("mla.softmax_cast", scores * e))
    casts = linear.saved_terms("mla", mla_linears(spec), dm)
    return terms + casts + residual_dropout_mask("attn", spec, dm)


@lru_cache(maxsize=64)
def mla_linears(spec: ModelSpec) -> tuple[Linear, ...]:
    """The block's projections in registration order: q_a (replicated) and q_b, or one q;
    kv_a (replicated) and kv_b; o, row-parallel (the ``attn_out`` gradient group). DeepSeek's
    attention_bias (``qkv_bias``) covers the down projections, ``attn_out_bias`` the output."""
    mla, h, a = _mla(spec), spec.hidden_size, spec.num_attention_heads
    bias = spec.qkv_bias
    q: tuple[Linear, ...] = (Linear("q", "attn", h, spec.q_size),)
    if mla.q_lora_rank:
        q = (Linear("q_a", "attn", h, mla.q_lora_rank, bias, Split.NONE),
             Linear("q_b", "attn", mla.q_lora_rank, spec.q_size))
    return (*q, Linear("kv_a", "attn", h, mla.kv_lora_rank + mla.qk_rope_head_dim, bias,
                       Split.NONE),
            Linear("kv_b", "attn", mla.kv_lora_rank, a * (mla.qk_nope_head_dim + mla.v_head_dim)),
            Linear("o", "attn_out", spec.attn_out_size, h, spec.attn_out_bias, Split.ROW))


def _latent_norm_sizes(spec: ModelSpec) -> tuple[int, int]:
    """The q_a and kv_a norms' weights (replicated; q_a's 0 without q_lora_rank)."""
    mla = _mla(spec)
    return mla.q_lora_rank, mla.kv_lora_rank


class Mla:
    """Multi-head latent attention (``MlaSpec``), its down projections replicated by TP."""

    name = "attn"

    def saved(self, spec: ModelSpec, wl: Workload, dm: Dims, recompute: Recompute) -> list[Term]:
        return mla_terms(spec, wl, dm, recompute)

    def _out(self, spec: ModelSpec, dm: Dims) -> int:
        return dm.tokens * _widths(spec, dm.tp)[2] * dm.e

    def forward_moments(self, spec: ModelSpec, wl: Workload, dm: Dims,
                        recompute: Recompute) -> list[Moment]:
        """The core's peak, its output not made yet, beside the concatenated q and k being
        made from the q_b output (alive until the concatenation); the output projection's
        output before the residual add."""
        saved = total(mla_terms(spec, wl, dm, recompute))
        qk = dm.tokens * _widths(spec, dm.tp)[0] * dm.e
        stream = dm.rows * spec.hidden_size * dm.e
        core = qk
        if wl.attention is Kernel.EAGER:
            core = eager.forward_saving(eager.core(spec, dm, wl.softmax_fp32 and dm.e < 4))
        return [Moment("attention", saved, stream),
                Moment("attention_core", saved - self._out(spec, dm), core)]

    def working_set(self, spec: ModelSpec, wl: Workload, dm: Dims) -> list[Moment]:
        """In a checkpointed layer: what the block would save (nothing is), with its output
        projection's output."""
        stream = dm.rows * spec.hidden_size * dm.e
        return [Moment("attention", 0,
                       stream + total(mla_terms(spec, wl, dm, Recompute.NONE)))]

    def backward_moments(self, spec: ModelSpec, wl: Workload, dm: Dims,
                         recompute: Recompute) -> list[BackwardMoment]:
        """The core's backward (the output's gradient, and those of q, k and v), then the
        projections': the up projections' input gradients beside the down projections'."""
        saved = total(mla_terms(spec, wl, dm, recompute))
        qk, kv_up, out = (w * dm.tokens * dm.e for w in _widths(spec, dm.tp))
        v = out
        core = out + 2 * qk + v
        if wl.attention is Kernel.EAGER:
            c = eager.core(spec, dm, wl.softmax_fp32 and dm.e < FP32_BYTES)
            core = max(t for _, t in eager.backward(c, rebuild=False))
        grad_inputs = 2 * dm.rows * spec.hidden_size * dm.e
        mla = _mla(spec)
        latent = dm.tokens * (mla.q_lora_rank + mla.kv_lora_rank) * dm.e
        return [
            BackwardMoment("attention.0", saved - out, core, ("attn_out",)),
            BackwardMoment("attn_in", 0, grad_inputs + latent + kv_up, ("attn",)),
        ]

    def rebuild_moments(self, spec: ModelSpec, wl: Workload, dm: Dims) -> list[Moment]:
        return []

    def tensor_sizes(self, spec: ModelSpec, t: int, ep: int) -> list[int]:
        """The projections (``mla_linears``), each latent norm after its down projection."""
        return [math.prod(shape) for shape in self.tensor_shapes(spec, t, ep)]

    def tensor_shapes(self, spec: ModelSpec, t: int, ep: int) -> list[tuple[int, ...]]:
        shapes = [linear.tensor_shapes(lin, t) for lin in mla_linears(spec)]
        q_norm, kv_norm = _latent_norm_sizes(spec)
        if q_norm:
            shapes.insert(1, [(q_norm,)])
        shapes.insert(len(shapes) - 2, [(kv_norm,)])
        return [shape for part in shapes for shape in part]

    def grad_groups(self, spec: ModelSpec, t: int, ep: int) -> dict[str, int]:
        """``attn_out``: the output projection (its backward runs first); ``attn``: all."""
        return linear.grad_groups(mla_linears(spec), t, ("attn_out", "attn"),
                                  {"attn": sum(_latent_norm_sizes(spec))})

    def flops_per_token(self, spec: ModelSpec, seq_len: int) -> float:
        """2 FLOPs per projection weight and per latent norm weight, and the core's
        (``core_flops_per_token``)."""
        return (linear.flops_per_token(mla_linears(spec)) + 2.0 * sum(_latent_norm_sizes(spec))
                + self.core_flops_per_token(spec, seq_len))

    def core_flops_per_token(self, spec: ModelSpec, seq_len: int) -> float:
        """QK^T over the query/key head (``head_dim`` = qk_nope_head_dim + qk_rope_head_dim,
        which the spec checks) and PV over the value head (``v_head_dim``), each 2 FLOPs per
        multiply-add over the causal average context s/2, as ``Attention.core_flops_per_token``
        counts them (Narayanan et al. 2021, arXiv 2104.04473, section 5.1): 2 * (s/2) * a *
        (head_dim + v_head_dim)."""
        core = seq_len * spec.num_attention_heads * (spec.head_dim + _mla(spec).v_head_dim)
        return float(core)

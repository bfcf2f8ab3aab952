"""The gated DeltaNet block of Qwen3-Next on the fused kernels transformers runs when
flash-linear-attention (fla) and causal-conv1d are installed (``DeltaNetKernel.FLA``,
models/qwen3_next/modeling_qwen3_next.py ``is_fast_path_available``): causal-conv1d's
``causal_conv1d_fn`` for the conv and its silu, fla's ``chunk_gated_delta_rule``
(fla/ops/gated_delta_rule/chunk.py ``ChunkGatedDeltaRuleFunction``) for the delta rule with
``use_qk_l2norm_in_kernel=True``, and fla's ``FusedRMSNormGated`` (fla/modules/
fused_norm_gate.py ``LayerNormGatedFunction``) for the gated norm. Read from fla at
bc3b101d (2026) and causal-conv1d's ``CausalConv1dFn``; none of them runs on a CPU (Triton,
CUDA), so the bytes are derived from the code, not traced.

Per micro-batch on a rank, with T tokens (b sequences of s), Hk key heads and Hv value heads
of dk and dv, C = 2 Hk dk + Hv dv conv channels, chunks of c = 64 tokens (N = ceil(s / c)
per sequence, no padding: fla's kernels take a partial last chunk), e the compute dtype:

- saved: the conv's input (``CausalConv1dFn.forward`` saves x, the weight and bias; its
  fused silu output is recomputed in backward); beta = sigmoid(b) (its output, which the
  rule saves too) and softplus's fp32 input and output (as on the torch path); the rule's
  ``ctx.save_for_backward``: the l2-normalised q and k (``l2norm_fwd``: the input's dtype)
  with their fp32 rstd per row, v (``input_guard`` makes the strided view of the conv output
  contiguous: a copy), g after ``chunk_local_cumsum`` (fp32) and A (``chunk_gated_delta_rule
  _fwd_intra``: zeros(B, T, Hv, 64) in k's dtype); the gated norm's x (the rule's output o,
  kept as ``residual_out``), its gate z (a T Hv dv copy: ``z.reshape(-1, dv)`` of a strided
  view, or the copy ``fix_query_key_value_ordering`` made) and its fp32 rstd per row; the
  norm's output, out_proj's input.
- in the rule's forward, beyond what it saves: w (T Hv dk) and u (T Hv dv) from
  ``recompute_w_u_fwd``, h (b N Hv dk dv, k's dtype) and v_new (T Hv dv) from
  ``chunk_gated_delta_rule_fwd_h``, o (T Hv dv) from ``chunk_fwd_o``, the final state (fp32)
  when a cache asks for it; the caller's q and k (repeated copies, or ``input_guard``'s
  contiguous copies of the views) and its unsaved locals.
- in the rule's backward (``chunk_gated_delta_rule_bwd``), beside the saved tensors and the
  output's gradient: w and u recomputed, h and v_new recomputed, dh (b N Hv dk dv), dv (the
  local one rebound by ``chunk_gated_delta_rule_bwd_dhu``'s), dq, dk, dw (``chunk_bwd_dqkwg``,
  its dg summed over the key blocks into T Hv fp32), then ``prepare_wy_repr_bwd``'s dk, dv,
  db and dg, all alive at its end.
"""

from __future__ import annotations

from memplan.model.dims import FP32_BYTES, Dims, Term

_PREFIX = "linear_attn"


def fla_rule_terms(z, dm: Dims) -> list[Term]:
    """What the conv, the gates and fla's chunked rule save (the module docstring)."""
    e, f, t, hv = dm.e, FP32_BYTES, z.tokens, z.hv
    return [Term(f"{_PREFIX}.conv_input", t * z.channels * e),
            Term(f"{_PREFIX}.beta", t * hv * e),
            Term(f"{_PREFIX}.softplus", 2 * t * hv * f),
            Term(f"{_PREFIX}.fla_qk", 2 * t * hv * z.dk * e),
            Term(f"{_PREFIX}.fla_rstd", 2 * t * hv * f),
            Term(f"{_PREFIX}.fla_v", t * hv * z.dv * e),
            Term(f"{_PREFIX}.fla_g", t * hv * f),
            Term(f"{_PREFIX}.fla_A", t * hv * z.c * e)]


def fla_norm_terms(z, dm: Dims) -> list[Term]:
    """FusedRMSNormGated's x, gate and rstd, and out_proj's input (its output)."""
    e, rows = dm.e, z.tokens * z.hv * z.dv
    return [Term(f"{_PREFIX}.norm_input", rows * e), Term(f"{_PREFIX}.norm_gate", rows * e),
            Term(f"{_PREFIX}.norm_rstd", z.tokens * z.hv * FP32_BYTES),
            Term(f"{_PREFIX}.out", rows * e)]


def states_bytes(z, dm: Dims) -> int:
    """h (b N Hv dk dv in k's dtype): the per-chunk states, made in forward and again in
    backward."""
    return z.b * z.n * z.hv * z.dk * z.dv * dm.e


def fla_rule_alive(z, dm: Dims, final_state: bool) -> int:
    """Beside the saved terms at ``chunk_fwd_o``: the caller's locals nothing saves (the
    projections' outputs, the conv output q, k, v view, with grouped value heads the z, b
    and a copies; g before the cumsum), the q and k the rule was given (2 T Hv dk), and the
    kernels' w, u, h, v_new and o; the fp32 final state when a cache asks for it."""
    e, f, t, hv = dm.e, FP32_BYTES, z.tokens, z.hv
    caller = (t * (2 * z.hk * z.dk + 2 * hv * z.dv + 2 * hv) * e + t * z.channels * e
              + (t * hv * (z.dv + 2) * e if hv > z.hk else 0) + t * hv * f)
    kernels = t * hv * (3 * z.dk + 3 * z.dv) * e + states_bytes(z, dm)
    return caller + kernels + (z.b * hv * z.dk * z.dv * f if final_state else 0)


def fla_rule_grads(z, dm: Dims) -> int:
    """In flight at ``prepare_wy_repr_bwd``'s end: the output's gradient, w, u, v_new, dv,
    dq, dk, dw and the WY pass's dk and dv (T Hv (5 dk + 5 dv) in all), db (T Hv), h and dh,
    and the two fp32 gate gradients."""
    e, t, hv = dm.e, z.tokens, z.hv
    return (t * hv * (5 * z.dk + 5 * z.dv + 1) * e + 2 * states_bytes(z, dm)
            + 2 * t * hv * FP32_BYTES)


def fla_checkpointed(z, dm: Dims) -> int:
    """In a checkpointed layer (nothing saved): at ``chunk_fwd_o`` the tensors the rule would
    save, and the sigmoid's beta, beside ``fla_rule_alive`` (softplus's fp32 input a freed
    temporary; its output is the g the caller holds)."""
    kept = sum(t.size_bytes for t in fla_rule_terms(z, dm)
               if not t.name.endswith((".conv_input", ".softplus")))
    return kept + fla_rule_alive(z, dm, False)


def fla_cache_bytes(z, dm: Dims) -> int:
    """A training forward with use_cache keeps the conv state (F.pad of the conv input to its
    last K positions, b C K) and the rule's fp32 final state; the fused rule leaves no graph
    behind it."""
    return z.b * z.channels * z.taps * dm.e + z.b * z.hv * z.dk * z.dv * FP32_BYTES


def fla_norm_working(z, dm: Dims) -> int:
    """In a checkpointed layer, at the fused gated norm: the caller's locals (``fla_rule_alive``
    without the kernels'), the rule's output, the gate's copy, the norm's output and rstd."""
    e, rows = dm.e, z.tokens * z.hv * z.dv
    caller = fla_rule_alive(z, dm, False) - (z.tokens * z.hv * (3 * z.dk + 3 * z.dv) * e
                                             + states_bytes(z, dm))
    return caller + 3 * rows * e + z.tokens * z.hv * FP32_BYTES

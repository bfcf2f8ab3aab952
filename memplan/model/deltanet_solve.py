"""The gated DeltaNet block of Qwen3-Next on transformers' rewritten torch fallback
(``Workload.deltanet_kernel`` torch-solve): models/qwen3_next/modeling_qwen3_next.py
``torch_chunk_gated_delta_rule`` from transformers 5.17.0 on (5.25.0 read), which solves the
chunks' unit lower-triangular systems with ``torch.linalg.solve_triangular`` where 5.3-5.16
ran a forward substitution loop (``memplan.model.deltanet``), applies the decays to the
query and key once before the chunk scan, and normalises q and k (``l2norm``) in fp32 inside
the rule. The conv (``causal_conv1d_fn``'s torch path: ``F.conv1d`` and silu on the slice),
the gates and the gated norm are unchanged, and so are their sizes (``memplan.model.deltanet``).

Per micro-batch on a rank (the names of ``memplan.model.deltanet.Sizes``: T tokens, Tp padded,
Hv value heads of dk and dv, N chunks of c, M = b Hv N c^2 the chunk matrices), what the rule
saves, all fp32:

- ``l2norm`` on the fp32 copies of q and k (repeated to the Hv value heads): both copies
  (2 T Hv dk) and the rsqrt per row (2 T Hv);
- ``F.pad``'s outputs: the scaled query, the key, the value and beta (Tp Hv (2 dk + dv + 1));
  k_beta (``k_beta @ key^T`` and the decay product save it); the strictly upper mask that
  ``masked_fill`` saves (c^2 bools);
- five chunk matrices: pairwise_decay (exp's output), k_beta @ key^T, the ut_system product
  (``solve_triangular`` saves its matrix), q @ k^T and intra_chunk_attn (the scan's matmul
  saves its slices);
- exp(cum_decay) twice (for decayed_k_beta and for the query: two exps, Tp Hv each), the two
  solves' results new_values (Tp Hv dv) and k_cumdecay (Tp Hv dk);
- with more than one chunk, which the state update backward reaches: the decayed query and
  key (Tp Hv dk each), the key's exp(cum_last - cum) (Tp Hv) and chunk_decay (b Hv N);
- per chunk: v_new (together Tp Hv dv) and the state entering it (b Hv dk dv).
"""

from __future__ import annotations

from memplan.model.dims import FP32_BYTES, MASK_BYTES, Dims, Term

_PREFIX = "linear_attn"


def strided(z, dm: Dims) -> bool:
    """Whether the rule's fp32 query and key keep the (b, s, H, d) layout of their
    (b, H, s, d) views: in an fp32 model ``x.transpose(1, 2).to(torch.float32, memory_format=
    torch.contiguous_format)`` returns the transposed view itself (no conversion, no copy), and
    ``F.pad`` with nothing to pad clones it as it is laid out (with padding its output is
    contiguous)."""
    return dm.e >= FP32_BYTES and z.s % z.c == 0


def chunk_copies(z, dm: Dims) -> bool:
    """Whether ``k_beta @ key^T`` and ``query @ key^T`` copy their operands: laid out as
    ``strided`` says, their batch dimensions (b, Hv, N) fold into one only where at most
    one of b and N is above 1 or there is one head (matmul's reshape; traced)."""
    return strided(z, dm) and z.hv > 1 and (z.b > 1 or z.n > 1)


def slice_copies(z, dm: Dims) -> bool:
    """Whether the scan's matmuls copy a chunk's decayed query or key (``query[:, :, i]``:
    batch dimensions b and Hv, which fold only where one of them is 1)."""
    return strided(z, dm) and z.hv > 1 and z.b > 1


def solve_conv_terms(z, dm: Dims) -> list[Term]:
    """The conv's input and output (as ``memplan.model.deltanet``), beta and softplus; what
    ``l2norm`` saves, q and k and the rsqrt per row: the fp32 copies below fp32, else the
    tensors themselves, the repeated q and k (Hv > Hk) or the conv's silu output they view."""
    e, f, t = dm.e, FP32_BYTES, z.tokens
    qk = t * z.channels * e if (e >= f and z.hv == z.hk) else 2 * t * z.hv * z.dk * f
    return [Term(f"{_PREFIX}.conv_input", t * z.channels * e),
            Term(f"{_PREFIX}.conv_output", z.b * z.channels * (z.s + z.taps - 1) * e),
            Term(f"{_PREFIX}.qk", qk),
            Term(f"{_PREFIX}.l2norm_rsqrt", 2 * t * z.hv * f),
            Term(f"{_PREFIX}.beta", t * z.hv * e),
            Term(f"{_PREFIX}.softplus", 2 * t * z.hv * f)]


def solve_chunk_terms(z, dm: Dims) -> list[Term]:
    """The rule's tensors saved once per micro-batch (the module docstring); laid out as
    ``strided`` says, the two chunk matmuls save copies of k_beta, the key twice and the
    query (4 Tp Hv dk; ``chunk_copies``), and the scan copies of a chunk of the decayed
    query (chunks 1..N-1) and of the decayed key (chunks 0..N-2) instead of keeping them
    whole (``slice_copies``)."""
    f, tp, hv = FP32_BYTES, z.padded, z.hv
    k_like, v_like = tp * hv * z.dk * f, tp * hv * z.dv * f
    decayed = 0
    if z.n > 1:
        decayed = (2 * (z.n - 1) * z.b * hv * z.c * z.dk * f if slice_copies(z, dm)
                   else 2 * k_like) + tp * hv * f + z.b * hv * z.n * f
    copies = 4 * k_like if chunk_copies(z, dm) else 0
    # the mask, and the factor -exp(A_log) of g (exp saves its output, the product the
    # negated copy): Hv fp32 each
    masks = z.c * z.c * MASK_BYTES + 2 * hv * f
    return [Term(f"{_PREFIX}.rule_kv", 4 * k_like + 2 * v_like + decayed + copies),
            Term(f"{_PREFIX}.rule_masks", masks),
            Term(f"{_PREFIX}.rule_gates", 3 * tp * hv * f),  # beta, exp(cum) twice
            Term(f"{_PREFIX}.rule_decay", 5 * z.chunk_matrices * f)]


def solve_per_chunk_terms(z) -> list[Term]:
    """v_new of every chunk and the state entering it."""
    f, hv = FP32_BYTES, z.hv
    return [Term(f"{_PREFIX}.chunk_rows", z.padded * hv * z.dv * f),
            Term(f"{_PREFIX}.chunk_states", z.n * z.b * hv * z.dk * z.dv * f)]


def solve_rule_terms(z, dm: Dims) -> list[Term]:
    return solve_conv_terms(z, dm) + solve_chunk_terms(z, dm) + solve_per_chunk_terms(z)


def solve_checkpointed_rule(z, dm: Dims) -> int:
    """The most bytes ``torch_chunk_gated_delta_rule``'s own tensors reach without autograd
    saving any (fp32; K = Tp Hv dk, V = Tp Hv dv, G = Tp Hv, M the chunk matrices, r and rk
    one chunk's rows of dv and dk, S the state):

    - at the chunk scan's start: the decayed query and key, k_beta, decayed_k_beta and
      k_cumdecay (5 K), the padded value, v_beta, new_values and core_attn_out (4 V), the
      padded beta and decay and cum_decay (3 G),
      pairwise_decay, ut_system and intra_chunk_attn (3 M), the state, the mask and
      chunk_decay;
    - then per chunk the most of: v_new, inter_chunk_attn, intra @ v_new and their sum (4 r);
      v_new and inter_chunk_attn (locals until the next chunk rebinds them) with the state's
      decayed copy, a copy of the chunk's decayed key (``slice_copies``) and k^T @ v_new
      (2 r + 2 S + rk), or with the three S-sized tensors of the update (2 r + 3 S);
    - before it, building the chunk matrices: the padded query, key and value, k_beta,
      v_beta (3 K + 2 V), the gates (3 G) and the mask, pairwise_decay and a product with
      its operand (3 M), with the operands' copies (``chunk_copies``: 2 K)."""
    f, hv, b, c = FP32_BYTES, z.hv, z.b, z.c
    k_like, v_like, g_like = (z.padded * hv * d * f for d in (z.dk, z.dv, 1))
    big = z.chunk_matrices * f
    r, rk, state = b * hv * c * z.dv * f, b * hv * c * z.dk * f, b * hv * z.dk * z.dv * f
    mask = c * c * MASK_BYTES
    start = (5 * k_like + 4 * v_like + 3 * g_like + 3 * big + state + mask
             + b * hv * z.n * f)
    copy = rk if slice_copies(z, dm) else 0
    scan = start + max(4 * r, 2 * r + 2 * state + copy, 2 * r + 3 * state)
    build = (3 * k_like + 2 * v_like + 3 * g_like + mask + 3 * big
             + (2 * k_like if chunk_copies(z, dm) else 0))
    return max(scan, build)


def solve_caller_locals(z, dm: Dims) -> int:
    """``memplan.model.deltanet.caller_locals`` but the repeated q and k, which the rule makes
    and drops itself (5.25; 5.17-5.24 repeat them in the caller)."""
    return 0 if z.hv == z.hk else -2 * z.tokens * z.hv * z.dk * dm.e


def solve_last_update(z) -> int:
    """What the last chunk's state update adds that only the final state's graph keeps: a copy
    of the chunk's decayed key (``slice_copies``) or, with one chunk, the decayed key, its exp
    and chunk_decay, which only that update saves."""
    f, hv = FP32_BYTES, z.hv
    if z.n == 1:
        return z.padded * hv * (z.dk + 1) * f + z.b * hv * f
    return 0


def solve_rule_alive(z, dm: Dims) -> int:
    """Beside the saved tensors at the chunk scan's end: the qkvz projection's output (z views
    it), v_beta and core_attn_out (V each), decayed_k_beta (K), the padded decay and cum_decay
    (G each), the final state and what only its update saved (``solve_last_update``; a copy
    of the chunk's decayed key with ``slice_copies``)."""
    f, hv = FP32_BYTES, z.hv
    la_out = z.tokens * (2 * z.hk * z.dk + 2 * hv * z.dv) * dm.e
    copy = z.b * hv * z.c * z.dk * f if slice_copies(z, dm) else 0
    return (la_out + z.padded * hv * (2 * z.dv + z.dk + 2) * f + z.b * hv * z.dk * z.dv * f
            + solve_last_update(z) + copy)


def solve_update_locals(z, dm: Dims) -> int:
    """Beyond ``solve_rule_alive`` at the last chunk's state update in a forward that saves:
    the decayed state and k^T @ v_new (S each, the add's inputs), the chunk's
    ``inter_chunk_attn`` (b Hv c dv fp32: a local the loop rebinds, its bmm saves its inputs
    only), and the caller's locals nothing saves (``memplan.model.deltanet.
    last_update_locals``: projected_states_ba and, with grouped value heads, the silu output,
    the z copy and the b and a copies; g, T Hv fp32). Traced on transformers 5.23, the wide
    toy (dk = dv = 128) in fp32 under full recompute: step 1's backward peaks here, -133,664
    B (-0.99%) without the last two, -544 B with them."""
    e, t, hv = dm.e, z.tokens, z.hv
    grouped = t * (z.channels + hv * z.dv + 2 * hv) * e if hv > z.hk else 0
    return (2 * z.b * hv * z.dk * z.dv * FP32_BYTES + t * 2 * hv * e + grouped
            + z.b * hv * z.c * z.dv * FP32_BYTES + t * hv * FP32_BYTES)

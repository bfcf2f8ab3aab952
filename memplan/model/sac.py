"""torchtitan's per-op selective activation checkpointing (``Workload.selective_impl = op``).

torchtitan 0.3.0 wraps each block in ``create_selective_checkpoint_contexts`` with the policy of
``SelectiveAC._wrap_block`` (``distributed/activation_checkpoint.py``): the outputs of the ops
in its save list (``_get_default_save_ops``: PyTorch's compute-intensive ops, matmuls and the
SDPA kernels among them, and collectives) are kept, except every second matmul of the block,
counted in execution order; everything else is recomputed in backward, where the block's
forward reruns (the kept outputs are served from the cache) before its backward.

So a block holds its checkpointed input and the kept outputs (``sac_terms``), and in backward
rebuilds what a block without recompute saves, as a fully recomputed block does.
"""

from __future__ import annotations

from memplan.model.dims import FP32_BYTES, Dims, Term
from memplan.spec import ModelSpec


def matmuls(spec: ModelSpec, fused_qkv: bool) -> list[tuple[str, int, int, bool]]:
    """A Llama block's matmuls in execution order as (name, input width, output width,
    column-parallel): the q/k/v projection (one fused, or three), the output projection, then
    the MLP's gate (w1), up (w3) and down (w2) projections."""
    h, q, kv, f = spec.hidden_size, spec.q_size, spec.kv_size, spec.ffn_hidden_size
    qkv = ([("attn.qkv", h, q + 2 * kv, True)] if fused_qkv else
           [("attn.q_proj", h, q, True), ("attn.k_proj", h, kv, True),
            ("attn.v_proj", h, kv, True)])
    mlp = [("mlp.w1", h, f, True)] + ([("mlp.w3", h, f, True)] if spec.mlp.gated else [])
    return qkv + [("attn.o_proj", q, h, False)] + mlp + [("mlp.w2", f, h, False)]


MatMul = tuple[str, int, int, bool]


def recomputed(spec: ModelSpec, fused_qkv: bool,
               mms: list[MatMul] | None = None) -> list[MatMul]:
    """The matmuls per-op SAC recomputes: the even-numbered ones (``meta[mm_count_key] % 2
    == 0``) of the block's counted matmuls ``mms`` (default: a Llama block's, ``matmuls``)."""
    mms = matmuls(spec, fused_qkv) if mms is None else mms
    return [m for i, m in enumerate(mms, start=1) if i % 2 == 0]


def sac_terms(spec: ModelSpec, dm: Dims, fused_qkv: bool,
              mms: list[MatMul] | None = None) -> list[Term]:
    """What a block under per-op SAC keeps beyond its input: every odd matmul's output
    (the 1st, 3rd, ...: ``meta[mm_count_key] % 2 == 0`` recomputes the even ones) of its
    counted matmuls ``mms`` (default ``matmuls``) and the attention kernel's output and fp32
    logsumexp."""
    mms = matmuls(spec, fused_qkv) if mms is None else mms
    rerun = {m[0] for m in recomputed(spec, fused_qkv, mms)}
    # a column-parallel output is this rank's shard; a row-parallel one the full partial sum
    kept = [Term(f"sac.{name}", dm.tokens * (d_out // dm.tp if column else d_out) * dm.e)
            for name, _, d_out, column in mms if name not in rerun]
    heads = spec.num_attention_heads // dm.tp
    kept.append(Term("sac.attn.out", dm.tokens * spec.q_size // dm.tp * dm.e))
    kept.append(Term("sac.attn.lse", dm.b * heads * dm.s * FP32_BYTES))
    return kept

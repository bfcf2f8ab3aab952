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


def matmul_outputs(spec: ModelSpec, dm: Dims, fused_qkv: bool) -> list[tuple[str, int]]:
    """A Llama block's matmuls in execution order, with their output's bytes on this rank:
    the q/k/v projection (one fused, or three), the output projection, then the MLP's gate
    (w1), up (w3) and down (w2) projections. Row-parallel outputs are the full sequence."""
    e, t, tok = dm.e, dm.tp, dm.tokens
    kv = tok * spec.kv_size // t * e
    qkv = ([("attn.qkv", tok * (spec.q_size + 2 * spec.kv_size) // t * e)] if fused_qkv else
           [("attn.q_proj", tok * spec.q_size // t * e), ("attn.k_proj", kv),
            ("attn.v_proj", kv)])
    out = [("attn.o_proj", tok * spec.hidden_size * e)]
    inner = tok * spec.ffn_hidden_size // t * e
    mlp = ([("mlp.w1", inner), ("mlp.w3", inner)] if spec.mlp.gated else [("mlp.w1", inner)])
    return qkv + out + mlp + [("mlp.w2", tok * spec.hidden_size * e)]


def sac_terms(spec: ModelSpec, dm: Dims, fused_qkv: bool) -> list[Term]:
    """What a block under per-op SAC keeps beyond its input: every odd matmul's output
    (the 1st, 3rd, ...: ``meta[mm_count_key] % 2 == 0`` recomputes the even ones) and the
    attention kernel's output and fp32 logsumexp."""
    kept = [Term(f"sac.{name}", size)
            for i, (name, size) in enumerate(matmul_outputs(spec, dm, fused_qkv), start=1)
            if i % 2 == 1]
    heads = spec.num_attention_heads // dm.tp
    kept.append(Term("sac.attn.out", dm.tokens * spec.q_size // dm.tp * dm.e))
    kept.append(Term("sac.attn.lse", dm.b * heads * dm.s * FP32_BYTES))
    return kept

"""Eager attention, op by op: the bytes its core holds at each local peak.

Eager attention (``softmax(q k^T / sqrt(d) + mask) v`` written out in PyTorch, as Hugging Face's
``eager`` implementation does) materialises score-sized tensors of b * a/t * s * s_kv elements,
so at long sequences its local peaks decide a layer's forward and backward peaks. They depend on
which tensors are saved, which are only held by Python locals until the function returns, and
which copies ``torch.matmul`` makes. All of it was read off traces of the reference model with
the exact tracker (``memplan trace``; ``docs/ground_truth.md``, section "eager attention"):

- ``matmul`` on 4-d tensors reshapes them to 3-d. q, k and v come out of their projections as
  (b, s, heads, d) transposed to (b, heads, s, d); merging b and heads is not a view when
  b > 1 and heads > 1, so the matmuls copy q, k^T (first) and v (second). K and V repeated to
  every query head (GQA, ``repeat_interleave``) are contiguous and need no copy.
- the caller's locals q, k, v stay alive while the core runs, and the core's output stays
  alive while the output projection runs (its transposed reshape is a copy).
- the scores: the raw product, its scaled and masked successors (the masked one is a local
  until the core returns), then the softmax output, dropout's mask and output.
- backward: the value matmul's backward makes the gradients of V and of the probabilities;
  when it finishes, its saved V and the dropout output are freed; then softmax's backward adds
  the score gradient beside the incoming one.
- a checkpointed core (selective recompute) saves nothing while it runs forward; rerun in the
  backward it saves everything again and stops early once the value matmul has saved its
  inputs (torch.utils.checkpoint's default early stop), before that matmul runs.
"""

from __future__ import annotations

from typing import NamedTuple

from memplan.model.dims import MASK_BYTES, Dims
from memplan.spec import ModelSpec


class Core(NamedTuple):
    """Sizes of one eager core (bytes, one micro-batch, one rank)."""

    scores: int  # one score-sized tensor in the compute dtype
    mask: int  # dropout's bool mask over the scores (0 without dropout)
    dropped: int  # dropout's output over the scores (0 without dropout)
    q: int  # q, and any tensor of q's shape (output, repeated K or V)
    kv: int  # k or v before repetition
    q_copy: int  # the first matmul's contiguous copy of q
    k_extra: int  # the contiguous copy of k^T, or K repeated to every head
    v_extra: int  # the contiguous copy of v, or V repeated to every head
    grouped: bool  # K and V repeated to every query head (GQA, MQA)

    @property
    def caller_locals(self) -> int:
        """q, k, v held by the caller that are not themselves what the matmuls save."""
        held = self.q if self.q_copy else 0
        if self.k_extra:
            held += self.kv
        if self.v_extra:
            held += self.kv
        return held

    @property
    def rebuilt(self) -> int:
        """What the core saves when it runs with autograd recording (beyond q, k, v)."""
        return (self.q_copy + self.k_extra + self.v_extra + self.scores
                + self.mask + self.dropped)


def core(spec: ModelSpec, dm: Dims) -> Core:
    heads = spec.num_attention_heads // dm.tp
    scores = dm.b * heads * dm.s * dm.s_kv
    q = dm.tokens * spec.q_size // dm.tp * dm.e
    kv = dm.tokens * spec.kv_size // dm.tp * dm.e
    copies = dm.b > 1 and heads > 1 and dm.s > 1
    grouped = spec.num_kv_heads < spec.num_attention_heads
    dropout = spec.dropout > 0
    extra = q if (grouped or copies) else 0
    return Core(scores=scores * dm.e, mask=scores * MASK_BYTES if dropout else 0,
                dropped=scores * dm.e if dropout else 0, q=q, kv=kv,
                q_copy=q if copies else 0, k_extra=extra, v_extra=extra, grouped=grouped)


def forward_saving(c: Core) -> int:
    """Transient bytes at the forward peak of a core that saves (no recompute), beyond what it
    has saved by then (everything it saves): the masked scores, still a local, beside the
    value matmul's output, and the caller's q, k, v the matmuls copied."""
    return c.caller_locals + c.scores + c.q


def forward_checkpointed(c: Core) -> int:
    """Bytes a checkpointed core holds at its forward peak, beyond its inputs q, k, v."""
    # repeated K and V are the core's locals until it returns; copies die with their matmul
    reps = c.k_extra + c.v_extra if c.grouped else 0
    first = c.q_copy + (reps if c.grouped else c.k_extra) + c.scores
    scores = reps + 2 * c.scores  # raw and scaled, then masked and softmax
    dropout = reps + 3 * c.scores + c.mask if c.mask else 0  # masked, softmax, mask, output
    # the value matmul: the masked scores, its probabilities, the copy of v, its output
    value = reps + 2 * c.scores + (0 if c.grouped else c.v_extra) + c.q
    return max(first, scores, dropout, value)


def output_projection(c: Core, saving: bool) -> int:
    """Transients while the output projection runs, beyond its output: the core's output
    (its transposed reshape is the copy the projection saves) and, when the core saved
    copies, the caller's q, k, v."""
    return c.q + (c.caller_locals if saving else 0)


def backward(c: Core, rebuild: bool) -> list[tuple[int, int]]:
    """(change of the attention block's saved bytes, gradient bytes in flight) at the core's
    two backward peaks, the output projection's backward done (its saved input freed) and the
    incoming residual gradient excluded: the value matmul's backward (gradients of the output,
    of V and of the probabilities), then softmax's (the value matmul freed what it saved, V as
    it multiplied it and the dropout output; gradients of V, the probabilities and scores).

    ``rebuild``: the core reruns first (selective recompute) and holds what it saves again;
    otherwise its saved tensors are among the block's saved terms (V as a q-sized term).
    """
    rebuilt = c.rebuilt if rebuild else 0
    v_saved = c.v_extra if rebuild else c.q
    return [(rebuilt, 2 * c.q + c.scores),
            (rebuilt - v_saved - c.dropped, c.q + 2 * c.scores)]

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

Under autocast with fp32 weights (``Dims.autocast``) the additive mask is fp32, so the masked
scores and the softmax are fp32; the value matmul saves a low-precision cast of the
probabilities. With RoPE the caller's q and k are fp32 (rotated by the fp32 tables) and never
saved (the matmuls save casts of them, or contiguous copies of the casts), and K repeated to
every head is fp32 too, a local of the core beside its saved cast. In backward the gradient of
the probabilities' cast is upcast to fp32 before softmax's backward, which runs in fp32.
"""

from __future__ import annotations

from typing import NamedTuple

from memplan.model.dims import FP32_BYTES, INDEX_BYTES, MASK_BYTES, Dims
from memplan.spec import ModelSpec


class Core(NamedTuple):
    """Sizes of one eager core (bytes, one micro-batch, one rank)."""

    scores: int  # one score-sized tensor in the compute dtype
    mask: int  # dropout's bool mask over the scores (0 without dropout)
    q: int  # q, and any tensor of q's shape (output, repeated K or V)
    kv: int  # k or v before repetition
    q_copy: int  # the first matmul's contiguous copy of q
    k_extra: int  # the contiguous copy of k^T, or K repeated to every head
    v_extra: int  # the contiguous copy of v, or V repeated to every head
    grouped: bool  # K and V repeated to every query head (GQA, MQA)
    sm: int = 0  # the softmax output (fp32 under autocast)
    masked: int = 0  # the masked scores (in the mask's dtype: fp32 under autocast)
    value_input: int = 0  # what the value matmul saved of the probabilities beyond softmax's
    #                       own output: dropout's output, or under autocast their cast
    fp32_caller: int = 0  # autocast with RoPE: the caller's fp32 rotated q and k
    fp32_k_rep: int = 0  # ... and K repeated to every head in fp32, a local of the core
    dropout_local: int = 0  # autocast: dropout's fp32 output, a local (its cast is saved)
    softcap: int = 0  # logit soft-capping: each of its score-sized tensors (compute dtype)
    # attention sinks (GPT-OSS): one column of the scores (the sink's, and the row max's
    # values) and the row max's int64 indices
    sink_col: int = 0
    sink_index: int = 0

    @property
    def caller_locals(self) -> int:
        """q, k, v held by the caller that are not themselves what the matmuls save."""
        if self.fp32_caller:
            return self.fp32_caller + (self.kv if self.v_extra else 0)
        held = self.q if self.q_copy else 0
        if self.k_extra:
            held += self.kv
        if self.v_extra:
            held += self.kv
        return held

    @property
    def rebuilt(self) -> int:
        """What the core saves when it runs with autograd recording (beyond q, k, v)."""
        return self.q_copy + self.k_extra + self.v_extra + self.sm + self.mask + self.value_input


def core(spec: ModelSpec, dm: Dims, softmax_fp32: bool = False) -> Core:
    """The core's sizes; ``softmax_fp32``: the softmax runs in fp32 and its output is cast
    back for the value matmul (transformers' ``eager_attention_forward``), as under
    autocast."""
    heads = spec.num_attention_heads // dm.tp
    scores = dm.b * heads * dm.s * dm.s_kv
    q = dm.tokens * spec.q_size // dm.tp * dm.e
    kv = dm.tokens * spec.kv_size // dm.tp * dm.e
    copies = dm.b > 1 and heads > 1 and dm.s > 1
    grouped = spec.num_kv_heads < spec.num_attention_heads
    dropout = spec.dropout > 0
    extra = q if (grouped or copies) else 0
    amp = dm.autocast
    # under autocast the value matmul saves the cast of dropout's fp32 output, or of the
    # probabilities
    fp32_softmax = amp or softmax_fp32
    value_input = scores * dm.e if dropout or fp32_softmax else 0
    rope = amp and spec.rope_fp32_under_autocast
    fp32_q = dm.tokens * spec.q_size // dm.tp * dm.stream_e
    fp32_k = dm.tokens * spec.kv_size // dm.tp * dm.stream_e
    return Core(scores=scores * dm.e, mask=scores * MASK_BYTES if dropout else 0,
                q=q, kv=kv,
                q_copy=q if copies else 0, k_extra=extra, v_extra=extra, grouped=grouped,
                sm=scores * (FP32_BYTES if fp32_softmax else dm.e), masked=scores * dm.stream_e,
                value_input=value_input,
                fp32_caller=fp32_q + fp32_k if rope else 0,
                fp32_k_rep=fp32_q if rope and grouped else 0,
                dropout_local=scores * dm.stream_e if amp and dropout else 0,
                softcap=scores * dm.e if spec.attn_logit_softcap is not None else 0,
                **_sinks(spec, dm, amp))


def _sinks(spec: ModelSpec, dm: Dims, amp: bool) -> dict[str, int]:
    """GPT-OSS's sink column (``ModelSpec.attn_sinks``), one per query row and head, in the
    scores' dtype, and the row max's int64 indices; modelled without autocast
    (``_sink_moments``)."""
    if not spec.attn_sinks or amp:
        return {}
    rows = dm.b * (spec.num_attention_heads // dm.tp) * dm.s
    return {"sink_col": rows * dm.e, "sink_index": rows * INDEX_BYTES}


def forward_saving(c: Core) -> int:
    """Transient bytes at the forward peak of a core that saves (no recompute), beyond what it
    has saved by then (everything it saves): the masked scores, still a local, beside the
    value matmul's output, and the caller's q, k, v the matmuls copied (and the fp32 K
    repeated to every head, under autocast with RoPE)."""
    return c.caller_locals + c.fp32_k_rep + c.masked + c.dropout_local + c.q


def saving_sink_moments(c: Core) -> list[tuple[int, int]]:
    """A core with sinks rerun with autograd recording (``_sink_moments``), at the row max's
    difference: of what the core saves, the probabilities (the softmax's output with its
    sink column) not made yet; beside the rest, the caller's locals, the masked scores, the
    cat's output, the difference and the max's values (its indices saved). As (saved bytes
    not made yet, bytes beside); none without sinks. Traced: transformers' GPT-OSS narrowed,
    bf16, 2 x 1,024 tokens, under full recompute: the rerun's difference the backward's
    peak, 1,158,264 B above the estimate without it."""
    if not c.sink_col:
        return []
    wide = c.scores + c.sink_col
    return [(wide, c.caller_locals + c.fp32_k_rep + c.scores + 2 * wide + c.sink_col)]


def forward_checkpointed(c: Core) -> int:
    """Bytes a checkpointed core holds at its forward peak, beyond its inputs q, k, v."""
    return max(value for value, _ in checkpointed_moments(c))


# the names of an eager core's ops whose outputs a policy can keep (``memplan.model.sac_ops.
# _eager_core_ops``): the scores (the first matmul's output), the softmax, its cast back, the
# dropout (output and mask) and the context (the value matmul's output); with logit
# soft-capping, tanh's output and the capped scores (``tanh * softcap``)
SCORES, SOFTMAX, CAST, DROPOUT, CONTEXT = ("attn.scores", "attn.softmax", "attn.softmax_cast",
                                           "attn.dropout", "attn.context")
TANH, CAPPED = "attn.softcap_tanh", "attn.softcap"


def _after_mask(c: Core) -> dict[str, int]:
    """What each kept output made before the mask's add adds once the masked scores exist:
    the scores (freed at the scaling) and, with soft-capping, tanh's output and the capped
    scores (freed by the next op: the product, then the add)."""
    return {SCORES: c.scores, TANH: c.softcap, CAPPED: c.softcap}


def _softcap_moments(c: Core, reps: int) -> list[tuple[int, dict[str, int]]]:
    """Logit soft-capping (models/gemma2/modeling_gemma2.py ``eager_attention_forward``:
    ``attn_weights / softcap``, ``torch.tanh``, ``* softcap``, each rebinding
    ``attn_weights``) between the scaling and the mask: each op's input and output, two
    score-sized tensors in the compute dtype, the raw scores freed (kept, they add); tanh's
    output and the capped scores are alive there anyway. Nothing without soft-capping."""
    return [(reps + 2 * c.scores, {SCORES: c.scores})] if c.softcap else []


def checkpointed_moments(c: Core) -> list[tuple[int, dict[str, int]]]:
    """A checkpointed core's forward moments (bytes beyond its inputs q, k, v), each with
    the bytes a kept op output adds there beyond what the moment holds (``SCORES``, ...:
    kept, an output stays alive from its op on, where the core would have freed it)."""
    if c.sm != c.scores:  # autocast or an fp32 softmax: fp32 masked scores and softmax
        return _checkpointed_autocast(c)
    # repeated K and V are the core's locals until it returns; copies die with their matmul
    reps = c.k_extra + c.v_extra if c.grouped else 0
    first = c.q_copy + (reps if c.grouped else c.k_extra) + c.scores
    scores = reps + 2 * c.scores  # raw and scaled, then masked and softmax
    kept_scores = _after_mask(c)
    out = [(first, {}), *_softcap_moments(c, reps), (scores, kept_scores)]
    if c.sink_col:
        return out + _sink_moments(c, reps)
    if c.mask:  # masked, softmax, mask, output
        out.append((reps + 3 * c.scores + c.mask, kept_scores))
    # the value matmul: the masked scores, its probabilities, the copy of v, its output
    value = reps + 2 * c.scores + (0 if c.grouped else c.v_extra) + c.q
    return out + [(value, {**kept_scores, SOFTMAX: c.scores if c.mask else 0})]


def _sink_moments(c: Core, reps: int) -> list[tuple[int, dict[str, int]]]:
    """A checkpointed core with sinks after its scaling (models/gpt_oss/modeling_gpt_oss.py
    ``eager_attention_forward``, no dropout, the softmax in the scores' dtype): the masked
    scores (``attn_weights``, a local until dropout's no-op rebinds it to the probabilities'
    view) beside ``torch.cat([attn_weights, sinks], dim=-1)``, s_kv + 1 wide; the row max
    (``combined_logits.max(dim=-1, keepdim=True)``: its values and int64 indices, the
    indices freed with the tuple once ``.values`` is read); the difference (rebinding
    ``combined_logits``: the cat's output freed after it), then the softmax beside it and the
    masked scores, the max's values freed; at the value matmul the difference and the
    probabilities with its output. Traced: transformers' GPT-OSS narrowed, bf16, 2 x 1,024
    tokens, under full recompute: each moment to the byte, the difference's the core's
    peak (the forward's, 16,285,824 B above the core without sinks). A kept scores tensor
    (the first matmul's output) adds at each; the softmax's output is alive anyway."""
    wide = c.scores + c.sink_col
    kept = {SCORES: c.scores}
    return [(reps + c.scores + wide + c.sink_col + c.sink_index, kept),
            (reps + c.scores + 2 * wide + c.sink_col, kept),
            (reps + c.scores + 2 * wide, kept),
            (reps + 2 * wide + (0 if c.grouped else c.v_extra) + c.q, kept)]


def _checkpointed_autocast(c: Core) -> list[tuple[int, dict[str, int]]]:
    """``checkpointed_moments`` under autocast or with an fp32 softmax: the raw and scaled
    scores in the low dtype, the masked scores (a local to the end) and the softmax in fp32,
    dropout's fp32 output and mask (the softmax freed once dropout returns), the cast of the
    probabilities the value matmul reads; repeated K (fp32 with RoPE) and V are locals of
    the core."""
    k_rep = c.fp32_k_rep or (c.k_extra if c.grouped else 0)
    reps = k_rep + c.v_extra if c.grouped else 0
    casts = 2 * c.q + c.q_copy + (c.k_extra if c.q_copy else 0)  # the first matmul's inputs
    first = reps + casts + c.scores
    # a softmax in a wider dtype than its input (softmax(dtype=float32) on bf16 masked
    # scores, no autocast) copies the input to that dtype first (traced: Llama bf16 eager)
    upcast = c.sm if c.masked < c.sm else 0
    kept_scores = _after_mask(c)
    out = [(first, {}), (reps + 2 * c.scores, {}), *_softcap_moments(c, reps),
           (reps + c.scores + c.masked, kept_scores),
           (reps + c.masked + upcast + c.sm, kept_scores)]
    probs = c.sm
    if c.mask:
        out.append((reps + c.masked + c.sm + c.dropout_local + c.mask, kept_scores))
        probs = c.dropout_local + c.mask
    value = reps + c.masked + probs + c.value_input + (0 if c.grouped else c.v_extra) + c.q
    return out + [(value, {**kept_scores, SOFTMAX: c.sm if c.mask else 0})]


def returned(c: Core, autocast: bool) -> str:
    """Which kept op output is the probabilities the core returns (transformers'
    ``eager_attention_forward`` returns ``attn_weights``, which the decoder layer holds to its
    end: ``attention.held_weights_bytes``): dropout's output, else the softmax's cast back
    (``.to(query.dtype)``: a copy on 16-bit weights; under autocast a no-op on RoPE's fp32
    query, the softmax itself, and a cast no policy names on another query), else the
    softmax; "" for none."""
    if c.mask:
        return DROPOUT
    if autocast:
        return SOFTMAX if c.fp32_caller else ""
    return CAST if c.sm != c.scores else SOFTMAX


def output_moment_adds(c: Core, autocast: bool) -> dict[str, int]:
    """What each kept op output adds at the output projection (``SCORES``, ...): the scores
    (with soft-capping, tanh's output and the capped scores), the softmax and its cast (freed
    by then) but the returned probabilities (``returned``:
    alive until the attention returns; of dropout's, its mask); the context is the copy's
    source, alive there."""
    adds = {**_after_mask(c), SOFTMAX: c.sm, CAST: c.value_input, DROPOUT: c.mask}
    held = returned(c, autocast)
    if held:
        adds[held] = c.mask if held == DROPOUT else 0
    return adds


def output_projection(c: Core, saving: bool) -> int:
    """Transients while the output projection runs, beyond its output: the core's output
    (its transposed reshape is the copy the projection saves) and, when the core saved
    copies, the caller's q, k, v."""
    return c.q + (c.caller_locals if saving else 0)


def rerun(c: Core) -> int:
    """Gradient bytes in flight and the rerun's locals when a checkpointed core (selective
    recompute), rerun in backward, stops early (the value matmul's inputs saved, beside
    everything else it saves again, ``Core.rebuilt``): the core output's gradient (q-sized,
    from the output projection's backward) beside the masked scores and, under autocast,
    dropout's fp32 output (locals to the core's end; their successors are saved) and the fp32
    K repeated to every head (with RoPE). Traced: the reference GPT under amp-bf16 with eager
    attention and attention dropout, 2 x 128 tokens: step 1's backward peaks here, at the
    contiguous copy of V the value matmul saves last (294,912 B above the value matmul's
    backward: the probabilities' cast and that copy)."""
    return c.q + c.masked + c.dropout_local + c.fp32_k_rep


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
            (rebuilt - v_saved - c.value_input, c.q + 2 * c.sm)]

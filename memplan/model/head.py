"""The head block (last pipeline stage): final norm, output projection and cross-entropy, on
all tokens at once or in checkpointed chunks of the tokens.

What it saves: the final norm's terms, the log-softmax output of the vocab-parallel loss and
the targets. A chunked loss saves no log-softmax output: each chunk's checkpoint keeps only
its input (a view of the final norm's output) and recomputes the rest in its backward.

A chunked loss whose chunks run their backward inside the loss call (``ChunkBackward.IN_LOSS``,
torchtitan 0.3's ``ChunkedLossWrapper.__call__`` in components/loss.py) saves the input
gradient it summed over the chunks instead (``accumulated_grad``, cast to the final norm's
output dtype: the output's bytes); the head's weight gradient exists when the loss returns, and
the model's backward starts at the final norm (``memplan.model.loss_in_call``).

torchtitan's loss compiled whole (``compile_loss`` with ``LossImpl.TORCHTITAN``:
``components/loss.py build_cross_entropy_loss`` wraps ``cross_entropy_loss``,
``F.cross_entropy(pred.flatten(0, 1).float(), labels.flatten(0, 1))``, in ``torch.compile``
when the job compiles, at e7c0cae; 0.3's ``compile.components`` "loss") is partitioned as
torchtune's compiled chunk (``memplan.model.chunked_output``, one chunk): the upcast, the
shifted logits and their exponentials are fusible pointwise ops, recomputed; the row max and
the log-sum-exp are reductions, saved; the logits, the graph's input, saved as they are (the
model's output: the loop's ``del pred`` frees nothing). So it saves the compute-dtype logits
and two fp32 per token, makes no logits-sized buffer in forward, and in backward one kernel
makes the logits' gradient in the compute dtype (traced: tests/traced/
test_torchtitan_compiled_loss.py, Inductor on CPU).

Compiled on logits the TP ranks split over the vocabulary (loss parallel: ``cross_entropy_loss``
runs ``_LossParallelCrossEntropy.apply`` on the DTensor's local shard, 0.3's components/loss.py),
Dynamo traces the autograd function's forward and backward into one graph and the partitioner
moves the part of its backward that does not read the incoming gradient, ``grad_input +
torch.exp(log_probs)`` (the softmax less the one-hot targets, fp32), into the forward: that is
saved, with the targets' out-of-shard mask (one byte per token), in place of the eager
``log_probs``; the logits are not saved (the graph frees its input). The forward's kernel holds
``log_probs`` (fp32, logits-sized) beside it, with the logits, three fp32 numbers per token (the
row max, the local result, the per-token gather) and the loss; the backward makes the logits'
gradient in the compute dtype in one kernel (traced: tests/traced/
test_torchtitan_compiled_loss.py, rank 0 of a fake process group of two, Inductor on CPU).
"""

from __future__ import annotations

from typing import NamedTuple

from memplan.model import chunked_output as tune
from memplan.model import linear as lin
from memplan.model import norm
from memplan.model.block import BackwardMoment, Moment
from memplan.model.linear import Linear, Split, weight_casts
from memplan.model.dims import FP32_BYTES, INDEX_BYTES, MASK_BYTES, Dims, Term, total
from memplan.model.moments import Event, Segment
from memplan.model.mtp import depth_terms
from memplan.model.norm import norm_terms
from memplan.parallel import vocab_shard
from memplan.spec import ModelSpec, norm_params
from memplan.units import ceil_div
from memplan.workload import ChunkBackward, LogitsHeld, LossImpl, MambaKernel, Recompute, Workload


def logit_bytes(wl: Workload, dm: Dims) -> int:
    """The loss's dtype: fp32 with upcast logits, and under autocast always (log_softmax takes
    ``dtype=float32`` there: AT_FORALL_FP32_SET_OPT_DTYPE in ``aten/src/ATen/autocast_mode.h``)."""
    return (FP32_BYTES if wl.logits_fp32 or dm.autocast or tune.torchtune_chunked(wl)
            else dm.e)


def head_terms(spec: ModelSpec, wl: Workload, dm: Dims) -> list[Term]:
    """Final norm, the head weight's cast under autocast, log-softmax output of the
    vocab-parallel loss (unchunked), targets; with multi-token prediction each depth's
    terms beside its layer (``memplan.model.mtp.depth_terms``), its loss's as the head's."""
    loss = _loss_terms(spec, wl, dm)
    mtp = depth_terms(spec, wl, dm, [Term(f"mtp.{t.name}", t.size_bytes) for t in loss]
                      ) if wl.mtp_layers else []
    # a chunked loss's checkpoints do not keep the head weight's cast (autocast's cache holds
    # it to the forward's end: ``forward_extra_bytes``)
    casts = [] if wl.loss_checkpointed else weight_casts("head", head_weight(spec, dm), dm)
    final_norm = norm_terms("final_norm", spec, wl, dm)
    if in_loss(wl):
        # the final norm's output is freed with the loop's `pred`; _DecoderOutputGradient
        # BackProp saves the summed input gradient, ``.to(hidden_states.dtype)``: its bytes
        final_norm = [Term("loss.input_grad", t.size_bytes) if t.name == "final_norm.output"
                      else t for t in final_norm]
    return [*final_norm, *casts, *lora_terms(spec, dm), *softcap_terms(spec, wl, dm), *loss,
            *batch_terms(wl, dm), *(mtp * wl.mtp_layers)]


def head_adapted(spec: ModelSpec, dm: Dims) -> bool:
    """Whether the output projection carries a LoRA adapter (``--lora-targets output``)."""
    return dm.adapters is not None and dm.adapters.adapts(head_linear(spec, dm.tp))


def lora_terms(spec: ModelSpec, dm: Dims) -> list[Term]:
    """What the output projection's adapter saves (``linear.adapter_terms``: ``lora_A``'s
    input unless it is the final norm's output itself, the rank-r intermediate); none when
    not adapted. peft's ``Linear.forward`` (``peft/tuners/lora/layer.py``) on ``lm_head``,
    torchtune's ``LoRALinear.forward`` on ``output_proj`` (``apply_lora_to_output``)."""
    if not head_adapted(spec, dm):
        return []
    return lin.adapter_terms("head", [head_linear(spec, dm.tp)], dm)


def lora_forward_bytes(spec: ModelSpec, wl: Workload, dm: Dims) -> int:
    """At an adapted head's ``result + lora_B(lora_A(x)) * scaling``, beyond the head's saved
    terms: the model's final hidden state (unless saved), the base logits in the compute
    dtype and the adapter's two logits-sized tensors (``linear.adapter_forward_bytes``:
    ``lora_B``'s output and its scaled copy, then the promoted sum beside the scaled copy).
    With dropout, peft's ``x = self._cast_input_dtype(x, lora_A.weight.dtype)`` keeps the fp32
    cast of a lower-precision input alive as a local beside the saved dropout output (traced:
    tests/traced/test_finetune.py). 0 when not adapted."""
    if not head_adapted(spec, dm):
        return 0
    head = head_linear(spec, dm.tp)
    rows = dm.linear_rows * spec.hidden_size
    hidden = 0 if norm.output_kept("final_norm", dm) else rows * dm.stream_e
    ad_b = dm.adapters.weight_bytes
    cast = rows * ad_b if dm.adapters.dropout > 0 and dm.stream_e < ad_b else 0
    return (hidden + cast + dm.tokens * dm.vocab_shard * dm.e
            + lin.adapter_forward_bytes(head, dm))


def lora_backward_bytes(spec: ModelSpec, dm: Dims) -> int:
    """At an adapted head's backward, beyond the final norm's saved terms: its adapter's saved
    terms (released with the loss's, alive until the adapter's backward) and the larger of
    the adapter's backward (run first: made later in forward), at ``* scaling``'s backward:
    the base's compute-dtype share of the logits' gradient, the promoted sum's gradient in the
    adapters' dtype (``.to``'s backward) and its scaled copy; and the base's, its input
    gradient beside the adapter's (waiting to be summed). 0 when not adapted."""
    if not head_adapted(spec, dm):
        return 0
    low = dm.adapters.weight_bytes if not dm.autocast else dm.e
    logits = dm.tokens * dm.vocab_shard
    grad_in = dm.rows * spec.hidden_size * dm.e
    adapter = logits * (dm.e + 2 * low)
    base = logits * dm.e + 2 * grad_in
    return total(lora_terms(spec, dm)) + max(adapter, base)


def titan_compiled(wl: Workload) -> bool:
    """torchtitan's unchunked cross-entropy compiled whole (module docstring;
    ``parallel.compile_loss_rule`` admits it without autocast; chunked, each chunk's is
    ``memplan.model.loss_in_call``'s)."""
    return (wl.compile_loss and wl.loss_impl is LossImpl.TORCHTITAN
            and not wl.loss_checkpointed)


def _titan_compiled_parallel(spec: ModelSpec, wl: Workload, dm: Dims) -> bool:
    """torchtitan's cross-entropy compiled on logits split over the vocabulary (module
    docstring: ``_LossParallelCrossEntropy`` in one graph)."""
    return titan_compiled(wl) and dm.vocab_shard < spec.vocab_size


def in_loss(wl: Workload) -> bool:
    """A chunked loss that runs each chunk's backward inside the loss call."""
    return wl.loss_checkpointed and wl.loss_chunk_backward is ChunkBackward.IN_LOSS


def _loss_terms(spec: ModelSpec, wl: Workload, dm: Dims) -> list[Term]:
    """The loss's saved terms: the log-softmax output (Megatron-LM's fp32 softmax) of the
    vocab-parallel loss, none when chunked; Megatron-LM's also saves the target mask and
    the shard's target indices; torchtune's chunked one is ``chunked_output.loss_terms``."""
    if tune.torchtune_chunked(wl):
        return tune.loss_terms(wl, dm)
    if _titan_compiled_parallel(spec, wl, dm):
        # loss parallel: the softmax less the one-hot targets (fp32), the out-of-shard mask
        return [Term("loss.softmax_grad", dm.tokens * dm.vocab_shard * FP32_BYTES),
                Term("loss.target_mask", dm.tokens * MASK_BYTES)]
    if titan_compiled(wl):  # the logits (the graph's input) and the row max and log-sum-exp
        return [Term("loss.logits", dm.tokens * dm.vocab_shard * dm.e),
                Term("loss.row_stats", 2 * dm.tokens * FP32_BYTES)]
    loss = [] if wl.loss_checkpointed else [
        Term("loss.softmax" if _megatron_loss(wl) else "loss.log_softmax",
             dm.tokens * dm.vocab_shard * (FP32_BYTES if _megatron_loss(wl)
                                           else logit_bytes(wl, dm)))]
    if _megatron_loss(wl):
        loss.append(Term("loss.target_mask", dm.tokens * (MASK_BYTES + INDEX_BYTES)))
    return loss


def softcap_terms(spec: ModelSpec, wl: Workload, dm: Dims) -> list[Term]:
    """Final-logit soft-capping (``final_logit_softcap``), as Gemma2ForCausalLM.forward runs
    it on the head's output before the loss: ``logits / cap``, ``tanh``, ``* cap``; tanh saves
    its output, logits-sized in the compute dtype (the divisions by a number save nothing).
    A chunked loss keeps it inside each chunk's checkpoint."""
    if spec.final_logit_softcap is None or wl.loss_checkpointed:
        return []
    return [Term("loss.softcap_tanh", dm.tokens * dm.vocab_shard * dm.e)]


def head_weight(spec: ModelSpec, dm: Dims) -> int:
    return dm.vocab_shard * spec.hidden_size


def head_linear(spec: ModelSpec, t: int) -> Linear:
    """The output projection h -> V on one rank of ``t`` that split the vocabulary
    (``ParallelConfig.vocab_divisor``): its shard of ceil(V / t) rows (``vocab_shard``, as
    ``model_states.count_stage_params`` counts it; Megatron-LM pads the vocabulary), declared
    whole on the rank (``Split.NONE``) so the ceiling is kept. No bias."""
    return Linear("head", "head", spec.hidden_size, vocab_shard(spec.vocab_size, t),
                  split=Split.NONE)


def loss_chunk_tokens(wl: Workload, dm: Dims) -> tuple[int, int]:
    """(tokens in the largest chunk, number of chunks) of the loss, as ``torch.chunk`` splits
    the micro-batch's tokens: chunks of ceil(T / n) tokens, the last one smaller (so fewer
    than n chunks when n does not divide T evenly enough). (T, 1) when unchunked."""
    if wl.loss_chunks == 1:
        return dm.tokens, 1
    size = ceil_div(dm.tokens, wl.loss_chunks)
    return size, ceil_div(dm.tokens, size)


def batch_terms(wl: Workload, dm: Dims) -> list[Term]:
    """The targets (saved by the loss) and the loss with nll_loss's saved total weight (two
    scalars in the logits' dtype): the training loop holds them until the backward ends. A
    chunked loss saves no total weight (its chunks are checkpointed): the loss alone;
    torchtune's chunked one is ``chunked_output.batch_terms``."""
    if tune.torchtune_chunked(wl):
        return tune.batch_terms(wl, dm)
    if titan_compiled(wl):  # the fp32 loss, and the count of labels the mean divides by
        # (saved by the partition as ``sum(labels != -100)`` converted to fp32)
        return [Term("loss.targets", dm.tokens * INDEX_BYTES),
                Term("loss.scalars", 2 * FP32_BYTES)]
    count = 1 if wl.loss_checkpointed else 2
    return [Term("loss.targets", dm.tokens * INDEX_BYTES),
            Term("loss.scalars", count * logit_bytes(wl, dm))]


def forward_extra_bytes(spec: ModelSpec, wl: Workload, dm: Dims) -> int:
    """Bytes alive at the loss beyond what is saved: the logits the log-softmax reads.

    With fp32 logits the compute-dtype logits are freed once upcast, and the fp32 copy lives
    until the loss returns, next to the log-softmax output. A chunked loss holds the logits
    and the log-softmax output of one chunk, both freed when the chunk returns its sum.
    """
    # a loss that runs its backward in the call is memplan.model.loss_in_call's
    assert not in_loss(wl), "loss_in_call.forward_extra_bytes counts an in-loss chunked loss"
    if tune.torchtune_chunked(wl):
        return tune.forward_extra_bytes(spec, wl, dm)
    if _titan_compiled_parallel(spec, wl, dm):
        # the logits (the graph's input, freed at its end), the fp32 log-probabilities, three
        # fp32 numbers per token and the fp32 loss
        return (dm.tokens * dm.vocab_shard * (dm.e + FP32_BYTES)
                + 3 * dm.tokens * FP32_BYTES + FP32_BYTES)
    if titan_compiled(wl):  # the kernels make the fp32 loss alone beside what is saved
        return FP32_BYTES
    # under autocast the head saves a cast of the final norm's fp32 output, which the model
    # still holds (its last hidden state; all-gathered under DTensor sequence parallelism)
    # while the loss runs
    if _megatron_loss(wl):
        # the model's compute-dtype logits beside the fp32 copy, which is the saved softmax
        return dm.tokens * dm.vocab_shard * dm.e
    held = 0
    # (a loop that computes the loss outside the model, litgpt's, holds no hidden state: the
    # model's forward returned the logits alone)
    # a frozen head (LoRA) saves no input at all: the held hidden state is alive alone
    # (under DeepSpeed's ZeRO-3 it is kept into backward, counted as saved: head_input_kept)
    frozen = dm.adapters is not None and not dm.head_input_kept
    if (dm.autocast or frozen) and wl.logits_held is not LogitsHeld.STEP:
        held = (head_weight(spec, dm) * dm.e if wl.loss_checkpointed and dm.autocast
                else dm.linear_rows * spec.hidden_size * dm.stream_e)
    if (wl.logits_held in (LogitsHeld.LOSS, LogitsHeld.OUTPUT) and not wl.loss_checkpointed
            and (wl.logits_fp32 or dm.autocast) and dm.e < FP32_BYTES):
        # the model's output keeps the compute-dtype logits while the loss reads its fp32 copy
        # (in fp32 the upcast is the tensor itself)
        held += dm.tokens * dm.vocab_shard * dm.e
    if _titan_parallel_loss(spec, wl, dm):
        # _LossParallelCrossEntropy.forward: ``shifted = logits_2d - local_max`` lives beside
        # the fp32 logits and the log-probabilities it makes
        held += dm.tokens * dm.vocab_shard * logit_bytes(wl, dm)
    return held + _logits_alive(wl, dm)


def _titan_parallel_loss(spec: ModelSpec, wl: Workload, dm: Dims) -> bool:
    """torchtitan's vocab-parallel cross-entropy (``LossImpl.TORCHTITAN`` on logits the TP
    ranks split over the vocabulary); a chunked loss is PyTorch's."""
    return (wl.loss_impl is LossImpl.TORCHTITAN and not wl.loss_checkpointed
            and dm.vocab_shard < spec.vocab_size)


def _megatron_loss(wl: Workload) -> bool:
    """Megatron-LM's in-place vocab-parallel cross-entropy (``LossImpl.MEGATRON``, or its
    fused form ``MEGATRON_FUSED``); a chunked loss is PyTorch's whatever the framework."""
    return (wl.loss_impl in (LossImpl.MEGATRON, LossImpl.MEGATRON_FUSED)
            and not wl.loss_checkpointed)


def _fused_gradient_copy(wl: Workload, dm: Dims) -> int:
    """The fp32 copy of the saved softmax that the compiled ``calculate_gradients`` of
    megatron/core/fusions/fused_cross_entropy.py (``LossImpl.MEGATRON_FUSED``) works on:
    torch.compile functionalizes ``grad_2d[arange_1d, masked_target_1d] -= softmax_update``
    into an out-of-place index_put on a fresh buffer, multiplies it by the loss's gradient
    into the compute-dtype result and writes it back into the softmax (its mutated input);
    the copy lives until the call returns, beside the softmax and the result (traced:
    tests/traced/test_megatron_loss.py, Inductor on CPU, the allocator's own events)."""
    if wl.loss_impl is not LossImpl.MEGATRON_FUSED or wl.loss_checkpointed:
        return 0
    return dm.tokens * dm.vocab_shard * FP32_BYTES


def step_held_bytes(wl: Workload, dm: Dims) -> int:
    """Logits a training loop keeps from its loss to the next forward's end: ``LogitsHeld.
    STEP`` the tensor the loss read, fp32 when upcast (Fabric converts the output);
    ``OUTPUT`` the model's output, the compute-dtype logits the loss upcast (transformers'
    ``ForCausalLMLoss`` upcasts its own copy)."""
    if wl.logits_held is LogitsHeld.OUTPUT:
        return dm.tokens * dm.vocab_shard * dm.e
    if wl.logits_held is not LogitsHeld.STEP:
        return 0
    return dm.tokens * dm.vocab_shard * logit_bytes(wl, dm)


def output_cache_bytes(spec: ModelSpec, wl: Workload, dm: Dims) -> int:
    """The key/value cache a held model output keeps (``LogitsHeld.OUTPUT`` with transformers'
    ``use_cache``, ``Workload.kv_cache``, which gradient checkpointing turns off): each
    layer's K and V in the compute dtype (``DynamicLayer.update`` concatenates them into new
    tensors, which attention then reads and SDPA saves): part of the saved activations until
    backward frees them, held by the output from then to the next model call's return."""
    if (wl.logits_held is not LogitsHeld.OUTPUT or not wl.kv_cache
            or wl.recompute is not Recompute.NONE):
        return 0
    if (spec.mamba is not None and spec.mamba.parallel_attention
            and wl.mamba_kernel is not MambaKernel.TORCH_EINSUM):
        return 0  # Falcon-H1 on transformers 5.3: no cache (memplan.model.layer.kv_cache_bytes)
    return spec.num_layers * 2 * dm.tokens * spec.kv_size // dm.tp * dm.e


def upcast_bytes(spec: ModelSpec, wl: Workload, dm: Dims) -> int:
    """When a training loop holds the previous step's logits (``LogitsHeld.STEP``), they are
    released only once the new ones are assigned, which Fabric's ``convert_output`` upcasts
    inside the model call: the compute-dtype logits and their fp32 copy, beside the held ones,
    the final norm's saved terms and the head weight's cast, before the loss starts (traced:
    litgpt bf16-true and bf16-mixed)."""
    if wl.logits_held is not LogitsHeld.STEP or wl.loss_checkpointed:
        return 0
    lb = logit_bytes(wl, dm)
    casts = weight_casts("head", head_weight(spec, dm), dm)
    return (total(norm_terms("final_norm", spec, wl, dm) + casts)
            + dm.tokens * dm.vocab_shard * (dm.e + lb if dm.e < lb else lb))


def _logits_alive(wl: Workload, dm: Dims) -> int:
    if wl.loss_checkpointed:
        return (2 * loss_chunk_tokens(wl, dm)[0] * dm.vocab_shard * logit_bytes(wl, dm)
                + _autocast_logits(wl, loss_chunk_tokens(wl, dm)[0], dm))
    return dm.tokens * dm.vocab_shard * logit_bytes(wl, dm) + _autocast_logits(wl, dm.tokens, dm)


def _autocast_logits(wl: Workload, tokens: int, dm: Dims) -> int:
    """Under autocast without the upcast, the low-precision logits beside the fp32 copy that
    ``log_softmax(x, dtype=float32)`` converts them to first (``log_softmax`` in
    ``aten/src/ATen/native/SoftMax.cpp``; CUDA skips the copy only for fp16 input, which the
    CPU trace cannot follow: amp-fp16 without the upcast is an overestimate by this copy)."""
    if not dm.autocast or wl.logits_fp32:
        return 0
    return tokens * dm.vocab_shard * dm.e


def linear_backward_bytes(spec: ModelSpec, wl: Workload, dm: Dims, vocab_grad_bytes: int) -> int:
    """At the output projection's backward: the logits' gradient in the compute dtype (after
    the fp32 upcast's backward), the gradient of its input and the head's weight gradient
    (``vocab_grad_bytes``, as produced in the compute dtype), beyond what is saved.

    A chunked loss runs one projection backward per chunk, last chunk first. Autograd sums
    the chunks' weight gradients in the buffer of the weight's gradient node, each into a new
    tensor: from the second chunk run on, three weight-gradient-sized tensors exist at once
    (the buffer, the chunk's gradient, their sum). It keeps the chunks' input gradients
    until the split's backward concatenates them; the last chunk run frees the final norm's
    output (nothing else saves it) once its projection's backward is done. So the worst is
    the last chunk's weight gradient made, with its logits' gradient not yet freed and all
    input gradients beside it, or the three-way sum of the chunk run before it, beside the
    input gradients made so far (traced: tests/traced/test_ground_truth.py, ``loss_chunks``)."""
    if in_loss(wl):  # run inside the loss call (``memplan.model.loss_in_call``)
        return 0
    if tune.torchtune_chunked(wl):
        return tune.linear_backward_bytes(spec, wl, dm, vocab_grad_bytes)
    chunk, chunks = loss_chunk_tokens(wl, dm)
    grad_logits = chunk * dm.vocab_shard * dm.e
    if not wl.loss_checkpointed:
        # with fp32 logits, the upcast's fp32 gradient has replaced the fp32 logits (both
        # freed by now); without, nothing is upcast: the compute-dtype logits gradient
        grad_input = dm.rows * spec.hidden_size * dm.e
        return grad_logits + grad_input + vocab_grad_bytes
    grad_input = _chunk_input_grads(spec, dm)
    summed = vocab_grad_bytes if chunks > 1 else 0  # the earlier chunks' sum, in the buffer
    # under autocast the chunk's own input gradient is still in the compute dtype, beside the
    # rerun's casts of the weight and of its input
    current = (chunk * spec.hidden_size * (dm.stream_e - dm.e)
               if dm.autocast and dm.linear_rows == dm.tokens else 0)
    last_made = (grad_input - current + summed + vocab_grad_bytes + grad_logits
                 + _rerun_casts(spec, wl, dm))
    # the sum before the last chunk run's: the input gradients of all chunks but the first
    before_last = grad_input - grad_input * chunk // dm.tokens if chunks > 2 else 0
    return max(last_made, before_last + 3 * summed)


def loss_backward_bytes(spec: ModelSpec, wl: Workload, dm: Dims, vocab_grad_bytes: int) -> int:
    """Bytes alive in the loss's backward beyond what is saved: the incoming gradient of the
    log-softmax output and the gradient it produces, both logits-sized.

    A chunked loss recomputes a chunk's log-softmax output (its fp32 logits are freed right
    after: nothing saves them), then holds it with those two gradients. Its last chunk run is
    the worst: the other chunks' input gradients and their summed weight gradient
    (``vocab_grad_bytes``) wait beside it (``linear_backward_bytes``)."""
    if in_loss(wl):  # the saved input gradient is handed on: nothing new
        return 0
    if tune.torchtune_chunked(wl):
        return tune.loss_backward_bytes(spec, wl, dm, vocab_grad_bytes)
    if titan_compiled(wl):  # one kernel makes the logits' gradient in the compute dtype
        return dm.tokens * dm.vocab_shard * dm.e
    chunk, chunks = loss_chunk_tokens(wl, dm)
    if _megatron_loss(wl):
        # the gradient is the softmax buffer updated in place; its cast to the compute dtype
        # is made while that fp32 buffer still exists (compiled: beside a copy of it)
        return dm.tokens * dm.vocab_shard * dm.e + _fused_gradient_copy(wl, dm)
    if not wl.loss_checkpointed:
        logits = dm.tokens * dm.vocab_shard * logit_bytes(wl, dm)
        if 0 < wl.loss_split < dm.tokens:
            # split without checkpointing: each piece's backward frees its saved log-softmax
            # output, then the split's backward concatenates the pieces' gradients into a
            # new logits-sized one: both beside the rest once every piece is done
            return logits
        if _titan_parallel_loss(spec, wl, dm):
            # _LossParallelCrossEntropy.backward: zeros_like(log_probs), exp(log_probs) and
            # their sum (then the product, with the sum and the zeros still alive)
            return 3 * logits
        return 2 * logits
    logits = chunk * dm.vocab_shard * logit_bytes(wl, dm)
    grad_input = _chunk_input_grads(spec, dm)
    others = grad_input - grad_input * chunk // dm.tokens
    return (3 * logits + (others + vocab_grad_bytes if chunks > 1 else 0)
            + _rerun_casts(spec, wl, dm))


def _rerun_casts(spec: ModelSpec, wl: Workload, dm: Dims) -> int:
    """Under autocast, a chunk's rerun in backward casts the head weight and the chunk's input
    again (its forward's casts were not kept); both live until its projection's backward is
    done. The chunks' weight gradients still meet in the compute dtype, at the one cast node
    of the forward, whose cached cast every chunk read."""
    if not dm.autocast or not wl.loss_checkpointed:
        return 0
    return (head_weight(spec, dm) + loss_chunk_tokens(wl, dm)[0] * spec.hidden_size) * dm.e


def final_norm_hook(spec: ModelSpec, dm: Dims, saved_at_backward: int) -> int:
    """Bytes of the final norm at its weight's gradient hook: transformers' RMSNorm ends in
    ``weight * hidden.to(input_dtype)``, whose backward node runs first and makes the
    gradient of the normalised input (rows x h) and the weight's (one per weight element),
    both in the input's dtype (the weight's too: bf16 weights, or fp32 under autocast); the
    weight's ``AccumulateGrad`` (and the hooks on it) runs next, the node's incoming gradient
    and its saved normalised input freed, what the rest of the norm's backward reads
    (``saved_at_backward``) still saved (traced under DeepSpeed ZeRO-2, tests/traced/
    test_deepspeed_trace.py)."""
    return (saved_at_backward + dm.rows * spec.hidden_size * dm.stream_e
            + norm_params(spec) * dm.stream_e)


def _chunk_input_grads(spec: ModelSpec, dm: Dims) -> int:
    """The chunks' input gradients of a chunked loss together: each chunk's projection takes
    rows of the final norm's output as the head sees it (all-gathered under DTensor sequence
    parallelism, where the split's backward runs before the gradient is scattered back)."""
    return dm.linear_rows * spec.hidden_size * dm.stream_e


class HeadBlock(NamedTuple):
    """The last stage's final norm, head projection and loss for one micro-batch on one rank,
    in bytes, and the moments it emits (``memplan.model.moments``); all 0 on other stages."""

    forward_saved: int = 0  # the final norm's and the loss's saved terms but the targets
    final_norm_forward: int = 0  # the final norm's forward: its saved terms and transient
    loss_forward: int = 0  # the loss's forward, beyond what is saved
    lora_forward: int = 0  # an adapted head's adapter sum (``lora_forward_bytes``), all in
    upcast: int = 0  # the final norm's saved terms and new logits beside held ones
    #                  (``upcast_bytes``)
    saved_bytes: int = 0  # the final norm's and the loss's saved terms (batch excluded)
    loss: int = 0  # in the loss's backward, beyond what is saved
    linear: int = 0  # at the head projection's backward: logits grad in the compute dtype,
    #                  input grad and the head's weight grad
    main_grads: int = 0  # fp32 main gradients: at the head's fp32 copy, beyond what is saved
    #                      below the final norm (its saved tensors but the output, the input
    #                      gradient, the compute-dtype and fp32 weight gradients)
    grads: int = 0  # the final norm's and head's gradients as held
    final_norm_saved: int = 0  # what of the final norm is saved when its backward runs
    final_norm_bwd: int = 0  # gradients in flight inside the final norm's backward
    final_norm_all: int = 0  # all the final norm saves (alive at the head's backward)
    final_norm_hook: int = 0  # at its weight's gradient hook: what it still saves, its
    #                           input-side gradient and its weight's (``final_norm_hook``)
    tied_grad: int = 0  # a tied head's weight gradient, held until the embedding's backward
    deferred: int = 0  # the input and logits' gradient kept for a deferred weight gradient
    #                    from the head's backward to the step's end (``memplan.model.
    #                    deferred_wgrad``)
    loss_made: int = 0  # of ``grads``, those made inside the loss call (``in_loss``)
    loss_held: int = 0  # what the loss call's reduce leaves held (the data-parallel
    #                     mechanism's reduce-scatter input) until the final norm's unit
    #                     reduces after its backward
    regather: int = 0  # the head's unit's all-gather output where the loss call resharded
    #                    the unit and the backward gathers it again at its start, beside the
    #                    unsharded weights it is copied into (``DataParallel.head_regather``)
    held_logits: int = 0  # logits the training loop keeps from the loss to the next step's
    #                       loss (``LogitsHeld.STEP``, ``step_held_bytes``)
    held_past_loss: bool = False  # ... to the end of the next step's loss, which runs in the
    #                               model call whose output replaces them (``LogitsHeld.OUTPUT``)
    held_cache: int = 0  # ... and the output's key/value cache, which is what attention saved
    #                      (``output_cache_bytes``): held beyond the graph once backward is done
    embeds_held: int = 0  # the embedding's output the model's forward keeps until it returns,
    #                       after the final norm (``memplan.model.stage.embeds_held_bytes``)
    embeds_copy: bool = False  # that output is no layer's input: alive beside the first
    #                            layer too (``ModelSpec.embeds_scaled_copy``)
    mask_released: int = 0  # the attention masks, the model's forward's locals too: alive
    #                         from the stage's start, freed when it returns (``stage._walk``)
    pipe_output: int = 0  # the last pipeline stage's output (its logits) torch's pipelining
    #                       holds through the micro-batch's backward, not saved by the loss
    #                       (``memplan.model.pipeline_buffers``, ``StageBuffers.output``)
    pipe_previous: int = 0  # ... the previous micro-batch's, alive at a forward until this
    #                         one's output replaces it, before the loss

    @classmethod
    def of(cls, spec: ModelSpec, wl: Workload, dm: Dims,
           saved_terms: list[Term] | None = None, loss_extra: int | None = None) -> HeadBlock:
        """The head of one micro-batch on one rank of a last stage, read from its ``Block``
        interface (``saved``, or ``saved_terms`` where the caller has them; the moments of
        ``forward_moments`` and ``backward_moments``): what every last stage of an estimate
        shares. Its gradients are the stage's (``on_stage``). The batch (targets, loss
        scalars) is the training loop's, not counted in ``saved_bytes``; the loop's held
        logits are ``step_held_bytes``."""
        block = cls()
        saved = total(saved_terms if saved_terms is not None
                      else block.saved(spec, wl, dm, Recompute.NONE))
        final = norm.final_saved_bytes(spec, wl, dm)
        # a loss that runs its backward in the call counts its own (``loss_in_call``)
        extra = forward_extra_bytes(spec, wl, dm) if loss_extra is None else loss_extra
        final_norm, *lora, loss_fwd = block._forward_moments(spec, wl, dm, saved, final,
                                                             extra)
        loss, linear, final_norm_bwd = block._backward_moments(spec, wl, dm, saved, final)
        batch = batch_terms(wl, dm)
        return cls(forward_saved=saved - batch[0].size_bytes,
                   final_norm_forward=final_norm.own_bytes + final_norm.transient_bytes,
                   lora_forward=sum(m.own_bytes + m.transient_bytes for m in lora),
                   loss_forward=loss_fwd.transient_bytes, upcast=upcast_bytes(spec, wl, dm),
                   saved_bytes=saved - total(batch), loss=loss.transient_bytes,
                   linear=linear.transient_bytes, final_norm_saved=final_norm_bwd.own_bytes,
                   final_norm_bwd=final_norm_bwd.transient_bytes,
                   final_norm_all=linear.own_bytes,
                   final_norm_hook=final_norm_hook(spec, dm, final_norm_bwd.own_bytes),
                   held_logits=step_held_bytes(wl, dm),
                   held_past_loss=wl.logits_held is LogitsHeld.OUTPUT,
                   held_cache=output_cache_bytes(spec, wl, dm))

    def on_stage(self, grads: int, vocab_grad: int, main_grads: bool,
                 tied_grad: int) -> HeadBlock:
        """This head on a stage whose final norm and head hold ``grads`` bytes of gradients.
        With fp32 main gradients (``main_grads``) the head's compute-dtype weight gradient
        (``vocab_grad``) is accumulated into a new fp32 one (first micro-batch) while it
        still exists, after the head's backward freed the logits gradient and its saved input
        (the final norm's output): the final norm's saved bytes (its saved tensors but its
        output, plus the input gradient of the same size), both weight gradients. A tied
        head's gradient (``tied_grad``) waits for the embedding's backward."""
        main = self.final_norm_all + vocab_grad + grads if main_grads else 0
        return self._replace(grads=grads, main_grads=main, tied_grad=tied_grad)

    # --- the ``Block`` interface (``memplan.model.block``): what the fields above are made
    # from, per micro-batch on one rank of the last stage, in bytes (``t``: the ranks that
    # split the vocabulary, ``ParallelConfig.vocab_divisor``; ``ep`` has no meaning here) ---

    name = "head"  # the final norm, the output projection and the loss

    def saved(self, spec: ModelSpec, wl: Workload, dm: Dims,
              recompute: Recompute) -> list[Term]:
        """``head_terms``: the final norm's, the weight cast's, the soft-cap's and the loss's
        (log-softmax, or none with a chunked loss) saved terms and the batch's targets and
        scalars. ``recompute`` applies to layers only: the head is never checkpointed by it
        (a chunked loss checkpoints its own chunks, ``Workload.loss_chunks``)."""
        return head_terms(spec, wl, dm)

    def forward_moments(self, spec: ModelSpec, wl: Workload, dm: Dims,
                        recompute: Recompute) -> list[Moment]:
        """The final norm (its saved terms, its transient ``norm.final_forward_transient``),
        then the loss (all the head saves, beyond it ``forward_extra_bytes``)."""
        return self._forward_moments(spec, wl, dm, total(self.saved(spec, wl, dm, recompute)),
                                     norm.final_saved_bytes(spec, wl, dm),
                                     forward_extra_bytes(spec, wl, dm))

    def _forward_moments(self, spec: ModelSpec, wl: Workload, dm: Dims, saved: int,
                         final: tuple[int, int], loss_extra: int) -> list[Moment]:
        """``forward_moments`` from the head's saved bytes, ``norm.final_saved_bytes`` and the
        loss's bytes beyond what is saved."""
        lora = ([Moment("head_lora", final[0] + total(lora_terms(spec, dm)),
                        lora_forward_bytes(spec, wl, dm))] if head_adapted(spec, dm) else [])
        return [Moment("final_norm", final[0], norm.final_forward_transient(spec, wl, dm)),
                *lora, Moment("loss", saved, loss_extra)]

    def working_set(self, spec: ModelSpec, wl: Workload, dm: Dims) -> list[Moment]:
        """None: the head is never inside a checkpointed layer (its chunked loss's reruns are
        counted in ``forward_extra_bytes`` and ``loss_backward_bytes``)."""
        return []

    def backward_moments(self, spec: ModelSpec, wl: Workload, dm: Dims,
                         recompute: Recompute) -> list[BackwardMoment]:
        """The loss (all saved alive, ``loss_backward_bytes``), the output projection (the
        final norm's saved terms, ``linear_backward_bytes``; its weight gradient just made in
        the compute dtype), the final norm (what it still saves, ``final_backward_bytes``).
        The head's weight gradient is counted as made in the compute dtype, as the stage's
        terms count it (``stage_terms``); a tied head's is the embedding's group."""
        return self._backward_moments(spec, wl, dm, total(self.saved(spec, wl, dm, recompute)),
                                      norm.final_saved_bytes(spec, wl, dm))

    def _backward_moments(self, spec: ModelSpec, wl: Workload, dm: Dims, saved: int,
                          final: tuple[int, int]) -> list[BackwardMoment]:
        """``backward_moments`` from the head's saved bytes and ``norm.final_saved_bytes``."""
        fresh = head_weight(spec, dm)  # elements of the weight whose gradient is made
        # a frozen head (LoRA's base) makes no weight gradient: autograd's mm backward makes
        # only what requires grad (``derivatives.yaml``: mat2's gradient when it does)
        grad = 0 if dm.adapters is not None else fresh * dm.e
        final_norm, norm_at_backward = final
        # an adapted head's base weight is frozen: no gradient; its adapter's backward and the
        # base's input gradient (``lora_backward_bytes``)
        head_bwd = (lora_backward_bytes(spec, dm) if head_adapted(spec, dm)
                    else linear_backward_bytes(spec, wl, dm, grad))
        return [BackwardMoment("loss", saved, loss_backward_bytes(spec, wl, dm, grad)),
                BackwardMoment("head", final_norm, head_bwd, ("head",), fresh),
                BackwardMoment("final_norm", norm_at_backward,
                               norm.final_backward_bytes(spec, wl, dm), ("head", "final_norm"))]

    def rebuild_moments(self, spec: ModelSpec, wl: Workload, dm: Dims) -> list[Moment]:
        """None: nothing of the head is rebuilt by layer recompute (see ``working_set``)."""
        return []

    def tensor_sizes(self, spec: ModelSpec, t: int, ep: int) -> list[int]:
        """The final norm's weight (and bias), then the output projection's shard (none when
        tied: the embedding's weight; a pipeline's last stage holds a copy of it, which
        ``model_states.count_stage_params`` adds)."""
        proj = [] if spec.tied_embeddings else lin.tensor_sizes(head_linear(spec, t), t)
        return [spec.hidden_size] * (2 if spec.norm_bias else 1) + proj

    def tensor_shapes(self, spec: ModelSpec, t: int, ep: int) -> list[tuple[int, ...]]:
        proj = [] if spec.tied_embeddings else lin.tensor_shapes(head_linear(spec, t), t)
        return [(spec.hidden_size,)] * (2 if spec.norm_bias else 1) + proj

    def grad_groups(self, spec: ModelSpec, t: int, ep: int) -> dict[str, int]:
        """The output projection's gradient first (0 when tied), then the final norm's."""
        proj = [] if spec.tied_embeddings else [head_linear(spec, t)]
        return lin.grad_groups(proj, t, ("head", "final_norm"),
                                  {"final_norm": norm_params(spec)})

    def flops_per_token(self, spec: ModelSpec, seq_len: int) -> float:
        """The projection's 2*h*V (whole vocabulary: ``linear.flops_per_token``, the head term
        of ``planning.timing``, tied or not) and the final norm's 2 per parameter, as a layer's
        norms count (``Norm.flops_per_token``; the step-time model leaves the final norm's
        out)."""
        return (lin.flops_per_token([head_linear(spec, 1)])
                + norm.Norm("final_norm").flops_per_token(spec, seq_len))

    def forward_segment(self, at: int, steady: bool) -> Segment:
        """The final norm, the logits a loop held from the previous step freed (``steady``:
        from step 2 on), then the loss, beside ``at`` gathered bytes; after it the loop keeps
        the loss's logits (``held_logits``)."""
        released = Event("loop.logits_released", self.pipe_previous
                         - self.previous_logits(steady), None)
        return Segment((Event("final_norm.forward", 0, self.final_norm_forward + at),
                        *((Event("loop.inputs_embeds_released", -self.embeds_held, None),)
                          if self.embeds_held else ()),
                        *((Event("loop.mask_released", -self.mask_released, None),)
                          if self.mask_released else ()),
                        *((Event("head.lora_forward", 0, self.lora_forward + at),)
                          if self.lora_forward else ()),
                        *((Event("pipeline.output_released", -self.pipe_previous, None),)
                          if self.pipe_previous else ()),
                        Event("loss.upcast", 0, self.upcast + at),
                        *(() if self.held_past_loss else (released,)),
                        Event("loss.forward", 0, self.forward_saved + self.loss_forward + at),
                        *((released,) if self.held_past_loss else ()),
                        Event("loop.logits_kept", self.held_logits, None)))

    def previous_logits(self, steady: bool) -> int:
        """The logits (and a held output's cache) the loop still holds from the previous step
        when a forward starts: from step 2 on (``steady``), until the loss replaces them; and
        a pipeline's previous output (``pipe_previous``, in every step), until this one's is
        made."""
        return (self.held_logits + self.held_cache if steady else 0) + self.pipe_previous

    def backward_held(self) -> int:
        """Logits alive beyond what the graph saves through a micro-batch's backward: the
        loop's (``loop_logits``) and a pipeline's output (``pipe_output``)."""
        return self.held_logits + self.pipe_output

    def step_logits(self) -> Event:
        """What the loop keeps alive through the optimizer step: the logits, and a held
        output's key/value cache, no longer saved by the graph."""
        return Event("loop.logits", self.step_logits_bytes(), None)

    def step_logits_bytes(self) -> int:
        """``step_logits``' bytes."""
        return self.held_logits + self.held_cache

    def loop_logits(self) -> Event:
        """The logits the loop keeps alive from the loss through the backward and the
        optimizer step (``held_logits``)."""
        return Event("loop.logits", self.held_logits, None)

    def backward_events(self, at_loss: int, at: int, beside: int,
                        growing: bool, at_hook: int = 0,
                        at_norm: int | None = None) -> tuple[Event, ...]:
        """The loss beside ``at_loss`` gathered bytes, then the head projection, its fp32
        main gradient and the final norm beside ``at`` (the final norm beside ``at_norm``
        where given; and ``beside`` at the final norm's backward, ``at_hook`` at its weight's
        gradient hook: ``final_norm_hook``); ``growing``: its gradients are new (else
        accumulated into existing ones)."""
        if not any(self):  # no head on this stage: only what is gathered at its loss
            return (Event("loss.backward", 0, at),)
        # gradients the loss call made (new ones held from it on) and what its reduce holds
        made = self.loss_made if growing else 0
        # the head's unit gathered again (the loss call resharded it): its copy-out, beside
        # everything the loss call left
        regather = ((Event("head.regather", 0, at_loss + self.regather),) if self.regather
                    else ())
        events = (Event("loss.made", made + self.loss_held, None), *regather,
                  Event("loss.backward", -self.saved_bytes, at_loss + self.loss),
                  Event("head.backward", 0, at + self.final_norm_all + self.linear),
                  # a deferred weight gradient's input and logits' gradient stay
                  *((Event("head.deferred_wgrad", self.deferred, None),) if self.deferred
                    else ()),
                  # the head's weight gradient exists; a tied head's waits for the embedding's
                  Event("head.main_grads", (self.grads if growing else 0) - made
                        + self.tied_grad, at + self.main_grads))
        released = (Event("loss.released", -self.loss_held, None),) if self.loss_held else ()
        if not self.final_norm_bwd:
            return (*events, *released)
        # the final norm's own gradient comes after the head's; its weight's hook runs
        # after the first node of its backward, before the rest of it
        norm_at = at if at_norm is None else at_norm
        hook = ((Event("final_norm.hook", 0, self.final_norm_hook + at_hook + norm_at),)
                if at_hook else ())
        return (*events, *hook, Event("final_norm.backward", 0,
                                      self.final_norm_saved + self.final_norm_bwd + beside
                                      + norm_at),
                *released)

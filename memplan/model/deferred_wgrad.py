"""The output layer's weight gradient deferred to the step's end (``Workload.
head_wgrad_deferral``: Megatron-LM's ``--defer-embedding-wgrad-compute`` with
``--wgrad-deferral-limit``): what the last pipeline stage keeps across micro-batches, for one
rank, in bytes.

What megatron-core 0.16 does (the output layer is a ``ColumnParallelLinear`` built by
``models/gpt/gpt_model.py GPTModel.__init__`` with two lists, ``embedding_activation_buffer``
and ``grad_output_buffer``):

- forward (``tensor_parallel/layers.py ColumnParallelLinear.forward``): while the list holds
  fewer than the limit (0: no limit), the layer's input is appended to
  ``embedding_activation_buffer``: ``input_parallel``, the final norm's output as the layer
  reads it (the sequence shard [s/tp, b, h] under sequence parallelism, else [s, b, h]; the
  same tensor autograd saves, so it costs nothing until the backward would have freed it);
- backward (``LinearWithGradAccumulationAndAsyncCommunication.backward``): while
  ``grad_output_buffer`` holds fewer than the limit, the incoming gradient (the logits'
  [s, b, V/tp] in the compute dtype) is appended and no weight gradient is computed (only the
  input gradient); the other micro-batches compute theirs as usual;
- after the last micro-batch's backward (``pipeline_parallel/schedules.py
  finish_embedding_wgrad_compute``, before ``finalize_model_grads``), ``utils.py
  drain_embedding_wgrad_compute`` pops the pairs in order and accumulates each weight gradient
  into ``main_grad`` in place (``wgrad_gemm_accum_fp32``: gradient-accumulation fusion, which
  ``ModelParallelConfig.__post_init__`` requires, as it requires pipeline parallelism). Under
  sequence parallelism it all-gathers each input into one of two buffers of the global memory
  buffer (``get_tensor(..., "mpu_0")`` / ``"mpu_1"``: [s, b, h] each), which the buffer keeps
  for the rest of training (``utils.py GlobalMemoryBuffer.get_tensor`` caches by name).

So the pairs of the first ``min(m, limit)`` micro-batches (all ``m`` with limit 0) accumulate
on the last stage through the step's forwards and backwards and are freed by the drain.
"""

from __future__ import annotations

from typing import NamedTuple

from memplan.model.dims import Dims
from memplan.spec import ModelSpec
from memplan.workload import Workload


class Deferred(NamedTuple):
    """The deferred pairs around the last micro-batch of a step on the last stage, one rank,
    in bytes (all 0 without deferral)."""

    pair: int = 0  # one micro-batch's kept input and logits' gradient
    own: int = 0  # the last micro-batch's own pair, kept from its head's backward on
    before_forward: int = 0  # earlier pairs alive at the last micro-batch's forward
    before_backward: int = 0  # earlier pairs alive at its backward
    drain: int = 0  # at the drain's first weight-gradient GEMM: what is left of the pairs
    #                 and the gathered buffers
    resident: int = 0  # the drain's gathered buffers, kept from the first step's drain on
    weight_grad: int = 0  # the head's compute-dtype weight gradient a deferred micro-batch
    #                       does not make


NO_DEFERRAL = Deferred()  # (a tuple: one for every stage and estimate without deferral)


def pair_bytes(spec: ModelSpec, dm: Dims) -> tuple[int, int]:
    """(the kept input, the kept logits' gradient) of one micro-batch on one rank: the final
    norm's output as the output layer reads it (``dm.stream``: T/tp rows under sequence
    parallelism, else T, in the residual stream's dtype) and the logits' gradient, T x
    ceil(V/tp) in the compute dtype (``dm.vocab_shard``)."""
    return dm.stream(spec.hidden_size), dm.tokens * dm.vocab_shard * dm.e


def deferred(spec: ModelSpec, wl: Workload, dm: Dims, m: int, in_flight: int) -> Deferred:
    """What the deferral keeps on the last stage with ``m`` micro-batches per step, of which
    ``in_flight`` (this one included) are between their forward and backward on the stage's
    last model chunk when the last one runs its forward.

    n = min(m, limit) micro-batches (m with limit 0) defer theirs. At the last micro-batch's
    backward the m - 1 before it have run theirs: min(m - 1, n) pairs; at its forward only
    m - in_flight of them. It keeps its own pair when it is one of the n (n = m). At the drain
    (``drain_embedding_wgrad_compute``) all n pairs, less, under sequence parallelism, the
    first input (freed once gathered) plus the gathered buffers: one with a single pair (the
    loop does not run), two from two pairs on (the next input gathered while the GEMM reads
    the other); without it the inputs are read as they are."""
    limit = wl.head_wgrad_deferral
    if limit is None:
        return NO_DEFERRAL
    n = m if limit == 0 else min(m, limit)
    kept_input, grad_output = pair_bytes(spec, dm)
    pair = kept_input + grad_output
    gathered = 0
    if dm.res_tokens_div > 1:  # sequence parallel: the inputs are sequence shards
        gathered = min(n, 2) * dm.tokens * spec.hidden_size * dm.stream_e
    drain = n * pair - (kept_input if gathered else 0) + gathered
    return Deferred(pair=pair, own=pair if n == m else 0,
                    before_forward=min(max(m - in_flight, 0), n) * pair,
                    before_backward=min(m - 1, n) * pair, drain=drain, resident=gathered,
                    weight_grad=dm.vocab_shard * spec.hidden_size * dm.e if n == m else 0)


__all__ = ["Deferred", "deferred", "pair_bytes"]

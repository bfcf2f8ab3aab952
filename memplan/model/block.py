"""The interface every block of a layer exposes, and the moments it reports.

A block (a norm, an attention, an MLP, an MoE feed-forward; outside the layers the head,
``memplan.model.head.HeadBlock``, and the embedding, ``memplan.model.embedding.
EmbeddingBlock``) says, for one micro-batch on one rank, in bytes:

- ``saved``: the tensors autograd keeps from its forward for its backward (``Term``s);
- ``forward_moments``: its local peaks while it runs forward and saves, as (its own saved bytes
  so far, transients beyond them);
- ``working_set``: its local peaks while it runs inside a checkpointed (fully recomputed)
  layer's forward, which saves nothing: bytes beyond what the layer holds before it;
- ``backward_moments``: its local peaks in backward, as (its own saved bytes still alive,
  gradients in flight, which of its parameter groups have gradients by then);
- ``tensor_sizes`` and ``grad_groups``: its parameter tensors on one TP/EP rank, in
  registration order, and the parameter groups whose gradients appear during its backward;
- ``flops_per_token``: the forward FLOPs of one token through it.

``memplan.model.layer`` adds blocks in execution order, so what else is alive at a block's
moment (the saved bytes of the blocks before it, the gradients of the blocks after it) is a
running sum there, never written out by hand.
"""

from __future__ import annotations

from typing import NamedTuple, Protocol

from memplan.model.dims import Dims, Term
from memplan.spec import ModelSpec
from memplan.workload import Recompute, Workload


class Moment(NamedTuple):
    """A local peak of one block: ``own_bytes`` of its saved (or rebuilt) tensors alive, and
    ``transient_bytes`` beyond them (outputs before a residual add, gradients in flight)."""

    name: str
    own_bytes: int
    transient_bytes: int


class BackwardMoment(NamedTuple):
    """A local peak of one block's backward (``Moment``), with ``grads`` the names of its own
    parameter groups whose gradients exist by then (``Block.grad_groups``) and
    ``fresh_params`` the parameters of a weight whose gradient was just made, still in the
    compute dtype (an fp32 main gradient is made from it after)."""

    name: str
    own_bytes: int
    transient_bytes: int
    grads: tuple[str, ...] = ()
    fresh_params: int = 0
    hook_freed: int = 0  # what the node that made the fresh gradient frees before that
    #                      weight's gradient hook runs: its saved input, of ``own_bytes``, or
    #                      its incoming gradient, of ``transient_bytes`` (the engine releases
    #                      a node's saved tensors and inputs once it has run, torch/csrc/
    #                      autograd/engine.cpp call_function, before the weight's
    #                      AccumulateGrad); 0 where not modelled
    rerun_freed: int = 0  # of ``own_bytes``, what a fully recomputed layer has freed by
    #                       then: the rerun's tensors a node unpacked, which the checkpoint
    #                       drops then (torch/utils/checkpoint.py _checkpoint_hook's
    #                       unpack_hook), where the saving forward keeps them to the end of
    #                       the node; 0 where not modelled


class Block(Protocol):
    """What a layer needs of each block (see the module docstring)."""

    name: str  # the parameter group of the whole block, and the prefix of its terms

    def saved(self, spec: ModelSpec, wl: Workload, dm: Dims,
              recompute: Recompute) -> list[Term]: ...

    def forward_moments(self, spec: ModelSpec, wl: Workload, dm: Dims,
                        recompute: Recompute) -> list[Moment]: ...

    def working_set(self, spec: ModelSpec, wl: Workload, dm: Dims) -> list[Moment]: ...

    def backward_moments(self, spec: ModelSpec, wl: Workload, dm: Dims,
                         recompute: Recompute) -> list[BackwardMoment]: ...

    def rebuild_moments(self, spec: ModelSpec, wl: Workload, dm: Dims) -> list[Moment]: ...

    def tensor_sizes(self, spec: ModelSpec, t: int, ep: int) -> list[int]: ...

    def tensor_shapes(self, spec: ModelSpec, t: int, ep: int) -> list[tuple[int, ...]]: ...

    def grad_groups(self, spec: ModelSpec, t: int, ep: int) -> dict[str, int]: ...

    def flops_per_token(self, spec: ModelSpec, seq_len: int) -> float: ...


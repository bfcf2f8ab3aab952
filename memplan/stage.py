"""One pipeline stage's layer kinds and states: what it holds at every micro-batch size.

Both are built once per layout and stage and shared by every micro-batch size (the states also
by every recompute policy): ``memory.estimate`` reads them for each configuration, and a search
evaluates many micro-batch sizes and policies of each layout.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from functools import lru_cache

from memplan.layers import first_positions, layer_keys, runs_of
from memplan.parallel import GradBuffers, ParallelConfig, ZeroStage
from memplan.pipeline import stage_layers
from memplan.spec import ModelSpec
from memplan.states import (
    ShardingBuffers,
    StageParams,
    StateBytes,
    optimizer_step_temp_bytes,
    sharding_buffers,
    stage_params,
    state_bytes,
)
from memplan.units import ceil_div
from memplan.workload import Recompute, Workload


@dataclass(frozen=True)
class StageKinds:
    """The kinds of one stage's layers (MoE or dense, recompute policy), in order."""

    keys: list[tuple[bool, Recompute]]
    positions: dict[tuple[bool, Recompute], int]  # each kind's first layer
    counts: dict[tuple[bool, Recompute], int]  # layers of each kind
    runs: list[tuple[tuple[bool, Recompute], int]]  # runs of identical layers, in order
    chunks: list[dict[tuple[bool, Recompute], int]]  # layers of each kind per model chunk


@dataclass(frozen=True)
class StageStates:
    """What one stage holds whatever the micro-batch and the recompute policy: parameters,
    states, gradient sizes and buffers."""

    first: bool
    last: bool
    sp: StageParams
    st: StateBytes
    grad_per_param: float
    opt_temp: int
    shard: ShardingBuffers
    vocab_grad: int  # the embedding's (and a tied head's) gradient in the compute dtype
    main_grads: bool  # fp32 main gradients beside the compute-dtype ones
    buckets: int  # DDP's persistent copy of the gradients
    persistent: bool  # gradients live in persistent data-parallel buffers

    @property
    def optimizer_phase(self) -> int:
        """Tensor bytes at the optimizer step: no activation is alive."""
        st = self.st
        return st.params_bytes + st.grads_bytes + st.optimizer_bytes + self.opt_temp + self.buckets


def stage_parts(spec: ModelSpec, par: ParallelConfig,
                wl: Workload) -> tuple[tuple[StageStates, StageKinds], ...]:
    """Every stage's states and layer kinds, in stage order: the same for every micro-batch size
    of ``wl`` (and the states for every recompute policy)."""
    return _parts_for(spec, par, _without(wl, False))


@lru_cache(maxsize=8192)
def _parts_for(spec: ModelSpec, par: ParallelConfig,
               wl: Workload) -> tuple[tuple[StageStates, StageKinds], ...]:
    states = _without(wl, True)
    return tuple((_states_for(spec, par, states, i), _kinds_for(spec, wl, par.pp, par.vpp, i))
                 for i in range(par.pp))


def optimizer_phase_bytes(spec: ModelSpec, par: ParallelConfig, wl: Workload) -> int:
    """Tensor bytes of the most loaded stage at its optimizer step, where no activation is
    alive: the same at every micro-batch size and recompute policy."""
    return _optimizer_phase(spec, par, _without(wl, True))


@lru_cache(maxsize=4096)
def _optimizer_phase(spec: ModelSpec, par: ParallelConfig, wl: Workload) -> int:
    return max(_states_for(spec, par, wl, i).optimizer_phase for i in range(par.pp))


@lru_cache(maxsize=4096)
def _without(wl: Workload, recompute: bool) -> Workload:
    """``wl`` with its batch sizes (and the recompute policy) at fixed values: the cache key of
    what does not depend on them."""
    if recompute:
        return canonical(wl, micro_batch_size=1, global_batch_size=None,
                         recompute=Recompute.NONE, recompute_layers=None)
    return canonical(wl, micro_batch_size=1, global_batch_size=None)


def canonical(wl: Workload, **fields: object) -> Workload:
    """``wl`` with ``fields`` replaced, one object for equal results (so caches keyed by it hit
    by identity, without comparing field by field)."""
    return _one(wl.model_copy(update=fields))


@lru_cache(maxsize=4096)
def _one(wl: Workload) -> Workload:
    return wl


@lru_cache(maxsize=4096)
def _kinds_for(spec: ModelSpec, wl: Workload, pp: int, vpp: int, stage: int) -> StageKinds:
    layers = [i for chunk in stage_layers(spec.num_layers, ParallelConfig(pp=pp, vpp=vpp), stage)
              for i in chunk]
    keys = layer_keys(spec, wl, layers)
    positions = first_positions(keys)
    counts = Counter(keys) if len(positions) > 1 else {keys[0]: len(keys)}
    per_chunk = len(keys) // vpp
    chunks = [Counter(keys[c * per_chunk:(c + 1) * per_chunk]) for c in range(vpp)]
    return StageKinds(keys=keys, positions=positions, counts=counts, runs=runs_of(keys),
                      chunks=chunks)


@lru_cache(maxsize=16384)
def _states_for(spec: ModelSpec, par: ParallelConfig, wl: Workload, stage: int) -> StageStates:
    first, last = stage == 0, stage == par.pp - 1
    all_layers = [i for chunk in stage_layers(spec.num_layers, par, stage) for i in chunk]
    sp = stage_params(spec, par, all_layers, first=first, last=last)
    st = state_bytes(sp, par, wl)
    e = wl.compute_dtype.itemsize
    # Gradients exist during forward when an earlier micro-batch made them, or when they live
    # in persistent data-parallel buffers; DDP's default copies them into separate buckets.
    ddp = par.data_parallel_buffers
    return StageStates(
        first=first, last=last, sp=sp, st=st, grad_per_param=st.grads_bytes / max(sp.total, 1),
        opt_temp=optimizer_step_temp_bytes(sp, st, par, wl), shard=sharding_buffers(sp, par, wl),
        vocab_grad=ceil_div(spec.vocab_size, par.vocab_divisor) * spec.hidden_size * e,
        main_grads=wl.precision.recipe.grad_bytes > e and par.zero < ZeroStage.PARAMETERS,
        buckets=st.grads_bytes if ddp and par.grad_buffers is GradBuffers.COPY else 0,
        persistent=ddp and par.grad_buffers is GradBuffers.VIEW,
    )

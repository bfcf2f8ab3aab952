"""Every cache of the analytic model, in one place, apart from the formulas.

The formulas (blocks, layer, states, stage terms, stage walk) are plain functions of typed
inputs; this module wraps them in caches for the inputs a search or a batch of estimates
repeats: a layer kind per (spec, workload, per-rank dims, kind), a stage's parameters and
states per layout, the per-micro-batch terms every stage of an estimate shares
(``memplan.model.stage_terms``). Keys are frozen inputs, so a cached result is the formula's
result for exactly those inputs. (Loading files once - the
model and GPU catalogs, calibration profiles - is cached where they are read.)
"""

from __future__ import annotations

from fractions import Fraction
from functools import lru_cache

from memplan.model.dims import Dims, exact_ratio
from memplan.model.dims import whole_bytes_each as _whole_bytes_each
from memplan.model.layer import grad_group_params
from memplan.model.layer import layer_kind as _layer_kind
from memplan.model.model_states import StageParams, count_stage_params, stage_param_totals
from memplan.model.moments import Segment, fold
from memplan.model.pipeline import Schedule, chunks_in_flight
from memplan.model.stage_parts import (
    LayerKey,
    StageKinds,
    StageStates,
    build_kinds,
    build_states,
    stage_layer_indices,
)
from memplan.model.stage_terms import StageTerms, stage_terms
from memplan.parallel import ExpertSplit, ParallelConfig, ZeroStage, pipeline_only
from memplan.spec import ModelSpec
from memplan.workload import Recompute, Workload

layer_kind = lru_cache(maxsize=4096)(_layer_kind)
grad_groups = lru_cache(maxsize=1024)(grad_group_params)


def whole_bytes_each(counts: tuple[int, ...], per_item: int | Fraction) -> tuple[int, ...]:
    """``dims.whole_bytes_each`` (a layer kind's gradient bytes at each of its moments: the
    same for every micro-batch size), kept per (counts, per_item): keyed by the ratio's numerator
    and denominator (a ``Fraction`` hashes in Python, an int pair in C)."""
    return _whole_bytes_each_by(counts, per_item.numerator, per_item.denominator)


@lru_cache(maxsize=8192)
def _whole_bytes_each_by(counts: tuple[int, ...], numerator: int,
                         denominator: int) -> tuple[int, ...]:
    return _whole_bytes_each(counts, exact_ratio(numerator, denominator))


@lru_cache(maxsize=8192)
def step_fold(step: Segment) -> tuple[int | None, int]:
    """``moments.fold`` of a stage's optimizer step from nothing alive (``StageStates.step``,
    ``first_step``): the same in every walk of the stage's states."""
    return fold([step])


@lru_cache(maxsize=4096)
def stage_params(spec: ModelSpec, t: int, ep: int, pp: int, layers: tuple[int, ...],
                 first: bool, last: bool, vocab_div: int, mtp: int = 0) -> StageParams:
    return count_stage_params(spec, t, ep, pp, layers, first, last, vocab_div, mtp)


def canonical(wl: Workload, **fields: object) -> Workload:
    """``wl`` with ``fields`` replaced, one object for equal results (so caches keyed by it hit
    by identity, without comparing field by field)."""
    return _one(wl.model_copy(update=fields))


@lru_cache(maxsize=4096)
def _one(wl: Workload) -> Workload:
    return wl


@lru_cache(maxsize=4096)
def _without(wl: Workload, recompute: bool) -> Workload:
    """``wl`` with its batch sizes (and the recompute policy) at fixed values, and without an
    op-level save list (the layer kinds and states read none of it: the per-kind terms do,
    ``_per_kind``): the cache key of what does not depend on them. Megatron's global
    buffer (``Workload.attention_global_buffer``), kept with the states' buffers, follows the
    micro-batch: its size is kept there."""
    mbs = wl.micro_batch_size if wl.attention_global_buffer else 1
    # DeepSpeed's ZeRO-3 coordinator replays the module trace, which a checkpoint's
    # recomputation changes (memplan.model.deepspeed_coordinator): its states keep the policy
    if recompute and not (wl.framework == "deepspeed" and wl.recompute is Recompute.FULL):
        return canonical(wl, micro_batch_size=mbs, global_batch_size=None,
                         recompute=Recompute.NONE, recompute_layers=None,
                         recompute_every=None, recompute_save=())
    return canonical(wl, micro_batch_size=mbs, global_batch_size=None, recompute_save=())


def stage_parts(spec: ModelSpec, par: ParallelConfig,
                wl: Workload) -> tuple[tuple[StageStates, StageKinds], ...]:
    """Every stage's states and layer kinds, in stage order: the same for every micro-batch size
    of ``wl`` (and the states for every recompute policy)."""
    return _parts_for(spec, par, _without(wl, False))


@lru_cache(maxsize=8192)
def _parts_for(spec: ModelSpec, par: ParallelConfig,
               wl: Workload) -> tuple[tuple[StageStates, StageKinds], ...]:
    return tuple(zip(_all_states(spec, par, _without(wl, True)),
                     _all_kinds(spec, wl, par.pp, par.vpp, par.stage_layers)))


def optimizer_phase_bytes(spec: ModelSpec, par: ParallelConfig, wl: Workload) -> int:
    """Tensor bytes of the most loaded stage at its optimizer step, where no activation is
    alive: the same at every micro-batch size and recompute policy."""
    return _optimizer_phase(spec, par, _without(wl, True))


@lru_cache(maxsize=4096)
def _optimizer_phase(spec: ModelSpec, par: ParallelConfig, wl: Workload) -> int:
    return max(states.optimizer_phase for states in _all_states(spec, par, wl))


@lru_cache(maxsize=4096)
def _all_kinds(spec: ModelSpec, wl: Workload, pp: int, vpp: int,
               split: tuple[int, ...] | None) -> tuple[StageKinds, ...]:
    """Every stage's layer kinds (one cache entry per layout, not per stage: the keys are
    hashed once)."""
    return tuple(build_kinds(spec, wl, pp, vpp, i, split) for i in range(pp))


@lru_cache(maxsize=4096)
def _all_states(spec: ModelSpec, par: ParallelConfig, wl: Workload) -> tuple[StageStates, ...]:
    """Every stage's states (interior stages with the same parameters share theirs)."""
    out = []
    seen: dict = {}
    for stage in range(par.pp):
        layers = stage_layer_indices(spec, par.pp, par.vpp, stage, par.stage_layers)
        params = stage_params(spec, par.tp, par.experts, par.pp, layers, stage == 0,
                              stage == par.pp - 1, par.vocab_divisor, wl.mtp_layers)
        interior = 0 < stage < par.pp - 1
        key = (params, len(layers)) if interior else None
        if key is not None and key in seen:
            out.append(seen[key]._replace(first=False, last=False))
            continue
        states = build_states(spec, par, wl, params, stage)
        if key is not None:
            seen[key] = states
        out.append(states)
    return tuple(out)


def fewest_stage_params(spec: ModelSpec, par: ParallelConfig, mtp_layers: int = 0) -> int:
    """The fewest parameters (before ZeRO sharding) any pipeline stage of ``par`` holds, as
    its ``stage_parts`` count them, without building its states."""
    return _fewest(spec, par.tp, par.experts, par.pp, par.vpp, par.stage_layers,
                   par.vocab_divisor, mtp_layers)


@lru_cache(maxsize=8192)
def _fewest(spec: ModelSpec, tp: int, experts: int | ExpertSplit, pp: int, vpp: int,
            split: tuple[int, ...] | None, vocab_div: int, mtp_layers: int) -> int:
    return min(sum(stage_param_totals(spec, tp, experts, pp,
                                      stage_layer_indices(spec, pp, vpp, stage, split),
                                      stage == 0, stage == pp - 1, vocab_div, mtp_layers)[:2])
               for stage in range(pp))


@lru_cache(maxsize=8192)
def in_flight(pp: int, vpp: int, m: int, stage: int, schedule: Schedule,
              group: int | None = None) -> tuple[int, ...]:
    """``chunks_in_flight``, which reads only pp, vpp and vpp_group (``group``) of the
    layout."""
    return tuple(chunks_in_flight(pipeline_only(pp, vpp, vpp_group=group), m, stage,
                                  schedule))


def shared_terms(spec: ModelSpec, wl: Workload, dm: Dims, ep: int | ExpertSplit,
                 parts: tuple[tuple[StageStates, StageKinds], ...]) -> StageTerms:
    """``stage_terms`` for every layer kind of ``parts`` (a layout's ``stage_parts``), built
    once per spec, per-kind workload (``_per_kind``), dims and set of kinds."""
    keys = frozenset(key for _, kinds in parts for key in kinds.counts)
    return _terms_for(spec, _per_kind(wl), dm, ep, keys)


@lru_cache(maxsize=1024)
def _per_kind(wl: Workload) -> Workload:
    """What the per-kind terms read of ``wl``: not the global batch, nor how many layers get
    full recompute (the stage's layer kinds say which policy each layer has)."""
    return canonical(wl, global_batch_size=None, recompute_layers=None,
                     recompute_every=None)


@lru_cache(maxsize=1024)
def _terms_for(spec: ModelSpec, wl: Workload, dm: Dims, ep: int | ExpertSplit,
               keys: frozenset[LayerKey]) -> StageTerms:
    return stage_terms(spec, wl, dm, ep, keys, layer_kind, grad_groups)


# ``stage.walk_core`` per its inputs, the stage's optimizer states aside: ZeRO 0 and 1 of a
# layout (and dp sizes that change only the optimizer's shard) walk the same activations
# and gradients. Bounded: the oldest entry goes first.
WALKS_MAX = 4096
_walks: dict = {}
_views: dict = {}  # id(fx) -> (fx, its walk_view, the view's token): one per stage's states
_tokens: dict = {}  # a view without its parameter counts -> one equal object (its token)
_NO_STEP = Segment(())
_PARAMS = StageStates._fields.index("params")


def walk_view(fx: StageStates) -> StageStates:
    """``fx`` without what only its optimizer's step and states read (``stage.walk_core``
    reads none of it): the optimizer's bytes, master copy, host and paged shares, the grad
    scaler, the step's temporaries and segments, the load."""
    return fx._replace(states=fx.states._replace(optimizer_bytes=0, master_bytes=0,
                                                 num_optimizer_params=0, host_bytes=0,
                                                 scaler_bytes=0, setup_bytes=0,
                                                 paged_bytes=0),
                       opt_temp=0, step=_NO_STEP, load=0, first_step=None)


def _view_of(fx: StageStates) -> tuple[StageStates, tuple]:
    """``walk_view(fx)`` and its token: one object for equal views less their parameter
    counts (the key compares those by identity), kept per ``fx`` object (a layout's stages
    come from ``_all_states``: the same objects for every micro-batch size)."""
    got = _views.get(id(fx))
    if got is not None and got[0] is fx:
        return got[1], got[2]
    view = walk_view(fx)
    rest = view[:_PARAMS] + view[_PARAMS + 1:]
    if len(_tokens) >= WALKS_MAX:
        _tokens.clear()  # (a token already in a key stays held by its entry)
    token = _tokens.setdefault(rest, rest)
    if len(_views) >= WALKS_MAX:
        del _views[next(iter(_views))]
    _views[id(fx)] = (fx, view, token)  # (holding fx: its id stays its own)
    return view, token


def stage_walk(core, spec: ModelSpec, par: ParallelConfig, wl: Workload, m: int, stage: int,
               schedule: Schedule, shared: StageTerms,
               parts: tuple[StageStates, StageKinds], prepared=None):
    """``core`` (``stage.walk_core``) of the stage's ``walk_view``, kept per what it reads:
    the spec, workload, micro-batches, stage, schedule, the layout's pipeline, offload and
    whether ZeRO shards gradients, the stage terms, kinds and parameter counts (by identity:
    all come from this module's caches, each entry holds them, and hashing the parameter
    counts' per-tensor tuples would cost more than a small walk) and the rest of the view
    (its token, ``_view_of``). ``prepared``: the walk inputs ``stage.backward_floor`` made
    for the same stage, used on a miss."""
    fx, kinds = parts
    view, token = _view_of(fx)
    key = (spec, wl, m, stage, schedule, par.pp, par.vpp, par.vpp_group, par.offload,
           par.zero >= ZeroStage.GRADIENTS, id(shared), id(kinds), id(fx.params), id(token))
    hit = _walks.get(key)
    if hit is not None:
        return hit[0]
    result = core(spec, par, wl, m, stage, schedule, shared, (view, kinds), prepared)
    if len(_walks) >= WALKS_MAX:
        del _walks[next(iter(_walks))]
    _walks[key] = (result, shared, kinds, fx.params, token)  # (held: their ids stay theirs)
    return result

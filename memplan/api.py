"""The Python API: the same answers as the CLI, from names or typed inputs.

>>> import memplan
>>> est = memplan.estimate("llama-2-7b", gpus=8, gpu="h100", zero=1, micro_batch_size=2)
>>> est.peak_bytes, est.fits
"""

from __future__ import annotations

from functools import lru_cache, wraps
from os import PathLike, fspath
from typing import Any

from memplan import arguments, presets
from memplan.errors import MemplanError, ValidationError, validation_message
from memplan.hardware import DEFAULT_GPU, GpuSpec, load_gpu
from memplan.model.estimate import Estimate
from memplan.model.estimate import cached_estimate
from memplan.model.pipeline import Schedule
from memplan.overheads import Overheads
from memplan.parallel import (
    GradBuffers,
    Offload,
    ParallelConfig,
    TpStyle,
    ZeroStage,
    layout_for_gpus,
)
from memplan.spec import MAX_LAYERS, ModelSpec, load_model
from memplan.units import parse_bytes
from memplan.workload import DEFAULT_SEQ_LEN, Recompute, Workload


# the cache of repeated configurations (``memplan.model.estimate.cached_estimate``)
_estimate = cached_estimate


def default_seq(spec: ModelSpec) -> int:
    """``Workload``'s default sequence length, capped at the model's maximum."""
    return min(DEFAULT_SEQ_LEN, spec.max_seq_len)


@arguments.plain_arguments
def make_workload(spec: ModelSpec, **fields: Any) -> Workload:
    """A ``Workload`` from keyword fields, with the default sequence length for ``spec``."""
    arguments.one_of("spec", spec, (ModelSpec,), what="a ModelSpec")
    arguments.model_fields(Workload, fields, arguments.LABELS)
    if fields.get("seq_len") is None:
        fields["seq_len"] = default_seq(spec)
    # each value's type in the key: True == 1 would otherwise be served 1's workload unchecked
    items = tuple(sorted((k, type(v).__name__, v) for k, v in fields.items() if v is not None))
    try:
        return _cached_workload(items)
    except TypeError:  # an unhashable value: validate without the cache (and fail clearly)
        return _validate(Workload, {k: v for k, _, v in items})


@lru_cache(maxsize=4096)
def _cached_workload(items: tuple[tuple[str, str, Any], ...]) -> Workload:
    return _validate(Workload, {k: v for k, _, v in items})


def _cached(function):
    """``lru_cache`` that lets an unhashable argument through uncached, to be refused by name
    in the body (``lru_cache`` alone would raise ``TypeError: unhashable type``); typed, so
    that ``True`` is not served the cached answer for 1 without being checked."""
    cached = lru_cache(maxsize=4096, typed=True)(function)

    @wraps(function)
    def call(*args: Any, **kwargs: Any) -> Any:
        try:
            hash((args, tuple(kwargs.items())))
        except TypeError:
            return function(*args, **kwargs)
        return cached(*args, **kwargs)

    call.cache_clear = cached.cache_clear  # type: ignore[attr-defined]
    call.cache_info = cached.cache_info  # type: ignore[attr-defined]
    return call


@arguments.plain_arguments
@_cached
def make_layout(num_gpus: int, *, tp: int = 1, pp: int = 1, vpp: int = 1, cp: int = 1,
                ep: int = 1, dp: int | None = None, zero: int = 0,
                sequence_parallel: bool | None = None, vocab_parallel: bool = True,
                tp_style: str | None = None, grad_buffers: str | None = None,
                offload: Any = "none", stage_layers: Any = None,
                dp_shard: int | None = None, etp: int | None = None,
                vpp_group: int | None = None) -> ParallelConfig:
    """A layout for ``num_gpus``; sequence parallelism defaults to on whenever tp > 1; TP style
    and gradient buffers left None take ``ParallelConfig``'s defaults (Megatron-LM's)."""
    for name, value in (("gpus", num_gpus), ("tp", tp), ("pp", pp), ("vpp", vpp), ("cp", cp),
                        ("ep", ep)):
        arguments.integer(name, value, maximum=arguments.MAX_GPUS)
    arguments.integer("dp", dp, maximum=arguments.MAX_GPUS, optional=True)
    if not arguments.is_int(zero) or zero not in (0, 1, 2, 3):
        raise MemplanError(f"zero must be 0, 1, 2 or 3, got {arguments.shown(zero)}")
    arguments.boolean("sequence_parallel", sequence_parallel, optional=True)
    arguments.boolean("vocab_parallel", vocab_parallel)
    sp = tp > 1 if sequence_parallel is None else sequence_parallel
    styles: dict[str, Any] = {}  # only those given: the rest are ParallelConfig's defaults
    if tp_style is not None:
        if tp_style not in {style.value for style in TpStyle}:
            raise MemplanError(f"tp_style must be megatron or dtensor, got {tp_style!r}")
        styles["tp_style"] = TpStyle(tp_style)
    if grad_buffers is not None:
        if grad_buffers not in {kind.value for kind in GradBuffers}:
            raise MemplanError(f"grad_buffers must be view or copy, got {grad_buffers!r}")
        styles["grad_buffers"] = GradBuffers(grad_buffers)
    targets = parse_offload(offload)
    split = parse_stage_layers(stage_layers)
    arguments.integer("dp_shard", dp_shard, optional=True)
    arguments.integer("etp", etp, maximum=arguments.MAX_GPUS, optional=True)
    arguments.integer("vpp_group", vpp_group, optional=True)
    return layout_for_gpus(num_gpus, tp=tp, pp=pp, cp=cp, dp=dp, vpp=vpp, ep=ep, etp=etp,
                           vpp_group=vpp_group,
                           zero=ZeroStage(zero), sequence_parallel=sp,
                           vocab_parallel=vocab_parallel, offload=targets,
                           stage_layers=split, dp_shard=dp_shard, **styles)


def parse_offload(value: Any) -> frozenset[Offload]:
    """What is offloaded (``Offload``) from "none" (or None), "optimizer,activations", an
    ``Offload``, or a collection of names."""
    if value is None:
        return frozenset()
    names = (value.split(",") if isinstance(value, str)
             else [value] if isinstance(value, Offload)
             else list(value) if isinstance(value, (list, tuple, set, frozenset)) else None)
    known = {kind.value: kind for kind in Offload}
    picked = [known.get(getattr(name, "value", name).strip() if isinstance(
        getattr(name, "value", name), str) else None) for name in names or ()]
    if names is None or None in picked and names not in (["none"], [""]):
        raise MemplanError("offload must be none or a comma list of optimizer, activations, "
                           f"params, got {value!r}")
    return frozenset(kind for kind in picked if kind is not None)


def parse_stage_layers(value: Any) -> tuple[int, ...] | None:
    """Layers per virtual pipeline stage from "15,16,16,15" (a run of equal stages may be
    written "16x6", as ``memplan plan`` prints it), a sequence of ints, or None."""
    if value is None:
        return None
    items = value.split(",") if isinstance(value, str) else value
    try:
        counts: list[int] = []
        for item in items:
            counts += _layer_counts(item)
            if len(counts) > MAX_LAYERS:
                raise _TooManyStages
        out = tuple(counts)
    except _TooManyStages:
        raise MemplanError(f"stage_layers lists more than {MAX_LAYERS} stages (memplan's "
                           f"limit: a stage holds a layer or none), got "
                           f"{arguments.shown(value)}") from None
    except (TypeError, ValueError):
        raise MemplanError(f"stage_layers must be layer counts separated by commas (a run as "
                           f"16x6), got {arguments.shown(value)}") from None
    if not out:
        raise MemplanError(f"stage_layers must list at least one stage, got "
                           f"{arguments.shown(value)}")
    return out


class _TooManyStages(Exception):
    """A stage list longer than MAX_LAYERS, found before the list is made."""


def _layer_counts(item: Any) -> list[int]:
    """The stages of one item ("16" or a run "16x6"); the runs are bounded before they are
    expanded, so "1x99999999999" is refused rather than built."""
    if not isinstance(item, str):
        if not arguments.is_int(item):
            raise TypeError(item)
        return [int(item)]
    layers, _, times = item.strip().partition("x")
    count = int(times) if times else 1
    if count < 1:
        raise ValueError(item)
    if count > MAX_LAYERS:
        raise _TooManyStages
    return [int(layers)] * count


@arguments.plain_arguments
def estimate(model: str | ModelSpec, *, gpus: int = 1, gpu: str | GpuSpec = DEFAULT_GPU,
             gpu_memory: str | int | None = None, tp: int = 1, pp: int = 1, vpp: int = 1,
             cp: int = 1, ep: int = 1, dp: int | None = None, zero: int = 0,
             sequence_parallel: bool | None = None, vocab_parallel: bool = True,
             tp_style: str | None = None, grad_buffers: str | None = None,
             offload: Any = "none", framework: str | None = None,
             stage_layers: Any = None, dp_shard: int | None = None,
             etp: int | None = None, vpp_group: int | None = None,
             overheads: Overheads | None = None,
             schedule: Schedule | str = Schedule.ONE_F_ONE_B,
             calibration: str | list[str] | None = None, fit_reserved: str | None = None,
             **workload: Any) -> Estimate:
    """Per-GPU memory of training ``model`` on ``gpus`` GPUs.

    ``workload`` takes the ``Workload`` fields (micro_batch_size, global_batch_size, seq_len,
    precision, optimizer, optimizer_impl, recompute, recompute_layers, recompute_every,
    attention, norm_impl, logits_fp32, loss_chunks). ``framework`` (megatron, torchtitan, hf,
    lightning; default generic) fills every implementation choice left unset (None) with what
    that framework runs (``memplan.presets``). ``gpu_memory`` ("80GiB", "80GB" or int bytes)
    overrides the GPU's capacity. ``offload``: what lives in host memory ("optimizer",
    "activations", "params", a comma list or a collection of them; ``Offload``). ``calibration``: profile paths (or "auto", the committed profile for ``gpu``)
    whose correction is added as its own line (``memplan.calibrate.apply``).
    ``fit_reserved`` (with ``recompute="auto"``; an allocator configuration in
    ``PYTORCH_CUDA_ALLOC_CONF``'s form, "" for the defaults): the save set must also fit once
    the caching allocator is replayed under it, as ``plan`` fits (``_auto_save``).
    Raises ``MemplanError`` for any invalid input.
    """
    gpu_spec = _gpu(gpu)
    capacity = _capacity(gpu_memory)
    arguments.one_of("overheads", overheads, (Overheads, type(None)), what="an Overheads")
    schedule = arguments.choice("schedule", schedule, Schedule)
    calibration = arguments.strings("calibration", calibration)
    auto = workload.get("recompute") == AUTO
    if fit_reserved is not None:
        arguments.one_of("fit_reserved", fit_reserved, (str,), what="an allocator configuration")
        if not auto:
            raise MemplanError("fit_reserved chooses recompute auto's save set: give it with "
                               f"recompute='auto', got recompute={workload.get('recompute')!r}")
    if auto:  # the save set is chosen below, once the layout and its budget are known
        workload = {**workload, "recompute": "ops"}
    # the arguments are plain already: resolve's own wrapper would check them a second time
    spec, par, wl = resolve.__wrapped__(
        model, gpus=gpus, tp=tp, pp=pp, vpp=vpp, cp=cp, ep=ep, dp=dp, zero=zero,
        sequence_parallel=sequence_parallel, vocab_parallel=vocab_parallel, tp_style=tp_style,
        grad_buffers=grad_buffers, offload=offload, framework=framework,
        stage_layers=stage_layers, dp_shard=dp_shard, etp=etp, vpp_group=vpp_group,
        **workload)
    notes: tuple[str, ...] = ()
    if auto and (why := _ops_refusal(spec, wl)) is not None:
        wl, notes = _auto_level(spec, gpu_spec, par, wl, capacity, overheads, schedule,
                                fit_reserved, why)
    elif auto:
        none = _auto_none(spec, gpu_spec, par, wl, capacity, overheads, schedule, fit_reserved)
        if none is not None:
            wl, notes = none, (AUTO_NONE_NOTE,)
        else:
            wl = _auto_save(spec, gpu_spec, par, wl, capacity, overheads, schedule,
                            fit_reserved)
    est = _estimate(spec, gpu_spec, par, wl, capacity_bytes=capacity,
                    overheads=overheads,
                    schedule=schedule)
    if notes:
        est = est._replace(notes=notes)
    if not calibration:
        return est
    from memplan.calibrate.apply import calibrate
    from memplan.calibrate.apply import resolve as load_profiles

    return calibrate(est, load_profiles(_as_list(calibration), gpu_spec))


# ``recompute="auto"``: op-level checkpointing with the save set chosen to fit
AUTO = "auto"


# ``recompute="auto"`` where no recompute fits: the least recompute of all (every op's output
# kept, the scans and norm tensors no policy names too), read by ``memplan.report.sac_policy``
AUTO_NONE_NOTE = ("recompute auto: no recompute fits, the least recompute of all (every "
                  "layer keeps all it saves, what no policy names included): no layer is "
                  "checkpointed")


def _auto_none(spec: ModelSpec, gpu: GpuSpec, par: Any, wl: Workload, capacity: int | None,
               overheads: Overheads | None, schedule: Schedule,
               fit_reserved: str | None) -> Workload | None:
    """``wl`` without recompute where that fits (and, with ``fit_reserved``, fits once the
    allocator is replayed: ``_reserved_excess``), else None: not checkpointing a layer
    recomputes nothing, less than any save set, whose layers rerun what no policy names (a
    Mamba2 mixer's scan, a norm's tensors of implementation-dependent ops)."""
    none = wl.model_copy(update={"recompute": Recompute.NONE, "recompute_save": ()})
    try:
        est = _estimate(spec, gpu, par, none, capacity_bytes=capacity, overheads=overheads,
                        schedule=schedule)
    except MemplanError:  # (a layout or framework that refuses no recompute)
        return None
    if not est.fits or (fit_reserved is not None
                        and _reserved_excess(est, fit_reserved) is not None):
        return None
    return none


def _auto_save(spec: ModelSpec, gpu: GpuSpec, par: Any, wl: Workload, capacity: int | None,
               overheads: Overheads | None, schedule: Schedule,
               fit_reserved: str | None = None) -> Workload:
    """``wl`` (recompute ops) with the save set of least recompute that fits the GPU
    (``memplan.planning.save_sets``); the empty set when none does (the estimate then says
    it does not fit). ``fit_reserved`` (an allocator configuration, ``PYTORCH_CUDA_ALLOC_CONF``'s
    form, "" for the defaults): the set must also fit once the caching allocator is replayed
    (``_reserved_excess``); one that does not is chosen again against the capacity less the
    most the allocator reserved beyond a chosen set's tensors, as ``plan``'s reserved check
    does (``memplan.planning.planner._retry_reserved``), until one fits or none not tried
    does (the last is kept: the replay then says where it runs out)."""
    from memplan.model.dims import Dims
    from memplan.model.estimate import resolve_split
    from memplan.model.layer import ops_forward_peaks, ops_search_items
    from memplan.planning.save_sets import frontier

    dm = Dims.of(spec, resolve_split(spec, par, wl), wl)
    sets = frontier(ops_search_items(spec, wl, dm))
    forward = ops_forward_peaks(spec, wl, dm, sets)

    def run(save: tuple[str, ...]) -> Any:
        return _estimate(spec, gpu, par, wl.model_copy(update={"recompute_save": save}),
                         capacity_bytes=capacity, overheads=overheads, schedule=schedule)

    capacity_bytes = run(()).capacity_bytes
    save = _save_within(sets, forward, run, capacity_bytes)
    tried, margin = {save}, 0
    while fit_reserved is not None:
        excess = _reserved_excess(run(save), fit_reserved)
        if excess is None:
            break
        # (+1: where the allocator runs out of memory the replay reads the whole capacity,
        # which the set's peak plus the margin then reaches exactly)
        margin = max(margin, excess + 1)
        again = _save_within(sets, forward, run, capacity_bytes - margin)
        if again in tried:
            break
        tried.add(again)
        save = again
    return wl.model_copy(update={"recompute_save": save})


def _ops_refusal(spec: ModelSpec, wl: Workload) -> str | None:
    from memplan.model.sac_ops import ops_refusal

    return ops_refusal(spec, wl)


# (``memplan.planning.planner.OPS_NOT_MODELLED``'s counterpart for one layout)
AUTO_LEVEL_NOTE = ("recompute auto: op-level save sets are not modelled here ({why}); chose "
                   "the whole recompute level of least recompute that fits instead, in plan's "
                   "order (none, selective, full on k of each stage's layers, full): {chosen}")


def _auto_level(spec: ModelSpec, gpu: GpuSpec, par: Any, wl: Workload, capacity: int | None,
                overheads: Overheads | None, schedule: Schedule, fit_reserved: str | None,
                why: str) -> tuple[Workload, tuple[str, ...]]:
    """``recompute="auto"`` where the layer's ops are not modelled
    (``memplan.model.sac_ops.ops_refusal``): the whole level of least recompute that fits
    (and, with ``fit_reserved``, fits once the allocator is replayed: ``_reserved_excess``),
    taken in the order ``plan`` searches in op-level checkpointing's place
    (``memplan.planning.planner._policy_tuple``: none, selective, full on an eighth ... seven
    eighths of the fewest layers a stage holds, full), with a note saying so; full recompute
    of every layer where none fits (the estimate then says it does not fit). A level this
    layer or layout refuses is passed over."""
    from memplan.planning.planner import RECOMPUTE_ORDER, _fewest_layers, _policy_tuple

    fewest = _fewest_layers(spec.num_layers, par.pp, par.vpp, par.stage_layers)
    chosen = wl.model_copy(update={"recompute": Recompute.FULL, "recompute_layers": None,
                                   "recompute_save": ()})
    found = False
    for policy, layers in _policy_tuple(RECOMPUTE_ORDER, fewest):
        level = wl.model_copy(update={"recompute": policy, "recompute_layers": layers,
                                      "recompute_save": ()})
        try:
            est = _estimate(spec, gpu, par, level, capacity_bytes=capacity,
                            overheads=overheads, schedule=schedule)
        except MemplanError:
            continue
        if est.fits and (fit_reserved is None
                         or _reserved_excess(est, fit_reserved) is None):
            chosen, found = level, True
            break
    name = chosen.recompute.value + ("" if chosen.recompute_layers is None else
                                     f" on {chosen.recompute_layers} layers of each stage")
    name += "" if found else " (none fits: full recompute of every layer)"
    return chosen, (AUTO_LEVEL_NOTE.format(why=why, chosen=name),)


def _save_within(sets: tuple, forward: tuple, run: Any, budget: int) -> tuple[str, ...]:
    """The save list of least recompute whose estimate (``run``) peaks within ``budget``: one
    set for every layer, or under pipeline parallelism one per stage (the first stages hold
    more micro-batches in flight); the empty set where none fits."""
    from memplan.planning.save_sets import choose, choose_per_stage

    if run(()).parallel.pp > 1:
        from memplan.model.sac_ops import stage_lists

        chosen, _ = choose_per_stage(sets, lambda kept: tuple(
            s.peak_bytes for s in run(tuple(sorted(kept))).stages), budget, forward=forward)
        return tuple(sorted(stage_lists([c.kept if c else () for c in chosen])))
    choice, _ = choose(sets, lambda kept: run(tuple(sorted(kept))).peak_bytes <= budget,
                       forward=forward)
    return () if choice is None else tuple(sorted(choice.kept))


def _reserved_excess(est: Any, alloc_conf: str) -> int | None:
    """How many bytes the most loaded rank needs beyond the estimate's peak once the caching
    allocator is replayed under ``alloc_conf`` and the device's capacity, where that does not
    fit (``memplan.model.reserved.reserved_rank``, the figure ``plan`` fits); None where it
    does."""
    from memplan.model.reserved import reserved_rank

    got = reserved_rank(est, est.capacity_bytes, alloc_conf)
    if got.oom_step is None and got.peak_bytes <= est.capacity_bytes:
        return None
    return got.peak_bytes - est.peak_bytes


def _as_list(value: str | list[str]) -> list[str]:
    return [value] if isinstance(value, str) else list(value)


def _gpu(gpu: Any) -> GpuSpec:
    """A catalog GPU by name or alias, or a ``GpuSpec`` as given."""
    arguments.one_of("gpu", gpu, (str, GpuSpec), what="a GPU name (`memplan gpus`) or a GpuSpec")
    return gpu if isinstance(gpu, GpuSpec) else load_gpu(gpu)


def _spec(model: Any) -> ModelSpec:
    """A catalog name, a model file's path, or a ``ModelSpec`` as given."""
    if isinstance(model, ModelSpec):
        return model
    if isinstance(model, PathLike):
        model = fspath(model)
    arguments.text("model", model)
    return load_model(model)


def _capacity(gpu_memory: str | int | None) -> int | None:
    """``--gpu-memory`` as int bytes ("80GiB", "80GB" or bytes), or None for the catalog's."""
    if gpu_memory is None:
        return None
    arguments.one_of("gpu_memory", gpu_memory, (str, int), what='a size such as "80GiB" or '
                     "int bytes")
    if isinstance(gpu_memory, bool):
        raise MemplanError(f"gpu_memory must be a size such as \"80GiB\" or int bytes, got "
                           f"{arguments.shown(gpu_memory)}")
    try:
        return parse_bytes(gpu_memory)
    except ValueError as err:
        raise MemplanError(f"gpu_memory: {err}") from err


@arguments.plain_arguments
def resolve(model: str | ModelSpec, *, gpus: int = 1, tp: int = 1, pp: int = 1, vpp: int = 1,
            cp: int = 1, ep: int = 1, dp: int | None = None, zero: int = 0,
            sequence_parallel: bool | None = None, vocab_parallel: bool = True,
            tp_style: str | None = None, grad_buffers: str | None = None,
            offload: Any = "none", framework: str | None = None,
            stage_layers: Any = None, dp_shard: int | None = None,
            etp: int | None = None, vpp_group: int | None = None,
            **workload: Any) -> tuple[ModelSpec, ParallelConfig, Workload]:
    """The typed (spec, layout, workload) for names and numbers; raises MemplanError.
    Implementation choices left None take the framework's defaults (``memplan.presets``)."""
    spec = _spec(model)
    arguments.model_fields(Workload, workload, arguments.LABELS)
    fw = presets.parse(framework)
    filled = presets.apply(fw, spec, {"tp_style": tp_style, "grad_buffers": grad_buffers,
                                      **workload})
    # (the unwrapped functions: every argument is plain already, the spec validated)
    par = make_layout.__wrapped__(
        gpus, tp=tp, pp=pp, vpp=vpp, cp=cp, ep=ep, dp=dp, zero=zero,
        sequence_parallel=sequence_parallel, vocab_parallel=vocab_parallel,
        tp_style=filled.pop("tp_style"), grad_buffers=filled.pop("grad_buffers"),
        offload=offload, stage_layers=stage_layers, dp_shard=dp_shard, etp=etp,
        vpp_group=vpp_group)
    return spec, par, make_workload.__wrapped__(spec, framework=fw, **filled)


def _validate(model: type[Workload], data: dict[str, Any]) -> Workload:
    try:
        return model.model_validate(data)
    except ValidationError as err:
        raise MemplanError(validation_message(err, arguments.LABELS)) from err


@arguments.plain_arguments
def plan(model: str | ModelSpec, *, gpus: int, gpu: str | GpuSpec = DEFAULT_GPU,
         gpu_memory: str | int | None = None, safety: float | None = None,
         max_tp: int | None = None, recompute: list[str] | None = None,
         tp: int | None = None, pp: int | None = None, vpp: int | None = None,
         cp: int | None = None, ep: int | None = None, zero: int | None = None,
         sequence_parallel: bool | None = None, calibration: str | list[str] | None = None,
         stage_layers: Any = None, dp_shard: int | None = None, top: int | None = None,
         etp: int | None = None, vpp_group: int | None = None, reserved: bool | None = None,
         offload: Any = None, **workload: Any):
    """Layouts, recompute policies and micro-batch sizes that fit ``gpus`` GPUs, fastest first
    (``memplan.planning.planner.PlanResult``). Layout arguments given are fixed; the rest are
    searched. ``workload`` takes Workload fields (seq_len, global_batch_size, precision, ...).
    ``calibration`` as for ``estimate``: candidates are re-checked and re-timed with it.
    ``top``: only the ``top`` fastest candidates are wanted, so recompute policies that cannot
    beat them are not searched (the first ``top`` are the same; without calibration).
    ``recompute="auto"`` (op-level checkpointing, the save set chosen per fit) where memplan
    does not model the layer op by op searches the whole levels instead and says why in the
    result's ``notes``. ``reserved``: each candidate is fitted against the caching allocator's reserved peak
    (``memplan.model.reserved``, one replay per configuration checked, cached), its
    micro-batch lowered until that fits, fastest first until ``top`` fit. False: the search's
    tensor peak and fixed overheads alone (a lower bound of what the device holds). None
    (the default): with ``top`` (the CLI's ``--top``, 10 unless given), not without it, where
    every candidate would be replayed (hundreds of replays). ``offload``: what lives in host
    memory, as ``estimate`` takes it, fixed for every candidate; None: nothing, except under
    DeepSpeed, whose offload the plan searches (``_offload_choices``)."""
    from memplan.planning.planner import DEFAULT_SAFETY
    from memplan.planning.planner import merge
    from memplan.planning.planner import plan as run_plan

    spec = _spec(model)
    gpu_spec = _gpu(gpu)
    capacity = _capacity(gpu_memory)
    arguments.integer("gpus", gpus, maximum=arguments.MAX_GPUS)
    arguments.number("safety", safety, low=0, high=1, optional=True)
    arguments.integer("max_tp", max_tp, maximum=arguments.MAX_GPUS, optional=True)
    arguments.integer("top", top, optional=True)
    for name, value in (("tp", tp), ("pp", pp), ("vpp", vpp), ("cp", cp), ("ep", ep),
                        ("etp", etp)):
        arguments.integer(name, value, maximum=arguments.MAX_GPUS, optional=True)
    arguments.integer("vpp_group", vpp_group, optional=True)
    arguments.boolean("reserved", reserved, optional=True)
    if reserved is None:
        reserved = top is not None

    if zero is not None and (not arguments.is_int(zero) or zero not in (0, 1, 2, 3)):
        raise MemplanError(f"zero must be 0, 1, 2 or 3, got {arguments.shown(zero)}")
    arguments.boolean("sequence_parallel", sequence_parallel, optional=True)
    calibration = arguments.strings("calibration", calibration)
    arguments.model_fields(Workload, workload, arguments.LABELS)
    _check_fixed(spec, gpus, tp, pp, cp)
    policies = None
    if recompute is not None:
        # auto: op-level save sets, the set chosen per fit, and no recompute where that fits
        # (``_auto_none``); a layout's fastest micro-batch of either (``planner._ranked``)
        policies = [p for r in arguments.strings("recompute", recompute)
                    for p in ((Recompute.NONE, Recompute.OPS) if r == AUTO
                              else (Recompute.parse(r),))]
        policies = list(dict.fromkeys(policies))
    fw = presets.parse(workload.pop("framework", None))
    refused = presets.refused_recompute(fw)
    if refused:  # search only what the framework offers; refuse what it does not, by name
        for policy in policies or []:
            if policy.label in refused:
                presets.validate(None, make_workload(spec, framework=fw, recompute=policy))
        policies = [p for p in (policies or [r for r in Recompute if r is not Recompute.OPS])
                    if p.label not in refused]
    fixed = {"tp": tp, "pp": pp, "vpp": vpp, "cp": cp, "ep": ep, "etp": etp,
             "vpp_group": vpp_group, "zero": zero,
             "sp": sequence_parallel, "stage_layers": parse_stage_layers(stage_layers),
             "dp_shard": dp_shard}
    safety = DEFAULT_SAFETY if safety is None else safety
    filled = presets.apply(fw, spec, workload)
    for name in presets.LAYOUT_FIELDS:  # the planner searches Megatron-style layouts
        filled.pop(name, None)
    result = merge([
        run_plan(spec, gpu_spec, gpus, make_workload(spec, framework=fw, **{**filled, **bucket}),
                 capacity_bytes=capacity, max_tp=max_tp, fixed={**fixed, "offload": targets},
                 safety=safety, recompute=policies,
                 # calibration re-times every candidate: the analytic order may change
                 top=None if calibration else top,
                 # fitted against the caching allocator's reserved peak (calibration
                 # re-checks its candidates with its own correction)
                 reserved=reserved and not calibration)
        for bucket in _bucket_choices(fw, spec, workload)
        for targets in _offload_choices(fw, offload)])
    _check_found(result, gpus, fixed)
    if not calibration:
        return result
    from memplan.calibrate.apply import calibrate_plan
    from memplan.calibrate.apply import resolve as load_profiles

    return calibrate_plan(result, spec, gpu_spec, load_profiles(_as_list(calibration), gpu_spec),
                          capacity_bytes=capacity, safety=safety)


def _bucket_choices(fw: presets.Framework, spec: ModelSpec,
                    given: dict[str, Any]) -> list[dict[str, int]]:
    """The reduce bucket sizes a plan searches under DeepSpeed when none is given (a
    ds_config's ``reduce_bucket_size`` or ``zero_bucket_numel``): DeepSpeedZeroConfig's
    default, 5e8 elements (runtime/zero/config.py; the preset's default), and the transformers
    Trainer's ``"auto"``, hidden x hidden (transformers/integrations/deepspeed.py
    HfTrainerDeepSpeedConfig.trainer_config_finalize), largest first; one plan (no change)
    otherwise."""
    if fw is not presets.Framework.DEEPSPEED or given.get("zero_bucket_numel") is not None:
        return [{}]
    default = presets.apply(fw, spec, {})["zero_bucket_numel"]
    return [{"zero_bucket_numel": n}
            for n in sorted({default, spec.hidden_size ** 2}, reverse=True)]


def _offload_choices(fw: presets.Framework, given: Any) -> list[frozenset[Offload]]:
    """What a plan keeps in host memory: a given ``offload`` (``parse_offload``) fixed; else
    nothing, and under DeepSpeed also its optimizer offload (``offload_optimizer: {device:
    cpu}``) and that with the parameters' (``offload_param``, stage 3), each a plan of its
    own merged into one (the stages a choice is not offered at are refused by the preset,
    ``presets.REFUSALS``)."""
    if given is not None:
        return [parse_offload(given)]
    if fw is not presets.Framework.DEEPSPEED:
        return [frozenset()]
    return [frozenset(), frozenset({Offload.OPTIMIZER}),
            frozenset({Offload.OPTIMIZER, Offload.PARAMS})]


def _check_fixed(spec: ModelSpec, gpus: int, tp: int | None, pp: int | None,
                 cp: int | None) -> None:
    """The layout degrees a plan keeps fixed must split ``gpus`` and the model (the
    planner's own rules, ``memplan.planning.planner.layouts``), or no layout can be searched."""
    given = {name: value for name, value in (("tp", tp), ("pp", pp), ("cp", cp))
             if value is not None}
    product = 1
    for value in given.values():
        product *= value
    if gpus % product:
        names = "*".join(given)
        numbers = "*".join(str(v) for v in given.values())
        raise MemplanError(f"gpus ({gpus}) must be divisible by {names} "
                           f"({numbers} = {product})" if len(given) > 1 else
                           f"gpus ({gpus}) must be divisible by {names} ({product})")
    if tp is not None:
        for field in ("num_attention_heads", "num_kv_heads", "ffn_hidden_size"):
            if getattr(spec, field) % tp:
                raise MemplanError(f"tp ({tp}) must divide {field} ({getattr(spec, field)}) "
                                   f"of {spec.name}")
    if pp is not None and pp > spec.num_layers:  # uneven splits are searched too
        raise MemplanError(f"pp ({pp}) must be at most num_layers ({spec.num_layers}) of "
                           f"{spec.name}: every pipeline stage needs a layer")


# Why a plan found nothing that are not memory: the layout itself is impossible.
_MEMORY_REASONS = ("out of memory", "sp off:")


def _check_found(result: Any, gpus: int, fixed: dict[str, Any]) -> None:
    """A plan with layout values fixed that leaves no layout to search is a mistake in the
    input, not an answer: raise with the rule that removed the most layouts."""
    given = {k: v for k, v in fixed.items() if v is not None}
    if result.candidates or not given or not result.rejected:
        return
    if any(reason.startswith(_MEMORY_REASONS) for reason in result.rejected):
        return
    reason, count = result.rejected.most_common(1)[0]
    kept = ", ".join(f"{k} {v}" for k, v in given.items())
    raise MemplanError(f"no layout of {gpus} GPUs with {kept} can be searched: {reason} "
                       f"({count} layouts)")


@arguments.plain_arguments
def check(model: str | ModelSpec, *, safety: float | None = None, **kwargs: Any) -> Estimate:
    """``estimate(model, **kwargs)``, raising MemplanError with the breakdown when it does not
    fit in capacity * (1 - safety): a launcher's pre-flight check."""
    from memplan.planning.planner import DEFAULT_SAFETY
    from memplan.report.estimate import check_fits  # the breakdown in GiB is rendering

    arguments.number("safety", safety, low=0, high=1, optional=True)
    return check_fits(estimate(model, **kwargs),

                      safety=DEFAULT_SAFETY if safety is None else safety)

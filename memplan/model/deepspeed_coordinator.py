"""DeepSpeed's ZeRO-3 parameter coordinator, replayed on a model's module trace: which weights
are gathered, and which all-gather buffers are alive, at each module's run in forward and
backward, in bytes, on one rank.

Read in DeepSpeed 0.19.8, ``deepspeed/runtime/zero/partitioned_param_coordinator.py``
``PartitionedParameterCoordinator`` and ``partition_parameters.py``; each step below names the
function it follows. The coordinator records the module trace in the first step
(``reset_step``: INVALID -> RECORD at the first forward's start, RECORD -> COMPLETE at the
second's), so step 1 gathers each module for its own run only and every later step prefetches
and keeps weights by the recorded trace (``replay``'s ``complete``).

- ``fetch_sub_module`` gathers the module's own parameters not yet gathered (one coalesced
  all-gather), waits for each (``__inflight_param_registry.pop(param).wait()``), drops the
  module's entries from the parameter queue and, with ``stage3_prefetch_bucket_size`` > 0,
  pops the queue until ``min(max_live - available, prefetch_bucket)`` elements of parameters
  not gathered are taken, gathering them in one coalesced all-gather (``__all_gather_params``;
  every popped entry, gathered or not, marks its parameter as fetched for that entry's use:
  ``__most_recent_step_id_param_fetched_for``).
- A coalesced all-gather of more than one parameter (``partition_parameters.py
  _all_gather_dtype``) makes one flat buffer of the partitions x ranks; its handle's ``wait``
  gives every parameter of the group a whole copy (``torch.cat`` of its slices); the flat
  buffer lives while the registry holds the handle for any parameter of the group (each is
  popped at its module's fetch). One parameter alone is gathered into its own buffer
  (``_all_gather_sequential``), padded to a multiple of the ranks, which the parameter keeps.
- ``release_sub_module`` -> ``__params_to_release``: a module's parameters are released after
  its run unless persistent (``ds_persist``), prefetched for a later use
  (``__most_recent_step_id_param_fetched_for[param] > step_id``), or used again within the next
  ``stage3_max_reuse_distance`` elements of the trace (the parameters of the modules after it,
  counted once per use); ``__release_param`` frees the whole copy.
- Persistent parameters (``parameter_offload.py mark_persistent_parameters``: at most
  ``stage3_param_persistence_threshold`` elements each, ``stage3_model_persistence_threshold``
  in all) are released like the others in the recording step, gathered again after each
  optimizer step (``stage3.py _post_step``) and never released after that.

A module here holds one parameter tensor (a Llama's every ``nn.Linear``, norm and the
embedding: ``parameters(recurse=False)``); modules without parameters (a decoder layer, its
attention and MLP, the activation) change nothing and are left out.
"""

from __future__ import annotations

from collections import deque
from functools import lru_cache
from typing import Any, NamedTuple

from memplan.workload import Recompute

# DeepSpeedZeroConfig defaults (runtime/zero/config.py, 0.19.8): stage3_prefetch_bucket_size
# 5e7, stage3_max_live_parameters 1e9, stage3_max_reuse_distance 1e9,
# stage3_param_persistence_threshold 1e5, stage3_model_persistence_threshold sys.maxsize
PREFETCH_BUCKET_SIZE = 50_000_000
MAX_LIVE_PARAMETERS = 1_000_000_000
MAX_REUSE_DISTANCE = 1_000_000_000
PARAM_PERSISTENCE_THRESHOLD = 100_000
MODEL_PERSISTENCE_THRESHOLD = 2**63 - 1


class Coordinator(NamedTuple):
    """The coordinator's settings, in elements (the ds_config's ``stage3_*`` keys)."""

    prefetch_bucket: int = PREFETCH_BUCKET_SIZE
    max_live: int = MAX_LIVE_PARAMETERS
    reuse_distance: int = MAX_REUSE_DISTANCE
    persistence_threshold: int = PARAM_PERSISTENCE_THRESHOLD
    model_persistence_threshold: int = MODEL_PERSISTENCE_THRESHOLD

    @property
    def plain(self) -> bool:
        """Each module gathered for its own run only, in every step."""
        return not (self.prefetch_bucket or self.reuse_distance or self.persistence_threshold)


class Use(NamedTuple):
    """One module's run in the trace: its parameter (an index of the model's tensors; -1 for
    a module without parameters of its own, which still prefetches), whether it is a
    forward run, and whether that forward is a checkpoint's recomputation."""

    param: int
    forward: bool
    recompute: bool = False
    fetch: bool = True  # False: the module's release alone (its fetch came earlier)
    release: bool = True  # False: its fetch alone (released by a later use)
    # frozen parameters a checkpoint's recomputation gathered under this module's backward,
    # released with it (partitioned_param_coordinator.py fetch_sub_module:
    # update_recompute_parameters, "Only frozen params need recompute attribution")
    with_frozen: tuple[int, ...] = ()


def persistent(sizes: tuple[int, ...], c: Coordinator) -> frozenset[int]:
    """The persistent parameters (``mark_persistent_parameters``: in registration order, each
    of at most the threshold, while the total stays within the model threshold)."""
    out, total = set(), 0
    for i, n in enumerate(sizes):
        if n + total > c.model_persistence_threshold:
            continue
        if n <= c.persistence_threshold:
            out.add(i)
            total += n
    return frozenset(out)


class Replayed(NamedTuple):
    """``replay``'s bytes per run of the trace: ``at`` after the module's fetch (its prefetch
    included), where it computes; ``after`` after its release."""

    at: tuple[int, ...]
    after: tuple[int, ...]


def replay(sizes: tuple[int, ...], trace: tuple[Use, ...], c: Coordinator, dp: int,
           itemsize: int, complete: bool = True, with_aliases: bool = True) -> Replayed:
    """Bytes gathered on one rank (whole parameters and live all-gather buffers) at each run
    of ``trace``, the step's module runs in order (forward, then backward), for the model
    whose parameter tensors have ``sizes`` elements. ``complete``: the trace is recorded
    (step 2 on); else the recording step's behaviour (each module for its own run).
    ``itemsize``: bytes of a gathered element. ``with_aliases``: count the weights a
    recomputation saved after their release (False: the parameters' own storage only, what
    the coordinator sees)."""
    keep = persistent(sizes, c) if complete else frozenset()
    rank = _Rank(sizes, dp, itemsize, keep, with_aliases)
    fetches = tuple(u for u in trace if u.fetch)  # the recorded trace: one step per fetch
    order = (deque((u.param, step) for step, u in enumerate(fetches) if u.param >= 0)
             if complete else deque())
    fetched_for: dict[int, int] = {}
    out, after = [], []
    step = -1
    for use in trace:
        p = use.param
        if use.recompute and p >= 0:
            rank.saved.add(p)
        if use.fetch:
            step += 1
            _fetch(rank, p, step, complete, order, fetched_for, c)
        out.append(rank.held())
        if p >= 0 and use.release and _released(p, step + 1, fetches, sizes, c, keep,
                                                fetched_for, complete):
            rank.release(p)
        for q in use.with_frozen:
            if q not in keep:
                rank.release(q)
        if p >= 0 and not use.forward:
            rank.backward_done(p)
        after.append(rank.held())
    return Replayed(tuple(out), tuple(after))


class _Rank:
    """What one rank holds gathered: each parameter's whole copy (``data``), the registry of
    in-flight gathers (parameter -> its group), the elements gathered (``active``:
    ``__n_available_params``, persistent ones not counted). A checkpoint's recomputation
    saves each weight it reads for its backward as an alias of the gathered copy
    (torch/utils/checkpoint.py _recomputation_hook: ``x.detach()``): a release then frees the
    parameter's data but not the alias (``aliases``), alive to the weight's own backward; a
    gather meanwhile makes a second copy."""

    def __init__(self, sizes: tuple[int, ...], dp: int, itemsize: int, keep: frozenset[int],
                 with_aliases: bool) -> None:
        self.sizes, self.dp, self.itemsize, self.with_aliases = sizes, dp, itemsize, with_aliases
        self.data = {i: n * itemsize for i, n in enumerate(sizes) if i in keep}
        self.registry: dict[int, _Group] = {}
        self.saved: set[int] = set()
        self.aliases: dict[int, int] = {}
        self.active = 0

    def held(self) -> int:
        return (sum(self.data.values()) + (sum(self.aliases.values()) if self.with_aliases
                                           else 0)
                + sum(g.flat_bytes for g in set(self.registry.values())))

    def gathered(self, p: int) -> bool:
        return p in self.data or p in self.registry

    def gather(self, params: list[int]) -> None:
        """``__all_gather_params``: one gather of those not gathered."""
        todo = sorted(p for p in params if not self.gathered(p))
        if not todo:
            return
        self.active += sum(self.sizes[p] for p in todo)
        padded = sum(-(-self.sizes[p] // self.dp) for p in todo) * self.dp * self.itemsize
        group = _Group(todo, padded if len(todo) > 1 else 0)
        if len(todo) == 1:  # _all_gather_sequential: the parameter keeps its padded buffer
            self.data[todo[0]] = padded
        for p in todo:
            self.registry[p] = group

    def wait(self, p: int) -> None:
        """``__inflight_param_registry.pop(param).wait()``."""
        group = self.registry.pop(p)
        if not group.waited:
            group.waited = True
            for q in group.params:
                if group.flat_bytes:  # AllGatherCoalescedHandle.wait: torch.cat
                    self.data[q] = self.sizes[q] * self.itemsize

    def release(self, p: int) -> None:
        """``__release_param``."""
        if p in self.data and p not in self.registry:
            if p in self.saved and p not in self.aliases:
                self.aliases[p] = self.data[p]
            del self.data[p]
            self.active -= self.sizes[p]

    def backward_done(self, p: int) -> None:
        if p in self.saved:
            self.saved.discard(p)
            self.aliases.pop(p, None)


def _fetch(rank: _Rank, p: int, step: int, complete: bool, order: deque,
           fetched_for: dict[int, int], c: Coordinator) -> None:
    """``fetch_sub_module`` of the module of parameter ``p`` (-1: none) at ``step``."""
    if p >= 0:
        rank.gather([p])
        if p in rank.registry:
            rank.wait(p)
    if not complete:
        return
    if p >= 0 and fetched_for.get(p, -10**10) < step:
        entry, used = order.popleft()
        fetched_for[entry] = used
    if c.prefetch_bucket > 0:
        _prefetch(rank, order, fetched_for, c)


class _Group:
    """One all-gather: its parameters and its flat buffer's bytes (0 for one parameter)."""

    def __init__(self, params: list[int], flat_bytes: int) -> None:
        self.params, self.flat_bytes, self.waited = params, flat_bytes, False


def _prefetch(rank: _Rank, order: deque, fetched_for: dict[int, int], c: Coordinator) -> None:
    """``fetch_sub_module``'s prefetch: pop the parameter queue until the elements taken reach
    min(max live - available, prefetch bucket); gather the popped parameters not gathered."""
    limit = min(c.max_live - rank.active, c.prefetch_bucket)
    taken: list[int] = []
    numel = 0
    while order and numel < limit:
        p, used = order.popleft()
        fetched_for[p] = max(fetched_for.get(p, -10**10), used)
        if not rank.gathered(p) and p not in taken:
            taken.append(p)
            numel += rank.sizes[p]
    rank.gather(taken)


def _released(p: int, step: int, trace: tuple[Use, ...], sizes: tuple[int, ...],
              c: Coordinator, keep: frozenset[int], fetched_for: dict[int, int],
              complete: bool) -> bool:
    """``__params_to_release`` for the module of parameter ``p`` released at ``step`` (the
    coordinator's step counter after the module's fetch)."""
    if not complete:
        return True
    if p in keep or fetched_for.get(p, -10**10) > step:
        return False
    traversed = 0
    for use in trace[step:]:
        if traversed >= c.reuse_distance:
            break
        if use.param == p:
            return False
        traversed += sizes[use.param] if use.param >= 0 else 0
    return True


# a transformers Llama decoder layer's modules in forward order (traced: the coordinator's
# recorded trace), as indices of its 9 tensors (norm, q, k, v, o, norm, gate, up, down); -1
# the modules without parameters: the layer, its attention, its MLP, the activation
_LLAMA_LAYER = (-1, 0, -1, 1, 2, 3, 4, 5, -1, 6, -1, 7, 8)
# ... and in backward (each module's pre-backward hook, when its output's gradient is made)
_LLAMA_LAYER_BACKWARD = (-1, -1, 8, 7, -1, 6, 5, -1, 4, 3, 2, 1, 0)
# the blocks of a Llama layer (memplan.model.layer.layer_blocks: its norm, attention, norm,
# MLP), each from the run of its first module with parameters to the next one's; a module
# without parameters before it (the layer, the attention, the MLP) is the block before's,
# the layer's own the first block's
LLAMA_BLOCKS = ("attn_norm", "attn", "mlp_norm", "mlp")
_LLAMA_LAYER_BLOCK = (0, 0, 0, 1, 1, 1, 1, 2, 2, 3, 3, 3, 3)
# the MLP's steps (memplan.model.mlp.working_steps) at its modules' runs: the gate
# projection, the activation, the up projection, the down projection at their own (the
# replay's ``at``); the product after the up projection's release (``after``), before the
# down projection's fetch
_LLAMA_MLP_STEPS = (("gate", 9, True), ("act", 10, True), ("up", 11, True),
                    ("prod", 11, False), ("down", 12, True))


class Trace(NamedTuple):
    """A step's module runs (``uses``) and where each falls (``where``): "forward",
    "layer" (a layer's forward), "head" (the final norm's and the head's forward), "loss"
    (the root's backward hook, before the loss's backward), "head_backward", the index of
    the layer whose backward (or recomputation) it is, "embedding_backward"; in a Llama
    layer's forward the block each runs in (``block``: an index of ``LLAMA_BLOCKS``, -1
    elsewhere). ``layer_runs``: the runs of one layer's forward (0: a plain Llama layer's,
    ``_LLAMA_LAYER``); ``mlp_steps``: the MLP's steps at those runs (``_LLAMA_MLP_STEPS``)."""

    uses: tuple[Use, ...]
    where: tuple[str | int, ...]
    block: tuple[int, ...] = ()
    layer_runs: int = 0
    mlp_steps: tuple[tuple[str, int, bool], ...] = _LLAMA_MLP_STEPS


def llama_trace(num_tensors: int, embedding_tensors: int, layer_tensors: tuple[int, ...],
                head_tensors: int, recomputed: tuple[bool, ...] = (),
                tied: bool = False) -> Trace:
    """The module runs of one training step of a decoder-only model as DeepSpeed records them
    (traced, a transformers Llama ``LlamaForCausalLM``: forward the root, the model, the
    embedding, the rotary embedding, each layer's modules (``_LLAMA_LAYER``), the final norm,
    the head; backward the root, the head, the model, the final norm, each layer's
    (``_LLAMA_LAYER_BACKWARD``) last to first, the embedding). ``num_tensors`` parameter
    tensors in forward order: the embedding's, each layer's (``layer_tensors`` of each), the
    final norm's and the head's (``head_tensors``; with ``tied`` embeddings the head module
    uses the embedding's weight). A layer of other than 9 tensors is its container and its
    tensors in order, each its own module. A layer whose activations are recomputed
    (``recomputed``, per layer) runs its forward again inside its backward."""
    spans, start = [], embedding_tensors
    for n in layer_tensors:
        spans.append(list(range(start, start + n)))
        start += n
    norm = list(range(start, num_tensors))  # the final norm's (and the head's, untied)
    proj = norm.pop() if not tied else 0
    uses: list[Use] = []
    where: list[str | int] = []
    block: list[int] = []

    def add(items: list[Use], at: str | int, blocks: tuple[int, ...] = ()) -> None:
        uses.extend(items)
        where.extend([at] * len(items))
        block.extend(blocks or [-1] * len(items))

    def layer(span: list[int], forward: bool) -> list[Use]:
        if len(span) != 9:
            ids = span if forward else span[::-1]
            return [Use(-1, forward)] + [Use(i, forward) for i in ids]
        order = _LLAMA_LAYER if forward else _LLAMA_LAYER_BACKWARD
        return [Use(span[k] if k >= 0 else -1, forward) for k in order]

    add([Use(-1, True), Use(-1, True)] + [Use(i, True) for i in range(embedding_tensors)]
        + [Use(-1, True)], "forward")  # the root, the model, the embedding, rotary
    for span in spans:
        add(layer(span, True), "layer", _LLAMA_LAYER_BLOCK if len(span) == 9 else ())
    add([Use(i, True) for i in norm] + [Use(proj, True)], "head")
    add([Use(-1, False)], "loss")
    add([Use(proj, False), Use(-1, False)] + [Use(i, False) for i in norm[::-1]],
        "head_backward")
    for index in reversed(range(len(spans))):
        back = layer(spans[index], False)
        if index < len(recomputed) and recomputed[index]:
            # non-reentrant checkpointing (the Trainer's): the recomputation runs when the
            # layer's first backward node unpacks what it saved, after the pre-backward hooks
            # of the layer (and, for a Llama layer, its MLP and the down projection, whose
            # release follows the recomputation: traced)
            again = [u._replace(recompute=True) for u in layer(spans[index], True)]
            cut = 3 if len(spans[index]) == 9 else 1
            first = back[cut - 1]
            back = (back[:cut - 1] + [first._replace(release=False)] + again
                    + [first._replace(fetch=False)] + back[cut:])
        add(back, index)
    add([Use(i, False) for i in reversed(range(embedding_tensors))], "embedding_backward")
    return Trace(tuple(uses), tuple(where), tuple(block))


class Positions(NamedTuple):
    """Bytes gathered at the walk's positions in one step (``steady_positions``)."""

    in_layer: int  # the most beside a layer's forward
    at_loss: int  # at the loss (the head released, the backward not started)
    loss_backward: int  # at the loss's backward (the root's backward hook has prefetched)
    head: int  # at the head's backward (and the final norm's)
    in_block: int  # the most beside a layer's backward (its recomputation included), the
    #                stage's first layer's left out
    in_first_block: int  # ... the first layer's
    embedding: int  # at the embedding's backward
    persistent: int  # the persistent parameters (gathered from the first step's end on)
    block_hooks: Any = None  # ``HookGathers`` of a layer's backward, the most over the layers
    #                          of ``in_block``; None where a layer is recomputed
    first_block_hooks: Any = None  # ... of the stage's first layer
    layer_blocks: tuple[tuple[str, int], ...] = ()  # the most beside each block of a layer's
    #                                                 forward, over the layers (``LLAMA_BLOCKS``
    #                                                 order); () where a layer is not Llama's


class HookGathers(NamedTuple):
    """Bytes gathered through a layer's backward by its gradient hooks (its tensors in
    reverse registration order, the order the hooks run): ``at`` each hook (its module's
    backward, after the module's fetch), and ``between`` (one more) the most from the
    layer's backward start to the first hook's module, between two hooks' modules, and from
    the last one to the layer's end (``_hook_gathers``)."""

    at: tuple[int, ...]
    between: tuple[int, ...]


def positions(sizes: tuple[int, ...], trace: Trace, c: Coordinator, dp: int,
              itemsize: int, complete: bool = True) -> Positions:
    """``replay`` of ``trace`` read at the walk's positions."""
    r = replay(sizes, trace.uses, c, dp, itemsize, complete)

    def most(pick) -> int:
        return max((v for v, w in zip(r.at, trace.where) if pick(w)), default=0)

    head_end = max(i for i, w in enumerate(trace.where) if w == "head")
    keep = persistent(sizes, c) if complete else frozenset()
    hooks = _hook_gathers(trace, r.at)
    return Positions(
        in_layer=most(lambda w: w == "layer"), at_loss=r.after[head_end],
        loss_backward=most(lambda w: w == "loss"), head=most(lambda w: w == "head_backward"),
        in_block=most(lambda w: isinstance(w, int) and w > 0),
        in_first_block=most(lambda w: w == 0),
        embedding=most(lambda w: w == "embedding_backward"),
        persistent=sum(sizes[i] for i in keep) * itemsize,
        block_hooks=_most_of([v for w, v in hooks.items() if w > 0]),
        first_block_hooks=hooks.get(0), layer_blocks=_layer_blocks(trace, r))


def _layer_blocks(trace: Trace, r: Replayed) -> tuple[tuple[str, int], ...]:
    """``Positions.layer_blocks`` from the replay's bytes each run: a block's tensors exist
    from its first module's run (its fetch done, its prefetch included) to the next block's,
    what is gathered then at most the most at those runs; the MLP's steps
    (``mlp.<step>``, ``_LLAMA_MLP_STEPS``) each at its own run, the most over the layers."""
    runs = [k for k, w in enumerate(trace.where) if w == "layer"]
    if not runs or any(trace.block[k] < 0 for k in runs):
        return ()
    blocks = [(name, max(r.at[k] for k in runs if trace.block[k] == i))
              for i, name in enumerate(LLAMA_BLOCKS)]
    size = trace.layer_runs or len(_LLAMA_LAYER_BLOCK)
    layers = [runs[a:a + size] for a in range(0, len(runs), size)]
    steps = [(f"mlp.{name}", max((r.at if at else r.after)[layer[k]] for layer in layers))
             for name, k, at in trace.mlp_steps]
    return tuple(blocks + steps)


def _hook_gathers(trace: Trace, at: tuple[int, ...]) -> dict[int, HookGathers | None]:
    """Per layer (its index), ``HookGathers`` of its backward from the replay's bytes ``at``
    each run: a weight's gradient hook (stage3.py ``reduce_independent_p_g_buckets_and_
    remove_grads``, from its ``AccumulateGrad``) runs inside its module's backward, after the
    module's fetch (``fetch_sub_module``, its pre-backward hook) and before its release (its
    post-backward hook). None for a recomputed layer (its recomputation's gathers are not
    placed among the hooks)."""
    runs: dict[int, list[tuple[Use, int]]] = {}
    for use, w, held in zip(trace.uses, trace.where, at):
        if isinstance(w, int) and not use.forward:
            runs.setdefault(w, []).append((use, held))
    recomputed = {w for use, w in zip(trace.uses, trace.where)
                  if isinstance(w, int) and use.recompute}
    out: dict[int, HookGathers | None] = {}
    for w, seq in runs.items():
        if w in recomputed:
            out[w] = None
            continue
        marks = sorted(((use.param, k) for k, (use, _) in enumerate(seq) if use.param >= 0),
                       reverse=True)  # the hooks' order: reverse registration order
        points = [k for _, k in marks]
        if points != sorted(points):  # modules not in the hooks' order: no profile
            out[w] = None
            continue
        held = [h for _, h in seq]
        edges = [-1, *points, len(seq)]
        between = tuple(max(held[a + 1:b], default=0) for a, b in zip(edges, edges[1:]))
        out[w] = HookGathers(tuple(held[k] for k in points), between)
    return out


def _most_of(layers: list[HookGathers | None]) -> HookGathers | None:
    """Elementwise the most of the layers' ``HookGathers`` (None if any is None or they
    differ in length)."""
    if not layers or any(v is None for v in layers) or len({len(v.at) for v in layers}) > 1:
        return None
    return HookGathers(tuple(map(max, *(v.at for v in layers))) if len(layers) > 1
                       else layers[0].at,
                       tuple(map(max, *(v.between for v in layers))) if len(layers) > 1
                       else layers[0].between)


def zero3_coordinator(wl: Any) -> Coordinator:
    """The coordinator a workload sets (``Workload.zero3_*_numel``)."""
    return Coordinator(prefetch_bucket=wl.zero3_prefetch_numel,
                       max_live=wl.zero3_max_live_numel,
                       reuse_distance=wl.zero3_reuse_distance_numel,
                       persistence_threshold=wl.zero3_persistence_numel)


def layer_tensor_counts(tensor_sizes: tuple[int, ...], first: int,
                        layers: tuple[int, ...]) -> tuple[int, ...]:
    """How many of ``tensor_sizes`` (from index ``first``) make each layer of ``layers``
    elements."""
    counts, i = [], first
    for numel in layers:
        n, total = 0, 0
        while total < numel and i + n < len(tensor_sizes):
            total += tensor_sizes[i + n]
            n += 1
        counts.append(n)
        i += n
    return tuple(counts)


def coordinator_positions(params: Any, wl: Any, c: Coordinator, dp: int, itemsize: int,
                          complete: bool = True) -> Positions:
    """``positions`` of a stage's parameters (``memplan.model.model_states.StageParams``) under
    the coordinator ``c`` from step 2 on (``complete``; else in step 1): the Llama module trace (``llama_trace``), every
    layer's forward run again before its backward under full recompute (a checkpointed
    layer)."""
    counts = layer_tensor_counts(params.tensor_sizes, params.embedding_tensors, params.layers)
    recomputed = _recomputed(wl, len(counts))
    # tied embeddings: the stage's last tensor is the final norm's (one dimension)
    tied = (len(params.tensor_shapes[-1]) == 1 if params.tensor_shapes
            else params.head_tensors < 2)
    trace = _cached_trace(len(params.tensor_sizes), params.embedding_tensors, counts,
                          params.head_tensors, recomputed, tied)
    return _cached_positions(params.tensor_sizes, trace, c, dp, itemsize, complete)


def _recomputed(wl: Any, n: int) -> tuple[bool, ...]:
    """Which of a stage's ``n`` layers full recompute checkpoints: all, the first
    ``recompute_layers``, or every ``recompute_every``-th (as ``memplan.model.stage_parts.
    layer_recompute`` reads them)."""
    if wl.recompute is not Recompute.FULL:
        return (False,) * n
    if wl.recompute_layers is not None:
        return tuple(i < wl.recompute_layers for i in range(n))
    if wl.recompute_every is not None:
        return tuple((i + 1) % wl.recompute_every == 0 for i in range(n))
    return (True,) * n


@lru_cache(maxsize=64)
def _cached_trace(*args: Any) -> Trace:
    return llama_trace(*args)


@lru_cache(maxsize=64)
def _cached_positions(sizes: tuple[int, ...], trace: Trace, c: Coordinator, dp: int,
                      itemsize: int, complete: bool) -> Positions:
    return positions(sizes, trace, c, dp, itemsize, complete)


# --- peft's LoRA: each adapted projection a wrapper of four modules ----------------------------

# a Llama layer's projections in memplan's tensor order, each after the block's norm
LLAMA_PROJECTIONS = ("q", "k", "v", "o", "gate", "up", "down")


def lora_layer_sizes(layer: tuple[int, ...], adapters: tuple[tuple[int, int] | None, ...]
                     ) -> tuple[int, ...]:
    """A Llama layer's 9 tensors (norm, q, k, v, o, norm, gate, up, down) with each adapted
    projection's ``lora_A`` and ``lora_B`` (``adapters``: per projection of
    ``LLAMA_PROJECTIONS``, their elements, or None) after its base weight."""
    out = [layer[0]]
    for j, name in enumerate(LLAMA_PROJECTIONS):
        if name == "gate":
            out.append(layer[5])
        out.append(layer[1 + j + (1 if j >= 4 else 0)])
        if adapters[j] is not None:
            out += list(adapters[j])
    return tuple(out)


def _lora_index(start: int, adapted: tuple[bool, ...]) -> dict[str, list[int]]:
    """A peft-wrapped Llama layer's tensors from ``start``: each projection's (its base, and
    lora_A, lora_B where adapted) and the norms', in ``lora_layer_sizes``' order."""
    ids, k = {"norm": [start]}, start + 1
    for j, name in enumerate(LLAMA_PROJECTIONS):
        if name == "gate":
            ids["norm2"] = [k]
            k += 1
        n = 3 if adapted[j] else 1
        ids[name] = list(range(k, k + n))
        k += n
    return ids


def _lora_forward(ids: dict[str, list[int]], steps: list[tuple[str, int, bool]] | None
                  ) -> tuple[list[Use], list[int]]:
    """A peft-wrapped Llama layer's forward runs and the block of each; ``steps`` (when
    given) gets the MLP's steps at them (``Trace.mlp_steps``: the base projections' runs, the
    adapters' sums after their lora_B, the activation, the product)."""
    out: list[tuple[int, int]] = [(-1, 0), (ids["norm"][0], 0), (-1, 0)]

    def step(name: str, at: bool) -> None:
        if steps is not None:
            steps.append((name, len(out) - 1, at))

    def proj(name: str, b: int) -> None:
        t = ids[name]
        if len(t) == 1:
            out.append((t[0], b))
            if b == 3:
                step(name, True)
            return
        out.extend([(-1, b), (t[0], b)])
        if b == 3:
            step(name, True)
        out.extend([(-1, b), (t[1], b), (t[2], b)])
        if b == 3:
            step(f"{name}_lora", False)

    for name in ("q", "k", "v", "o"):
        proj(name, 1)
    out += [(ids["norm2"][0], 2), (-1, 2)]
    proj("gate", 3)
    out.append((-1, 3))
    step("act", True)
    proj("up", 3)
    step("prod", False)  # the product after the up projection's (its adapter's) release
    if len(ids["up"]) == 3:
        step("lora", False)  # the up projection's adapter sum (layer.by_block's mlp.lora)
    proj("down", 3)
    return [Use(p, True) for p, _ in out], [b for _, b in out]


def _lora_backward(ids: dict[str, list[int]], first: bool) -> list[Use]:
    """A peft-wrapped Llama layer's backward runs; ``first``: its input needs no gradient
    (the input norm and the q, k, v bases and dropouts run no backward)."""
    out = [-1, -1]

    def proj(name: str) -> None:
        t, skip = ids[name], first and name in ("q", "k", "v")
        if len(t) == 3:
            out.extend([-1, t[2], t[1]])
        if not skip:
            out.extend([-1, t[0]] if len(t) == 3 else [t[0]])

    proj("down")
    proj("up")
    out.append(-1)
    proj("gate")
    out += [ids["norm2"][0], -1]
    for name in ("o", "v", "k", "q"):
        proj(name)
    if not first:
        out.append(ids["norm"][0])
    return [Use(p, False) for p in out]


def _lora_recomputed(ids: dict[str, list[int]], back: list[Use]) -> list[Use]:
    """``back`` with the layer's recomputation, after the down projection's lora_B hook (its
    base's where not adapted), the frozen weights it gathers released with that module
    (``Use.with_frozen``) and not after their own runs."""
    trainable = {t for name, t_ids in ids.items() if name not in ("norm", "norm2")
                 for t in t_ids[1:]}
    mlp = {ids[name][0] for name in ("gate", "up", "down")}
    again = [u._replace(recompute=True) for u in _lora_forward(ids, None)[0]]
    frozen = tuple(dict.fromkeys(u.param for u in again if u.param in mlp))
    again = [u._replace(release=u.param < 0 or u.param in trainable) for u in again]
    cut = 4 if len(ids["down"]) == 3 else 3
    first = back[cut - 1]
    return (back[:cut - 1] + [first._replace(release=False)] + again
            + [first._replace(fetch=False, with_frozen=frozen)] + back[cut:])


def llama_lora_trace(num_tensors: int, embedding_tensors: int, layers: int,
                     adapted: tuple[bool, ...], head_tensors: int,
                     recomputed: tuple[bool, ...] = (), tied: bool = False) -> Trace:
    """``llama_trace`` of a peft-wrapped Llama (traced, DeepSpeed 0.19.8's recorded module
    trace on the toy): an adapted projection (``adapted``, per ``LLAMA_PROJECTIONS``) is
    peft's ``lora.Linear`` (no parameter of its own) running ``base_layer``, ``lora_dropout``
    (no parameter), ``lora_A``, ``lora_B`` in forward, and in backward (each module's
    pre-backward hook) the wrapper, ``lora_B``, ``lora_A``, the dropout and ``base_layer``;
    the root is two modules (peft's model and the transformers one). Without recompute the
    stage's first layer's input needs no gradient (a frozen embedding): its input norm and
    the base and dropout of the projections reading it (q, k, v) run no backward, nor does
    the embedding; with it (peft's ``enable_input_require_grads``) every module does, and a
    layer's recomputation follows the down projection's ``lora_B`` hook (its release after
    it; the frozen MLP weights it gathers are released with that module,
    partitioned_param_coordinator.py ``update_recompute_parameters``, the attention's at their
    own backward: traced). Tensors: the embedding's, each layer's (``lora_layer_sizes``), the
    final norm's and the head's (``head_tensors``)."""
    per = 9 + 2 * sum(adapted)
    uses: list[Use] = []
    where: list[str | int] = []
    block: list[int] = []
    steps: list[tuple[str, int, bool]] = []

    def add(items: list[Use], at: str | int, blocks: list[int] | None = None) -> None:
        uses.extend(items)
        where.extend([at] * len(items))
        block.extend(blocks if blocks is not None else [-1] * len(items))

    ids = [_lora_index(embedding_tensors + i * per, adapted) for i in range(layers)]
    head = list(range(embedding_tensors + layers * per, num_tensors))
    proj_head = head.pop() if not tied else 0
    add([Use(-1, True)] * 3 + [Use(i, True) for i in range(embedding_tensors)]
        + [Use(-1, True)], "forward")
    for i in range(layers):
        items, blocks = _lora_forward(ids[i], steps if i == 0 else None)
        add(items, "layer", blocks)
    add([Use(i, True) for i in head] + [Use(proj_head, True)], "head")
    add([Use(-1, False)] * 2, "loss")
    add([Use(proj_head, False), Use(-1, False)] + [Use(i, False) for i in head[::-1]],
        "head_backward")
    grads_in = any(recomputed)
    for i in reversed(range(layers)):
        back = _lora_backward(ids[i], i == 0 and not grads_in)
        add(_lora_recomputed(ids[i], back) if i < len(recomputed) and recomputed[i] else back,
            i)
    if grads_in:
        add([Use(i, False) for i in reversed(range(embedding_tensors))], "embedding_backward")
    return Trace(tuple(uses), tuple(where), tuple(block),
                 layer_runs=len(_lora_forward(ids[0], None)[0]) if ids else 0,
                 mlp_steps=tuple(steps))


def lora_stage_sizes(params: Any, adapted: tuple[bool, ...],
                     adapters: tuple[int, ...]) -> tuple[int, ...] | None:
    """A stage's parameter tensors with peft's adapters, in ``llama_lora_trace``'s order: the
    embedding's, each Llama layer's (``lora_layer_sizes``; ``adapters``, the stage's adapter
    tensors, lora_A then lora_B per adapted projection, layer by layer), the final norm's
    and the head's. None where a layer is not a Llama layer of 9 tensors."""
    counts = layer_tensor_counts(params.tensor_sizes, params.embedding_tensors, params.layers)
    if not counts or any(n != 9 for n in counts):
        return None
    out = list(params.tensor_sizes[:params.embedding_tensors])
    start, a = params.embedding_tensors, iter(adapters)
    for _ in counts:
        pairs = tuple((next(a), next(a)) if on else None for on in adapted)
        out += lora_layer_sizes(params.tensor_sizes[start:start + 9], pairs)
        start += 9
    return (*out, *params.tensor_sizes[start:])


def lora_positions(params: Any, wl: Any, c: Coordinator, dp: int, itemsize: int,
                   adapted: tuple[bool, ...], adapters: tuple[int, ...],
                   complete: bool = True) -> tuple[Positions, int] | None:
    """``coordinator_positions`` of a peft-wrapped Llama stage (``llama_lora_trace`` over
    ``lora_stage_sizes``), and the persistent parameters' bytes (the adapters among them);
    None where the stage is not one of Llama layers."""
    sizes = lora_stage_sizes(params, adapted, adapters)
    if sizes is None:
        return None
    n = len(params.layers)
    tied = (len(params.tensor_shapes[-1]) == 1 if params.tensor_shapes
            else params.head_tensors < 2)
    trace = llama_lora_trace(len(sizes), params.embedding_tensors, n, adapted,
                             params.head_tensors, _recomputed(wl, n), tied)
    kept = sum(sizes[i] for i in persistent(sizes, c)) * itemsize
    return positions(sizes, trace, c, dp, itemsize, complete), kept

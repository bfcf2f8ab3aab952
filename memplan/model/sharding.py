"""The data-parallel mechanism's moments in a stage's forward and backward: what it holds
beside each block and the instants of its own (gathers, reduce-scatters), for one rank, in
bytes.

``DataParallel`` is the policy a stage reads (built once per layout from
``memplan.model.model_states.ShardingBuffers``, completed per micro-batch by ``with_stream``);
``forward_positions``, ``head_moments``, ``run_positions``, ``end_moments`` and
``step_end_moments`` emit its part of
the forward and the backward in execution order, which ``memplan.model.walk`` lays beside the
blocks' own moments. Three mechanisms share the vocabulary:

- replicated gradients (DDP, ZeRO-1): nothing beside the blocks;
- one buffer of unsharded gradients awaiting their reduce-scatter (ZeRO-2's reduce bucket, at
  most ``grad_cap``): beside each block, the gradients made so far unsharded, beyond the shard
  they become;
- FSDP2 units (``per_unit``): each unit's gradients unsharded (in the weights' dtype) until its
  own reduce-scatter after its backward, whose input is held until the next unit's; the root
  (embedding, final norm, head) reduce-scattered at the end, or, with separate units
  (torchtitan), the head's and the embedding's units after their own backward; gathered
  weights beside every block (the block and the one its backward prefetches); under pipeline
  parallelism (kept gathered) every unit gathered throughout, gradients as plain accumulators
  until the step's reduce after its last micro-batch;
- units as buckets (``queued_whole``): as the reduce buffer, the gradients made so far
  unsharded up to the queue's capacity, whole beside the persistent shard, and a window of
  gathered units beside each block (``memplan.model.fsdp_buckets``).

Gradient bytes come in as this rank's held (sharded) bytes; ``unsharded_ratio`` (unsharded /
held, exact: an int where whole, else a ``Fraction``) turns them into the unsharded bytes the mechanism holds, whole
bytes rounded down.
"""

from __future__ import annotations

from fractions import Fraction
from typing import Any, NamedTuple

from memplan.model.dims import exact_ratio, whole_bytes
from memplan.model.layer import LayerMoment
from memplan.model.model_states import ShardingBuffers
from memplan.model.moments import Event
from memplan.workload import PrecisionPolicy


class DataParallel(NamedTuple):
    """How one stage's data-parallel mechanism holds weights and gradients in forward and
    backward (bytes on one rank; 0 where it holds nothing)."""

    grad_cap: int = 0  # most unsharded gradient bytes awaiting a reduce-scatter
    unsharded_ratio: int | Fraction = 1  # unsharded / held gradient bytes (the shard
    #                                          degree), exact
    per_unit: bool = False  # FSDP2: a unit's gradients unsharded until its own reduce-scatter,
    #                         whose input is held (beside its shard) until the next unit's
    unsharded_dtype: int | Fraction = 1  # FSDP2: bytes of an unsharded gradient (the
    #                                          weights' dtype) per byte of its reduce dtype
    at_head: int = 0  # weights gathered at the loss and the head
    at_final_norm: int | None = None  # ... at the final norm's backward (None: ``at_head``;
    #                                   DeepSpeed's ZeRO-3 under LoRA: the head released)
    head_prefetch: int = 0  # ... of them, the block the head's unit prefetches, gathered only
    #                         after the loss's backward
    head_regather: int = 0  # the head's unit's all-gather output beside its unsharded weights
    #                         where a loss that runs the head's backward resharded the unit
    #                         and the backward gathers it again (``ShardingBuffers.
    #                         backward_head_regather_bytes``; the head counts it only then)
    in_block: int = 0  # ... while a block's backward runs
    in_first_block: int = 0  # ... while the stage's first block (the last in backward) runs
    at_embedding: int = 0  # ... at the embedding
    separate_units: bool = False  # FSDP2: the embedding and the head are units of their own,
    #                               each reduce-scattered after its backward
    reduce_copies: int = 0  # FSDP2 at shard degree 1: unit-sized reduce-dtype tensors alive at
    #                         a unit's reduce (its input, its output, which becomes the
    #                         gradient, and a divided copy); 0 where no such moment is modelled
    boundary_grad: int = 0  # ... and the gradient of the unit's input, alive beside them
    in_block_forward: int = 0  # weights gathered while a block runs forward
    at_loss_forward: int = 0  # ... at the final norm and the loss
    block_start: int = 0  # ... at a block's start (its gather, before it computes), beside
    #                       the residual stream it is about to read; 0: not modelled
    first_block_start: int = 0  # ... at the stage's first block's start
    queued_whole: bool = False  # the waiting gradients are whole buckets beside the shard
    window_units: int = 0  # units gathered at once in forward, fewer over the stage's last
    #                        blocks (nothing after them to prefetch); 0: not modelled
    window_unit: int = 0  # ... the gathered bytes of one of them
    at_reduce: int = 0  # FSDP1: weights gathered at a block's reduce-scatter
    kept_layer: int = 0  # FSDP1 SHARD_GRAD_OP: a block's gathered bytes, alive from its
    #                      gather in forward to its post-backward
    kept_layers: int = 0  # ... every block's, alive from the forward's end
    prefetch_tail: int = 0  # FSDP1 with LoRA's adapter units: the block before, gathered at a
    #                         block's ``PREFETCH_TAIL`` moments (but the stage's first's)
    flat: bool = False  # FSDP1 (``memplan.model.fsdp1``): a unit's reduce-scatter input is
    #                     its unsharded gradient itself, or its copy in the reduce dtype where
    #                     that differs, and it and the output shard are dropped in the unit's
    #                     own post-backward hook; nothing is held to the next unit's
    step_reduce: int = 0  # kept gathered under PP: a unit's reduce-scatter input and output
    #                       shard at the step's reduce, after its last micro-batch's backward
    #                       (0: no such moment)
    fresh_only: bool = False  # gradients copied away at their hooks: a moment holds only
    #                           the weight gradients just made, in every micro-batch
    partition: int = 0  # gradients held whole from one point of the backward on, not growing
    #                     with the gradients made (the walk's own gradients are then 0)
    partition_from: int = 0  # ... that point: -1 the head's backward (after the loss's), i
    #                          the i-th block in backward; beyond the blocks it is the end's
    #                          gradients (the walk's grads_total)
    zero3_hooks: bool = False  # DeepSpeed's ZeRO-3: each weight's fresh gradient alive until
    #                            its hook copies it into the bucket; a bucket reduce runs in
    #                            a hook, its bytes beside the hook's moment (``block_peak``)
    reduces: Any = None  # ... the reduces (deepspeed_zero.Zero3ReducesAt): the first at a
    #                      hook of block ``partition_from``, the later ones' by hook
    layer_hooks: tuple[int, ...] = ()  # ... a layer's tensors in the order of their hooks
    hook_gathers: Any = None  # ... what the coordinator holds gathered at and between them
    #                           (deepspeed_coordinator.HookGathers; in_block's layers)
    first_hook_gathers: Any = None  # ... the stage's first layer's (in_first_block's)
    forward_blocks: tuple[tuple[str, int], ...] = ()  # ... gathered beside each block of a
    #                                                   layer's forward (of which
    #                                                   in_block_forward is the most)
    root_last: int = 0  # FSDP2: the root unit's last parameter's gradient (held bytes), alive
    #                     past its unsharded_grads.clear() to foreach_reduce's return
    #                     (``root_last_grad``)
    fresh_grad: int = 0  # gradients accumulated by autograd into existing ones: bytes per
    #                      element of a weight's new gradient, alive beside them at the
    #                      moment that made it (``accumulated_fresh``); 0: not modelled

    # Bytes are made from bytes in integer arithmetic on the ratios' numerators and
    # denominators (gradient bytes are never negative): exact, and no Fraction is built.

    def unsharded(self, held: int) -> int:
        """Unsharded bytes, in the reduce dtype, of ``held`` gradient bytes."""
        r = self.unsharded_ratio
        return held * r.numerator // r.denominator

    def shard_of(self, unsharded: int) -> int:
        """This rank's shard, in held bytes, of ``unsharded`` gradient bytes."""
        r = self.unsharded_ratio
        return unsharded * r.denominator // r.numerator

    def buffer(self, made: int) -> int:
        """Beyond the shard, the gradients made so far waiting unsharded (at most the cap);
        whole buckets (``queued_whole``) are all beyond it."""
        if not self.grad_cap:  # gradients replicated: nothing waits
            return 0
        waiting = min(self.grad_cap, self.unsharded(made))
        r = self.unsharded_ratio
        if r.numerator > r.denominator and not self.queued_whole:
            return waiting - self.shard_of(waiting)
        return waiting

    def root(self, made: int) -> int:
        """FSDP2's root gradients unsharded, in the weights' dtype, beyond their shard."""
        return self.unit_grads(made) - made

    def unit_grads(self, held: int) -> int:
        """A unit's gradients unsharded, in the weights' dtype."""
        r, d = self.unsharded_ratio, self.unsharded_dtype
        return held * r.numerator * d.numerator // (r.denominator * d.denominator)

    def reduced(self, unit: int) -> int:
        """A unit's reduce at shard degree 1, beyond the gradients held before it."""
        return self.reduce_copies * self.unsharded(unit) + self.boundary_grad

    def block_peak(self, moments: tuple[LayerMoment, ...], grads: tuple[int, ...],
                   growing: bool, reduce: tuple[int, ...] = (), gathers: Any = None,
                   beside: int = 0) -> int:
        """A layer's largest moment in backward: its alive and transient bytes at each, with
        its own gradients made by then (``grads``, held bytes) as the mechanism holds them:
        FSDP2's unsharded in the weights' dtype (capped at a unit), else as held where they
        are new this backward (accumulated into existing ones otherwise). DeepSpeed's ZeRO-3
        (``zero3_hooks``): the fresh weight gradient at each moment, and a bucket reduce's
        bytes at the moment of the hook it runs in (``reduce``: by hook, the layer's tensors
        in backward order, ``hook_moments``), the node that made the gradient having freed
        its saved input (``LayerMoment.hook_freed``). With ``gathers`` (the coordinator's
        ``HookGathers`` of the block) each moment holds what is gathered at it
        (``moment_gathers``) where the block is counted with ``beside``: the difference is
        taken off."""
        if self.zero3_hooks:
            ks = hook_moments(moments, self.layer_hooks)
            less = tuple(max(0, beside - held)
                         for held in moment_gathers(ks, len(moments), gathers, beside))
            most = max(m.alive_bytes + m.transient_bytes + g - off
                       for m, g, off in zip(moments, grads, less))
            extra = dict.fromkeys(range(len(moments)), 0)
            for k, made in zip(ks, reduce):
                if k is not None:
                    extra[k] = max(extra[k], made)
            return max([most, *(m.alive_bytes - m.hook_freed + m.transient_bytes + g + extra[k]
                                - less[k]
                                for k, (m, g) in enumerate(zip(moments, grads)) if extra[k])])
        if self.per_unit:
            r, d = self.unsharded_ratio, self.unsharded_dtype
            # min(cap, g x r) x d, whole bytes: the cap and g x r over r's denominator
            cap, num = self.grad_cap * r.denominator, d.numerator
            den = r.denominator * d.denominator
            rn = r.numerator
            if gathers is PREFETCH_TAIL and self.prefetch_tail:
                tail = self.prefetch_tail
                return max(m.alive_bytes + m.transient_bytes + min(cap, g * rn) * num // den
                           + (tail if m.name in PREFETCH_TAIL else 0)
                           for m, g in zip(moments, grads))
            return max([m.alive_bytes + m.transient_bytes + min(cap, g * rn) * num // den
                        for m, g in zip(moments, grads)])
        # gradients copied away at their hooks: the moments hold the fresh weight gradients
        # alone, in every micro-batch (``fresh_only``)
        if growing or self.fresh_only:
            return max([m.alive_bytes + m.transient_bytes + g for m, g in zip(moments, grads)])
        # accumulated into existing gradients: the weight gradient a moment just made is in
        # flight beside them until its AccumulateGrad adds it in (``accumulated_fresh``)
        fresh = self.fresh_grad
        return max([m.alive_bytes + m.transient_bytes + m.fresh_params * fresh
                    for m in moments])

    def layer_forward(self, blocks: tuple[tuple[str, int], ...], peak: int,
                      beside: int) -> int:
        """A layer's forward peak (``peak``, its blocks' ``blocks``: ``LayerKind.
        forward_blocks``) beside ``beside`` gathered bytes: with what is gathered at each of
        its blocks (``forward_blocks``, DeepSpeed's ZeRO-3 coordinator, where ``beside`` is
        the most of them) each block's peak beside its own, a block's step (``mlp.prod``)
        beside the step's where given, else its block's; else ``peak`` beside ``beside``."""
        if not self.forward_blocks:
            return peak + beside
        gathered = dict(self.forward_blocks)
        if (beside != self.in_block_forward
                or _block_names(k for k, _ in blocks) != _block_names(gathered)):
            return peak + beside
        return max(p + gathered.get(k, gathered[k.split(".")[0]]) for k, p in blocks)

    @property
    def at_loss(self) -> int:
        """Weights gathered at the loss's backward: the head's, before its unit prefetches."""
        return self.at_head - self.head_prefetch

    @property
    def reduce_at_block(self) -> bool:
        """FSDP2's root-unit reduce-scatter moments of every block (not at shard degree 1)."""
        return self.per_unit and not self.reduce_copies and not self.separate_units


def _block_names(keys: Any) -> list[str]:
    """The blocks of ``forward_blocks`` keys (a block, or ``block.step``), in order."""
    return list(dict.fromkeys(k.split(".")[0] for k in keys))


def hook_moments(moments: tuple[LayerMoment, ...], hooks: tuple[int, ...]
                 ) -> tuple[int | None, ...]:
    """The moment (index into ``moments``) where each of a layer's gradient hooks runs
    (``hooks``: its tensors' elements in backward order): a hook whose tensor is the weight of
    the next moment with a fresh gradient (``fresh_params``, the same elements) runs there;
    the others (norms, and weights whose moment is not modelled) at the last such moment
    matched, or the first with a fresh gradient before any: the most loaded of those that
    can hold it."""
    fresh = [k for k, m in enumerate(moments) if m.fresh_params]
    if not fresh:
        return (None,) * len(hooks)
    out, at, nxt = [], fresh[0], 0
    for numel in hooks:
        if nxt < len(fresh) and moments[fresh[nxt]].fresh_params == numel:
            at, nxt = fresh[nxt], nxt + 1
        out.append(at)
    return tuple(out)


def moment_gathers(ks: tuple[int | None, ...], n: int, gathers: Any,
                   beside: int) -> tuple[int, ...]:
    """Bytes gathered at each of a block's ``n`` backward moments, its hooks at moments
    ``ks`` (``hook_moments``): at a moment with hooks, the most at those hooks and between
    them (``HookGathers``); at one without, the most from the hook before it to the hook
    after it. ``beside`` at every moment without ``gathers`` or where the hooks are not all
    placed."""
    if gathers is None or len(gathers.at) != len(ks) or None in ks or not ks:
        return (beside,) * n
    at, between = gathers.at, gathers.between
    out = []
    for k in range(n):
        mine = [j for j, m in enumerate(ks) if m == k]
        if mine:
            lo, hi = mine[0], mine[-1]
            out.append(max([*at[lo:hi + 1], *between[lo + 1:hi + 1]]))
            continue
        before = [j for j, m in enumerate(ks) if m < k]
        after = [j for j, m in enumerate(ks) if m > k]
        span = [between[before[-1] + 1 if before else 0]]
        span += [at[before[-1]]] if before else []
        span += [at[after[0]]] if after else []
        out.append(max(span))
    return tuple(out)


def data_parallel(shard: ShardingBuffers, params: int, grads_bytes: int,
                  policy: PrecisionPolicy) -> DataParallel:
    """A stage's mechanism from its sharding buffers, its ``params`` and its held gradient
    bytes (``grads_bytes``); the gradient of a unit's input (``boundary_grad``) depends on the
    micro-batch and is set by the stage."""
    if shard.kept_gathered:  # every unit gathered throughout; gradients as accumulators
        g = shard.gathered_bytes
        return DataParallel(at_head=g, in_block=g, in_first_block=g, at_embedding=g,
                            in_block_forward=g, at_loss_forward=g, step_reduce=shard.grad_bytes)
    return DataParallel(
        grad_cap=shard.grad_bytes,
        unsharded_ratio=exact_ratio(params * policy.grad_bytes, max(grads_bytes, 1)),
        # FSDP2 frees a unit's reduce-scatter input only when the next unit's reduce-scatter
        # waits on it (traced, tests/traced/test_ground_truth.py FSDP_GRID)
        per_unit=bool(shard.gathered_bytes) and not shard.queued_whole,
        queued_whole=shard.queued_whole,
        unsharded_dtype=exact_ratio(policy.unsharded.itemsize, policy.grad_bytes),
        # in backward FSDP2 holds the root and the block being computed (traced); with
        # torchtitan's units, the head's unit until its backward, one block, the embedding's
        in_block=shard.backward_block_bytes, in_first_block=shard.backward_last_block_bytes,
        at_head=shard.backward_head_bytes, at_embedding=shard.backward_end_bytes,
        at_final_norm=shard.backward_final_norm_bytes,
        head_prefetch=shard.backward_head_prefetch_bytes,
        head_regather=shard.backward_head_regather_bytes,
        separate_units=shard.separate_units, reduce_copies=shard.reduce_copies,
        in_block_forward=shard.gathered_bytes, at_loss_forward=shard.gathered_at_loss_bytes,
        block_start=shard.forward_start_bytes,
        first_block_start=shard.forward_first_start_bytes,
        window_units=shard.window_units, window_unit=shard.window_unit,
        partition=shard.partition_bytes, partition_from=shard.partition_from,
        zero3_hooks=shard.bucket_resident or shard.zero3_reduces is not None,
        reduces=shard.zero3_reduces,
        layer_hooks=shard.layer_hooks, hook_gathers=shard.hook_gathers,
        first_hook_gathers=shard.first_hook_gathers,
        forward_blocks=shard.forward_block_gathers,
        fresh_only=bool(shard.bucket_bytes),
        flat=shard.flat_units, at_reduce=shard.backward_reduce_bytes,
        kept_layer=shard.kept_layer_bytes, kept_layers=shard.kept_layers_bytes,
        prefetch_tail=shard.prefetch_tail_bytes)


def accumulated_fresh(dp: DataParallel, grad_bytes: int) -> DataParallel:
    """``dp`` where autograd adds each new weight gradient into an existing ``.grad`` (a later
    micro-batch's backward, or gradients kept zeroed): the new gradient, ``grad_bytes`` per
    element (the dtype it is made in), is alive beside the accumulated ones at the moment that
    made it (``LayerMoment.fresh_params``), as the first micro-batch's moment holds it.
    torch/csrc/autograd/functions/accumulate_grad.h ``AccumulateGrad::accumulateGrad``: with
    ``variable.grad`` defined and grad mode off, ``variable_grad += new_grad`` in place, and
    the new gradient (the weight's ``mm`` output in its node's backward, alive through the
    node: its input's gradient is made beside it) is freed after; the engine runs the
    weight's ``AccumulateGrad`` right after the node (torch/csrc/autograd/engine.cpp: its
    sequence number, UINT64_MAX, first in the ready queue). DDP changes nothing of it
    (torch/nn/parallel/distributed.py: the reducer's autograd hook runs after
    ``AccumulateGrad``, and copies ``.grad`` into its bucket, ``gradient_as_bucket_view``
    False). Traced: the reference model under DDP (dp 2, bf16, 3 blocks of 3.2M parameters,
    32 tokens, 3 micro-batches): the second micro-batch's down projection, 1,441,792 B.
    Mechanisms that copy gradients away at their hooks (``fresh_only``), FSDP2's units
    (``per_unit``: ``memplan.model.grad_sync.new_grads``) and DeepSpeed's ZeRO-3 hooks
    count theirs already."""
    if dp.fresh_only or dp.per_unit or dp.zero3_hooks or not grad_bytes:
        return dp
    return dp._replace(fresh_grad=grad_bytes)


def root_last_grad(dp: DataParallel, tensor_sizes: tuple[int, ...], embedding_tensors: int,
                   head_tensors: int, grad_per_param: int | Fraction) -> DataParallel:
    """``dp`` with the held bytes of the root unit's last parameter's gradient (FSDP2's
    per-unit reduce-scatter at the root; ``dp`` as it is otherwise), every parameter
    training. torch 2.13's ``foreach_reduce`` (torch/distributed/fsdp/_fully_shard/
    _fsdp_collectives.py) first walks ``zip(fsdp_params, unsharded_grads)`` to re-chunk the
    gradients not sharded on dim 0; its loop variable keeps the group's last gradient bound
    after ``unsharded_grads.clear()``, so that one is freed only when the function returns,
    after the reduce-scatter's output shard is made. The root's parameters in registration
    order: the embedding's, then the final norm's and the head's on the last stage, whose
    last tensor is the head's weight (untied) or the final norm's (traced: the reference GPT
    under FSDP2 at dp 2, the head's 4000 x 512 bf16 gradient alive at the root's
    reduce-scatter until foreach_reduce returns, tests/traced/test_ground_truth.py
    ``test_fsdp_root_reduce_scatter``)."""
    if not dp.reduce_at_block:
        return dp
    if head_tensors:
        last = tensor_sizes[-1]
    elif embedding_tensors:
        last = tensor_sizes[embedding_tensors - 1]
    else:
        return dp
    return dp._replace(root_last=whole_bytes(last, grad_per_param))


def with_stream(dp: DataParallel, stream: int) -> DataParallel:
    """``dp`` for one micro-batch whose residual stream is ``stream`` bytes: beside a unit's
    reduce-scatter the gradient of its input (FSDP2), beside a block's gather in forward the
    input it is about to read."""
    if not (dp.per_unit or dp.block_start or dp.flat):
        return dp
    return dp._replace(boundary_grad=stream if dp.per_unit or dp.flat else 0,
                       block_start=dp.block_start + stream if dp.block_start else 0,
                       first_block_start=dp.first_block_start + stream if dp.block_start
                       else 0)


def forward_positions(dp: DataParallel, n: int, stage_first: bool,
                      stage_last: bool = False) -> list[Position]:
    """A run of ``n`` identical blocks in forward: the weights gathered beside each block's
    compute and, where modelled, its gather at its start (the stage's first block's beside
    the root's or the embedding's all-gather output, not a block's); a window of units
    shrinks over the stage's last blocks (``stage_last``: the run ends the stage)."""
    if dp.window_unit and stage_last:
        return _shrinking(dp, n)
    if dp.kept_layer:  # each block's gathered weights stay alive after its forward
        start = dp.first_block_start if stage_first else dp.block_start
        return [Position(n, Event("unit.gather", dp.kept_layer, start), dp.in_block_forward,
                         None)]
    if not dp.block_start:
        return [Position(n, None, dp.in_block_forward, None)]
    start = Event("unit.gather", 0, dp.block_start)
    if not stage_first:
        return [Position(n, start, dp.in_block_forward, None)]
    return [Position(1, Event("unit.gather", 0, dp.first_block_start), dp.in_block_forward,
                     None),
            Position(n - 1, start, dp.in_block_forward, None)]


def _shrinking(dp: DataParallel, n: int) -> list[Position]:
    """The stage's last run of ``n`` blocks in forward with a window of ``window_units``:
    the i-th block (from 0) holds min(window, n - i) units. Where it shrinks, a block's bytes
    change by the same amount at each block (its saved activations up, a unit down), so its
    largest is at one of its ends: the blocks between them are given one unit, never above
    the ends."""
    full = dp.in_block_forward

    def at(units: int) -> int:
        return full - (dp.window_units - units) * dp.window_unit

    whole = max(0, n - dp.window_units + 1)  # blocks with the whole window
    rest = n - whole  # then rest, rest - 1, ..., 1 units
    positions = [Position(whole, None, full, None)] if whole else []
    if rest >= 2:
        positions.append(Position(1, None, at(rest), None))
    if rest >= 3:
        positions.append(Position(rest - 2, None, at(1), None))
    if rest >= 1:
        positions.append(Position(1, None, at(1), None))
    return positions


# FSDP1 with LoRA's adapters as units and a backward prefetch: the moments of a block's
# backward from its first adapter's hook on (q's lora_A, in the input projections' backward):
# its input projections' and its input norm's (memplan.model.fsdp1._adapter_units)
PREFETCH_TAIL = ("attn_in", "attn_norm")


class Position(NamedTuple):
    """``repeat`` blocks in a row of one run, as the mechanism sees them in backward."""

    repeat: int
    before: Event | None  # its instant before a block's backward (the block's saved alive)
    beside: int  # bytes it holds at every moment of the block's backward
    after: Event | None  # its instant after the block's backward, before the block's
    #                      gradients are counted as held
    reduce: tuple[int, ...] = ()  # bucket reduces' bytes at each of the block's gradient hooks
    #                               (zero3_hooks)
    gathers: Any = None  # what is gathered through the block's backward, by hook
    #                      (zero3_hooks: DataParallel.hook_gathers), of which ``beside`` is
    #                      the most


class Held(NamedTuple):
    """What the mechanism carries from one run of blocks to the next in backward."""

    made: int  # held gradient bytes made this backward so far
    prev_input: int  # the last unit's reduce-scatter input, still held
    root_held: int  # the root's unsharded gradients beyond their shard
    blocks: int  # blocks walked


def head_moments(dp: DataParallel, head_grads: int) -> tuple[int, tuple[Event, ...], Held]:
    """At the head: (the bytes beside the final norm's backward, the instants after it, what
    is carried to the blocks). ``head_grads``: the head's (and final norm's) held gradients."""
    beside = dp.root(head_grads) if dp.per_unit else dp.buffer(head_grads)
    beside += dp.partition if dp.partition_from < 0 else 0
    events: tuple[Event, ...] = ()
    if dp.reduce_copies and dp.separate_units:  # the head's own unit at its reduce
        events = (Event("head.reduce", 0, dp.reduced(head_grads) - head_grads),)
    root_held = dp.root(head_grads) if dp.per_unit and not dp.separate_units else 0
    # the head's own unit: its reduce-scatter input (unsharded, in the reduce dtype) is held
    # until the first block's reduce-scatter, as a block's is until the next one's
    previous = dp.unsharded(head_grads) if dp.separate_units else 0
    if dp.kept_layers:  # FSDP1 SHARD_GRAD_OP: the blocks kept gathered since the forward,
        #                 counted beside the loss and the head, alive from here on
        events += (Event("units.kept", dp.kept_layers, None),)
    return beside, events, Held(head_grads, previous, root_held, 0)


def head_hook(dp: DataParallel) -> int:
    """Bytes beside the final norm's weight gradient hook (DeepSpeed's ``zero3_hooks``): a
    bucket reduce among the head's hooks runs there (the head projection's hook runs first,
    into an empty bucket), with the gradient it reads outside the bucket
    (``Zero3ReducesAt.kept``); 0 where none runs there."""
    if not dp.zero3_hooks or dp.reduces is None or dp.partition_from >= 0:
        return 0
    return dp.reduces.first + dp.reduces.kept


def run_positions(dp: DataParallel, held: Held, layer_grads: int, early: int, n: int,
                  growing: bool, stage_first: bool) -> tuple[list[Position], Held]:
    """A run of ``n`` identical blocks whose held gradients are ``layer_grads`` each
    (``early``: the most of them made at one of a block's moments), in backward order;
    ``stage_first``: the run ends with the stage's first block. Returns its positions and
    what is carried on."""
    after = held_after(dp, held, layer_grads, n)
    if dp.fresh_only:
        return _partition_positions(dp, held.blocks, n, stage_first), after
    if dp.flat and not dp.per_unit:  # FSDP1 without a sync: the walk's grads are accumulators
        return _flat_unsynced(dp, layer_grads, n, stage_first), after
    if not dp.per_unit:
        first = last = 0
        if dp.grad_cap:
            first = dp.buffer(held.made + early)
            last = dp.buffer(held.made + (n - 1) * layer_grads + early)
        gathered, end_gathered = dp.in_block, dp.in_first_block if stage_first else dp.in_block
        if first == last and gathered == end_gathered:
            return [Position(n, None, first + gathered, None)], after
        if n == 1:
            return [Position(1, None, last + end_gathered, None)], after
        # the buffer only grows, so between the ends it holds at least the first block's
        return [Position(1, None, first + gathered, None),
                Position(n - 2, None, first + gathered, None),
                Position(1, None, last + end_gathered, None)], after
    return _unit_positions(dp, held, layer_grads, n, growing, stage_first), after


def held_after(dp: DataParallel, held: Held, layer_grads: int, n: int) -> Held:
    """What ``run_positions`` carries on after a run of ``n`` blocks of ``layer_grads`` held
    gradient bytes each: FSDP2's last reduce-scatter input is the run's own."""
    prev_input = held.prev_input
    if dp.per_unit and not dp.fresh_only:
        prev_input = 0 if dp.flat else dp.unsharded(layer_grads)
    return Held(held.made + n * layer_grads, prev_input, held.root_held, held.blocks + n)


def positions_key(dp: DataParallel, held: Held, n: int) -> object:
    """All that ``run_positions`` reads of ``held`` for a run of ``n`` blocks: two runs of the
    same blocks, ends and mechanism with equal keys get equal positions (a hybrid's repeating
    pattern of layer kinds is then walked once per distinct key). Under a partition held from
    block ``partition_from``: where the run starts against it (before by more than the run,
    by d <= n blocks, at it, past it); under a bucket cap: the gradients made, until the
    buffer is full; FSDP: the previous unit's reduce-scatter input and the root's gradients."""
    if dp.fresh_only:
        return max(-1, min(dp.partition_from - held.blocks, n + 1))
    if not dp.per_unit:
        if dp.flat or not dp.grad_cap:
            return 0
        return held.made if dp.unsharded(held.made) < dp.grad_cap else -1
    return held.root_held if dp.flat else (held.prev_input, held.root_held)


def _partition_positions(dp: DataParallel, start: int, n: int,
                         stage_first: bool) -> list[Position]:
    """Blocks ``start`` to ``start + n - 1`` in backward with a partition held whole from block
    ``partition_from`` on (the block where it is made counted with it), beside what the
    mechanism holds at every block (``in_block``; ``in_first_block`` at the stage's first)."""
    without = min(n, max(0, dp.partition_from - start))
    if dp.zero3_hooks:  # the reduces' bytes at a hook: the first's, then the most of a later
        return _hook_positions(dp, start, n, without, stage_first)
    spans = [(without, 0), (n - without, dp.partition)]
    out = []
    for count, extra in (span for span in spans if span[0]):
        out.append(Position(count, None, dp.in_block + extra, None))
    if stage_first and dp.in_first_block != dp.in_block:
        last = out.pop()
        extra = last.beside - dp.in_block
        if last.repeat > 1:
            out.append(last._replace(repeat=last.repeat - 1))
        out.append(Position(1, None, dp.in_first_block + extra, None))
    return out


def _hook_positions(dp: DataParallel, start: int, n: int, without: int,
                    stage_first: bool) -> list[Position]:
    """``_partition_positions`` under DeepSpeed's ZeRO-3 (``zero3_hooks``): no reduce in the
    blocks before ``partition_from``, the first reduce's bytes in that block, the most of a
    later one's in the blocks after it, each at a hook (``Position.reduce``)."""
    r = dp.reduces
    first = 1 if start + without == dp.partition_from and without < n else 0
    at_first = tuple(r.first if j == r.first_hook else 0 for j in range(len(r.later)))
    spans = [(without, ()), (first, at_first), (n - without - first, r.later)]
    out = [Position(count, None, dp.in_block, None, reduce, dp.hook_gathers)
           for count, reduce in spans if count]
    if stage_first and (dp.in_first_block != dp.in_block
                        or dp.first_hook_gathers != dp.hook_gathers):
        last = out.pop()
        if last.repeat > 1:
            out.append(last._replace(repeat=last.repeat - 1))
        out.append(last._replace(repeat=1, beside=dp.in_first_block,
                                 gathers=dp.first_hook_gathers))
    return out


def _unit_positions(dp: DataParallel, held: Held, layer_grads: int, n: int, growing: bool,
                    stage_first: bool) -> list[Position]:
    """FSDP2's blocks of one run: the first block in backward holds the previous unit's
    reduce-scatter input, the others their neighbour's of the run; the stage's first block
    prefetches no block before it (``in_first_block``) and reduce-scatters beside the
    embedding's gathered weights. Between the ends the blocks hold both a reduce-scatter
    input and the all-gather output of the block their backward prefetches (traced:
    test_ground_truth.py, test_fsdp_backward_between_the_ends_of_a_run)."""
    run_input, unit_grads = dp.unsharded(layer_grads), dp.unit_grads(layer_grads)
    root_held = held.root_held
    if dp.flat:
        return _flat_positions(dp, held, layer_grads, n, growing, stage_first)
    at_block = growing and dp.reduce_at_block  # (read once for the run's positions)

    def position(repeat: int, held_input: int, last: bool, measured: bool) -> Position:
        gathered = dp.in_first_block if stage_first and last else dp.in_block
        before = after = None
        if at_block:
            # at its copy-out before its backward (FSDPParamGroup.wait_for_unshard in
            # pre_backward): its all-gather output beside its unsharded weights (the same
            # bytes as its gradients in the weights' dtype), the previous reduce-scatter
            # input still held
            before = Event("unit.copy_out", 0, root_held + held_input + dp.in_first_block
                             + unit_grads)
            # at its reduce-scatter after its backward, its weights resharded, the previous
            # input dropped first (FSDPParamGroup.post_backward pops reduce_scatter_states
            # beyond reduce_scatter_max_input_buffers, 1): its unsharded gradients beside
            # the reduce-dtype input they are copied into (foreach_reduce_scatter_copy_in),
            # the gradient of its input, and the root with the block the backward
            # prefetched (the embedding's weights after the stage's first block)
            end = dp.at_embedding if stage_first and last else dp.in_first_block
            after = Event("unit.reduce_scatter", 0, root_held + unit_grads + run_input
                            + dp.boundary_grad + end) if measured else None
        elif dp.reduce_copies and growing and measured:  # weights resharded, saved freed
            after = Event("unit.reduce", 0, root_held + dp.reduced(layer_grads))
        return Position(repeat, before, root_held + held_input + gathered, after)

    if n == 1:
        return [position(1, held.prev_input, True, True)]
    # a run's reduce-scatters are measured at its ends only
    return [position(1, held.prev_input, False, True),
            position(n - 2, run_input, False, False),
            position(1, run_input, True, True)]


def flat_reduce(dp: DataParallel, grads: int) -> int:
    """FSDP1's reduce of a unit whose held gradients are ``grads`` bytes, beyond its unsharded
    gradient (torch 2.13 _runtime_utils.py ``_post_backward_hook``, ``_reduce_grad``): its copy
    in the reduce dtype where that differs (``flat_param.grad.to(reduce_dtype)``, the
    autograd-made gradient still referenced) and the output shard
    (``_get_reduce_scatter_tensors``: ``torch.empty_like(chunks[0])``) in the reduce dtype,
    which ``_cast_grad_to_param_dtype`` replaces by its copy in the weights' dtype: held
    bytes. ``F.pad``'s copy where a unit's elements do not divide by the shard degree is not
    counted (none of the padding is)."""
    copy = dp.unsharded(grads) if dp.unsharded_dtype != 1 else 0
    return copy + grads


def _flat_positions(dp: DataParallel, held: Held, layer_grads: int, n: int, growing: bool,
                    stage_first: bool) -> list[Position]:
    """FSDP1's blocks of one run (``flat``): beside each block's backward the root and the
    blocks gathered (``in_block``; the stage's first block ``in_first_block``). After it, the
    larger of two instants, each beside the gradient of its input: the flat gradient made,
    its weights still gathered (the views' gradients, one per parameter, concatenated by
    autograd's backward of the ``split`` that made the views from the flat parameter,
    ``FlatParamHandle._get_unflat_views``: the unit's gradients twice); and its reduce, its
    weights freed and the next unit gathered where its prefetch does so (``at_reduce``, the
    root alone at the stage's first), its unsharded gradient beside ``flat_reduce``."""
    root_held, unit_grads = held.root_held, dp.unit_grads(layer_grads)
    # the block before prefetched inside the block's backward (LoRA's adapter units)
    tail = PREFETCH_TAIL if dp.prefetch_tail else None

    def position(repeat: int, last: bool) -> Position:
        gathered = dp.in_first_block if last else dp.in_block
        after = None
        if growing:
            end = dp.at_embedding if last else dp.at_reduce
            flatten = 2 * unit_grads + gathered
            # its own weights freed before the reduce (alive until then when kept)
            reduce = unit_grads + flat_reduce(dp, layer_grads) + end - dp.kept_layer
            after = Event("unit.flat_grad", -dp.kept_layer,
                          root_held + dp.boundary_grad + max(flatten, reduce))
        return Position(repeat, None, root_held + gathered, after, (),
                        None if last else tail)

    if not stage_first:
        return [position(n, False)]
    return [position(n - 1, False), position(1, True)] if n > 1 else [position(1, True)]


def _flat_unsynced(dp: DataParallel, layer_grads: int, n: int,
                   stage_first: bool) -> list[Position]:
    """FSDP1's blocks of one run in a micro-batch without a sync (``no_sync()``, the walk's
    gradients the units' flat accumulators of ``layer_grads`` bytes each): after each block's
    backward, its weights still gathered, the views' new gradients beside the flat gradient
    they are concatenated into, which ``AccumulateGrad`` keeps as the accumulator (the first
    micro-batch) or adds into it in place (the others); ``_post_backward_hook`` then reshards
    the weights (FULL_SHARD) and returns before any reduce (``not state._sync_gradients``)."""
    def position(repeat: int, last: bool) -> Position:
        gathered = dp.in_first_block if last else dp.in_block
        return Position(repeat, None, gathered, Event(
            "unit.flat_grad", 0, gathered + 2 * layer_grads + dp.boundary_grad))

    if not stage_first:
        return [position(n, False)]
    return [position(n - 1, False), position(1, True)] if n > 1 else [position(1, True)]


def end_moments(dp: DataParallel, held: Held, head_grads: int, embedding_grads: int,
                growing: bool, tied: bool = False) -> tuple[int, tuple[Event, ...]]:
    """At the embedding's backward, every block done: (the bytes beside it, the mechanism's
    instants after it, measured on the alive bytes once the stage's gradients are all
    made). ``tied``: a tied head's gradient is summed into the embedding's there."""
    units = embedding_grads if dp.separate_units else head_grads + embedding_grads
    if dp.per_unit:
        # FSDP2's unit gradients made before the embedding's, unsharded beyond their shard.
        # Untied, the embedding's own unsharded gradient is the dense one its backward makes
        # (``EmbeddingBlock.extra``, beyond its shard), which becomes the parameter's .grad:
        # counted here too it was read twice (traced: one block beside a root twice its
        # size, 1,536,000 B over at the embedding's backward, its bf16 gradient, 2,048,000 B,
        # less its fp32 shard, 512,000). Tied, the pending head gradient, the dense one and
        # their sum are alive at once, of which ``extra`` counts two beyond the shard: the
        # embedding's unsharded gradient beyond its shard stays here (traced, GPT-2 at dp 2).
        made = units if tied else units - embedding_grads
        beside = dp.root(made) + (held.prev_input if held.blocks else 0)
    else:
        beside = dp.buffer(held.made + embedding_grads)
    events: tuple[Event, ...] = ()
    if dp.reduce_at_block:
        # FSDP2's root (embedding, final norm, head) at its reduce-scatter after the
        # embedding's backward, its weights resharded (_fsdp_collectives.py foreach_reduce):
        # its unsharded gradients, in the weights' dtype, copied into the reduce-dtype input,
        # then freed (unsharded_grads.clear()) before the output shard is made beside that
        # input. Its shard is new in the first micro-batch; in later ones the output joins it.
        # Its last parameter's gradient, in the weights' dtype, is freed only when
        # foreach_reduce returns (``root_last``).
        rs_input = dp.unsharded(units)
        events = (Event("root.reduce_scatter_input", 0,
                        dp.unit_grads(units) + rs_input - (units if growing else 0)),
                  Event("root.reduce_scatter_output", 0, rs_input + (0 if growing else units)
                        + dp.unit_grads(dp.root_last)))
    elif dp.reduce_copies and dp.separate_units and growing:  # the embedding's unit
        events = (Event("embedding.reduce", 0,
                        dp.reduced(embedding_grads) - embedding_grads - dp.boundary_grad),)
    # DeepSpeed's ZeRO-3: the epilogue's reduce (the embedding's gradient) after its backward
    return beside + dp.at_embedding + (dp.reduces.end if dp.zero3_hooks else 0), events


def step_end_moments(dp: DataParallel, in_flight: int, inputs_freed: int) -> tuple[Event, ...]:
    """After the step's last micro-batch's backward on the stage, kept gathered under PP:
    torch's pipeline stage runs each unit's post_backward once (``perform_reduce_grad``,
    torch/distributed/pipelining/stage.py), a unit's reduce-scatter input and its output shard
    (``step_reduce``) beside every unit gathered (``at_embedding``) and the accumulated
    gradients. No other micro-batch is in flight by then (``in_flight``: their activations,
    freed); the stage's inputs are counted whole there (``inputs_freed``: what of them the
    embedding's backward freed, counted again; not traced). () for other mechanisms."""
    if not dp.step_reduce:
        return ()
    return (Event("pipeline.drained", -in_flight, None),
            Event("step.reduce_scatter", 0, dp.step_reduce + dp.at_embedding + inputs_freed))

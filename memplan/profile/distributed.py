"""Trace one rank of a multi-rank layout (FSDP2, tensor parallel, DDP) in one process.

``trace_parallel(spec, layout, workload)`` starts torch's fake process group as rank 0 of
``layout.world_size`` ranks (collectives return at once and leave their buffers as they are, so
every tensor has the shape and dtype it has on a real rank), wraps the reference model the way
torchtitan / plain PyTorch do, and runs ``trace.run_steps`` on it. The fake group reproduces a
2-process gloo rank's parameters, gradients and optimizer states exactly, and its activations
and peaks up to the collective buffers gloo's worker threads may still hold
(``gloo_late_bytes``); tests/traced/test_parallel_trace.py keeps a real gloo run of each kind to hold
it to that. ``trace_rank`` does the same on whatever process group is already initialised (that
is what the gloo tests call in each worker).

Layouts:
- FSDP2 (zero 3, dp > 1): ``fully_shard`` on every block, then on the root, as torchtitan does.
  ``fsdp-bf16`` = fp32 weights with ``MixedPrecisionPolicy(bf16 params, fp32 reduce)``; ``fp32``
  = plain. FSDP2 frees and re-allocates its unsharded parameter buffers with
  ``untyped_storage().resize_()``, a storage method no dispatch mode sees; we wrap FSDP2's own
  ``alloc_storage`` / ``free_storage`` so the tracker follows them at the moment they happen,
  under an extra category ``gathered`` (the all-gathered weights are neither parameters, which
  stay the resident shard, nor activations).
- TP (tp > 1, dp = 1): torchtitan's Llama plan on the blocks (q/k/v, gate/up colwise; o_proj,
  down rowwise); with sequence parallelism the norms are ``SequenceParallel`` and the residual
  stream is sharded on the sequence dim. Embedding and head stay replicated (a vocab-parallel
  head needs torch's ``loss_parallel`` around forward and backward; not done yet); with SP the
  embedding's output is split on the sequence and the final norm's output gathered back before
  the head. Everything outside the plan is a replicated DTensor (see ``_replicate``).
- DDP (zero 0, dp > 1): ``DistributedDataParallel`` with its defaults, real tensors only (its
  C++ reducer reads parameter data). Its reducer allocates flat gradient buckets (one gradient-
  sized copy, gradient_as_bucket_view=False) when it is built and rebuilds them at step 2's
  first forward; both are done under the tracker and labelled ``buckets``. The all-reduce runs
  through a Python comm hook equal to the default one (the built-in C++ hook needs a future
  value the fake group does not set); gloo runs use the same hook.

Measured on FSDP2 (tiny): the root's gathered weights live from its forward to the end of
backward; during forward FSDP2 also keeps the previous unit's flat all-gather output alive
(``comm_ctx.all_gather_state``, until the next all-gather), so a block sees two units and the
loss sees the root plus the last block's buffer.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from memplan.errors import MemplanError
from memplan.parallel import Offload, ParallelConfig
from memplan.profile.reference import ReferenceModel
from memplan.profile.trace import (
    SyncContext,
    TraceResult,
    _fake_mode,
    ref_options,
    run_steps,
)
from memplan.profile.tracker import HostCategories, MemoryTracker, _local
from memplan.spec import ModelSpec
from memplan.workload import GradSync, Precision, Workload

GATHERED = "gathered"  # FSDP2's unsharded (all-gathered) parameter buffers
BUCKETS = "buckets"  # DDP's flat gradient buckets; reduce-scatter inputs FSDP2 holds


class ParallelTracker(MemoryTracker):
    """The exact tracker plus categories for communication buffers that live across ops."""

    def __init__(self, *, timeline: bool = False) -> None:
        super().__init__(timeline=timeline)
        self.by_category[GATHERED] = 0
        self.by_category[BUCKETS] = 0

    def resync(self, tensor: torch.Tensor, op: str) -> None:
        """Re-read a tensor's storage size after a resize no dispatch mode saw."""
        local = _local(tensor)
        if local is None:
            return
        st = local.untyped_storage()
        entry = self._live.get(id(st))
        if entry is not None:
            self._resize(entry, st.nbytes())
            self._record(op)

    def live(self) -> dict[int, list[Any]]:
        """A snapshot of the counted storages. Entries are compared by identity, since a freed
        storage's id() can be reused by a later one."""
        return dict(self._live)

    def born_since(self, before: dict[int, list[Any]]) -> dict[int, list[Any]]:
        return {k: e for k, e in self._live.items() if before.get(k) is not e}

    def bytes_of(self, born: dict[int, list[Any]], category: str = "activations") -> int:
        """Bytes of the storages in ``born`` still alive and counted in ``category``."""
        return sum(e[0] for k, e in born.items()
                   if self._live.get(k) is e and e[1] == category)

    def relabel_new(self, before: dict[int, list[Any]], category: str) -> int:
        """Move every storage counted since ``before`` to ``category``; return their bytes."""
        moved = 0
        for entry in self.born_since(before).values():
            moved += self.move(entry, category)
        return moved


class HostOffloadTracker(HostCategories, ParallelTracker):
    """``ParallelTracker`` for FSDP2 with ``CPUOffloadPolicy`` on a CPU-only build, where the
    host and the device are the same memory: the totals (and so the phase peaks) count the
    device alone. Host memory is the categories ``HOST``: the sharded weights
    (``parameters``), the sharded gradients FSDP2 copies to the host after each
    reduce-scatter (``gradients``, relabelled by a post-accumulate-grad hook FSDP2 calls on
    each sharded parameter), the optimizer's states and whatever the optimizer step makes
    (it runs on the host copies: ``optimizer``). ``by_category`` still counts all."""


def _host_gradients(model: nn.Module, tracker: ParallelTracker) -> None:
    """Label each sharded gradient host memory as FSDP2 assigns it (``HostOffloadTracker``)."""
    for p in model.parameters():
        p.register_post_accumulate_grad_hook(lambda q: tracker.relabel(q.grad, "gradients"))


OnModel = Callable[[nn.Module, ParallelTracker], None]


def layout_kind(par: ParallelConfig, wl: Workload | None = None) -> str:
    """``fsdp``, ``fsdp1`` (``wl.fsdp_version`` 1: ``memplan.profile.fsdp1``), ``tp`` or
    ``ddp``; raise for layouts this tracer does not build."""
    if (wl is not None and wl.fsdp_version == 1 and par.dp > 1 and par.zero == 3
            and par.tp == par.pp == par.cp == par.ep == 1):
        return "fsdp1"
    if par.pp > 1 or par.cp > 1 or par.ep > 1:
        raise MemplanError("trace_parallel: pp, cp and ep layouts are not traced yet")
    if par.tp > 1 and par.dp > 1:
        raise MemplanError("trace_parallel: tp and dp together are not traced yet")
    if par.tp > 1:
        return "tp"
    if par.dp > 1 and par.zero == 3:
        return "fsdp"
    if par.dp > 1 and par.zero == 0:
        return "ddp"
    raise MemplanError(f"trace_parallel: zero {int(par.zero)} with dp {par.dp} is not traced "
                       "(FSDP2 is zero 3, DDP zero 0; one rank needs trace)")


def trace_parallel(spec: ModelSpec, par: ParallelConfig, wl: Workload, *, steps: int = 2,
                   fake: bool = True, timeline: bool = False,
                   on_model: OnModel | None = None) -> TraceResult:
    """Trace rank 0 of ``par`` in this process through the fake process group.
    ``on_model(model, tracker)`` runs once the model is wrapped, before the first step (to
    attach hooks that measure parts of the model)."""
    layout_kind(par, wl)
    if dist.is_initialized():
        raise MemplanError("trace_parallel: a process group is already initialised; "
                           "call trace_rank instead")
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=par.world_size)
    try:
        return trace_rank(spec, par, wl, steps=steps, fake=fake, timeline=timeline,
                          on_model=on_model)
    finally:
        dist.destroy_process_group()


def trace_rank(spec: ModelSpec, par: ParallelConfig, wl: Workload, *, steps: int = 2,
               fake: bool = True, timeline: bool = False,
               on_model: OnModel | None = None, device: str = "cpu") -> TraceResult:
    """Trace this process's rank of ``par`` on the default process group (fake or real).
    ``device="cuda"`` builds the model and the mesh on this rank's current CUDA device (FSDP2
    and TP only; call it under ``torch.device("cuda")`` so the step's token ids follow)."""
    kind = layout_kind(par, wl)
    if dist.get_world_size() != par.world_size:
        raise MemplanError(f"trace_rank: process group has {dist.get_world_size()} ranks, "
                           f"the layout {par.world_size}")
    _check_precision(kind, wl)
    if kind == "fsdp1":
        # FSDP1's init reads parameter data (_init_utils, flattening and sharding copies), which
        # fake tensors do not have: it always runs on real tensors
        fake = False
    if kind == "ddp" and fake:
        # DDP's reducer reads parameter data in C++ (shape check, bucket rebuild broadcast),
        # which fake tensors do not have.
        raise MemplanError("trace_parallel: DDP runs only on real tensors (fake=False)")
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(device, (par.world_size,))
    offload = Offload.PARAMS in par.offload
    tracker = (HostOffloadTracker if offload else ParallelTracker)(timeline=timeline)
    with _fake_mode() if fake else contextlib.nullcontext():
        torch.manual_seed(0)  # every rank builds the same replicated weights
        if kind == "fsdp1":
            from memplan.profile.fsdp1 import fsdp1_model, follow_flat_storage

            model = fsdp1_model(spec, par, wl, device)
            m, sync = accumulation(kind, par, wl, model)
            with follow_flat_storage(tracker):
                own = wl.precision if wl.precision.policy.autocast else Precision.FP32
                return run_steps(model, spec, wl, tracker, steps=steps, precision=own,
                                 micro_batches=m, sync=sync)
        if kind == "fsdp":
            model = _fsdp_model(spec, wl, mesh, device, offload)
            if offload:
                _host_gradients(model, tracker)
        elif kind == "tp":
            model = _tp_model(spec, wl, mesh, par.sequence_parallel, device)
        else:
            model = _ddp_model(spec, wl, tracker)
        if on_model is not None:
            on_model(model, tracker)
        m, sync = accumulation(kind, par, wl, model)
        if kind != "fsdp":
            return run_steps(model, spec, wl, tracker, steps=steps, micro_batches=m, sync=sync)
        with _follow_fsdp_storage(tracker):
            # FSDP2 casts to bf16 itself: the optimizer updates the fp32 shards directly; under
            # autocast the recipe still runs forward and loss in autocast
            own = wl.precision if wl.precision.policy.autocast else Precision.FP32
            return run_steps(model, spec, wl, tracker, steps=steps, precision=own,
                             micro_batches=m, sync=sync)


def accumulation(kind: str, par: ParallelConfig, wl: Workload,
                 model: nn.Module) -> tuple[int, SyncContext | None]:
    """The micro-batches per step the workload's global batch gives this layout (1 without
    one), and with ``grad_sync`` last the loop's sync per micro-batch: FSDP2's
    ``set_requires_gradient_sync(last)`` before each (on the root, which sets every unit),
    DDP's ``no_sync()`` around all but the last."""
    per_step = wl.micro_batch_size * par.dp
    m, rest = divmod(wl.global_batch_size or per_step, per_step)
    if m < 1 or rest:
        raise MemplanError(f"trace_parallel: gbs ({wl.global_batch_size}) is not a multiple "
                           f"of mbs*dp ({wl.micro_batch_size * par.dp})")
    if wl.grad_sync is not GradSync.LAST or m == 1:
        return m, None
    if kind == "fsdp":
        @contextlib.contextmanager
        def fsdp_sync(last: bool) -> Iterator[None]:
            model.set_requires_gradient_sync(last)
            yield

        return m, fsdp_sync
    if kind in ("ddp", "fsdp1"):  # FullyShardedDataParallel.no_sync(), as DDP's
        return m, lambda last: contextlib.nullcontext() if last else model.no_sync()
    raise MemplanError("trace_parallel: grad_sync last is traced for FSDP2 and DDP only")


def _check_precision(kind: str, wl: Workload) -> None:
    if kind in ("fsdp", "fsdp1") and wl.precision not in (Precision.FSDP_BF16, Precision.FP32,
                                               Precision.BF16_PURE, Precision.AMP_BF16,
                                               Precision.AMP_FP16):
        raise MemplanError(f"trace_parallel: FSDP2 runs fsdp-bf16, bf16-pure, amp-bf16, "
                           f"amp-fp16 or fp32, not {wl.precision.value}")
    if kind not in ("fsdp", "fsdp1") and wl.precision is Precision.FSDP_BF16:
        raise MemplanError("precision: fsdp-bf16 needs an FSDP layout (zero 3, dp > 1)")


# --- real gloo against the fake group ------------------------------------------------------

def leave_rank() -> None:
    """End a gloo rank whose work is done and written: flush the standard streams and leave
    without the interpreter's finalization.

    A gloo process group's worker threads can still hold a finished collective's work (and its
    tensors) after ``destroy_process_group``: the device mesh and FSDP2's state keep the group
    object alive, and the workers drop tensors after waking the main thread (see
    ``gloo_late_bytes``). When the interpreter is torn down first, a worker that then drops such
    a tensor takes the GIL of a finalized interpreter and the process aborts ("terminate called
    without an active exception", SIGABRT or SIGSEGV) after its results were written. Measured
    here: 3 of 84 two-rank ``memplan calibrate --device cpu --quick --nproc 2`` runs on a loaded
    2-core machine, always after the last record. The same teardown race is described in
    pytorch/pytorch#179291 (an atexit ``destroy_process_group``, which does not help where the
    group outlives it). ``os._exit`` skips that teardown; everything the rank writes is written
    whole before it (records atomically, JSON lines flushed)."""
    import os
    import sys

    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def gloo_late_bytes(spec: ModelSpec, par: ParallelConfig, wl: Workload) -> int:
    """Bytes a rank traced on a real gloo group may count, at any moment, beyond the fake-group
    trace of the same layout (which is deterministic and never larger).

    ProcessGroupGloo runs a group's collectives on two worker threads (``Options.threads``:
    two per device). A worker marks its work complete, which wakes the main thread, and only
    then drops the work, which holds the collective's input and output and, for a
    reduce-scatter, gloo's own full-size copy of the input. When the worker is descheduled in
    between (a loaded machine), those tensors outlive their last use on the main thread, so a
    phase peak or the bytes alive at a phase boundary can include them. Bound: two works, each
    holding at most a full-size input, a full-size copy and its shard. The full size is the
    largest collective of the layout: FSDP2, a unit's unsharded gradients counted in fp32 (no
    recipe reduces in a wider type, and the all-gathered weights are no larger); TP, one
    (b, s, h) activation in the compute dtype; DDP, the gradients in the compute dtype (a bucket
    is at most that).
    """
    kind = layout_kind(par)
    compute = wl.compute_dtype.itemsize
    model = ReferenceModel(spec, ref_options(wl, torch.float32), device="meta")
    if kind == "fsdp":
        blocks = [sum(p.numel() for p in b.parameters()) for b in model.blocks]
        root = sum(p.numel() for p in model.parameters()) - sum(blocks)
        full = max(*blocks, root) * 4
    elif kind == "tp":
        full = wl.micro_batch_size * wl.seq_len * spec.hidden_size * compute
    else:
        full = sum(p.numel() for p in model.parameters()) * compute
    return 2 * (2 * full + -(-full // par.world_size))


# --- FSDP2 ---------------------------------------------------------------------------------

def _fsdp_model(spec: ModelSpec, wl: Workload, mesh, device: str = "cpu",
                offload: bool = False) -> nn.Module:
    """``offload``: FSDP2's ``CPUOffloadPolicy`` (unpinned: a CPU-only build cannot pin)."""
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    # fp32 weights (FSDP2 keeps fp32 shards and casts the gathered copy), but the forward's own
    # tensors (RoPE tables, eager mask) in the compute dtype, as the model reads them from
    # ``model.opts.dtype``. (``.to(fp32)`` after building fails on fake tensors.) bf16-pure
    # builds bf16 weights: FSDP2 shards, gathers and reduces them in bf16.
    weights = torch.bfloat16 if wl.precision is Precision.BF16_PURE else torch.float32
    model = ReferenceModel(spec, ref_options(wl, weights), device=device)
    model.opts = ref_options(wl)
    if wl.precision is Precision.FSDP_BF16:
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    else:
        mp = MixedPrecisionPolicy()
    policy = {"offload_policy": CPUOffloadPolicy(pin_memory=False)} if offload else {}
    for block in model.blocks:
        fully_shard(block, mesh=mesh, mp_policy=mp, **policy)
    fully_shard(model, mesh=mesh, mp_policy=mp, **policy)
    return model


@contextlib.contextmanager
def _follow_fsdp_storage(tracker: ParallelTracker) -> Iterator[None]:
    """Make FSDP2's storage resizes visible to the tracker while they happen."""
    from torch.distributed.fsdp._fully_shard import _fsdp_param, _fsdp_param_group

    alloc, free = _fsdp_param.alloc_storage, _fsdp_param.free_storage

    def alloc_tracked(tensor: torch.Tensor) -> None:
        alloc(tensor)
        # The buffer was born (counted) at its torch.empty; from here on it is a gathered
        # weight, not an activation, whatever phase first allocated it.
        tracker.relabel(tensor, GATHERED)
        tracker.resync(tensor, "fsdp.alloc_storage")

    def free_tracked(tensor: torch.Tensor) -> None:
        free(tensor)
        tracker.resync(tensor, "fsdp.free_storage")

    _fsdp_param.alloc_storage = alloc_tracked
    _fsdp_param.free_storage = free_tracked
    _fsdp_param_group.alloc_storage = alloc_tracked  # imported by name there
    try:
        yield
    finally:
        _fsdp_param.alloc_storage, _fsdp_param.free_storage = alloc, free
        _fsdp_param_group.alloc_storage = alloc


# --- tensor parallel -------------------------------------------------------------------------

def _tp_model(spec: ModelSpec, wl: Workload, mesh, sp: bool, device: str = "cpu") -> nn.Module:
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        PrepareModuleOutput,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    if spec.moe is not None:
        raise MemplanError("trace_parallel: tensor parallel MoE is not traced yet")
    model = ReferenceModel(spec, ref_options(wl), device=device)
    out = Shard(1) if sp else Replicate()  # rowwise outputs: reduce-scatter with SP
    for block in model.blocks:
        plan = {
            "attn.q_proj": ColwiseParallel(), "attn.k_proj": ColwiseParallel(),
            "attn.v_proj": ColwiseParallel(), "attn.o_proj": RowwiseParallel(output_layouts=out),
            "mlp.up": ColwiseParallel(), "mlp.down": RowwiseParallel(output_layouts=out),
        }
        if block.mlp.gate is not None:
            plan["mlp.gate"] = ColwiseParallel()
        if sp:
            plan.update({
                "attn_norm": SequenceParallel(), "mlp_norm": SequenceParallel(),
                # attn(x, rope, mask): only x is gathered back to the full sequence.
                "attn": PrepareModuleInput(input_layouts=(Shard(1), None, None),
                                           desired_input_layouts=(Replicate(), None, None)),
                "mlp": PrepareModuleInput(input_layouts=(Shard(1),),
                                          desired_input_layouts=(Replicate(),)),
            })
        parallelize_module(block, mesh, plan)
    if spec.tied_embeddings:
        raise MemplanError("trace_parallel: tied embeddings under tensor parallel are not "
                           "traced yet (the head reuses the embedding's weight outside a module)")
    # Everything outside the TP plan is replicated, as DTensors: torch.optim's foreach kernels
    # refuse a mix of DTensor and plain parameters, and splitting them into two param groups
    # would change the step's temporaries (sized by each group).
    _replicate(model.embed, mesh, Shard(1) if sp else Replicate())
    _replicate(model.head, mesh, Replicate())
    if sp:
        # The final norm runs on the sequence shard; its output is gathered for the head.
        parallelize_module(model.final_norm, mesh, SequenceParallel())
        parallelize_module(model.final_norm, mesh, PrepareModuleOutput(
            output_layouts=Shard(1), desired_output_layouts=Replicate()))
    else:
        for norm in [model.final_norm, *(m for b in model.blocks
                                         for m in (b.attn_norm, b.mlp_norm))]:
            _replicate(norm, mesh, Replicate())
    return model


def _replicate(module: nn.Module | None, mesh, output) -> None:
    """Replicate ``module``'s weights as DTensors; plain tensors in, local ``output`` out.

    from_local / to_local are views, so replication adds no bytes; an embedding whose output is
    wanted as ``Shard(1)`` (sequence parallel) takes its local slice without communication."""
    from torch.distributed.tensor import DTensor, Replicate, distribute_module

    if module is None:
        return

    def to_dtensor(_mod, inputs, mesh):
        return tuple(DTensor.from_local(x, mesh, [Replicate()], run_check=False)
                     if isinstance(x, torch.Tensor) and not isinstance(x, DTensor) else x
                     for x in inputs)

    def to_local(_mod, out, _mesh):
        if out.placements[0] != output:
            out = out.redistribute(placements=[output])
        return out.to_local()

    distribute_module(module, mesh, input_fn=to_dtensor, output_fn=to_local)


# --- DDP ---------------------------------------------------------------------------------------

def _ddp_model(spec: ModelSpec, wl: Workload, tracker: ParallelTracker) -> nn.Module:
    from torch.nn.parallel import DistributedDataParallel

    model = ReferenceModel(spec, ref_options(wl))
    with tracker:
        tracker.register(list(model.parameters()), "parameters")
        before = tracker.live()
        # DDP's reducer allocates one flat buffer per gradient bucket here (25 MiB cap, the
        # first bucket 1 MiB); gradient_as_bucket_view=False (the default) keeps .grad apart and
        # copies every gradient into its bucket for the all-reduce and back.
        ddp = DistributedDataParallel(model)
        tracker.relabel_new(before, BUCKETS)
    ddp.register_comm_hook(None, _allreduce_hook)
    pre_forward = ddp._pre_forward

    def pre_forward_tracked(*args, **kwargs):
        # Step 2's first forward rebuilds the buckets in the order gradients became ready
        # (Reducer::rebuild_buckets): new flat buffers, born in forward but not activations.
        before = tracker.live()
        out = pre_forward(*args, **kwargs)
        tracker.relabel_new(before, BUCKETS)
        return out

    ddp._pre_forward = pre_forward_tracked
    return ddp


def _allreduce_hook(_state, bucket):
    """DDP's default all-reduce, in place on the bucket. The built-in C++ hook takes its result
    from the work's future, which the fake process group leaves empty; this one returns the
    bucket itself, so fake and real groups run the same ops (both use it)."""
    buf = bucket.buffer()
    buf.div_(dist.get_world_size())
    dist.all_reduce(buf)
    fut: torch.futures.Future = torch.futures.Future()
    fut.set_result(buf)
    return fut


__all__ = ["BUCKETS", "GATHERED", "ParallelTracker", "accumulation", "gloo_late_bytes",
           "layout_kind", "trace_parallel", "trace_rank"]

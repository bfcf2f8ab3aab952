"""The exact tracker against PyTorch's own allocator accounting.

``torch.profiler`` with ``profile_memory=True`` records every allocation and free the CPU
allocator sees. Its memory profile ties each allocation to the tensor storage it backs (a
``TensorKey``) where there is one; the rest are raw blocks that back no tensor. The tracker is a
``TorchDispatchMode``: it counts the storages of the tensors the ops it intercepts return, so
what it can be held to is the profiler's tensor storages, and the raw blocks are accounted for
apart:

- tensor storages: replayed in order, the profiler's peak above the step's starting bytes
  equals the tracker's peak, except for 8-byte scalar tensors that kernels create for
  themselves below the dispatcher (the wrapped-number divisor of ``mean``'s backward, for
  instance; none of these cases has more than two of them alive at the peak). This part does
  not depend on the number of intra-op threads: checked with 1 to 8.
- raw blocks are of two kinds. Kernel scratch (the CPU BLAS's packing buffers in ``mm``/``bmm``,
  the per-thread buffers of the CPU flash-attention kernel) is allocated and freed inside one
  aten call, and its size is a function of ``torch.get_num_threads()`` (a ``mm`` in this step
  asks for 38,016 bytes with one thread and 75,520 with two), so it is only required to stay
  inside its call; it is not compared. The other kind is the CPU generator's state
  (``torch.get_rng_state()``, 5,056 bytes) that non-reentrant checkpointing saves once per
  region in the forward and once more when the backward recomputes it; on a GPU it is host
  memory too, so memplan does not count it. Their number is exact.

Including the raw blocks in the peak made this comparison depend on the thread count: the
scratch of a backward ``mm`` set the profiler's peak with two threads and not with one.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest

torch = pytest.importorskip("torch")

from torch._C._profiler import _EventType  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402
from torch.profiler._memory_profiler import Action, TensorKey  # noqa: E402

from memplan.api import make_workload  # noqa: E402
from memplan.profile.reference import ReferenceModel  # noqa: E402
from memplan.profile.trace import ref_options  # noqa: E402
from memplan.profile.tracker import MemoryTracker  # noqa: E402
from memplan.spec import ModelSpec, load_model  # noqa: E402
from memplan.workload import Recompute  # noqa: E402

TINY = load_model("tiny")
GPT = ModelSpec.model_validate({**load_model("gpt2").model_dump(), "name": "gpt-mini",
                                "num_layers": 2, "hidden_size": 64, "num_attention_heads": 4,
                                "num_kv_heads": 4, "head_dim": 16, "ffn_hidden_size": 256,
                                "vocab_size": 96, "max_seq_len": 256})

CASES = [
    (TINY, dict(seq_len=64, micro_batch_size=2)),
    (TINY, dict(seq_len=64, micro_batch_size=2, attention="eager", recompute="full")),
    (TINY, dict(seq_len=64, micro_batch_size=2, recompute="selective", norm_impl="fused")),
    (GPT, dict(seq_len=64, micro_batch_size=2, attention="eager")),
]
IDS = [s.name + "-" + "-".join(map(str, f.values())) for s, f in CASES]
# Scalar tensors kernels allocate below the dispatcher: at most two 8-byte ones at the peak.
SCALAR_BYTES = 8
MAX_HIDDEN_SCALARS = 2


def _setup(spec: ModelSpec, fields: dict):
    wl = make_workload(spec, **fields)
    torch.manual_seed(0)
    model = ReferenceModel(spec, ref_options(wl))
    model.train()
    ids = torch.randint(0, spec.vocab_size, (wl.micro_batch_size, wl.seq_len))
    targets = torch.randint(0, spec.vocab_size, (wl.micro_batch_size, wl.seq_len))

    def step() -> None:
        model(ids, targets).backward()
        for p in model.parameters():
            p.grad = None

    return wl, model, ids, targets, step


@dataclass
class RawBlock:
    """An allocation the profiler ties to no tensor: its size, and whether it was freed inside
    an aten call that was running when it was allocated (kernel scratch)."""

    nbytes: int
    inside_one_call: bool


@dataclass
class ProfiledStep:
    tensor_peak_bytes: int
    tensor_net_bytes: int
    raw: list[RawBlock]


def _profile(step) -> ProfiledStep:
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True,
                 with_stack=True) as prof:
        step()
    memory = prof._memory_profile()
    live = peak = 0
    for _, action, (key, _version), size in memory.timeline:
        if not isinstance(key, TensorKey):
            continue  # a raw block: counted below
        if action == Action.CREATE:
            live += size
        elif action == Action.DESTROY:
            live -= size
        peak = max(peak, live)
    return ProfiledStep(peak, live, _raw_blocks(memory._op_tree.dfs()))


def _raw_blocks(events) -> list[RawBlock]:
    open_calls: dict[int, tuple[int, list[int]]] = {}  # ptr -> (bytes, end times of aten calls)
    blocks = []
    for event in events:
        if event.typed[0] != _EventType.Allocation:
            continue
        fields = event.typed[1]
        if TensorKey.from_allocation(fields) is not None:
            continue
        if fields.alloc_size > 0:
            open_calls[fields.ptr] = (fields.alloc_size, _aten_call_ends(event))
        else:
            nbytes, ends = open_calls.pop(fields.ptr)
            blocks.append(RawBlock(nbytes, any(event.start_time_ns <= end for end in ends)))
    assert not open_calls, "every raw block of the step is freed within the step"
    return blocks


def _aten_call_ends(event) -> list[int]:
    ends = []
    parent = event.parent
    while parent is not None:
        if parent.typed[0] == _EventType.TorchOp and parent.name.startswith("aten::"):
            ends.append(parent.end_time_ns)
        parent = parent.parent
    return ends


def _tracker_peak(model, ids, targets, step) -> tuple[int, int]:
    tracker = MemoryTracker()
    with tracker:
        tracker.register([*model.parameters(), ids, targets], "parameters")
        base = tracker.total_bytes
        step()
    peak = max(p.total_bytes for p in tracker.peaks.values())
    return peak - base, tracker.total_bytes - base


def _checkpointed_regions(wl, spec: ModelSpec) -> int:
    # The reference model checkpoints each layer (full) or each attention core (selective).
    return spec.num_layers if wl.recompute > Recompute.NONE else 0


@pytest.mark.parametrize("threads", [1, 2, 4])
@pytest.mark.parametrize(("spec", "fields"), CASES, ids=IDS)
def test_tracker_peak_equals_profiler_tensor_storages(spec: ModelSpec, fields: dict,
                                                      threads: int) -> None:
    wl, model, ids, targets, step = _setup(spec, fields)
    before = torch.get_num_threads()
    # The thread count is varied to show the compared quantities do not depend on it (the
    # scratch that does is in the raw blocks); it is restored for the rest of the suite.
    torch.set_num_threads(threads)
    try:
        step()  # warm-up: lazily created state exists before either measurement
        profiled = _profile(step)
        tracker_peak, tracker_net = _tracker_peak(model, ids, targets, step)
    finally:
        torch.set_num_threads(before)
    assert profiled.tensor_net_bytes == tracker_net == 0
    gap = profiled.tensor_peak_bytes - tracker_peak
    assert tracker_peak > 0
    assert 0 <= gap <= MAX_HIDDEN_SCALARS * SCALAR_BYTES and gap % SCALAR_BYTES == 0, \
        (tracker_peak, profiled.tensor_peak_bytes)

    rng_state_bytes = torch.get_rng_state().numel()
    # Everything else is kernel scratch, alive inside one aten call (whether there is any
    # depends on the BLAS torch was built with, so that is not asserted).
    outside = [b.nbytes for b in profiled.raw if not b.inside_one_call]
    assert outside == [rng_state_bytes] * (2 * _checkpointed_regions(wl, spec))


def test_operator_tensors_walked_as_pytree_flattens_them() -> None:
    """The tracker's walk of an operator's arguments and results (``tracker._tensors``) finds
    the tensors ``tree_flatten`` finds, in its order: nested lists, tuples and dicts, a named
    tuple, a ``torch.return_types`` struct, an OrderedDict, and leaves that are not tensors
    (None, a slice, a torch.Size, a string, numbers)."""
    import collections

    from torch.utils._pytree import tree_flatten

    from memplan.profile.tracker import _tensors

    a, b, c = torch.ones(2), torch.zeros(3), torch.empty(1)
    pair = collections.namedtuple("pair", "x y")
    samples = [((a, [b, {"k": c, "j": 3}]), {"out": a}), pair(a, (b, None)),
               torch.return_types.max((a, b)), collections.OrderedDict(z=c, y=[a]),
               (slice(1, 2), torch.Size([2]), "s", 1.0, [a, a]), a, None]
    for s in samples:
        want = [id(x) for x in tree_flatten(s)[0] if isinstance(x, torch.Tensor)]
        assert [id(x) for x in _tensors(s, [])] == want, s

"""The exact tracker against PyTorch's own allocator accounting.

``torch.profiler`` with ``profile_memory=True`` records every allocation and free the CPU
allocator sees; its memory timeline (``_memory_profile().timeline``) replayed in order gives the
live bytes at each moment. On real CPU tensors the tracker's peak above the step's starting
bytes must equal the profiler's for one training step (forward and backward), except for what
is allocated below the dispatcher: each live checkpointed region saves the CPU generator's state
(``torch.get_rng_state()``, 5,056 bytes; on a GPU it is host memory too, so memplan does not
count it), and a few 8-byte scalars.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from torch.profiler import ProfilerActivity, profile  # noqa: E402
from torch.profiler._memory_profiler import Action  # noqa: E402

from memplan.api import make_workload  # noqa: E402
from memplan.profile.reference import ReferenceModel  # noqa: E402
from memplan.profile.trace import ref_options  # noqa: E402
from memplan.profile.tracker import MemoryTracker  # noqa: E402
from memplan.spec import ModelSpec, load_model  # noqa: E402

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

    return model, ids, targets, step


def _profiler_peak(step) -> tuple[int, int]:
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True,
                 with_stack=True) as prof:
        step()
    live = peak = 0
    for _, action, _, size in prof._memory_profile().timeline:
        if action == Action.CREATE:
            live += size
        elif action == Action.DESTROY:
            live -= size
        peak = max(peak, live)
    return peak, live


def _tracker_peak(model, ids, targets, step) -> tuple[int, int]:
    tracker = MemoryTracker()
    with tracker:
        tracker.register([*model.parameters(), ids, targets], "parameters")
        base = tracker.total_bytes
        step()
    peak = max(p.total_bytes for p in tracker.peaks.values())
    return peak - base, tracker.total_bytes - base


@pytest.mark.parametrize(("spec", "fields"), CASES,
                         ids=[s.name + "-" + "-".join(map(str, f.values())) for s, f in CASES])
def test_tracker_peak_equals_profiler_allocations(spec: ModelSpec, fields: dict) -> None:
    model, ids, targets, step = _setup(spec, fields)
    step()  # warm-up: lazily created state exists before either measurement
    profiler_peak, profiler_net = _profiler_peak(step)
    tracker_peak, tracker_net = _tracker_peak(model, ids, targets, step)
    assert profiler_net == tracker_net == 0
    rng_state_bytes = torch.get_rng_state().numel()
    gap = profiler_peak - tracker_peak
    assert tracker_peak > 0 and gap >= 0
    assert gap % rng_state_bytes <= 16, (tracker_peak, profiler_peak)
    assert gap // rng_state_bytes <= 2  # at most two checkpointed regions live at once

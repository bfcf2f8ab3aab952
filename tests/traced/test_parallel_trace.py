"""One rank of FSDP2, tensor-parallel and DDP layouts, traced in one process (fake process group).

Model: ``tiny`` (2 layers, hidden 64, ffn 176, 4 heads, 2 KV heads, vocab 128), micro-batch 2,
sequence 64. The fake-group traces are held to:
- FSDP2: parameters, gradients and optimizer states per rank are the per-parameter ceil(dim0/N)
  shards, i.e. exactly 1/N of the single-process trace (tiny's dims all divide by 4);
  activations are those of one process.
- TP: per-module saved activations, measured as the bytes born inside a module and still alive
  when backward starts, are 1/t inside attention and MLP; norms are replicated without SP.
- one real 2-process gloo run per kind: each rank's states equal the fake-group trace exactly,
  its saved activations and peaks within the collective buffers gloo's threads may still hold.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

from memplan.errors import MemplanError  # noqa: E402
from memplan.parallel import ParallelConfig  # noqa: E402
from memplan.profile.distributed import (  # noqa: E402
    GATHERED,
    ParallelTracker,
    gloo_late_bytes,
    leave_rank,
    trace_parallel,
    trace_rank,
)
from memplan.profile.reference import ReferenceModel, RefOptions  # noqa: E402
from memplan.profile.trace import (  # noqa: E402
    TraceResult,
    _fake_mode,
    ref_options,
    run_steps,
    trace,
)
from memplan.spec import load_model  # noqa: E402
from memplan.units import PHASES  # noqa: E402
from memplan.workload import Workload  # noqa: E402

SPEC = load_model("tiny")
B, S, H = 2, 64, 64


def wl(precision: str) -> Workload:
    return Workload(micro_batch_size=B, seq_len=S, precision=precision)


@functools.cache
def single(precision: str) -> TraceResult:
    return trace(SPEC, ParallelConfig(), wl(precision))


@functools.cache
def fsdp(dp: int, precision: str) -> TraceResult:
    return trace_parallel(SPEC, ParallelConfig(dp=dp, zero=3), wl(precision))


def ceil_sharded_bytes(n: int, itemsize: int = 4) -> int:
    """Bytes of every parameter's FSDP2 shard: ceil(dim0 / n) rows of it."""
    model = ReferenceModel(SPEC, RefOptions(dtype=torch.float32), device="meta")
    return sum(-(-p.shape[0] // n) * (p.numel() // p.shape[0]) * itemsize
               for p in model.parameters())


# --- FSDP2 ------------------------------------------------------------------------------------

@pytest.mark.parametrize("precision", ["fp32", "fsdp-bf16"])
@pytest.mark.parametrize("dp", [2, 4])
def test_fsdp2_states_are_one_nth_per_rank(dp: int, precision: str) -> None:
    ref, got = single("fp32"), fsdp(dp, precision)  # fsdp-bf16 keeps fp32 shards and grads
    assert got.params_bytes == ceil_sharded_bytes(dp) == ref.params_bytes // dp
    assert ref.params_bytes % dp == 0
    for r, g in zip(ref.steps, got.steps):
        assert g.grads_bytes == r.grads_bytes // dp
        assert g.optimizer_bytes == r.optimizer_bytes // dp


@pytest.mark.parametrize("dp", [2, 4])
def test_fsdp2_activations_are_one_process(dp: int) -> None:
    """FSDP2 splits the batch, not the model's activations: a rank saves what one process does
    (fsdp-bf16 computes in bf16, so it saves what bf16-mixed does)."""
    assert (fsdp(dp, "fp32").steady.saved_activations_bytes
            == single("fp32").steady.saved_activations_bytes)
    assert (fsdp(dp, "fsdp-bf16").steady.saved_activations_bytes
            == single("bf16-mixed").steady.saved_activations_bytes)


def test_fsdp2_gathered_weights_are_freed_by_the_optimizer_step() -> None:
    """The root's gathered weights stay through forward (not resharded) and are freed after
    backward; the resize tracking sees them go."""
    got = fsdp(2, "fsdp-bf16")
    root_bf16 = (2 * SPEC.vocab_size * H + H) * 2  # embedding, head, final norm
    for step in got.steps:
        assert step.phases["forward"].by_category[GATHERED] >= root_bf16
        assert step.phases["optimizer"].by_category[GATHERED] == 0


# --- tensor parallel ----------------------------------------------------------------------

MODULES = [f"blocks.{i}.{m}" for i in range(SPEC.num_layers)
           for m in ("attn_norm", "attn", "mlp_norm", "mlp")]


class BornSaved:
    """Per module: bytes of storages born during its forward and alive when forward ends."""

    def __init__(self) -> None:
        self.born: dict[str, dict] = {}
        self.saved: dict[str, int] = {}

    def __call__(self, model: torch.nn.Module, tracker: ParallelTracker) -> None:
        for name in MODULES:
            mod = model.get_submodule(name)

            def pre(_m, _a, name=name):
                self.born[name] = tracker.live()

            def post(_m, _a, _o, name=name):
                self.born[name] = tracker.born_since(self.born[name])

            # prepend: before the TP styles' input hooks, so their all-gathers count inside.
            mod.register_forward_pre_hook(pre, prepend=True)
            mod.register_forward_hook(post)
        model.register_forward_hook(lambda *_: self.saved.update(
            {n: tracker.bytes_of(k) for n, k in self.born.items()}))


@functools.cache
def born_single() -> dict[str, int]:
    probe = BornSaved()
    with _fake_mode():
        model = ReferenceModel(SPEC, ref_options(wl("bf16-mixed")))
        tracker = ParallelTracker()
        probe(model, tracker)
        run_steps(model, SPEC, wl("bf16-mixed"), tracker, steps=1)
    return probe.saved


@functools.cache
def born_tp(tp: int, sp: bool) -> dict[str, int]:
    probe = BornSaved()
    trace_parallel(SPEC, ParallelConfig(tp=tp, sequence_parallel=sp), wl("bf16-mixed"),
                   steps=1, on_model=probe)
    return probe.saved


def test_tp_without_sp_divides_attention_and_mlp_and_replicates_norms() -> None:
    ref, got = born_single(), born_tp(2, False)
    for name in MODULES:
        if name.endswith("norm"):
            assert got[name] == ref[name] > 0, name
        else:
            assert got[name] * 2 == ref[name] > 0, name


def test_tp_with_sp_divides_norms_and_keeps_gathered_inputs() -> None:
    """With SP the norms run on the sequence shard. DTensor's all-gather before attention and
    MLP is saved by their first matmuls at full size (Megatron-LM saves the shard and gathers
    again in backward), so the full (b, s, h) norm output is saved once, inside them."""
    ref, got = born_single(), born_tp(2, True)
    full = B * S * H * 2  # bf16 (b, s, h)
    for name in MODULES:
        if name.endswith("norm"):
            assert got[name] * 2 == ref[name] - full, name
        else:
            assert got[name] * 2 == ref[name] + 2 * full, name


def test_tp_parameters_are_sharded_on_the_plan() -> None:
    got = trace_parallel(SPEC, ParallelConfig(tp=2), wl("bf16-mixed"), steps=1)
    model = ReferenceModel(SPEC, RefOptions(), device="meta")
    sharded = ("q_proj", "k_proj", "v_proj", "o_proj", "gate", "up", "down")
    expect = sum(p.numel() * 2 // (2 if any(s in n for s in sharded) else 1)
                 for n, p in model.named_parameters())
    assert got.params_bytes == expect
    assert got.steady.grads_bytes == expect


# --- real gloo, two processes ---------------------------------------------------------------

GLOO_CASES = {
    "fsdp2": (ParallelConfig(dp=2, zero=3), "fsdp-bf16"),
    "tp": (ParallelConfig(tp=2), "bf16-mixed"),
    "tp-sp": (ParallelConfig(tp=2, sequence_parallel=True), "bf16-mixed"),
    "ddp": (ParallelConfig(dp=2), "bf16-mixed"),
}


def summary(r: TraceResult) -> dict[str, Any]:
    return {"params": r.params_bytes, "steps": [
        {"saved": s.saved_activations_bytes, "grads": s.grads_bytes,
         "optimizer": s.optimizer_bytes,
         "peaks": {ph: (s.phases[ph].total_bytes, s.phases[ph].by_category) for ph in PHASES}}
        for s in r.steps]}


def _gloo_rank(rank: int, folder: str) -> None:
    """One worker: every case in turn on one gloo group (one process start for all of them).
    The group meets through a file store in ``folder`` (no TCP port to pick and race for), and
    each rank writes its summaries there; a worker that fails makes the parent's join raise."""
    dist.init_process_group("gloo", init_method=f"file://{folder}/store", rank=rank,
                            world_size=2)
    try:
        out = {case: summary(trace_rank(SPEC, par, wl(precision), fake=False))
               for case, (par, precision) in GLOO_CASES.items()}
    finally:
        dist.destroy_process_group()
    (Path(folder) / f"rank{rank}.json").write_text(json.dumps(out))
    leave_rank()  # gloo's threads must not race the interpreter's teardown (see leave_rank)


@pytest.fixture(scope="module")
def gloo_ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    assert all(par.world_size == 2 for par, _ in GLOO_CASES.values())
    folder = tmp_path_factory.mktemp("gloo")
    mp.start_processes(_gloo_rank, args=(str(folder),), nprocs=2, start_method="spawn")
    return [json.loads((folder / f"rank{r}.json").read_text()) for r in range(2)]


@pytest.mark.parametrize("case", list(GLOO_CASES))
def test_real_gloo_ranks_against_fake_group(case: str, gloo_ranks: list[dict[str, Any]]) -> None:
    """Each real rank against the fake-group trace (rank 0; tiny's dims all divide by 2, so
    rank 1 holds the same bytes). Parameters, gradients and optimizer states are equal
    exactly. Saved activations and phase peaks are at least the fake group's and at most
    ``gloo_late_bytes`` more: gloo's worker threads drop a finished collective's tensors after
    waking the main thread, so on a loaded machine they can outlive their last use (see
    ``gloo_late_bytes``). The ranks race each other, so they are not compared with each other."""
    par, precision = GLOO_CASES[case]
    # DDP's reducer needs real tensors; the others trace on fake ones.
    fake = summary(trace_parallel(SPEC, par, wl(precision), fake=case != "ddp"))
    late = gloo_late_bytes(SPEC, par, wl(precision))
    for rank, results in enumerate(gloo_ranks):
        real = results[case]
        assert real["params"] == fake["params"], rank
        for k, (got, want) in enumerate(zip(real["steps"], fake["steps"], strict=True)):
            assert {q: got[q] for q in ("grads", "optimizer")} == \
                {q: want[q] for q in ("grads", "optimizer")}, (rank, k)
            assert 0 <= got["saved"] - want["saved"] <= late, (rank, k)
            for phase in PHASES:
                extra = got["peaks"][phase][0] - want["peaks"][phase][0]
                assert 0 <= extra <= late, (rank, k, phase, extra)


@pytest.mark.parametrize("par, message", [
    (ParallelConfig(dp=2, zero=1), "zero 1 with dp 2 is not traced"),
    (ParallelConfig(tp=2, dp=2), "tp and dp together"),
    (ParallelConfig(pp=2), "pp, cp and ep"),
])
def test_untraced_layouts_are_refused(par: ParallelConfig, message: str) -> None:
    with pytest.raises(MemplanError, match=message):
        trace_parallel(SPEC, par, wl("bf16-mixed"))


def test_ddp_needs_real_tensors() -> None:
    with pytest.raises(MemplanError, match="DDP runs only on real tensors"):
        trace_parallel(SPEC, ParallelConfig(dp=2), wl("bf16-mixed"))
    assert not dist.is_initialized()  # the fake group is torn down on errors too

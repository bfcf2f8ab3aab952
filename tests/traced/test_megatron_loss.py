"""Megatron-LM's vocab-parallel cross-entropy, traced: what ``--framework megatron`` counts.

``_VocabParallelCrossEntropy`` (megatron/core/tensor_parallel/cross_entropy.py) is run as
Megatron runs it, on compute-dtype logits of shape [s, b, V / tp] from the output layer, on a
one-rank gloo group, under the exact tracker, and compared with memplan's head terms for
``loss_impl = megatron``: the saved softmax (the fp32 copy of the logits, turned into the
softmax in place), its target mask and indices; at the loss, the compute-dtype logits beside
it; in backward, the gradient made in place on the softmax and its cast to the compute dtype.
"""

from __future__ import annotations

import gc
import os

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("megatron.core")

from memplan.api import make_layout, make_workload  # noqa: E402
from memplan.model.dims import Dims  # noqa: E402
from memplan.model.head import (  # noqa: E402
    forward_extra_bytes,
    head_terms,
    loss_backward_bytes,
)
from memplan.profile.tracker import MemoryTracker  # noqa: E402
from memplan.spec import load_model  # noqa: E402



@pytest.fixture(scope="module")
def megatron_group():
    import torch.distributed as dist

    if dist.is_initialized():
        pytest.skip("a process group is already initialised")
    # one rank: an in-process store, no TCP port to find free (or to race another job for)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    from megatron.core import parallel_state

    parallel_state.initialize_model_parallel(1, 1)
    yield
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


@pytest.mark.parametrize(("b", "s", "vocab"), [(2, 128, 1000), (1, 96, 777)])
def test_vocab_parallel_cross_entropy_matches_the_terms(megatron_group, b: int, s: int,
                                                       vocab: int) -> None:
    from megatron.core.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy

    spec = load_model("tiny").model_copy(update={"vocab_size": vocab})
    wl = make_workload(spec, framework="megatron", loss_impl="megatron", micro_batch_size=b,
                       seq_len=s, precision="bf16-fp32-grads")
    dm = Dims.of(spec, make_layout(1), wl)
    tokens = b * s
    tracker = MemoryTracker()
    with tracker:
        tracker.set_phase("forward", step=1)
        logits = torch.randn(s, b, vocab, dtype=torch.bfloat16, requires_grad=True)
        target = torch.randint(0, vocab, (s, b))
        inputs = tracker.bytes_in("activations")  # the logits and the targets
        packed: dict[int, int] = {}

        def pack(t: torch.Tensor) -> torch.Tensor:
            packed[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            losses = vocab_parallel_cross_entropy(logits, target)
        loss = losses.sum()
        forward = tracker.peak(1, "forward").total_bytes - inputs
        tracker.set_phase("backward")
        # what the loss keeps: the storages autograd saved (not the inputs) and the losses
        # the step holds. Counted from the graph, not from the bytes alive: gloo's worker
        # thread lets go of the all-reduced per-token sums whenever it gets to run (a
        # barrier does not wait for that), which made the count depend on the machine's load
        for t in (logits, target):
            packed.pop(t.untyped_storage().data_ptr(), None)
        for t in (losses, loss):
            packed[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        saved = sum(packed.values())
        start = tracker.total_bytes
        loss.backward()
        backward = tracker.peak(1, "backward").total_bytes - start
    terms = {t.name: t.size_bytes for t in head_terms(spec, wl, dm)}
    softmax = terms["loss.softmax"]
    assert inputs == tokens * vocab * 2 + tokens * 8  # bf16 logits, int64 targets
    assert softmax == tokens * vocab * 4
    # saved: the softmax, the target mask (bool) and the shard's target indices (int64), and
    # the per-token losses with their sum the step holds (fp32)
    assert saved == softmax + terms["loss.target_mask"] + tokens * 4 + 4
    # at the loss the compute-dtype logits are alive (memplan's loss term: here an input)
    # beside the softmax buffer, with per-token temporaries (the max, the predicted logits,
    # the sum of exponentials) at most
    assert forward_extra_bytes(spec, wl, dm) == tokens * vocab * 2
    assert 0 <= forward - saved <= 4 * tokens * 8
    # backward: the logits' compute-dtype gradient beside the fp32 buffer it was computed in
    # (memplan's loss backward term), with per-token operands at most
    assert 0 <= backward - loss_backward_bytes(spec, wl, dm, 0) <= 4 * tokens * 8


@pytest.mark.parametrize(("b", "s", "vocab"), [(2, 128, 1000), (1, 96, 777)])
def test_fused_cross_entropy_keeps_what_the_unfused_keeps(megatron_group, b: int, s: int,
                                                          vocab: int) -> None:
    """--cross-entropy-loss-fusion (megatron/core/fusions/fused_cross_entropy.py, the native
    implementation, the only one Megatron-LM's validate_args allows): its steps run eagerly
    here (megatron.core.jit's jit_fuser off: a dispatch mode does not see inside compiled
    kernels), against the unfused loss on the same inputs. The forward peak and the saved
    tensors are the same bytes (the fp32 softmax, the target mask, the target indices); the
    backward differs by per-token operands (the loss gradient and indices, under 4 x 8 B per
    token), which memplan's loss terms leave out for both."""
    import importlib

    import megatron.core.jit as jit
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy

    compiled = jit.jit_fuser
    jit.disable_jit_fuser()
    try:
        import megatron.core.fusions.fused_cross_entropy as fused_module
        fused_module = importlib.reload(fused_module)
        group = parallel_state.get_tensor_model_parallel_group()
        runs = {}
        for name, loss_fn in (
                ("unfused", vocab_parallel_cross_entropy),
                ("fused", lambda x, t: fused_module.fused_vocab_parallel_cross_entropy(x, t,
                                                                                       group))):
            torch.manual_seed(0)
            tracker = MemoryTracker()
            with tracker:
                tracker.set_phase("forward", step=1)
                logits = torch.randn(s, b, vocab, dtype=torch.bfloat16, requires_grad=True)
                target = torch.randint(0, vocab, (s, b))
                inputs = tracker.bytes_in("activations")
                loss = loss_fn(logits, target).sum()
                forward = tracker.peak(1, "forward").total_bytes - inputs
                tracker.set_phase("backward")
                # what the loss keeps, once gloo's worker has let go of the all-reduced
                # per-token sums (its queued work holds them until it runs: a barrier waits
                # for it) and no cyclic garbage waits for the collector
                torch.distributed.barrier()
                gc.collect()
                saved = tracker.bytes_in("activations") - inputs
                start = tracker.total_bytes
                loss.backward()
                backward = tracker.peak(1, "backward").total_bytes - start
            runs[name] = (forward, saved, backward, logits.grad.dtype)
    finally:
        jit.jit_fuser = compiled
        importlib.reload(fused_module)
    (f0, s0, b0, g0), (f1, s1, b1, g1) = runs["unfused"], runs["fused"]
    assert (f1, s1, g1) == (f0, s0, g0) == (f0, s0, torch.bfloat16)
    assert 0 <= b1 - b0 <= 4 * b * s * 8


def _allocator_bytes(run) -> tuple[int, int, int]:
    """(forward peak, bytes at the backward's start, backward peak) of ``run(mark)``, each
    over the bytes alive before it, from the CPU allocator's own events (torch.profiler with
    profile_memory): they include the buffers compiled kernels allocate, which a dispatch
    mode such as the exact tracker does not see. ``run`` calls ``mark()`` between its forward
    and its backward."""
    from torch.profiler import ProfilerActivity, profile, record_function

    def marked():
        with record_function("memplan.backward"):
            pass

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        run(marked)
    events = prof.profiler.kineto_results.events()
    mark = next(e.start_ns() for e in events if e.name() == "memplan.backward")
    alive = forward = backward = start = 0
    for event in sorted((e for e in events if e.name() == "[memory]"),
                        key=lambda e: e.start_ns()):
        if event.start_ns() >= mark and not start:
            start = alive
        alive += event.nbytes()
        if event.start_ns() < mark:
            forward = max(forward, alive)
        else:
            backward = max(backward, alive)
    return forward, start, backward


def test_compiled_fused_cross_entropy_backward_copies_the_softmax(megatron_group) -> None:
    """--cross-entropy-loss-fusion as Megatron-LM runs it: fused_cross_entropy.py's steps
    compiled by jit_fuser (torch.compile, Inductor; here on CPU) on bf16 logits [s, b, V] of
    s 64, b 2, V 1024 (T 128 tokens). The forward peaks as the unfused loss's (T * V * (2 +
    4): the bf16 logits and the fp32 softmax). In backward the compiled calculate_gradients
    makes the target's index_put on an fp32 copy of the saved softmax and writes the product
    back into it: beyond the logits and the softmax alive at its start, the bf16 gradient T *
    V * 2 and that copy T * V * 4 (memplan's loss backward term for loss_impl megatron-fused),
    with per-token operands at most. (Run eagerly, the backward holds the bf16 gradient alone:
    test_fused_cross_entropy_keeps_what_the_unfused_keeps.)"""
    import importlib

    import megatron.core.fusions.fused_cross_entropy as fused_module
    from megatron.core import parallel_state

    import memplan.api

    fused_module = importlib.reload(fused_module)  # jit_fuser as Megatron sets it: compiled
    group = parallel_state.get_tensor_model_parallel_group()
    s, b, vocab = 64, 2, 1024
    tokens = s * b

    def step(mark) -> None:
        logits = torch.randn(s, b, vocab, dtype=torch.bfloat16, requires_grad=True)
        target = torch.randint(0, vocab, (s, b))
        loss = fused_module.fused_vocab_parallel_cross_entropy(logits, target, group).sum()
        mark()
        loss.backward()

    step(lambda: None)  # compiles the four functions
    forward, start, backward = _allocator_bytes(step)
    spec = load_model("tiny").model_copy(update={"vocab_size": vocab})
    wl = memplan.api.make_workload(spec, framework="megatron", loss_impl="megatron-fused",
                                   micro_batch_size=b, seq_len=s,
                                   precision="bf16-fp32-grads")
    dm = Dims.of(spec, make_layout(1), wl)
    # per-token tensors: the int64 targets, the shard's target indices, the mask, the max,
    # the predicted logits with the sum of exponentials, the losses: under 8 x 8 B a token
    per_token = 8 * tokens * 8
    assert 0 <= forward - tokens * vocab * (2 + 4) <= per_token
    assert 0 <= start - tokens * vocab * (2 + 4) <= per_token  # the logits, the softmax
    extra = loss_backward_bytes(spec, wl, dm, 0)
    assert extra == tokens * vocab * (2 + 4)
    assert 0 <= backward - start - extra <= per_token

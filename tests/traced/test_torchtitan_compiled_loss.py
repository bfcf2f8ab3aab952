"""torchtitan's cross-entropy compiled whole (``compile_loss`` with ``loss_impl torchtitan``,
``memplan.model.head``) against real training steps of the reference model.

What is traced: the reference model (2 layers, vocabulary 2048) whose logits go to
torchtitan's ``cross_entropy_loss`` (``F.cross_entropy(pred.flatten(0, 1).float(),
labels.flatten(0, 1))``, torchtitan/components/loss.py at e7c0cae, the commit of the
published H200 float8 run) under ``torch.compile``, as ``build_cross_entropy_loss`` wraps it
when the job compiles: Inductor on CPU, partitioned by ``min_cut_rematerialization_partition``.
Real tensors, counted by ``memplan.profile.tracker.CompiledTracker`` (the buffers Inductor's
wrapper allocates included).

What the partitioner saves (traced): the logits as the head returned them (the graph's input)
and two fp32 numbers per token (the row max and the log-sum-exp), with the labels and the
count of labels as an fp32 scalar; for two sequences of 128 tokens 256 x 2048 x 2 = 1,048,576 B of bf16
logits and 2,048 B of statistics, where the eager loss saves 2,097,152 B of fp32
log-softmax.

Then torchtitan 0.3's own loss classes, compiled as its Trainer builds them
(``BaseLoss._maybe_compile``): its ``ChunkedLossWrapper`` with the inner loss compiled or eager
(``memplan.model.loss_in_call``), at tp 1 and with the head ``ColwiseParallel`` on a TP mesh of
two, and its ``CrossEntropyLoss`` compiled on vocabulary-split DTensor logits (loss parallel,
``memplan.model.head``), on rank 0 of the fake process group.
"""

from __future__ import annotations

import contextlib

import pytest

torch = pytest.importorskip("torch")

from memplan.api import make_layout, make_workload  # noqa: E402
from recorded import compare  # noqa: E402 (tests/traced/recorded.py)
from memplan.spec import load_model  # noqa: E402

TOLERANCE_PCT = 1.0
EXACT = ("params_bytes", "grads_bytes", "activations_bytes")

CASES = {
    "b2-s128-bf16-pure": dict(micro_batch_size=2, seq_len=128, precision="bf16-pure"),
    "b1-s64-bf16-pure": dict(micro_batch_size=1, seq_len=64, precision="bf16-pure"),
    "b2-s128-fp32": dict(micro_batch_size=2, seq_len=128, precision="fp32"),
    "b2-s128-recompute": dict(micro_batch_size=2, seq_len=128, precision="bf16-pure",
                              recompute="full"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_torchtitan_compiled_loss_matches_trace(case: str) -> None:
    spec = load_model("tiny").model_copy(update={"vocab_size": 2048})
    wl = make_workload(spec, loss_impl="torchtitan", compile_loss=True, **CASES[case])
    result = compare(spec, make_layout(1), wl, fake=False)
    for name in EXACT:
        row = result.row(name)
        assert row.estimated_bytes == row.measured_bytes, row
    bad = [r for r in result.rows if abs(r.diff_pct) > TOLERANCE_PCT]
    assert not bad, bad


# --- torchtitan 0.3's own loss classes, compiled as its Trainer builds them -----------------

@pytest.fixture()
def inductor_traced():
    """Dynamo's caches reset, no on-disk cache (a hit would skip the rerouting of Inductor's
    buffers), Inductor's CPU buffers made through aten (``inductor_buffers_seen``)."""
    from memplan.profile.tracker import inductor_buffers_seen

    torch._dynamo.reset()
    with torch._functorch.config.patch(enable_autograd_cache=False), \
            torch._inductor.config.patch(fx_graph_cache=False), inductor_buffers_seen():
        yield
    torch._dynamo.reset()


def _compile_config(compiled: bool):
    from torchtitan.config import CompileConfig

    return CompileConfig(enable=True, components=["loss"]) if compiled else None


@contextlib.contextmanager
def _tp_group(tp: int):
    """A TP mesh of ``tp`` ranks, rank 0 of the fake process group, with the "partial_dtensor"
    backend the Trainer sets (``cross_entropy_loss`` runs ``_LossParallelCrossEntropy`` on a
    ``Shard(-1)`` DTensor's local shard); none at tp 1."""
    if tp == 1:
        yield None
        return
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore
    from torchtitan.distributed import utils as dist_utils

    if dist.is_initialized():
        pytest.skip("a process group is already initialised")
    backend = dist_utils.get_spmd_backend()
    _stale_meshes_dropped()
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=tp)
    try:
        dist_utils.set_spmd_backend("partial_dtensor")
        yield init_device_mesh("cpu", (tp,), mesh_dim_names=("tp",))
    finally:
        dist_utils.set_spmd_backend(backend)
        dist.destroy_process_group()
        _stale_meshes_dropped()


def _stale_meshes_dropped() -> None:
    """DTensor's C++ sharding-propagation cache keeps the output specs it computed, with
    their device mesh: after a process group is destroyed and another made (earlier tests),
    an op on an equal mesh is given the old mesh, whose destroyed group Dynamo then meets
    (graph break in ``from_local``, ``ValueError: Group ... is not registered``). Cleared
    around each group of these tests."""
    torch._C._clear_DTensor_sharding_propagator_cache()


# (tp, compiled): the loss call's most beyond its input, as traced
WRAPPER_PEAKS = {(1, False): 2_197_516, (1, True): 1_157_132,
                 (2, False): 1_413_200, (2, True): 887_372}


@pytest.mark.parametrize(("tp", "compiled"), list(WRAPPER_PEAKS),
                         ids=["eager", "compiled", "tp2-eager", "tp2-compiled"])
def test_chunked_loss_wrapper_matches_loss_in_call(inductor_traced, tp: int,
                                                   compiled: bool) -> None:
    """torchtitan 0.3's ``ChunkedLossWrapper`` (4 chunks) with its inner ``CrossEntropyLoss``
    built with compile.components "loss" (``BaseLoss._maybe_compile``: each chunk's
    ``cross_entropy_loss`` one Inductor graph) or eager, on bf16 hidden states of 2 x 128
    tokens (h 64) and a bf16 ``lm_head`` of 64 x 2048 (no data parallelism: the weight's
    gradient summed by autograd in bf16); at tp 2 the head ``ColwiseParallel`` to a
    ``Shard(-1)`` DTensor (loss parallel, as torchtitan's llama3 TP plan makes it), rank 0 of
    the fake process group. Against ``loss_in_call`` (loss_chunk_backward in-loss).

    T 256, a chunk of 64 tokens; what the call holds throughout: the chunks' copies
    256 x 64 x 2 + 256 x 8 = 34,816, the fp32 input-gradient sum 65,536 and the fp32 total:
    100,356. At tp 1 a chunk's logits are 64 x 2048 x 2 = 262,144 B (fp32 524,288), the
    summed weight gradient 262,144. Eagerly a later chunk's loss backward is the call's most:
    the summed gradient, the bf16 logits, the fp32 copy, log-softmax and its gradient
    (3 x 524,288): 2,097,152, 2,197,508 B with what is held (traced 2,197,516: 8 B of
    scalars). Compiled that moment is the summed gradient, the logits, their bf16 gradient
    and 3 x 64 x 4 (the graph's saved row max and log-sum-exp, its backward's per-token
    buffer): 787,200, under the chunk's projection backward (the summed gradient, the logits
    and their gradient, the new weight gradient 262,144, the chunk's input gradient 64 x 64 x
    2 = 8,192): 1,056,768, 1,157,124 B with what is held (traced 1,157,132).

    At tp 2 the logits are 64 x 1024 x 2 = 131,072 (fp32 262,144), the summed gradient of
    the shard 131,072. Eagerly ``_LossParallelCrossEntropy.backward`` holds four fp32 (the
    saved log-probabilities, zeros, exp, their sum) beside the logits and the summed
    gradient: 1,310,720, 1,411,076 B with what is held (traced 1,413,200: 2,124 B of
    per-token indices and masks, 0.15%). Compiled the forward's kernel is the most: the
    summed gradient, the logits, the fp32 log-probabilities and the saved softmax less the
    targets (2 x 262,144), three fp32 and a mask byte per token (832): 787,264, 887,620 B
    with what is held (traced 887,372: with a GPU's realization rules,
    ``memplan.profile.inductor_rules``, one of the three per-token numbers is inlined, not
    a buffer; 887,628 with the CPU's). Left after the call either way: the summed input
    gradient cast to bf16, 256 x 64 x 2 = 32,768 B, and the fp32 loss."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module
    from torchtitan.components.loss import ChunkedLossWrapper, CrossEntropyLoss

    from memplan.model import head, loss_in_call
    from memplan.model.dims import Dims
    from memplan.profile.tracker import CompiledTracker

    b, s, chunks = 2, 128, 4
    spec = load_model("tiny").model_copy(update={"vocab_size": 2048})
    h, vocab = spec.hidden_size, spec.vocab_size
    wl = make_workload(spec, loss_impl="torchtitan", precision="bf16-pure", micro_batch_size=b,
                       seq_len=s, loss_chunks=chunks, loss_chunk_backward="in-loss",
                       compile_loss=compiled)
    layout = make_layout(tp, tp=tp, tp_style="dtensor") if tp > 1 else make_layout(1)
    dm = Dims.of(spec, layout, wl)
    with _tp_group(tp) as mesh:
        torch.manual_seed(0)
        lm_head = torch.nn.Linear(h, vocab, bias=False, dtype=torch.bfloat16)
        if mesh is not None:
            parallelize_module(lm_head, mesh, ColwiseParallel(
                input_layouts=Replicate(), output_layouts=Shard(-1), use_local_output=False))
        loss_fn = ChunkedLossWrapper.Config(num_chunks=chunks, loss_fn=CrossEntropyLoss.Config()
                                            ).build(compile_config=_compile_config(compiled))
        loss_fn.set_lm_head(lm_head)
        tracker = CompiledTracker()
        with tracker:
            tracker.register(list(lm_head.parameters()), "parameters")
            for step in (1, 2):  # the first compiles; the second is measured
                lm_head.weight.grad = None
                tracker.set_phase("forward", step=step)
                x = torch.randn(b, s, h, dtype=torch.bfloat16, requires_grad=True)
                hidden = x * 1  # the final norm's output: not a leaf
                labels = torch.randint(0, vocab, (b, s))
                tokens = torch.tensor(b * s)
                base = tracker.total_bytes
                loss, _ = loss_fn(hidden, labels, tokens)
                peak = tracker.peak(step, "forward").total_bytes - base
                left = tracker.total_bytes - base - getattr(
                    lm_head.weight.grad, "_local_tensor", lm_head.weight.grad).nbytes
                tracker.set_phase("backward")
                loss.backward()
                del loss, hidden, x
    modelled = max(loss_in_call.forward_extra_bytes(spec, wl, dm),
                   loss_in_call.last_chunk_bytes(spec, wl, dm, 0))
    assert abs(peak - modelled) <= 0.01 * peak, (peak, modelled)
    assert peak == WRAPPER_PEAKS[tp, compiled]
    terms = {t.name: t.size_bytes for t in head.head_terms(spec, wl, dm)}
    assert 0 <= left - terms["loss.input_grad"] <= 8, left  # the loss and its sum


def test_compiled_loss_parallel_matches_head(inductor_traced) -> None:
    """torchtitan 0.3's ``CrossEntropyLoss`` built compiled, on bf16 logits split over the
    vocabulary (a ``Shard(2)`` DTensor on a TP mesh of 2, rank 0 of the fake process group;
    the "partial_dtensor" backend the Trainer sets, so ``cross_entropy_loss`` runs
    ``_LossParallelCrossEntropy`` on the local shard): one graph, its collectives in it.

    2 x 64 tokens (T 128), vocabulary 2048 (1024 a rank): the fp32 shard 128 x 1024 x 4 =
    524,288 B, the bf16 one 262,144. Saved: the softmax less the one-hot targets (fp32,
    524,288) and the out-of-shard mask (128), not the logits: 524,416 (traced 524,420, with
    the fp32 loss). The forward's kernel holds the fp32 log-probabilities (524,288), three
    fp32 numbers per token (1,536) and the loss (4) beside them: 1,050,244 B beyond the
    logits (traced 1,049,732: with a GPU's realization rules one of the three per-token
    numbers is inlined, not a buffer; to the byte with the CPU's). The backward makes the
    bf16 gradient, 262,144 B beside what is saved (traced 262,152: 8 B of scalars)."""
    from torch.distributed.tensor import DTensor, Shard
    from torchtitan.components.loss import CrossEntropyLoss

    from memplan.model import head
    from memplan.model.dims import Dims
    from memplan.profile.tracker import CompiledTracker

    b, s, tp = 2, 64, 2
    spec = load_model("tiny").model_copy(update={"vocab_size": 2048})
    wl = make_workload(spec, loss_impl="torchtitan", precision="bf16-pure", micro_batch_size=b,
                       seq_len=s, compile_loss=True)
    dm = Dims.of(spec, make_layout(tp, tp=tp, tp_style="dtensor"), wl)
    shard = spec.vocab_size // tp
    with _tp_group(tp) as mesh:
        loss_fn = CrossEntropyLoss.Config().build(compile_config=_compile_config(True))
        tracker = CompiledTracker()
        with tracker:
            for step in (1, 2):  # the first compiles; the second is measured
                tracker.set_phase("forward", step=step)
                x = torch.randn(b, s, shard, dtype=torch.bfloat16, requires_grad=True)
                pred = DTensor.from_local(x * 1, mesh, (Shard(2),), run_check=False)
                labels = torch.randint(0, spec.vocab_size, (b, s))
                tokens = torch.tensor(b * s)
                base = tracker.total_bytes
                loss, _ = loss_fn(pred, labels, tokens)
                forward = tracker.peak(step, "forward").total_bytes - base
                saved = tracker.total_bytes - base
                tracker.set_phase("backward")
                before = tracker.total_bytes
                loss.backward()
                backward = tracker.peak(step, "backward").total_bytes - before
                del loss, pred, x
    terms = {t.name: t.size_bytes for t in head.head_terms(spec, wl, dm)}
    loss_saved = terms["loss.softmax_grad"] + terms["loss.target_mask"]
    logits = dm.tokens * dm.vocab_shard * dm.e  # made before ``base``
    modelled_forward = loss_saved + head.forward_extra_bytes(spec, wl, dm) - logits
    assert (saved, forward, backward) == (524_420, 1_049_732, 262_152)
    assert abs(saved - loss_saved) <= 0.01 * saved, (saved, loss_saved)
    assert abs(forward - modelled_forward) <= 0.01 * forward, (forward, modelled_forward)
    modelled_backward = head.loss_backward_bytes(spec, wl, dm, 0)
    assert abs(backward - modelled_backward) <= 0.01 * backward, (backward, modelled_backward)

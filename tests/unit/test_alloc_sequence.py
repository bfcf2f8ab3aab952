"""The model-derived allocation sequence (``memplan.model.alloc_sequence``) replayed through the
caching-allocator model: a stage's segment layout derived by hand from the allocator's rules,
the fold against the whole replay, and the estimate's reserved fields."""

from __future__ import annotations

from memplan.model.alloc_sequence import (
    LayerTensors,
    StageInputs,
    replay_stage,
    stage_sequence,
)
from memplan.model.allocator import Alloc, AllocatorConfig, Blip, Free
from memplan.model.dims import Term
from memplan.model.embedding import EmbeddingBlock
from memplan.model.head import HeadBlock
from memplan.model.layer import LayerKind, LayerMoment
from memplan.model.sharding import DataParallel
from memplan.model.walk import Walk

MiB = 1 << 20


def _stage(layers: int, elements: int = MiB) -> StageInputs:
    """``layers`` layers of one bf16 weight of ``elements`` (1 Mi: 2 MiB) each, Adam's two
    fp32 states per element (4 MiB each per tensor), bf16 gradients (2 MiB per layer); each layer
    saves one 12 MiB tensor, has no transient beyond it, and one backward moment at which its
    gradient exists. No embedding, head, master copy, temporaries or data parallelism."""
    kind = LayerKind(terms=(Term("layer.saved", 12 * MiB),), saved_bytes=12 * MiB,
                     moments=(LayerMoment("only", 12 * MiB, 0, ("layer",)),),
                     forward_peak_bytes=12 * MiB)
    walk = Walk(runs=[(kind, 2 * elements, (2 * elements,), layers)], other_bytes=0,
                rest_saved=0,
                head=HeadBlock(), embedding=EmbeddingBlock(), sharding=DataParallel())
    return StageInputs(
        walk=walk, layers=tuple(LayerTensors((elements,)) for _ in range(layers)),
        embed_elements=(), head_elements=(), params_bytes=layers * 2 * elements,
        grad_per_param=2, master_bytes=0, setup_bytes=0, states_bytes=layers * 8 * elements,
        num_states=2, opt_temp=0, first_step_states_late=False, buffers=0, buckets=0,
        persistent_grads=0, microbatches=1, keep_grads=False)


def test_sequence_of_a_two_layer_stage() -> None:
    """Setup: both weights (2 MiB). Each step: the forward saves T1, T2 (12 MiB); the backward
    makes layer 2's gradient before freeing T2, then layer 1's before freeing T1; step 1's
    optimizer makes the four states (4 MiB) lazily; zero_grad frees both gradients."""
    seq = stage_sequence(_stage(2))
    sizes = [(type(e).__name__, getattr(e, "size_bytes", None)) for e in seq.events]
    step = [("Alloc", 12 * MiB), ("Alloc", 12 * MiB), ("Alloc", 2 * MiB), ("Free", None),
            ("Alloc", 2 * MiB), ("Free", None)]
    assert sizes[:2] == [("Alloc", 2 * MiB)] * 2
    assert sizes[2:8] == step
    assert sizes[8:12] == [("Alloc", 4 * MiB)] * 4
    assert sizes[12:14] == [("Free", None)] * 2
    assert sizes[14:] == (step + [("Free", None)] * 2) * 2
    assert seq.marks == [2, 14, 22, 30]
    # step 2's forward and layer 2's gradient over the weights, step 1's states and nothing
    # else: 4 + 16 + 24 + 2 MiB
    assert seq.peak == 46 * MiB
    assert all(isinstance(e, (Alloc, Free)) for e in seq.events)


def test_two_layer_stage_segment_layout_by_hand() -> None:
    """Rules (``CUDACachingAllocator.cpp``): a request of 1-10 MiB gets a 20 MiB segment, one
    of 10 MiB or more its size rounded to 2 MiB; best fit is the smallest free block of the
    pool (ties: the older segment); a large-pool block splits when more than 1 MiB remains.

    Setup: W1 opens segment A (20 MiB) and splits it; W2 splits A again [W1 W2 | 16 free].
    Step 1: T1 (12) takes A's 16 (4 left); T2 finds nothing -> segment B (12). Backward: G2
    (2) takes A's 4 (split, 2 left); T2 freed (B whole); G1 takes A's 2 exactly; T1 freed
    (A's 12 MiB hole). The states S (4 each): S1a into A's 12 hole (8 left), S1b into those 8
    (4 left), S2a into the 4 exactly, S2b into B (8 left). zero_grad frees G2, G1: A has
    4 free, B 8. Reserved 20 + 12 = 32 MiB.
    Step 2: T1 (12) fits neither 4 nor 8 -> segment C (12); T2 -> segment D (12): reserved
    56 MiB, 24 MiB more than step 1 (step 1's states sit where step 1's activations were).
    Step 3 reuses C and D: 56 MiB. Tensor peak 46 MiB (step 2, layer 2's gradient beside
    everything): 10 MiB of the reserved peak is not tensors."""
    r = replay_stage(_stage(2), AllocatorConfig())
    assert r.reserved_by_step == (20 * MiB, 32 * MiB, 56 * MiB, 56 * MiB)
    assert r.reserved_peak_bytes == 56 * MiB
    assert r.tensor_peak_bytes == 46 * MiB
    assert r.fragmentation_bytes == 10 * MiB


def test_two_layer_stage_with_max_split_size() -> None:
    """``max_split_size_mb:10``: get_free_block never hands a block of 10 MiB or more to a
    smaller request (it looks at the best fit only); a request of 10 MiB or more takes a block
    less than 20 MiB (max_non_split_rounding) larger whole (should_split: no split at or above
    the limit). Setup: W1 opens A (20) and splits it; W2's best fit is A's 18, oversized: B
    (20). Step 1: T1 (12) takes A's 18 whole, T2 B's 18 whole; G2 (2): no free block -> C
    (20, split); T2 freed (B's 18); G1: best fit B's 18, oversized -> D; T1 freed. Each state
    (4): the best fit is an 18 or a new segment's 16, always oversized -> E, F, G, H. Reserved
    8 x 20 = 160 MiB. Step 2: T1, T2 take E's and F's 16 whole; G2 and G1 meet oversized best
    fits (16) -> I, J: 200. Step 3: the same -> K, L: 240. Without a capacity the 20 MiB
    segments the gradients leave whole are never reused (a request below the limit never takes
    a block at or above it); with one, release_available_cached_blocks frees them."""
    r = replay_stage(_stage(2), AllocatorConfig(max_split_size_bytes=10 * MiB))
    assert r.reserved_by_step == (40 * MiB, 160 * MiB, 200 * MiB, 240 * MiB)


def test_two_layer_stage_with_expandable_segments() -> None:
    """``expandable_segments:True``: one segment of address space for the large pool, backed
    by 20 MiB pages; a request maps pages from the lowest free-then-unmapped run that holds it;
    blocks split when 512 B or more remain; best fit prefers the block that can grow (a free
    block followed by unmapped space) only over a larger one. Offsets in MiB.
    Setup: page 1 [0, 20): W1 0-2, W2 2-4, free 4-20. Reserved 20.
    Step 1: T1 4-16; T2: no free 12 -> free 16-20 and page 2 -> T2 16-28, free 28-40 (40).
    G2 28-30 (free 30-40); T2 freed (16-28). G1: 30-40 can grow without end, so 16-28 is the
    better fit: G1 16-18 (free 18-28). T1 freed (4-16). States (4): S1a 18-22, S1b 22-26
    (2 left), S2a: 4-16 beats 30-40 (it can grow): 4-8, S2b 8-12. zero_grad: free 12-18 and
    26-40. Step 2: T1 26-38; T2: 38-40 and page 3 -> 38-50 (60). G2 12-14, T2 freed (38-60),
    G1 14-16, T1 freed (26-60). Step 3 fits in 26-60 and 12-18: 60. Tensor peak 46 MiB: 14 MiB
    of the reserved peak is not tensors, more than without expandable segments (10): whole
    20 MiB pages."""
    r = replay_stage(_stage(2), AllocatorConfig(expandable_segments=True))
    assert r.reserved_by_step == (20 * MiB, 40 * MiB, 60 * MiB, 60 * MiB)
    assert r.tensor_peak_bytes == 46 * MiB
    assert r.fragmentation_bytes == 14 * MiB


def test_fold_equals_the_whole_replay_on_a_uniform_stage() -> None:
    """24 identical layers of 12 MiB weights (each its own segment, as are its 12 MiB
    gradient, 24 MiB states and 12 MiB saved tensor): replayed whole, and folded (the run cut
    to 2 + k periods, k = 0..3, extrapolated once the reserved bytes grow by the same amount
    three times) give the same reserved bytes at every step's end and the same tensor peak.
    With expandable segments the period is five layers (five 12 MiB tensors fill three 20 MiB
    pages)."""
    stage = _stage(24, 6 * MiB)
    for cfg in (AllocatorConfig(), AllocatorConfig(expandable_segments=True)):
        whole = replay_stage(stage, cfg)
        folded = replay_stage(stage, cfg, fold_above=6, fold_start=2)
        assert folded.folded and not whole.folded
        assert folded.reserved_by_step == whole.reserved_by_step
        assert folded.tensor_peak_bytes == whole.tensor_peak_bytes
    # without expandable segments the period is one layer: 2 + 3 + 4 + 5 layers replayed
    assert (replay_stage(stage, AllocatorConfig(), fold_above=6, fold_start=2).num_events
            < replay_stage(stage, AllocatorConfig()).num_events)


def test_uniform_stage_grows_by_whole_layers() -> None:
    """Without the fold, by hand for n layers: the weights fill one 20 MiB segment per 10
    layers (2 MiB each, a request between 1 and 10 MiB takes a 20 MiB segment); step 2 and
    step 3 reserve the same (the allocator has reached its steady state after step 2)."""
    for n in (4, 10, 20):
        r = replay_stage(_stage(n), AllocatorConfig())
        assert r.reserved_by_step[0] == -(-n // 10) * 20 * MiB
        assert r.reserved_by_step[2] == r.reserved_by_step[3]
        assert r.reserved_by_step[2] >= r.reserved_by_step[1]


def test_estimate_reserved_fields() -> None:
    """``estimate_reserved`` on GPT-2 (one stage): the reserved peak is the walk's tensor peak
    plus the allocator's bytes beyond the sequence's own (never below the tensor peak), step
    by step it never decreases (no capacity: nothing is released), and the step note names
    the step that reserves more."""
    import memplan
    from memplan.model.reserved import estimate_reserved

    est = memplan.estimate("gpt2", micro_batch_size=2, seq_len=512, precision="fp32")
    (r,) = estimate_reserved(est)
    s = est.stages[0]
    assert r.reserved_peak_bytes == s.tensor_peak_bytes + r.fragmentation_bytes
    assert r.fragmentation_bytes >= 0 and r.expandable_reserved_peak_bytes >= s.tensor_peak_bytes
    assert list(r.reserved_by_step) == sorted(r.reserved_by_step)
    assert r.step_note.startswith("step 2 reserves") == (r.reserved_by_step[2]
                                                         > r.reserved_by_step[1])


def test_alloc_conf_option_refuses_what_is_not_modelled(capsys) -> None:
    """An allocator option the model does not follow is refused in one line, exit 2."""
    from memplan.cli import main

    assert main(["estimate", "-m", "tiny", "--alloc-conf",
                 "garbage_collection_threshold:0.6"]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "memplan: error: PYTORCH_CUDA_ALLOC_CONF: 'garbage_collection_threshold' is not "
        "modelled"]


def _synthetic_snapshot() -> dict:
    """A synthetic ``torch.cuda.memory._snapshot()`` (made by hand, not by a GPU): one device,
    a trace of A (8 MiB), B (8 MiB), A freed, C (4 MiB), then an out-of-memory event for a
    12 MiB request with 6 MiB free on the device. The real allocator's choices, by its rules:
    A opens a 20 MiB segment (split, 12 left), B takes 8 of those (4 left at 16-20), C's best
    fit is that 4 MiB tail (smaller than A's freed 8). The segment at the failure: A's 8 MiB
    inactive, B and C allocated: reserved 20, allocated 12."""
    mib = MiB
    trace = [
        {"action": "segment_alloc", "addr": 0, "size": 20 * mib, "stream": 0},
        {"action": "alloc", "addr": 0, "size": 8 * mib, "stream": 0},
        {"action": "alloc", "addr": 8 * mib, "size": 8 * mib, "stream": 0},
        {"action": "free_requested", "addr": 0, "size": 8 * mib, "stream": 0},
        {"action": "free_completed", "addr": 0, "size": 8 * mib, "stream": 0},
        {"action": "alloc", "addr": 16 * mib, "size": 4 * mib, "stream": 0},
        {"action": "oom", "addr": 0, "size": 12 * mib, "device_free": 6 * mib, "stream": 0},
    ]
    blocks = [{"address": 0, "size": 8 * mib, "requested_size": 8 * mib, "state": "inactive"},
              {"address": 8 * mib, "size": 8 * mib, "requested_size": 8 * mib,
               "state": "active_allocated"},
              {"address": 16 * mib, "size": 4 * mib, "requested_size": 4 * mib,
               "state": "active_allocated"}]
    segment = {"device": 0, "address": 0, "total_size": 20 * mib, "allocated_size": 12 * mib,
               "active_size": 12 * mib, "requested_size": 12 * mib, "stream": 0,
               "segment_type": "large", "segment_pool_id": (0, 0), "is_expandable": False,
               "frames": [], "blocks": blocks}
    return {"segments": [segment], "device_traces": [trace]}


def test_diagnose_snapshot_fragmentation() -> None:
    """The synthetic snapshot: reserved 20 MiB, allocated 12: 8 MiB reserved but unallocated.
    The request lacked 12 - 6 = 6 MiB, which the unallocated 8 MiB would have covered in one
    piece: all of the failure is fragmentation. Its trace replayed by the allocator model
    makes the same choices (one 20 MiB segment: 20 MiB reserved, as recorded); with
    expandable segments one 20 MiB page (C then takes A's freed block, which cannot grow,
    over the tail, which can): 20 MiB."""
    from memplan.diagnose import diagnose
    from memplan.diagnose.snapshot import snapshot_report

    data = _synthetic_snapshot()
    result = diagnose("tiny", oom=snapshot_report(data), snapshot=data, fixes=False)
    f = result.fragmentation
    assert (f.requested_bytes, f.device_free_bytes, f.unallocated_bytes) == (
        12 * MiB, 6 * MiB, 8 * MiB)
    assert f.share == 1.0
    assert f.replay is not None and f.replay.num_events == 4
    assert (f.replay.recorded_reserved_bytes, f.replay.replayed_reserved_bytes,
            f.replay.expandable_reserved_bytes) == (20 * MiB, 20 * MiB, 20 * MiB)


def test_diagnose_oom_message_against_the_model() -> None:
    """An allocator message (2.1+ format): 2.00 GiB requested, 1.50 GiB free, 70.00 GiB
    allocated and 6.50 GiB reserved but unallocated: the request lacked 0.50 GiB, which the
    unallocated reserve holds 13 times over: all of the failure is fragmentation. Beside it,
    the model's reserved memory of the configuration diagnosed (its own stage's, from
    ``estimate_reserved``)."""
    from memplan.diagnose import diagnose
    from memplan.model.reserved import estimate_reserved

    text = ("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 "
            "has a total capacity of 79.15 GiB of which 1.50 GiB is free. Including "
            "non-PyTorch memory, this process has 77.64 GiB memory in use. Of the allocated "
            "memory 70.00 GiB is allocated by PyTorch, and 6.50 GiB is reserved by PyTorch "
            "but unallocated.")
    result = diagnose("llama-3-8b", oom=text, gpus=8, zero=3, micro_batch_size=4,
                      fixes=False)
    f = result.fragmentation
    assert f.unallocated_bytes == round(6.5 * 2**30)
    assert f.share == 1.0
    est = result.diagnosis.estimate
    r = estimate_reserved(est)[est.stages.index(result.diagnosis.stage)]
    assert f.model_fragmentation_bytes == r.fragmentation_bytes
    assert f.replay is None


def test_allocator_runs_out_of_memory_although_the_tensors_fit() -> None:
    """The two-layer stage (``test_two_layer_stage_segment_layout_by_hand``: tensor peak
    46 MiB, 56 MiB reserved without a limit) with 50 MiB that cudaMalloc may take: step 2's
    T1 opens C (32 + 12 = 44 MiB), T2's 12 MiB would make 56: cudaMalloc fails; no cached
    segment is wholly free (A holds the weights and three states, B the fourth), so releasing
    them frees nothing and the retry fails: out of memory in step 2 with 46 MiB of tensors
    and 50 MiB reserved. With 56 MiB it fits, as without a limit."""
    from memplan.model.reserved import stage_reserved

    tight = stage_reserved(_stage(2), 46 * MiB, AllocatorConfig(), 50 * MiB)
    assert tight.oom_step == 2 and tight.reserved_peak_bytes == 50 * MiB
    assert tight.step_note.startswith("the allocator runs out of memory in step 2")
    room = stage_reserved(_stage(2), 46 * MiB, AllocatorConfig(), 56 * MiB)
    assert room.oom_step is None and room.reserved_peak_bytes == 56 * MiB


def test_fsdp2_root_unit_end_of_backward_as_its_tensors() -> None:
    """FSDP2 with root units (``fsdp_units`` root), tiny (hidden 64, vocabulary 128, untied;
    blocks of 4,096 x 3 + 64 x 32 x 2 + 3 x 64 x 176 + 2 x 64 = 46,208 elements) on 4 ranks,
    fsdp-bf16 (bf16 gathered, fp32 reduce). The root: 2 x 128 x 64 + 64 = 16,448 elements.
    At the embedding's backward: the gathered root, 16,448 x 2 = 32,896 B, on the all-gather
    stream; the root's gradients made before the embedding's (head and final norm, 128 x 64 +
    64 = 8,256 elements: the embedding's own is the dense one its backward makes) unsharded in
    bf16 beyond their fp32 shard, 16,512 - 8,256 x 4 / 4 = 8,256 B, with the last block's fp32
    reduce-scatter input, 46,208 x 4 = 184,832 B, as one held tensor of 193,088 B on the
    compute stream; then the root's reduce-scatter: the
    16,448 B beyond the shard and its fp32 input, 16,448 x 4 = 65,792 B, the gradients freed
    first (foreach_reduce's unsharded_grads.clear()) but the head weight's, the root's last
    (128 x 64 bf16 = 16,384 B; ``sharding.root_last_grad``), freed after the input: the
    others' 64 B, the head's 16,384 B, the input, then the frees."""
    import memplan
    from memplan.model import memo
    from memplan.model.dims import Dims
    from memplan.model.reserved import stage_inputs
    from memplan.model.stage import walk_stage
    from memplan.overheads import no_overheads

    est = memplan.estimate("tiny", gpus=4, zero=3, precision="fsdp-bf16", seq_len=128,
                           micro_batch_size=2, overheads=no_overheads())
    spec, par, wl = est.spec, est.parallel, est.workload
    parts = memo.stage_parts(spec, par, wl)
    shared = memo.shared_terms(spec, wl, Dims.of(spec, par, wl), par.experts, parts)
    walked = walk_stage(spec, par, wl, est.num_microbatches, 0, est.schedule, shared, parts[0])
    events = stage_sequence(stage_inputs(spec, par, wl, 1, walked, shared)).events
    sizes = {e.id: e.size_bytes for e in events if isinstance(e, Alloc)}
    flat: list[tuple[str, int, int | None]] = []  # tensor by tensor, a Blip's written out
    for e in events:
        if isinstance(e, Blip):
            flat += [("Alloc", n, e.stream) for n in e.tensors()]
            flat += [("Free", n, None) for n in e.tensors()]
        else:
            flat.append((type(e).__name__, sizes[e.id], getattr(e, "stream", None)))
    at = next(i for i, e in enumerate(flat) if e == ("Alloc", 32_896, 1)
              and flat[i + 1] == ("Alloc", 193_088, 0))
    tail = flat[at:at + 12]
    assert [t for t in tail if t[0] == "Alloc"][:2] == [("Alloc", 32_896, 1),
                                                       ("Alloc", 193_088, 0)]
    assert tail[-6:] == [("Alloc", 64, 0), ("Alloc", 16_384, 0), ("Alloc", 65_792, 0),
                         ("Free", 64, None), ("Free", 65_792, None), ("Free", 16_384, None)]


def test_fsdp2_sharded_gradients_one_tensor_per_unit_on_the_reduce_scatter_stream() -> None:
    """FSDP2 (torch 2.6 ``foreach_reduce``): a unit's sharded gradients are views of its
    ``reduce_output``, made on the reduce-scatter stream. tiny (2 blocks of 46,208 elements,
    head 128 x 64 = 8,192, final norm 64, embedding 8,192) on 4 ranks, fsdp-bf16 (fp32
    shards): each block one tensor of 46,208 x 4 / 4 = 46,208 B on stream 2 (not its seven
    parameter tensors on the compute stream); the head 8,192 B and the norm 64 B, the
    embedding 8,192 B; all freed by ``zero_grad`` at the step's end. With two micro-batches
    the second's output is added into the gradient and freed: a 46,208 B blip per block and
    16,448 B for the root unit."""
    import memplan
    from memplan.model import memo
    from memplan.model.dims import Dims
    from memplan.model.reserved import stage_inputs
    from memplan.model.stage import walk_stage
    from memplan.overheads import no_overheads

    def step_one(**kw) -> list:
        est = memplan.estimate("tiny", gpus=4, zero=3, precision="fsdp-bf16", seq_len=128,
                               micro_batch_size=2, overheads=no_overheads(), **kw)
        spec, par, wl = est.spec, est.parallel, est.workload
        m = est.num_microbatches
        parts = memo.stage_parts(spec, par, wl)
        shared = memo.shared_terms(spec, wl, Dims.of(spec, par, wl), par.experts, parts)
        walked = walk_stage(spec, par, wl, m, 0, est.schedule, shared, parts[0])
        b = stage_sequence(stage_inputs(spec, par, wl, m, walked, shared))
        return b.events[b.marks[0]:b.marks[1]]

    def on_stream_2(events: list) -> tuple[list[int], list[int]]:
        """(sizes made on stream 2, those of them still alive at the step's end); a tensor
        made and freed at one instant may be one ``Blip`` event of several sizes."""
        made, alive = [], {}
        for e in events:
            if isinstance(e, Alloc) and e.stream == 2:
                made.append(e.size_bytes)
                alive[e.id] = e.size_bytes
            elif isinstance(e, Free):
                alive.pop(e.id, None)
            elif getattr(e, "stream", None) == 2 and hasattr(e, "sizes_bytes"):
                made.extend(e.tensors())
        return sorted(made), sorted(alive.values())

    events = step_one()
    assert on_stream_2(events) == ([64, 8_192, 8_192, 46_208, 46_208], [])
    assert isinstance(events[-1], Free)  # zero_grad at the step's end frees them
    events = step_one(global_batch_size=16)  # 2 micro-batches of 2 on each of 4 ranks
    # the root's (head, norm, embedding: 16,448 B) too, at its reduce-scatter
    assert on_stream_2(events) == ([64, 8_192, 8_192, 16_448, 46_208, 46_208, 46_208, 46_208],
                                   [])


def _by_marks(events: list, marks: list[int], cfg: AllocatorConfig) -> tuple:
    """``replay`` (every event, the allocated bytes followed too) read at ``marks``: the
    reserved bytes after the event before each mark (0 before any), the reserved peak and
    the step whose allocation failed."""
    from memplan.model.allocator import replay

    r = replay(events, cfg)
    seen = r.reserved_bytes
    at = tuple(seen[m - 1] if 0 < m <= len(seen) else seen[-1] if m and seen else 0
               for m in marks)
    oom = (None if r.oom_event is None else
           next(k for k, m in enumerate(marks) if r.oom_event < m))
    return at, r.reserved_peak_bytes, oom


def test_stage_replay_equals_the_whole_replay() -> None:
    """``replay_stage`` (the reserved bytes only, blips that surely make no segment passed
    over, a limited replay's capacity set from the sequence's tensor peak) and ``replay``
    over ``stage_sequence``'s list (every event, allocated bytes too) give the same reserved
    bytes at every step's end, reserved peak and failing step: llama-7b stages (pp 1 and 2, ZeRO 1 and 3, recompute none and full,
    one and two micro-batches) without a limit, and each under capacities at 99%, 90% and
    80% of its unlimited reserved peak (the limited replay: where cudaMalloc meets the limit,
    the cache is released, or the allocator runs out of memory)."""
    import memplan
    from memplan.model import memo
    from memplan.model.dims import Dims
    from memplan.model.reserved import stage_inputs
    from memplan.model.stage import walk_stage
    from memplan.overheads import no_overheads

    seen_oom = seen_fit_limited = 0
    for kw in ({"pp": 1, "zero": 1, "recompute": "none", "micro_batch_size": 1},
               {"pp": 2, "zero": 3, "recompute": "full", "micro_batch_size": 2,
                "global_batch_size": 64}):
        est = memplan.estimate("llama-7b", gpus=8, seq_len=1024, overheads=no_overheads(),
                               **kw)
        spec, par, wl = est.spec, est.parallel, est.workload
        m = est.num_microbatches
        parts = memo.stage_parts(spec, par, wl)
        shared = memo.shared_terms(spec, wl, Dims.of(spec, par, wl), par.experts, parts)
        for i in range(par.pp):
            walked = walk_stage(spec, par, wl, m, i, est.schedule, shared, parts[i])
            s = stage_inputs(spec, par, wl, m, walked, shared)
            b = stage_sequence(s)
            want = _by_marks(b.events, b.marks, AllocatorConfig())
            got = replay_stage(s, AllocatorConfig())
            assert (got.reserved_by_step, got.reserved_peak_bytes, got.oom_step,
                    got.tensor_peak_bytes, got.num_events) == (*want, b.peak, len(b.events))
            for share in (99, 90, 80):
                cap = want[1] * share // 100
                lim = _by_marks(b.events, b.marks, AllocatorConfig(capacity_bytes=cap))
                got = replay_stage(s, AllocatorConfig(), limit=(b.peak, cap))
                assert (got.reserved_by_step, got.reserved_peak_bytes, got.oom_step) == lim
                seen_oom += lim[2] is not None
                seen_fit_limited += lim[2] is None
    assert seen_oom and seen_fit_limited  # both kinds of limited replay were compared


def test_moment_table_rows_by_hand() -> None:
    """Three moments of alive 10, 6 and 8 MiB, transient 1, 2 and 0 MiB, with 4, 0 and 2 Mi
    parameters' weight gradients made at them. Gradients new this backward (``fresh_grad``
    0): (10, 1, 6), (6, 2, 8), (8, 0, 0) MiB; accumulated in bf16 (2 bytes a parameter, the
    fresh gradient in flight on top): transients 1 + 8, 2 + 0 and 0 + 4 MiB."""
    from memplan.model.alloc_sequence import moment_table

    moments = (LayerMoment("a", 10 * MiB, 1 * MiB, ("layer",), fresh_params=4 * MiB),
               LayerMoment("b", 6 * MiB, 2 * MiB, ("layer",)),
               LayerMoment("c", 8 * MiB, 0, ("layer",), fresh_params=2 * MiB))
    assert moment_table(moments, 0) == ((10 * MiB, 1 * MiB, 6 * MiB),
                                        (6 * MiB, 2 * MiB, 8 * MiB), (8 * MiB, 0, 0))
    assert moment_table(moments, 2) == ((10 * MiB, 9 * MiB, 6 * MiB),
                                        (6 * MiB, 2 * MiB, 8 * MiB), (8 * MiB, 4 * MiB, 0))

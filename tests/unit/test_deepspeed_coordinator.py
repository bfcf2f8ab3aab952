"""DeepSpeed's ZeRO-3 parameter coordinator replayed (memplan.model.deepspeed_coordinator): bytes
derived by hand on tiny traces, 2 ranks, 2 B per element. A parameter of n elements gathered
alone keeps a buffer of ceil(n / 2) x 2 elements; a coalesced gather of several makes a flat
buffer of the sum of their partitions x 2 and, at its first wait, a whole copy of each. The
replay against DeepSpeed's own coordinator, fetch by fetch: tests/traced/test_deepspeed_trace.py."""

from __future__ import annotations

from memplan import api
from memplan.model.deepspeed_coordinator import (
    Coordinator,
    Use,
    layer_tensor_counts,
    llama_trace,
    persistent,
    positions,
    replay,
)

F, B = True, False


def test_persistent_parameters() -> None:
    """mark_persistent_parameters: each parameter of at most the threshold, in order, while the
    total stays within the model threshold: (10, 200, 5) with threshold 10 keeps 0 and 2; with
    a model threshold of 12 only 0 (10 + 5 > 12)."""
    assert persistent((10, 200, 5), Coordinator(persistence_threshold=10)) == {0, 2}
    assert persistent((10, 200, 5), Coordinator(persistence_threshold=10,
                                                model_persistence_threshold=12)) == {0}


def test_prefetch_one_coalesced_gather() -> None:
    """Parameters of 4, 6 and 2 elements used in turn after a module without parameters;
    prefetch bucket 100, nothing kept. The first module prefetches all three in one gather:
    flat buffer (2 + 3 + 1) x 2 x 2 B = 24 B. The first use waits: whole copies of all three,
    24 B, beside the flat buffer (the registry still holds it for the other two): 48 B; its
    release leaves 40. The second use pops the second entry (40), release -> 28; the third
    pops the last (the flat buffer freed): its copy alone, 4 B, then 0."""
    r = replay((4, 6, 2), (Use(-1, F), Use(0, F), Use(1, F), Use(2, F)),
               Coordinator(100, 1000, 0, 0), 2, 2)
    assert r.at == (24, 48, 40, 4) and r.after == (24, 40, 28, 0)


def test_prefetch_stops_at_max_live() -> None:
    """The same with stage3_max_live_parameters 7: the first prefetch takes 4 then 6 (10 >= 7
    stops it): flat (2 + 3) x 2 x 2 = 20 B; at the first use both copies (20 B) and the flat
    buffer: 40, no prefetch (10 live > 7), release -> 32; the second use frees the flat buffer
    (12 B) and, 6 live, prefetches 1 more element's worth: the third alone, padded 2 x 2 B =
    4 B: 16; release -> 4; the third: 4, then 0."""
    r = replay((4, 6, 2), (Use(-1, F), Use(0, F), Use(1, F), Use(2, F)),
               Coordinator(100, 7, 0, 0), 2, 2)
    assert r.at == (20, 40, 16, 4) and r.after == (20, 32, 4, 0)


def test_reuse_distance_keeps_what_is_used_again() -> None:
    """Forward 0 (4 elements, 8 B gathered), 1 (6 elements, 12 B), backward 1, 0. Reuse
    distance 100: each is kept while its next use is within 100 elements of the trace: 0
    stays (8), 1 stays (20), 1 released after its backward (no use after), 0 too. Distance 5:
    0 is released (the next module's 6 elements reach 5 first), 1 kept (used next); in the
    recording step (not complete) every module is released after its run."""
    trace = (Use(0, F), Use(1, F), Use(1, B), Use(0, B))
    far = replay((4, 6), trace, Coordinator(0, 1000, 100, 0), 2, 2)
    assert far.at == (8, 20, 20, 8) and far.after == (8, 20, 8, 0)
    near = replay((4, 6), trace, Coordinator(0, 1000, 5, 0), 2, 2)
    assert near.at == (8, 12, 12, 8) and near.after == (0, 12, 0, 0)
    first = replay((4, 6), trace, Coordinator(0, 1000, 5, 0), 2, 2, complete=False)
    assert first.after == (0, 0, 0, 0)


def test_recomputation_keeps_the_weights_it_saved() -> None:
    """Recording step, a checkpointed pair: forward 0, 1 (each released: 0); backward 1 is
    fetched (12 B) and the recomputation runs 0 (gathered, 8 B: 20) and 1 (already there),
    each released after its forward run but alive as the recomputation's saved alias (20
    throughout); 1's backward ends (its alias dropped: 8); 0's backward gathers a second copy
    beside its alias (16), both gone after it."""
    trace = (Use(0, F), Use(1, F), Use(1, B, release=False), Use(0, F, True), Use(1, F, True),
             Use(1, B, fetch=False), Use(0, B))
    r = replay((4, 6), trace, Coordinator(0, 0, 0, 0), 2, 2, complete=False)
    assert r.at == (8, 12, 12, 20, 20, 20, 16)
    assert r.after == (0, 0, 12, 20, 20, 8, 0)
    assert replay((4, 6), trace, Coordinator(0, 0, 0, 0), 2, 2, complete=False,
                  with_aliases=False).after == (0, 0, 12, 12, 0, 0, 0)


def test_llama_trace_shape() -> None:
    """One Llama layer (9 tensors) between the embedding and the final norm and head: forward
    root, model, embedding, rotary (4), the layer's 13 modules, norm and head (2); backward
    root (the loss), head, model, norm (4), the layer's 13, the embedding: 37 runs. With the
    layer recomputed its 13 forward runs and the down projection's release join its backward."""
    t = llama_trace(12, 1, (9,), 2)
    assert len(t.uses) == 37
    assert t.where.count("layer") == 13 and t.where.count(0) == 13
    r = llama_trace(12, 1, (9,), 2, (True,))
    assert len(r.uses) == 37 + 14 and sum(u.recompute for u in r.uses) == 13
    assert layer_tensor_counts((5, 1, 2, 3, 1, 2, 3, 7), 1, (6, 6)) == (3, 3)


def test_toy_positions_by_hand() -> None:
    """The traced toy (tests/traced/hf_configs.LLAMA3_TOY) on 2 ranks with DeepSpeed's defaults:
    the first module's prefetch gathers every non-persistent parameter (embedding 256,000,
    the MLPs 6 x 229,376, the head 256,000: 1,888,256 elements) in one flat buffer,
    3,776,512 B, and the first wait copies them out: with the persistent ones (norms and the
    q/k/v/o, 328,960 elements) every weight whole, 4,434,432 B, plus the buffer: 8,210,944 B
    beside each layer; the head's fetch frees the buffer: 4,434,432 at the loss. Persistent:
    657,920 B."""
    layer = (256, 65_536, 16_384, 16_384, 65_536, 256, 229_376, 229_376, 229_376)
    sizes = (256_000, *layer, *layer, 256, 256_000)
    at = positions(sizes, llama_trace(len(sizes), 1, (9, 9), 2), Coordinator(), 2, 2)
    assert (at.in_layer, at.at_loss, at.persistent) == (8_210_944, 4_434_432, 657_920)


def test_default_coordinator_estimated() -> None:
    """--zero 3 under the deepspeed preset is estimated with DeepSpeed's default coordinator;
    step 1 (the recording step) is the plain coordinator's, lower."""
    est = api.estimate("llama-2-7b", gpus=8, zero=3, framework="deepspeed")
    plain = api.estimate("llama-2-7b", gpus=8, zero=3, framework="deepspeed",
                         zero3_plain_gathers=True)
    assert est.worst.params_bytes == plain.worst.params_bytes == 2 * 842_301_952
    assert est.worst.first_step.forward == plain.worst.first_step.forward
    assert est.worst.steady.forward > plain.worst.steady.forward


def test_moment_gathers_by_hand() -> None:
    """A layer of 9 tensors whose hooks (down, up, gate, norm, o, v, k, q, norm) fall at the
    backward moments 0, 2, 2, 2, 5, 5, 5, 5, 5 of 7 (memplan.model.sharding.hook_moments),
    the coordinator holding at them 10, 20, 30, 40, 50, 60, 70, 80, 90 and between them
    (before the first, ..., after the last) 5, 0, 25, 0, 0, 0, 0, 0, 0, 95: moment 0 holds the
    down projection's 10; moment 1 (no hook) the most from the down's hook to the up's, 20;
    moment 2 the most at up, gate and norm and between them, 40; moments 3 and 4 from the
    norm's hook to the o's, 50; moment 5 the most at o to the last norm, 90; moment 6, after
    every hook, 95. Without the coordinator's bytes (or hooks not all placed) every moment
    holds the layer's most, ``beside``."""
    from memplan.model.deepspeed_coordinator import HookGathers
    from memplan.model.sharding import moment_gathers

    ks = (0, 2, 2, 2, 5, 5, 5, 5, 5)
    g = HookGathers((10, 20, 30, 40, 50, 60, 70, 80, 90), (5, 0, 25, 0, 0, 0, 0, 0, 0, 95))
    assert moment_gathers(ks, 7, g, 100) == (10, 20, 40, 50, 50, 90, 95)
    assert moment_gathers(ks, 7, None, 100) == (100,) * 7
    assert moment_gathers((0, None), 2, HookGathers((1, 2), (0, 0, 0)), 7) == (7, 7)


def test_layer_blocks_by_hand() -> None:
    """A Llama layer's 13 forward runs (the layer, its norm, the attention, q, k, v, o, the
    norm, the MLP, gate, the activation, up, down) fall in its blocks attn_norm (the first
    three), attn (q to o), mlp_norm (the norm and the MLP module) and mlp (gate to down); the
    coordinator holding 1, 2, ..., 13 at them and 101, ..., 113 after their releases, each
    block holds its most: 3, 7, 9, 13; the MLP's steps their module's: gate 10, act 11, up
    12, down 13, the product after up's release, 112. A run outside a Llama layer's blocks
    (-1) leaves nothing to read by block."""
    from memplan.model.deepspeed_coordinator import Replayed, Trace, _layer_blocks

    uses = tuple(Use(-1, F) for _ in range(13))
    blocks = (0, 0, 0, 1, 1, 1, 1, 2, 2, 3, 3, 3, 3)
    trace = Trace(uses, ("layer",) * 13, blocks)
    r = Replayed(tuple(range(1, 14)), tuple(range(101, 114)))
    assert _layer_blocks(trace, r) == (
        ("attn_norm", 3), ("attn", 7), ("mlp_norm", 9), ("mlp", 13), ("mlp.gate", 10),
        ("mlp.act", 11), ("mlp.up", 12), ("mlp.prod", 112), ("mlp.down", 13))
    assert _layer_blocks(trace._replace(block=(-1,) * 13), r) == ()
    toy = llama_trace(12, 1, (9,), 2)
    assert [b for b, w in zip(toy.block, toy.where) if w == "layer"] == list(blocks)


def test_layer_forward_by_block() -> None:
    """A layer whose blocks peak at 100, 200, 100 and 300 B, the coordinator holding 10, 50,
    10 and 20 B at them (the most, 50, beside the layer): the MLP's 300 + 20 = 320 B, not
    300 + 50; blocks that do not match the coordinator's, or a position holding other than
    the most, count the layer's peak beside it (350, 310)."""
    from memplan.model.sharding import DataParallel

    dp = DataParallel(in_block_forward=50, forward_blocks=(
        ("attn_norm", 10), ("attn", 50), ("mlp_norm", 10), ("mlp", 20)))
    layer = (("attn_norm", 100), ("attn", 200), ("mlp_norm", 100), ("mlp", 300))
    assert dp.layer_forward(layer, 300, 50) == 320
    assert dp.layer_forward(layer[:3], 300, 50) == 350
    assert dp.layer_forward(layer, 300, 10) == 310
    assert DataParallel(in_block_forward=50).layer_forward(layer, 300, 50) == 350
    # the MLP by step: the product (300) where 0 is gathered, the down projection (250)
    # beside its 20; a step the coordinator does not give (gate) beside the block's 20
    steps = dp._replace(forward_blocks=dp.forward_blocks + (("mlp.prod", 0), ("mlp.down", 20)))
    by_step = (*layer[:3], ("mlp.gate", 150), ("mlp.prod", 300), ("mlp.down", 250))
    assert steps.layer_forward(by_step, 300, 50) == max(250, 170, 300, 270)


def test_lora_trace_by_hand() -> None:
    """A peft-wrapped toy Llama (2 layers; hidden 256, MLP 896, k/v 64 wide; rank 8 on all
    seven projections): a layer's tensors are the two norms, the seven base weights and each
    projection's lora_A (8 x d_in) and lora_B (d_out x 8), 23 in all, each adapter after its
    base weight. Fetches of modules with parameters in one step (DeepSpeed's recorded trace on
    the toy: 93 and 144): forward the embedding, 23 per layer, the final norm and the head
    (49); backward the head and the final norm (2), the last layer's 23, the first layer's 19
    (without checkpointing its input needs no gradient: its input norm and the q, k, v bases
    run no backward), no embedding: 93. With full recompute each layer's 23 twice (its
    recomputation), the first layer's all, and the embedding's: 49 + 2 + 92 + 1 = 144. Every
    adapter is at most 1e5 elements: persistent."""
    from memplan.model.deepspeed_coordinator import (
        Coordinator,
        lora_layer_sizes,
        llama_lora_trace,
        persistent,
    )

    layer = (256, 65_536, 16_384, 16_384, 65_536, 256, 229_376, 229_376, 229_376)
    adapters = ((2_048, 2_048), (2_048, 512), (2_048, 512), (2_048, 2_048), (2_048, 7_168),
                (2_048, 7_168), (7_168, 2_048))
    sizes = lora_layer_sizes(layer, adapters)
    assert sizes == (256, 65_536, 2_048, 2_048, 16_384, 2_048, 512, 16_384, 2_048, 512,
                     65_536, 2_048, 2_048, 256, 229_376, 2_048, 7_168, 229_376, 2_048, 7_168,
                     229_376, 7_168, 2_048)
    model = (256_000, *sizes, *sizes, 256, 256_000)
    for recompute, fetches in ((False, 93), (True, 144)):
        trace = llama_lora_trace(len(model), 1, 2, (True,) * 7, 2, (recompute,) * 2)
        assert sum(1 for u in trace.uses if u.param >= 0 and u.fetch) == fetches
    kept = persistent(model, Coordinator())
    assert sum(model[i] for i in kept) == 2 * (256 * 2 + 2 * 16_384 + 2 * 65_536
                                               + 40_960) + 256

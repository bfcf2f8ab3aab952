"""The attention's backward in a compiled layer rebuilt inside the graph (torchtitan's block
under full AC and per-op SAC): ``memplan.model.compiled.attention_backward_moments``, by hand.

The toy: h 256, f 768, 8 query heads and 2 kv heads of 32, bf16, 2 x 64 tokens (T 128). By
hand: S = T h 2 = 65,536 B (the residual stream, the SDPA output, q); K = T 64 2 = 16,384 B
(k, v); q's fp32 upcast 131,072 B; a norm's statistics T 4 = 512 B; RoPE's complex64 table
64 x 16 x 8 = 8,192 B; the three MLP weight gradients 3 h f 2 = 1,179,648 B.
"""

from __future__ import annotations

from memplan.model import compiled, compiled_order
from memplan.model.dims import Dims, Term
from memplan.model.layer import grad_group_params, layer_kind
from memplan.parallel import ParallelConfig
from memplan.spec import spec_from_hf_dict
from memplan.workload import Recompute, Workload

TOY = {"model_type": "llama", "hidden_size": 256, "intermediate_size": 768,
       "num_attention_heads": 8, "num_key_value_heads": 2, "num_hidden_layers": 1,
       "vocab_size": 1000, "max_position_embeddings": 1024, "hidden_act": "silu",
       "rms_norm_eps": 1e-5, "tie_word_embeddings": False}
S, K, Q32, STATS, TABLE = 65_536, 16_384, 131_072, 512, 8_192


def _toy(recompute: Recompute, seq_len: int = 64, **extra):
    spec = spec_from_hf_dict(dict(TOY), "toy", "toy").model_copy(update={"fused_qkv": True})
    wl = Workload(micro_batch_size=2, seq_len=seq_len, precision="bf16-pure", recompute=recompute,
                  compile=True, rope_cache="layer", selective_impl="op", **extra)
    return spec, wl, Dims.of(spec, ParallelConfig(), wl)


def test_full_ac_attention_moments() -> None:
    """Full AC: alive beside the input (S) the output projection's output, both MLP input
    gradients, the attention output's gradient, the SDPA output's gradient, the attention
    norm's output and SDPA's output (7 S) and both norms' statistics: 8 S + 1,024 =
    525,312 B. In flight at q's RoPE backward: the incoming gradient, dq, dk, dv, dq's fp32
    upcast and its complex product, the table's copy: 2 S + 2 K + 2 x 131,072 + 8,192 =
    434,176 B; at the q/k/v gradient's kernel: the incoming gradient, dq, dk, dv, the
    product and the fused gradient T x 384 x 2: 2 S + 2 K + 131,072 + S + 2 K = 360,448 B."""
    spec, wl, dm = _toy(Recompute.FULL)
    assert compiled.rebuilt_attention_schedule(spec, wl, dm, Recompute.FULL)
    assert compiled.attention_backward_moments(spec, dm) == [
        ("attention_rope", 8 * S + 2 * STATS, 2 * S + 2 * K + 2 * Q32 + TABLE, ("mlp",)),
        ("attention_qkv", 8 * S + 2 * STATS, 3 * S + 4 * K + Q32, ("mlp",))]
    assert 8 * S + 2 * STATS == 525_312 and 2 * S + 2 * K + 2 * Q32 + TABLE == 434_176


def test_per_op_sac_attention_moments() -> None:
    """Per-op SAC keeping SDPA's output: no attention norm output or statistics (recomputed at
    the end), the kept SDPA output (S), the rerun's RoPE'd q (S) and k's fp32 upcast
    (T 64 4 = 32,768 B) instead: 6 S + 512 + 2 S + 32,768 = 557,568 B, each hold counted (the
    wrapper's check is ``compiled_order.with_sac_order``'s). At 2 x 64 the layer's peak is
    not there but at the end of lpmf's order (``test_lpmf_order_below_hidden``)."""
    spec, wl, dm = _toy(Recompute.SELECTIVE)
    kept = [Term("sac.attn.out", S)]
    moments = compiled.attention_backward_moments(spec, dm, kept)
    assert moments[0][1] == 8 * S + STATS + 32_768 == 557_568


def _peak(spec, wl, dm, recompute: Recompute) -> tuple[dict, int]:
    groups = grad_group_params(spec, 1, 1, False)
    moments = {m.name: m for m in layer_kind(spec, wl, dm, False, recompute).moments}
    size = {n: m.alive_bytes + m.transient_bytes + 2 * sum(groups[g] for g in m.grads_before)
            for n, m in moments.items()}
    return size, max(size.values())


def test_lpmf_defers_mlp_grads_by_size() -> None:
    """lpmf runs the MLP's weight gradients last where f (h - T) > T h (the down projection's
    weight gradient's net bytes against the up projection's grad-input matmul's; a tie to the
    weight gradient): T 128: 768 x 128 > 128 x 256; T 192: 768 x 64 = 192 x 256, not;
    T 2,048 not."""
    for seq, defers in ((64, True), (96, False), (1024, False)):
        spec, wl, dm = _toy(Recompute.FULL, seq_len=seq)
        assert compiled_order.lpmf_defers_mlp_grads(spec, dm) is defers


def test_lpmf_order_below_hidden() -> None:
    """2 x 64 tokens (F = T f 2 = 196,608 B, all weight gradients 2 x (256 + 256 x 384 +
    256 x 256 + 256 + 3 x 256 x 768) = 1,508,352 B), full AC and per-op SAC: Inductor takes
    lpmf's order (``compiled_order.with_lpmf_order``), whose end holds every weight gradient
    beside the input, the incoming gradient, the input gradient, the MLP norm's output and
    gate's output gradient: 4 S + F + 1,508,352 = 1,967,104 B, its estimate (the common
    offset left out) below the baseline's; in a step the input and the incoming gradient are
    freed by then (``compiled_order.in_step``): the moment 2 S + F + 1,508,352 = 1,836,032 B,
    the layer's peak. Full AC: the baseline's q's RoPE backward
    8 S + 1,024 + 434,176 + 1,179,648 = 2,139,136 less dq and the SDPA output's gradient:
    2,008,064, above the MLP's kernel (1,676,288, lpmf's plus the table 1,684,480). Per-op
    SAC: the rerun's RoPE (5 S + S + T 384 2 + S + 4,096 + 512 alive, S + 2 x 131,072 +
    8,192 in flight, 1,179,648: 2,077,184) less the kept q/k/v but v's slice (98,304 -
    16,384) plus a table: 2,003,456."""
    f, weights = 196_608, 1_508_352
    assert 2 * (256 + 256 * 384 + 256 * 256 + 256 + 3 * 256 * 768) == weights
    for recompute in (Recompute.FULL, Recompute.SELECTIVE):
        spec, wl, dm = _toy(recompute)
        size, peak = _peak(spec, wl, dm, recompute)
        assert peak == size["mlp_grads_last"] == 2 * S + f + weights == 1_836_032
        end = next(m for m in layer_kind(spec, wl, dm, False, recompute).moments
                   if m.name == "mlp_grads_last")
        assert (size["mlp_grads_last"] + compiled_order.held_by_lone_layer(end, S)
                == 4 * S + f + weights == 1_967_104)
        assert "mlp_in" not in size
    # per-op SAC's q's RoPE backward in lpmf's order (``compiled_order.sac_lpmf_rope``):
    # 6 S + 3 F + 512 + the held SDPA output gradient, RoPE'd q and statistics (2 S + 512);
    # S + (S + 2 K) + 2 x 131,072 + 8,192 in flight; the output projection's weight gradient
    rope = 6 * S + 3 * f + STATS + 2 * S + STATS + S + S + 2 * K + 2 * Q32 + TABLE + 131_072
    assert size["attention_rope"] == rope == 1_680_384
    baseline = 8 * S + 2 * STATS + 2 * S + 2 * K + 2 * Q32 + TABLE + 1_179_648
    assert baseline == 2_139_136 and baseline - 2 * S == 2_008_064 > 1_967_104
    rerun = 7 * S + 98_304 + 4_096 + STATS + S + 2 * Q32 + TABLE + 1_179_648
    assert rerun == 2_077_184 and rerun - (98_304 - K) + TABLE == 2_003_456 > 1_967_104


def test_sac_rerun_rope_and_holds() -> None:
    """Per-op SAC at 2 x 96 (S 98,304, K 24,576, q's upcast 196,608, table 12,288, the kept
    q/k/v 147,456, logsumexp 6,144, statistics 768): the baseline's order (lpmf does not
    defer). The rerun's RoPE of q: 5 S + S + 147,456 + S + 6,144 + 768 = 842,496 alive,
    S + 2 x 196,608 + 12,288 = 503,808 in flight, 1,179,648: 2,525,952 B, the layer's peak.
    Inductor's estimates (the common offset left out): it 2,525,952 - 122,880 + 12,288 =
    2,415,360; the MLP's kernel 2,415,360 - 122,880 - 24,576 = 2,267,904; q's RoPE backward
    with no hold (2,667,264 - 3 S - 49,152 = 2,323,200): k's fp32 upcast held
    (2,372,352 <= 2,415,360), neither S buffer (2,470,656 > it): q's RoPE backward
    2,667,264 - 2 S = 2,470,656 B."""
    spec, wl, dm = _toy(Recompute.SELECTIVE, seq_len=96)
    s, k, q32, table = 98_304, 24_576, 196_608, 12_288
    size, peak = _peak(spec, wl, dm, Recompute.SELECTIVE)
    alive = 5 * s + s + 147_456 + s + 6_144 + 768
    assert alive == 842_496 and s + 2 * q32 + table == 503_808
    assert peak == size["attention_rerun_rope"] == alive + 503_808 + 1_179_648 == 2_525_952
    assert size["mlp_act"] == 2_415_360
    assert size["attention_rope"] == 2_667_264 - 2 * s == 2_470_656
    estimate, window = 2_525_952 - 122_880 + table, 2_667_264 - 3 * s - 2 * k
    assert (estimate, window) == (2_415_360, 2_323_200)
    assert window + 2 * k <= estimate < window + 2 * k + s


def test_schedule_only_where_traced() -> None:
    """Separate q/k/v, transformers' real RoPE (cos/sin tables), no recompute, or TP: the
    schedule was not traced there; the eager order's moments stand."""
    spec, wl, dm = _toy(Recompute.FULL)
    separate = spec.model_copy(update={"fused_qkv": False})
    assert not compiled.rebuilt_attention_schedule(separate, wl, dm, Recompute.FULL)
    forward = wl.model_copy(update={"rope_cache": "forward"})
    assert not compiled.rebuilt_attention_schedule(spec, forward, dm, Recompute.FULL)
    assert not compiled.rebuilt_attention_schedule(spec, wl, dm, Recompute.NONE)
    tp = Dims.of(spec, ParallelConfig(tp=2), wl)
    assert not compiled.rebuilt_attention_schedule(spec, wl, tp, Recompute.FULL)


def test_full_ac_sdpa_grad_reuse_by_size() -> None:
    """Full AC's layer (``compiled.with_sdpa_grad_reuse``): the SDPA output's gradient held
    for the q/k/v input gradient where the RoPE moment less dq is no larger than every other
    moment. 2 x 96 (T 192, S 98,304, K 24,576, statistics 768, q's upcast 196,608, table
    96 x 16 x 8 = 12,288): RoPE 8 S + 1,536 + 2 S + 2 K + 2 x 196,608 + 12,288 + 1,179,648 =
    2,618,880, less dq 2,520,576; the MLP's kernel (``swiglu_moments``' ``mlp_act``, the
    rebuilt set and the kernel's T x f tensors) 2,514,432: freed, alive 7 S + 1,536 =
    689,664 at both attention moments. 2 x 1,024 (S 1,048,576): RoPE 8 S + 16,384 + 2 S +
    2 x 262,144 + 2 x 2,097,152 + 131,072 + 1,179,648 = 16,531,456 less dq, against the MLP's
    kernel 26,820,608: held, 8 S + 16,384 = 8,404,992."""
    spec = spec_from_hf_dict(dict(TOY), "toy", "toy").model_copy(update={"fused_qkv": True})
    groups = grad_group_params(spec, 1, 1, False)
    for seq, s, rope, mlp, alive in ((96, 98_304, 2_618_880, 2_514_432, 689_664),
                                     (1024, 1_048_576, 16_531_456, 26_820_608, 8_404_992)):
        wl = Workload(micro_batch_size=2, seq_len=seq, precision="bf16-pure",
                      recompute=Recompute.FULL, compile=True, rope_cache="layer")
        dm = Dims.of(spec, ParallelConfig(), wl)
        moments = {m.name: m for m in layer_kind(spec, wl, dm, False, Recompute.FULL).moments}
        size = {n: m.alive_bytes + m.transient_bytes
                + 2 * sum(groups[g] for g in m.grads_before) for n, m in moments.items()}
        held = rope - s <= mlp
        assert size["mlp_act"] == mlp and held == (seq == 1024)
        assert size["attention_rope"] == rope - (0 if held else s)
        assert moments["attention_rope"].alive_bytes == alive
        assert moments["attention_qkv"].alive_bytes == alive


def test_sac_lpmf_rope_near_the_threshold() -> None:
    """Per-op SAC at 2 x 88 (T 176: 176 x 1,024 < 768 x 256, lpmf defers; S 90,112,
    F 270,336, K 22,528, q's upcast 180,224, table 11,264, statistics 704): lpmf's peak is
    q's RoPE backward (``compiled_order.sac_lpmf_rope``). Its estimate, the held buffers and
    the q/k/v gradient's q part left out: 6 S + 3 F + 704 + (S + S + 2 K + 2 x 180,224 +
    11,264) + 131,072 - S = 1,990,336; lpmf's peak estimate its kernel's, the baseline's
    plus the table (2,225,344, above its end 4 S + F + 1,508,352 = 2,139,136); the holds
    2 S + 704 fit under it: all three held, the moment 1,990,336 + S + 2 S + 704 =
    2,261,376 B, the layer's peak (traced: 2,171,264 with the held output for the input and
    the incoming gradient)."""
    spec, wl, dm = _toy(Recompute.SELECTIVE, seq_len=88)
    s, f, k, q32, table, stats = 90_112, 270_336, 22_528, 180_224, 11_264, 704
    assert compiled_order.lpmf_defers_mlp_grads(spec, dm)
    estimate = 6 * s + 3 * f + stats + (s + s + 2 * k + 2 * q32 + table) + 131_072 - s
    assert estimate == 1_990_336
    size, peak = _peak(spec, wl, dm, Recompute.SELECTIVE)
    # lpmf's end as Inductor estimates it, 4 S + F + 1,508,352 = 2,139,136, and in a step
    # without the input and the incoming gradient (``compiled_order.in_step``)
    end = 2 * s + f + 1_508_352
    assert size["mlp_grads_last"] == end == 2_139_136 - 2 * s == 1_958_912
    assert size["mlp_act"] == 2_225_344 >= estimate + 2 * s + stats
    assert peak == size["attention_rope"] == estimate + s + 2 * s + stats == 2_261_376

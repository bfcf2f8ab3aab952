"""The readers of memplan.hf.families_more on the held-out published configs
(tests/data/hf/heldout): each count is the one transformers builds on the meta device
(tests/traced/test_hf_heldout.py checks them against transformers itself, tensor by tensor)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from memplan.spec import load_model, spec_from_hf_dict

HELDOUT = Path(__file__).resolve().parents[1] / "data" / "hf" / "heldout"


def _spec(name: str):
    data = json.loads((HELDOUT / name / "config.json").read_text())
    return spec_from_hf_dict(data, "config.json", name)


def test_ernie_0_3b_by_hand() -> None:
    """ERNIE-4.5-0.3B: 18 layers of h 1,024, 16 heads and 2 KV heads of 128, ffn 3,072, no
    biases, tied. Attention q 1,024 x 2,048 and o 2,048 x 1,024 (2,097,152 each), k and v
    1,024 x 256 (262,144 each): 4,718,592; MLP 3 x 1,024 x 3,072 = 9,437,184; two norms
    2,048: 14,157,824 per layer, 254,840,832 in all; the embedding 103,424 x 1,024 =
    105,906,176 and the final norm 1,024: 360,748,032."""
    spec = _spec("ERNIE-4.5-0.3B-PT")
    assert spec.num_params == 360_748_032 and spec.approximate is None


def test_ernie_moe_21b_by_hand() -> None:
    """ERNIE-4.5-21B-A3B: 28 layers of h 2,560, 20 heads and 4 KV heads of 128, tied, no
    biases. Attention q and o 2,560 x 2,560 (6,553,600 each), k and v 2,560 x 512 (1,310,720
    each): 15,728,640; two norms 5,120. Layer 0 dense (moe_layer_start_index 1): 3 x 2,560 x
    12,288 = 94,371,840. Layers 1-27 MoE: 64 experts x 3 x 2,560 x 1,536 = 754,974,720, the
    router 64 x 2,560 = 163,840 and its e_score_correction_bias 64, two shared experts as one
    MLP of 3,072: 3 x 2,560 x 3,072 = 23,592,960: 778,731,584. The embedding 103,424 x 2,560
    = 264,765,440, the final norm 2,560: 264,765,440 + 28 x 15,733,760 + 94,371,840 + 27 x
    778,731,584 + 2,560 = 21,825,437,888 (transformers' meta build too)."""
    spec = _spec("ERNIE-4.5-21B-A3B-PT")
    assert spec.num_params == 21_825_437_888 and spec.approximate is None
    assert (spec.moe.num_experts, spec.moe.top_k, spec.moe.first_dense_layers) == (64, 6, 1)


def test_ernie_moe_other_layouts_refused() -> None:
    data = json.loads((HELDOUT / "ERNIE-4.5-21B-A3B-PT" / "config.json").read_text())
    from memplan.errors import MemplanError

    with pytest.raises(MemplanError, match="moe_layer_interval"):
        spec_from_hf_dict({**data, "moe_layer_interval": 2}, "config.json", "m")
    with pytest.raises(MemplanError, match="moe_layer_end_index"):
        spec_from_hf_dict({**data, "moe_layer_end_index": 10}, "config.json", "m")


@pytest.mark.parametrize(("name", "count"), [
    ("EXAONE-4.0-32B", 32_003_216_384), ("EXAONE-4.0-1.2B", 1_279_391_488),
    ("Seed-OSS-36B-Instruct", 36_151_104_512), ("Hunyuan-7B-Instruct", 7_504_568_320),
    ("Hunyuan-A13B-Instruct", 80_393_183_232), ("dots.llm1.inst", 142_774_373_888),
])
def test_published_counts(name: str, count: int) -> None:
    """transformers 5.3 and 5.25 build these counts from the same files."""
    spec = _spec(name)
    assert spec.num_params == count and spec.approximate is None


def test_exaone4_layers() -> None:
    """EXAONE-4.0-32B: LLLG, a 4,096 window; the full layers attend without RoPE; norms after
    the mixers and per-head q/k norms."""
    spec = _spec("EXAONE-4.0-32B")
    assert spec.sliding_window == 4096 and spec.sliding_window_pattern == 4
    assert spec.nope_layer_interval == 4 and spec.qk_norm.value == "head"
    assert spec.norm_placement.value == "post"
    small = _spec("EXAONE-4.0-1.2B")
    assert small.sliding_window is None and small.nope_layer_interval == 0


def test_seed_oss_biases_and_dropout() -> None:
    spec = _spec("Seed-OSS-36B-Instruct")
    assert spec.qkv_bias and not spec.attn_out_bias and spec.dropout == 0.1


def test_dots1_moe() -> None:
    spec = _spec("dots.llm1.inst")
    moe = spec.moe
    assert (moe.num_experts, moe.top_k, moe.first_dense_layers, moe.num_shared_experts) == (
        128, 6, 1, 2)
    assert spec.qk_norm.value == "head"


def test_apertus_8b_by_hand() -> None:
    """Apertus-8B-2509: 32 layers of h 4,096, 32 heads and 8 KV heads of 128, a plain MLP of
    21,504 with xIELU, untied, no biases. Attention q and o 4,096 x 4,096 (16,777,216 each),
    k and v 4,096 x 1,024 (4,194,304 each): 41,943,040; the per-head q and k norms 2 x 128 =
    256; up and down 2 x 4,096 x 21,504 = 176,160,768; xIELU's alpha_p and alpha_n 2; two norms
    8,192: 218,112,258 per layer, 6,979,592,256 in all; the embedding and the head 2 x
    131,072 x 4,096 = 1,073,741,824, the final norm 4,096: 8,053,338,176 (transformers' meta
    build too, tests/traced/test_hf_heldout.py)."""
    spec = _spec("Apertus-8B-2509")
    assert spec.num_params == 8_053_338_176 and spec.approximate is None
    assert (spec.mlp.value, spec.activation_impl.value, spec.qk_norm.value) == (
        "gelu", "xielu", "head")


def test_apertus_other_activation_refused() -> None:
    """Apertus's MLP is plain: a gated activation name (silu) has no block memplan models."""
    from memplan.errors import MemplanError

    data = json.loads((HELDOUT / "Apertus-8B-2509" / "config.json").read_text())
    with pytest.raises(MemplanError, match="hidden_act"):
        spec_from_hf_dict({**data, "hidden_act": "silu"}, "config.json", "m")
    assert _spec_of({**data, "hidden_act": "gelu"}).activation_impl.value == "kernel"


def _spec_of(data: dict):
    return spec_from_hf_dict(data, "config.json", "m")


def test_apertus_compiled_or_op_level_recompute_refused() -> None:
    """What Inductor or per-op SAC keeps of the xIELU formula is not modelled: refused."""
    from memplan.api import estimate
    from memplan.errors import MemplanError

    spec = _spec("Apertus-8B-2509")
    with pytest.raises(MemplanError, match="xIELU"):
        estimate(spec, gpus=8, zero=3, compile=True)
    with pytest.raises(MemplanError, match="recompute ops"):
        estimate(spec, gpus=8, zero=3, recompute="ops")


def test_granite_4_micro_by_hand() -> None:
    """granite-4.0-micro (granitemoehybrid, every layer attention, no experts): 40 layers of h
    2,560, 40 heads of 64 and 8 KV heads, tied, no biases. Attention q and o 2,560 x 2,560
    (6,553,600 each), k and v 2,560 x 512 (1,310,720 each): 15,728,640; the shared MLP's
    input_linear 2,560 x 16,384 = 41,943,040 and output_linear 8,192 x 2,560 = 20,971,520;
    two norms 5,120: 78,648,320 per layer, 3,145,932,800 in all; the embedding 100,352 x
    2,560 = 256,901,120 and the final norm 2,560: 3,402,836,480 (transformers' meta build
    too)."""
    spec = _spec("granite-4.0-micro")
    assert spec.num_params == 3_402_836_480 and spec.approximate is None
    assert (spec.fused_gate_up, spec.ffn_hidden_size, spec.position.value) == (True, 8192,
                                                                                "rope")


def test_granite_hybrid_layer_kinds() -> None:
    """Attention and Mamba layers, with or without experts, are read; transformers 5.25's
    to_dict() spellings of attention and Mamba layers (full_attention, linear_attention) are
    read as the file's."""
    from memplan.hf.config import ConfigKeys
    from memplan.hf.families_more import granite_hybrid_layers

    data = json.loads((HELDOUT / "granite-4.0-micro" / "config.json").read_text())
    assert granite_hybrid_layers(ConfigKeys({**data, "layer_types": ["full_attention"] * 40},
                                            "c"))
    assert granite_hybrid_layers(ConfigKeys({**data, "num_local_experts": 8}, "c"))
    mamba = {**data, "layer_types": ["mamba"] + ["attention"] * 39}
    assert granite_hybrid_layers(ConfigKeys(mamba, "c"))
    assert _spec_of(mamba).is_linear_layer(0) and not _spec_of(mamba).is_linear_layer(1)
    spelled = {**data, "layer_types": ["linear_attention"] + ["full_attention"] * 39}
    assert _spec_of(spelled) == _spec_of(mamba)


def test_granite_4_h_tiny_by_hand() -> None:
    """granite-4.0-h-tiny as published: without its experts 895,307,328 parameters
    (tests/unit/test_mamba.py by hand); each of the 40 layers adds GraniteMoeHybridMoE's 64
    experts of 512 (modeling_granitemoehybrid.py: input_linear (64, 1,024, 1,536) =
    100,663,296, output_linear (64, 1,536, 512) = 50,331,648) and its bias-free router
    (64 x 1,536 = 98,304): 151,093,248 a layer, 6,043,729,920 in all: 6,939,037,248."""
    spec = _spec("granite-4.0-h-tiny")
    assert spec.approximate is None and spec.num_params == 6_939_037_248
    catalog = load_model("granite-4.0-h-tiny")
    assert catalog.model_copy(update={"name": spec.name, "source": spec.source}) == spec
    moe = spec.moe
    assert moe is not None and moe.parallel_experts and moe.stacked_experts
    assert moe.router_logits_fp32 and moe.router_topk_softmax and moe.router_weights_cast
    assert moe.shared_experts_last
    assert (moe.num_experts, moe.top_k, moe.expert_ffn_hidden_size) == (64, 6, 512)
    assert (moe.num_shared_experts, moe.shared_expert_ffn_hidden_size) == (1, 1024)


def test_granite_3_1_moe_1b_by_hand() -> None:
    """granite-3.1-1b-a400m-instruct (granitemoe): 24 layers of h 1,024, 16 heads and 8 KV
    heads of 64, no biases, tied. Attention q and o 1,024 x 1,024 (1,048,576 each), k and v
    1,024 x 512 (524,288 each): 3,145,728; GraniteMoeMoE: the router 32 x 1,024 = 32,768,
    input_linear (32, 1,024, 1,024) = 33,554,432, output_linear (32, 1,024, 512) =
    16,777,216; two norms 2,048: 53,512,192 a layer, 1,284,292,608 in all; the embedding
    49,155 x 1,024 = 50,334,720 and the final norm 1,024: 1,334,628,352."""
    spec = _spec("granite-3.1-1b-a400m-instruct")
    assert spec.approximate is None and spec.num_params == 1_334_628_352
    catalog = load_model("granite-3.1-1b-a400m")
    assert catalog.model_copy(update={"name": spec.name, "source": spec.source}) == spec
    moe = spec.moe
    assert moe is not None and moe.parallel_experts and not moe.num_shared_experts
    assert (moe.num_experts, moe.top_k, moe.expert_ffn_hidden_size) == (32, 8, 512)


def test_granite_3_1_moe_3b_by_hand() -> None:
    """granite-3.1-3b-a800m-instruct (granitemoe): 32 layers of h 1,536, 24 heads and 8 KV
    heads of 64, no biases, tied. Attention q and o 1,536 x 1,536 (2,359,296 each), k and v
    1,536 x 512 (786,432 each): 6,291,456; the router 40 x 1,536 = 61,440, input_linear
    (40, 1,024, 1,536) = 62,914,560, output_linear (40, 1,536, 512) = 31,457,280; two norms
    3,072: 100,727,808 a layer, 3,223,289,856 in all; the embedding 49,155 x 1,536 =
    75,502,080 and the final norm 1,536: 3,298,793,472."""
    spec = _spec("granite-3.1-3b-a800m-instruct")
    assert spec.approximate is None and spec.num_params == 3_298_793_472
    catalog = load_model("granite-3.1-3b-a800m")
    assert catalog.model_copy(update={"name": spec.name, "source": spec.source}) == spec


def test_granite_4_h_small_by_hand() -> None:
    """granite-4.0-h-small: h 4,096, 40 layers, tied. The embedding 100,352 x 4,096 =
    411,041,792 and the final norm 4,096. 4 attention layers (32 heads and 8 KV heads of
    128): q and o 16,777,216 each, k and v 4,194,304 each: 41,943,040. 36 Mamba2 layers (128
    heads of 64, d 8,192, 1 group of state 128): in_proj 4,096 x (2 x 8,192 + 2 x 128 + 128)
    = 68,681,728, the conv1d over 8,448 channels (4 taps and a bias) 42,240, dt_bias, A_log
    and D 384, the gated norm 8,192, out_proj 8,192 x 4,096 = 33,554,432: 102,286,976. Every
    layer: the router 72 x 4,096 = 294,912, input_linear (72, 1,536, 4,096) = 452,984,832,
    output_linear (72, 4,096, 768) = 226,492,416, the shared MLP 4,096 x 3,072 + 1,536 x
    4,096 = 18,874,368 and two norms 8,192: 698,654,720. 411,045,888 + 4 x 41,943,040 + 36 x
    102,286,976 + 40 x 698,654,720 = 32,207,337,984 (the "32.2B" stated for it)."""
    spec = _spec("granite-4.0-h-small")
    assert spec.approximate is None and spec.num_params == 32_207_337_984
    catalog = load_model("granite-4.0-h-small")
    assert catalog.model_copy(update={"name": spec.name, "source": spec.source}) == spec


def test_granite_moe_shared_by_hand() -> None:
    """granitemoeshared: the same config with a shared MLP of 1,024 (GraniteMoeSharedMLP:
    input_linear 1,024 -> 2,048, output_linear 1,024 -> 1,024: 3,145,728 a layer) adds
    75,497,472: 1,410,125,824; shared_intermediate_size 0 (the class's default) builds none."""
    data = json.loads((HELDOUT / "granite-3.1-1b-a400m-instruct" / "config.json").read_text())
    shared = {**data, "model_type": "granitemoeshared", "shared_intermediate_size": 1024}
    assert _spec_of(shared).num_params == 1_410_125_824
    assert _spec_of({**shared, "shared_intermediate_size": 0}).num_params == 1_334_628_352


def test_granite_moe_runs_grouped_experts_by_default() -> None:
    """transformers 5.23 runs Granite's MoE through its experts interface (GraniteMoeExperts,
    grouped_mm_experts_forward: the hf preset's moe_impl grouped) behind GraniteMoeTopKRouter;
    the saved bytes per MoE layer: 2 sequences of 64 tokens (T 128), top 8 of 32 (R 1,024
    rows), h 1,024, f 512, bf16. The router: topk's indices (R x 8 B) and the fp32 softmax
    of the top-k logits (R x 4 B), no probability of every expert (the fp32 logits and the
    top-k values are saved by nothing): 12 KiB; the token, sort and unsort indices (R x 8 B
    each): 24 KiB; the gathered rows and the experts' output (R h, 2 B): 4 MiB; gate/up
    (R 2f), activation and product (R f): 4 MiB; the routing weights cast to bf16 (R x 2 B):
    2 KiB: 8,427,520 B. Mixtral's router would save every expert's fp32 probability (T E x
    4 B), the weights' per-token sum (T x 4 B) and fp32 routing weights: 18,944 B more."""
    from memplan import presets
    from memplan.model.dims import Dims
    from memplan.model.moe import moe_terms
    from memplan.parallel import ParallelConfig
    from memplan.workload import MoeImpl, Workload

    spec = _spec("granite-3.1-1b-a400m-instruct")
    kwargs = presets.apply(presets.parse("hf"), spec, {})
    assert kwargs["moe_impl"] == "grouped"
    wl = Workload(seq_len=64, micro_batch_size=2, precision="bf16-pure", moe_impl="grouped")
    dm = Dims.of(spec, ParallelConfig(), wl)
    assert sum(t.size_bytes for t in moe_terms(spec, dm, MoeImpl.GROUPED)) == 8_427_520
    assert spec.moe is not None
    plain = spec.model_copy(update={"moe": spec.moe.model_copy(update={
        "router_topk_softmax": False, "router_logits_fp32": False,
        "router_weights_cast": False})})
    assert sum(t.size_bytes for t in moe_terms(plain, dm, MoeImpl.GROUPED)) == 8_446_464


def test_granite_moe_own_experts_on_request() -> None:
    """transformers 5.3's GraniteMoeParallelExperts, asked for (moe_impl parallel, which
    estimate accepts); its saved bytes per MoE layer are GraniteMoeMoE's (memplan.model.
    moe_parallel.parallel_terms), the same T, R, h, f, bf16: the top-k indices, the sort and
    token indices (8 B each a row) and the fp32 top-k softmax (4 B): 28 KiB; the gathered
    rows, the experts' output and the weighted rows (R h, 2 B): 6 MiB; gate/up (R 2f),
    activation and product (R f): 4 MiB; the gates (R x 2 B): 2 KiB: 10,516,480 B."""
    from memplan import api
    from memplan.model.dims import Dims
    from memplan.model.moe_parallel import parallel_terms
    from memplan.parallel import ParallelConfig
    from memplan.workload import Workload

    spec = _spec("granite-3.1-1b-a400m-instruct")
    wl = Workload(seq_len=64, micro_batch_size=2, precision="bf16-pure", moe_impl="parallel")
    dm = Dims.of(spec, ParallelConfig(), wl)
    assert sum(t.size_bytes for t in parallel_terms(spec, dm)) == 10_516_480
    own = api.estimate(spec, framework="hf", seq_len=64, micro_batch_size=2,
                       precision="bf16-pure", moe_impl="parallel")
    grouped = api.estimate(spec, framework="hf", seq_len=64, micro_batch_size=2,
                           precision="bf16-pure")
    assert own.workload.moe_impl.value == "parallel"
    assert grouped.workload.moe_impl.value == "grouped"
    assert own.stages[0].activations_bytes > grouped.stages[0].activations_bytes


def test_granite_select_backward_sums_by_hand() -> None:
    """granite-4.0-h-small in bf16 on one rank: each expert's weight slice (self.weight[i])
    gets a zero tensor of the whole weight in backward, summed out of place into the
    weight's buffer: two weight-sized tensors beside the gradient. input_linear (72, 1,536,
    4,096) x 2 B = 905,969,664 B, twice: 1,811,939,328; output_linear (72, 4,096, 768) x 2 B
    = 452,984,832, twice: 905,969,664. Eight experts a rank (ep 9) a ninth of it; one
    expert a rank (ep 72): its slice's gradient is the weight's, nothing beside it."""
    from memplan.model.dims import Dims
    from memplan.model.moe_parallel import select_grads
    from memplan.parallel import ParallelConfig
    from memplan.workload import Workload

    spec = load_model("granite-4.0-h-small")
    wl = Workload(seq_len=4096, precision="bf16-pure", moe_impl="parallel")
    dm = Dims.of(spec, ParallelConfig(), wl)
    assert select_grads(spec, dm) == (1_811_939_328, 905_969_664)
    assert select_grads(spec, dm._replace(ep=9)) == (1_811_939_328 // 9, 905_969_664 // 9)
    assert select_grads(spec, dm._replace(ep=72)) == (0, 0)


def test_granite_residual_multiplier_holds_a_gradient_copy_through_the_rerun() -> None:
    """Every Granite config here sets residual_multiplier 0.22 (``scaled_residual``; the
    catalog's entries too). Under full recompute the rerun of a layer runs beside the scaled
    copy of the stream's gradient (``residual + out * m``: the product's backward ran first):
    T h e = 2 * 1,024 * 4,096 * 2 = 16,777,216 B more at every rerun moment of granite-3.3-8b
    in bf16, nothing more once the layer's own backward runs."""
    from memplan.api import make_layout, make_workload
    from memplan.model.dims import Dims
    from memplan.model.layer import backward_moments
    from memplan.workload import Recompute

    for name in ("granite-3.3-8b", "granite-3.1-1b-a400m", "granite-4.0-h-tiny"):
        assert load_model(name).scaled_residual
    tiny = json.loads((HELDOUT / "granite-4.0-h-tiny" / "config.json").read_text())
    assert spec_from_hf_dict(tiny, "config.json", "g").scaled_residual
    spec = load_model("granite-3.3-8b")
    plain = spec.model_copy(update={"scaled_residual": False})
    wl = make_workload(spec, framework="hf", seq_len=1024, micro_batch_size=2,
                       precision="bf16-pure", recompute="full")
    dm = Dims.of(spec, make_layout(1), wl)
    with_copy, without = (backward_moments(s, wl, dm, moe_layer=False,
                                           recompute=Recompute.FULL) for s in (spec, plain))
    diffs = [a.transient_bytes - b.transient_bytes for a, b in zip(with_copy, without)]
    assert diffs[0] == 16_777_216 and diffs[-1] == 0
    assert set(diffs) == {0, 16_777_216}

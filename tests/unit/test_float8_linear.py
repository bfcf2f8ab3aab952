"""torchao's float8 linears (``--float8``, ``memplan.model.linear``), with bytes derived by hand
from torchao's code (torchao 0.18.0, ``torchao/float8/``):

- ``float8_linear.py``, ``matmul_with_hp_or_float8_args.forward``: ``ctx.save_for_backward(
  input_hp, weight_hp_t)``: the high-precision input and ``self.weight.t()`` (a view of the
  parameter) are saved, not their float8 casts; the casts ``input_maybe_fp8`` and
  ``weight_maybe_fp8_t`` are locals alive at ``torch.mm``.
- ``...backward``: casts ``grad_output`` (axiswise_dim -1) and ``weight_hp_t`` (axiswise_dim -1)
  for the input gradient, then ``grad_output`` (axiswise_dim 0) and the input (axiswise_dim 0)
  for the weight gradient; the first two stay alive as locals at the second matmul.
- ``config.py``, ``CastConfig.__post_init__`` and ``Float8LinearConfig.from_recipe_name``:
  every cast is one byte (e4m3; tensorwise's grad_output e5m2); tensorwise is ``ScalingGranularity.TENSORWISE`` (one scale),
  rowwise ``AXISWISE`` for input, weight and grad_output.
- ``float8_utils.py``, ``tensor_to_amax`` (``amax(abs(x), dim=axiswise_dim, keepdim=True)``:
  one scale per slice along the other dim) and ``amax_to_scale`` (``res.to(torch.float32)``:
  4 bytes a scale).
"""

from __future__ import annotations

import pytest

from memplan import api
from memplan.errors import LayoutError
from memplan.model import linear
from memplan.model.dims import Dims
from memplan.model.linear import Linear
from memplan.model.mlp import Mlp
from memplan.parallel import ParallelConfig, validate
from memplan.spec import ModelSpec, load_model
from memplan.workload import Float8Recipe, Recompute, Workload

# 16 tokens of a bf16 micro-batch at TP 1; one projection 64 -> 96
DM = Dims(b=2, s=8, s_kv=8, tokens=16, res_tokens_div=1, tp=1, e=2, vocab_shard=64, stream_e=2)
TW = DM._replace(float8=Float8Recipe.TENSORWISE)
RW = DM._replace(float8=Float8Recipe.ROWWISE)
AMP = DM._replace(stream_e=4, autocast=True)
UP = Linear("up", "mlp", 64, 96)


def test_float8_saves_no_weight_cast() -> None:
    """Under bf16 autocast a plain linear saves autocast's bf16 cast of its fp32 weight:
    64 * 96 = 6,144 elements * 2 = 12,288 bytes. As a Float8Linear it saves
    ``self.weight.t()``, a view of the parameter: no bytes of its own; the input it saves is
    the same high-precision tensor a plain linear saves (counted by the block)."""
    assert linear.saved_bytes([UP], AMP) == 12_288
    for recipe in (Float8Recipe.TENSORWISE, Float8Recipe.ROWWISE):
        assert linear.saved_bytes([UP], AMP._replace(float8=recipe)) == 0
        assert linear.saved_bytes([UP], DM._replace(float8=recipe)) == 0


def test_forward_casts_per_recipe() -> None:
    """At the forward matmul: the input cast 16 x 64 = 1,024 bytes and the weight cast
    (weight_hp_t, 64 x 96) 6,144 bytes. Tensorwise: one fp32 scale each, + 8: 7,176.
    Rowwise: the input's scales per token row (axiswise_dim -1), 16 * 4 = 64; the weight's
    per output column (axiswise_dim 0 of the d_in x d_out transpose), 96 * 4 = 384: 7,616.
    Without float8: 0."""
    assert linear.float8_forward_bytes(UP, DM) == 0
    assert linear.float8_forward_bytes(UP, TW) == 7_176
    assert linear.float8_forward_bytes(UP, RW) == 7_616


def test_backward_casts_per_recipe() -> None:
    """At the weight-gradient matmul, four casts alive. grad_output dim0 16 x 96 = 1,536,
    weight 6,144, grad_output dim1 1,536, input dim1 16 x 64 = 1,024: 10,240 bytes.
    Tensorwise: + 4 scales * 4 = 10,256. Rowwise: grad_output dim0 per token, 16 * 4 = 64;
    the weight per input row (axiswise_dim -1 of weight_hp_t), 64 * 4 = 256; grad_output dim1
    per output column, 96 * 4 = 384; the input per input column, 64 * 4 = 256: 10,240 + 960 =
    11,200."""
    assert linear.float8_backward_bytes(UP, DM) == 0
    assert linear.float8_backward_bytes(UP, TW) == 10_256
    assert linear.float8_backward_bytes(UP, RW) == 11_200


def test_float8_keeps_saved_activations_of_a_bf16_run() -> None:
    """torchtitan's bf16 FSDP run (no autocast): a Float8Linear saves the same bf16 input a
    plain linear saves and no weight cast, so the saved activations are those of the plain
    run, byte for byte."""
    kw = dict(gpus=8, zero=3, micro_batch_size=1, seq_len=1024, precision="fsdp-bf16")
    plain = api.estimate("tiny", **kw)
    for recipe in ("tensorwise", "rowwise"):
        f8 = api.estimate("tiny", float8=recipe, **kw)
        assert f8.stages[0].activations_bytes == plain.stages[0].activations_bytes


@pytest.mark.parametrize(("model", "update", "par", "why"), [
    ("mixtral-8x7b", {}, {}, r"MoE layers and moe_impl loop \(it needs grouped experts\)"),
    ("mixtral-8x7b", {"moe_impl": "every"}, {},
     r"MoE layers and moe_impl every \(it needs grouped experts\)"),
    ("mixtral-8x7b", {"moe_impl": "grouped"}, {"tp": 2}, "MoE layers and tp 2"),
    ("mixtral-8x7b", {"moe_impl": "grouped", "compile": True}, {}, "MoE layers and compile"),
    ("tiny", {}, {"tp": 2, "tp_style": "megatron"}, "tp 2 in the megatron style"),
    ("tiny", {"lora_rank": 8}, {}, r"lora_rank 8 \(a frozen Float8Linear saves its input "
     r"and makes a weight gradient it drops; torchtitan's adapters run in the compute dtype, "
     r"memplan's LoRA is peft's fp32 adapters\)"),
    ("tiny", {"recompute": "selective", "selective_impl": "core"}, {}, "recompute selective"),
])
def test_float8_refuses_what_is_not_modelled(model: str, update: dict, par: dict,
                                            why: str) -> None:
    wl = Workload.model_validate({"float8": "rowwise", **update})
    with pytest.raises(LayoutError, match=f"float8 rowwise with {why}: not modelled"):
        validate(load_model(model), ParallelConfig(**par), wl)


def test_widths_not_multiples_of_16_stay_plain() -> None:
    """torchtitan converts only linears whose widths are multiples of 16 (``module_filter_fn``,
    ``torchtitan/components/quantization/utils.py``): 64 -> 40 stays plain, so under autocast
    it saves its weight's bf16 cast, 64 * 40 * 2 = 5,120 bytes, and has no float8 casts."""
    odd = Linear("odd", "mlp", 64, 40)
    assert linear.saved_bytes([odd], AMP._replace(float8=Float8Recipe.ROWWISE)) == 5_120
    assert linear.float8_forward_bytes(odd, RW) == 0
    assert linear.float8_backward_bytes(odd, RW) == 0


TINY = ModelSpec.model_validate({
    "name": "float8-test", "hidden_size": 64, "num_layers": 1, "num_attention_heads": 4,
    "num_kv_heads": 2, "ffn_hidden_size": 96, "vocab_size": 128, "mlp": "swiglu",
    "norm": "rmsnorm", "position": "rope", "tied_embeddings": False, "max_seq_len": 64,
    "head_dim": 16, "source": "hand-made for this test"})


def test_mlp_moments_hold_the_down_projections_casts() -> None:
    """SwiGLU h 64, ffn 96, 16 bf16 tokens. Forward, at the down projection (96 -> 64,
    n = 16 * 96 = 1,536 input elements, m = 96 * 64 = 6,144 weight elements): plain, its
    output 16 * 64 * 2 = 2,048 bytes then beside the residual add's output (4,096). As a
    Float8Linear the largest of: the input's cast working set 9n (+ its scale), the weight's
    beside the input's float8 cast, n + 9m, and both casts beside the output, n + m + 2,048.
    Tensorwise (one 4-byte scale a cast) max(13,828, 1,540 + 55,300 = 56,840, 9,736) =
    56,840; rowwise (the input's 16 scales, the weight's 64) max(13,888, 1,600 + 55,552 =
    57,152, 10,048) = 57,152.
    Backward, before its weight gradient: p = 16 * 64 = 1,024 grad_output elements, its input
    gradient 16 * 96 * 2 = 3,072 bytes: max(9p, go0 + 9m, go0 + w0 + 3,072 + 9p, go0 + w0 +
    3,072 + go1 + 9n) with scales; tensorwise max(9,220, 1,028 + 55,300 = 56,328, 19,468,
    25,104) = 56,328; rowwise (go0 16 scales, the weight's 96, go1's 64, the input's 96)
    max(9,280, 1,088 + 55,680 = 56,768, ...) = 56,768."""
    mlp, wl = Mlp(), Workload()
    forward = {recipe: mlp.forward_moments(TINY, wl, DM._replace(float8=recipe),
                                           Recompute.NONE)[0].transient_bytes
               for recipe in Float8Recipe}
    assert forward == {Float8Recipe.NONE: 4_096, Float8Recipe.TENSORWISE: 56_840,
                       Float8Recipe.ROWWISE: 57_152}
    down = Linear("down", "mlp_out", 96, 64)
    assert linear.float8_backward_peak(down, DM, 3_072) == 3_072
    assert linear.float8_backward_peak(down, TW, 3_072) == 56_328
    assert linear.float8_backward_peak(down, RW, 3_072) == 56_768
    moments = {m.name: m for m in mlp.backward_moments(TINY, wl, TW, Recompute.NONE)}
    assert moments["mlp_f8_down"].transient_bytes == 56_328
    assert moments["mlp_f8_down"].grads == ()  # before its weight's gradient exists
    plain = {m.name for m in mlp.backward_moments(TINY, wl, DM, Recompute.NONE)}
    assert not any(name.startswith("mlp_f8") for name in plain)


def test_mlp_input_projections_as_float8() -> None:
    """The gate and up projections (64 -> 96: n = 16 * 64 = 1,024, m = 6,144, each output
    16 * 96 * 2 = 3,072 bytes), tensorwise. Forward, the gate's peak alone:
    max(9,220, 1,028 + 55,300 = 56,328, 1,028 + 6,148 + 3,072 = 10,248) = 56,328; up's the same
    beside the saved gate output and its activation (2 * 3,072 = 6,144 own bytes).
    Backward, up's: its output's gradient and the activation's (2 * 3,072) and its peak
    (p = 1,536: max(13,828, 1,540 + 55,300 = 56,840, ...) with its input gradient 2,048)
    = 6,144 + 56,840 = 62,984, the gate's output still saved (3,072); the gate's: up's input
    gradient 2,048, its output's gradient 3,072 and the same peak: 61,960."""
    mlp, wl = Mlp(), Workload()
    fwd = {m.name: m for m in mlp.forward_moments(TINY, wl, TW, Recompute.NONE)}
    assert (fwd["mlp_f8_gate"].own_bytes, fwd["mlp_f8_gate"].transient_bytes) == (0, 56_328)
    assert (fwd["mlp_f8_up"].own_bytes, fwd["mlp_f8_up"].transient_bytes) == (6_144, 56_328)
    bwd = {m.name: m for m in mlp.backward_moments(TINY, wl, TW, Recompute.NONE)}
    assert (bwd["mlp_f8_up"].own_bytes, bwd["mlp_f8_up"].transient_bytes) == (3_072, 62_984)
    assert (bwd["mlp_f8_gate"].own_bytes, bwd["mlp_f8_gate"].transient_bytes) == (0, 61_960)


def test_compiled_float8_refuses_an_ungated_mlp() -> None:
    """Compiled float8 is traced on torchtitan's gated MLP only: an ungated one is refused."""
    from memplan.parallel import float8_rule
    from memplan.spec import MlpKind

    wl = Workload.model_validate({"float8": "rowwise", "compile": True})
    assert float8_rule(TINY, ParallelConfig(), wl) is None
    err = float8_rule(TINY.model_copy(update={"mlp": MlpKind.GELU}), ParallelConfig(), wl)
    assert "float8 rowwise with compile and an ungated MLP: not modelled" in str(err)


def test_float8_all_gather_drops_the_weight_casts() -> None:
    """With FSDP2's float8 all-gather the linear receives its weight already in float8
    (``fsdp_post_all_gather``'s ``Float8TrainingTensor``): no weight cast. The up projection
    64 -> 96 over 16 tokens, tensorwise: forward at the matmul the input's cast alone, 1,024 +
    4 = 1,028 bytes (7,176 with the weight's); the forward peak the input cast's working set
    9 * 1,024 + 4 = 9,220 beside nothing, or 1,028 with the output 3,072: 9,220. Backward,
    before the weight gradient (grad input 16 x 64 x 2 = 2,048): grad_output's two casts and
    the input's, max(9 * 1,536 + 4 = 13,828, 1,540 + 2,048 + 13,828 = 17,416, 1,540 + 2,048 +
    1,540 + 9,216 + 4 = 14,348) = 17,416."""
    gathered = TW._replace(float8_gathered=True)
    assert linear.float8_forward_bytes(UP, gathered) == 1_028
    assert linear.float8_forward_peak(UP, gathered, 3_072) == 9_220
    assert linear.float8_backward_peak(UP, gathered, 2_048) == 17_416


def test_float8_all_gather_gathers_one_byte_per_converted_weight() -> None:
    """The gathered bytes of a block: TINY's converted weights (q 64 x 64, k and v 64 x 32
    each, o 64 x 64, gate, up and down 64 x 96 each = 30,720 elements) at 1 byte instead of
    bf16's 2: 30,720 bytes fewer per gathered block (its norms' 128 elements stay bf16)."""
    from memplan.model.layer import float8_gather_saving

    assert float8_gather_saving(TINY, 1, 2) == 30_720


@pytest.mark.parametrize(("update", "par", "why"), [
    ({"float8": "rowwise"}, {"zero": 3, "dp": 8}, "float8 rowwise (it needs tensorwise)"),
    ({"float8": "tensorwise"}, {"zero": 1, "dp": 8},
     "no FSDP2 weight sharding (it needs zero 3, FSDP2)"),
])
def test_float8_all_gather_refusals(update: dict, par: dict, why: str) -> None:
    wl = Workload.model_validate({"float8_all_gather": True, **update})
    with pytest.raises(LayoutError, match=f"float8_all_gather with {why.replace('(', '.').replace(')', '.')}"):
        validate(TINY, ParallelConfig(**par), wl)


# torchao's float8 TP styles (float8_tensor_parallel.py), as torchtitan's llama3 apply_tp uses
# them with tensorwise float8: tp 2 with DTensor sequence parallelism, 16 tokens, 8 a shard
TP2 = TW._replace(tp=2, res_tokens_div=2, gathered_linear_input=True, float8_tp=True)
DOWN = Linear("down", "mlp_out", 96, 64, split=linear.Split.ROW)


def test_float8_tp_saves_float8_inputs() -> None:
    """PrepareFloat8ModuleInput casts a block's input on its sequence shard and all-gathers
    the float8 tensor, which its linears save: 16 tokens x 64 x 1 byte + one fp32 scale =
    1,028 bytes (bf16 gathered: 2,048); the down projection saves its input's float8 cast,
    16 x 48 + 4 = 772 bytes, and the bf16 product (16 x 48 x 2 = 1,536) is saved by no one."""
    from memplan.model.mlp import mlp_terms
    from memplan.model.norm import norm_terms

    wl = Workload.model_validate({"framework": "torchtitan", "norm_impl": "fused"})
    assert linear.float8_tp_input_bytes(16, 64) == 1_028
    terms = dict(norm_terms("mlp_norm", TINY, wl, TP2))
    assert terms["mlp_norm.output"] == 1_028
    mlp = dict(mlp_terms("mlp", TINY, TP2, 96, 16))
    assert (mlp["mlp.prod"], mlp["mlp.down_float8"]) == (0, 772)


def test_float8_tp_casts_by_hand() -> None:
    """At tp 2 (tensorwise) the up projection (64 -> 48 on this rank) finds its input cast: forward, the
    weight's cast alone, 3,072 elements: its working set 9 * 3,072 + 4 = 27,652 beside
    nothing, or 3,076 beside the output 1,536: 27,652. Backward, its gradient arrives cast
    (16 x 48 + 4 = 772): max(the gradient's cast working set 9 * 768 + 4 = 6,916, 772 +
    27,652 = 28,424, 772 + 3,076 + grad input 2,048 = 5,896) = 28,424. The down projection
    (row-parallel, 48 -> 64) casts its gradient on the 8-token shard (9 * 512 + 4 = 4,612),
    then gathers it in float8 (16 x 64 + 4 = 1,028): max(4,612, 1,028 + 27,652 = 28,680,
    1,028 + 3,076 + 1,536 = 5,640) = 28,680."""
    assert linear.float8_forward_peak(UP, TP2, 1_536) == 27_652
    assert linear.float8_backward_peak(UP, TP2, 2_048) == 28_424
    assert linear.float8_backward_peak(DOWN, TP2, 1_536) == 28_680


def test_float8_tp_accepted_and_refused() -> None:
    """Tensorwise and rowwise with DTensor TP are modelled, compiled too under full
    recompute or per-op SAC, and tensorwise with separate q/k/v without recompute; the
    Megatron style, rowwise or a fused qkv compiled without recompute are refused by name."""
    tw = Workload.model_validate({"float8": "tensorwise"})
    validate(TINY, ParallelConfig(tp=2, tp_style="dtensor"), tw)
    validate(TINY, ParallelConfig(tp=2, tp_style="dtensor"),
             Workload.model_validate({"float8": "rowwise"}))
    with pytest.raises(LayoutError, match="tp 2 in the megatron style: not modelled"):
        validate(TINY, ParallelConfig(tp=2, tp_style="megatron"), tw)
    compiled = Workload.model_validate({"float8": "tensorwise", "compile": True})
    validate(TINY, ParallelConfig(tp=2, tp_style="dtensor"), compiled)
    with pytest.raises(LayoutError, match=r"tp 2, compile, recompute none and a fused wqkv "
                       r"\(torchao's float8 TP styles have no plan entry for it"):
        validate(TINY, ParallelConfig(tp=2, tp_style="dtensor"),
                 compiled.model_copy(update={"fused_qkv": True}))
    with pytest.raises(LayoutError, match=r"tp 2, compile, recompute none and rowwise "
                       r"scaling \(the partitioner saves the float8 casts of some sharded "
                       "weights and only the scales of others"):
        validate(TINY, ParallelConfig(tp=2, tp_style="dtensor"),
                 compiled.model_copy(update={"float8": Float8Recipe.ROWWISE}))
    for recipe in ("tensorwise", "rowwise"):
        sac = Workload.model_validate({"float8": recipe, "compile": True,
                                       "recompute": "selective", "selective_impl": "op"})
        validate(TINY, ParallelConfig(tp=2, tp_style="dtensor", sequence_parallel=True), sac)
    full = Workload.model_validate({"float8": "tensorwise", "compile": True,
                                    "recompute": "full"})
    validate(TINY, ParallelConfig(tp=2, tp_style="dtensor"), full)


def test_float8_rowwise_tp_gathered_gradient() -> None:
    """Rowwise under DTensor TP with SP (plain RowwiseParallel): the down projection's
    backward reads its output gradient all-gathered in bf16, 16 tokens x 64 x 2 = 2,048
    bytes, alive through its backward: its peak is the tp 1 formula's plus 2,048. The tp 1
    formula for 48 -> 64 on this rank, 16 rows, rowwise: the gradient's first cast (1,024 B
    + 16 * 4 scales = 1,088) beside the weight's cast working set (48 x 64 = 3,072 elements
    * 9 + 48 * 4 = 27,840): 28,928, above the gradient's cast working set (9,280) and the
    later casts beside the input gradient (15,360; 14,272); + 2,048 = 30,976. The up
    projection (column-parallel) holds no gathered gradient: the tp 1 formula alone."""
    rw = RW._replace(tp=2, res_tokens_div=2, gathered_linear_input=True)
    assert linear.float8_backward_peak(DOWN, rw, 1_536) == 30_976
    assert (linear.float8_backward_peak(UP, rw, 2_048)
            == linear.float8_backward_peak(UP, rw._replace(gathered_linear_input=False), 2_048))

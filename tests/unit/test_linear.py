"""The projections every block declares (``memplan.model.linear``), with sizes derived by hand."""

from __future__ import annotations

from memplan.model import linear
from memplan.model.attention import Attention, attention_linears
from memplan.model.dims import Dims, Term
from memplan.model.linear import Linear, Split
from memplan.model.mlp import Mlp, mlp_linears
from memplan.spec import ModelSpec

# a bf16 micro-batch of 2 x 8 tokens at TP 2 (only the fields the projections read matter)
DM = Dims(b=2, s=8, s_kv=8, tokens=16, res_tokens_div=1, tp=2, e=2, vocab_shard=64, stream_e=2)
AMP = DM._replace(stream_e=4, autocast=True)

TINY = ModelSpec.model_validate({
    "name": "linear-test", "hidden_size": 64, "num_layers": 1, "num_attention_heads": 4,
    "num_kv_heads": 2, "ffn_hidden_size": 96, "vocab_size": 128, "mlp": "swiglu",
    "norm": "rmsnorm", "position": "rope", "tied_embeddings": False, "qkv_bias": True,
    "max_seq_len": 64, "head_dim": 16, "source": "hand-made for this test"})


def test_tensor_sizes_follow_megatron_splits() -> None:
    """h = 64 -> 32 with a bias at t = 4. Column-parallel: weight 64*32/4 = 512, bias 32/4 =
    8. Row-parallel: weight 512, bias whole, 32. Replicated: weight 2,048, bias 32. Two
    experts stacked in one column-parallel tensor: 2 * 64*32/4 = 1,024, no bias."""
    assert linear.tensor_sizes(Linear("a", "g", 64, 32, True), 4) == [512, 8]
    assert linear.tensor_sizes(Linear("a", "g", 64, 32, True, Split.ROW), 4) == [512, 32]
    assert linear.tensor_sizes(Linear("a", "g", 64, 32, True, Split.NONE), 4) == [2048, 32]
    assert linear.tensor_sizes(Linear("a", "g", 64, 32, stack=2), 4) == [1024]


def test_saved_terms_only_under_autocast() -> None:
    """q 64 -> 32 and o 32 -> 64 at t = 2: 1,024 + 1,024 weight elements on the rank (the
    biases are not saved casts), 2 bytes each under bf16 autocast: 4,096 bytes; none
    without autocast."""
    lins = [Linear("q", "attn", 64, 32, True), Linear("o", "attn_out", 32, 64, True, Split.ROW)]
    assert linear.saved_terms("x", lins, AMP) == [Term("x.weight_casts", 4096)]
    assert linear.saved_terms("x", lins, DM) == []
    assert linear.saved_bytes(lins[1:], AMP) == 2048


def test_input_copies_and_saved_input() -> None:
    """Three linears reading one tensor save it once, or under autocast three casts. The
    output projection (32 -> 64, row-parallel) saves its input split by t = 2: 16 tokens * 16
    * 2 bytes = 512; a column-parallel one its whole input: 16 * 64 * 2 = 2,048."""
    assert linear.input_copies(3, DM) == 1 and linear.input_copies(3, AMP) == 3
    row = Linear("o", "attn_out", 32, 64, split=Split.ROW)
    assert linear.saved_input("o.in", row, 16, DM) == Term("o.in", 512)
    assert linear.saved_input("q.in", Linear("q", "attn", 64, 32), 16, DM).size_bytes == 2048


def test_grad_groups_accumulate_in_backward_order() -> None:
    """down (96 -> 64, no bias) at t = 2: 3,072; gate and up (64 -> 96): 3,072 each. After the
    down projection's backward 3,072 parameters have gradients, after the whole MLP 9,216; a
    norm's 64 added to the second group: 9,280."""
    lins = [Linear("up", "mlp", 64, 96), Linear("gate", "mlp", 64, 96),
            Linear("down", "mlp_out", 96, 64, split=Split.ROW)]
    assert linear.grad_groups(lins, 2, ("mlp_out", "mlp")) == {"mlp_out": 3072, "mlp": 9216}
    assert linear.grad_groups(lins, 2, ("mlp_out", "mlp"), {"mlp": 64})["mlp"] == 9280


def test_flops_count_two_per_parameter() -> None:
    """64 -> 32 with a bias: 2,048 + 32 parameters, 2 FLOPs each per token: 4,160."""
    assert linear.flops_per_token([Linear("a", "g", 64, 32, True)]) == 4160.0


def test_blocks_declare_their_projections() -> None:
    """TINY: h = 64, 4 heads of 16 (q 64), 2 KV heads (k, v 32 each), q/k/v biases; SwiGLU of
    96. At t = 2 the attention holds q 64*64/2 = 2,048 (+32), k and v 64*32/2 = 1,024 (+16)
    each, o 64*64/2 = 2,048: its ``attn_out`` group 2,048, ``attn`` 6,144 + 64 = 6,208. The
    MLP: up and gate 64*96/2 = 3,072 each, down 3,072. Under bf16 autocast the attention
    saves casts of 6,144 weights (12,288 bytes), the MLP of 9,216 (18,432)."""
    attn = attention_linears(TINY)
    assert [lin.name for lin in attn] == ["q", "k", "v", "o"]
    assert Attention().tensor_sizes(TINY, 2, 1) == [2048, 32, 1024, 16, 1024, 16, 2048]
    assert Attention().grad_groups(TINY, 2, 1) == {"attn_out": 2048, "attn": 6208}
    assert linear.saved_terms("attn", attn, AMP)[0].size_bytes == 12288
    assert [lin.name for lin in mlp_linears(TINY, 96)] == ["up", "gate", "down"]
    assert Mlp().tensor_sizes(TINY, 2, 1) == [3072, 3072, 3072]
    assert Mlp().grad_groups(TINY, 2, 1) == {"mlp_out": 3072, "mlp": 9216}
    assert linear.saved_terms("mlp", mlp_linears(TINY, 96), AMP)[0].size_bytes == 18432

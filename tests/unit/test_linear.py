"""The projections every block declares (``memplan.model.linear``), with sizes derived by hand."""

from __future__ import annotations

from memplan.model import linear
from memplan.model.attention import Attention, attention_linears
from memplan.model.dims import Dims, Term
from memplan.model.linear import Linear, Split
from memplan.model.mla import Mla, mla_linears
from memplan.model.mlp import Mlp, mlp_linears
from memplan.model.moe import MoE
from memplan.spec import MlaSpec, ModelSpec, MoESpec

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


def test_moe_declares_router_and_this_ranks_experts() -> None:
    """4 experts of SwiGLU width 32, top-2, h = 64, at EP 2 and TP 2: the router 64*4 = 256
    (replicated), then this rank's 2 experts, each up, gate and down of 64*32/2 = 1,024; stacked,
    one gate-up tensor 2 * 64*64/2 = 4,096 and one down 2 * 32*64/2 = 2,048. Gradients after
    the down projections' backward: 2,048; after all: 2,048 + 4,096 + 256 = 6,400. FLOPs per
    token: the router 2 * 256 = 512, and the top-2 of 4 experts of 3 * 64*32 = 6,144
    parameters: 2 * 4 * 6,144 * 2/4 = 24,576; 25,088 in all."""
    moe = {"num_experts": 4, "top_k": 2, "expert_ffn_hidden_size": 32}
    spec = TINY.model_copy(update={"moe": MoESpec(**moe)})
    stacked = TINY.model_copy(update={"moe": MoESpec(**moe, stacked_experts=True)})
    assert MoE().tensor_sizes(spec, 2, 2) == [256] + [1024] * 6
    assert MoE().tensor_sizes(stacked, 2, 2) == [256, 4096, 2048]
    groups = {"mlp_out": 2048, "mlp": 6400}
    assert MoE().grad_groups(spec, 2, 2) == MoE().grad_groups(stacked, 2, 2) == groups
    assert MoE().flops_per_token(spec, 64) == 25088.0


def test_mla_declares_replicated_down_projections() -> None:
    """h = 64, 4 heads, q_lora 16, kv_lora 8, nope 8, rope 4 (head 12), value 8, at TP 2: q_a
    64*16 = 1,024 (replicated) and its norm 16; q_b 16 * 48/2 = 384; kv_a 64*12 = 768
    (replicated) and its norm 8; kv_b 8 * 4*16/2 = 256; o 32*64/2 = 1,024. ``attn``: all
    3,480. Under bf16 autocast the weight casts: (1,024 + 384 + 768 + 256 + 1,024) * 2 =
    6,912 bytes. FLOPs at seq 64: 2 * (1,024 + 768 + 768 + 512 + 2,048 projection and 24
    norm parameters) = 10,288, and the core 64 * 4 * (12 + 8) = 5,120: 15,408."""
    mla = MlaSpec(q_lora_rank=16, kv_lora_rank=8, qk_nope_head_dim=8, qk_rope_head_dim=4,
                  v_head_dim=8)
    spec = TINY.model_copy(update={"mla": mla, "head_dim": 12, "num_kv_heads": 4,
                                   "qkv_bias": False})
    assert Mla().tensor_sizes(spec, 2, 1) == [1024, 16, 384, 768, 8, 256, 1024]
    assert Mla().grad_groups(spec, 2, 1) == {"attn_out": 1024, "attn": 3480}
    assert linear.saved_bytes(mla_linears(spec), AMP) == 6912
    assert Mla().flops_per_token(spec, 64) == 15408.0

"""LFM2 (memplan.hf.families_conv, memplan.model.short_conv): its parameter count and the
short-convolution block's saved bytes, moments and FLOPs, by hand.

The traced ground truth (transformers' own Lfm2ForCausalLM cut to three toy layers, stepped
under the exact tracker, and its meta-device count) is tests/traced/test_hf_heldout.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from memplan.errors import MemplanError
from memplan.model.dims import Dims, total
from memplan.model.layer import layer_blocks, layer_terms
from memplan.model.short_conv import ShortConv, conv_cache_bytes, short_conv_terms
from memplan.parallel import ParallelConfig
from memplan.spec import ModelSpec, load_model, spec_from_hf_dict
from memplan.workload import Recompute, Workload

CONFIG = json.loads((Path(__file__).parent.parent / "data" / "hf" / "heldout" / "LFM2-1.2B" /
                     "config.json").read_text())


def test_lfm2_1_2b_count_by_hand() -> None:
    """LiquidAI/LFM2-1.2B's config.json: h = 2,048, 16 layers (attention on 2, 5, 8, 10, 12,
    14; short convolutions on the other 10), 32 heads / 8 KV heads of 64, V = 65,536 tied,
    conv_L_cache 3 without bias, block_ff_dim 12,288 -> int(2 * 12,288 / 3) = 8,192 (a
    multiple of 256) (modeling_lfm2.py, transformers 5.3):

    embedding (tied)     65,536 * 2,048                             =   134,217,728
    attention layer (Lfm2Attention):
      q_proj, out_proj   2 * 2,048 * 2,048                          =     8,388,608
      k_proj, v_proj     2 * 2,048 * 512                            =     2,097,152
      q/k layernorms     2 * 64                                     =           128
                                                                    =    10,485,888
    short-convolution layer (Lfm2ShortConv):
      in_proj            2,048 * 6,144                              =    12,582,912
      conv               2,048 * 3                                  =         6,144
      out_proj           2,048 * 2,048                              =     4,194,304
                                                                    =    16,783,360
    MLP (w1, w3, w2)     3 * 2,048 * 8,192                          =    50,331,648
    two norms            2 * 2,048                                  =         4,096
    6 attention layers   6 * (10,485,888 + 50,335,744)              =   364,929,792
    10 conv layers       10 * (16,783,360 + 50,335,744)             =   671,191,040
    final norm           2,048                                      =         2,048
    total                                                           = 1,170,340,608

    The model card's table gives 1,170,340,608."""
    spec = spec_from_hf_dict(CONFIG, "config.json", "lfm2")
    assert spec.approximate is None and spec.num_params == 1_170_340_608
    assert [i for i in range(16) if not spec.is_linear_layer(i)] == [2, 5, 8, 10, 12, 14]
    assert spec.ffn_hidden_size == 8192 and spec.tied_embeddings
    catalog = load_model("lfm2-1.2b")
    assert catalog.num_params == 1_170_340_608
    assert catalog.model_copy(update={"name": spec.name, "source": spec.source}) == spec


def test_layer_types_and_ffn_rules() -> None:
    """layer_types (transformers 5.25's to_dict) sets the attention layers as full_attn_idxs
    does; without either every layer attends. block_ffn_dim_multiplier null skips the
    rounding: int(2 * 1,000 / 3) = 666; 1.5 rounds int(1.5 * 666) = 999 up to 1,024."""
    types = ["conv", "full_attention"] * 8
    data = {k: v for k, v in CONFIG.items() if k != "full_attn_idxs"}
    spec = spec_from_hf_dict({**data, "layer_types": types}, "c", "m")
    assert spec.short_conv.attention_layers == tuple(range(1, 16, 2))
    assert spec_from_hf_dict(data, "c", "m").short_conv.attention_layers == tuple(range(16))
    odd = {**CONFIG, "block_ff_dim": 1000}
    assert spec_from_hf_dict({**odd, "block_ffn_dim_multiplier": None}, "c", "m") \
        .ffn_hidden_size == 666
    assert spec_from_hf_dict({**odd, "block_ffn_dim_multiplier": 1.5}, "c", "m") \
        .ffn_hidden_size == 1024
    with pytest.raises(MemplanError, match="layer_types"):
        spec_from_hf_dict({**data, "layer_types": ["mamba"] * 16}, "c", "m")


def _toy() -> ModelSpec:
    """h = 64, 4 heads / 2 KV heads of 16, f = 176, 3 layers, attention on layer 1, K = 3."""
    return ModelSpec(name="toy", source="test", num_layers=3, hidden_size=64,
                     ffn_hidden_size=176, num_attention_heads=4, num_kv_heads=2, head_dim=16,
                     vocab_size=128, max_seq_len=64, norm="rmsnorm", mlp="swiglu",
                     position="rope", tied_embeddings=True, qk_norm="head",
                     short_conv={"conv_kernel": 3, "attention_layers": [1]})


def test_short_conv_saved_bytes_by_hand() -> None:
    """b = 2, s = 32 (T = 64), c = 64 channels, K = 3, bf16 (e = 2): in_proj's output 3 T c e
    = 24,576, B * x T c e = 8,192, the padded convolution output b c (s + K - 1) e = 2 * 64 *
    34 * 2 = 8,704, out_proj's input 8,192: 49,664 B. Under amp-bf16 also the weight casts:
    in_proj 3 * 64 * 64 * 2 = 24,576, out_proj 8,192, the convolution's 64 * 3 * 2 = 384.
    Parameters in registration order: conv 192, in_proj 12,288, out_proj 4,096; FLOPs per
    token 2 * (12,288 + 4,096) + 2 * 64 * 3 = 33,152. The cache with use_cache: b c K e =
    768 B per layer."""
    spec = _toy()
    wl = Workload(micro_batch_size=2, seq_len=32)
    dm = Dims.of(spec, ParallelConfig(), wl)
    terms = {t.name: t.size_bytes for t in short_conv_terms(spec, dm)}
    assert terms == {"short_conv.bcx": 24_576, "short_conv.bx": 8_192,
                     "short_conv.conv_out": 8_704, "short_conv.out": 8_192}
    amp = Workload(micro_batch_size=2, seq_len=32, precision="amp-bf16")
    dm_amp = Dims.of(spec, ParallelConfig(), amp)
    assert total(short_conv_terms(spec, dm_amp)) == 49_664 + 24_576 + 8_192 + 384
    block = ShortConv()
    assert block.tensor_sizes(spec, 1, 1) == [192, 12_288, 4_096]
    assert block.flops_per_token(spec, 32) == 33_152.0
    assert conv_cache_bytes(spec, dm) == 768
    assert isinstance(layer_blocks(spec, False, "linear")[1], ShortConv)
    saved = layer_terms(spec, wl, dm, moe_layer=False, recompute=Recompute.NONE,
                        variant="linear")
    assert sum(t.size_bytes for t in saved if t.name.startswith("short_conv.")) == 49_664


def test_short_conv_backward_peaks_at_the_chunk() -> None:
    """In backward the chunk's gradients peak: B's, C's and x's (3 T c e = 24,576) beside
    their concatenation (24,576), everything the block saved freed by then; in_proj's backward
    after it holds the concatenation and its input's gradient (8,192): 32,768."""
    spec = _toy()
    wl = Workload(micro_batch_size=2, seq_len=32)
    dm = Dims.of(spec, ParallelConfig(), wl)
    moments = {m.name: m for m in ShortConv().backward_moments(spec, wl, dm, Recompute.NONE)}
    assert (moments["short_conv.chunk"].own_bytes,
            moments["short_conv.chunk"].transient_bytes) == (0, 49_152)
    assert max(m.transient_bytes for m in moments.values()) == 49_152
    assert moments["short_conv_in"].transient_bytes == 32_768

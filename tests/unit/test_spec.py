"""The model catalog and exact parameter counting.

Published counts are the tensor totals of the released checkpoints (the figures Hugging Face
reports for each repository); a count that is off by even one layer norm means a config value
in the catalog is wrong.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from memplan.errors import ValidationError

from memplan.errors import MemplanError
from memplan.spec import ModelSpec, catalog_names, load_model, param_counts

PUBLISHED = {
    "llama-7b": 6_738_415_616,
    "llama-13b": 13_015_864_320,
    "llama-30b": 32_528_943_616,
    "llama-65b": 65_285_660_672,
    "llama-2-7b": 6_738_415_616,
    "llama-2-13b": 13_015_864_320,
    "llama-2-70b": 68_976_648_192,
    "llama-3-8b": 8_030_261_248,
    "llama-3-70b": 70_553_706_496,
    "llama-3.1-8b": 8_030_261_248,
    "llama-3.1-70b": 70_553_706_496,
    "llama-3.1-405b": 405_853_388_800,
    "llama-3.2-3b": 3_212_749_824,
    "mistral-7b": 7_241_732_096,
    "mixtral-8x7b": 46_702_792_704,
    "qwen2.5-7b": 7_615_616_512,
    "qwen2.5-72b": 72_706_203_648,
    "gpt2": 124_439_808,
    "gpt2-xl": 1_557_611_200,
    # the LiquidAI/LFM2 model cards' parameter table (counted by hand in
    # tests/unit/test_short_conv.py)
    "lfm2-1.2b": 1_170_340_608,
    # read from their config.json files (tests/data/hf/heldout), counted by hand in
    # tests/unit/test_hf_more_families.py and against transformers' meta build in
    # tests/traced/test_hf_heldout.py
    "granite-4.0-h-tiny": 6_939_037_248,
    "granite-3.1-1b-a400m": 1_334_628_352,
    "granite-3.1-3b-a800m": 3_298_793_472,
    "granite-4.0-h-small": 32_207_337_984,
    # Falcon-H1, read from their held-out config.json files (Megatron-Bridge's provider
    # values), counted by hand in tests/unit/test_falcon_h1.py and against transformers 5.3's
    # and 5.23's meta builds in tests/traced/test_hf_heldout.py
    "falcon-h1-0.5b": 521_411_104,
    "falcon-h1-1.5b-deep": 1_554_874_768,
    "falcon-h1-7b": 7_585_654_880,
    "falcon-h1-34b": 33_642_516_224,
}

# The newer families: their totals as their model cards state them (billions, to the digits
# given; DeepSeek-V3's main model, Gemma 3's language model). The exact counts are checked
# against the models transformers builds (tests/traced/test_hf_families.py).
STATED_BILLIONS = {
    "qwen3-8b": 8.2, "qwen3-30b-a3b": 30.5, "qwen1.5-moe-a2.7b": 14.3, "gemma-2-9b": 9.24,
    "gemma-3-12b": 11.8, "phi-3-mini-4k": 3.8, "olmo-2-7b": 7.3, "deepseek-v3": 671,
}
# families whose catalog entries are checked against the count of the model transformers
# builds from the same config.json (tests/traced/test_hf_families.py), to the parameter
COUNTED_BY_TRANSFORMERS: set[str] = {"command-r7b", "phi-4-mini", "olmo-3-7b", "smollm3-3b",
                                     "ministral-8b", "gemma-7b", "granite-3.3-8b"}
# The MoE / hybrid families' flagships, whose model cards state nominal sizes ("32B"; GLM-4.5's
# "355B" counts its multi-token-prediction layer, which transformers does not build; gpt-oss's
# 116.8B and 20.9B): their exact counts are checked against transformers' meta build
# (tests/traced/test_hf_moe_families.py)
MOE_FAMILY_FLAGSHIPS = {"glm-4-32b", "glm-4.5", "gpt-oss-120b", "gpt-oss-20b",
                        "llama-4-scout", "llama-4-maverick"}
# Qwen3-Next-80B-A3B (its card: "80B total, 3B active"; counted by hand in
# tests/unit/test_qwen3_next.py, against transformers in tests/traced/test_hf_qwen3_next.py)
MOE_FAMILY_FLAGSHIPS |= {"qwen3-next-80b-a3b"}
EXPECTED_CATALOG = {*PUBLISHED, *STATED_BILLIONS, *COUNTED_BY_TRANSFORMERS, *MOE_FAMILY_FLAGSHIPS,
                    "gpt3-175b", "tiny"}


@pytest.mark.parametrize("name", sorted(STATED_BILLIONS))
def test_catalog_count_matches_the_stated_total(name: str) -> None:
    stated = STATED_BILLIONS[name]
    digits = len(str(stated).partition(".")[2]) if "." in str(stated) else 0
    assert round(param_counts(load_model(name)).total / 1e9, digits) == stated


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_catalog_count_matches_published(name: str) -> None:
    assert param_counts(load_model(name)).total == PUBLISHED[name]


def test_catalog_holds_the_expected_models() -> None:
    assert set(catalog_names()) == EXPECTED_CATALOG


@pytest.mark.parametrize("name", sorted(EXPECTED_CATALOG))
def test_every_catalog_file_loads_with_a_source(name: str) -> None:
    spec = load_model(name)
    assert spec.name == name
    assert spec.source.strip()


def test_gpt3_175b_count() -> None:
    """GPT-3 175B by hand: h=12288, L=96, V=50257, S=2048, ffn=4h, all biases, LayerNorm with bias.

    token embedding     V*h = 50257 * 12288                   =     617,558,016
    position embedding  S*h = 2048 * 12288                    =      25,165,824
    one layer:
      attention weights 4h^2 = 4 * 150,994,944                =     603,979,776
      attention biases  3h (q,k,v) + h (out) = 4h              =          49,152
      MLP weights       2 * h * 4h = 8h^2                      =   1,207,959,552
      MLP biases        4h (up) + h (down) = 5h                =          61,440
      two LayerNorms    2 * 2h = 4h                            =          49,152
      layer total       12h^2 + 13h                            =   1,812,099,072
    96 layers           96 * 1,812,099,072                     = 173,961,510,912
    final LayerNorm     2h                                     =          24,576
    head                tied to the token embedding            =               0
    total                                                      = 174,604,259,328

    The paper (Brown et al. 2020, Table 2.1) rounds this to 175.0B.
    """
    assert param_counts(load_model("gpt3-175b")).total == 174_604_259_328


def test_llama4_scout_count() -> None:
    """Llama 4 Scout's text model by hand (models/llama4/modeling_llama4.py): h=5120, L=48,
    40 query heads and 8 key/value heads of 128, V=202048, untied; every layer MoE.

    token embedding     202048 * 5120                          =   1,034,485,760
    one layer:
      q and o           2 * 5120 * 5120                        =      52,428,800
      k and v           2 * 5120 * 1024                        =      10,485,760
      (the L2 q/k norm has no weights)
      router            5120 * 16                              =          81,920
      16 experts        16 * 3 * 5120 * 8192                   =   2,013,265,920
      shared expert     3 * 5120 * 8192                        =     125,829,120
      two RMSNorms      2 * 5120                               =          10,240
      layer total                                              =   2,202,101,760
    48 layers           48 * 2,202,101,760                     = 105,700,884,480
    final norm                                                 =           5,120
    head                202048 * 5120                          =   1,034,485,760
    total                                                      = 107,769,861,120

    The published 109,676,279,296 adds the vision tower and projector (1,906,418,176); the
    17B active: attention 48 * 62,914,560, one expert and the shared one 48 * 251,658,240,
    embedding and head: 17,168,465,920. transformers' meta build counts the same
    (tests/traced/test_hf_moe_families.py)."""
    assert param_counts(load_model("llama-4-scout")).total == 107_769_861_120


def test_llama4_maverick_count() -> None:
    """Llama 4 Maverick's text model by hand: Scout's widths, MoE on the 24 odd layers with
    128 experts, dense MLPs of 16384 on the 24 even ones, no q/k norm.

    attention and norms per layer   62,914,560 + 10,240          =      62,924,800
    MoE layer: router 5120 * 128 = 655,360; 128 * 125,829,120 = 16,106,127,360;
      shared 125,829,120; with attention and norms               =  16,295,536,640
    dense layer: 3 * 5120 * 16384 = 251,658,240, with the rest   =     314,583,040
    24 * 16,295,536,640 + 24 * 314,583,040                        = 398,642,872,320
    embedding, head 2 * 1,034,485,760, final norm 5120            =   2,068,976,640
    total                                                         = 400,711,848,960

    The model card's 400B total; 17B active: attention 3,019,898,880, 24 MoE layers' router,
    one expert and the shared one 24 * 252,313,600, 24 dense MLPs 24 * 251,658,240,
    embedding and head: 17,184,194,560."""
    assert param_counts(load_model("llama-4-maverick")).total == 400_711_848_960


def test_tiny_count() -> None:
    """tiny by hand: h=64, L=2, ffn=176, 4 heads / 2 KV heads of 16, V=128, untied, RMSNorm.

    token embedding     128 * 64                               =   8,192
    one layer:
      q and out         2 * 64 * (4*16)                        =   8,192
      k and v           2 * 64 * (2*16)                        =   4,096
      SwiGLU            3 * 64 * 176                           =  33,792
      two RMSNorms      2 * 64                                 =     128
      layer total                                              =  46,208
    2 layers                                                   =  92,416
    final RMSNorm       64                                     =      64
    head (untied)       128 * 64                               =   8,192
    total                                                      = 108,864
    """
    counts = param_counts(load_model("tiny"))
    assert counts.layers[0].total == 46_208
    assert counts.total == 108_864


def test_llama_2_7b_parts() -> None:
    """Llama-2-7B by part: h=4096, ffn=11008, 32 layers, V=32000, untied.

    one layer = 4h^2 (q,k,v,o) + 3*h*ffn (gate, up, down) + 2h (norms)
              = 67,108,864 + 135,266,304 + 8,192 = 202,383,360
    """
    counts = param_counts(load_model("llama-2-7b"))
    assert counts.embedding == 131_072_000
    assert counts.position_embedding == 0
    assert len(counts.layers) == 32
    assert {lp.total for lp in counts.layers} == {202_383_360}
    # Norms are replicated under tensor parallelism; every matrix is sharded.
    assert counts.layers[0].replicated == 8_192
    assert counts.layers[0].tp_sharded == 202_375_168
    assert counts.layers[0].expert == 0
    assert counts.final_norm == 4_096
    assert counts.head == 131_072_000
    assert counts.total == 131_072_000 + 32 * 202_383_360 + 4_096 + 131_072_000


def test_mixtral_layer_split() -> None:
    """Mixtral layer: attention 2*4096*4096 + 2*4096*1024 = 41,943,040; router 4096*8 = 32,768;
    experts 8 * 3*4096*14336 = 1,409,286,144; norms 8,192."""
    counts = param_counts(load_model("mixtral-8x7b"))
    layer = counts.layers[0]
    assert layer.tp_sharded == 41_943_040
    assert layer.replicated == 32_768 + 8_192
    assert layer.expert == 1_409_286_144


def test_gpt2_parts() -> None:
    counts = param_counts(load_model("gpt2"))
    assert counts.embedding == 50257 * 768
    assert counts.position_embedding == 1024 * 768
    assert counts.head == 0
    assert counts.final_norm == 2 * 768


def test_unknown_name_suggests_the_near_one() -> None:
    with pytest.raises(MemplanError, match="'llama-2-7b'") as err:
        load_model("llama2-7b")
    assert "\n" not in str(err.value)


def test_unknown_name_with_nothing_near() -> None:
    with pytest.raises(MemplanError, match="unknown model") as err:
        load_model("zzzzzzzz")
    assert "did you mean" not in str(err.value)


def _toml_with(tmp_path: Path, extra: str) -> Path:
    base = (Path(__file__).parents[2] / "model_specs" / "models" / "tiny.toml").read_text()
    path = tmp_path / "custom.toml"
    path.write_text(base.replace('name = "tiny"\n', "") + extra)
    return path


def test_toml_file_loads_with_name_from_stem(tmp_path: Path) -> None:
    spec = load_model(str(_toml_with(tmp_path, "")))
    assert spec.name == "custom"
    assert spec.num_params == 108_864


def test_toml_unknown_key_is_named(tmp_path: Path) -> None:
    path = _toml_with(tmp_path, "num_layer = 3\n")
    with pytest.raises(MemplanError, match="num_layer") as err:
        load_model(str(path))
    assert str(path) in str(err.value)
    assert "\n" not in str(err.value)


def test_toml_bad_value_is_one_line(tmp_path: Path) -> None:
    text = _toml_with(tmp_path, "").read_text().replace("num_kv_heads = 2", "num_kv_heads = 3")
    (tmp_path / "bad.toml").write_text(text)
    with pytest.raises(MemplanError, match="num_kv_heads") as err:
        load_model(str(tmp_path / "bad.toml"))
    assert "\n" not in str(err.value)


def test_malformed_toml(tmp_path: Path) -> None:
    path = tmp_path / "broken.toml"
    path.write_text("num_layers = = 2\n")
    with pytest.raises(MemplanError, match="broken.toml"):
        load_model(str(path))


def _tiny(**fields) -> ModelSpec:
    base = dict(name="t", source="hand", num_layers=1, hidden_size=8, ffn_hidden_size=16,
                num_attention_heads=2, num_kv_heads=2, head_dim=4, vocab_size=10,
                max_seq_len=32, norm="layernorm", mlp="swiglu", position="rope",
                tied_embeddings=True)
    return ModelSpec(**(base | fields))


def test_parallel_block_has_one_norm_per_layer() -> None:
    """By hand, h = 8, ffn 16, 2 heads of 4, vocabulary 10, one layer, tied, LayerNorm
    without bias: embedding 10 * 8 = 80; q, k, v, o 4 * 8 * 8 = 256; gate, up, down
    3 * 8 * 16 = 384; final norm 8; a sequential layer's two norms 16 (744 in all), a
    parallel layer's one 8 (736)."""
    assert _tiny().num_params == 744
    assert _tiny(parallel_block=True).num_params == 736


@pytest.mark.parametrize(("fields", "named"), [
    ({"parallel_block": True, "norm_placement": "sandwich"}, "parallel_block"),
    ({"norm_centres_twice": True, "norm": "rmsnorm"}, "norm_centres_twice"),
    ({"rotary_dim": 3}, "rotary_dim"),
    ({"rotary_dim": 6}, "rotary_dim"),
])
def test_new_layer_fields_refuse_what_they_do_not_describe(fields: dict, named: str) -> None:
    with pytest.raises(ValidationError, match=named):
        _tiny(**fields)


def test_rope_dim_and_nope_layers() -> None:
    """rotary_dim narrows RoPE's width (head_dim 4, rotary 2); every 4th layer (index 3, 7)
    without RoPE at interval 4."""
    assert _tiny(rotary_dim=2).rope_dim == 2 and _tiny().rope_dim == 4
    spec = _tiny(num_layers=8, nope_layer_interval=4)
    assert [i for i in range(8) if spec.is_nope_layer(i)] == [3, 7]

"""Reading Hugging Face ``config.json`` files.

The fixtures under ``tests/data/hf`` are the config.json files published on the Hub for each
model; loading one must give exactly the catalog entry's parameter count.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from memplan.errors import MemplanError
from memplan.spec import load_model, spec_from_hf_config

HF = Path(__file__).parent.parent / "data" / "hf"

# fixture folder (named as the Hub repository) -> catalog name
PAIRS: dict[str, str] = json.loads((HF / "catalog.json").read_text())

# Fields that must agree between a config.json and its catalog entry (name and source differ).
SHAPE_FIELDS = (
    "num_layers", "hidden_size", "num_attention_heads", "num_kv_heads", "head_dim", "vocab_size",
    "max_seq_len", "norm", "mlp", "position", "tied_embeddings", "qkv_bias", "attn_out_bias",
    "mlp_bias", "norm_bias", "dropout", "moe", "fused_gate_up", "qk_norm",
    "norm_placement", "final_logit_softcap", "attn_logit_softcap", "sliding_window",
    "sliding_window_pattern", "mla", "norm_scale_fp32", "rope_keeps_dtype", "rope_per_layer_type",
    "nope_layer_interval", "rotary_dim", "parallel_block", "norm_centres_twice",
    "linear_attention", "attn_output_gate", "embeds_scaled_copy",
)


@pytest.mark.parametrize("folder", sorted(PAIRS))
def test_config_json_matches_catalog(folder: str) -> None:
    spec = spec_from_hf_config(HF / folder / "config.json")
    catalog = load_model(PAIRS[folder])
    assert spec.num_params == catalog.num_params
    for field in SHAPE_FIELDS:
        if field == "moe" and spec.moe is not None and catalog.moe is not None:
            # the experts' tensor layout is how transformers 5 builds them (stacked); the
            # mixtral-8x7b entry keeps one tensor per expert weight, as its estimates did
            same = {"stacked_experts"}
            assert (spec.moe.model_dump(exclude=same)
                    == catalog.moe.model_dump(exclude=same)), field
            continue
        assert getattr(spec, field) == getattr(catalog, field), field


def test_name_is_the_folder_and_source_names_the_file() -> None:
    path = HF / "Qwen2.5-7B" / "config.json"
    spec = spec_from_hf_config(path)
    assert spec.name == "Qwen2.5-7B"
    assert str(path) in spec.source


def test_load_model_accepts_a_folder_or_file() -> None:
    folder = HF / "gpt2"
    assert load_model(str(folder)).num_params == 124_439_808
    assert load_model(str(folder / "config.json")).name == "gpt2"


def test_family_specifics() -> None:
    qwen = spec_from_hf_config(HF / "Qwen2.5-7B" / "config.json")
    assert (qwen.qkv_bias, qwen.attn_out_bias, qwen.mlp_bias) == (True, False, False)
    gpt2 = spec_from_hf_config(HF / "gpt2" / "config.json")
    assert gpt2.tied_embeddings and gpt2.norm_bias and gpt2.ffn_hidden_size == 4 * 768
    assert gpt2.dropout == pytest.approx(0.1)
    mixtral = spec_from_hf_config(HF / "Mixtral-8x7B-v0.1" / "config.json")
    assert mixtral.moe is not None
    assert (mixtral.moe.num_experts, mixtral.moe.top_k) == (8, 2)
    assert not mixtral.moe.router_bias


def _write(tmp_path: Path, data: dict, stem: str = "config") -> Path:
    path = tmp_path / "m" / f"{stem}.json"
    path.parent.mkdir(exist_ok=True)
    path.write_text(json.dumps(data))
    return path


def _base(folder: str = "Meta-Llama-3-8B") -> dict:
    return json.loads((HF / folder / "config.json").read_text())


def _error(path: Path) -> str:
    with pytest.raises(MemplanError) as err:
        spec_from_hf_config(path)
    message = str(err.value)
    assert "\n" not in message
    assert str(path) in message
    return message


def test_llama_defaults(tmp_path: Path) -> None:
    """num_key_value_heads defaults to the head count, head_dim to hidden / heads."""
    data = _base("Llama-2-7b-hf")
    del data["num_key_value_heads"], data["tie_word_embeddings"]
    spec = spec_from_hf_config(_write(tmp_path, data))
    assert spec.num_kv_heads == 32 and spec.head_dim == 128 and not spec.tied_embeddings
    assert spec.num_params == 6_738_415_616


def test_explicit_head_dim_and_biases(tmp_path: Path) -> None:
    data = _base() | {"head_dim": 64, "attention_bias": True, "mlp_bias": True}
    spec = spec_from_hf_config(_write(tmp_path, data))
    assert spec.head_dim == 64 and spec.q_size == 2048
    assert spec.qkv_bias and spec.attn_out_bias and spec.mlp_bias


def test_name_is_the_stem_for_other_file_names(tmp_path: Path) -> None:
    assert spec_from_hf_config(_write(tmp_path, _base(), stem="my-model")).name == "my-model"


def test_malformed_json(tmp_path: Path) -> None:
    path = tmp_path / "config.json"
    path.write_text('{"model_type": "llama", ')
    _error(path)


def test_not_an_object(tmp_path: Path) -> None:
    path = tmp_path / "config.json"
    path.write_text("[1, 2]")
    assert "JSON object" in _error(path)


def test_missing_key(tmp_path: Path) -> None:
    data = _base()
    del data["num_hidden_layers"]
    assert "num_hidden_layers" in _error(_write(tmp_path, data))


def test_missing_model_type(tmp_path: Path) -> None:
    data = _base()
    del data["model_type"]
    assert "model_type" in _error(_write(tmp_path, data))


def test_unknown_model_type(tmp_path: Path) -> None:
    message = _error(_write(tmp_path, _base() | {"model_type": "mamba"}))
    assert "model_type" in message and "'mamba'" in message


@pytest.mark.parametrize(("key", "value"), [
    ("hidden_size", "4096"),
    ("hidden_size", 4096.0),
    ("num_hidden_layers", True),
    ("vocab_size", 0),
    ("tie_word_embeddings", "no"),
    ("hidden_act", "tanh"),
])
def test_wrong_value_is_named(tmp_path: Path, key: str, value: object) -> None:
    message = _error(_write(tmp_path, _base() | {key: value}))
    assert key in message and repr(value).strip("'") in message


def test_heads_not_dividing_hidden(tmp_path: Path) -> None:
    assert "num_attention_heads" in _error(_write(tmp_path, _base() | {"num_attention_heads": 30}))


def test_model_spec_validation_becomes_one_line(tmp_path: Path) -> None:
    """32 heads with 5 KV heads passes the reader but not ModelSpec's own check."""
    assert "num_kv_heads" in _error(_write(tmp_path, _base() | {"num_key_value_heads": 5}))


def test_mixtral_top_k_above_experts(tmp_path: Path) -> None:
    data = _base("Mixtral-8x7B-v0.1") | {"num_experts_per_tok": 9}
    assert "top_k" in _error(_write(tmp_path, data))


def test_gpt2_bad_dropout(tmp_path: Path) -> None:
    data = _base("gpt2") | {"resid_pdrop": "0.1"}
    assert "resid_pdrop" in _error(_write(tmp_path, data))


@pytest.mark.parametrize(("act", "impl"), [("gelu", "kernel"), ("gelu_pytorch_tanh", "kernel"),
                                           ("gelu_new", "gelu_new"), ("relu", "kernel")])
def test_gpt2_activation_names_map_to_what_transformers_runs(tmp_path: Path, act: str,
                                                            impl: str) -> None:
    """ACT2FN (transformers activations.py): gelu and gelu_pytorch_tanh are one kernel,
    gelu_new is NewGELUActivation's Python formula; other formulas are refused by name."""
    data = json.loads((HF / "gpt2" / "config.json").read_text())
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**data, "activation_function": act}))
    assert spec_from_hf_config(path).activation_impl.value == impl
    path.write_text(json.dumps({**data, "activation_function": "quick_gelu"}))
    with pytest.raises(MemplanError, match="activation_function.*quick_gelu"):
        spec_from_hf_config(path)


def test_gelu_new_saves_three_more_intermediates() -> None:
    """GPT-2 (its published config: gelu_new) at b 1, s 1024 in bf16: 12 layers, each saving
    3 more ffn-sized tensors (tanh output, 0.5*x, 1+tanh) than the fused GELU: T * 4h * 2 B
    each."""
    import memplan
    from memplan.overheads import no_overheads

    spec = spec_from_hf_config(HF / "gpt2" / "config.json")
    formula = memplan.estimate(spec, seq_len=1024, overheads=no_overheads()).worst
    kernel = memplan.estimate(spec.model_copy(update={"activation_impl": "kernel"}),
                              seq_len=1024, overheads=no_overheads()).worst
    assert formula.activations_bytes - kernel.activations_bytes == 12 * 3 * 1024 * 3072 * 2


# --- the families of memplan.hf.families ------------------------------------------------------

def test_new_family_specifics() -> None:
    """What each family's modeling code builds beyond Llama's layer (memplan.hf.families)."""
    def read(folder: str):
        return spec_from_hf_config(HF / folder / "config.json")

    qwen3 = read("Qwen3-8B")
    assert qwen3.qk_norm.value == "head" and not qwen3.qkv_bias
    qwen2_moe = read("Qwen1.5-MoE-A2.7B")
    assert qwen2_moe.qkv_bias and not qwen2_moe.attn_out_bias
    moe = qwen2_moe.moe
    assert moe is not None and moe.shared_expert_gate and moe.num_shared_experts == 1
    assert (moe.num_experts, moe.top_k, moe.shared_expert_ffn_hidden_size) == (60, 4, 5632)
    gemma2 = read("gemma-2-9b")
    assert gemma2.q_size == 4096 != gemma2.hidden_size and gemma2.tied_embeddings
    assert (gemma2.final_logit_softcap, gemma2.attn_logit_softcap) == (30.0, 50.0)
    assert [gemma2.is_sliding_layer(i) for i in range(4)] == [True, False, True, False]
    gemma3 = read("gemma-3-12b-pt")
    assert gemma3.vocab_size == 262208 and gemma3.head_dim == 256  # Gemma3TextConfig defaults
    assert [i for i in range(12) if not gemma3.is_sliding_layer(i)] == [5, 11]
    assert "vision tower is not counted" in gemma3.source
    phi3 = read("Phi-3-mini-4k-instruct")
    assert phi3.fused_qkv and phi3.fused_gate_up and phi3.sliding_window == 2047
    assert phi3.is_sliding_layer(0) and phi3.is_sliding_layer(31)
    olmo2 = read("OLMo-2-1124-7B")
    assert olmo2.norm_placement.value == "post" and olmo2.qk_norm.value == "full"
    # Olmo2RotaryEmbedding.forward returns fp32 tables; Olmo3RotaryEmbedding casts them
    assert olmo2.rope_tables_fp32 and not read("Olmo-3-1025-7B").rope_tables_fp32
    dsv3 = read("DeepSeek-V3")
    assert dsv3.mla is not None and dsv3.mla.q_lora_rank == 1536 and dsv3.head_dim == 192
    assert dsv3.moe is not None and dsv3.num_moe_layers == 58
    assert not dsv3.is_moe_layer(2) and dsv3.is_moe_layer(3)


def test_published_totals() -> None:
    """Parameter totals the publishers state: Phi-3-mini 3,821,079,552 (keras-hub's
    phi3_presets.py, ``params``), Gemma 2 9B 9,241,705,984; Qwen3-8B 8.2B of which 6.95B
    non-embedding (its model card: 8.19B less two 151936 x 4096 tables)."""
    assert load_model("phi-3-mini-4k").num_params == 3_821_079_552
    assert load_model("gemma-2-9b").num_params == 9_241_705_984
    qwen3 = load_model("qwen3-8b")
    assert round((qwen3.num_params - 2 * 151936 * 4096) / 1e9, 2) == 6.95


def test_qwen_sliding_layers_from_max_window_layers_are_refused(tmp_path: Path) -> None:
    """use_sliding_window slides the layers from max_window_layers on: no periodic pattern."""
    data = _base("Qwen3-8B") | {"use_sliding_window": True, "sliding_window": 4096,
                                 "max_window_layers": 28}
    assert "layer_types" in _error(_write(tmp_path, data))


def test_layer_types_read_and_checked(tmp_path: Path) -> None:
    types = ["sliding_attention", "sliding_attention", "full_attention"] * 14
    spec = spec_from_hf_config(_write(tmp_path, _base("gemma-2-9b") | {"layer_types": types}))
    assert spec.sliding_window_pattern == 3
    bad = ["full_attention", "sliding_attention"] * 21
    assert "layer_types" in _error(_write(tmp_path, _base("gemma-2-9b") | {"layer_types": bad}))
    assert "layer_types" in _error(_write(tmp_path, _base("gemma-2-9b") | {"layer_types": [1]}))


def test_moe_layout_refusals(tmp_path: Path) -> None:
    """Dense layers other than a leading run, zero experts, MLA with fewer KV heads."""
    base = _base("Qwen1.5-MoE-A2.7B")
    assert "mlp_only_layers" in _error(_write(tmp_path, base | {"mlp_only_layers": [3]}))
    spec = spec_from_hf_config(_write(tmp_path, base | {"mlp_only_layers": [1, 0]}))
    assert spec.moe is not None and spec.moe.first_dense_layers == 2 and spec.num_moe_layers == 22
    assert "num_experts" in _error(_write(tmp_path, base | {"num_experts": 0}))
    dsv3 = _base("DeepSeek-V3")
    assert "num_key_value_heads" in _error(_write(tmp_path, dsv3 | {"num_key_value_heads": 8}))
    assert "first_k_dense_replace" in _error(_write(tmp_path,
                                                    dsv3 | {"first_k_dense_replace": 61}))


def test_gemma3_needs_its_text_config(tmp_path: Path) -> None:
    data = _base("gemma-3-12b-pt")
    del data["text_config"]
    assert "text_config" in _error(_write(tmp_path, data))


def test_phi3_partial_rotary(tmp_path: Path) -> None:
    """Phi-3-mini's head_dim 96 (3072 / 32): a factor of 0.5 rotates int(96 * 0.5) = 48
    dimensions (Phi3RotaryEmbedding), rope_parameters' own 0.25 wins over the top-level
    one (Phi3Config.convert_rope_params_to_dict: setdefault): int(96 * 0.25) = 24; a factor
    that rotates nothing (int(96 * 0.01) = 0) or is out of (0, 1] is refused by name."""
    data = _base("Phi-3-mini-4k-instruct")
    assert load_model(str(_write(tmp_path, data | {"partial_rotary_factor": 0.5}))).rope_dim == 48
    nested = data | {"partial_rotary_factor": 0.5,
                     "rope_parameters": {"rope_type": "default", "partial_rotary_factor": 0.25}}
    assert load_model(str(_write(tmp_path, nested))).rotary_dim == 24
    assert load_model(str(_write(tmp_path, data | {"partial_rotary_factor": 1.0}))).rotary_dim is None
    for bad in (0.01, 1.5, 0.0):
        assert "partial_rotary_factor" in _error(_write(tmp_path, data | {
            "partial_rotary_factor": bad}))


def test_eager_softmax_dtype_is_the_familys() -> None:
    """transformers 5.3's eager_attention_forward: GPT-2's runs softmax(attn_weights) in the
    scores' dtype (models/gpt2/modeling_gpt2.py), Llama's and the families built on it
    softmax(..., dtype=torch.float32).to(query.dtype) (models/llama/modeling_llama.py, and
    each of memplan.hf.families' modules). The hf preset reads the family's."""
    import memplan

    assert not spec_from_hf_config(HF / "gpt2" / "config.json").eager_softmax_fp32
    for folder in ("Meta-Llama-3-8B", "Mistral-7B-v0.1", "Qwen2.5-7B", "Qwen3-8B",
                   "gemma-2-9b", "Phi-3-mini-4k-instruct", "OLMo-2-1124-7B", "DeepSeek-V3"):
        assert spec_from_hf_config(HF / folder / "config.json").eager_softmax_fp32, folder
    gpt2 = memplan.estimate(spec_from_hf_config(HF / "gpt2" / "config.json"), framework="hf",
                            attention="eager")
    assert not gpt2.workload.softmax_fp32
    assert memplan.estimate("gpt2", framework="hf").workload.softmax_fp32 is False
    assert memplan.estimate("llama-3-8b", framework="hf").workload.softmax_fp32 is True


def test_gpt2_eager_softmax_in_bf16_saves_two_bytes_less_per_score() -> None:
    """GPT-2 (published config: dropout 0.1) in bf16 with eager attention at b 1, s 1024, hf
    preset: its softmax output, which softmax's backward saves, is bf16 (2 B per score)
    where an fp32 softmax saves 4 B; dropout's bool mask and its bf16 output (the value
    matmul's input) are saved either way. 12 layers x 12 heads x 1024^2 scores x 2 B."""
    import memplan
    from memplan.overheads import no_overheads

    spec = spec_from_hf_config(HF / "gpt2" / "config.json")

    def activations(s) -> int:
        return memplan.estimate(s, seq_len=1024, framework="hf", attention="eager",
                                precision="bf16-pure",
                                overheads=no_overheads()).worst.activations_bytes

    upcast = activations(spec.model_copy(update={"eager_softmax_fp32": True}))
    assert upcast - activations(spec) == 12 * 12 * 1024 * 1024 * 2


def test_gelu_new_under_autocast_saves_fp32_tensors() -> None:
    """GPT-2 (gelu_new) under amp-bf16 at b 1, s 1024: on CUDA autocast runs pow in fp32
    (AT_FORALL_FP32), so the formula saves an fp32 cast of x (4 B), tanh's fp32 output (4),
    0.5 * x in bf16 (2) and the fp32 1 + tanh (4); the fp32 product is cast to bf16 for the
    down projection, which saves the cast (2): 16 B per ffn element where one GELU kernel
    saves its bf16 input and output (4): 12 B more, x 12 layers x 1024 tokens x 3072."""
    import memplan
    from memplan.overheads import no_overheads

    spec = spec_from_hf_config(HF / "gpt2" / "config.json")

    def activations(s) -> int:
        return memplan.estimate(s, seq_len=1024, precision="amp-bf16",
                                overheads=no_overheads()).worst.activations_bytes

    kernel = spec.model_copy(update={"activation_impl": "kernel"})
    assert activations(spec) - activations(kernel) == 12 * 1024 * 3072 * 12


@pytest.mark.parametrize("act", ["gelu_new", "gelu_fast", "gelu_python_tanh", "quick_gelu"])
def test_gated_python_formula_activations_are_refused(tmp_path: Path, act: str) -> None:
    """A gated MLP runs ACT2FN[hidden_act]: gelu and gelu_pytorch_tanh (and silu) are one
    kernel each; the Python formulas save other tensors in other dtypes, modelled for GPT-2's
    plain MLP only, so a Llama-style or Gemma config naming one is refused by name."""
    for folder, key in (("Meta-Llama-3-8B", "hidden_act"), ("gemma-2-9b", "hidden_activation")):
        data = json.loads((HF / folder / "config.json").read_text())
        path = tmp_path / "config.json"
        path.write_text(json.dumps({**data, key: act}))
        with pytest.raises(MemplanError, match=f"{key}.*{act}"):
            spec_from_hf_config(path)
    data = json.loads((HF / "Meta-Llama-3-8B" / "config.json").read_text())
    path.write_text(json.dumps({**data, "hidden_act": "gelu_pytorch_tanh"}))
    assert spec_from_hf_config(path).mlp.value == "geglu"


@pytest.mark.parametrize("precision", ["bf16-pure", "amp-bf16"])
def test_gpt2_cache_pins_the_fused_projection(precision: str) -> None:
    """GPT-2 (published config: use_cache) at b 1, s 1024, hf preset: DynamicLayer.update
    copies K and V into the cache (torch.cat) and SDPA saves the copies, while q, a view of
    c_attn's fused output, keeps all of that output alive, its K and V thirds too: 2 x 1024
    tokens x 768 x 2 B more per layer than without the cache, x 12 layers. Under autocast
    c_attn's output (addmm) and so the copies are bf16 as well."""
    import memplan
    from memplan.overheads import no_overheads

    spec = spec_from_hf_config(HF / "gpt2" / "config.json")

    def activations(kv_cache: bool) -> int:
        return memplan.estimate(spec, seq_len=1024, framework="hf", precision=precision,
                                kv_cache=kv_cache,
                                overheads=no_overheads()).worst.activations_bytes

    assert activations(True) - activations(False) == 12 * 2 * 1024 * 768 * 2


def test_use_cache_is_the_configs(tmp_path: Path) -> None:
    """transformers builds a DynamicCache in training when the config's use_cache is on
    (LlamaModel.forward), every configuration class's default: the hf preset's kv_cache
    follows the file (absent: on), and --no-use-cache / kv_cache=False still wins."""
    import memplan

    data = json.loads((HF / "Meta-Llama-3-8B" / "config.json").read_text())
    path = tmp_path / "config.json"
    for given, expected in ((None, True), (True, True), (False, False)):
        body = {k: v for k, v in data.items() if k != "use_cache"}
        if given is not None:
            body["use_cache"] = given
        path.write_text(json.dumps(body))
        spec = spec_from_hf_config(path)
        assert spec.use_cache is expected
        assert memplan.estimate(spec, framework="hf").workload.kv_cache is expected
    assert memplan.estimate(spec_from_hf_config(HF / "Meta-Llama-3-8B" / "config.json"),
                            framework="hf", kv_cache=False).workload.kv_cache is False


def test_mistral_and_mixtral_sliding_window(tmp_path: Path) -> None:
    """Every Mistral / Mixtral layer attends within config.sliding_window
    (MistralAttention.forward passes it on); absent, the configuration class's default
    (MistralConfig 4096, MixtralConfig None); null: none."""
    mistral = _base("Mistral-7B-v0.1")
    spec = spec_from_hf_config(HF / "Mistral-7B-v0.1" / "config.json")
    assert spec.sliding_window == 4096 and spec.is_sliding_layer(0) and spec.is_sliding_layer(31)
    absent = {k: v for k, v in mistral.items() if k != "sliding_window"}
    assert spec_from_hf_config(_write(tmp_path, absent)).sliding_window == 4096
    assert spec_from_hf_config(_write(tmp_path, mistral | {"sliding_window": None})) \
        .sliding_window is None
    assert spec_from_hf_config(HF / "Mixtral-8x7B-v0.1" / "config.json").sliding_window is None
    mixtral = {k: v for k, v in _base("Mixtral-8x7B-v0.1").items() if k != "sliding_window"}
    assert spec_from_hf_config(_write(tmp_path, mixtral)).sliding_window is None
    assert spec_from_hf_config(_write(tmp_path, mixtral | {"sliding_window": 512})) \
        .sliding_window == 512


# Mistral-7B-v0.1 narrowed as tests/traced/test_frameworks.py's mistral-window cases trace it
MISTRAL_TOY = dict(num_hidden_layers=2, hidden_size=256, intermediate_size=896,
                   num_attention_heads=8, num_key_value_heads=2, head_dim=32, vocab_size=64)


def _mistral_saved(window: int, recompute: str) -> int:
    from memplan.api import estimate
    from memplan.spec import spec_from_hf_dict

    spec = spec_from_hf_dict(_base("Mistral-7B-v0.1") | MISTRAL_TOY | {"sliding_window": window},
                             "toy", "mistral-toy")
    est = estimate(spec, framework="hf", micro_batch_size=2, seq_len=1024,
                   precision="bf16-pure", attention="flash", recompute=recompute)
    return est.stages[0].activations_bytes


def test_mistral_window_mask_bytes_by_hand() -> None:
    """2 sequences of s = 1,024 tokens in bf16, 8 query heads / 2 key-value heads of 32, 2
    layers; a 256-token window (an explicit mask: s >= window) against a 2,048-token one
    (masking_utils.py _ignore_causal_mask_sdpa: no mask, the generic layer).

    Full recompute: each checkpointed layer's inputs are kept, among them the boolean mask
    MistralModel.forward builds once (create_sliding_window_causal_mask -> sdpa_mask: the
    window's function on (1, 1, s, 1) and (1, 1, 1, s) positions, expanded to the batch):
    s * s = 1,048,576 B, once for both layers.

    No recompute, per layer: SDPA's copy of the mask in the query's dtype
    (convert_boolean_attn_mask: the expanded (b, 1, s, s)) b * s * s * 2 = 4,194,304 B, and
    K and V saved at the query width (integrations/sdpa_attention.py repeat_kv: no enable_gqa
    with a mask), 2 * b * s * (8 - 2) * 32 * 2 = 1,572,864 B more; 5,767,168 B a layer,
    11,534,336 B for two (traced: 67,969,032 - 56,434,696 B, the same difference)."""
    assert _mistral_saved(256, "full") - _mistral_saved(2048, "full") == 1_048_576
    assert _mistral_saved(256, "none") - _mistral_saved(2048, "none") == 11_534_336


def test_gemma3_rope_tables_per_layer_type() -> None:
    """Gemma3TextModel.forward keeps one pair of cos/sin tables per layer type (sliding,
    full): at 128 tokens, head_dim 96, bf16: 2 pairs x 2 tables x 128 x 96 x 2 B = 98,304 B;
    Gemma 2 (one rotary embedding) and a Gemma 3 without full layers (pattern 0) one pair."""
    from memplan.api import make_layout, make_workload
    from memplan.model.attention import rope_terms
    from memplan.model.dims import Dims
    from memplan.spec import spec_from_hf_dict

    toy = {"num_hidden_layers": 3, "hidden_size": 256, "intermediate_size": 768,
           "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 96,
           "vocab_size": 1000, "sliding_window": 64, "sliding_window_pattern": 3,
           "rope_scaling": None}

    def rope(folder: str, **update) -> int:
        spec = spec_from_hf_dict(_base(folder).get("text_config", _base(folder)) | toy | update,
                                 "toy", "toy")
        wl = make_workload(spec, seq_len=128, micro_batch_size=2, precision="bf16-pure")
        return sum(t.size_bytes for t in rope_terms(spec, wl, Dims.of(spec, make_layout(1), wl)))

    assert rope("gemma-3-12b-pt") == 98_304
    assert rope("gemma-3-12b-pt", layer_types=["sliding_attention"] * 3) == 49_152
    assert rope("gemma-2-9b") == 49_152


def test_fused_gate_up_checkpointed_working_set_by_hand() -> None:
    """Phi3MLP.forward under full recompute (nothing saved): gate_up_proj's output (T x 2f)
    stays alive through the function (``gate`` a view of it) beside the activation and the
    product: 4 x T x f x e. Phi-3 narrowed (h 256, f 768), 2 x 128 tokens, fp32: inner =
    256 x 768 x 4 = 786,432 B, so 3,145,728 B (3 x inner + the down projection's 262,144 B
    output is less); traced: the first forward 785,536 B under with 3 x inner (-6.4%),
    within 0.01% with 4."""
    from memplan.api import make_layout, make_workload
    from memplan.model.dims import Dims
    from memplan.model.mlp import Mlp
    from memplan.spec import spec_from_hf_dict

    toy = {"num_hidden_layers": 2, "hidden_size": 256, "intermediate_size": 768,
           "num_attention_heads": 8, "num_key_value_heads": 2, "vocab_size": 1000}
    spec = spec_from_hf_dict(_base("Phi-3-mini-4k-instruct") | toy, "toy", "phi3-toy")
    assert spec.fused_gate_up
    wl = make_workload(spec, seq_len=128, micro_batch_size=2, precision="fp32",
                       recompute="full")
    moments = Mlp().working_set(spec, wl, Dims.of(spec, make_layout(1), wl))
    assert [(m.name, m.transient_bytes) for m in moments] == [("mlp", 3_145_728)]


def test_qwen2_moe_builds_a_window_mask_no_layer_reads() -> None:
    """Qwen2MoeModel.forward fills causal_mask_mapping with create_sliding_window_causal_mask
    on every call; with use_sliding_window off its config's window is 0, so
    _ignore_causal_mask_sdpa never skips it and no layer reads it. At 2 x s = 1,024 tokens:
    SDPA's boolean mask (1, 1, s, s) = 1,048,576 B; eager attention's additive one, one per
    sequence (eager_mask: torch.where over the expanded boolean) in bf16, 2 x s x s x 2 =
    4,194,304 B. Alive through the forward until the model's forward returns: the
    forward peak grows by it, the saved activations do not (no checkpoint keeps it), and a
    framework that builds no mask (torchtitan) has none."""
    from memplan.api import estimate
    from memplan.spec import spec_from_hf_dict

    toy = _base("Qwen1.5-MoE-A2.7B") | {"num_hidden_layers": 2, "hidden_size": 128,
                                         "intermediate_size": 256, "num_attention_heads": 4,
                                         "num_key_value_heads": 2, "num_experts": 4,
                                         "num_experts_per_tok": 2, "moe_intermediate_size": 64,
                                         "shared_expert_intermediate_size": 128,
                                         "vocab_size": 64}
    spec = spec_from_hf_dict(toy, "toy", "qwen2-moe-toy")
    assert spec.window_mask_always and spec.sliding_window is None
    plain = spec.model_copy(update={"window_mask_always": False})

    def stage(s, framework: str, attention: str, recompute: str):
        return estimate(s, framework=framework, micro_batch_size=2, seq_len=1024,
                        precision="bf16-pure", attention=attention,
                        recompute=recompute).stages[0]

    for recompute in ("none", "full"):
        for attention, mask in (("flash", 1_048_576), ("eager", 4_194_304)):
            with_mask, without = (stage(s, "hf", attention, recompute) for s in (spec, plain))
            assert with_mask.steady.forward - without.steady.forward == mask
            assert with_mask.first_step.forward - without.first_step.forward == mask
            assert with_mask.activations_bytes == without.activations_bytes
    titan = stage(spec, "torchtitan", "flash", "none"), stage(plain, "torchtitan", "flash", "none")
    assert titan[0].steady.forward == titan[1].steady.forward


def _eager_llama(**fields):
    from memplan.api import resolve
    from memplan.model.dims import Dims
    from memplan.spec import spec_from_hf_dict

    spec = spec_from_hf_dict(_base("Meta-Llama-3-8B") | {
        "num_hidden_layers": 2, "hidden_size": 256, "intermediate_size": 896,
        "num_attention_heads": 8, "num_key_value_heads": 2, "vocab_size": 1000},
        "toy", "llama-toy")
    fields = {"attention": "eager", **fields}
    _, par, wl = resolve(spec, gpus=1, framework="hf", micro_batch_size=2, seq_len=1024,
                         precision="bf16-pure", **fields)
    return spec, wl, Dims.of(spec, par, wl)


def test_transformers_eager_mask_is_one_per_sequence() -> None:
    """masking_utils.py eager_mask: torch.where over sdpa_mask's boolean mask expanded to
    (b, 1, s, s), so the additive mask is b x s x s in the embedding's dtype: 2 x 1,024 x
    1,024 x 2 = 4,194,304 B in bf16, where one (s, s) table is 2,097,152 B. Under full
    recompute every checkpointed layer takes it as an input: saved once."""
    from memplan.model.attention import eager_mask_bytes, mask_terms

    spec, wl, dm = _eager_llama(recompute="full")
    assert wl.mask_per_sequence and eager_mask_bytes(wl, dm) == 4_194_304
    assert [t.size_bytes for t in mask_terms(spec, wl, dm)] == [4_194_304]
    plain = wl.model_copy(update={"mask_per_sequence": False})
    assert eager_mask_bytes(plain, dm) == 2_097_152


def test_mistral_builds_the_window_mask_alone() -> None:
    """MistralModel.forward (and Mixtral's, Phi-3's, Ministral 3's): ``mask_function =
    create_causal_mask if config.sliding_window is None else
    create_sliding_window_causal_mask``, one mask for every layer. Eager, that mask is the
    additive (b, 1, s, s_kv) table: 2 x 1,024 x 1,024 x 2 = 4,194,304 B in bf16, saved once
    under full recompute, and no causal mask beside it (before: both, 8,388,608 B). Qwen3's
    causal_mask_mapping builds both (one layer of two sliding here): there both stay."""
    from memplan.api import resolve
    from memplan.model.attention import mask_terms, window_mask_terms
    from memplan.model.dims import Dims
    from memplan.spec import spec_from_hf_dict

    def saved(folder: str, **more) -> list[int]:
        spec = spec_from_hf_dict(_base(folder) | {
            "num_hidden_layers": 2, "hidden_size": 256, "intermediate_size": 896,
            "num_attention_heads": 8, "num_key_value_heads": 2, "vocab_size": 1000,
            "sliding_window": 512, **more}, "toy", "toy")
        _, par, wl = resolve(spec, gpus=1, framework="hf", micro_batch_size=2, seq_len=1024,
                             precision="bf16-pure", attention="eager", recompute="full")
        dm = Dims.of(spec, par, wl)
        return [t.size_bytes for t in mask_terms(spec, wl, dm) + window_mask_terms(spec, wl, dm)]

    assert saved("Mistral-7B-v0.1") == [4_194_304]
    assert saved("Qwen3-8B", use_sliding_window=True,
                 layer_types=["sliding_attention", "full_attention"]) == [4_194_304, 4_194_304]


def test_eager_weights_outlive_the_attention_in_a_checkpointed_layer() -> None:
    """LlamaDecoderLayer.forward: hidden_states, _ = self.self_attn(...) keeps what
    eager_attention_forward returns beside the output, its probabilities (2 x 8 heads x
    1,024 x 1,024 x 2 B = 33,554,432 B in bf16), until the layer returns: under full recompute
    every moment after the attention (the MLP's norm and the MLP) holds them, the attention's
    own do not. SDPA returns none."""
    from memplan.model.layer import forward_moments
    from memplan.workload import Recompute

    def moments(**fields):
        spec, wl, dm = _eager_llama(recompute="full", **fields)
        return [(m.block, m.alive_bytes + m.transient_bytes) for m in
                forward_moments(spec, wl, dm, moe_layer=False, recompute=Recompute.FULL)]

    held, plain = moments(), moments(attn_weights_held=False)
    diff = {(block, a - b) for (block, a), (_, b) in zip(held, plain, strict=True)}
    assert diff == {("attn_norm", 0), ("attn", 0), ("mlp_norm", 33_554_432),
                    ("mlp", 33_554_432)}
    assert moments(attention="flash") == moments(attention="flash", attn_weights_held=False)


def test_fp32_softmax_on_bf16_scores_copies_them_first() -> None:
    """A checkpointed eager core in bf16 with transformers' softmax(dtype=float32): at the
    softmax the masked bf16 scores, their fp32 copy (softmax converts its input first) and
    the fp32 output. 2 x 8 heads x 1,024 x 1,024 = 16,777,216 scores: 33,554,432 B in bf16,
    67,108,864 B in fp32; beside K and V repeated to the 8 query heads (2 x 1,048,576 B):
    2,097,152 + 33,554,432 + 2 x 67,108,864 = 169,869,312 B, above the first matmul's
    (39,845,888 B) and the value matmul's (137,363,456 B) moments."""
    from memplan.model import eager

    spec, wl, dm = _eager_llama(recompute="full")
    c = eager.core(spec, dm, wl.softmax_fp32)
    assert (c.scores, c.masked, c.sm) == (33_554_432, 33_554_432, 67_108_864)
    assert eager.forward_checkpointed(c) == 169_869_312


def test_olmo2_rope_tables_in_fp32() -> None:
    """OLMo 2 7B in bf16 (heads of 128) at 1 x 4,096 tokens, recompute full: the cos and sin
    tables the checkpointed layers keep are fp32, 2 x 4,096 x 128 x 4 B = 4,194,304 B
    (Llama's, cast to bf16, would be half)."""
    from memplan import api

    spec = spec_from_hf_config(HF / "OLMo-2-1124-7B" / "config.json")
    est = api.estimate(spec, seq_len=4096, precision="bf16-pure", recompute="full")
    terms = {t.name: t.size_bytes for t in est.stages[0].activation_terms}
    assert terms["rope.cos_sin"] == 4_194_304

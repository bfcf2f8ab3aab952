"""Translate a Hugging Face style ``config.json`` into the fields of a ``ModelSpec``.

A dict translator: ``memplan.spec`` reads the file and validates the fields it returns.

The file is read as JSON data only: no ``transformers`` import, no ``trust_remote_code``, no
network. The translators of llama, mistral, mixtral, qwen2 and gpt2 are here, those of the other
families in ``memplan.hf.families``, which dispatches on ``model_type``
(``memplan.hf.families.spec_fields``). Only families whose field names and conventions are
known are accepted; anything else is refused rather than guessed at, because
a silently wrong parameter count would make every memory figure downstream wrong.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from memplan.errors import MemplanError

_MISSING = object()



class ConfigKeys:
    """Typed access to the JSON object, with errors that name the file, the key and the value."""

    def __init__(self, data: dict[str, Any], where: str) -> None:
        self.data = data
        self.where = where

    def error(self, key: str, problem: str) -> MemplanError:
        return MemplanError(f"{self.where}: {key}: {problem}")

    def _get(self, key: str, default: Any) -> Any:
        # JSON null means "use the default" in HF configs (e.g. "n_inner": null).
        value = self.data.get(key)
        if value is None:
            if default is _MISSING:
                raise self.error(key, "required key is missing (or null)")
            return default
        return value

    def get_int(self, key: str, default: Any = _MISSING) -> int:
        value = self._get(key, default)
        # bool is an int subclass in Python; `true` is never a valid width.
        if isinstance(value, bool) or not isinstance(value, int):
            raise self.error(key, f"expected a positive integer, got {value!r}")
        if value <= 0:
            raise self.error(key, f"expected a positive integer, got {value}")
        return value

    def get_bool(self, key: str, default: bool) -> bool:
        value = self._get(key, default)
        if not isinstance(value, bool):
            raise self.error(key, f"expected true or false, got {value!r}")
        return value

    def get_float(self, key: str, default: float) -> float:
        value = self._get(key, default)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise self.error(key, f"expected a number, got {value!r}")
        return float(value)

    def get_str(self, key: str, default: Any = _MISSING) -> str:
        value = self._get(key, default)
        if not isinstance(value, str):
            raise self.error(key, f"expected a string, got {value!r}")
        return value


def _head_dim(cfg: ConfigKeys, hidden: int, heads: int, heads_key: str) -> int:
    """hidden / heads, refusing a remainder rather than silently rounding it away."""
    if hidden % heads:
        raise cfg.error(heads_key, f"{heads} does not divide hidden size {hidden} "
                                   "and no head_dim is given")
    return hidden // heads


# transformers' ACT2FN (activations.py): the names that run one aten kernel (GELUActivation:
# F.gelu; GELUTanh: F.gelu(approximate="tanh"); SiLUActivation and nn.SiLU: F.silu)
_KERNEL_GELU = ("gelu", "gelu_pytorch_tanh")
_KERNEL_SILU = ("silu", "swish")
KERNEL_ACTIVATIONS = _KERNEL_SILU + _KERNEL_GELU


def gated_act(cfg: ConfigKeys, key: str, default: str) -> str:
    """The gated MLP kind of an activation name: one aten kernel (``_KERNEL_SILU``,
    ``_KERNEL_GELU``). ACT2FN's Python formulas (gelu_new, gelu_fast, gelu_python_tanh, ...)
    save other tensors in other dtypes (``memplan.model.mlp.gelu_new_saved``), modelled in
    GPT-2's plain MLP only: refused by name here."""
    act = cfg.get_str(key, default).lower()
    if act in _KERNEL_SILU:
        return "swiglu"
    if act in _KERNEL_GELU:
        return "geglu"
    raise cfg.error(key, f"unsupported activation {act!r} for a gated MLP: modelled are "
                         f"{', '.join(_KERNEL_SILU + _KERNEL_GELU)} (one kernel each); "
                         "transformers' Python-formula activations are not")


def gated_mlp(cfg: ConfigKeys) -> str:
    return gated_act(cfg, "hidden_act", "silu")


def _plain_mlp(cfg: ConfigKeys) -> tuple[str, str]:
    """(MLP kind, activation implementation) of a GPT-2-style ``activation_function``."""
    act = cfg.get_str("activation_function", "gelu_new").lower()
    if act in _KERNEL_GELU:
        return "gelu", "kernel"
    if act == "gelu_new":
        return "gelu", "gelu_new"
    if act == "relu":
        return "relu", "kernel"
    raise cfg.error("activation_function",
                    f"unsupported activation {act!r}: modelled are gelu, gelu_pytorch_tanh "
                    "(one kernel), gelu_new (transformers' Python formula) and relu")


def llama_fields(cfg: ConfigKeys, *, head_dim_default: int | None, tie_default: bool,
                 bias: bool = True, defaults: dict[str, int] | None = None) -> dict[str, Any]:
    """The fields every Llama-style config names alike. ``head_dim`` is read when given, else
    ``head_dim_default`` (the family's configuration class default), else hidden / heads.
    ``bias``: ``attention_bias`` covers q, k, v and o (Llama's); otherwise the caller sets
    the biases. ``defaults``: the configuration class's defaults of vocab_size and
    max_position_embeddings (else both are required)."""
    given = defaults or {}
    hidden = cfg.get_int("hidden_size")
    heads = cfg.get_int("num_attention_heads")
    if cfg.data.get("head_dim") is not None:
        head_dim = cfg.get_int("head_dim")
    elif head_dim_default is not None:
        head_dim = head_dim_default
    else:
        head_dim = _head_dim(cfg, hidden, heads, "num_attention_heads")
    attention_bias = cfg.get_bool("attention_bias", False) if bias else False
    return {
        "num_layers": cfg.get_int("num_hidden_layers"),
        "hidden_size": hidden,
        "ffn_hidden_size": cfg.get_int("intermediate_size"),
        "num_attention_heads": heads,
        "num_kv_heads": cfg.get_int("num_key_value_heads", heads),
        # Some models (e.g. Mistral-Nemo) set head_dim so that heads * head_dim != hidden.
        "head_dim": head_dim,
        "vocab_size": cfg.get_int("vocab_size", given.get("vocab_size", _MISSING)),
        "max_seq_len": cfg.get_int("max_position_embeddings",
                                   given.get("max_position_embeddings", _MISSING)),
        "norm": "rmsnorm",
        "mlp": gated_mlp(cfg),
        "position": "rope",
        "tied_embeddings": cfg.get_bool("tie_word_embeddings", tie_default),
        "qkv_bias": attention_bias,
        "attn_out_bias": attention_bias,
        "mlp_bias": cfg.get_bool("mlp_bias", False),
    }


# the configuration classes' sliding_window default (transformers 5.3:
# models/mistral/configuration_mistral.py MistralConfig.__init__ 4096,
# models/mixtral/configuration_mixtral.py MixtralConfig.__init__ None)
MISTRAL_WINDOW: dict[str, int | None] = {"mistral": 4096, "mixtral": None}


def mistral_window(cfg: ConfigKeys, default: int | None) -> dict[str, Any]:
    """Mistral's and Mixtral's sliding window: every layer's (MistralAttention.forward passes
    ``sliding_window=config.sliding_window`` to the attention; MistralModel.forward builds
    create_sliding_window_causal_mask when it is set, in place of the causal mask:
    ``window_mask_alone``); null: none, absent: the class's default."""
    if "sliding_window" not in cfg.data:
        window = default
    else:
        window = None if cfg.data["sliding_window"] is None else cfg.get_int("sliding_window")
    return {} if window is None else {"sliding_window": window, "sliding_window_pattern": 0,
                                      "window_mask_alone": True}


def llama_like(cfg: ConfigKeys, model_type: str) -> dict[str, Any]:
    # Llama's attention_bias covers q, k, v and o. Qwen2's q/k/v bias is hard-wired in its
    # modeling code (no config field) and its o_proj never has one.
    # transformers defaults tie_word_embeddings to False for all four families.
    fields = llama_fields(cfg, head_dim_default=None, tie_default=False)
    if model_type == "qwen2":
        fields.update(qkv_bias=True, attn_out_bias=False)
    if model_type in MISTRAL_WINDOW:
        fields.update(mistral_window(cfg, MISTRAL_WINDOW[model_type]))
    if model_type == "mixtral":
        # Mixtral's intermediate_size is the expert width; every layer is MoE and the router
        # (gate) is a bias-free linear layer; transformers 5 stacks the experts' weights
        # (models/mixtral/modeling_mixtral.py MixtralExperts: gate_up_proj, down_proj)
        fields["moe"] = {
            "num_experts": cfg.get_int("num_local_experts"),
            "top_k": cfg.get_int("num_experts_per_tok"),
            "expert_ffn_hidden_size": fields["ffn_hidden_size"],
            "router_bias": False,
            "stacked_experts": True,
        }
    return fields


def gpt2(cfg: ConfigKeys) -> dict[str, Any]:
    hidden = cfg.get_int("n_embd")
    heads = cfg.get_int("n_head")
    # One dropout rate stands for all of them; the largest is the safe (conservative) choice.
    dropout = max(cfg.get_float(k, 0.1) for k in ("resid_pdrop", "attn_pdrop", "embd_pdrop"))
    return {
        "num_layers": cfg.get_int("n_layer"),
        "hidden_size": hidden,
        "ffn_hidden_size": cfg.get_int("n_inner", 4 * hidden),
        "num_attention_heads": heads,
        "num_kv_heads": heads,
        "head_dim": _head_dim(cfg, hidden, heads, "n_head"),
        "vocab_size": cfg.get_int("vocab_size"),
        "max_seq_len": cfg.get_int("n_positions"),
        "norm": "layernorm",
        "norm_bias": True,
        "mlp": _plain_mlp(cfg)[0],
        "activation_impl": _plain_mlp(cfg)[1],
        "position": "learned",
        "tied_embeddings": cfg.get_bool("tie_word_embeddings", True),
        "qkv_bias": True,
        "fused_qkv": True,  # GPT2Attention's Conv1D c_attn
        "attn_out_bias": True,
        "mlp_bias": True,
        "dropout": dropout,
        # eager_attention_forward: softmax(attn_weights, dim=-1), no upcast
        "eager_softmax_fp32": False,
    }


def model_name(path: Path) -> str:
    """The model's name for a config file: a checkpoint folder is named after the model; the
    file itself is always "config.json"."""
    if path.name == "config.json" and path.parent.name:
        return path.parent.name
    return path.stem


FULL, SLIDING = "full_attention", "sliding_attention"


def _layer_types(cfg: ConfigKeys, num_layers: int, default: list[str]) -> list[str]:
    """``layer_types`` as the file gives it (transformers 5 writes it), else the family's
    rule (``default``)."""
    types = cfg.data.get("layer_types")
    if types is None:
        return default
    if (not isinstance(types, list) or len(types) != num_layers
            or any(t not in (FULL, SLIDING) for t in types)):
        raise cfg.error("layer_types", f"expected {num_layers} entries of {FULL!r} or "
                                       f"{SLIDING!r}, got {types!r}")
    return types


def sliding_fields(cfg: ConfigKeys, types: list[str], window: int | None) -> dict[str, Any]:
    """``sliding_window`` and ``sliding_window_pattern`` of a list of layer types: every layer
    sliding (pattern 0) or every n-th full (pattern n); anything else is refused."""
    if window is None or SLIDING not in types:
        return {}
    if FULL not in types:
        return {"sliding_window": window, "sliding_window_pattern": 0}
    n = types.index(FULL) + 1
    if any((t == FULL) != (i % n == n - 1) for i, t in enumerate(types)):
        raise cfg.error("layer_types", "only every layer sliding or every n-th layer full "
                                       f"attention is modelled, got {types!r}")
    return {"sliding_window": window, "sliding_window_pattern": n}

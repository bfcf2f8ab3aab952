"""megatron-core's MoE layer traced on CPU: what its routed experts save, against memplan's
``loop`` MoE terms (the implementation the megatron preset runs today).

megatron-core 0.16.1's ``MoELayer`` (local layer spec: the allgather token dispatcher,
``SequentialMLP`` experts, no bias, non-gated GeLU without the bias-activation fusion, the
router in fp32 as ``--moe-router-dtype fp32``) on a one-rank gloo group, its saved tensors
collected by storage through ``torch.autograd.graph.saved_tensors_hooks``. Per expert it
keeps fc1's output (saved by the activation), the activation's output (saved by its product
with the routing probabilities) and that product cast back (saved by fc2): three
[rows, ffn] tensors, as ``TEGroupedMLP.forward``'s ``bias_act_func`` does with
``--moe-grouped-gemm`` (megatron/core/transformer/moe/experts.py); the unpermute's
``scatter_add_`` saves its index only (moe_utils.py ``unpermute`` without probs), so no
expert output and no weighted output are kept. memplan's loop keeps two [rows, ffn] tensors
and both [rows, h] ones: the totals differ by rows * (ffn - 2h) * 2 bytes, nothing where the
expert FFN is 2h (the held-out Megatron MoE runs' 1024 = 2 * 512).
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("megatron.core")

from memplan.api import make_layout, make_workload  # noqa: E402
from memplan.model.dims import Dims, total  # noqa: E402
from memplan.model.moe import moe_terms  # noqa: E402
from memplan.profile.megatron_model import megatron_group, megatron_on_cpu  # noqa: E402
from memplan.spec import ModelSpec, load_model  # noqa: E402

H, FFN, EXPERTS, TOP_K, S, B = 64, 128, 8, 2, 64, 2


def _saved_activations() -> int:
    """Bytes of the storages the MoE layer's autograd graph saves, its weights and its input
    left out."""
    import torch.nn.functional as F
    import megatron.core.transformer.moe.moe_utils as moe_utils
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.spec_utils import build_module
    from megatron.core.transformer.transformer_config import TransformerConfig

    # RouterGatingLinearFunction reads Transformer Engine's GEMM, a name 0.16.1 leaves
    # undefined without Transformer Engine; None is its own fallback to torch's matmul
    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None
    config = TransformerConfig(
        num_layers=1, hidden_size=H, num_attention_heads=4, num_moe_experts=EXPERTS,
        moe_router_topk=TOP_K, moe_ffn_hidden_size=FFN, add_bias_linear=False,
        moe_router_dtype="fp32", moe_token_dispatcher_type="allgather",
        moe_aux_loss_coeff=0.0, params_dtype=torch.bfloat16, bf16=True,
        use_cpu_initialization=True, hidden_dropout=0.0, activation_func=F.gelu,
        bias_activation_fusion=False, bias_dropout_fusion=False,
        gradient_accumulation_fusion=False, moe_grouped_gemm=False, moe_permute_fusion=False)
    spec = get_gpt_layer_local_spec(num_experts=EXPERTS, moe_grouped_gemm=False)
    layer = build_module(spec.submodules.mlp, config=config)
    weights = {p.untyped_storage().data_ptr() for p in layer.parameters()}
    x = torch.randn(S, B, H, dtype=torch.bfloat16, requires_grad=True)
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in weights and storage.data_ptr() != x.data_ptr():
            seen.setdefault(storage.data_ptr(), storage.nbytes())
        return t

    torch.manual_seed(0)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        layer(x)
    return sum(seen.values())


def test_megatron_experts_save_three_ffn_tensors() -> None:
    """T = 128 tokens, R = T * k = 256 routed rows, h 64, ffn 128, 8 experts, bf16. Saved,
    by hand: the permuted rows R * h * 2 = 32,768; per expert fc1's output, the GeLU output
    and its product with the probabilities cast back, 3 * R * ffn * 2 = 196,608; the router's
    fp32 probabilities over the experts T * E * 4 = 4,096; the top-k indices T * k * 8 =
    2,048, the permutation's indices R * 8 = 2,048, the top-k probabilities T * k * 4 = 1,024,
    the routing map T * E = 1,024 and the permuted probabilities R * 4 = 1,024: 240,640.
    memplan's loop terms: the router's probabilities T * E * 4 = 4,096, the top-k indices
    R * 8 = 2,048, the top-k weights with their per-token sum R * 4 + T * 4 = 1,536, the
    token index R * 8 = 2,048, the gathered rows 32,768, two [R, ffn] tensors 131,072, the
    expert output and the weighted output 2 * R * h * 2 = 65,536 and bf16 routing weights
    R * 2 = 512: 239,616."""
    with megatron_group(), megatron_on_cpu():
        saved = _saved_activations()
    tokens, rows = S * B, S * B * TOP_K
    assert saved == (rows * H * 2 + 3 * rows * FFN * 2 + tokens * EXPERTS * 4
                     + tokens * TOP_K * 8 + rows * 8 + tokens * TOP_K * 4 + tokens * EXPERTS
                     + rows * 4) == 240_640
    spec = ModelSpec.model_validate({
        **load_model("tiny").model_dump(), "hidden_size": H, "num_attention_heads": 4,
        "num_kv_heads": 4, "head_dim": H // 4, "mlp": "gelu",
        "moe": {"num_experts": EXPERTS, "top_k": TOP_K, "expert_ffn_hidden_size": FFN}})
    wl = make_workload(spec, framework="megatron", micro_batch_size=B, seq_len=S,
                       precision="bf16-fp32-grads")
    loop = total(moe_terms(spec, Dims.of(spec, make_layout(1), wl)))
    assert loop == 239_616
    # the difference is the experts' third [R, ffn] tensor against the two [R, h] ones, and
    # the small per-row terms
    assert saved - loop == rows * (FFN - 2 * H) * 2 + 1_024 == 1_024

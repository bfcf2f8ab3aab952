"""The order of a gated MLP's backward, traced on CPU: what is alive at the up projection's
weight gradient hook (memplan.model.mlp.up_backward) in transformers' LlamaMLP and litgpt's
LLaMAMLP, hidden 256, intermediate 896, 64 tokens in bf16 (T x f = 114,688 B, T x h =
32,768 B). Versions: transformers 5.3, litgpt 0.5.13, torch 2.13."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from memplan.model.mlp import up_backward  # noqa: E402
from memplan.workload import MlpImpl  # noqa: E402

T, H, F = 64, 256, 896
INNER, ROWS = T * F * 2, T * H * 2


def _transformers() -> tuple[torch.nn.Module, torch.nn.Module]:
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaMLP

    mlp = LlamaMLP(LlamaConfig(hidden_size=H, intermediate_size=F, hidden_act="silu"))
    return mlp, mlp.up_proj


def _litgpt() -> tuple[torch.nn.Module, torch.nn.Module]:
    litgpt = pytest.importorskip("litgpt")
    from litgpt.model import LLaMAMLP

    mlp = LLaMAMLP(litgpt.Config(n_embd=H, intermediate_size=F, bias=False,
                                 mlp_class_name="LLaMAMLP"))
    return mlp, mlp.fc_2


@pytest.mark.parametrize(("build", "impl"), [(_transformers, MlpImpl.GENERIC),
                                             (_litgpt, MlpImpl.LITGPT)],
                         ids=["transformers", "litgpt"])
def test_up_projection_backward(build, impl: MlpImpl) -> None:
    """At the up projection's weight gradient hook the T x f tensors alive beyond the
    forward's saved ones are those memplan's moment holds less the up projection's output
    gradient, released before the hook: transformers 2 (the activation waits with its saved
    input, the gate's output, and its incoming gradient), litgpt 1 (the activation's backward
    ran: the gate output's gradient); with the up projection's input gradient (T x h)."""
    from memplan.profile.tracker import MemoryTracker

    torch.manual_seed(0)
    mlp, up = build()
    mlp = mlp.to(torch.bfloat16)
    tracker = MemoryTracker()
    seen: dict[str, int] = {}

    def count(_param) -> None:
        live = [e[0] for e in tracker._live.values()]
        seen.update(inner=live.count(INNER), rows=live.count(ROWS))

    up.weight.register_post_accumulate_grad_hook(count)
    with tracker:
        x = torch.randn(1, T, H, dtype=torch.bfloat16, requires_grad=True) * 1
        y = mlp(x)
        y.backward(torch.ones_like(y))
    m = up_backward(ROWS, INNER, H * F, impl)
    held = m.own_bytes + m.transient_bytes - m.hook_freed - ROWS
    assert seen["inner"] * INNER == held
    # T x h: the leaf, the MLP's input (its product with 1), its output and the output's
    # gradient, the up projection's input gradient
    assert seen["rows"] == 5

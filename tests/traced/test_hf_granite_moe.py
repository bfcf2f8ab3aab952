"""IBM Granite's MoE families as current transformers runs them, against the hf preset's
default (``moe_impl`` grouped): transformers 5.23 rewrote GraniteMoeMoE as a router,
GraniteMoeTopKRouter (models/granitemoe/modeling_granitemoe.py: the top-k of the fp32
logits, their softmax in fp32, cast to the input's dtype; ``MoESpec.router_logits_fp32``,
``router_topk_softmax``, ``router_weights_cast``), and stacked GraniteMoeExperts run by the
experts interface (``use_experts_implementation``: integrations/moe.py
grouped_mm_experts_forward), the same code under granitemoeshared's and granitemoehybrid's
prefixes; the shared MLP still runs after the experts (``MoESpec.shared_experts_last``).

transformers 5.3's GraniteMoeParallelExperts (``moe_impl`` parallel) is traced in
test_hf_heldout.py; this file skips where it is installed. Granite 4.0-H's Mamba2 layers
are left out here: 5.23 writes their torch path as einsum chunks (mamba2_chunk_scan), which
memplan does not model (memplan.model.mamba is 5.3's naive scan); the hybrid's experts are
traced on its attention layers.

Versions: transformers 5.23.0, torch 2.13.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from known import EXACT, check  # noqa: E402  (tests/traced/known.py)
from memplan.profile.frameworks import FrameworkCase, compare_framework  # noqa: E402
from test_hf_heldout import _TOY, TRACED, _cut  # noqa: E402


def _experts_interface() -> bool:
    """Whether the installed transformers runs Granite's MoE as GraniteMoeExperts through
    the experts interface (5.23 on), not 5.3's GraniteMoeParallelExperts."""
    from transformers.models.granitemoe import modeling_granitemoe as m

    return hasattr(m, "GraniteMoeExperts") and not hasattr(m, "GraniteMoeParallelExperts")


pytestmark = pytest.mark.skipif(
    not _experts_interface(),
    reason=f"transformers {transformers.__version__} runs Granite's MoE through 5.3's "
           "GraniteMoeParallelExperts (moe_impl parallel: test_hf_heldout.py)")

GRANITE = {
    # Granite 3.x MoE: 4 experts of 256, 2 routed a token
    "granitemoe": TRACED["granitemoe"],
    # the same with the shared MLP of 256 after the experts
    "granitemoeshared": TRACED["granitemoeshared"],
    # Granite 4.0's hybrid with experts, two attention layers (no Mamba2: above), each with
    # 4 experts of 256 (2 routed a token) and the shared MLP
    "granitemoehybrid-moe": _cut("granite-4.0-micro", num_hidden_layers=2,
                                 layer_types=["attention"] * 2, num_local_experts=4,
                                 num_experts_per_tok=2, shared_intermediate_size=256,
                                 mamba_n_heads=4, mamba_d_head=64, **_TOY),
}


def _cases():
    for name, data in sorted(GRANITE.items()):
        yield FrameworkCase("transformers", name, data, "fp32", 2, 64)
        yield FrameworkCase("transformers", name, data, "bf16-pure", 2, 64)
        yield FrameworkCase("transformers", name, data, "bf16-pure", 2, 64,
                            options={"recompute": "full"})


@pytest.mark.parametrize("case", list(_cases()), ids=lambda c: c.id)
def test_library_matches_estimate(case: FrameworkCase) -> None:
    """Every phase peak, saved activations and states within 1% of transformers' own step,
    the estimate on the hf preset's default (grouped experts, Granite's router)."""
    comparison = compare_framework(case)
    assert comparison.spec.approximate is None  # read by its family's reader
    assert comparison.workload.moe_impl.value == "grouped"
    check(comparison.rows, None, exact=EXACT)

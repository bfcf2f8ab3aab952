"""IBM Granite's MoE families as current transformers runs them, against the hf preset's
default (``moe_impl`` grouped): transformers 5.23 rewrote GraniteMoeMoE as a router,
GraniteMoeTopKRouter (models/granitemoe/modeling_granitemoe.py: the top-k of the fp32
logits, their softmax in fp32, cast to the input's dtype; ``MoESpec.router_logits_fp32``,
``router_topk_softmax``, ``router_weights_cast``), and stacked GraniteMoeExperts run by the
experts interface (``use_experts_implementation``: integrations/moe.py
grouped_mm_experts_forward), the same code under granitemoeshared's and granitemoehybrid's
prefixes; the shared MLP still runs after the experts (``MoESpec.shared_experts_last``).

transformers 5.3's GraniteMoeParallelExperts (``moe_impl`` parallel) is traced in
test_hf_heldout.py; this file skips where it is installed. Granite 4.0-H Tiny as published
(Mamba2 and attention layers, each with experts) runs its Mamba2 layers as 5.23 writes their
torch path (``mamba2_chunk_scan``'s einsums: ``mamba_kernel`` torch-einsum, memplan.model.
mamba_einsum); Granite 4.0 Micro's hybrid has attention layers alone.

Versions: transformers 5.23.0, torch 2.13.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from known import EXACT, Known, KnownDeviation, check  # noqa: E402  (tests/traced/known.py)
from memplan.profile.frameworks import FrameworkCase  # noqa: E402
from recorded import compare_framework  # noqa: E402 (tests/traced/recorded.py)
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
    # Granite 4.0's hybrid with experts, two attention layers, each with
    # 4 experts of 256 (2 routed a token) and the shared MLP
    # Granite 4.0-H Tiny with its experts: Mamba2, attention, Mamba2 (test_hf_heldout.py's
    # granitemoehybrid-h-moe), each with 4 experts of 256 (2 routed a token) and the shared MLP
    "granitemoehybrid-h-moe": TRACED["granitemoehybrid-h-moe"],
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
    if case.name == "granitemoehybrid-h-moe":
        assert comparison.workload.mamba_kernel.value == "torch-einsum"
    check(comparison.rows, None, exact=EXACT)


# The MoE block the layer's peak (as test_hf_heldout.py's MOE_PEAK): 2 x 256 tokens over a
# 64-token vocabulary, bf16 and fp32 under full recompute. The checkpointed forward's working set
# is 5.23's grouped_mm_experts_forward (moe_impl grouped: the rows gathered once, already sorted,
# the unsort index made after the down projection; memplan.model.moe._grouped_moments), within
# 0.08% (5.3's gather, sorted copy and indices, moe_impl grouped-token, read it 282,464 B over).
# granitemoeshared's rerun backward peaks at the shared MLP's product backward, run first beside
# everything the rerun rebuilt (memplan.model.moe._shared_last_backward): with the scaled copy of
# the block output's gradient that the routed branch holds (T h = 131,072 B: residual +
# hidden_states * residual_multiplier) and the shared output_linear's weight gradient (its own
# group, moe_shared_out: s h e = 65,536 B) it reads +1,904 B (+0.02%; it read 194,704 B under; in
# fp32 +1,904 B, where it read 391,312 B, 2.16%, under): the harness passes the ids as the labels
# (memplan counts the targets apart, 4,096 B) and transformers' position ids are one row (2,048
# B), the routed offsets (E int32) and the rotary buffer are not counted.
MOE_PEAK_KNOWN: dict[str, Known | None] = {
    "granitemoe": None,
    "granitemoeshared": None,
}


def _peak_param(name: str):
    known = MOE_PEAK_KNOWN[name]
    marks = [pytest.mark.xfail(strict=True, raises=KnownDeviation, reason=known.cause)
             ] if known else []
    return pytest.param(name, known, id=name, marks=marks)


@pytest.mark.parametrize("precision", ["bf16-pure", "fp32"])
@pytest.mark.parametrize(("name", "known"), [_peak_param(n) for n in sorted(MOE_PEAK_KNOWN)])
def test_moe_block_peaks_match_estimate(name: str, known: Known | None, precision: str) -> None:
    """Every phase peak within 1% where the MoE block sets it, but the known rows above."""
    case = FrameworkCase("transformers", name, {**GRANITE[name], "vocab_size": 64},
                         precision, 2, 256, options={"recompute": "full"})
    check(compare_framework(case).rows, known, exact=EXACT)

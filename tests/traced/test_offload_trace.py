"""Activations offloaded as ``torch.autograd.graph.save_on_cpu`` does, traced on a transformers
model against the estimate with ``offload="activations"``.

A CPU-only build cannot move a tensor off the device, so ``memplan.profile.offload.HostSaved``
runs save_on_cpu's pack and unpack hooks with a real host side: what a decoder layer saves is
copied outside the exact tracker (host memory) and copied back, counted, when a backward node
reads it. Two training steps of Llama-3 cut to two layers (transformers 5.3, SDPA, the hf
preset: the model returns its KV cache, the loop drops the output before backward); every
parameter, gradient, optimizer, saved-activation and phase row within 1%.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from test_frameworks import LLAMA3_TOY, hf  # tests/traced/test_frameworks.py
from memplan.profile.frameworks import FrameworkCase, compare_built, trace_case


def _case(recipe: str, offload: str) -> FrameworkCase:
    return FrameworkCase("transformers", "llama3-toy", hf("Meta-Llama-3-8B", **LLAMA3_TOY),
                         recipe, 2, 128, options={"offload": offload})


@pytest.mark.parametrize("recipe", ["fp32", "bf16-pure"])
def test_save_on_cpu_matches_estimate(recipe: str) -> None:
    """Every row within 1%; the saved activations left on the GPU are the embedding's and the
    head's alone; the host holds at least what the estimate says (its lower bound: a tensor
    several nodes save is packed once per node)."""
    built, result = trace_case(_case(recipe, "activations"))
    c = compare_built(built, result)
    bad = [(r.name, r.measured_bytes, r.estimated_bytes, round(r.diff_pct, 3))
           for r in c.rows if abs(r.diff_pct) > 1.0]
    assert not bad, bad
    host = c.estimate.stages[0].host_activations_bytes
    assert 0.8 * built.host.host_bytes <= host <= built.host.host_bytes


def test_hooks_move_every_layer_tensor() -> None:
    """Without offloading the layers' saved tensors are most of what forward leaves; with
    HostSaved around the layers what remains is the head's, the loss's and the batch's: the
    difference is at least the two layers' saved bytes (5,908,480 each for this shape, from
    the terms: 2 norms of 3 * 262,144 + 1,024, attention 663,552, MLP 4 * 917,504) and the
    rope tables (2 * 16,384)."""
    _, plain = trace_case(_case("fp32", "none"))
    built, off = trace_case(_case("fp32", "activations"))
    moved = plain.steady.saved_activations_bytes - off.steady.saved_activations_bytes
    assert moved == 2 * 5_908_480 + 2 * 16_384
    assert built.host.packed > 0

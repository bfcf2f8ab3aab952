"""Offloading traced against the estimate: activations as ``torch.autograd.graph.save_on_cpu``
saves them, on a transformers model (``offload="activations"``), and FSDP2's
``CPUOffloadPolicy`` on memplan's reference model (``offload="params"``).

A CPU-only build cannot move a tensor off the device, so ``memplan.profile.offload.HostSaved``
runs save_on_cpu's pack and unpack hooks with a real host side: what a decoder layer saves is
copied outside the exact tracker (host memory) and copied back, counted, when a backward node
reads it. Two training steps of Llama-3 and Qwen2.5 cut to two layers (transformers 5.3, SDPA,
the hf preset: the model returns its KV cache, the loop drops the output before backward); every
parameter, gradient, optimizer, saved-activation and phase row within 1%.

FSDP2 runs ``fully_shard(..., offload_policy=CPUOffloadPolicy(pin_memory=False))`` through the
fake process group (``memplan.profile.distributed``), where host and device are the same
memory: ``HostOffloadTracker`` counts as host the sharded weights, the sharded gradients FSDP2
hands back after each reduce-scatter and all the optimizer step makes, and its phase peaks
count the device alone.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from test_frameworks import LLAMA3_TOY, QWEN_TOY, hf  # tests/traced/test_frameworks.py
from memplan import api
from recorded import compare  # tests/traced/recorded.py
from memplan.profile.frameworks import FrameworkCase, compare_built, trace_case
from memplan.spec import load_model
from memplan.workload import Workload


def _case(recipe: str, offload: str, qwen: bool = False, **options) -> FrameworkCase:
    if qwen:  # a wider MLP (ffn 5.3 x hidden), MQA, q/k/v biases
        return FrameworkCase("transformers", "qwen2.5-toy", hf("Qwen2.5-7B", **QWEN_TOY),
                             recipe, 2, 128, options={"offload": offload, **options})
    return FrameworkCase("transformers", "llama3-toy", hf("Meta-Llama-3-8B", **LLAMA3_TOY),
                         recipe, 2, 128, options={"offload": offload, **options})


@pytest.mark.parametrize(("recipe", "qwen"), [("fp32", False), ("bf16-pure", False),
                                              ("fp32", True)])
def test_save_on_cpu_matches_estimate(recipe: str, qwen: bool) -> None:
    """Every row within 1%; the saved activations left on the GPU are the embedding's and the
    head's alone; the host holds at least what the estimate says (its lower bound: a tensor
    several nodes save is packed once per node)."""
    built, result = trace_case(_case(recipe, "activations", qwen))
    c = compare_built(built, result)
    bad = [(r.name, r.measured_bytes, r.estimated_bytes, round(r.diff_pct, 3))
           for r in c.rows if abs(r.diff_pct) > 1.0]
    assert not bad, bad
    host = c.estimate.stages[0].host_activations_bytes
    assert 0.8 * built.host.host_bytes <= host <= built.host.host_bytes


def test_save_on_cpu_around_checkpointed_layers() -> None:
    """Gradient checkpointing (non-reentrant) inside the hooks: only each layer's checkpointed
    input goes to the host, 2 layers * 2 * 128 * 256 * 4 B = 524,288 (estimated exactly: the
    rerun saves on the device, the rope tables stay, the checkpoint's inputs); every row
    within 1%."""
    built, result = trace_case(_case("fp32", "activations", recompute="full"))
    c = compare_built(built, result)
    bad = [(r.name, r.measured_bytes, r.estimated_bytes, round(r.diff_pct, 3))
           for r in c.rows if abs(r.diff_pct) > 1.0]
    assert not bad, bad
    assert built.host.host_bytes == c.estimate.stages[0].host_activations_bytes == 524_288


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


def test_fsdp2_cpu_offload_policy_matches_estimate() -> None:
    """The tiny spec on 2 ranks, fsdp-bf16: every phase of both steps exact to 0.05% with the
    weights, gradients and states off the GPU (the estimate's 0 for each); the host holds the
    measured sharded weights, gradients and states, and the 21 step counts (4 bytes each) the
    trace does not count (torch.optim keeps them on the host: ``run_steps`` forgets them)."""
    par = api.make_layout(2, zero=3, offload="params")
    c = compare(load_model("tiny"), par, Workload(micro_batch_size=2, seq_len=64,
                                                  precision="fsdp-bf16"))
    phases = [r for r in c.rows if "." in r.name]
    assert all(abs(r.diff_pct) <= 0.05 for r in phases), phases
    steady = c.trace.steady.phases["optimizer"].by_category
    host = steady["parameters"] + steady["gradients"] + steady["optimizer"]
    stage = c.estimate.stages[0]
    assert stage.params_bytes == stage.grads_bytes == stage.optimizer_bytes == 0
    assert stage.host_bytes == host + 21 * 4

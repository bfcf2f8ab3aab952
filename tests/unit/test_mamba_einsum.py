"""Granite 4.0-H's Mamba2 layers as transformers 5.23 runs them (``mamba_kernel``
torch-einsum, memplan.model.mamba_einsum) against transformers 5.23's own steps, recorded:
tests/data/traces/mamba_einsum/transformers-5.23.json, written by
benchmarks/record_mamba_traces.py (the toy Granite 4.0-H of tests/traced/test_hf_heldout.py
cut to Mamba2, attention, Mamba2 layers, four sets of Mamba sizes, fp32, bf16, bf16 under
full recompute and amp-bf16, stepped twice under the exact tracker). The suite's own transformers (5.3)
runs the naive scan instead; with 5.23 installed the same cases run live in
tests/traced/test_hf_heldout.py.

Every row (states, saved activations, each phase of step 1 and of the steady state) is
checked against the recording: the states and the saved activations to the byte (but one
int64 scalar with one sequence), the phases within 0.1%. Under full recompute the backward's
peak is the rerun's scan output, beside the scaled copy of the stream's gradient Granite's
residual multiplier makes before the rerun (``ModelSpec.scaled_residual``).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from memplan.hardware import DEFAULT_GPU, load_gpu
from memplan.model.estimate import estimate
from memplan.overheads import no_overheads
from memplan.parallel import ParallelConfig
from memplan.spec import ModelSpec
from memplan.workload import MambaKernel, Workload

RECORDED = json.loads((Path(__file__).parent.parent / "data" / "traces" / "mamba_einsum" /
                       "transformers-5.23.json").read_text())
EXACT = ("params_bytes", "grads_bytes", "activations_bytes")
TOLERANCE_PCT = 0.1
# With one sequence (the two-groups shape, b = 1) the model saves 8 B more than counted (one
# int64 scalar), in every recipe, on transformers 5.3's naive path too: not the Mamba block's
ONE_SEQUENCE = -8


def _estimated(case: dict) -> dict[str, int]:
    spec = ModelSpec(**case["spec"])
    wl = Workload(**case["workload"])
    stage = estimate(spec, load_gpu(DEFAULT_GPU), ParallelConfig(**case["layout"]), wl,
                     overheads=no_overheads()).stages[0]
    out = {"params_bytes": stage.params_bytes, "grads_bytes": stage.grads_bytes,
           "optimizer_bytes": stage.optimizer_bytes,
           "activations_bytes": stage.activations_bytes}
    for label, phases in (("first_step", stage.first_step), ("steady", stage.steady)):
        for phase in ("forward", "backward", "optimizer"):
            out[f"{label}.{phase}_bytes"] = getattr(phases, phase)
    return out


def test_the_recording_is_the_einsum_scan() -> None:
    assert RECORDED["transformers"].startswith("5.23")
    assert len(RECORDED["cases"]) == 16
    assert {c["workload"]["mamba_kernel"] for c in RECORDED["cases"]} == {"torch-einsum"}


@pytest.mark.parametrize("case", RECORDED["cases"], ids=[c["id"] for c in RECORDED["cases"]])
def test_estimate_matches_transformers_5_23(case: dict) -> None:
    estimated = _estimated(case)
    for name, measured in case["measured"].items():
        got = estimated[name]
        if name in EXACT:
            short = ONE_SEQUENCE if name == "activations_bytes" and case["id"].startswith(
                "two-groups") else 0
            assert got - measured == short, (name, got, measured)
            continue
        assert abs(got - measured) <= measured * TOLERANCE_PCT / 100, (name, got, measured)


def test_the_naive_scan_misses_the_einsum_scan() -> None:
    """The same recordings estimated as transformers 5.3 runs the scan (``mamba_kernel``
    torch): the saved activations and the forward's peak do not match 5.23's (the naive scan
    saves fewer copies and holds its broadcasting products)."""
    case = next(c for c in RECORDED["cases"] if c["id"] == "chunk-mats-fp32")
    naive = _estimated({**case, "workload": {**case["workload"],
                                             "mamba_kernel": MambaKernel.TORCH.value}})
    measured = case["measured"]
    assert naive["activations_bytes"] != measured["activations_bytes"]
    assert naive["first_step.forward_bytes"] > 1.1 * measured["first_step.forward_bytes"]


def test_autocast_terms_by_hand() -> None:
    """The toy under amp-bf16 (fp32 weights, bf16 compute): b = 2, s = 64 (T = 128), H = 4
    heads of 64 (d = 256), n = 32, G = 1 (C = 320 channels, in_proj's width W = 580), K = 4,
    chunks of 48 (N = 2, Tp = 192), M = b N c^2 H = 36,864 elements. torch.einsum is an op of
    CUDA's lower-precision autocast list: each einsum of ``mamba2_chunk_scan`` casts its fp32
    operands to bf16 and returns bf16 (read off transformers 5.23's own mixer, every
    ``aten._to_copy``); F.conv1d casts its input and weight; softplus runs in fp32:

    mamba.in_proj_out   none: ``.to(weight.dtype)`` upcasts the conv's bf16 input, conv1d
                        casts that back, the gate's fp32 copy and softplus's cast read dt =       0
    mamba.conv_casts    conv1d's input cast T C 2 + weight cast C K 2 = 81,920 + 2,560   =  84,480
    mamba.dt            softplus's fp32 input, its output, the clamped dt: 3 T H 4      =   6,144
    mamba.chunk_mats    L fp32 M 4, G and M's cast bf16 2 M 2 = 147,456 + 147,456      = 294,912
                        (fp32: 3 M 4 = 442,368)
    mamba.bc            B in chunks Tp H n 4 + four bmm copies 4 Tp H n 2               = 294,912
    mamba.x_dt          two copies of x * dt's cast: 2 Tp d 2                           = 196,608
    mamba.decay_chunk   exp's b (N + 1)^2 H 4 and its bf16 cast b (N + 1)^2 H 2         =     432
    mamba.states        (b (N + 1) d n + b N d n) 2 = 98,304 + 65,536                   = 163,840
    mamba.y_off         C_times_states, bf16: Tp d 2                                    =  98,304

    The mixer saves 2,564,834 B a layer with its linears' weight casts (866,672 B less than
    counted in fp32 sizes; traced: the toy's saved activations exact). The cache keeps the
    conv state b C K 2 = 5,120 and the final state b d n 2 = 32,768 (bf16 under autocast).
    In a checkpointed layer the scan's output is made beside in_proj's output (T W 2 =
    148,480), L and M in fp32 (294,912), G (73,728), silu's output (T C 2 = 81,920), B, C and
    B_decay in fp32 (294,912), the zero first state (b d n 2 = 32,768), the clamped dt (T H 4
    = 2,048), the chunks' decay (288) and A (16): 929,072; with D's residual, x * dt, Y_off,
    their sum and its copy in fp32 (5 Tp d 4 = 983,040), Y_diag and C_times_states in bf16
    (2 Tp d 2 = 196,608), the passed states (98,304) and four Tp H 4 (12,288): 2,219,312 B
    (traced on 5.23's mixer under checkpoint: the same, its weight casts apart)."""
    from memplan.model import mamba_einsum as es
    from memplan.model.dims import Dims
    from memplan.model.mamba import mamba_cache_bytes, mamba_terms, sizes

    case = next(c for c in RECORDED["cases"] if c["id"] == "toy-amp-bf16")
    spec, wl = ModelSpec(**case["spec"]), Workload(**case["workload"])
    dm = Dims.of(spec, ParallelConfig(), wl)
    assert dm.autocast and dm.e == 2
    terms = {t.name: t.size_bytes for t in mamba_terms(spec, dm, MambaKernel.TORCH_EINSUM)}
    assert (terms["mamba.in_proj_out"], terms["mamba.conv_casts"], terms["mamba.dt"]) == (
        0, 84_480, 6_144)
    assert (terms["mamba.chunk_mats"], terms["mamba.bc"], terms["mamba.x_dt"]) == (
        294_912, 294_912, 196_608)
    assert (terms["mamba.decay_chunk"], terms["mamba.states"], terms["mamba.y_off"]) == (
        432, 163_840, 98_304)
    assert sum(terms.values()) == 2_564_834
    assert mamba_cache_bytes(spec, wl, dm) == 5_120 + 32_768
    z = sizes(spec.mamba, dm)
    scan_out = next(m for m in es.working_set(z, dm) if m.name == "mamba.scan_out")
    assert scan_out.transient_bytes == 2_219_312

"""Op-level checkpointing of Mamba2 layers on transformers 5.23's einsum scan (``mamba_kernel``
torch-einsum: ``memplan.model.sac_mamba.mamba_items``, ``sac_falcon``) against transformers
5.23's own code, recorded: tests/data/traces/mamba_einsum/sac-5.23.json, written by
benchmarks/record_mamba_sac_traces.py (CI runs transformers 5.3, whose naive scan
tests/traced/test_sac_policy.py traces live).

- The policy's keys: over one decoder layer's forward, the ops of the (family, width) keys
  memplan's items have come in the order memplan lists them (so each item's index among its
  key's ops, and each key's count per layer, are transformers'), in fp32 and bf16, for
  Granite 4.0-H's and Falcon-H1's toys with colliding widths, and under autocast.
- The emitted policy's step: saved activations as full recompute's own (Granite's toy 4 B a
  token more than counted with any list, 4,096 B at 2 x 512 tokens; Falcon-H1's none), every
  phase within 1% (all within 0.2% as recorded, under autocast within 0.67%).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from memplan.hardware import DEFAULT_GPU, load_gpu
from memplan.model import layer as layers
from memplan.model.dims import Dims
from memplan.model.estimate import estimate
from memplan.model.sac_ops import NORM
from memplan.overheads import no_overheads
from memplan.parallel import ParallelConfig
from memplan.spec import ModelSpec, spec_from_hf_dict
from memplan.workload import Recompute, Workload
from memplan.api import make_workload

RECORDED = json.loads((Path(__file__).parent.parent / "data" / "traces" / "mamba_einsum" /
                       "sac-5.23.json").read_text())
TOLERANCE_PCT = 1.0


def test_the_recording_is_the_einsum_scan() -> None:
    assert RECORDED["transformers"].startswith("5.23")
    assert len(RECORDED["keys"]) == 27 and len(RECORDED["cases"]) == 50
    assert {c["workload"]["mamba_kernel"] for c in RECORDED["cases"]} == {"torch-einsum"}


def _item_keys(rec: dict) -> tuple[list[tuple[str, int]], list[tuple[str, int]]]:
    """(the traced keys, memplan's layer ops) restricted to the keys memplan's items have."""
    spec = spec_from_hf_dict(rec["config"], "config.json", "toy")
    wl = make_workload(spec, framework="hf", precision=rec["precision"],
                       micro_batch_size=rec["batch"], seq_len=rec["seq"],
                       mamba_kernel="torch-einsum")
    dm = Dims.of(spec, ParallelConfig(), wl)
    variant = "linear" if rec["model"] == "granite" else None
    _, ops = layers._layer_ops(spec, wl, dm, False, variant)
    keys = {(i.op, i.width) for i in ops if i.name}
    mine = [(i.op, i.width) for i in ops if (i.op, i.width) in keys and i.op != NORM]
    return [tuple(k) for k in rec["keys"] if tuple(k) in keys], mine


@pytest.mark.parametrize("rec", RECORDED["keys"],
                         ids=[f"{r['model']}-{r['precision']}-{r['seq']}-{i}"
                              for i, r in enumerate(RECORDED["keys"])])
def test_items_indexed_as_transformers_runs_them(rec: dict) -> None:
    traced, mine = _item_keys(rec)
    assert traced == mine


def test_the_act_is_the_sequence_wide() -> None:
    """causal_conv1d_fn's silu runs on (b, C, s): the recorded Granite toy at 64 tokens runs
    an ``act`` 64 wide right after the conv (C = 256 + 2 x 32 = 320 channels)."""
    rec = next(r for r in RECORDED["keys"] if r["model"] == "granite" and r["seq"] == 64
               and r["precision"] == "fp32")
    keys = [tuple(k) for k in rec["keys"]]
    at = keys.index(("conv", 320))
    assert keys[at + 1] == ("act", 64)


def _estimated(case: dict) -> dict[str, int]:
    stage = estimate(ModelSpec(**case["spec"]), load_gpu(DEFAULT_GPU),
                     ParallelConfig(**case["layout"]), Workload(**case["workload"]),
                     overheads=no_overheads()).stages[0]
    out = {"activations_bytes": stage.activations_bytes}
    for label, phases in (("first_step", stage.first_step), ("steady", stage.steady)):
        for phase in ("forward", "backward", "optimizer"):
            out[f"{label}.{phase}_bytes"] = getattr(phases, phase)
    return out


OPS = [c for c in RECORDED["cases"] if c["save"]]


@pytest.mark.parametrize("case", OPS, ids=[c["id"] for c in OPS])
def test_emitted_policy_matches_transformers_5_23(case: dict) -> None:
    full = next(c for c in RECORDED["cases"]
                if not c["save"] and c["id"].rsplit("-", 1)[0] == case["id"].rsplit("-", 1)[0]
                and c["spec"] == case["spec"])
    assert Workload(**case["workload"]).recompute is Recompute.OPS
    got, reference = _estimated(case), _estimated(full)
    own = reference["activations_bytes"] - full["measured"]["activations_bytes"]
    # full recompute's own on the toys: Granite's 4 B a token over (2,048 B at 2 x 256 tokens
    # to 8,192 B at 2 x 1,024), Falcon-H1's exact
    tokens = case["workload"]["micro_batch_size"] * case["workload"]["seq_len"]
    assert own in (0, 4 * tokens)
    assert got["activations_bytes"] - case["measured"]["activations_bytes"] == own
    for name, measured in case["measured"].items():
        if name in got and name != "activations_bytes":
            assert abs(got[name] - measured) <= measured * TOLERANCE_PCT / 100, (
                name, got[name], measured)

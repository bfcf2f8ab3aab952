"""memplan's save set beside PyTorch's integer program (``torch.distributed._tools.sac_ilp``
over ``SACEstimator``'s per-op statistics; ``memplan.profile.sac_ilp``) on the reference
model's tiny layer, at the same bytes: memplan's choice reruns no more FLOPs (the rerun with
early stop, which the program does not model), and both are traced with the exact tracker to
show what each keeps. Needs pulp (the program's solver).

Measured on tiny (seq 128, micro-batch 2), per layer, budget = fraction of the estimator's
op bytes (1,312,768 B):

| fraction | budget B | program saves (traced) | its rerun FLOPs | memplan saves (traced) | memplan rerun FLOPs |
|---|---|---|---|---|---|
| 0.1 | 131,277 | 131,072 (147,456) | 15,508,992 | 126,976 (126,976) | 12,892,672 |
| 0.2 | 262,554 | 256,000 (272,384) | 7,123,968 | 249,856 (249,856) | 5,028,352 |
| 0.3 | 393,831 | 387,072 (403,456) | 816,128 | 315,392 (315,392) | 834,048 |

The program's choice keeps 16,384 B per layer more than its statistics count, over the budget
at every fraction; it spends bytes on the down projection's output, which a rerun with early
stop never recomputes. At 0.3 it reruns 2.2% fewer FLOPs than memplan (RoPE's and the norms'
outputs kept in the bytes memplan's items leave over) but does not fit its budget."""

from __future__ import annotations

import dataclasses
import math

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("pulp")

from collections import Counter  # noqa: E402

from memplan.api import make_layout, make_workload  # noqa: E402
from memplan.model.dims import Dims  # noqa: E402
from memplan.model.layer import ops_items  # noqa: E402
from memplan.planning.save_sets import frontier  # noqa: E402
from memplan.profile import sac_ilp  # noqa: E402
from memplan.profile.reference import ReferenceModel  # noqa: E402
from memplan.profile.trace import _fake_mode, ref_options, run_steps  # noqa: E402
from memplan.profile.tracker import MemoryTracker  # noqa: E402
from memplan.spec import load_model  # noqa: E402

SPEC = load_model("tiny")
FIELDS = dict(seq_len=128, micro_batch_size=2)
# at 0.3 the program reruns 2.2% fewer FLOPs: with the bytes memplan's items leave over it
# keeps RoPE's and the norms' elementwise outputs, ops a policy by op family cannot name
FRACTIONS = (0.1, 0.2, pytest.param(0.3, marks=pytest.mark.xfail(
    strict=True, reason="the program reruns 2.2% fewer FLOPs, keeping RoPE's and the norms' "
    "outputs, at 403,456 B traced per layer over the 393,831 B budget")))


@pytest.fixture(scope="module")
def stats():
    return sac_ilp.layer_stats(SPEC, make_workload(SPEC, **FIELDS))


def _saved_activations(policy_fns: tuple) -> int:
    wl = make_workload(SPEC, **FIELDS, recompute="ops")
    with _fake_mode():
        torch.manual_seed(0)
        model = ReferenceModel(SPEC, dataclasses.replace(ref_options(wl),
                                                         policy_fns=policy_fns))
        return run_steps(model, SPEC, wl, MemoryTracker(), steps=2).steady \
            .saved_activations_bytes


@pytest.mark.parametrize("fraction", FRACTIONS)
def test_memplan_reruns_no_more_than_the_ilp(stats, fraction: float) -> None:
    budget = math.ceil(fraction * sum(stats.memory))
    ilp = sac_ilp.ilp_choice(stats, fraction)
    assert ilp.saved_bytes <= budget
    wl = make_workload(SPEC, **FIELDS, recompute="ops")
    dm = Dims.of(SPEC, make_layout(1), wl)
    best = max((c for c in frontier(ops_items(SPEC, wl, dm)) if c.kept_bytes <= budget),
               key=lambda c: c.kept_bytes)
    mine = sac_ilp.choice_of(stats, sac_ilp.memplan_ops(stats, best.kept, SPEC, dm.tokens,
                                                         dm.e))
    assert mine.saved_bytes == best.kept_bytes <= budget
    # both traced: memplan's keeps, beyond full recompute, exactly what it counts per layer;
    # the program's keeps at least what its statistics count (``ILP_TRACED``)
    counts = Counter(stats.func_names)
    base = _saved_activations(sac_ilp.policy_fns(frozenset(), counts, SPEC.num_layers))
    traced = {name: (_saved_activations(sac_ilp.policy_fns(c.saved, counts, SPEC.num_layers))
                     - base) // SPEC.num_layers for name, c in (("ilp", ilp), ("memplan", mine))}
    print(f"fraction {fraction}: budget {budget:,} B; ilp saves {ilp.saved_bytes:,} B "
          f"(traced {traced['ilp']:,}), reruns {ilp.rerun_flops:,.0f} FLOPs; memplan saves "
          f"{mine.saved_bytes:,} B (traced {traced['memplan']:,}), reruns "
          f"{mine.rerun_flops:,.0f}")
    assert traced["memplan"] == mine.saved_bytes
    assert traced["ilp"] >= ilp.saved_bytes
    assert mine.rerun_flops <= ilp.rerun_flops

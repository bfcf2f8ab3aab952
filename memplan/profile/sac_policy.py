"""The selective checkpointing policy ``memplan estimate --emit-policy torch`` prints, loaded
as a module for the reference model (``RefOptions.policy_fns``) or any other model's layers.
"""

from __future__ import annotations

from memplan.model.dims import Dims
from memplan.model.layer import has_nope_layers, ops_items, ops_kinds, ops_unkept
from memplan.model.sac_ops import resolve
from memplan.parallel import ParallelConfig
from memplan.report.sac_policy import _emit_mixed, torch_policy
from memplan.spec import ModelSpec
from memplan.workload import Workload


def emitted_module(spec: ModelSpec, wl: Workload, par: ParallelConfig | None = None) -> dict:
    """The namespace of the emitted torch policy module for ``wl``'s save set (on one rank
    of ``par``: one process by default)."""
    par = par or ParallelConfig()
    dm = Dims.of(spec, par, wl)
    if len(ops_kinds(spec)) > 1 or has_nope_layers(spec):
        # dense and MoE layers, RoPE and NoPE ones: a set and op counts per layer
        text = _emit_mixed("torch", spec, par, wl, dm)
    else:
        items = ops_items(spec, wl, dm)
        text = torch_policy(spec, items, resolve(items, wl.recompute_save, spec), "trace",
                            unkept=ops_unkept(spec, wl, dm))
    namespace: dict = {"__name__": "memplan_emitted_policy"}
    exec(compile(text, "<emitted policy>", "exec"), namespace)  # noqa: S102 (our own text)
    return namespace


def emitted_policy_fns(spec: ModelSpec, wl: Workload) -> tuple:
    """One policy per decoder layer, as the emitted module defines them."""
    return tuple(emitted_module(spec, wl)["policy_fns"])

"""memplan: per-GPU memory budgets for LLM training, before the job starts.

Importing memplan never imports torch; only ``memplan.profile`` does, lazily. The public names
below are loaded on first use (PEP 562): ``import memplan`` alone imports nothing else, so a
training loop that only needs ``memplan.monitor`` does not build the model's typed inputs, and
``memplan.estimate`` loads the model when it is first named.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # what static checkers and IDEs see; at run time __getattr__ loads them
    from memplan.api import check, estimate, make_layout, make_workload, plan
    from memplan.errors import MemplanError
    from memplan.hardware import GpuSpec, gpu_catalog, load_gpu
    from memplan.model.estimate import Estimate, PhasePeaks, StageMemory
    from memplan.parallel import ParallelConfig, ZeroStage
    from memplan.spec import ModelSpec, catalog_names, load_model, param_counts
    from memplan.workload import (
        Attention,
        NormImpl,
        Optimizer,
        OptimizerImpl,
        Precision,
        Recompute,
        Workload,
    )

__version__ = "0.1.0"

# public name -> the module that defines it
_HOMES = {
    "check": "memplan.api", "estimate": "memplan.api", "make_layout": "memplan.api",
    "make_workload": "memplan.api", "plan": "memplan.api",
    "MemplanError": "memplan.errors",
    "GpuSpec": "memplan.hardware", "gpu_catalog": "memplan.hardware",
    "load_gpu": "memplan.hardware",
    "Estimate": "memplan.model.estimate", "PhasePeaks": "memplan.model.estimate",
    "StageMemory": "memplan.model.estimate",
    "ParallelConfig": "memplan.parallel", "ZeroStage": "memplan.parallel",
    "ModelSpec": "memplan.spec", "catalog_names": "memplan.spec", "load_model": "memplan.spec",
    "param_counts": "memplan.spec",
    "Attention": "memplan.workload", "NormImpl": "memplan.workload",
    "Optimizer": "memplan.workload", "OptimizerImpl": "memplan.workload",
    "Precision": "memplan.workload", "Recompute": "memplan.workload",
    "Workload": "memplan.workload",
}

__all__ = sorted(_HOMES)


def __getattr__(name: str) -> Any:
    """A public name, imported from its module on first use (and kept in this module's
    namespace, so each is looked up once); a submodule (``memplan.spec``) the same way."""
    home = _HOMES.get(name)
    if home is not None:
        value = getattr(importlib.import_module(home), name)
    elif not name.startswith("_"):
        try:
            value = importlib.import_module(f"{__name__}.{name}")
        except ModuleNotFoundError as e:
            if e.name != f"{__name__}.{name}":
                raise
            raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_HOMES))

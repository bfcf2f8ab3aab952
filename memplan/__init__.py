"""memplan: per-GPU memory budgets for LLM training, before the job starts.

Importing memplan never imports torch; only ``memplan.profile`` does, lazily.
"""

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

__all__ = [
    "Attention", "Estimate", "GpuSpec", "MemplanError", "ModelSpec", "NormImpl", "Optimizer",
    "OptimizerImpl", "ParallelConfig", "PhasePeaks", "Precision", "Recompute", "StageMemory",
    "Workload", "ZeroStage", "catalog_names", "check", "estimate", "gpu_catalog", "load_gpu",
    "load_model", "make_layout", "make_workload", "param_counts", "plan",
]

"""Fixed per-process memory outside the tensors a training step holds.

These are defaults until ``memplan calibrate`` measures them on a machine; each names its source
and is reported on its own line, so the analytic tensor bytes stay visible next to them.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import lru_cache

from memplan.hardware import GpuSpec
from memplan.units import MiB

# The default CUDA context: what the driver holds for a process, outside PyTorch's caching
# allocator, once its first training step has run with lazy module loading (CUDA >= 11.7 loads
# a kernel when it is first used; PyTorch sets CUDA_MODULE_LOADING=LAZY since 1.13,
# pytorch/pytorch#86509): the bare context, the kernels loaded so far, and the cuBLAS and cuDNN
# handles the first step creates (their workspaces come from the caching allocator: the
# workspace line below). PyTorch's maintainers put it at "around 400MB" (#109888) and ~300 MB
# (#107667; 256-616 MiB seen across GPUs); #86509 measured 287,047,680 bytes after a first
# tensor with lazy loading and 666,632,192 with eager loading. The 1-2 GB people read in
# nvidia-smi are more than this: nvidia-smi counts the caching allocator's reserved pool as the
# process's memory, and eager loading (CUDA_MODULE_LOADING=EAGER, or CUDA < 11.7) loads every
# kernel of every library at once (over 1,000 MB, #107667). `memplan calibrate` measures it on
# a machine (memplan.profile.overhead_probe: context, first tensor, cuBLAS, attention).
CUDA_CONTEXT_BYTES = 400 * MiB
CUDA_CONTEXT_SOURCE = ("default: CUDA context after the first step with lazy module loading "
                       "(bare context, loaded kernels, cuBLAS/cuDNN handles; their workspaces "
                       "are the workspace line), ~400 MiB (pytorch/pytorch#109888); nvidia-smi's "
                       "1-2 GB also counts PyTorch's reserved pool and, with eager loading, "
                       "every kernel")

# PyTorch allocates one cuBLAS workspace per (handle, stream) from the caching allocator:
# 32 MiB on compute capability 9.x (Hopper), 4 MiB elsewhere, following cuBLAS's
# cublasSetWorkspace recommendation (pytorch/pytorch#89027, #120925).
_CUBLAS_WORKSPACE_HOPPER_BYTES = 32 * MiB
_CUBLAS_WORKSPACE_DEFAULT_BYTES = 4 * MiB

# Transformer Engine's cuBLAS workspace (transformer_engine/pytorch/cpp_extensions/gemm.py
# get_cublas_workspace_size_bytes, the same in TE v2.10 to v2.18): 32 MiB + 1,024 B from compute
# capability 9 (its NVFP4 GEMMs' alignment and scales), 4 MiB below; and TE's compute streams
# (transformer_engine/common/util/multi_stream.cpp get_num_compute_streams: 4), over which its
# grouped GEMM spreads the experts' GEMMs (common/gemm/cublaslt_gemm.cu, workspace[i % 4]).
_TE_WORKSPACE_HOPPER_BYTES = 32 * MiB + 1024
_TE_WORKSPACE_DEFAULT_BYTES = 4 * MiB
TE_COMPUTE_STREAMS = 4
# Userbuffers' overlap streams, each with its slice of TE's Userbuffers workspace
# (transformer_engine/pytorch/cpp_extensions/gemm.py _NUM_MAX_UB_STREAMS, TE 2.16 b9d690e)
TE_UB_STREAMS = 3

# The caching allocator's reserved-but-unallocated bytes (rounding, split blocks, cached free
# segments) are no flat share of the tensor peak: the caching-allocator model replays each
# stage's allocation sequence (memplan.model.reserved) and plan fits against what it reserves.
# The analytic peak counts none (allocator_fraction 0); a calibration may add what it measured
# beyond the model (the residual, memplan.calibrate.apply).
ALLOCATOR_FRACTION = 0.0
ALLOCATOR_SOURCE = ("caching-allocator model: reserved beyond the tensor peak replayed per stage "
                    "(estimate --reserved; plan fits against it), not in this peak")
# A diagnosis names measured reserved-but-unallocated bytes above this share of the reserved
# bytes (a threshold for what is worth a line, no term of the estimate).
NOTABLE_CACHE_FRACTION = 0.05


@dataclass(frozen=True)
class Overheads:
    """Per-process fixed bytes and the allocator's share of the tensor peak."""

    cuda_context_bytes: int
    cuda_context_source: str
    workspace_bytes: int
    workspace_source: str
    allocator_fraction: float
    allocator_source: str

    def allocator_bytes(self, tensor_peak_bytes: int) -> int:
        return int(tensor_peak_bytes * self.allocator_fraction)

    @property
    def fixed_bytes(self) -> int:
        return self.cuda_context_bytes + self.workspace_bytes


@lru_cache(maxsize=64)
def default_overheads(gpu: GpuSpec) -> Overheads:
    """Uncalibrated defaults for ``gpu``."""
    hopper = gpu.compute_capability.startswith("9.")
    workspace = _CUBLAS_WORKSPACE_HOPPER_BYTES if hopper else _CUBLAS_WORKSPACE_DEFAULT_BYTES
    return Overheads(
        cuda_context_bytes=CUDA_CONTEXT_BYTES,
        cuda_context_source=CUDA_CONTEXT_SOURCE,
        workspace_bytes=workspace,
        workspace_source=(f"default: cuBLAS workspace {workspace // MiB} MiB for compute capability "
                          f"{gpu.compute_capability} (pytorch/pytorch#89027, #120925)"),
        allocator_fraction=ALLOCATOR_FRACTION,
        allocator_source=ALLOCATOR_SOURCE,
    )


def te_grouped_gemm_workspace_bytes(gpu: GpuSpec) -> int:
    """Transformer Engine's grouped-GEMM workspaces on ``gpu``: gemm.py general_grouped_gemm
    takes get_cublas_workspace(device, ub=False, grouped_gemm=True), which makes one
    workspace per compute stream (tex.get_num_cublas_streams()) with torch.empty, through
    PyTorch's caching allocator, and keeps them (functools.lru_cache) from the first grouped
    GEMM to the process's end: 4 x (32 MiB + 1,024 B) from compute capability 9."""
    major = int(gpu.compute_capability.split(".")[0])
    each = _TE_WORKSPACE_HOPPER_BYTES if major >= 9 else _TE_WORKSPACE_DEFAULT_BYTES
    return TE_COMPUTE_STREAMS * each


def te_gemm_workspace_bytes(gpu: GpuSpec, ub: bool) -> int:
    """Transformer Engine's workspace for its other GEMMs on ``gpu``: gemm.py general_gemm
    takes get_cublas_workspace(device, ub is not None, False), one workspace of 32 MiB +
    1,024 B from compute capability 9 for GEMMs without Userbuffers and, with ``ub``, one of
    _NUM_MAX_UB_STREAMS (3) times that for those with them (Megatron-LM's --tp-comm-overlap:
    the row-parallel modules' weight-gradient GEMMs take none, so both are made), each made
    with torch.empty at its first GEMM and kept (functools.lru_cache). Userbuffers' own
    communication buffers are allocated outside PyTorch's allocator
    (common/comm_gemm_overlap/userbuffers register_user_buffer_collective: cudaMalloc)."""
    major = int(gpu.compute_capability.split(".")[0])
    each = _TE_WORKSPACE_HOPPER_BYTES if major >= 9 else _TE_WORKSPACE_DEFAULT_BYTES
    return each * (1 + (TE_UB_STREAMS if ub else 0))


def with_library_workspaces(ovh: Overheads, gpu: GpuSpec, te_grouped_gemm: bool,
                            te_gemm: bool = False, te_ub: bool = False) -> Overheads:
    """``ovh`` with the workspaces a job's libraries keep beside PyTorch's cuBLAS one: Transformer
    Engine's grouped-GEMM workspaces when the experts run it (``Workload.te_grouped_gemm``),
    its workspace for its other GEMMs (``te_gemm``; with Userbuffers ``te_ub``:
    ``te_gemm_workspace_bytes``), allocated bytes on the workspace line (calibration measures
    PyTorch's own only)."""
    if te_grouped_gemm:
        extra = te_grouped_gemm_workspace_bytes(gpu)
        ovh = replace(ovh, workspace_bytes=ovh.workspace_bytes + extra,
                      workspace_source=(f"{ovh.workspace_source}; Transformer Engine's grouped "
                                        f"GEMM: {TE_COMPUTE_STREAMS} cuBLAS workspaces, "
                                        f"{extra:,} B (transformer_engine/pytorch/"
                                        "cpp_extensions/gemm.py get_cublas_workspace)"))
    if te_gemm or te_ub:
        extra = te_gemm_workspace_bytes(gpu, te_ub) - (0 if te_gemm else
                                                       te_gemm_workspace_bytes(gpu, False))
        ovh = replace(ovh, workspace_bytes=ovh.workspace_bytes + extra,
                      workspace_source=(f"{ovh.workspace_source}; Transformer Engine's GEMM "
                                        f"workspace{'s with Userbuffers' if te_ub else ''}, "
                                        f"{extra:,} B (transformer_engine/pytorch/"
                                        "cpp_extensions/gemm.py get_cublas_workspace)"))
    return ovh


def no_overheads() -> Overheads:
    """Tensor bytes only: what an exact tracker on CPU sees."""
    return Overheads(0, "none", 0, "none", 0.0, "none")

"""Read the numbers out of a PyTorch out-of-memory error message, torch-free.

The caching allocator raises the message in ``c10/cuda/CUDACachingAllocator.cpp``
(``DeviceCachingAllocator::malloc``, after it has released cached blocks and retried). The
formats below were checked against ``libc10_cuda.so`` of the PyPI wheels 1.3.1, 1.4.0, 1.5.0,
1.13.1, 2.0.1, 2.1.2, 2.2.2, 2.3.1, 2.4.1, 2.5.1, 2.7.1, 2.9.1 and 2.15.0 (its strings, and from
1.13.1 on the ``c10::str<...>`` instantiation that builds the message, whose template arguments
give every piece's type in order), against pytorch/pytorch's ``CUDACachingAllocator.cpp``
(commit 001074d2), ``CUDAMallocAsyncAllocator.cpp`` (03459473) and
``c10/xpu/XPUCachingAllocator.cpp`` (00d512ae), and against messages users pasted in GitHub
issues (tests/unit/test_diagnose_formats.py).

The parenthesised format, up to 2.0 (a ``RuntimeError`` in 1.5.0, a
``torch.cuda.OutOfMemoryError`` in 1.13.1 and 2.0.1)::

    CUDA out of memory. Tried to allocate 20.00 MiB (GPU 0; 15.78 GiB total capacity; 14.56 GiB
    already allocated; 21.88 MiB free; [5.00 GiB allowed; ]14.65 GiB reserved in total by
    PyTorch)

1.3.1 ends in "14.65 GiB cached)"; 1.4.0 and 1.5.0 say "reserved in total by PyTorch)" and
print no "allowed" part. 1.13.1 and 2.0.1 print the "allowed" part
(``set_per_process_memory_fraction``) and then " If reserved memory is >> allocated memory try
setting max_split_size_mb to avoid fragmentation.  See documentation for Memory Management and
PYTORCH_CUDA_ALLOC_CONF". intel-extension-for-pytorch's XPU allocator prints this format
without the "free" part.

The sentence format, 2.1 on (``torch.cuda.OutOfMemoryError``; ``torch.OutOfMemoryError`` from
2.4)::

    CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79.10 GiB of
    which 1.50 GiB is free. [Process 4242 has 3.00 GiB memory in use. ][Including non-PyTorch
    memory, this process has 74.58 GiB memory in use. ][5.00 GiB allowed; ]Of the allocated
    memory 70.20 GiB is allocated by PyTorch, [with 1.00 GiB allocated in private pools (e.g.,
    CUDA Graphs), ]and 3.50 GiB is reserved by PyTorch but unallocated. If reserved but ...

- 2.1 spells it "total capacty" and advises max_split_size_mb; 2.2 on spell "capacity" and
  advise "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True".
- 2.1 to 2.4 print no "allowed" part at all; 2.5 on print it after the process sentences.
- 2.4 on add the private-pool clause (its size is counted in the "allocated" figure).
- 2.3 prints the device index as a raw byte (``DeviceIndex`` is ``int8_t``): GPU 0 writes a
  NUL that cuts the message after "GPU", GPU 1 to 8 a control character.
- The process sentences come from NVML (``reportProcessMemoryInfo``), one per process, this
  process's as "Including non-PyTorch memory, this process"; absent where PyTorch has no NVML
  access. NVML's "not available" (2^64 - 1 bytes) prints as "17179869184.00 GiB".
- 2.15.0 words the advice differently when expandable segments are on (after "unallocated.").

ROCm builds say "HIP out of memory" and "(e.g., HIP Graphs)". The XPU allocator
(``c10/xpu/XPUCachingAllocator.cpp``) writes the same sentences without process sentences or
private pools, and without "of which ... is free" before its main-branch form.

The cudaMallocAsync backend (``PYTORCH_CUDA_ALLOC_CONF=backend:cudaMallocAsync``,
``c10/cuda/CUDAMallocAsyncAllocator.cpp``) has its own message, exact request included::

    Allocation on device 0 would exceed allowed memory. (out of memory)
    Currently allocated     : 15.16 GiB
    Requested               : 512.00 KiB
    Device limit            : 15.99 GiB
    Free (according to CUDA): 0 bytes
    PyTorch limit (set by user-supplied memory fraction)
                            : 17179869184.00 GiB

(no fraction set: the limit is UINT64_MAX). Its device index is a raw byte in 2.3.1 to 2.7.1
too, so on GPU 0 only "Allocation on device " is left.

"Tried to allocate" is the segment the allocator asked the driver for, not the tensor: the
request rounded by ``round_size`` and then by ``get_allocation_size`` (2 MiB up to 1 MiB, 20 MiB
below 10 MiB, else a multiple of 2 MiB). Every size is ``format_size``: "N bytes" up to 1024,
else value / 1024^k with two decimals in KiB up to 1 MiB, MiB up to 1 GiB and GiB above (no
larger unit: "3725.29 GiB"); "1024.00 KiB" and "1024.00 MiB" occur. A printed size is within
0.005 units of the true bytes, so each parsed int is within ``rounding_bytes`` =
ceil(0.005 x unit): 0 for bytes, 6 B for KiB, 5,243 B for MiB, 5,368,710 B for GiB.

The CUDA runtime's own "CUDA error: out of memory" (cudaMalloc outside the caching allocator:
NCCL, cuBLAS, the context) carries no numbers; it is recognised as its own kind.

NCCL's own reports are their own kind too (``nccl``): its ``CUDACHECK``/``CUCHECK`` macros
(src/include/checks.h) log ``NCCL WARN Cuda failure 2 'out of memory'`` (the error number
first in recent releases, ``Cuda failure 'out of memory'`` before), its allocators
(src/include/alloc.h) ``NCCL WARN Failed to CUDA calloc 6291456 bytes`` (or ``calloc async``,
the one size such a log gives), and PyTorch's ``DistBackendError`` ends in NCCL's last error
(``ncclUnhandledCudaError: Call to CUDA function failed. Last error: Cuda failure 'out of
memory'``). Such an allocation is a communicator's buffers or NCCL's own state, made with
cudaMalloc or cuMem* outside PyTorch's caching allocator.
"""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass

from memplan.arguments import MAX_GPUS
from memplan.errors import MemplanError, shown
from memplan.inputs import LOG_BYTES, read_bytes
from memplan.units import MAX_INT64, GiB, KiB, MiB, ceil_div

# format_size's units (c10/cuda/CUDACachingAllocator.cpp until 2.4, then c10/core)
_UNITS = {"bytes": 1, "KiB": KiB, "MiB": MiB, "GiB": GiB}
_NUM = r"\d+(?:\.\d+)?"
_UNIT = r"(?:bytes|KiB|MiB|GiB)"


def _size(name: str) -> str:
    return rf"(?P<{name}>{_NUM})\s*(?P<{name}_u>{_UNIT})"


# a device index printed as a number, or (2.3's int8_t) as one raw control byte
_DEVICE = r"(?:(?P<dev>\d+)|(?P<devbyte>[\x00-\x08\x0e-\x1b]))?"

_HEAD = re.compile(r"(?:CUDA|HIP|XPU) out of memory\.\s*Tried to allocate\s+"
                   + _size("req"))
_EXABYTE = re.compile(r"(?:CUDA|HIP|XPU) out of memory\. Tried to allocate more than 1EB memory")
# the parenthesised format (1.x, 2.0; intel-extension-for-pytorch without "free")
_OLD = re.compile(
    r"\s*\(GPU\s*(?P<dev>\d+);\s*" + _size("total") + r" total capacity;\s*" + _size("alloc")
    + r" already allocated;\s*(?:" + _size("free") + r" free;\s*)?(?:" + _size("allowed")
    + r" allowed;\s*)?" + _size("reserved") + r" (?:reserved in total by PyTorch|cached)\)?")
# the sentence format (2.1 on, XPU)
_NEW = re.compile(
    r"\.\s*GPU ?" + _DEVICE + r"\s*has a total (?:capacity|capacty) of " + _size("total")
    + r"(?: of which " + _size("free") + r" is free)?\.\s*(?P<middle>.*?)Of the allocated memory "
    + _size("alloc") + r" is allocated by PyTorch, (?:with " + _size("private")
    + r" allocated in private pools \(e\.g\., \w+ Graphs\), )?and " + _size("unalloc")
    + r" is reserved by PyTorch but unallocated\.")
# 2.3's GPU 0: the NUL device byte ends the text the exception carries
_CUT = re.compile(r"\.\s*GPU\b(?!\s*\S*\s*has a total)")
_ALLOWED = re.compile(_size("allowed") + r" allowed;")
_PROC = re.compile(r"(?:Process (?P<pid>\d+)|Including non-PyTorch memory, this process) has "
                   + _size("used") + r" memory in use\.")
# the cudaMallocAsync backend
_ASYNC = re.compile(
    r"Allocation on device ?" + _DEVICE + r"\s*would exceed allowed memory\. \(out of memory\)"
    r"\s*Currently allocated\s*:\s*" + _size("alloc") + r"\s*Requested\s*:\s*" + _size("req")
    + r"\s*Device limit\s*:\s*" + _size("total") + r"\s*Free \(according to \w+\)\s*:\s*"
    + _size("free") + r"\s*PyTorch limit \(set by user-supplied memory fraction\)\s*:\s*"
    + _size("limit"))
_ASYNC_CUT = re.compile(r"Allocation on device\b")
_DRIVER = re.compile(r"CUDA error: out of memory")
# NCCL (see the module docstring); a line prefix "host:pid:tid [dev]" names the CUDA device
_NCCL = re.compile(r"NCCL WARN\b[^']{0,200}?out of memory|Cuda failure (?:\d+ )?'out of memory'"
                   r"|Failed to CUDA calloc(?: async)? \d+ bytes")
_NCCL_SIZE = re.compile(r"Failed to CUDA calloc(?: async)? (\d+) bytes")
_NCCL_DEVICE = re.compile(r"\[(\d+)\] (?:[\w/.]+:\d+ )?NCCL WARN")
_OTHER = re.compile(r"(MPS backend) out of memory")
# torchrun and most launchers prefix each line of a rank's output: "[rank3]: ", "3: "
_RANK_PREFIX = re.compile(r"^\s*\[(?:default)?rank(\d+)\]:\s?|^\s*(\d+):\s", re.MULTILINE)
# NVML's "not available" (2^64 - 1 bytes) prints as 17179869184.00 GiB; so does an unset
# cudaMallocAsync limit (UINT64_MAX)
_UNAVAILABLE = 2**63


# the kinds of report (OomReport.kind): the caching allocator's message, the driver's (no
# numbers), NCCL's own, a memory snapshot's
OOM_KINDS = ("allocator", "driver", "nccl", "snapshot")


@dataclass(frozen=True)
class OomReport:
    """The numbers of one out-of-memory message; sizes are int bytes, each within
    ``rounding_bytes`` of the true value (None where this format does not give it)."""

    kind: str  # "allocator" (the caching allocator's message), "driver" (no numbers),
    #            "nccl" (NCCL's own report; at most the size it failed to allocate) or
    #            "snapshot" (memplan.diagnose.snapshot: exact bytes)
    version: str  # which message format: "1.x-2.0", "2.1+", "cudaMallocAsync", "driver",
    #               "nccl" or "snapshot"
    device: int | None = None
    rank: int | None = None  # from a "[rankN]:" line prefix, when present
    # the allocation that failed: the caching allocator's segment ("Tried to allocate": the
    # request rounded up to 2 MiB, 20 MiB or a 2 MiB multiple), cudaMallocAsync's exact
    # request, a snapshot's request rounded to the allocator's block size
    requested_bytes: int | None = None
    total_bytes: int | None = None  # device total (cudaMemGetInfo)
    free_bytes: int | None = None  # device free when the allocation failed
    allowed_bytes: int | None = None  # set_per_process_memory_fraction's limit, when printed
    allocated_bytes: int | None = None  # allocated by PyTorch (live tensors; from 2.4 the
    #                                     message also counts private_pool_bytes here)
    reserved_bytes: int | None = None  # reserved by PyTorch's caching allocator
    process_bytes: int | None = None  # this process, PyTorch and non-PyTorch memory (NVML)
    other_processes_bytes: int = 0  # other processes on this GPU (NVML)
    rounding_bytes: int = 0  # largest rounding error of any size above
    # from a memory snapshot only (memplan.diagnose.snapshot)
    largest_free_block_bytes: int | None = None  # largest cached block no tensor uses
    num_segments: int | None = None
    # cached in CUDA-graph private pools, counted in allocated_bytes (2.4+ messages)
    private_pool_bytes: int | None = None

    @property
    def unallocated_bytes(self) -> int | None:
        """Reserved by PyTorch but unallocated: cached blocks no live tensor uses."""
        if self.reserved_bytes is None or self.allocated_bytes is None:
            return None
        return self.reserved_bytes - self.allocated_bytes

    @property
    def non_pytorch_bytes(self) -> int | None:
        """Memory outside PyTorch's allocator: this process's (CUDA context, NCCL, cuBLAS
        handles) when NVML reported it, else everything on the device PyTorch did not reserve
        (other processes included)."""
        if self.reserved_bytes is None:
            return None
        if self.process_bytes is not None:
            return max(self.process_bytes - self.reserved_bytes, 0)
        if self.total_bytes is None or self.free_bytes is None:
            return None
        return max(self.total_bytes - self.free_bytes - self.reserved_bytes
                   - self.other_processes_bytes, 0)


def _bytes(value: str, unit: str) -> tuple[int, int]:
    """(bytes, rounding bound) of one ``format_size`` string."""
    scale = _UNITS[unit]
    bound = 0 if unit == "bytes" else math.ceil(0.005 * scale)
    return round(float(value) * scale), bound


def _get(m: re.Match, name: str) -> tuple[int, int] | None:
    return _bytes(m.group(name), m.group(name + "_u")) if m.group(name) else None


def _device(m: re.Match) -> int | None:
    if m.group("dev"):
        return int(m.group("dev"))
    return ord(m.group("devbyte")) if m.group("devbyte") else None


def _clean(text: str) -> tuple[str, int | None]:
    """One line of text without launcher prefixes, and the rank they named (the first)."""
    rank = None
    for line in text.splitlines():  # the prefix of the line that reports the failure
        match = _RANK_PREFIX.match(line)
        if match and ("out of memory" in line or "Allocation on device" in line):
            rank = int(match.group(1) or match.group(2))
            break
    return " ".join(_RANK_PREFIX.sub("", text).split()), rank


def parse_oom(text: str) -> OomReport:
    """The first out-of-memory message in ``text`` (a log, a traceback or the message alone).

    Raises MemplanError naming what is missing when no message can be read, or a number no
    message holds (one past ``int()``'s digit limit, or a size that is inf as a float)."""
    try:
        report = _parse_oom(text)
    except MemplanError:
        raise
    except (ValueError, OverflowError):
        raise MemplanError("the out-of-memory message holds a number too long to be a size, "
                           "a device or a rank (PyTorch prints a few digits): an altered "
                           "message") from None
    for field in dataclasses.fields(report):
        value = getattr(report, field.name)
        limit = MAX_GPUS if field.name in ("device", "rank") else MAX_INT64
        if type(value) is int and not -MAX_INT64 <= value <= limit:
            raise MemplanError(f"the out-of-memory message gives {field.name} {shown(value)}, "
                               f"past {limit:,} (no device or job has as many): an altered "
                               "message")
    return report


def _parse_oom(text: str) -> OomReport:
    if not isinstance(text, str):
        raise MemplanError(f"the OOM text must be a string, not {type(text).__name__}")
    flat, rank = _clean(text)
    if not flat:
        raise MemplanError("the OOM text is empty: give the error message PyTorch printed")
    head = _HEAD.search(flat)
    if head is None:
        return _headless(flat, rank)
    requested, bound = _get(head, "req")
    rest = flat[head.end():]
    old = _OLD.match(rest)
    if old:
        return _old_report(old, requested, bound, rank)
    new = _NEW.match(rest)
    if new:
        return _new_report(new, requested, bound, rank)
    said = f"'Tried to allocate {head.group('req')} {head.group('req_u')}"
    if _CUT.match(rest):
        raise MemplanError(f"the out-of-memory message ends after {said}. GPU': PyTorch 2.3 "
                           "printed the device index as a raw byte, and GPU 0's byte (NUL) "
                           "cut the message there, so no other size survives; give a memory "
                           "snapshot (--snapshot) instead")
    raise MemplanError(f"the out-of-memory message is incomplete or altered after {said}': "
                       "expected the GPU's total capacity, free, allocated and reserved sizes")


def _headless(flat: str, rank: int | None) -> OomReport:
    """A message without "out of memory. Tried to allocate <size>"."""
    fast = _ASYNC.search(flat)
    if fast:
        return _async_report(fast, rank)
    if _EXABYTE.search(flat):
        raise MemplanError("the failed request was over 1 EB ('Tried to allocate more than "
                           "1EB memory'): a size computed wrongly, not a memory plan; the "
                           "message has no other sizes")
    if _ASYNC_CUT.search(flat):
        raise MemplanError("the cudaMallocAsync out-of-memory message stops after 'Allocation "
                           "on device': PyTorch 2.3 and later printed the device index as a "
                           "raw byte, and GPU 0's byte (NUL) cut the message there, so no size "
                           "survives; give a memory snapshot (--snapshot) instead")
    if _NCCL.search(flat):
        size, dev = _NCCL_SIZE.search(flat), _NCCL_DEVICE.search(flat)
        return OomReport(kind="nccl", version="nccl", rank=rank,
                         device=int(dev.group(1)) if dev else None,
                         requested_bytes=int(size.group(1)) if size else None)
    if _DRIVER.search(flat):
        return OomReport(kind="driver", version="driver", rank=rank)
    other = _OTHER.search(flat)
    if other:
        raise MemplanError(f"{other.group(1)} out-of-memory messages are not read; give "
                           "a CUDA, HIP or XPU caching allocator message")
    raise MemplanError("no PyTorch out-of-memory message found: expected 'CUDA out of "
                       "memory. Tried to allocate ...' (PyTorch 1.x to current), or NCCL's "
                       "\"NCCL WARN Cuda failure 2 'out of memory'\"")


def _old_report(m: re.Match, requested: int, bound: int, rank: int | None) -> OomReport:
    total, allocated, free = _get(m, "total"), _get(m, "alloc"), _get(m, "free")
    allowed, reserved = _get(m, "allowed"), _get(m, "reserved")
    bounds = [bound, *(s[1] for s in (total, allocated, free, allowed, reserved) if s)]
    return OomReport(kind="allocator", version="1.x-2.0", device=int(m.group("dev")),
                     rank=rank, requested_bytes=requested, total_bytes=total[0],
                     free_bytes=free[0] if free else None,
                     allowed_bytes=allowed[0] if allowed else None, allocated_bytes=allocated[0],
                     reserved_bytes=reserved[0], rounding_bytes=max(bounds))


def _new_report(m: re.Match, requested: int, bound: int, rank: int | None) -> OomReport:
    total, free = _get(m, "total"), _get(m, "free")  # XPU before main prints no free
    allocated, unallocated, private = _get(m, "alloc"), _get(m, "unalloc"), _get(m, "private")
    middle = m.group("middle")  # NVML process sentences and the memory-fraction limit
    allowed_m = _ALLOWED.search(middle)
    allowed = _get(allowed_m, "allowed") if allowed_m else None
    bounds = [bound, total[1], allocated[1], unallocated[1],
              *(x[1] for x in (free, allowed, private) if x)]
    process, others = None, 0
    for proc in _PROC.finditer(middle):
        size = _get(proc, "used")
        if size[0] >= _UNAVAILABLE:  # NVML had no figure for this process
            continue
        bounds.append(size[1])
        if proc.group("pid") is None:
            process = size[0]
        else:
            others += size[0]
    return OomReport(kind="allocator", version="2.1+", device=_device(m), rank=rank,
                     requested_bytes=requested, total_bytes=total[0],
                     free_bytes=free[0] if free else None,
                     allowed_bytes=allowed[0] if allowed else None,
                     allocated_bytes=allocated[0], reserved_bytes=allocated[0] + unallocated[0],
                     process_bytes=process, other_processes_bytes=others,
                     private_pool_bytes=private[0] if private else None,
                     # reserved is the sum of two rounded sizes
                     rounding_bytes=max(max(bounds), allocated[1] + unallocated[1]))


def _async_report(m: re.Match, rank: int | None) -> OomReport:
    allocated, requested = _get(m, "alloc"), _get(m, "req")
    total, free, limit = _get(m, "total"), _get(m, "free"), _get(m, "limit")
    allowed = limit if limit[0] < _UNAVAILABLE else None  # UINT64_MAX: no fraction set
    bounds = [s[1] for s in (allocated, requested, total, free, allowed) if s]
    return OomReport(kind="allocator", version="cudaMallocAsync", device=_device(m), rank=rank,
                     requested_bytes=requested[0], total_bytes=total[0], free_bytes=free[0],
                     allowed_bytes=allowed[0] if allowed else None,
                     allocated_bytes=allocated[0], rounding_bytes=max(bounds))


# The caching allocator's block sizes (c10/cuda/CUDACachingAllocator.cpp: kMinBlockSize,
# kSmallSize, kSmallBuffer, kMinLargeAlloc, kLargeBuffer, kRoundLarge).
_MIN_BLOCK, _SMALL_SIZE, _SMALL_BUFFER = 512, MiB, 2 * MiB
_MIN_LARGE_ALLOC, _LARGE_BUFFER, _ROUND_LARGE = 10 * MiB, 20 * MiB, 2 * MiB


def _round_up(n: int, unit: int) -> int:
    return ceil_div(n, unit) * unit


def segment_bytes(tensor_bytes: int) -> int:
    """The segment the caching allocator asks the driver for when no cached block serves a
    tensor of ``tensor_bytes`` (``round_size`` then ``get_allocation_size``): what its OOM
    message prints after "Tried to allocate"."""
    size = max(_MIN_BLOCK, _round_up(tensor_bytes, _MIN_BLOCK))
    if size <= _SMALL_SIZE:
        return _SMALL_BUFFER
    if size < _MIN_LARGE_ALLOC:
        return _LARGE_BUFFER
    return _round_up(size, _ROUND_LARGE)


def request_matches(oom: OomReport, tensor_bytes: int) -> bool:
    """Whether the failed allocation of ``oom`` can be one tensor of ``tensor_bytes``: the
    caching allocator reports its segment (``segment_bytes``), a snapshot the request rounded
    to 512 B, cudaMallocAsync the request itself; each within the message's rounding."""
    if oom.requested_bytes is None or oom.kind == "nccl":  # NCCL's buffers are no tensor
        return False
    if oom.kind == "allocator" and oom.version != "cudaMallocAsync":
        expected = segment_bytes(tensor_bytes)
    elif oom.kind == "snapshot":
        expected = max(_MIN_BLOCK, _round_up(tensor_bytes, _MIN_BLOCK))
    else:
        expected = tensor_bytes
    return abs(oom.requested_bytes - expected) <= oom.rounding_bytes


def read_oom_text(path: str, stdin_text: str | None = None) -> str:
    """The text of ``path`` (a log), or ``stdin_text`` when ``path`` is "-"."""
    # a log may hold any bytes (a progress bar's escapes, a cut multi-byte character): the
    # message's own lines are ASCII, so undecodable bytes are replaced, not refused
    return (stdin_text or "" if path == "-" else
            read_bytes(path, "--oom", LOG_BYTES).decode("utf-8", errors="replace"))


def read_oom(path: str, stdin_text: str | None = None, text: str | None = None) -> OomReport:
    """``parse_oom`` of a file's text, or of ``stdin_text`` when ``path`` is "-" (or of
    ``text``, that file's text already read)."""
    if text is None:
        text = read_oom_text(path, stdin_text)
    try:
        return parse_oom(text)
    except MemplanError as err:
        where = "standard input" if path == "-" else path
        raise MemplanError(f"--oom: {where}: {err}") from None



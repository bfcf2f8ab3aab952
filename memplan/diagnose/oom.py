"""Read the numbers out of a PyTorch CUDA out-of-memory error message, torch-free.

The caching allocator raises the message in ``c10/cuda/CUDACachingAllocator.cpp``
(``DeviceCachingAllocator::malloc``, after it has released cached blocks and retried). Its
format changed twice; every variant is read here:

PyTorch 1.x and 2.0 (``RuntimeError`` before 1.13, ``torch.cuda.OutOfMemoryError`` from 1.13)::

    CUDA out of memory. Tried to allocate 20.00 MiB (GPU 0; 15.78 GiB total capacity;
    14.56 GiB already allocated; 21.88 MiB free; [5.00 GiB allowed; ]14.65 GiB reserved in
    total by PyTorch) If reserved memory is >> allocated memory try setting max_split_size_mb ...

PyTorch 2.1 ("capacty" is the source's spelling in 2.1), 2.2 to 2.4 and 2.5 on
(``torch.OutOfMemoryError`` from 2.5; the advice names ``expandable_segments`` from 2.3)::

    CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79.10 GiB
    of which 1.50 GiB is free. [5.00 GiB allowed; ][Process 4242 has 3.00 GiB memory in use. ]
    [Including non-PyTorch memory, this process has 74.58 GiB memory in use. ]Of the allocated
    memory 70.20 GiB is allocated by PyTorch, and 3.50 GiB is reserved by PyTorch but
    unallocated. If reserved but unallocated memory is large try setting ...

The per-process sentences come from NVML (``reportProcessMemoryInfo``) and are absent where the
driver API is not available. ROCm builds say "HIP out of memory"; the XPU allocator's message
(``c10/xpu/XPUCachingAllocator.cpp``) has the same sentences without "of which ... is free".
PyTorch before 1.5 said "cached" where later versions say "reserved in total by PyTorch".
Every size is ``format_size``: "N bytes" up to 1 KiB, else KiB, MiB or GiB (powers of 1024)
with two decimals, so each parsed size is within half a unit in the last place of the true
bytes: ``rounding_bytes`` (0 for "bytes", 5 B for KiB, 5,243 B for MiB, 5,368,710 B for GiB).

The CUDA runtime's own "CUDA error: out of memory" (cudaMalloc outside the caching allocator:
NCCL, cuBLAS, the context) carries no numbers; it is recognised as its own kind.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from memplan.errors import MemplanError
from memplan.units import GiB, KiB, MiB

# format_size's units (c10/cuda/CUDACachingAllocator.cpp, format_size)
_UNITS = {"bytes": 1, "KiB": KiB, "MiB": MiB, "GiB": GiB}
_SIZE = r"(\d+(?:\.\d+)?)\s*(bytes|KiB|MiB|GiB)"

_HEAD = re.compile(r"(CUDA|HIP|XPU) out of memory\.\s*Tried to allocate\s+" + _SIZE)
# PyTorch 1.x / 2.0: "(GPU 0; 15.78 GiB total capacity; ...)"
_OLD = re.compile(
    r"\s*\(GPU (\d+); " + _SIZE + r" total capacity; " + _SIZE + r" already allocated; "
    + _SIZE + r" free; (?:" + _SIZE + r" allowed; )?" + _SIZE
    + r" (?:reserved in total by PyTorch|cached)\)")
# PyTorch 2.1+: sentences
_NEW = re.compile(
    r"\.\s*GPU (\d+) has a total (?:capacity|capacty) of " + _SIZE + r"(?: of which " + _SIZE
    + r" is free)?\.\s*(.*?)Of the allocated memory " + _SIZE
    + r" is allocated by PyTorch, and " + _SIZE + r" is reserved by PyTorch but unallocated\.")
_ALLOWED = re.compile(_SIZE + r" allowed;")
_PROC = re.compile(r"(Process (\d+)|Including non-PyTorch memory, this process) has "
                   + _SIZE + r" memory in use\.")
_DRIVER = re.compile(r"CUDA error: out of memory")
_OTHER = re.compile(r"(MPS backend) out of memory")
# torchrun and most launchers prefix each line of a rank's output: "[rank3]: ", "3: "
_RANK_PREFIX = re.compile(r"^\s*\[(?:default)?rank(\d+)\]:\s?|^\s*(\d+):\s", re.MULTILINE)


@dataclass(frozen=True)
class OomReport:
    """The numbers of one out-of-memory message; sizes are int bytes, each within
    ``rounding_bytes`` of the true value (None where this format does not give it)."""

    kind: str  # "allocator" (the caching allocator's message), "driver" (no numbers) or
    #            "snapshot" (memplan.diagnose.snapshot: exact bytes)
    version: str  # which message format: "1.x-2.0", "2.1+", "driver" or "snapshot"
    device: int | None = None
    rank: int | None = None  # from a "[rankN]:" line prefix, when present
    requested_bytes: int | None = None
    total_bytes: int | None = None  # device total (cudaMemGetInfo)
    free_bytes: int | None = None  # device free when the allocation failed
    allowed_bytes: int | None = None  # set_per_process_memory_fraction's limit, when set
    allocated_bytes: int | None = None  # allocated by PyTorch (live tensors)
    reserved_bytes: int | None = None  # reserved by PyTorch's caching allocator
    process_bytes: int | None = None  # this process, PyTorch and non-PyTorch memory (NVML)
    other_processes_bytes: int = 0  # other processes on this GPU (NVML)
    rounding_bytes: int = 0  # largest rounding error of any size above
    # from a memory snapshot only (memplan.diagnose.snapshot)
    largest_free_block_bytes: int | None = None  # largest cached block no tensor uses
    num_segments: int | None = None

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


def _clean(text: str) -> tuple[str, int | None]:
    """One line of text without launcher prefixes, and the rank they named (the first)."""
    rank = None
    for line in text.splitlines():  # the prefix of the line that reports the failure
        match = _RANK_PREFIX.match(line)
        if match and "out of memory" in line:
            rank = int(match.group(1) or match.group(2))
            break
    return " ".join(_RANK_PREFIX.sub("", text).split()), rank


def parse_oom(text: str) -> OomReport:
    """The first out-of-memory message in ``text`` (a log, a traceback or the message alone).

    Raises MemplanError naming what is missing when no message can be read."""
    flat, rank = _clean(text)
    if not flat:
        raise MemplanError("the OOM text is empty: give the error message PyTorch printed")
    head = _HEAD.search(flat)
    if head is None:
        if _DRIVER.search(flat):
            return OomReport(kind="driver", version="driver", rank=rank)
        other = _OTHER.search(flat)
        if other:
            raise MemplanError(f"{other.group(1)} out-of-memory messages are not read; give "
                               "a CUDA, HIP or XPU caching allocator message")
        raise MemplanError("no PyTorch out-of-memory message found: expected 'CUDA out of "
                           "memory. Tried to allocate ...' (PyTorch 1.x to current)")
    requested, bound = _bytes(head.group(2), head.group(3))
    rest = flat[head.end():]
    old = _OLD.match(rest)
    if old:
        return _old_report(old, requested, bound, rank)
    new = _NEW.match(rest)
    if new:
        return _new_report(new, requested, bound, rank)
    raise MemplanError("the out-of-memory message is incomplete or altered after 'Tried to "
                       f"allocate {head.group(2)} {head.group(3)}': expected the GPU's total "
                       "capacity, free, allocated and reserved sizes")


def _old_report(m: re.Match, requested: int, bound: int, rank: int | None) -> OomReport:
    sizes = [_bytes(m.group(i), m.group(i + 1)) if m.group(i) else None
             for i in (2, 4, 6, 8, 10)]
    total, allocated, free, allowed, reserved = sizes
    bounds = [bound, *(s[1] for s in sizes if s)]
    return OomReport(kind="allocator", version="1.x-2.0", device=int(m.group(1)), rank=rank,
                     requested_bytes=requested, total_bytes=total[0], free_bytes=free[0],
                     allowed_bytes=allowed[0] if allowed else None, allocated_bytes=allocated[0],
                     reserved_bytes=reserved[0], rounding_bytes=max(bounds))


def _new_report(m: re.Match, requested: int, bound: int, rank: int | None) -> OomReport:
    total = _bytes(m.group(2), m.group(3))
    free = _bytes(m.group(4), m.group(5)) if m.group(4) else None  # XPU's message has none
    middle = m.group(6)  # NVML process lines and the memory-fraction limit, when present
    allowed = _ALLOWED.search(middle)
    allowed_size = _bytes(allowed.group(1), allowed.group(2)) if allowed else None
    allocated, unallocated = _bytes(m.group(7), m.group(8)), _bytes(m.group(9), m.group(10))
    bounds = [bound, total[1], allocated[1], unallocated[1],
              *(x[1] for x in (free, allowed_size) if x)]
    process, others = None, 0
    for proc in _PROC.finditer(middle):
        size = _bytes(proc.group(3), proc.group(4))
        bounds.append(size[1])
        if proc.group(2) is None:
            process = size[0]
        else:
            others += size[0]
    return OomReport(kind="allocator", version="2.1+", device=int(m.group(1)), rank=rank,
                     requested_bytes=requested, total_bytes=total[0],
                     free_bytes=free[0] if free else None,
                     allowed_bytes=allowed_size[0] if allowed_size else None,
                     allocated_bytes=allocated[0], reserved_bytes=allocated[0] + unallocated[0],
                     process_bytes=process, other_processes_bytes=others,
                     # reserved is the sum of two rounded sizes
                     rounding_bytes=max(max(bounds), allocated[1] + unallocated[1]))


def read_oom(path: str, stdin_text: str | None = None) -> OomReport:
    """``parse_oom`` of a file's text, or of ``stdin_text`` when ``path`` is "-"."""
    if path == "-":
        return parse_oom(stdin_text or "")
    try:
        with open(path, encoding="utf-8", errors="replace") as fh:
            return parse_oom(fh.read())
    except OSError as err:
        raise MemplanError(f"--oom: cannot read {path}: {err.strerror}") from err

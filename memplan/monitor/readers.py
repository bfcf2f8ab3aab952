"""What ``MemoryMonitor`` reads each step: the CUDA allocator, the process, the tensor tracker.

torch-free at import: torch and the tracker are used only when the job has imported them.

- ``cuda_reader``: ``torch.cuda.memory_stats`` of the current device (allocated, reserved,
  this step's peak: the counter is reset after each read, inactive split blocks, allocation
  retries, OOMs) and the device capacity; None unless torch is imported and CUDA initialised
  (the monitor never initialises CUDA).
- ``host_reader``: the process's resident set (``rss_bytes``, ``/proc/self/statm``) and its
  high-water mark (``peak_rss_bytes``, ``resource.getrusage``; the only one where there is no
  /proc, as on macOS), the memory it may still grow
  into (``capacity_bytes`` and ``headroom_bytes``: the cgroup v2 limit and what is left of it
  when one is set, else ``MemTotal`` and ``MemAvailable`` of ``/proc/meminfo``), and, while a
  ``memplan.profile.tracker.MemoryTracker`` is active, the exact bytes of live tensors
  (``tensor_bytes``, and ``tensor_peak_bytes`` since the previous read).
"""

from __future__ import annotations

import os
import resource
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

Reader = Callable[[], dict[str, int]]

_STAT_KEYS = {"allocated_bytes": "allocated_bytes.all.current",
              "reserved_bytes": "reserved_bytes.all.current",
              "peak_bytes": "allocated_bytes.all.peak",
              "inactive_split_bytes": "inactive_split_bytes.all.current",
              "alloc_retries": "num_alloc_retries", "num_ooms": "num_ooms"}
_STATM = Path("/proc/self/statm")
_MEMINFO = Path("/proc/meminfo")
_CGROUP = Path("/sys/fs/cgroup")
_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
# getrusage's ru_maxrss unit: KiB on Linux, bytes on macOS (getrusage(2) on each)
_MAXRSS_UNIT = 1 if sys.platform == "darwin" else 1024


def cuda_reader() -> Reader | None:
    """The CUDA allocator's counters, or None when torch is not imported or CUDA is not up
    (the monitor never initialises CUDA itself)."""
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return None
    device = torch.cuda.current_device()
    capacity = torch.cuda.get_device_properties(device).total_memory

    def read() -> dict[str, int]:
        stats = torch.cuda.memory_stats(device)
        torch.cuda.reset_peak_memory_stats(device)
        out = {k: int(stats.get(v, 0)) for k, v in _STAT_KEYS.items()}
        out["capacity_bytes"] = capacity
        return out

    return read


def _rss() -> dict[str, int]:
    """``rss_bytes`` (``/proc/self/statm``) and ``peak_rss_bytes`` of this process. The kernel
    raises getrusage's high-water mark lazily (when the resident set shrinks), so the peak is
    the larger of it and the resident set now."""
    out = {}
    try:
        out["rss_bytes"] = int(_STATM.read_bytes().split()[1]) * _PAGE
    except (OSError, ValueError, IndexError):
        pass
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * _MAXRSS_UNIT
    out["peak_rss_bytes"] = max(peak, out.get("rss_bytes", 0))
    return out


def _meminfo() -> dict[str, int]:
    """``MemTotal`` and ``MemAvailable`` of ``/proc/meminfo`` (its first lines), in bytes."""
    out = {}
    try:
        with _MEMINFO.open("rb") as f:
            head = f.read(512)
        for line in head.splitlines():
            key, _, rest = line.partition(b":")
            if key in (b"MemTotal", b"MemAvailable"):  # the file's unit is kB (KiB)
                out[key.decode()] = int(rest.split()[0]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return out


def _cgroup() -> Path | None:
    """This process's cgroup v2 folder when it sets a memory limit, else None."""
    try:
        entry = Path("/proc/self/cgroup").read_text().splitlines()[0]
        group = _CGROUP / entry.partition("::")[2].lstrip("/")
        if (group / "memory.max").read_text().strip() == "max":
            return None
        return group
    except (OSError, ValueError, IndexError):
        return None


def _cgroup_limit(group: Path) -> tuple[int, int] | None:
    """(limit, usage) of a cgroup v2 memory controller."""
    try:
        return (int((group / "memory.max").read_text()),
                int((group / "memory.current").read_text()))
    except (OSError, ValueError):
        return None


def active_tracker() -> Any | None:
    """The innermost active ``MemoryTracker`` when torch and the tracker are imported."""
    if "memplan.profile.tracker" not in sys.modules:
        return None
    tracker_type = sys.modules["memplan.profile.tracker"].MemoryTracker
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    modes = [m for m in _get_current_dispatch_mode_stack() if isinstance(m, tracker_type)]
    return modes[-1] if modes else None


def host_reader() -> Reader:
    """The process's memory and, under an active tracker, its exact tensor bytes."""
    group = _cgroup()  # found once: a job does not move between cgroups

    def read() -> dict[str, int]:
        out = _rss()
        limit = _cgroup_limit(group) if group is not None else None
        if limit is not None:
            out["capacity_bytes"], out["headroom_bytes"] = limit[0], max(limit[0] - limit[1], 0)
        else:
            info = _meminfo()
            if "MemTotal" in info and "MemAvailable" in info:
                out["capacity_bytes"], out["headroom_bytes"] = info["MemTotal"], info[
                    "MemAvailable"]
        tracker = active_tracker()
        if tracker is not None:
            out["tensor_bytes"] = tracker.total_bytes
            out["tensor_peak_bytes"] = tracker.take_high_water()
        return out

    return read


def default_reader() -> Reader:
    """The CUDA allocator's counters with the process's memory when CUDA is up, else the
    process's memory (``host_reader``). The CUDA keys win where both name one."""
    host, cuda = host_reader(), cuda_reader()
    if cuda is None:
        return host

    def read() -> dict[str, int]:
        out = host()
        # on CUDA, capacity and headroom are the device's (the monitor derives headroom)
        out.pop("capacity_bytes", None)
        out.pop("headroom_bytes", None)
        return {**out, **cuda()}

    return read


__all__ = ["Reader", "active_tracker", "cuda_reader", "default_reader", "host_reader"]

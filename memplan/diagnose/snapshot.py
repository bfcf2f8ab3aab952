"""Read a memory snapshot from ``torch.cuda.memory._dump_snapshot`` without torch.

The file is a pickle of plain dicts and lists (``torch.cuda.memory._snapshot``): "segments",
each with "device", "total_size", "allocated_size" and "blocks" (each "size" and "state":
"active_allocated", "active_pending_free" or "inactive"), and "device_traces", one list of
events per device, where an "oom" event carries the requested "size" and "device_free".

A pickle can run code when loaded, so it is read only when the caller says the file is
trusted, and then by an unpickler that refuses every global: a snapshot needs none, so a
file that names one is not a snapshot.
"""

from __future__ import annotations

import io
import pickle
from typing import Any

from memplan.diagnose.oom import OomReport
from memplan.errors import MemplanError

REFUSE = ("{path} is a pickle, and loading a pickle can run arbitrary code; memplan reads it "
          "only with --trust-pickle, for a file you made yourself with "
          "torch.cuda.memory._dump_snapshot")


class _NoGlobals(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        raise MemplanError(f"the snapshot names {module}.{name}: a memory snapshot holds only "
                           "dicts, lists, strings and numbers, so this file is not one")


def load_snapshot(path: str, *, trust_pickle: bool) -> dict[str, Any]:
    """The snapshot dict in ``path``; MemplanError without ``trust_pickle`` or if unreadable."""
    if not trust_pickle:
        raise MemplanError(REFUSE.format(path=path))
    try:
        with open(path, "rb") as fh:
            data = _NoGlobals(io.BytesIO(fh.read())).load()
    except OSError as err:
        raise MemplanError(f"--snapshot: cannot read {path}: {err.strerror}") from err
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError) as err:
        if isinstance(err, MemplanError):
            raise
        raise MemplanError(f"--snapshot: {path} is not a readable pickle ({err})") from err
    if not isinstance(data, dict) or not isinstance(data.get("segments"), list):
        raise MemplanError(f"--snapshot: {path} has no 'segments' list: not a snapshot from "
                           "torch.cuda.memory._dump_snapshot")
    return data


def snapshot_report(data: dict[str, Any], device: int | None = None) -> OomReport:
    """The allocator's state in the snapshot as an ``OomReport`` (exact bytes): reserved and
    allocated from the segments of ``device`` (the first device seen when None), the
    requested size and device free memory from the last "oom" event when there is one."""
    segments = [s for s in data["segments"] if isinstance(s, dict)]
    if device is None:
        device = segments[0].get("device", 0) if segments else 0
    try:
        mine = [s for s in segments if s.get("device", 0) == device]
        reserved = sum(int(s["total_size"]) for s in mine)
        allocated = sum(int(s["allocated_size"]) for s in mine)
        free_blocks = [int(b["size"]) for s in mine for b in s.get("blocks", [])
                       if b.get("state") == "inactive"]
    except (KeyError, TypeError, ValueError) as err:
        raise MemplanError(f"--snapshot: a segment lacks {err}: not a snapshot from "
                           "torch.cuda.memory._dump_snapshot") from err
    traces = data.get("device_traces") or []
    events = traces[device] if isinstance(traces, list) and device < len(traces) else []
    ooms = [e for e in events if isinstance(e, dict) and e.get("action") == "oom"]
    last = ooms[-1] if ooms else {}
    return OomReport(kind="snapshot", version="snapshot", device=device,
                     requested_bytes=int(last["size"]) if "size" in last else None,
                     free_bytes=int(last["device_free"]) if "device_free" in last else None,
                     allocated_bytes=allocated, reserved_bytes=reserved,
                     largest_free_block_bytes=max(free_blocks, default=0),
                     num_segments=len(mine))

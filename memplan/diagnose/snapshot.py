"""Read a memory snapshot from ``torch.cuda.memory._dump_snapshot`` without torch.

``_dump_snapshot`` (2.1 on) pickles ``torch.cuda.memory._snapshot()``: the dict that
``THCPModule_memorySnapshot`` (``torch/csrc/cuda/Module.cpp``) builds, with the keys that
``torch::cuda::_memory_snapshot_pickled`` (``torch/csrc/cuda/memory_snapshot.cpp``) pickles from
C++ and ``torch.xpu.memory._snapshot()`` returns for XPU. Checked against pytorch/pytorch's
``memory_snapshot.cpp`` (commit 00067369) and ``Module.cpp`` (003ce815), the key strings in
``libtorch_python.so`` of the 1.13.1, 2.0.1, 2.2.2 to 2.5.1, 2.9.1 and 2.15.0 wheels, and
their ``torch/cuda/memory.py`` and ``_memory_viz.py`` (and 2.13.0's):

- "segments": one dict per cudaMalloc'd segment of every device (per mapped range of an
  expandable segment): "device", "address", "total_size", "allocated_size", "active_size",
  "requested_size", "stream", "segment_type" ("large"/"small"), "segment_pool_id" (a tuple;
  (0, 0) outside CUDA-graph private pools), "is_expandable", "frames", and "blocks" in address
  order, each "address", "size", "requested_size", "state" and "frames". The state is
  "active_allocated" (a live tensor), "active_pending_free" (freed, waiting for another stream;
  the docstring of ``torch.cuda.memory._snapshot`` calls it "active_awaiting_free", which no
  writer emits) or "inactive" (cached and free). ``total_size`` is the sum of the block sizes,
  ``allocated_size`` that of the "active_allocated" blocks.
- "device_traces": one list of events per device index, each "action", "addr" (for "oom":
  "device_free", cudaMemGetInfo's free bytes), "size", "stream", maybe "frames", and from
  2.2.2 on (not in 2.0.1) "time_us".
  An "oom" event's size is the request rounded by ``round_size`` (``params.size()``), not the
  segment size the message prints after "Tried to allocate".
- "allocator_settings" and "external_annotations", and more keys in newer versions (2.15.0
  has "compile_context", "user_metadata", "forward_frames"); none is read here.

1.13 and 2.0 have no ``_dump_snapshot``; 1.13's ``_snapshot()`` and every version's
``torch.cuda.memory_snapshot()`` return the list of segments alone, which is read too (blocks
then carry "history" entries with "real_size", and no "requested_size").

A pickle can run code when loaded, so it is read only when the caller says the file is
trusted, and then by an unpickler that refuses every global and persistent id: a snapshot
holds only dicts, lists, tuples, strings, numbers and booleans (Python's pickle of the dict, or
the TorchScript pickler of ``memory_snapshot.cpp``, which writes no type tags there), so a file
that names a callable is not a snapshot.
"""

from __future__ import annotations

import io
import pickle
from typing import Any

from memplan.diagnose.oom import OomReport
from memplan.errors import MemplanError, shown
from memplan.inputs import SNAPSHOT_BYTES, read_bytes, too_large


REFUSE = ("{path} is a pickle, and loading a pickle can run arbitrary code; memplan reads it "
          "only with --trust-pickle, for a file you made yourself with "
          "torch.cuda.memory._dump_snapshot")
STATES = ("active_allocated", "active_pending_free", "inactive")


class _NoGlobals(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        raise MemplanError(f"the snapshot names {module}.{name}: a memory snapshot holds only "
                           "dicts, lists, strings and numbers, so this file is not one")

    def persistent_load(self, pid: Any) -> Any:
        raise MemplanError("the snapshot holds a persistent id: a memory snapshot holds only "
                           "dicts, lists, strings and numbers, so this file is not one")


def load_snapshot(path: str, *, trust_pickle: bool) -> dict[str, Any]:
    """The snapshot dict in ``path``; MemplanError without ``trust_pickle`` or if unreadable."""
    if not trust_pickle:
        raise MemplanError(REFUSE.format(path=path))
    raw = read_bytes(path, "--snapshot", SNAPSHOT_BYTES)
    try:
        data = _NoGlobals(io.BytesIO(raw)).load()
    except MemplanError:
        raise
    except Exception as err:  # a damaged pickle raises nearly anything
        raise MemplanError(f"--snapshot: {path} is not a readable pickle "
                           f"({type(err).__name__}: {err})") from err
    if isinstance(data, list):  # torch.cuda.memory_snapshot(), 1.13's _snapshot()
        data = {"segments": data}
    if not isinstance(data, dict) or not isinstance(data.get("segments"), list):
        raise MemplanError(f"--snapshot: {path} has no 'segments' list: not a snapshot from "
                           "torch.cuda.memory._dump_snapshot")
    entries = _entries(data)
    if entries > len(raw):
        raise MemplanError(f"--snapshot: {path} holds {entries:,} segments, blocks and events "
                           f"in {len(raw):,} bytes: a pickle that repeats shared references, "
                           "not a snapshot (each entry of one takes bytes of its own)")
    return data


def _entries(data: dict[str, Any]) -> int:
    """Segments, blocks and trace events as the reader will visit them (a shared list counted
    each time it is referenced), counted by their lengths without visiting them: a pickle of
    a few bytes can reference one list of a million blocks a million times."""
    segments = data["segments"]
    count = len(segments) + sum(len(seg["blocks"]) for seg in segments
                                if isinstance(seg, dict) and isinstance(seg.get("blocks"), list))
    traces = data.get("device_traces")
    if isinstance(traces, list):
        count += len(traces) + sum(len(t) for t in traces if isinstance(t, list))
    return count


def _int(value: Any, what: str) -> int:
    """A byte count: an int from 0 to ``MAX_INT64`` (the allocator's sizes are 64-bit)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 0 or too_large(value):
        raise MemplanError(f"--snapshot: {what} is {shown(value)}, not a byte count: not a "
                           "snapshot from torch.cuda.memory._dump_snapshot")
    return value


def _segment(seg: Any, i: int) -> tuple[int, int, list[int]]:
    """(total, allocated, free block sizes) of segment ``i``, checked against its blocks."""
    if not isinstance(seg, dict):
        raise MemplanError(f"--snapshot: segment {i} is a {type(seg).__name__}, not a dict")
    for key in ("total_size", "allocated_size"):
        if key not in seg:
            raise MemplanError(f"--snapshot: segment {i} lacks '{key}': not a snapshot from "
                               "torch.cuda.memory._dump_snapshot")
    total = _int(seg["total_size"], f"segment {i}'s total_size")
    allocated = _int(seg["allocated_size"], f"segment {i}'s allocated_size")
    blocks = seg.get("blocks")
    if blocks is None:
        return total, allocated, []
    if not isinstance(blocks, list):
        raise MemplanError(f"--snapshot: segment {i}'s blocks are a {type(blocks).__name__}, "
                           "not a list")
    sizes, live, free = 0, 0, []
    for j, block in enumerate(blocks):
        if not isinstance(block, dict) or "size" not in block:
            raise MemplanError(f"--snapshot: block {j} of segment {i} has no 'size'")
        size = _int(block["size"], f"block {j} of segment {i}'s size")
        state = block.get("state")
        if state not in STATES:
            raise MemplanError(f"--snapshot: block {j} of segment {i} has state {state!r}; "
                               f"PyTorch writes {', '.join(STATES)}")
        sizes += size
        if state == "active_allocated":
            live += size
        elif state == "inactive":
            free.append(size)
    if blocks and (sizes, live) != (total, allocated):
        raise MemplanError(f"--snapshot: segment {i}'s blocks add up to {sizes} bytes "
                           f"({live} allocated), its total_size says {total} ({allocated}): "
                           "the file is damaged or edited")
    return total, allocated, free


def _oom_events(data: dict[str, Any]) -> list[tuple[int, int, dict[str, Any]]]:
    """(device, position, event) of every "oom" event in the traces."""
    traces = data.get("device_traces")
    if not isinstance(traces, list):
        return []
    return [(dev, k, e) for dev, events in enumerate(traces) if isinstance(events, list)
            for k, e in enumerate(events) if isinstance(e, dict) and e.get("action") == "oom"]


def snapshot_report(data: dict[str, Any], device: int | None = None) -> OomReport:
    """The allocator's state in the snapshot as an ``OomReport`` (exact bytes): reserved and
    allocated from the segments of ``device``, the requested size and device free memory from
    its last "oom" event when there is one. Without ``device``: the device of the latest "oom"
    event (by "time_us" where recorded), else that of the first segment."""
    segments = data["segments"]
    ooms = _oom_events(data)
    if device is None:
        if ooms:
            device = max(ooms, key=lambda o: (o[2].get("time_us", 0)
                                               if isinstance(o[2].get("time_us"), int) else 0,
                                               o[1]))[0]
        else:
            first = segments[0] if segments and isinstance(segments[0], dict) else {}
            device = first.get("device", 0)
            if not isinstance(device, int) or isinstance(device, bool):
                raise MemplanError(f"--snapshot: segment 0's device is {device!r}, not an index")
    reserved = allocated = count = 0
    free: list[int] = []
    for i, seg in enumerate(segments):  # every segment is checked, the device's are summed
        total, live, blocks = _segment(seg, i)
        if seg.get("device", 0) == device:
            reserved, allocated, count = reserved + total, allocated + live, count + 1
            free += blocks
    mine = [e for dev, _, e in ooms if dev == device]
    last = mine[-1] if mine else {}
    requested = _int(last["size"], "the oom event's size") if "size" in last else None
    device_free = (_int(last["device_free"], "the oom event's device_free")
                   if "device_free" in last else None)
    return OomReport(kind="snapshot", version="snapshot", device=device,
                     requested_bytes=requested, free_bytes=device_free,
                     allocated_bytes=allocated, reserved_bytes=reserved,
                     largest_free_block_bytes=max(free, default=0), num_segments=count)


def snapshot_died_in(data: dict[str, Any]) -> Any:
    """Where the latest "oom" event's frames (recorded with ``_record_memory_history``'s
    context) say the job died (``memplan.diagnose.traceback.DiedIn``), else None."""
    from memplan.diagnose.traceback import frames_of, phase_of_frames

    ooms = _oom_events(data)
    if not ooms:
        return None
    _, _, last = max(ooms, key=lambda o: (o[2].get("time_us", 0)
                                          if isinstance(o[2].get("time_us"), int) else 0, o[1]))
    frames = last.get("frames")
    return phase_of_frames(frames_of(frames)) if isinstance(frames, list) else None


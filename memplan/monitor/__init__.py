"""The production memory monitor: per-step memory of a running training job, torch-free at import.

``memory_monitor`` (``MemoryMonitor``: one JSONL record per step and rank, warnings as they
happen), ``callbacks`` (transformers' and Lightning's callback protocols), ``readers`` (where a
step's counters come from: CUDA's allocator or the host), ``window`` (the leak rule's rolling
windows), ``trend`` (Theil-Sen growth with rising floors), ``records`` (a run's files read back
and summarised), ``sinks`` (the same numbers, opt-in, as TensorBoard scalars and W&B history).
"""

from memplan.monitor.memory_monitor import (
    LEAK_BYTES,
    LEAK_WINDOW,
    WARN_EVERY,
    MemoryMonitor,
    cuda_reader,
    host_reader,
    read_records,
    run_trend,
    summarize,
)

__all__ = ["LEAK_BYTES", "LEAK_WINDOW", "WARN_EVERY", "MemoryMonitor", "cuda_reader",
           "host_reader", "read_records", "run_trend", "summarize"]

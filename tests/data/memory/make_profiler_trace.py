"""Write ``cpu_step.pt.trace.json``: a real torch.profiler trace of two training steps of a
small MLP on CPU with ``profile_memory=True`` (the "[memory]" instant events the memory
timeline reads). Run from the repository root:

    python tests/data/memory/make_profiler_trace.py

The model: Linear(256, 1024) -> ReLU -> Linear(1024, 256), fp32, AdamW (foreach=False: the
for-loop step, what torch runs on CPU by default), batch 64; two steps, each marked by
``prof.step()`` under a schedule of two active steps (ProfilerStep#0 and #1), the optimizer step by torch's own record_function
("Optimizer.step#AdamW.step", torch/optim/optimizer.py profile_hook_step).
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import torch

OUT = Path(__file__).with_name("cpu_step.pt.trace.json.gz")


def main(out: Path = OUT) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.ReLU(),
                                torch.nn.Linear(1024, 256))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False)
    x, y = torch.randn(64, 256), torch.randn(64, 256)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU],
                                profile_memory=True,
                                schedule=torch.profiler.schedule(wait=0, warmup=0, active=2,
                                                                 repeat=1)) as prof:
        for _ in range(2):
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            prof.step()
    raw = out.with_suffix("")
    prof.export_chrome_trace(str(raw))
    data = json.loads(raw.read_text())
    raw.unlink()
    # keep what the timeline reads: the memory events, the steps and the operators
    data["traceEvents"] = [e for e in data["traceEvents"] if e.get("ph") in ("i", "X")]
    out.write_bytes(gzip.compress(json.dumps(data, separators=(",", ":")).encode(), mtime=0))


if __name__ == "__main__":
    import sys

    main(Path(sys.argv[1]) if len(sys.argv) > 1 else OUT)

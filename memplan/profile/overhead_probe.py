"""Fixed CUDA overheads, each measured in fresh processes (``python -m`` this module).

``mem_get_info`` needs a context, so a process cannot see the device before its own context
exists. The context is therefore measured across two processes: the first (``hold``) reports
the device's used bytes with its own context alive and waits; the second (``steps``) reports
its used bytes at start, which include both contexts, so the difference is one bare context.
The second process then reports the growth after ``torch.ones((1, 1)).to("cuda")`` (the first
allocator segment and the kernels it loads), the first bf16 matmul (cuBLAS handle and
workspace), and the first flash SDPA call (its kernels). The calling process never touches the
device here.
"""

from __future__ import annotations

import json
import subprocess
import sys

from memplan.errors import MemplanError

PROBE_TIMEOUT_S = 300


def _used() -> int:
    import torch

    free, total = torch.cuda.mem_get_info()
    return total - free


def hold() -> None:
    print(json.dumps({"used": _used()}), flush=True)
    sys.stdin.readline()


def steps() -> None:
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    out = {"init": _used()}
    torch.ones((1, 1)).to("cuda")
    torch.cuda.synchronize()
    out["first_tensor"] = _used()
    a = torch.randn(1024, 1024, device="cuda", dtype=torch.bfloat16)
    (a @ a).sum().item()
    out["cublas"] = _used()
    q = torch.randn(1, 16, 1024, 128, device="cuda", dtype=torch.bfloat16)
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
        F.scaled_dot_product_attention(q, q, q, is_causal=True).sum().item()
    out["sdpa"] = _used()
    print(json.dumps(out), flush=True)


def run_probes() -> dict[str, int]:
    """Device-used growth in bytes: context, first_tensor, cublas, sdpa (see the docstring)."""
    cmd = [sys.executable, "-m", "memplan.profile.overhead_probe"]
    first = subprocess.Popen([*cmd, "hold"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    try:
        held = json.loads(first.stdout.readline())  # type: ignore[union-attr]
        second = subprocess.run([*cmd, "steps"], capture_output=True, text=True,
                                timeout=PROBE_TIMEOUT_S, check=True)
        got = json.loads(second.stdout.strip().splitlines()[-1])
    except (json.JSONDecodeError, IndexError, subprocess.SubprocessError) as err:
        detail = getattr(err, "stderr", None) or str(err)
        raise MemplanError(f"overhead probe failed: {detail.strip().splitlines()[-1:]}") from err
    finally:
        if first.stdin:
            first.stdin.write("\n")
            first.stdin.close()
        first.wait(timeout=PROBE_TIMEOUT_S)
    return {"context": got["init"] - held["used"],
            "first_tensor": got["first_tensor"] - got["init"],
            "cublas": got["cublas"] - got["first_tensor"],
            "sdpa": got["sdpa"] - got["cublas"]}


if __name__ == "__main__":
    {"hold": hold, "steps": steps}[sys.argv[1]]()

"""Fixed CUDA overheads, each measured in fresh processes (``python -m`` this module).

``mem_get_info`` needs a context, so a process cannot see the device before its own context
exists. The context is therefore measured across two processes: the first (``hold``) reports
the device's used bytes with its own context alive and waits; the second (``steps``) reports
its used bytes at start, which include both contexts, so the difference is one bare context.
The second process then reports the growth after ``torch.ones((1, 1)).to("cuda")`` (the first
allocator segment and the kernels it loads), the first bf16 matmul (cuBLAS handle and
workspace), and the first flash SDPA call (its kernels). The calling process never touches the
device here; without a CUDA device (asked in the first process, before it makes a context) or
when a probe process fails, ``run_probes`` raises ``MemplanError`` with one line saying why.

What the probes measure is what ``memplan.overheads``' default CUDA context (400 MiB) stands
for until they run: ``context`` the bare context, ``first_tensor``, ``cublas`` and ``sdpa`` what
the first step adds outside the caching allocator (its first segment and kernels, the cuBLAS
handle and its kernels, the attention kernels).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

from memplan.errors import MemplanError

PROBE_TIMEOUT_S = 300


def _used() -> int:
    import torch

    free, total = torch.cuda.mem_get_info()
    return total - free


def _no_cuda() -> str | None:
    """Why this process cannot probe the device, or None (asked before any context exists)."""
    import torch

    if torch.cuda.is_available():
        return None
    return (f"no CUDA device is visible (torch {torch.__version__}, built for CUDA "
            f"{torch.version.cuda}, CUDA_VISIBLE_DEVICES="
            f"{os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')!s})")


def hold() -> None:
    why = _no_cuda()
    if why is not None:
        print(json.dumps({"error": why}), flush=True)
        return
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


def _last_line(text: str | None) -> str:
    lines = [line for line in (text or "").strip().splitlines() if line.strip()]
    return lines[-1] if lines else "no output"


def _answer(line: str, proc: subprocess.Popen[str], what: str) -> dict[str, int]:
    """The JSON a probe process printed, or MemplanError saying why there is none."""
    try:
        got = json.loads(line)
    except json.JSONDecodeError:
        proc.kill()
        _, err = proc.communicate(timeout=PROBE_TIMEOUT_S)
        raise MemplanError(f"overhead probe: the {what} process ended without a result "
                           f"(exit {proc.returncode}): {_last_line(err)}") from None
    if "error" in got:
        raise MemplanError(f"overhead probe needs a CUDA GPU: {got['error']}")
    return got


def _release(proc: subprocess.Popen[str]) -> None:
    """Let the holding process go (it may have ended already) and reap it."""
    try:
        if proc.stdin and not proc.stdin.closed:
            proc.stdin.write("\n")
            proc.stdin.close()
    except (BrokenPipeError, OSError):  # it has exited: nothing to release
        pass
    try:
        proc.wait(timeout=PROBE_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def run_probes() -> dict[str, int]:
    """Device-used growth in bytes: context, first_tensor, cublas, sdpa (see the docstring).
    Raises MemplanError (one line) without a CUDA device or when a probe process fails."""
    cmd = [sys.executable, "-m", "memplan.profile.overhead_probe"]
    first = subprocess.Popen([*cmd, "hold"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    try:
        held = _answer(first.stdout.readline(), first, "first")  # type: ignore[union-attr]
        try:
            second = subprocess.run([*cmd, "steps"], capture_output=True, text=True, check=False,
                                    timeout=PROBE_TIMEOUT_S)
        except subprocess.TimeoutExpired as err:
            raise MemplanError(f"overhead probe: the second process ran past "
                               f"{PROBE_TIMEOUT_S} s") from err
        if second.returncode != 0:
            raise MemplanError(f"overhead probe: the second process failed (exit "
                               f"{second.returncode}): {_last_line(second.stderr)}")
        try:
            got = json.loads(second.stdout.strip().splitlines()[-1])
        except (json.JSONDecodeError, IndexError) as err:
            raise MemplanError(f"overhead probe: the second process printed no result: "
                               f"{_last_line(second.stderr)}") from err
    finally:
        _release(first)
    return {"context": got["init"] - held["used"],
            "first_tensor": got["first_tensor"] - got["init"],
            "cublas": got["cublas"] - got["first_tensor"],
            "sdpa": got["sdpa"] - got["cublas"]}


if __name__ == "__main__":
    {"hold": hold, "steps": steps}[sys.argv[1]]()

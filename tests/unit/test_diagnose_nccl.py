"""NCCL's own out-of-memory reports: recognised by ``parse_oom`` in the forms NCCL and PyTorch
print them (lines as users pasted them in NVIDIA/nccl and PyTorch issues), explained by
``diagnose`` (an allocation outside PyTorch's allocator) with what helps."""

from __future__ import annotations

import pytest

import memplan
from memplan.cli import main
from memplan.diagnose import diagnose
from memplan.diagnose.oom import parse_oom, request_matches

# NCCL's CUDACHECK before the error number was printed (NVIDIA/TensorRT-LLM #1670)
OLD = "VM-0-16-ubuntu:392:494 [2] enqueue.cc:43 NCCL WARN Cuda failure 'out of memory'\n"
# include/alloc.h's two lines: the CUDA error, then the size (NVIDIA/nccl #1235)
CALLOC = ("ng30903:3063028:3066152 [3] include/alloc.h:178 NCCL WARN Cuda failure 2 'out of "
          "memory'\nng30903:3063028:3066152 [3] include/alloc.h:185 NCCL WARN Failed to CUDA "
          "calloc 6291456 bytes\nng30903:3063028:3066152 [3] NCCL INFO transport/p2p.cc:204 -> 1\n")
# PyTorch's error carrying NCCL's last error, each line prefixed by torchrun
TORCH = ("[rank5]: torch.distributed.DistBackendError: NCCL error in: /pytorch/torch/csrc/"
         "distributed/c10d/ProcessGroupNCCL.cpp:3356, unhandled cuda error (run with "
         "NCCL_DEBUG=INFO for details), NCCL version 2.21.5\n[rank5]: ncclUnhandledCudaError: "
         "Call to CUDA function failed.\n[rank5]: Last error:\n[rank5]: Cuda failure 'out of "
         "memory'\n")


@pytest.mark.parametrize("text, device, rank, requested", [
    (OLD, 2, None, None),
    (CALLOC, 3, None, 6_291_456),
    ("h:1:2 [0] NCCL WARN Failed to CUDA calloc async 2432 bytes", 0, None, 2432),
    (TORCH, None, 5, None),
    ("misc/cudawrap.cc:188 NCCL WARN Cuda failure 2 'out of memory'", None, None, None),
])
def test_nccl_messages_recognised(text, device, rank, requested):
    r = parse_oom(text)
    assert (r.kind, r.version, r.device, r.rank, r.requested_bytes) == (
        "nccl", "nccl", device, rank, requested)
    assert not request_matches(r, 6_291_456)  # NCCL's buffer is no tensor of the model


def test_allocator_message_wins_over_an_nccl_line():
    """A log with NCCL's warning and then PyTorch's own message: the sizes are in PyTorch's."""
    text = OLD + ("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU "
                  "0 has a total capacity of 79.10 GiB of which 1.50 GiB is free. Of the "
                  "allocated memory 70.20 GiB is allocated by PyTorch, and 3.50 GiB is reserved "
                  "by PyTorch but unallocated.")
    assert parse_oom(text).kind == "allocator"


def test_diagnose_explains_nccl_oom():
    r = diagnose("llama-7b", oom=CALLOC, gpus=8, zero=3, fixes=False)
    first = r.diagnosis.findings[0]
    est = memplan.estimate("llama-7b", gpus=8, zero=3)
    assert first.kind == "nccl" and first.cause
    assert first.sizes == {"headroom_bytes": est.capacity_bytes - est.worst.peak_bytes,
                           "requested_bytes": 6_291_456}
    for words in ("outside PyTorch's caching allocator", "NCCL_BUFFSIZE", "fewer communicators",
                  "init_process_group(device_id=...)", "expandable_segments",
                  "docs.nvidia.com/deeplearning/nccl/user-guide/docs/env.html"):
        assert words in first.text


def test_cli_nccl_oom(tmp_path, capsys):
    log = tmp_path / "rank3.log"
    log.write_text(CALLOC)
    assert main(["diagnose", "-m", "llama-7b", "-n", "8", "--zero", "3", "--oom", str(log),
                 "--no-fixes"]) == 0
    out = capsys.readouterr().out
    assert "error: NCCL out of memory, GPU 3: an allocation of 6.00 MiB failed" in out
    assert "NCCL itself ran out of memory (it failed to allocate 6.00 MiB)" in out

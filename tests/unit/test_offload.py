"""Optimizer offload with ZeRO (ZeRO-Offload): what leaves the GPU, what the host holds, what it costs.

Hand derivations for Llama-2-7B (6,738,415,616 parameters) on 8 H100s, ZeRO-1: each rank's
optimizer partition is ceil(6,738,415,616 / 8) = 842,301,952 parameters.
"""

from __future__ import annotations

import pytest

import memplan
from memplan.cli import main
from memplan.diagnose import diagnose
from memplan.diagnose.fixes import time_of
from memplan.errors import MemplanError
from memplan.hardware import gpu_catalog
from memplan.report.diagnose import fix_note

SHARD = 842_301_952


def test_states_leave_the_gpu() -> None:
    """bf16-mixed AdamW: 12 bytes per parameter of master weights and states leave the GPU,
    with the foreach step's fp32 temporary and the fp32 gradient copy; the host holds the
    master (4), the states (8) and an fp32 gradient (4): 16 bytes per parameter."""
    base = memplan.estimate("llama-2-7b", gpus=8, zero=1)
    off = memplan.estimate("llama-2-7b", gpus=8, zero=1, offload="optimizer")
    assert base.worst.optimizer_bytes == SHARD * 12 == 10_107_623_424
    assert base.worst.optimizer_temp_bytes == SHARD * 4 + SHARD * 4  # foreach + fp32 grad copy
    assert off.worst.optimizer_bytes == off.worst.optimizer_temp_bytes == 0
    assert off.worst.host_bytes == SHARD * 16 == 13_476_831_232
    assert (off.worst.params_bytes, off.worst.grads_bytes) == (base.worst.params_bytes,
                                                             base.worst.grads_bytes)
    # the steady state's peaks fall by the states; step 1's forward (before any state exists)
    # by the master copy made with the optimizer
    assert base.worst.steady.forward - off.worst.steady.forward == SHARD * 12
    assert base.worst.first_step.forward - off.worst.first_step.forward == SHARD * 4


def test_fp32_training_and_sgd_host_bytes() -> None:
    """The CPU optimizer keeps its own fp32 weights even in fp32 training: 4 + 8 + 4 bytes for
    AdamW; SGD with momentum 4 + 4 + 4."""
    fp32 = memplan.estimate("llama-2-7b", gpus=8, zero=1, offload="optimizer", precision="fp32")
    assert fp32.worst.host_bytes == SHARD * 16
    sgd = memplan.estimate("llama-2-7b", gpus=8, zero=2, offload="optimizer", optimizer="sgd")
    assert sgd.worst.host_bytes == SHARD * 12


@pytest.mark.parametrize("kwargs", [
    dict(zero=1), dict(zero=2), dict(zero=3), dict(zero=1, pp=2), dict(zero=2, tp=2),
    dict(zero=1, recompute="full", micro_batch_size=4),
])
def test_offload_never_raises_a_peak(kwargs: dict) -> None:
    base = memplan.estimate("llama-3-8b", gpus=16, **kwargs)
    off = memplan.estimate("llama-3-8b", gpus=16, offload="optimizer", **kwargs)
    for a, b in zip(base.stages, off.stages):
        assert b.peak_bytes <= a.peak_bytes
        assert b.steady.optimizer < a.steady.optimizer


def test_refusals_name_the_field(capsys: pytest.CaptureFixture[str]) -> None:
    """Without ZeRO the optimizer offload is torchao's CPUOffloadOptimizer, which keeps no
    master copy: bf16-mixed is refused; params need zero 3; an unknown name is refused."""
    with pytest.raises(MemplanError, match=r"offload optimizer with zero 0 \(torchao"):
        memplan.estimate("llama-2-7b", gpus=8, offload="optimizer")
    with pytest.raises(MemplanError, match="offload must be none or a comma list of optimizer, "
                                           "activations, params, got 'gpu'"):
        memplan.estimate("llama-2-7b", gpus=8, zero=1, offload="gpu")
    with pytest.raises(MemplanError, match="offload params needs zero 3"):
        memplan.estimate("llama-2-7b", gpus=8, zero=1, offload="params")
    assert main(["estimate", "--model", "llama-2-7b", "--gpus", "8",
                 "--offload", "optimizer"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert err.startswith("memplan: error: offload optimizer with zero 0 (torchao")


def test_step_time_adds_the_host_terms() -> None:
    """H100 node: PCIe Gen5 64 GB/s per direction, 614.4 GB/s host DRAM shared by 8 GPUs.
    Gradient shard down: 842,301,952 * 2 B / 64e9; weights up the same; CPU AdamW streams
    2 * (4 + 8) + 4 + 2 = 30 B per parameter at 76.8 GB/s."""
    off = memplan.estimate("llama-2-7b", gpus=8, zero=1, offload="optimizer")
    t = time_of(off)
    down = SHARD * 2 / 64e9
    assert t.comm_s["host_grads"] == pytest.approx(down, rel=1e-12)
    assert t.comm_s["host_step"] == pytest.approx(down + SHARD * 30 / 76.8e9, rel=1e-12)
    base = time_of(memplan.estimate("llama-2-7b", gpus=8, zero=1))
    assert base.comm_s["host_grads"] == base.comm_s["host_step"] == 0.0
    # exposed: a fifth of the download and all of the step (memplan.planning.timing.OVERLAP)
    assert t.step_s - base.step_s == pytest.approx(0.2 * down + down + SHARD * 30 / 76.8e9,
                                                   rel=1e-9)


def test_every_gpu_has_host_figures() -> None:
    for gpu in gpu_catalog().values():
        assert gpu.host_link_bytes_per_s > 0 and gpu.host_memory_bytes_per_s > 0
        assert "GB/s" in gpu.host_source


def test_diagnose_offers_offload_re_estimated() -> None:
    """ZeRO-0 job that does not fit: offload comes with ZeRO-1, its peak is estimate's."""
    kwargs = {"gpus": 8, "gpu": "h100", "micro_batch_size": 1, "seq_len": 2048}
    r = diagnose("llama-2-7b", gpu_memory="60GiB", **kwargs)
    fix = next(f for f in r.fixes.ranked if f.name == "optimizer offloaded to the host")
    assert fix.change == {"offload": "optimizer", "zero": 1}
    assert fix.flags.startswith("--offload optimizer --zero 1")
    again = memplan.estimate("llama-2-7b", gpu_memory="60GiB", offload="optimizer", zero=1,
                             global_batch_size=r.fixes.baseline.global_batch_size, **kwargs)
    assert fix.peak_bytes == again.peak_bytes and fix.fits
    assert fix_note(fix) == "host memory 12.55 GiB per GPU" and again.worst.host_bytes == SHARD * 16
    assert fix.time.step_s > r.fixes.baseline_time.step_s


def test_fsdp_precision_is_not_offloaded() -> None:
    """FSDP2 has no optimizer-only offload: the combination is refused and never suggested
    (its CPUOffloadPolicy, the weights with the optimizer, is: ``--offload params``)."""
    with pytest.raises(MemplanError, match="fsdp-bf16 is FSDP2"):
        memplan.estimate("llama-3-8b", gpus=8, zero=3, precision="fsdp-bf16",
                         offload="optimizer")
    r = diagnose("llama-3-8b", gpus=8, zero=3, precision="fsdp-bf16", micro_batch_size=2,
                 seq_len=8192)
    assert not any(f.name.startswith("optimizer offloaded") for f in r.fixes.ranked)
    assert any(f.flags.startswith("--offload params") for f in r.fixes.ranked)

"""``MemoryMonitor`` on real loops: the process's memory on CPU, the exact tensor tracker, a
real leak caught, transformers' callback handler and Lightning's trainer driving it;
``memplan monitor-summary``. (The rule itself, faults and patterns: tests/unit/test_monitor.py.)"""

from __future__ import annotations

import itertools
import json
import mmap
import subprocess
import sys

import pytest
from typer.testing import CliRunner

from memplan.cli import app, main
from memplan.monitor import MemoryMonitor, read_records, summarize

GiB, MiB = 1 << 30, 1 << 20


def test_cpu_job_records_process_memory(tmp_path, monkeypatch):
    """No reader, no CUDA: the process's resident set and the host's memory, every step."""
    monkeypatch.setenv("RANK", "5")
    with MemoryMonitor(tmp_path) as mon:
        rec = mon.step()
    assert rec["rank"] == 5 and "allocated_bytes" not in rec and rec["step_time_s"] >= 0
    assert 0 < rec["rss_bytes"] <= rec["peak_rss_bytes"]
    assert 0 < rec["headroom_bytes"] < rec["capacity_bytes"]
    assert (tmp_path / "memory_rank5.jsonl").exists()


def test_rss_leak_of_a_real_loop(tmp_path):
    """A loop that keeps 4 MiB a step, fresh anonymous pages each written (so resident): the
    resident set grows 4 MiB a step, 116 MiB over a 30-step window, and the leak is named in
    rss_bytes. (Pages of their own: a malloc'd buffer of that size may reuse heap pages that
    earlier tests freed but left resident, once glibc's mmap threshold has risen, and the
    resident set would not grow.)"""
    kept = []
    with MemoryMonitor(tmp_path, rank=0) as mon:
        for _ in range(40):
            pages = mmap.mmap(-1, 4 * MiB)
            pages.write(b"\x01" * (4 * MiB))
            kept.append(pages)
            rec = mon.step()
    assert any(w.startswith("rss_bytes grew ") for w in rec["warnings"])
    trend = mon.summary["trends"]["rss_bytes"]
    assert trend["leak"] and trend["slope_bytes_per_step"] == pytest.approx(4 * MiB, rel=0.1)


def test_exact_tensor_bytes_under_the_tracker(tmp_path):
    """A real CPU loop under the exact tracker keeping 1,000 fp32 values (4,000 bytes) a step:
    the default reader finds the active tracker, tensor bytes grow by exactly 4,000 a step, and
    the tensor peak of each step is read; with a 1,000-byte threshold the leak is flagged once
    the window holds 15 steps."""
    torch = pytest.importorskip("torch")
    from memplan.profile.tracker import MemoryTracker

    kept = []
    tracker = MemoryTracker()
    with tracker, MemoryMonitor(tmp_path, rank=0, leak_bytes=1000) as mon:
        recs = []
        model = torch.nn.Linear(16, 16)
        for _ in range(20):
            model(torch.randn(8, 16)).sum().backward()
            model.zero_grad()
            kept.append(torch.zeros(1000))
            recs.append(mon.step())
    tensors = [r["tensor_bytes"] for r in recs]
    assert {b - a for a, b in itertools.pairwise(tensors)} == {4000}
    assert all(r["tensor_peak_bytes"] >= r["tensor_bytes"] for r in recs)
    flagged = [r["step"] for r in recs if any("tensor_bytes grew" in w for w in r["warnings"])]
    assert flagged == list(range(15, 21))
    assert "growth_bytes" in mon.summary["trends"]["tensor_bytes"]
    assert any(w.startswith("tensor_bytes grew 76000 bytes over steps 1-20 (4000 bytes/step")
               for w in recs[-1]["warnings"])


def test_transformers_callback_handler(tmp_path):
    """transformers' own CallbackHandler dispatching every event a Trainer sends to the monitor
    passed as a callback (``Trainer(callbacks=[monitor])``): one record per optimizer step."""
    pytest.importorskip("torch")
    tc = pytest.importorskip("transformers.trainer_callback")

    mon = MemoryMonitor(tmp_path, rank=0)
    # (TrainingArguments needs accelerate; the handler only passes args on to callbacks)
    handler = tc.CallbackHandler([tc.PrinterCallback(), mon], None, None, None, None)
    args = None
    state, control = tc.TrainerState(), tc.TrainerControl()
    handler.on_init_end(args, state, control)
    handler.on_train_begin(args, state, control)
    for step in range(1, 4):
        handler.on_step_begin(args, state, control)
        handler.on_pre_optimizer_step(args, state, control)
        handler.on_optimizer_step(args, state, control)
        state.global_step = step
        control = handler.on_step_end(args, state, control)
        assert isinstance(control, tc.TrainerControl)  # the monitor returned None
        handler.on_log(args, state, control, logs={})
    handler.on_train_end(args, state, control)
    lines = (tmp_path / "memory_rank0.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [1, 2, 3]


@pytest.mark.parametrize("given", ["monitor", "lightning_callback"])
def test_lightning_trainer(tmp_path, given):
    """Lightning's Trainer on CPU, 4 optimizer steps of 8 batches (accumulating 2), with the
    monitor itself or its Callback subclass: one record per optimizer step, the rank from the
    trainer."""
    torch = pytest.importorskip("torch")
    pl = pytest.importorskip("lightning.pytorch")

    class Tiny(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.layer = torch.nn.Linear(8, 1)

        def training_step(self, batch, _):
            return self.layer(batch[0]).square().mean()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(64, 8)),
                                       batch_size=8)
    mon = MemoryMonitor(tmp_path / "mem")
    callback = mon if given == "monitor" else mon.lightning_callback()
    assert isinstance(callback, pl.Callback) == (given == "lightning_callback")
    trainer = pl.Trainer(max_steps=4, accumulate_grad_batches=2, callbacks=[callback],
                         logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, accelerator="cpu",
                         default_root_dir=tmp_path)
    trainer.fit(Tiny(), data)
    recs = read_records([tmp_path / "mem"])
    assert [r["step"] for r in recs] == [1, 2, 3, 4] and {r["rank"] for r in recs} == {0}
    assert all("rss_bytes" in r for r in recs)


def test_import_is_torch_free():
    code = ("import sys, memplan.monitor, memplan.monitor.callbacks; "
            "m = memplan.monitor.MemoryMonitor('x'); m.on_init_end(None, None, None); "
            "assert not {'torch', 'transformers', 'lightning'} & set(sys.modules)")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_cli_monitor_summary(tmp_path, capsys):
    for rank, peak in ((0, 40 * GiB), (1, 44 * GiB)):
        stats = iter([{"allocated_bytes": 10 * GiB, "peak_bytes": p, "reserved_bytes": p + GiB,
                       "capacity_bytes": 80 * GiB} for p in (peak, peak - GiB)])
        with MemoryMonitor(tmp_path, rank=rank, reader=lambda s=stats: next(s)) as mon:
            mon.step()
            mon.step()
    out = summarize(read_records([tmp_path]))
    assert out["worst_rank"] == 1 and out["worst"]["max_peak_bytes"] == 44 * GiB
    assert out["worst"]["min_headroom_bytes"] == 80 * GiB - 45 * GiB
    res = CliRunner().invoke(app, ["monitor-summary", str(tmp_path), "--json"],
                             catch_exceptions=False)
    assert res.exit_code == 0 and json.loads(res.stdout)["worst_rank"] == 1
    res = CliRunner().invoke(app, ["monitor-summary", str(tmp_path)], env={"COLUMNS": "100"},
                             catch_exceptions=False)
    assert res.exit_code == 0 and "worst rank: 1" in res.stdout
    assert main(["monitor-summary", str(tmp_path / "missing")]) == 2
    capsys.readouterr()


@pytest.mark.gpu
def test_cuda_reader():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from memplan.monitor.readers import cuda_reader

    x = torch.empty(1 << 20, device="cuda")
    read = cuda_reader()
    stats = read()
    assert stats["allocated_bytes"] >= x.nbytes and stats["reserved_bytes"] >= x.nbytes
    assert stats["capacity_bytes"] == torch.cuda.get_device_properties(0).total_memory

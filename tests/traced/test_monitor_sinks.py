"""``MemoryMonitor``'s records also sent to TensorBoard and Weights & Biases, with the real
libraries, offline (event files and an offline W&B run under tmp_path; no account, no network):
the values read back equal the JSONL records, and the JSONL is byte-identical with and without
the sinks. (``memplan.monitor.sinks``; the monitor's rules: tests/unit/test_monitor_rules.py.)

The counters are an allocator-shaped feed chosen by hand so that none is a float32 value (40 GiB
+ 12,345 bytes needs 36 significant bits; float32 keeps 24): a sink that rounded would fail.
"""

from __future__ import annotations

import glob
import json
import os
import struct
import subprocess
import sys
import time
import types
from pathlib import Path

import pytest
from typer.testing import CliRunner

from memplan.cli import app, main
from memplan.errors import MemplanError
from memplan.monitor import MemoryMonitor, memory_monitor

ROOT = Path(__file__).resolve().parents[2]
GiB = 1 << 30
CAPACITY = 80 * GiB  # an 80 GiB device
PREDICTED = 41 * GiB
# step s (1-based): allocated 40 GiB + 12,345 + 512 s; reserved 42 GiB + 3 s; peak 41 GiB + 777
# + s, except step 3, whose peak is 46 GiB: 5 GiB = 12.2% over the 41 GiB predicted, more than
# the 10% deviation_pct, so step 3 carries one warning.
STEPS = 4


def feed() -> types.FunctionType:
    step = iter(range(1, STEPS + 1))

    def reader() -> dict[str, int]:
        s = next(step)
        return {"allocated_bytes": 40 * GiB + 12_345 + 512 * s,
                "reserved_bytes": 42 * GiB + 3 * s,
                "peak_bytes": 46 * GiB if s == 3 else 41 * GiB + 777 + s,
                "inactive_split_bytes": 1_000_003 * s, "alloc_retries": s // 2,
                "num_ooms": 0, "capacity_bytes": CAPACITY}
    return reader


def hand_record(s: int) -> dict[str, int | float]:
    """The numbers of step ``s``'s record, derived by hand: fragmentation = reserved -
    allocated = 2 GiB - 12,345 - 509 s; headroom = capacity - max(reserved, peak) = 38 GiB - 3 s
    (reserved is larger) except at step 3, where the 46 GiB peak is: 34 GiB; the clock ticks
    0.5 s a call, so every step took 0.5 s."""
    peak = 46 * GiB if s == 3 else 41 * GiB + 777 + s
    return {"step_time_s": 0.5, "allocated_bytes": 40 * GiB + 12_345 + 512 * s,
            "reserved_bytes": 42 * GiB + 3 * s, "peak_bytes": peak,
            "inactive_split_bytes": 1_000_003 * s, "alloc_retries": s // 2, "num_ooms": 0,
            "capacity_bytes": CAPACITY, "fragmentation_bytes": 2 * GiB - 12_345 - 509 * s,
            "headroom_bytes": 34 * GiB if s == 3 else 38 * GiB - 3 * s,
            "num_warnings": 1 if s == 3 else 0, "predicted_peak_bytes": PREDICTED}


@pytest.fixture
def fixed_wall_time(monkeypatch):
    """The records' wall time (``time.time()`` in the monitor's module only, set again by each
    ``run``) fixed, so two runs write the same bytes: 1,800,000,000 + step."""
    monkeypatch.setattr(memory_monitor, "time", types.SimpleNamespace(
        time=time.time, perf_counter=time.perf_counter))


def reset_wall_time() -> None:
    if isinstance(memory_monitor.time, types.SimpleNamespace):
        walls = iter(range(1, 1000))
        memory_monitor.time.time = lambda: 1_800_000_000.0 + next(walls)


def run(out_dir, **sinks) -> tuple[bytes, list[dict]]:
    ticks = iter(range(1000))
    reset_wall_time()
    with MemoryMonitor(out_dir, rank=0, reader=feed(), predicted_peak_bytes=PREDICTED,
                       clock=lambda: 0.5 * next(ticks), **sinks) as mon:
        recs = [mon.step() for _ in range(STEPS)]
    assert mon.errors == 0 and all(recs)
    return (out_dir / "memory_rank0.jsonl").read_bytes(), recs


def test_hand_derivation_is_what_the_monitor_records(tmp_path, fixed_wall_time):
    _, recs = run(tmp_path / "plain")
    for s, rec in enumerate(recs, 1):
        want = hand_record(s)
        assert {k: rec[k] for k in want if k in rec} == {
            k: v for k, v in want.items() if k not in ("num_warnings", "predicted_peak_bytes")}
        assert len(rec["warnings"]) == want["num_warnings"]


# --- TensorBoard ---------------------------------------------------------------------------

def tensorboard_values(run_dir) -> dict[str, dict[int, float]]:
    """tag -> step -> value, read back with TensorBoard's EventAccumulator."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.util import tensor_util

    acc = EventAccumulator(str(run_dir))
    acc.Reload()
    out: dict[str, dict[int, float]] = {}
    for tag in acc.Tags()["tensors"]:
        assert acc.SummaryMetadata(tag).plugin_data.plugin_name == "scalars", tag
        out[tag] = {e.step: tensor_util.make_ndarray(e.tensor_proto).item()
                    for e in acc.Tensors(tag)}
    for tag in acc.Tags()["scalars"]:  # a writer's float32 simple values
        out[tag] = {e.step: e.value for e in acc.Scalars(tag)}
    return out


def as_tags(jsonl: bytes, predicted: bool = True) -> dict[str, dict[int, float]]:
    """The JSONL records as the sinks name them: memplan/<key> -> step -> value for every
    number but rank, step and time, memplan/num_warnings (how many warnings), and the
    monitor's predicted_peak_bytes; checked here against the hand-derived table."""
    out: dict[str, dict[int, float]] = {}
    for line in jsonl.splitlines():
        rec = json.loads(line)
        s = rec["step"]
        row = {k: v for k, v in rec.items() if k not in ("rank", "step", "time", "warnings")}
        row["num_warnings"] = len(rec["warnings"])
        if predicted:
            row["predicted_peak_bytes"] = PREDICTED
        assert row == {k: v for k, v in hand_record(s).items()
                       if predicted or k != "predicted_peak_bytes"}
        for key, value in row.items():
            out.setdefault(f"memplan/{key}", {})[s] = value
    return out


def test_tensorboard_scalars_equal_the_records(tmp_path, fixed_wall_time):
    """TensorBoard's own writer, into tmp/tb/memplan_rank0: every number of every record comes
    back exactly (float64), under memplan/<key>, at the record's step; TensorBoard's scalar
    dashboard (its data provider) lists the same tags; the JSONL is byte-identical."""
    pytest.importorskip("tensorboard", reason="the TensorBoard sink needs tensorboard: pip "
                        "install 'memplan[monitor]'")
    plain, recs = run(tmp_path / "plain")
    with_tb, recs_tb = run(tmp_path / "tb_run", tensorboard=tmp_path / "tb")
    assert with_tb == plain and recs_tb == recs
    got = tensorboard_values(tmp_path / "tb" / "memplan_rank0")
    assert got == as_tags(plain)
    assert got["memplan/peak_bytes"][1] == 41 * GiB + 778  # not a float32 value
    assert got["memplan/headroom_bytes"][3] == 34 * GiB

    from tensorboard import context
    from tensorboard.backend.event_processing import data_provider, plugin_event_multiplexer
    from tensorboard.data import provider

    mux = plugin_event_multiplexer.EventMultiplexer()
    mux.AddRunsFromDirectory(str(tmp_path / "tb"))
    mux.Reload()
    dash = data_provider.MultiplexerDataProvider(mux, str(tmp_path / "tb"))
    ctx = context.RequestContext()
    listed = dash.list_scalars(ctx, experiment_id="", plugin_name="scalars")
    assert set(listed) == {"memplan_rank0"} and set(listed["memplan_rank0"]) == set(got)
    read = dash.read_scalars(ctx, experiment_id="", plugin_name="scalars", downsample=100,
                             run_tag_filter=provider.RunTagFilter(tags=["memplan/peak_bytes"]))
    assert [(d.step, d.value) for d in read["memplan_rank0"]["memplan/peak_bytes"]] == [
        (1, 41 * GiB + 778), (2, 41 * GiB + 779), (3, 46 * GiB), (4, 41 * GiB + 781)]
    assert [d.wall_time for d in read["memplan_rank0"]["memplan/peak_bytes"]] == [
        r["time"] for r in recs]


def test_tensorboard_into_the_jobs_summary_writer(tmp_path, fixed_wall_time):
    """The job's own torch SummaryWriter (the one Trainer or Lightning logs to): memplan's
    scalars next to the job's, asked for in double precision, so exact too; the writer is
    flushed at close, not closed (the job goes on writing)."""
    pytest.importorskip("tensorboard", reason="needs tensorboard: pip install "
                        "'memplan[monitor]'")
    tb = pytest.importorskip("torch.utils.tensorboard")
    plain, _ = run(tmp_path / "plain")
    writer = tb.SummaryWriter(str(tmp_path / "job"))
    writer.add_scalar("train/loss", 2.5, 1)
    with_tb, _ = run(tmp_path / "tb_run", tensorboard=writer)
    writer.add_scalar("train/loss", 2.25, 2)  # still open
    writer.close()
    assert with_tb == plain
    got = tensorboard_values(tmp_path / "job")
    assert got.pop("train/loss") == {1: 2.5, 2: 2.25}
    assert got == as_tags(plain)


class Broken:
    def add_scalar(self, *_, **__):
        raise OSError(28, "No space left on device")


def test_a_failing_sink_is_counted_and_the_records_go_on(tmp_path, fixed_wall_time):
    """A writer that raises every time: each step's failure is counted in errors, never raised
    into the loop; the JSONL is the same."""
    plain, _ = run(tmp_path / "plain")
    ticks = iter(range(1000))
    reset_wall_time()
    with MemoryMonitor(tmp_path / "broken", rank=0, reader=feed(), predicted_peak_bytes=PREDICTED,
                       clock=lambda: 0.5 * next(ticks), tensorboard=Broken()) as mon:
        assert all(mon.step() for _ in range(STEPS))
    assert mon.errors == STEPS
    assert (tmp_path / "broken" / "memory_rank0.jsonl").read_bytes() == plain


@pytest.mark.parametrize(("kw", "says"), [
    ({"tensorboard": 42}, "tensorboard must be a folder path or a writer with add_scalar"),
    ({"tensorboard": ""}, "tensorboard must be a folder path"),
    ({"tensorboard": "file/tb"}, "tensorboard file/tb: file is a file, not a folder"),
    ({"wandb": "yes"}, "wandb must be True (the active wandb run) or a wandb run"),
])
def test_sink_arguments_checked_when_made(tmp_path, monkeypatch, kw, says):
    """Said when the monitor is made, before training: one line naming the argument."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "file").write_text("")
    with pytest.raises(MemplanError, match=r"^MemoryMonitor: " + says.replace("(", r"\(")
                       .replace(")", r"\)")):
        MemoryMonitor(tmp_path, **kw)


def test_sinks_import_nothing_until_asked(tmp_path):
    """Importing the monitor and recording without sinks imports neither library (nor torch)."""
    code = ("import sys; from memplan.monitor import MemoryMonitor; "
            f"m = MemoryMonitor({str(tmp_path)!r}, rank=0); m.step(); m.close(); "
            "print(sorted({'tensorboard', 'wandb', 'torch', 'numpy'} & set(sys.modules)))")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, timeout=60, cwd=ROOT, env=env)
    assert out.stdout.strip() == "[]", out.stderr


def test_monitor_summary_replays_records_to_tensorboard(tmp_path, fixed_wall_time):
    """``memplan monitor-summary DIR --tensorboard TB``: a finished run's records (here two
    ranks' files) written to TB/memplan_rank<R>, the same numbers as the monitor's own sink
    (less predicted_peak_bytes, which the files do not carry)."""
    pytest.importorskip("tensorboard", reason="needs tensorboard: pip install "
                        "'memplan[monitor]'")
    plain, _ = run(tmp_path / "mem")
    rank3 = [{**json.loads(line), "rank": 3} for line in plain.splitlines()]
    (tmp_path / "mem" / "memory_rank3.jsonl").write_text(
        "".join(json.dumps(r) + "\n" for r in rank3))
    result = CliRunner().invoke(app, ["monitor-summary", str(tmp_path / "mem"), "--tensorboard",
                                      str(tmp_path / "tb"), "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.output)["tensorboard"] == [
        str(tmp_path / "tb" / "memplan_rank0"), str(tmp_path / "tb" / "memplan_rank3")]
    want = as_tags(plain, predicted=False)
    for rank in (0, 3):
        assert tensorboard_values(tmp_path / "tb" / f"memplan_rank{rank}") == want
    assert (tmp_path / "mem" / "memory_rank0.jsonl").read_bytes() == plain


@pytest.mark.parametrize(("option", "value", "modules"), [
    ("--tensorboard", "tb", ("tensorboard", "tensorboard.summary", "tensorboard.summary.writer",
                             "tensorboard.summary.writer.event_file_writer")),
    ("--wandb", "memplan-test", ("wandb",)),
])
def test_monitor_summary_sink_without_the_library(tmp_path, monkeypatch, capsys, option, value,
                                                  modules):
    """Without the library: one line naming the option and the extra, exit 2, before the
    files are read (here there are none)."""
    for name in modules:
        monkeypatch.setitem(sys.modules, name, None)
    code = main(["monitor-summary", str(tmp_path / "none.jsonl"), option, value])
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert f"{option} needs {modules[0]}: pip install 'memplan[monitor]'" in err


# --- Weights & Biases ----------------------------------------------------------------------

def wandb_history(root, run_id: str = "*") -> list[dict]:
    """The history rows of the offline run under ``root`` (its run-<id>.wandb file, the
    transaction log ``wandb sync`` uploads: W&B's 7-byte header, then LevelDB log records of
    32 KiB blocks, 7-byte headers (crc, length, type: 1 full, 2 first, 3 middle, 4 last), each
    a ``wandb_internal_pb2.Record``), read once the run's ``exit`` record is there. wandb
    0.31 can write other records after it (an ``environment`` record seen last on a loaded
    machine), so the exit record is looked for among them, not as the last one."""
    import wandb

    # wandb-core may still be writing after finish() returns; teardown waits for the service
    # to shut down, its files written, so no wait below depends on the machine's load
    wandb.teardown()
    [path] = glob.glob(str(root / "wandb" / "offline-run-*" / f"run-{run_id}.wandb"))
    for _ in range(300):
        records = _records(Path(path).read_bytes())
        if any(r.WhichOneof("record_type") == "exit" for r in records):
            break
        time.sleep(0.1)
    assert any(r.WhichOneof("record_type") == "exit" for r in records), "the run never ended"
    return [{i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in r.history.item}
            for r in records if r.WhichOneof("record_type") == "history"]


def _records(data: bytes) -> list:
    from wandb.proto import wandb_internal_pb2

    if data[:4] != b":W&B":
        return []
    pos, raw, part = 7, [], b""
    while pos + 7 <= len(data):
        left = 32768 - pos % 32768
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if left < 7 or (length == 0 and kind == 0):  # a block's zero padding
            pos += left
            continue
        if pos + 7 + length > len(data):  # still being written
            break
        chunk, pos = data[pos + 7:pos + 7 + length], pos + 7 + length
        part = chunk if kind in (1, 2) else part + chunk
        if kind in (1, 4):
            raw.append(part)
    out = []
    for blob in raw:
        rec = wandb_internal_pb2.Record()
        rec.ParseFromString(blob)
        out.append(rec)
    return out


@pytest.fixture
def wandb_offline(tmp_path, monkeypatch):
    wandb = pytest.importorskip("wandb", reason="the W&B sink needs wandb: pip install "
                                "'memplan[monitor]'")
    for key, value in {"WANDB_MODE": "offline", "WANDB_DIR": str(tmp_path),
                       "WANDB_SILENT": "true", "WANDB_DISABLE_GIT": "true",
                       "WANDB_CONFIG_DIR": str(tmp_path / "config"),
                       "WANDB_CACHE_DIR": str(tmp_path / "cache")}.items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    wandb.teardown()  # settings read from this test's environment, not an earlier test's
    yield wandb
    if wandb.run is not None:
        wandb.run.finish()
    wandb.teardown()


@pytest.mark.parametrize("given", ["active", "run"])
def test_wandb_offline_history_equals_the_records(tmp_path, fixed_wall_time, wandb_offline,
                                                  given):
    """An offline run (no account, no network): one history row per step holding memplan/step
    and every number of the record under memplan/<key>, ints exact, whether the monitor finds
    the active run (``wandb=True``) or is given it; the JSONL is byte-identical."""
    wandb = wandb_offline
    plain, _ = run(tmp_path / "plain")
    wb_run = wandb.init(project="memplan-test", mode="offline", dir=str(tmp_path),
                        settings=wandb.Settings(console="off"))
    with_wb, _ = run(tmp_path / "wb_run", wandb=True if given == "active" else wb_run)
    wb_run.finish()
    assert with_wb == plain
    rows = [{k: v for k, v in row.items() if k.startswith("memplan/")}
            for row in wandb_history(tmp_path)]
    want = [{"memplan/step": s, **{f"memplan/{k}": v for k, v in hand_record(s).items()}}
            for s in range(1, STEPS + 1)]
    assert rows == want
    assert rows[0]["memplan/peak_bytes"] == 41 * GiB + 778


def test_wandb_without_a_run_skips_and_says_so(tmp_path, fixed_wall_time, wandb_offline, caplog):
    """``wandb=True`` on a rank where wandb.init was never called: steps are recorded, nothing
    is logged to W&B, one warning says why, once over 250 steps (not every warn_every = 100:
    W&B is often rank 0's alone); no error counted."""
    assert wandb_offline.run is None
    plain, _ = run(tmp_path / "plain")
    with caplog.at_level("WARNING", logger="memplan.monitor"):
        with_wb, _ = run(tmp_path / "wb_run", wandb=True)
        ticks = iter(range(1000))
        with MemoryMonitor(tmp_path / "long", rank=1, reader=lambda: {"allocated_bytes": 1},
                           clock=lambda: 0.5 * next(ticks), wandb=True) as mon:
            assert all(mon.step() for _ in range(250))
        assert mon.errors == 0
    assert with_wb == plain
    said = [r.getMessage() for r in caplog.records if "no wandb run" in r.getMessage()]
    assert len(said) == 2 and said[0].startswith("rank 0 step 1: ")
    assert said[1].startswith("rank 1 step 1: ")


def test_monitor_summary_replays_records_to_wandb(tmp_path, fixed_wall_time, wandb_offline):
    """``memplan monitor-summary DIR --wandb PROJECT`` with WANDB_MODE=offline: two ranks'
    records, each logged to an offline run of its own (memplan_rank<R>), whose history equals
    the records (less predicted_peak_bytes, which the files do not carry); --json says which
    run holds which rank."""
    plain, _ = run(tmp_path / "mem")
    rank3 = [{**json.loads(line), "rank": 3} for line in plain.splitlines()]
    (tmp_path / "mem" / "memory_rank3.jsonl").write_text(
        "".join(json.dumps(r) + "\n" for r in rank3))
    result = CliRunner().invoke(app, ["monitor-summary", str(tmp_path / "mem"), "--wandb",
                                      "memplan-test", "--json"])
    assert result.exit_code == 0, result.output
    runs = json.loads(result.output)["wandb"]
    assert [(r["rank"], r["project"]) for r in runs] == [(0, "memplan-test"),
                                                          (3, "memplan-test")]
    want = [{"memplan/step": s, **{f"memplan/{k}": v for k, v in hand_record(s).items()
                                   if k != "predicted_peak_bytes"}}
            for s in range(1, STEPS + 1)]
    for r in runs:
        rows = [{k: v for k, v in row.items() if k.startswith("memplan/")}
                for row in wandb_history(tmp_path, r["id"])]
        assert rows == want
    assert wandb_offline.run is None  # each run finished


@pytest.mark.parametrize("project", ["team/memory", "a" * 129, " "])
def test_monitor_summary_wandb_project_checked_first(tmp_path, capsys, project):
    """A project name W&B would refuse (wandb_settings.py, Settings.validate_project: at most
    128 characters, none of / \\ # ? % :): one line naming --wandb, exit 2, before the files
    are read (here there are none)."""
    code = main(["monitor-summary", str(tmp_path / "none.jsonl"), "--wandb", project])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("memplan: error: --wandb must name a W&B project")
    assert len(err.strip().splitlines()) == 1


def test_monitor_summary_wandb_refused_is_one_line(tmp_path, fixed_wall_time, wandb_offline,
                                                   monkeypatch, capsys):
    """W&B refusing to start a run (here its own UsageError for a machine not logged in, raised
    by a stand-in for wandb.init): one line, exit 2, and no TensorBoard files written either."""
    run(tmp_path / "mem")

    def refuse(**_):
        raise wandb_offline.errors.UsageError("No API key configured. Use `wandb login` to "
                                              "log in.")

    monkeypatch.setattr(wandb_offline, "init", refuse)
    code = main(["monitor-summary", str(tmp_path / "mem"), "--wandb", "memplan-test",
                 "--tensorboard", str(tmp_path / "tb")])
    err = capsys.readouterr().err
    assert code == 2 and err == ("memplan: error: --wandb memplan-test: W&B could not start a "
                                 "run: No API key configured. Use `wandb login` to log in.\n")
    assert not (tmp_path / "tb").exists()


@pytest.mark.parametrize("logger", ["tensorboard", "wandb"])
def test_lightning_trainer_with_its_own_logger(tmp_path, fixed_wall_time, monkeypatch, logger):
    """Lightning's Trainer on CPU (4 optimizer steps of 8 batches, accumulating 2) logging its
    loss through its own TensorBoardLogger or offline WandbLogger, the monitor as a callback
    sending to the same writer or run (``tensorboard=logger.experiment``, ``wandb=True``):
    memplan's scalars sit beside the trainer's, one value per optimizer step 1-4, equal to the
    JSONL records."""
    torch = pytest.importorskip("torch")
    pl = pytest.importorskip("lightning.pytorch")
    pytest.importorskip(logger, reason=f"needs {logger}: pip install 'memplan[monitor]'")
    if logger == "wandb":
        import wandb

        for key, value in {"WANDB_MODE": "offline", "WANDB_DIR": str(tmp_path),
                           "WANDB_SILENT": "true", "WANDB_DISABLE_GIT": "true"}.items():
            monkeypatch.setenv(key, value)
        wandb.teardown()

    class Tiny(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.layer = torch.nn.Linear(8, 1)

        def training_step(self, batch, _):
            loss = self.layer(batch[0]).square().mean()
            self.log("train_loss", loss)
            return loss

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    torch.manual_seed(0)
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(8, 8)),
                                       batch_size=1)
    if logger == "tensorboard":
        log = pl.loggers.TensorBoardLogger(str(tmp_path / "tb"), name="job", version=0)
        sink = {"tensorboard": log.experiment}
    else:
        log = pl.loggers.WandbLogger(project="memplan-test", save_dir=str(tmp_path),
                                     offline=True)
        sink = {"wandb": True}
    mon = MemoryMonitor(tmp_path / "mem", reader=lambda: {"allocated_bytes": 40 * GiB + 1},
                        **sink)
    trainer = pl.Trainer(max_steps=4, accumulate_grad_batches=2, callbacks=[mon], logger=log,
                         log_every_n_steps=1, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False,
                         accelerator="cpu", default_root_dir=tmp_path)
    trainer.fit(Tiny(), data)
    recs = [json.loads(line) for line in (tmp_path / "mem" / "memory_rank0.jsonl").open()]
    assert [r["step"] for r in recs] == [1, 2, 3, 4] and mon.errors == 0
    if logger == "tensorboard":
        got = tensorboard_values(tmp_path / "tb" / "job" / "version_0")
        assert "train_loss" in got
        assert got["memplan/allocated_bytes"] == {s: 40 * GiB + 1 for s in (1, 2, 3, 4)}
        assert got["memplan/step_time_s"] == {r["step"]: r["step_time_s"] for r in recs}
    else:
        import wandb

        wandb.finish()
        rows = wandb_history(tmp_path)
        assert any("train_loss" in row for row in rows)
        mine = [{k: v for k, v in row.items() if k.startswith("memplan/")} for row in rows]
        assert [m for m in mine if m] == [
            {"memplan/step": r["step"], "memplan/allocated_bytes": 40 * GiB + 1,
             "memplan/step_time_s": r["step_time_s"], "memplan/num_warnings": 0}
            for r in recs]
        wandb.teardown()

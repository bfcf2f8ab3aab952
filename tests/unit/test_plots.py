"""The plots: what each draws (read back from SVG text, where labels stay text), the exact
split of an estimate's bars, phase spans on both sample conventions, PNG/SVG by name, paths
checked before any work, the same data giving the same file. torch-free."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from typer.testing import CliRunner

import memplan
from memplan.cli import app, main
from memplan.errors import MemplanError
from memplan.measure.profiler_traces import analyze_traces, load
from memplan.measure.timeline import Sample, Timeline
from memplan.report.plot import check_path
from memplan.report.plot_estimate import plot_estimate, stage_parts
from memplan.report.plot_monitor import plot_monitor
from memplan.report.plot_timeline import phase_spans, plot_timeline
from memplan.report.plot_trace import plot_traces

pytest.importorskip("matplotlib")

GLOO = sorted((Path(__file__).parent.parent / "data" / "traces" / "gloo_2rank")
              .glob("rank*.json.gz"))
PNG = b"\x89PNG\r\n\x1a\n"
MiB, GiB = 2**20, 2**30


def _texts(svg: Path) -> list[str]:
    return [t.strip() for t in re.findall(r"<text[^>]*>([^<]*)", svg.read_text())]


def _cpu_timeline() -> Timeline:
    """Setup (step 0), then two steps of forward, backward, optimizer; times 0.1 s apart."""
    rows = [(0, "forward", 100), (1, "forward", 100), (1, "forward", 300),
            (1, "backward", 250), (1, "optimizer", 400), (2, "forward", 400),
            (2, "forward", 600), (2, "backward", 500), (2, "optimizer", 400)]
    samples = [Sample(index=k, step=st, phase=ph, total_bytes=b * MiB, time_s=0.1 * k,
                      by_category={"parameters": 100 * MiB, "activations": (b - 100) * MiB})
               for k, (st, ph, b) in enumerate(rows)]
    return Timeline(device="cpu-tracker", source="exact tensor tracker (test)", num_steps=2,
                    samples=samples, context={"model": "hand"})


def test_phase_spans_both_conventions():
    tl = _cpu_timeline()
    xs = [s.time_s for s in tl.samples]
    spans = [(round(lo, 6), round(hi, 6), st, ph) for lo, hi, st, ph in phase_spans(tl, xs)]
    assert spans == [(0.0, 0.1, 0, "setup"), (0.1, 0.3, 1, "forward"), (0.3, 0.4, 1, "backward"),
                     (0.4, 0.5, 1, "optimizer"), (0.5, 0.7, 2, "forward"),
                     (0.7, 0.8, 2, "backward"), (0.8, 0.8, 2, "optimizer")]
    # on CUDA a sample closes its phase: step start, end of forward, end of backward, step end
    cuda = Timeline(device="cuda", source="allocator", num_steps=1, samples=[
        Sample(index=k, step=1, phase=ph, total_bytes=0, time_s=t) for k, (ph, t) in
        enumerate([("forward", 0.0), ("forward", 1.0), ("backward", 3.0), ("optimizer", 3.5)])])
    assert phase_spans(cuda, [0.0, 1.0, 3.0, 3.5]) == [
        (0.0, 1.0, 1, "forward"), (1.0, 3.0, 1, "backward"), (3.0, 3.5, 1, "optimizer")]


def test_timeline_plot_labels(tmp_path):
    pred = {"first_step": {"forward": 300 * MiB}, "steady": {"forward": 600 * MiB}}
    path = plot_timeline(_cpu_timeline(), tmp_path / "t.svg", predicted=pred)
    texts = _texts(path)
    assert {"step 1", "step 2", "fwd", "bwd", "opt", "setup", "MiB"} <= set(texts)
    assert {"parameters", "activations", "estimate: phase peak", "measured: phase peak"} <= set(
        texts)
    assert any(t.startswith("time since the first sample (s;") for t in texts)
    png = plot_timeline(_cpu_timeline(), tmp_path / "t.png", predicted=pred)
    again = plot_timeline(_cpu_timeline(), tmp_path / "u.png", predicted=pred)
    assert png.read_bytes()[:8] == PNG and png.read_bytes() == again.read_bytes()


@pytest.mark.parametrize("name, says", [("x.jpg", "must end in .png or .svg"),
                                        ("sub", "must end in .png or .svg")])
def test_plot_path_checked(tmp_path, name, says):
    with pytest.raises(MemplanError, match=says):
        check_path(tmp_path / name)
    (tmp_path / "dir.png").mkdir()
    with pytest.raises(MemplanError, match="is a folder"):
        check_path(tmp_path / "dir.png")
    (tmp_path / "file").write_text("")
    with pytest.raises(MemplanError, match="is an existing file, not a folder"):
        check_path(tmp_path / "file" / "x.png")


def test_estimate_bars_split_the_peak_exactly():
    est = memplan.estimate("llama-7b", gpus=8, tp=2, pp=4, gpu="h100-sxm", seq_len=4096,
                           global_batch_size=64)
    for s in est.stages:
        parts = stage_parts(est, s)
        assert sum(parts.values()) == s.peak_bytes
        # steady state, several micro-batches: every model state is resident at the peak
        assert parts["parameters and buffers"] == s.params_bytes + s.buffers_bytes
        assert parts["optimizer states"] == s.optimizer_bytes
        assert parts["gradients"] == s.grads_bytes
        assert parts["CUDA context and workspace"] == s.cuda_context_bytes + s.workspace_bytes


def test_estimate_plot_and_cli(tmp_path):
    est = memplan.estimate("llama-7b", gpus=8, tp=2, pp=4, gpu="h100-sxm", seq_len=4096,
                           global_batch_size=64)
    texts = _texts(plot_estimate(est, tmp_path / "e.svg"))
    assert [t for t in texts if t.startswith("stage ")] == [f"stage {k}" for k in range(4)]
    assert sum(t == "fits" for t in texts) == 4 and "h100-sxm capacity (79.19 GiB)" in texts
    res = CliRunner().invoke(app, ["estimate", "-m", "llama-7b", "-n", "8", "--tp", "2", "--pp",
                                   "4", "--plot", str(tmp_path / "cli.png"), "--json"],
                             catch_exceptions=False)
    assert res.exit_code == 0 and json.loads(res.stdout)["plot"] == str(tmp_path / "cli.png")
    assert (tmp_path / "cli.png").read_bytes()[:8] == PNG


def test_trace_plot_marks_the_straggler(tmp_path):
    traces = [load(p, i) for i, p in enumerate(GLOO)]
    across = analyze_traces(traces)["across_ranks"]
    texts = _texts(plot_traces(traces, tmp_path / "t.svg", across=across))
    assert "rank 0" in texts and "rank 1: straggler" in texts
    assert "2 ranks, CPU (gloo) traces: straggler rank 1" in texts
    wait = across["exposed_wait_us"][0] / 1000
    assert f"{wait:.1f} ms ({across['exposed_wait_pct'][0]:.0f}%)" in texts
    res = CliRunner().invoke(app, ["analyze-trace", *map(str, GLOO), "--plot",
                                   str(tmp_path / "cli.png"), "--json"], catch_exceptions=False)
    assert res.exit_code == 0 and (tmp_path / "cli.png").read_bytes()[:8] == PNG
    assert main(["analyze-trace", *map(str, GLOO), "--plot", str(tmp_path / "x.gif")]) == 2


def test_monitor_plot(tmp_path):
    def recs(rank, grow):
        return [{"rank": rank, "step": k, "time": 0.0, "step_time_s": 0.5,
                 "allocated_bytes": 10 * GiB + k * grow, "peak_bytes": 30 * GiB + k * grow,
                 "capacity_bytes": 80 * GiB, "headroom_bytes": 48 * GiB - k * grow,
                 "warnings": ["allocated_bytes grew ...: possible leak"] if grow and k > 20
                 else []} for k in range(1, 41)]

    texts = _texts(plot_monitor({0: recs(0, 0), 1: recs(1, 100 * MiB)}, tmp_path / "m.svg"))
    assert {"rank 0: allocated peak", "rank 1: allocated peak", "capacity",
            "allocated at step end", "leak warned: rank 1, step 21"} <= set(texts)
    assert "memory monitor: 2 ranks, 40 steps" in texts
    for r in (0, 1):
        with (tmp_path / f"memory_rank{r}.jsonl").open("w") as f:
            f.writelines(json.dumps(rec) + "\n" for rec in recs(r, 100 * MiB * r))
    res = CliRunner().invoke(app, ["monitor-summary", str(tmp_path), "--plot",
                                   str(tmp_path / "cli.png")], env={"COLUMNS": "120"},
                             catch_exceptions=False)
    assert res.exit_code == 0 and f"wrote {tmp_path / 'cli.png'}" in res.stdout


def test_monitor_plot_without_headroom_has_no_empty_panel(tmp_path):
    """Records without a capacity carry no headroom: the figure is the memory panel alone (one
    axes, the step label under it), not a memory panel above an empty third. Under a drawn
    capacity line (30 GiB of 80 reaches a quarter) the headroom is a band in that panel; with
    the capacity off the scale (1 GiB of a 64 GiB host) and the headroom moving, a panel of its
    own below."""
    import xml.etree.ElementTree as ET

    recs = [{"rank": 0, "step": k, "time": 0.0, "allocated_bytes": 10 * GiB,
             "peak_bytes": 30 * GiB} for k in range(1, 6)]
    with_room = [{**r, "capacity_bytes": 80 * GiB, "headroom_bytes": 50 * GiB} for r in recs]
    host = [{"rank": 0, "step": k, "time": 0.0, "rss_bytes": GiB + k * 100 * MiB,
             "capacity_bytes": 64 * GiB, "headroom_bytes": 40 * GiB - k * 100 * MiB}
            for k in range(1, 6)]
    ns = "{http://www.w3.org/2000/svg}"

    def axes(path):
        tree = ET.parse(path)
        return sum(1 for g in tree.iter(f"{ns}g") if g.get("id", "").startswith("axes_"))

    plot_monitor({0: recs}, tmp_path / "alone.svg")
    plot_monitor({0: with_room}, tmp_path / "band.svg")
    plot_monitor({0: host}, tmp_path / "host.svg")
    assert [axes(tmp_path / f"{n}.svg") for n in ("alone", "band", "host")] == [1, 1, 2]
    texts = _texts(tmp_path / "alone.svg")
    assert "training step" in texts and not any(t.startswith("headroom") for t in texts)
    assert "headroom (least of the ranks)" in _texts(tmp_path / "band.svg")
    # the least headroom: 40 GiB - 5 x 100 MiB = 40,460 MiB = 39.51 GiB, at step 5
    host_texts = _texts(tmp_path / "host.svg")
    assert "headroom (GiB)" in host_texts and "least: 39.51 GiB (step 5)" in host_texts

"""``profile_step`` and ``memplan profile``: phases, exact bytes, the first-step anomaly, files.

The tiny MLP below holds (8*16 + 16) + (16*4 + 4) = 212 fp32 parameters = 848 bytes. AdamW
creates two fp32 states per parameter at its first step (exp_avg, exp_avg_sq: 1,696 bytes);
its 0-dim ``step`` counters are host tensors on CUDA and are not counted.
"""

from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")

from typer.testing import CliRunner

from memplan.api import resolve
from memplan.cli import app, main
from memplan.measure.timeline import first_step_anomaly, phase_peaks, summary, write
from memplan.profile import phase, profile_step
from memplan.profile.reference import ReferenceModel
from memplan.profile.reference_profile import profile_reference
from memplan.profile.trace import ref_options, trace

PARAM_BYTES = 848


def _mlp() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)


def _step(model, opt, k):
    loss = model(torch.randn(32, 8)).square().mean()
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    opt.zero_grad()


def test_phases_found_without_labels():
    model, opt = _mlp()
    tl = profile_step(model, opt, _step, steps=3)
    peaks = phase_peaks(tl)
    assert sorted(peaks) == [1, 2, 3]
    for step in peaks.values():
        assert set(step) == {"forward", "backward", "optimizer", "other"}  # clipping: other
    ops = {s.phase: s.op for s in tl.samples if "mm" in s.op}
    assert "forward" in ops and "backward" in ops


def test_exact_bytes_and_first_step_causes():
    model, opt = _mlp()
    tl = profile_step(model, opt, _step, steps=3)
    start, end = tl.of_step(1)[0], tl.of_step(1)[-1]
    assert start.by_category["parameters"] == PARAM_BYTES
    assert start.total_bytes == PARAM_BYTES
    assert end.by_category["optimizer"] == 2 * PARAM_BYTES
    assert end.total_bytes == 3 * PARAM_BYTES  # zero_grad(set_to_none) freed the grads
    # all gradients are alive when backward has ended (the first sample after it)
    after_bwd = next(s for s in tl.of_step(1) if s.phase == "other")
    assert after_bwd.by_category["gradients"] == PARAM_BYTES
    anomaly = first_step_anomaly(tl)
    causes = {c["cause"]: c["bytes"] for c in anomaly["causes"]}
    assert causes == {"optimizer_states": 2 * PARAM_BYTES, "other_persistent": 0}
    # steady forward holds the states step 1's forward did not
    assert peaks_of(tl, 3, "forward") - peaks_of(tl, 1, "forward") == 2 * PARAM_BYTES
    assert anomaly["peak_growth_bytes"] == [0]


def peaks_of(tl, step, ph):
    return phase_peaks(tl)[step][ph].total_bytes


def test_leak_warned_with_exact_growth():
    kept = []

    def leaky(model, opt, k):
        kept.append(torch.zeros(1000))  # 4,000 bytes kept per step
        _step(model, opt, k)

    model, opt = _mlp()
    tl = profile_step(model, opt, leaky, steps=4)
    anomaly = first_step_anomaly(tl)
    assert anomaly["peak_growth_bytes"] == [4000, 4000]
    causes = {c["cause"]: c["bytes"] for c in anomaly["causes"]}
    assert causes["other_persistent"] == 4000
    assert [r["step"] for r in anomaly["later_steps_above_first"]] == [2, 3, 4]
    assert any("leaking" in w for w in anomaly["warnings"])
    assert any("step 4 peaked" in w for w in anomaly["warnings"])


def test_explicit_phase_label():
    def labelled(model, opt, k):
        with phase("other"):
            torch.ones(256)  # 1 KiB, labelled other before the forward
        _step(model, opt, k)

    model, opt = _mlp()
    tl = profile_step(model, opt, labelled, steps=2)
    ones = next(s for s in tl.of_step(1) if "ones" in s.op)
    assert ones.phase == "other" and tl.of_step(1)[0].phase == "forward"
    with pytest.raises(Exception, match="must be one of"), phase("warmup"):
        pass


def test_reference_profile_equals_tracker_peaks():
    spec, par, wl = resolve("tiny", micro_batch_size=2, seq_len=64)
    tl = profile_reference(spec, par, wl, steps=3)
    traced = trace(spec, par, wl, steps=3)
    peaks = phase_peaks(tl)
    for k, measure in enumerate(traced.steps, start=1):
        for ph, want in measure.phases.items():
            assert peaks[k][ph].total_bytes == want.total_bytes
            assert peaks[k][ph].by_category == want.by_category
    anomaly = first_step_anomaly(tl)
    causes = {c["cause"]: c["bytes"] for c in anomaly["causes"]}
    assert causes["optimizer_states"] == traced.steady.optimizer_bytes - traced.first.phases[
        "forward"].by_category["optimizer"]


def test_write_outputs(tmp_path):
    model, opt = _mlp()
    tl = profile_step(model, opt, _step, steps=2)
    pred = {"source": "hand", "first_step": {"forward": 2000}, "steady": {"forward": 4000}}
    paths = write(tl, tmp_path, pred)
    assert [p.name for p in paths] == ["timeline.json", "timeline.csv", "summary.json"]
    rows = (tmp_path / "timeline.csv").read_text().splitlines()
    assert len(rows) == len(tl.samples) + 1
    data = json.loads((tmp_path / "summary.json").read_text())
    assert data == json.loads(json.dumps(summary(tl, pred)))
    vs = {(r["step"], r["phase"]): r for r in data["measured_vs_predicted"]}
    assert vs[(1, "forward")]["measured_bytes"] == peaks_of(tl, 1, "forward")
    assert vs[(2, "forward")]["diff_bytes"] == 4000 - peaks_of(tl, 2, "forward")
    assert len(json.loads((tmp_path / "timeline.json").read_text())["samples"]) == len(tl.samples)


def test_plot_png(tmp_path):
    pytest.importorskip("matplotlib")
    from memplan.report.plot_timeline import plot_timeline

    model, opt = _mlp()
    tl = profile_step(model, opt, _step, steps=2)
    path = plot_timeline(tl, tmp_path / "t.png", predicted_peak_bytes=5000)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_profile_json(tmp_path):
    result = CliRunner().invoke(app, ["profile", "-m", "tiny", "--seq", "64", "--mbs", "2",
                                      "--steps", "3", "--json", "--out", str(tmp_path)],
                                catch_exceptions=False)
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["num_steps"] == 3 and data["device"] == "cpu-tracker"
    # The estimate is exact for the reference model's tensors in every phase but step 1's
    # optimizer step, where AdamW's 0-dim fp32 step counters (one per parameter tensor, 4
    # bytes) are alive on the CPU tracker; on CUDA they are host tensors, not counted.
    spec, _, wl = resolve("tiny", micro_batch_size=2, seq_len=64)
    num_tensors = len(list(ReferenceModel(spec, ref_options(wl)).parameters()))
    for row in data["measured_vs_predicted"]:
        counters = row["label"] == "first_step" and row["phase"] == "optimizer"
        assert row["diff_bytes"] == (-4 * num_tensors if counters else 0), row
    assert (tmp_path / "summary.json").exists() and (tmp_path / "timeline.csv").exists()


@pytest.mark.parametrize("args, msg", [(["--steps", "1"], "steps (1)"),
                                       (["--device", "tpu"], "device 'tpu'")])
def test_cli_profile_errors(capsys, args, msg):
    assert main(["profile", "-m", "tiny", *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("memplan: error:") and msg in err and err.count("\n") == 1


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_profile(tmp_path):
    model, _ = _mlp()
    model = model.cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def step(model, opt, k):
        model(torch.randn(32, 8, device="cuda")).square().mean().backward()
        opt.step()
        opt.zero_grad()

    tl = profile_step(model, opt, step, steps=3)
    assert tl.device == "cuda"
    anomaly = first_step_anomaly(tl)
    causes = {c["cause"]: c["bytes"] for c in anomaly["causes"]}
    assert causes["optimizer_states"] == 2 * PARAM_BYTES
    assert all(s.reserved_bytes >= s.total_bytes for s in tl.samples)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error without CUDA")
def test_cli_cuda_without_device(capsys):
    assert main(["profile", "-m", "tiny", "--device", "cuda"]) == 2
    assert "no CUDA device" in capsys.readouterr().err


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cli_cuda_profile_files(tmp_path):
    result = CliRunner().invoke(app, ["profile", "-m", "tiny", "--seq", "256", "--mbs", "2",
                                      "--device", "cuda", "--perf", "--json",
                                      "--out", str(tmp_path)], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    causes = {c["cause"] for c in data["first_step"]["causes"]}
    assert {"allocator_cache", "outside_allocator"} <= causes
    assert (tmp_path / "snapshot.pickle").stat().st_size > 0
    assert data["perf"]["device"] == "cuda" and data["perf"]["mfu"] is not None
    assert data["perf"]["top_kernels"]

"""docs/accuracy.md is what benchmarks/accuracy_table.py builds from the committed runs."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "accuracy_table.py"


@pytest.fixture(scope="module")
def table():
    spec = importlib.util.spec_from_file_location("accuracy_table", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules["accuracy_table"] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def runs(table):
    return table.load_runs()


def test_every_run_has_a_source_and_a_measurement(table, runs):
    assert runs
    ids = [run["id"] for run in runs]
    assert len(ids) == len(set(ids)), "run ids must be unique"
    for run in runs:
        assert run["source"].strip(), run["id"]
        assert run["quote"].strip(), run["id"]
        assert run["what"].strip(), run["id"]
        assert isinstance(run["measured_bytes"], int) and run["measured_bytes"] > 0, run["id"]
        assert run["quantity"] in table.QUANTITIES, run["id"]
        assert run["rank"] in table.RANKS, run["id"]
        assert run["framework"] in {"megatron", "torchtitan", "hf", "lightning", "generic"}
        assert isinstance(run["not_expressible"], list), run["id"]
        assert "model" in run["memplan_args"] and "gpus" in run["memplan_args"], run["id"]


def test_committed_configs_exist(runs):
    for run in runs:
        model = run["memplan_args"]["model"]
        if "/" in model:
            assert (ROOT / model).is_file(), f"{run['id']}: {model} is missing"


def test_committed_doc_is_current(table, runs, monkeypatch):
    """The doc is the text built from the committed runs, and ``--check`` says so; ``--check``
    builds that text from the same committed files (``render(build_rows(load_runs()))``), so
    the rows and the text built here are handed to it for equal inputs, not built twice."""
    import json

    rows, texts = {}, {}
    build_rows, render = table.build_rows, table.render

    def rows_once(given, *args):
        key = json.dumps([given, args], sort_keys=True)
        if key not in rows:
            rows[key] = build_rows(given, *args)
        return rows[key]

    def text_once(built, *args, **kwargs):
        if args or kwargs:
            return render(built, *args, **kwargs)
        if id(built) not in texts:
            texts[id(built)] = render(built)
        return texts[id(built)]

    monkeypatch.setattr(table, "build_rows", rows_once)
    monkeypatch.setattr(table, "render", text_once)
    text = table.render(table.build_rows(runs))
    assert (ROOT / "docs" / "accuracy.md").read_text() == text, (
        "docs/accuracy.md is stale: run python benchmarks/accuracy_table.py")
    assert table.main(["--check"]) == 0


def test_torch_free():
    """The table builder never imports torch, held-out runs included (checked in a fresh
    interpreter)."""
    code = ("import importlib.util, sys; "
            f"spec = importlib.util.spec_from_file_location('accuracy_table', {str(SCRIPT)!r}); "
            "m = importlib.util.module_from_spec(spec); sys.modules['accuracy_table'] = m; "
            "spec.loader.exec_module(m); "
            "m.build_rows(m.load_runs()); m.build_heldout(); "
            "sys.exit(1 if 'torch' in sys.modules else 0)")
    assert subprocess.run([sys.executable, "-c", code], check=False, timeout=60).returncode == 0


# ------------------------------------------------------------------ other estimators

@pytest.fixture(scope="module")
def others(table):
    return {e["id"]: e for e in table.load_others()}


def _by_id(runs, run_id):
    return next(run for run in runs if run["id"] == run_id)


def test_other_estimators_cover_every_run(others, runs):
    """Every estimator that ran has an entry for every published run, with its version, and
    each number it is compared on is one of its stored outputs."""
    assert {"llm-analysis", "megatron", "deepspeed", "accelerate"} <= set(others)
    assert "runs" not in others["accelerate"] and others["accelerate"]["reason"]
    for est in (e for e in others.values() if "runs" in e):
        assert est["version"] and est["label"] and est["leaves_out"], est["id"]
        assert set(est["runs"]) == {run["id"] for run in runs}, est["id"]
        for run in runs:
            entry = est["runs"][run["id"]]
            assert entry["status"] in {"ok", "n/a", "refused"}, (est["id"], run["id"])
            if entry["status"] == "n/a":
                assert entry["reason"], (est["id"], run["id"])
                continue
            assert entry["inputs"], (est["id"], run["id"])
            if entry["status"] == "ok":
                assert est["compared"][run["quantity"]] in entry["outputs"]


def test_megatron_weights_and_optimizer_by_hand(table, others, runs):
    """Megatron's weight_and_optimizer for the 7B tp4 pp1 run (distributed optimizer, dp 2),
    compared with allocated between steps. h 4096, 32 heads, 8 query groups, ffn 16384,
    untied, vocab 131584 (padded for tp 4), LayerNorm:
    attention 2 h^2 (1 + 8/32) = 41,943,040; MLP 2 h ffn = 134,217,728; per-layer norms 2 h 2
    = 16,384. On a tp rank: (32 x 176,160,768 + 2 x 4096 x 131584) / 4 = 1,678,770,176
    sharded plus 32 x 16,384 + 2 x 4096 = 532,480 replicated = 1,679,302,656 parameters,
    at 6 + 12 / 2 = 12 bytes: 20,151,631,872 bytes (19218.09375 of its 2^20-byte 'MB')."""
    run = _by_id(runs, "megatron-ci/gpt3_7b_tp4_pp1_memory_speed/allocated")
    est = others["megatron"]
    assert est["runs"][run["id"]]["outputs"]["weight_and_optimizer_mb"] == 19218.09375
    other = table.other_estimate(est, run)
    assert other.estimate_bytes == 1_679_302_656 * 12 == 20_151_631_872
    assert other.note is None


def test_llm_analysis_model_states_by_hand(table, others, runs):
    """llm-analysis on the same run: per layer 2 h^2 + 2 h (h 8/32) = 41,943,040 attention,
    2 h ffn = 134,217,728 MLP, 2 h = 8,192 norm weights; one (tied) 4096 x 131584 embedding and
    a 4096 final norm: 32 x 176,168,960 + 538,968,064 + 4,096 = 6,176,378,880 parameters,
    over tp 4: 2 bytes of weights, 4 of gradients, 12 of optimizer states over dp 2 (ZeRO-1):
    6,176,378,880 / 4 x (2 + 4 + 12 / 2) = 18,529,136,640 bytes."""
    run = _by_id(runs, "megatron-ci/gpt3_7b_tp4_pp1_memory_speed/allocated")
    est = others["llm-analysis"]
    outputs = est["runs"][run["id"]]["outputs"]
    assert outputs["num_params_total"] == 6_176_378_880
    other = table.other_estimate(est, run)
    assert other.estimate_bytes == 6_176_378_880 // 4 * 12 == 18_529_136_640
    err = table.error_pct(other.estimate_bytes, run["measured_bytes"])
    assert err == pytest.approx(100 * (18_529_136_640 - 20_663_519_232) / 20_663_519_232)


def test_deepspeed_zero3_by_hand(table, others, runs):
    """DeepSpeed's ZeRO-3 GPU number (no offload) for Llama-3-8B on 8 GPUs: 4 bytes x the
    largest layer (the 128256 x 4096 = 525,336,576 embedding) + 18 bytes x 8,030,261,248
    parameters / 8 = 2,101,346,304 + 18,068,087,808 = 20,169,434,112 bytes, compared with
    the measured peak reserved (model states only)."""
    run = _by_id(runs, "torchtitan/llama3.1-8b/8gpu-fsdp-sac")
    est = others["deepspeed"]
    entry = est["runs"][run["id"]]
    assert entry["inputs"]["kwargs"]["total_params"] == 8_030_261_248
    assert entry["inputs"]["kwargs"]["largest_layer_params"] == 128256 * 4096
    other = table.other_estimate(est, run)
    assert other.estimate_bytes == 4 * 525_336_576 + 18 * 8_030_261_248 // 8 == 20_169_434_112


def test_not_expressible_and_refused_cells(table, others, runs):
    cp_run = _by_id(runs, "torchtitan/llama3.1-8b/8gpu-fsdp4-cp2-seq65536")
    assert table.other_estimate(others["llm-analysis"], cp_run).note == (
        "n/a: no context parallelism (cp 2)")
    titan = _by_id(runs, "torchtitan/llama3.1-8b/8gpu-fsdp-sac")
    assert table.other_estimate(others["megatron"], titan).note.startswith("n/a: ")
    refused = table.other_estimate(others["llm-analysis"], titan)
    assert refused.estimate_bytes is None and refused.note.startswith("refused: AssertionError")


def test_other_summary_compares_on_the_same_runs(table):
    """memplan's statistics next to an estimator cover only the runs that estimator gives a
    number for (and memplan does not refuse)."""
    def run(run_id):
        return {"id": run_id, "measured_bytes": 100, "quantity": "max_allocated",
                "not_expressible": []}

    est = {"id": "x", "label": "X", "tool": "X", "version": "1"}
    rows = [
        table.Row(run("a"), 110, others=(table.Other("X", 80),)),  # X -20%, memplan +10%
        table.Row(run("b"), 150, others=(table.Other("X", None, "n/a: no cp"),)),
        table.Row(run("c"), None, refused="no", others=(table.Other("X", 50),)),
    ]
    line = table._other_summary(0, est, rows)
    assert "a number for 2 of 3 runs (0 refused, 1 n/a)" in line
    assert ("X median |error| 20.0%, max |error| 20.0%, mean signed error -20.0% over 1 runs; "
            "memplan on the same runs: median |error| 10.0%, max |error| 10.0%, mean signed "
            "error +10.0% over 1 runs") in line
    assert "On 1 runs memplan refuses: -50.0%" in line


# ------------------------------------------------------------------ error ceilings

# Each published run's |error| ceiling in percentage points, and its error when the ceiling was
# set (the comment). Rule: today's |error| rounded up to the next 0.5 point, plus 1 point, so a
# change that moves a run's error by more than about a point away from the measurement fails
# here even while the table is regenerated; one that brings it closer passes (then lower the
# ceiling by the same rule). A new run needs a ceiling by the same rule.
CEILING_PCT = {
    "megatron-ci/gpt3_7b_tp1_pp4_memory_speed": 2.0,  # -0.89%
    "megatron-ci/gpt3_7b_tp1_pp4_memory_speed/allocated": 7.0,  # -5.82%
    "megatron-ci/gpt3_7b_tp4_pp1_memory_speed": 1.5,  # -0.36%
    "megatron-ci/gpt3_7b_tp4_pp1_memory_speed/allocated": 2.0,  # -0.50%
    "megatron-ci/gpt3_mcore_te_tp1_pp1_resume_torch_dist_dist_optimizer": 4.0,  # -2.66%
    "megatron-ci/gpt3_mcore_te_tp1_pp1_dist_optimizer_no_mmap_bin_files": 2.5,  # -1.48%
    "megatron-ci/gpt3_mcore_te_tp1_pp1_resume_torch_dist_uniform_full_recompute": 4.0,  # -2.99%
    "megatron-ci/gpt3_mcore_te_tp1_pp2_resume_torch_dist_rope_embeddings": 4.5,  # -3.33%
    "megatron-ci/gpt3_mcore_te_tp1_pp4_resume_torch_dist_swiglu": 3.5,  # -2.49%
    "megatron-ci/gpt3_mcore_te_tp1_pp4_vp1": 3.5,  # -2.27%
    "megatron-ci/gpt3_mcore_te_tp1_pp4_vp1_resume_torch_dist": 4.5,  # -3.32%
    "megatron-ci/gpt3_mcore_te_tp2_pp2_resume_torch_dist": 7.0,  # -5.97%
    "megatron-ci/gpt3_mcore_te_tp2_pp2_cp2_nondeterministic": 10.5,  # -9.24%
    "megatron-ci/gpt3_mcore_te_tp4_pp1_resume_torch_dist_dist_optimizer_overlap_grad_reduce":
        9.5,  # -8.16%
    "megatron-ci/gpt3_mcore_te_tp4_pp2_resume_torch_dist_reshard_8x1xNone": 11.5,  # -10.27%
    # --transformer-impl local: Megatron's global memory buffer (attention_global_buffer)
    # modelled, +67,108,864 B and +16,777,216 B (were -3.13% and +4.38%)
    "megatron-ci/gpt3_mcore_tp1_pp2": 2.5,  # -1.29%
    "megatron-ci/gpt3_mcore_tp4_pp1_resume_torch_dist": 6.5,  # +5.52%
    # the torchtitan rows with the settings their commits' code sets (9dec370; the H200 row
    # e7c0cae): gradients freed by zero_grad, one RoPE buffer, the root unit resharded after
    # forward, wq/wk/wv; at 9dec370 also the foreach AdamW and the upcast RMSNorm; lowered when
    # FSDP2's sharded gradients were replayed on its reduce-scatter stream
    "torchtitan/llama3.1-8b/8gpu-fsdp-sac": 3.5,  # -2.04%
    "torchtitan/llama3.1-8b/128gpu-fsdp-sac": 3.0,  # -1.59%
    "torchtitan/llama3.1-8b/8gpu-fsdp8-cp1-seq32768": 6.5,  # -5.24%
    "torchtitan/llama3.1-8b/8gpu-fsdp4-cp2-seq65536": 7.0,  # -5.56%
    "torchtitan/llama3.1-8b/8gpu-fsdp2-cp4-seq131072": 6.5,  # -5.30%
    "torchtitan/llama3.1-8b/8gpu-fsdp1-cp8-seq262144": 7.0,  # -5.79%
    "torchtitan/llama3.1-70b/256gpu-fsdp32-tp8": 7.5,  # -6.33%
    "torchtitan/llama3.1-405b/512gpu-fsdp8-tp8-pp8-1f1b": 18.5,  # -17.30%
    "torchtitan/llama3.1-405b/512gpu-fsdp8-tp8-pp8-cp1-seq32768": 10.5,  # -9.40%
    # its loss compiled whole (--compile-loss: e7c0cae's build_cross_entropy_loss)
    "torchtitan/llama3.1-8b/h200-32gpu-fsdp-sac-float8": 2.5,  # +1.30%
}


def test_inconsistent_published_runs_are_listed_under_the_runs(table):
    """A published run with ``inconsistent`` is listed, with that text, under the runs' table
    (before the held-out section); runs without it are not."""
    def run(run_id, **extra):
        return {"id": run_id, "measured_bytes": 100, "quantity": "max_allocated", **extra}

    lines = table._inconsistent([run("a", inconsistent="7 GiB above b at equal tensors"),
                                 run("b")])
    assert lines[-1] == "- `a`: 7 GiB above b at equal tensors."
    assert sum(line.startswith("- `") for line in lines) == 1
    assert table._inconsistent([run("b")]) == []
    doc = (ROOT / "docs" / "accuracy.md").read_text()
    runs_part = doc[doc.index("## Runs"):doc.index("## Held-out runs")]
    assert "- `torchtitan/llama3.1-405b/512gpu-fsdp8-tp8-pp8-1f1b`: Table 5's 1F1B" in runs_part


def test_every_run_stays_within_its_error_ceiling(table, runs):
    """Every published run has a ceiling, every ceiling a run, and memplan's |error| on each
    (estimated, not refused) is at most its ceiling."""
    assert set(CEILING_PCT) == {run["id"] for run in runs}
    rows = table.build_rows(runs)
    over = [(r.run["id"], r.refused or round(r.error_pct, 2), CEILING_PCT[r.run["id"]])
            for r in rows if r.error_pct is None or abs(r.error_pct) > CEILING_PCT[r.run["id"]]]
    assert not over, f"runs beyond their error ceiling (id, error %, ceiling): {over}"


# ------------------------------------------------------------------ held-out runs

HELDOUT_SETTINGS = {"gpus", "gpu", "megatron_args", "torchtitan_config", "options"}


@pytest.fixture(scope="module")
def heldout(table):
    return table.load_heldout()


def test_heldout_runs_are_apart_and_described_by_the_trainer(table, heldout, runs):
    """Each held-out run has a source, a quote and a measurement like a published run, none is
    a published run, and memplan sees it only through the trainer's own settings (no
    memplan arguments written for it); each Megatron config it names is committed and
    holds the flags the record lists."""
    assert heldout
    ids = [run["id"] for run in heldout]
    assert len(ids) == len(set(ids)), "held-out run ids must be unique"
    assert not set(ids) & {run["id"] for run in runs}, "a held-out run is also published"
    for run in heldout:
        assert run["source"].startswith("https://"), run["id"]
        assert run["quote"].strip() and run["what"].strip(), run["id"]
        assert isinstance(run["measured_bytes"], int) and run["measured_bytes"] > 0, run["id"]
        assert run["quantity"] in table.QUANTITIES and run["rank"] in table.RANKS, run["id"]
        assert "memplan_args" not in run, run["id"]
        settings = run["trainer_settings"]
        assert set(settings) <= HELDOUT_SETTINGS and {"gpus", "gpu"} <= set(settings)
        if "megatron_args" in settings:
            text = (ROOT / settings["megatron_args"]).read_text()
            assert "MODEL_ARGS:" in text, run["id"]
            for flag in run["flags"]:
                assert f"  {flag}:" in text, (run["id"], flag)
            assert str(run["measured_bytes"]) in run["quote"].replace(".0;", ";"), run["id"]


def test_heldout_command_is_the_trainer_settings(table):
    """A Megatron run's settings become exactly `memplan estimate --json --gpus 8 --gpu
    h100-sxm --megatron-args FILE`, the file as stored (relative to the repository)."""
    settings = {"megatron_args": "benchmarks/data/heldout/megatron/x.yaml", "gpus": 8,
                "gpu": "h100-sxm"}
    assert table.settings_command(settings) == [
        "estimate", "--json", "--gpus", "8", "--gpu", "h100-sxm",
        "--megatron-args", "benchmarks/data/heldout/megatron/x.yaml"]
    assert table.settings_command({**settings, "options": ["--grad-sync", "last"]})[-2:] == [
        "--grad-sync", "last"]


def test_heldout_refusal_is_reported_with_the_stored_path(table, heldout, tmp_path):
    """A refused run is a row without a number whose reason is memplan's own one line, naming
    the config by the path its settings give (so the doc is the same on every machine). The
    MTP run's config with its layout's m moved to rank 0's last virtual stage ("Et*3|(tt|)*
    5ttm|L", Megatron's standalone MTP stage) is refused."""
    run = next(r for r in heldout if r["id"].endswith("tp2_pp2_ep4_etp1_fine_grained_offloading"))
    text = (ROOT / run["trainer_settings"]["megatron_args"]).read_text()
    config = tmp_path / "standalone_mtp.yaml"
    config.write_text(text.replace("Et*3|(tt|)*6mL", "Et*3|(tt|)*5ttm|L"))
    run = {**run, "trainer_settings": {**run["trainer_settings"], "megatron_args": str(config)}}
    held = table.evaluate_heldout(run)
    assert held.row.memplan_bytes is None and held.estimate is None
    assert held.row.refused.startswith(
        f"Megatron-LM arguments {config}: --pipeline-model-parallel-layout = ")
    assert "outside the last stage" in held.row.refused


def test_heldout_estimate_is_the_last_stage_peak_allocated(table, heldout):
    """An estimated run compares the last stage's tensor peak + workspace of the CLI's JSON,
    the same number `memplan estimate --megatron-args FILE` prints for that stage."""
    run = next(r for r in heldout if r["id"].endswith("tp2_pp1_te_8experts_etp1_ep4"))
    held = table.evaluate_heldout(run)
    last = held.estimate["stages"][-1]
    assert held.row.memplan_bytes == last["tensor_peak_bytes"] + last["workspace_bytes"]
    assert held.estimate["layout"]["etp"] == 1 and held.estimate["layout"]["ep"] == 4


def test_heldout_summary_by_hand(table):
    """Errors +10%, -20% and +5% with one refusal: median |error| 10%, max 20%, mean signed
    -1.7%; 1 of 3 within 8%, 1 below -15%; the most under is the -20% run."""
    def run(run_id):
        return {"id": run_id, "measured_bytes": 100, "framework": "megatron"}

    held = [table.HeldOut(table.Row(run("a"), 110)), table.HeldOut(table.Row(run("b"), 80)),
            table.HeldOut(table.Row(run("c"), 105)),
            table.HeldOut(table.Row(run("d"), None, refused="no"))]
    lines = table.heldout_summary(held)
    assert lines[0] == "- 4 held-out runs (megatron): 3 estimated, 1 refused."
    assert lines[1] == ("- Estimated runs: median |error| 10.0%, max |error| 20.0%, mean "
                        "signed error -1.7% over 3 runs.")
    assert lines[2] == "- Largest |error|: -20.0% (b); most under: -20.0% (b)."
    assert lines[3] == "- Within 8%: 1 of 3; below -15%: 1."


def test_heldout_collector_reads_model_args():
    """The collector's MODEL_ARGS reader: indented `--flag: value` lines under MODEL_ARGS,
    comments after ' #' dropped, other blocks ignored."""
    spec = importlib.util.spec_from_file_location(
        "heldout_megatron", ROOT / "benchmarks" / "heldout_megatron.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    text = ("ENV_VARS:\n  CUDA_DEVICE_MAX_CONNECTIONS: 1\nMODEL_ARGS:\n  # sizes\n"
            "  --num-layers: 12\n  --dist-ckpt-strictness: log_all # TE\n"
            "  --qk-layernorm: true\nTEST_TYPE: regular\n")
    assert module.model_args(text) == {"--num-layers": "12", "--dist-ckpt-strictness": "log_all",
                                       "--qk-layernorm": "true"}


# ------------------------------------------------------------------ fine-tuning runs (held out)

@pytest.fixture(scope="module")
def finetune_runs(table):
    return table.load_finetune_runs()


@pytest.fixture(scope="module")
def finetune_rows(table, finetune_runs):
    """The committed fine-tuning runs' rows, built once for the tests that read them."""
    return table.build_finetune_rows(finetune_runs)


def test_every_finetune_run_has_a_source_and_a_measurement(table, runs, finetune_runs):
    """The held-out fine-tuning runs use the published runs' record format, with ids of their
    own, and name only catalog models or committed configs."""
    from memplan.spec import catalog_names

    assert finetune_runs
    ids = [run["id"] for run in finetune_runs]
    assert len(ids) == len(set(ids)), "run ids must be unique"
    assert not set(ids) & {run["id"] for run in runs}, "a fine-tuning id is also a published id"
    catalog = set(catalog_names())
    for run in finetune_runs:
        for key in ("source", "quote", "what", "unit_note", "notes"):
            assert run[key].strip(), (run["id"], key)
        assert run["source"].startswith("https://"), run["id"]
        assert isinstance(run["measured_bytes"], int) and run["measured_bytes"] > 0, run["id"]
        assert run["quantity"] in table.QUANTITIES, run["id"]
        assert run["rank"] in table.RANKS, run["id"]
        assert isinstance(run["not_expressible"], list), run["id"]
        args = run["memplan_args"]
        assert "gpus" in args, run["id"]
        model = args["model"]
        assert model in catalog or (ROOT / model).is_file(), f"{run['id']}: {model}"


def test_finetune_measured_bytes_follow_the_quoted_unit(finetune_runs):
    """measured_bytes is the quoted number in the unit the source prints: torchtune's
    memory_stats_log divided by 1e9 until mid-2024 ("GB"), its get_memory_stats by 1024**3
    later ("GiB")."""
    by_id = {run["id"]: run for run in finetune_runs}
    assert by_id["torchtune/llama2-7b/qlora-single-device-tutorial"]["measured_bytes"] == (
        9_290_000_000)
    # 7.4 x 1,073,741,824 = 7,945,689,497.6, rounded to whole bytes
    assert by_id["torchtune/llama3.1/readme-qlora-single-device-1x4090"]["measured_bytes"] == (
        7_945_689_498)


def _run(args, run_id="synthetic"):
    return {"id": run_id, "measured_bytes": 10 * 2**30, "quantity": "max_reserved",
            "rank": "max", "framework": "generic", "not_expressible": [],
            "source": "https://example.org", "memplan_args": args}


def test_an_option_memplan_does_not_accept_is_pending_not_an_error(table):
    """An option (or value) memplan refuses makes the row "not yet expressible: <flag value>"
    with no estimate; a row has no pending options when memplan accepts all of them. The
    keyword ``lora_rank_that_never_exists`` stands for an option of a later version: it is
    listed among the probed options for this test only."""
    options = dict(table.FINETUNE_OPTIONS)
    try:
        table.FINETUNE_OPTIONS["lora_rank_that_never_exists"] = "--lora-rank-that-never-exists"
        table.FINETUNE_OPTIONS["optimizer"] = "--optimizer"
        base = {"model": "tiny", "gpus": 1, "seq_len": 64}
        row = table.evaluate(_run({**base, "optimizer": "adamw",
                                   "lora_rank_that_never_exists": 8}))
        assert row.pending == ("--lora-rank-that-never-exists 8",)
        assert row.memplan_bytes is None and row.refused is None and not row.expressed
        assert row.error_pct is None
        bad_value = table.evaluate(_run({**base, "optimizer": "no-such-optimizer"}))
        assert bad_value.pending == ("--optimizer no-such-optimizer",)
        accepted = table.evaluate(_run({**base, "optimizer": "adamw"}))
        assert accepted.pending == () and accepted.memplan_bytes > 0 and accepted.expressed
    finally:
        table.FINETUNE_OPTIONS.clear()
        table.FINETUNE_OPTIONS.update(options)


def test_pending_rows_render_and_are_counted_apart(table):
    """A pending row shows its flags in the memplan cell, no error, and counts only on the
    not-yet-expressible line; an expressed row counts in the fine-tuning statistics."""
    pending = table.Row(_run({"model": "tiny", "gpus": 1, "lora_rank": 8}, "p"), None,
                        pending=("--lora-rank 8",))
    done = table.Row(_run({"model": "tiny", "gpus": 1}, "d"), 11 * 2**30)  # +10.0%
    lines = table.render_finetune([pending, done])
    row_p = next(line for line in lines if line.startswith("| p |"))
    assert "| not yet expressible: --lora-rank 8 |  |" in row_p
    assert ("- Runs memplan expresses: median |error| 10.0%, max |error| 10.0%, mean signed "
            "error +10.0% over 1 runs.") in lines
    assert ("- Not yet expressible (options memplan does not accept yet: --lora-rank): 1."
            in lines)


def test_inconsistent_finetune_runs_are_listed_under_their_table(table):
    """A fine-tuning run with ``inconsistent`` is listed, with that text, under the
    fine-tuning table; the committed torchtune README row whose number predates its config's
    truncation (README a95c6b931, untruncated Alpaca samples) is listed in the doc."""
    odd = table.Row(_run({"model": "tiny", "gpus": 1}, "odd")
                    | {"inconsistent": "measured a month earlier on longer samples"},
                    11 * 2**30)
    lines = table.render_finetune([odd])
    assert "- `odd`: measured a month earlier on longer samples." in lines
    assert lines.index("- `odd`: measured a month earlier on longer samples.") > next(
        k for k, line in enumerate(lines) if line.startswith("| odd |"))
    doc = (ROOT / "docs" / "accuracy.md").read_text()
    part = doc[doc.index("## Fine-tuning runs (held out)"):]
    part = part[:part.index("\n## ", 1)]
    assert "- `torchtune/llama2-7b/readme-lora-single-device-1x4090`: its 17.18 GB" in part


def test_committed_finetune_rows_never_crash(finetune_rows, finetune_runs):
    """Every committed fine-tuning run becomes a row: an estimate, a refusal with its
    message, or the options memplan does not accept yet."""
    rows = finetune_rows
    assert len(rows) == len(finetune_runs)
    for row in rows:
        assert row.pending or row.refused or row.memplan_bytes, row.run["id"]


# The target for the held-out fine-tuning runs, checked once enough of them are
# expressible (before the fine-tuning options exist, only a few full fine-tuning runs are).
FINETUNE_MEDIAN_TARGET_PCT = 8.0
FINETUNE_MIN_EXPRESSED = 8


# Not met yet: the median |error| of the fine-tuning runs memplan expresses, as measured
# (docs/accuracy.md's fine-tuning section). The largest misses: peft's FSDP-QLoRA 70B runs
# (-19% to -37%; FSDP1's QLoRA units are traced and modelled, and the no-offload run moved
# from -17.8% to -18.8% with them: the gap is outside the units' gathers, cause not found yet;
# the CPU-offload runs stand in with FSDP2's offload), torchtune's FSDP1 runs (LoRA on 2 GPUs -30%, the 4-GPU
# full fine-tune -23%) and its QLoRA tutorial run (-18%: torchao 0.1's whole-tensor
# quantization at load is counted, nf4-torchao-0.1; the caching allocator's segments left
# from quantizing the smaller attention weights are not). The QLoRA run moved from -45.5% to
# -18.4% without moving the median (it stays above it). The optimizer stepped in backward
# (--optimizer-in-backward) made torchtune's 7B low-memory run expressible (+3.8%; +96.5%
# before, with every gradient held): 13 runs, the median from 14.90 to 13.72. --compile made
# torchtune's packed, compiled 3B run expressible (+13.6% eager, -3.6% compiled; its recipe
# discards compile_loss's wrapper, so the loss runs eagerly): 14 runs, median 13.44.
# logits_held output (the loop keeps the model's output, its bf16 logits and key/value cache,
# to the next model call: peft's method_comparison run.py) made its four MetaMathQA runs
# expressible (-0.3/-0.9/+1.9/-4.5% -> +3.4/+2.8/+5.3/-2.3%): 18 runs, median 8.14. LoRA on
# the output projection (--lora-targets output) made torchtune's two all-layers runs
# expressible (-4.7/+2.8% as the closest run -> -4.6/+3.1%): 20 runs, median 4.92. A known
# deviation: the test fails when the median moves by more than 0.05 percentage points (update
# it with the cause), and passes once it is at the target. torchtune's compiled chunked loss
# (--compile-loss) and compile with LoRA (--compile-in-checkpoint, a frozen head making no
# weight gradient) made nine compiled runs expressible or re-priced: 29 runs, median 9.51 (the
# new runs are the llama3.1 README's, +11.1/+31.2/+11.2/+14.9%, above the old median).
# Since re-priced below the target (the test returns there): 29 runs at a 4.2% median; then
# base_quant nf4-torchao (torchao's NF4Tensor since 0.3) made torchtune's three compiled
# QLoRA runs expressible (+7.0% / +9.0% / +38.8% on tensors): 32 runs, median 5.92.
FINETUNE_MEDIAN_KNOWN_PCT = 5.92


def test_finetune_median_error_target(finetune_rows):
    """The issue's target (median |error| <= 8% over the expressed fine-tuning runs), or, until
    it is met, the median as last measured (``FINETUNE_MEDIAN_KNOWN_PCT``)."""
    rows = finetune_rows
    errors = [abs(r.error_pct) for r in rows if r.expressed]
    if len(errors) < FINETUNE_MIN_EXPRESSED:
        pytest.skip(f"{len(errors)} fine-tuning runs expressible; the target needs "
                    f"{FINETUNE_MIN_EXPRESSED}")
    import statistics

    median = statistics.median(errors)
    if median <= FINETUNE_MEDIAN_TARGET_PCT:
        return
    assert abs(median - FINETUNE_MEDIAN_KNOWN_PCT) <= 0.05, (median, sorted(errors))


# Error ceilings of the fine-tuning runs memplan expresses, by the rule of CEILING_PCT. A run
# that becomes expressible when a fine-tuning option lands gets its ceiling then; until it has
# one it is shown in docs/accuracy.md and counted in the median target above.
FINETUNE_CEILING_PCT = {
    # (torchtune's LoRA rows at 0914d5cf, ff594c23 and fef3ed10 ran with no adapter dropout
    # and bf16 adapters, as their builders make them: each moved under when the run's
    # configuration said so, benchmarks/data/finetune_runs.json)
    "torchtune/llama2-7b/readme-full-distributed-4x4090": 24.0,  # -22.74%
    "peft-metamathqa/full-finetuning--llama-3.2-3B-lr_0.00001": 3.5,  # -2.33%
    "peft-metamathqa/lora--llama-3.2-3B-rank32": 4.5,  # +3.40%
    "peft-metamathqa/lora--llama-3.2-3B-rank64": 4.0,  # +2.82%
    "peft-metamathqa/lora--llama-3.2-3B-rank10-target-mlp": 6.5,  # +5.27%
    "torchtune/llama3.2-3b/readme-optimization-flags-full-packed": 4.5,  # -3.48%
    "torchtune/llama3.2-3b/readme-optimization-flags-full-packed-compile": 5.0,  # -3.61%
    "torchtune/llama3.2-3b/readme-optimization-flags-full-packed-compile-chunked-ce":
        5.5,  # -4.22%
    "torchtune/llama3.2-3b/readme-optimization-flags-full-activation-checkpointing":
        21.5,  # +20.18%
    "torchtune/llama3.2-3b/readme-optimization-flags-full-optimizer-in-backward": 1.5,  # +0.12%
    "torchtune/llama3.2-3b/readme-optimization-flags-full-activation-offloading": 1.5,  # +0.07%
    "torchtune/llama3.2-3b/readme-optimization-flags-full-8bit-adamw": 11.0,  # -9.51%
    "torchtune/llama3.1/readme-full-single-device-1x4090": 12.5,  # +11.06%
    # the allocator model's reserved peak (max_reserved): its FSDP2 gathers' instants are
    # one tensor each on the gather stream (docs/allocator.md, not modelled); lowered when the
    # root unit's end of backward was replayed as its tensors
    "torchtune/llama3.1/readme-full-distributed-8xa100-cpu-offload": 102.5,  # +101.35%
    "torchtune/llama3.1/readme-lora-single-device-1x4090": 12.5,  # +11.89%
    "torchtune/llama3.1/readme-lora-distributed-8xa100": 30.5,  # +29.18%
    "torchtune/llama2-7b/readme-full-low-memory-1x4090": 5.0,  # +3.77%
    # (and with the loop's held fp32 logits and every layer's fp32 RoPE buffers, which a
    # trace of torchtune's step at the 7B's dimensions holds: logits_held step, rope_cache
    # layer-max; each moved closer)
    "torchtune/llama2-7b/lora-single-device-all-layers-r8": 5.0,  # -3.61%
    "torchtune/llama2-7b/lora-single-device-all-layers-r64": 6.0,  # -4.62%
}


def test_finetune_runs_stay_within_their_error_ceilings(finetune_rows):
    rows = {r.run["id"]: r for r in finetune_rows}
    assert set(FINETUNE_CEILING_PCT) <= set(rows)
    over = [(run_id, rows[run_id].refused or rows[run_id].pending
             or round(rows[run_id].error_pct, 2), ceiling)
            for run_id, ceiling in FINETUNE_CEILING_PCT.items()
            if rows[run_id].error_pct is None or abs(rows[run_id].error_pct) > ceiling]
    assert not over, f"fine-tuning runs beyond their error ceiling: {over}"


# ------------------------------------------------------------------ out-of-memory reports

def test_oom_reports_name_a_job_and_the_savers_that_fit():
    """benchmarks/data/oom_reports.json: real out-of-memory reports of fine-tuning jobs, each
    the failing job as memplan.estimate arguments (catalog models only) and the savers
    expected to fit, each a change of those arguments."""
    import json

    from memplan.spec import catalog_names

    reports = json.loads((ROOT / "benchmarks" / "data" / "oom_reports.json").read_text())
    assert len(reports) >= 8
    ids = [r["id"] for r in reports]
    assert len(ids) == len(set(ids))
    for report in reports:
        for key in ("source", "quote", "what_ran_out", "reported_fix", "capacity_note"):
            assert report[key].strip(), (report["id"], key)
        assert report["source"].startswith("https://github.com/"), report["id"]
        args = report["memplan_args"]
        assert args["model"] in catalog_names() and args["gpus"] >= 1, report["id"]
        expected = report["expected"]
        assert expected["baseline_fits"] is False and expected["basis"].strip(), report["id"]
        assert expected["fits_with"], report["id"]
        for saver in expected["fits_with"]:
            assert saver["saver"] and saver["flags"].startswith("--"), report["id"]
            assert saver["change"] and not set(saver["change"]) - set(args) - {
                "zero", "offload", "base_quant", "recompute", "optimizer", "precision",
                "micro_batch_size"}, report["id"]


def test_rows_become_estimates_once_the_options_exist(table, finetune_runs, monkeypatch):
    """Once memplan accepts the fine-tuning options, no row is pending and the section renders
    with every run estimated. Stands in for that memplan: an estimate that accepts the options
    and drops them (an unknown GPU becomes the default one)."""
    real = table.memplan.estimate

    def accepting(model, **kwargs):
        for key in table.FINETUNE_OPTIONS:
            kwargs.pop(key, None)
        return real(model, **kwargs)

    monkeypatch.setattr(table.memplan, "estimate", accepting)
    rows = table.build_finetune_rows(finetune_runs)
    assert not [r.run["id"] for r in rows if r.pending or r.refused]
    lines = table.render_finetune(rows)
    assert not any("not yet expressible:" in line for line in lines)
    assert "- Not yet expressible (options memplan does not accept yet: none): 0." in lines


# ------------------------------------------------------------------ DeepSpeed runs (held out)

DEEPSPEED_SETTINGS = {"gpus", "gpu", "deepspeed_config", "options"}

# Error ceilings of the DeepSpeed runs memplan estimates, by the rule of CEILING_PCT; the
# runs it cannot express (ZeRO-3, ZeRO-Offload) must stay refused with their reason until
# they are modelled (then they get a ceiling here).
DEEPSPEED_CEILING_PCT = {
    # the gas-8 rows never reached an optimizer step (measured_phases, the evidence in the
    # records' notes): step 1's forward and backward, no Adam state
    "gist-chenyaofo/llama-7b/zero2-mbs1": 2.0,  # +0.71%
    "gist-chenyaofo/llama-7b/zero2-ckpt-mbs1": 2.5,  # -1.11%
    "gist-chenyaofo/llama-7b/zero2-ckpt-mbs4": 7.0,  # -5.70%
    "gist-chenyaofo/llama-7b/zero2-ckpt-offload-mbs1": 2.5,  # +1.40%
    "gist-chenyaofo/llama-7b/zero3-mbs2": 10.0,  # -9.05%
    "gist-chenyaofo/llama-7b/zero3-ckpt-mbs2": 9.0,  # +8.09%
    "gist-chenyaofo/llama-7b/zero3-ckpt-mbs8": 2.0,  # -0.93%
    # two micro-batches of 8 per step measured 23.1 GiB above one (36.41 -> 59.51): ZeRO-3
    # accumulates in place into its resident gradient partitions; contradicted by the gist's
    # own rows (the record's "inconsistent")
    "gist-chenyaofo/llama-7b/zero3-ckpt-mbs8-gbs128": 40.0,  # -39.38%
    "gist-chenyaofo/llama-7b/zero3-ckpt-offload-optimizer-mbs2": 10.0,  # +9.1%
    # below what the gist's own ZeRO-3 rows at mbs 2 and 8 hold beside their model states,
    # interpolated to mbs 4 (the record's "inconsistent")
    "gist-chenyaofo/llama-7b/zero3-ckpt-offload-all-mbs4": 80.0,  # +78.9%
}


@pytest.fixture(scope="module")
def deepspeed_held(table):
    return table.build_heldout(table.load_deepspeed())


def test_deepspeed_runs_are_described_by_their_ds_config(table, runs):
    """Each DeepSpeed run has a source, a quote, what was measured and its unit, and memplan
    sees it only through a committed ds_config and the command line's model, GPUs, sequence
    and recompute; the measured bytes are the quoted number x 10^9 (the gist prints 'GB'
    with no unit: 44.8 -> 44,800,000,000)."""
    ds = table.load_deepspeed()
    assert ds
    ids = [run["id"] for run in ds]
    assert len(ids) == len(set(ids)) and not set(ids) & {run["id"] for run in runs}
    for run in ds:
        for key in ("quote", "what", "unit_note", "notes"):
            assert run[key].strip(), (run["id"], key)
        assert run["source"].startswith("https://"), run["id"]
        assert run["quantity"] == "max_allocated" and run["rank"] in table.RANKS
        settings = run["trainer_settings"]
        assert set(settings) <= DEEPSPEED_SETTINGS and {"gpus", "gpu", "deepspeed_config"} <= set(
            settings), run["id"]
        assert (ROOT / settings["deepspeed_config"]).is_file(), run["id"]
        quoted = run["measured_bytes"] / 1e9
        assert f"/{quoted:.1f} |" in run["quote"], run["id"]
    assert table.settings_command(ds[0]["trainer_settings"])[6:8] == [
        "--deepspeed-config", "benchmarks/data/deepspeed/gist-llama7b-zero2-mbs1.json"]


def test_deepspeed_runs_before_their_first_step(table, deepspeed_held):
    """A run measured before its first optimizer step (``measured_phases``) compares the most
    of step 1's forward and backward, not the tensor peak: the gist's ZeRO-2 rows at 8
    accumulation steps. zero2-mbs1 (no recompute): step 1's backward 42.02 GiB (the steady
    one, with Adam's 8 B x P / 8 = 6.28 GiB, 48.29); the row says what it compares; the
    inconsistent rows are listed under the table."""
    rows = {h.row.run["id"]: h for h in deepspeed_held}
    one = rows["gist-chenyaofo/llama-7b/zero2-mbs1"]
    phases = one.estimate["stages"][0]["phases"]
    assert one.row.memplan_bytes == (phases["first_step"]["backward_bytes"]
                                     + one.estimate["stages"][0]["workspace_bytes"])
    assert phases["steady"]["backward_bytes"] - phases["first_step"]["backward_bytes"] == (
        6_738_415_616 + 4)  # Adam's states on the 1/8 partition and the step count
    lines = table.render_deepspeed(deepspeed_held)
    assert any("(compared over first_step.forward, first_step.backward)" in line
               for line in lines)
    assert sum(line.startswith("- `gist-") for line in lines) == 2


def test_deepspeed_runs_within_ceilings_and_gaps_refused(deepspeed_held):
    """Every estimated DeepSpeed run has a ceiling and stays within it; every other run is
    refused by memplan, naming the ds_config key it cannot express, and says why in
    ``not_expressed``."""
    rows = {h.row.run["id"]: h.row for h in deepspeed_held}
    estimated = {k for k, r in rows.items() if r.memplan_bytes is not None}
    assert estimated == set(DEEPSPEED_CEILING_PCT)
    over = [(k, round(rows[k].error_pct, 2), c) for k, c in DEEPSPEED_CEILING_PCT.items()
            if abs(rows[k].error_pct) > c]
    assert not over, over
    for run_id in set(rows) - estimated:
        row = rows[run_id]
        assert row.run["not_expressed"].strip(), run_id
        assert ("zero_optimization.offload_param" in row.refused
                or "zero_optimization.offload_optimizer" in row.refused), row.refused

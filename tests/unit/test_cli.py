"""The ``memplan`` command line: output shape, the one-line error contract, no side effects.

Output is checked through ``typer.testing.CliRunner`` on ``memplan.cli.app``; exit codes and the
error contract (one line ``memplan: error: ...`` on stderr, exit 2, no traceback) go through
``memplan.cli.main``, which is where errors are turned into that line.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import Any

import pytest
from typer.exceptions import TyperException
from typer.testing import CliRunner

import memplan
from memplan.cli import app, main
from memplan.errors import MemplanError
from memplan.report import estimate_json
from memplan.report.versioned import SCHEMA_VERSION
from memplan.spec import catalog_names

LLAMA_7B_PARAMS = 6_738_415_616
BYTE_FIELDS = ("params_bytes", "grads_bytes", "optimizer_bytes", "activations_bytes",
               "peak_bytes")
# rich takes the width from COLUMNS, else from whichever std stream is a terminal; pin it.
NARROW = {"COLUMNS": "80"}  # what pipes, CI logs and CliRunner get by default
WIDE = {"COLUMNS": "250"}
ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


def invoke(*args: str, **kwargs: Any):
    """Run the typer app in-process; fail loudly on a non-zero exit."""
    result = CliRunner().invoke(app, list(args), catch_exceptions=False, **kwargs)
    assert result.exit_code == 0, (result.exit_code, result.stdout, result.stderr)
    return result


def flat(text: str) -> str:
    """Rich wraps at the terminal width: compare with whitespace runs collapsed."""
    return " ".join(ANSI.sub("", text).split())


def estimate_cli(*args: str) -> dict[str, Any]:
    """The estimate's JSON without its envelope (its version and command, checked here)."""
    result = invoke("estimate", *args, "--json")
    out = json.loads(result.stdout)  # the whole stdout is exactly one JSON document
    assert (out.pop("schema_version"), out.pop("command")) == (SCHEMA_VERSION, "estimate")
    return out


def walk_bytes(obj: Any, path: str = "") -> list[tuple[str, Any]]:
    """Every (path, value) whose key ends with ``_bytes``, at any depth."""
    found: list[tuple[str, Any]] = []
    if isinstance(obj, dict):
        for key, value in obj.items():
            where = f"{path}.{key}" if path else key
            if key.endswith("_bytes"):
                found.append((where, value))
            found += walk_bytes(value, where)
    elif isinstance(obj, list):
        for i, value in enumerate(obj):
            found += walk_bytes(value, f"{path}[{i}]")
    return found


# --- estimate --json -----------------------------------------------------------------------

def test_estimate_json_shape_and_int_bytes() -> None:
    out = estimate_cli("--model", "llama-7b", "--gpus", "64")
    assert isinstance(out, dict)
    for key in ("num_params", *BYTE_FIELDS, "capacity_bytes", "fits", "stages"):
        assert key in out, key
    assert out["num_params"] == LLAMA_7B_PARAMS
    assert isinstance(out["fits"], bool)
    assert out["fits"] == (out["peak_bytes"] <= out["capacity_bytes"])
    assert isinstance(out["stages"], list) and len(out["stages"]) == 1
    for stage in out["stages"]:
        for key in BYTE_FIELDS:
            assert key in stage, key

    found = walk_bytes(out)
    assert len(found) > 20
    for where, value in found:
        assert type(value) is int, (where, value)  # not float, not bool
    for stage in out["stages"]:
        for name, size in stage["activation_terms_per_microbatch"].items():
            assert type(size) is int, (name, size)


def test_capacity_defaults_to_catalog_h100() -> None:
    out = estimate_cli("--model", "llama-7b", "--gpus", "64")
    assert out["gpu"] == "h100-sxm"
    # CUDA deviceQuery for "NVIDIA H100 80GB HBM3": 85,028,896,768 bytes (model_specs/gpus.toml)
    assert out["capacity_bytes"] == 85_028_896_768
    assert out["headroom_bytes"] == out["capacity_bytes"] - out["peak_bytes"]


@pytest.mark.parametrize(("text", "expected"), [
    ("80GiB", 85_899_345_920),  # 80 * 2^30
    ("80GB", 80_000_000_000),  # 80 * 10^9
])
def test_gpu_memory_units(text: str, expected: int) -> None:
    out = estimate_cli("--model", "llama-7b", "--gpus", "64", "--gpu-memory", text)
    assert out["capacity_bytes"] == expected
    assert out["fits"] == (out["peak_bytes"] <= expected)


def test_pipeline_stages_and_most_loaded_stage() -> None:
    out = estimate_cli("--model", "llama-7b", "--gpus", "64", "--pp", "4")
    stages = out["stages"]
    assert len(stages) == 4
    assert [s["stage"] for s in stages] == [0, 1, 2, 3]
    assert sum(s["num_layers"] for s in stages) == 32
    worst = stages[out["most_loaded_stage"]]
    assert worst["peak_bytes"] == max(s["peak_bytes"] for s in stages)
    for key in BYTE_FIELDS:
        assert out[key] == worst[key], key
    assert out["layout"]["pp"] == 4 and out["layout"]["dp"] == 16


def _api_json(est: Any) -> dict[str, Any]:
    """What ``estimate --json`` prints for ``est`` (no reserved-memory replay without
    ``--reserved`` or ``--alloc-conf``)."""
    return estimate_json(est)


@pytest.mark.parametrize(("argv", "kwargs"), [
    ([], {}),
    (["--pp", "4"], {"pp": 4}),
    (["--gpu-memory", "80GB"], {"gpu_memory": "80GB"}),
    (["--tp", "2", "--pp", "2", "--zero", "1", "--mbs", "2", "--seq", "1024",
      "--recompute", "selective", "--gpu", "a100"],
     {"tp": 2, "pp": 2, "zero": 1, "micro_batch_size": 2, "seq_len": 1024,
      "recompute": memplan.Recompute.SELECTIVE, "gpu": "a100"}),
    (["--zero", "3", "--recompute", "full", "--recompute-layers", "4", "--precision",
      "bf16-fp32-grads", "--optimizer-impl", "fused", "--no-logits-fp32"],
     {"zero": 3, "recompute": memplan.Recompute.FULL, "recompute_layers": 4,
      "precision": memplan.Precision.BF16_FP32_GRADS,
      "optimizer_impl": memplan.OptimizerImpl.FUSED, "logits_fp32": False}),
])
def test_cli_json_equals_api(argv: list[str], kwargs: dict[str, Any]) -> None:
    cli = estimate_cli("--model", "llama-7b", "--gpus", "64", *argv)
    api = _api_json(memplan.estimate("llama-7b", gpus=64, **kwargs))
    assert cli == json.loads(json.dumps(api))


def test_estimate_json_is_one_object_on_stdout(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["estimate", "--model", "llama-7b", "--gpus", "64", "--json"]) == 0
    captured = capsys.readouterr()
    assert captured.err == ""
    assert isinstance(json.loads(captured.out), dict)


TINY_PP2 = ("--model", "tiny", "--gpus", "2", "--pp", "2", "--seq", "128", "--mbs", "2",
            "--gbs", "8", "--recompute", "full", "--recompute-layers", "1")


def test_estimate_json_step_time_derived_by_hand() -> None:
    """tiny (2 layers, h 64, q 64, V 128) on 2 GPUs at pp 2, gbs 8 x seq 128 = 1,024 tokens,
    mbs 2: 4 micro-batches. Per token, a layer's forward is 2 * (46,080 + 128) weights +
    2 * 128 * 64 attention = 108,800 FLOPs, the head 2 * 128 * 64 = 16,384, so the model FLOPs
    are 3 * (2 * 108,800 + 16,384) * 1,024 = 718,798,848. Full recompute of 1 layer of each
    stage reruns both layers: + 2 * 108,800 * 1,024 = 222,822,400, 941,621,248 for the job,
    470,810,624 per GPU. Compute at 40% of the H100's 989.4 TFLOP/s, at the pace of the
    busier stage: per token the first runs layer 0 four times (435,200), the second layer 1
    four times and the head three (435,200 + 49,152 = 484,352), 484,352 / 459,776 of the mean.
    The only communication is the pipeline's: 2 * (256 tokens * 64 * 2 B) * 4 micro-batches
    = 262,144 B over NVLink (450 GB/s), 8 sends of 3.4 us each (NCCL's NVLink step), half
    exposed; the bubble (2 - 1) / 4 of compute and exposed communication.
    The decoder's linears (per token 2 * 92,416 of the 233,984 forward FLOPs less the head's
    16,384: 184,832) run their GEMMs at the measured rate of their shape: every dimension of
    tiny's is 256 or less, XLA's sm_90 table's smallest point, 210,702,869,701,726 FLOP/s
    against 788,699,393,418,751 at its largest; the GEMMs take 0.4 * 989.4e12 /
    788,699,393,418,751 of the linears' time at 40% (memplan.planning.kernels). The attention
    (2 * 16,384 of the 233,984) runs at FlashAttention-2's measured causal H100 rate, held at
    its shortest point and its smallest head dimension (512 tokens; tiny's heads of 16 at the
    head-dimension-64 panel's rate: forward and backward 141e12 FLOP/s over 3.5 forwards of
    FLOPs): 0.4 * 989.4e12 * 3.5 / (3 * 141e12) of its time at 40%."""
    out = estimate_cli(*TINY_PP2)
    assert out["flops_per_step"] == 470_810_624
    share = 0.4 * 989.4e12 / 788_699_393_418_751
    linears = 1 - share + share * 788_699_393_418_751 / 210_702_869_701_726
    part = 184_832 / 233_984
    attention = 32_768 / 233_984
    kernel = 0.4 * 989.4e12 * 3.5 / (3 * 141e12)
    compute = (470_810_624 / (989.4e12 * 0.4) * 484_352 / 459_776
               * (1 - part - attention + part * linears + attention * kernel))
    exposed = (262_144 / 450e9 + 8 * 3.4e-6) * 0.5
    step = (compute + exposed) * (1 + 1 / 4)
    assert out["step_time_s"] == pytest.approx(step, rel=1e-12)
    assert out["tokens_per_s_per_gpu"] == pytest.approx(1024 / step / 2, rel=1e-12)
    assert out["mfu"] == pytest.approx(718_798_848 / step / 2 / 989.4e12, rel=1e-12)


def test_estimate_json_flops_read_recompute_per_stage() -> None:
    """llama-2-7b at pp 4, 64 x 4096 tokens: full recompute of the 8 layers of each stage is
    full recompute, 1.4913775719153664e16 FLOPs for the job, an eighth of it per GPU."""
    base = ("--model", "llama-2-7b", "--gpus", "8", "--pp", "4", "--gbs", "64",
            "--recompute", "full")
    every = estimate_cli(*base, "--recompute-layers", "8")
    full = estimate_cli(*base)
    assert every["flops_per_step"] == full["flops_per_step"] == 14_913_775_719_153_664 / 8
    assert every["step_time_s"] == full["step_time_s"]
    quarter = estimate_cli(*base, "--recompute-layers", "2")  # 8 of the 32 layers
    assert quarter["flops_per_step"] == (3 * 14_288_420_864 + 8 * 438_321_152) * 64 * 4096 / 8


def test_estimate_table_shows_the_step_time_line() -> None:
    text = flat(invoke("estimate", *TINY_PP2, env=WIDE).stdout)
    out = estimate_cli(*TINY_PP2)
    assert (f"step {out['step_time_s']:.3g} s, 4.708e+08 FLOPs per GPU (recompute included), "
            f"{out['tokens_per_s_per_gpu']:,.0f} tokens/s/GPU, MFU {out['mfu']:.2f} "
            "(step-time model; compute at an assumed 40% of peak FLOP/s)") in text
    # the kernel step model (the Megatron-LM preset's) says what it times the compute at
    megatron = flat(invoke("estimate", *TINY_PP2, "--framework", "megatron", env=WIDE).stdout)
    assert ("(step-time model; compute at the measured GEMM rates, the memory-bound kernels "
            "by their bytes)") in megatron


# --- estimate table ------------------------------------------------------------------------

def test_estimate_table_mentions_verdict_units_defaults_assumptions() -> None:
    text = flat(invoke("estimate", "--model", "llama-7b", "--gpus", "64").stdout)
    est = memplan.estimate("llama-7b", gpus=64)
    verdict = "FITS" if est.fits else "DOES NOT FIT"
    assert verdict in text
    assert "GiB" in text
    for default in ("mbs=1", "seq=2048", "precision=bf16-mixed", "optimizer=adamw"):
        assert default in text, default
    assert "assumptions" in text
    for line in est.assumptions:
        assert flat(line) in text, line


def test_estimate_table_fits_verdict() -> None:
    text = flat(invoke("estimate", "--model", "tiny", "--gpus", "1", "--seq", "128").stdout)
    assert "FITS" in text and "DOES NOT FIT" not in text


def test_estimate_table_readable_with_many_stages() -> None:
    out = invoke("estimate", "--model", "llama-7b", "--gpus", "64", "--pp", "16",
                 env=NARROW).stdout
    assert "…" not in out


# --- catalogs ------------------------------------------------------------------------------

def test_models_lists_catalog_names_on_wide_terminal() -> None:
    text = invoke("models", env=WIDE).stdout
    for name in catalog_names():
        assert name in text, name
    assert f"{LLAMA_7B_PARAMS / 1e9:.3f}B" in text


def test_models_lists_catalog_names_at_80_columns() -> None:
    text = invoke("models", env=NARROW).stdout
    for name in catalog_names():
        assert name in text, name


def test_models_json() -> None:
    out = json.loads(invoke("models", "--json").stdout)
    assert (out["schema_version"], out["command"]) == (SCHEMA_VERSION, "models")
    rows = out["models"]
    assert isinstance(rows, list)
    by_name = {row["name"]: row for row in rows}
    assert set(by_name) == set(catalog_names())
    assert by_name["llama-7b"]["num_params"] == LLAMA_7B_PARAMS
    for row in rows:
        assert type(row["num_params"]) is int and row["num_params"] > 0


def test_gpus_lists_h100() -> None:
    assert "h100-sxm" in invoke("gpus", env=WIDE).stdout


def test_gpus_lists_h100_at_80_columns() -> None:
    assert "h100-sxm" in invoke("gpus", env=NARROW).stdout


def test_gpus_json() -> None:
    rows = json.loads(invoke("gpus", "--json").stdout)["gpus"]
    by_name = {row["name"]: row for row in rows}
    assert "h100-sxm" in by_name
    assert by_name["h100-sxm"]["memory_bytes"] == memplan.load_gpu("h100").memory_bytes
    for row in rows:
        assert type(row["memory_bytes"]) is int


def test_estimate_help_shows_example() -> None:
    text = invoke("estimate", "--help").stdout
    assert "memplan estimate --model llama-7b --gpus 64" in flat(text)


def test_main_help_exit_zero(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--help"]) == 0
    assert main(["estimate", "--help"]) == 0
    captured = capsys.readouterr()
    assert "Usage" in captured.out and captured.err == ""


# --- the command table and the shared options ----------------------------------------------

def test_command_table_is_every_registered_command() -> None:
    """``memplan.cli.COMMANDS`` (name -> module, function) is the one list of commands: each
    entry is a command with help text, each command is an entry, each command module has one."""
    import typer

    import memplan.cli
    from memplan.cli import COMMANDS

    group = typer.main.get_command(app)
    assert list(group.commands) == list(COMMANDS)
    for name, (module, function) in COMMANDS.items():
        command = group.commands[name]
        assert command.callback.__module__ == f"memplan.cli.{module}", name
        assert command.callback.__name__ == function, name
        assert command.help and len(command.help.split()) > 3, name
        assert "Example" in command.help, name  # every command shows how it is called
    modules = {p.stem for p in Path(memplan.cli.__file__).parent.glob("*.py")}
    assert modules - {"__init__", "options"} == {module for module, _ in COMMANDS.values()}


@pytest.mark.parametrize("name", ["estimate", "models", "plan"])
def test_a_command_line_imports_only_its_command(name: str) -> None:
    """Fresh interpreter: ``memplan NAME --help`` imports memplan.cli's options and NAME's
    module, no other command's."""
    import subprocess
    import sys

    from memplan.cli import COMMANDS

    code = (f"import sys; from memplan.cli import main; main([{name!r}, '--help']); "
            "print(sorted(m for m in sys.modules if m.startswith('memplan.cli.')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout.strip().splitlines()[-1]
    assert out == repr(sorted({f"memplan.cli.{COMMANDS[name][0]}", "memplan.cli.options"}))


# own options that reuse a shared flag with another meaning
OWN_MEANING = {("plan", "recompute"): "fixes the policy, or none: all searched",
               ("calibrate", "model"): "the grid's reference spec",
               ("calibrate", "seq"): "the longest sequence traced",
               ("calibrate", "gpu"): "this GPU's catalog name, or none: from the device"}


def test_shared_options_are_declared_once() -> None:
    """Every command taking a layout or workload gets those options from ``SHARED`` through
    ``uses``: the same flags and help in each (plan's layout defaults are None: searched), and
    no command declares a shared flag itself except those of ``OWN_MEANING``."""
    import typer

    from memplan.cli.options import SHARED

    group = typer.main.get_command(app)
    flags_of = {p.name: (tuple(p.opts), tuple(p.secondary_opts), p.help)
                for p in group.commands["estimate"].params if p.name in SHARED}
    assert set(flags_of) == set(SHARED)
    shared_flags = {flag for opts, _, _ in flags_of.values() for flag in opts}
    for name in ("estimate", "plan", "diagnose", "trace", "profile", "calibrate"):
        command = group.commands[name]
        for param in command.params:
            flags = (tuple(param.opts), tuple(param.secondary_opts), param.help)
            if param.name in command.callback.shared:
                assert flags == flags_of[param.name], (name, param.name)
            elif (name, param.name) not in OWN_MEANING:
                assert not set(param.opts) & shared_flags, (name, param.name)
    assert group.commands["diagnose"].callback.shared == group.commands["estimate"].callback.shared


def test_flag_names_come_from_one_table() -> None:
    """``memplan.arguments.CLI_OPTIONS`` names the option of every API keyword the shared
    options set, and nothing else: each shared option but the model sets the keyword the
    table gives it, and the flag it declares is the table's (``--sp`` for sequence_parallel,
    ``--mbs`` for micro_batch_size, ``--recompute-layers`` for recompute_layers)."""
    import typer

    from memplan import arguments
    from memplan.cli.options import KEYWORDS, SHARED

    assert set(KEYWORDS) == set(SHARED) - {"model"}
    assert (arguments.flag("sequence_parallel"), arguments.flag("micro_batch_size"),
            arguments.flag("recompute_layers")) == ("--sp", "--mbs", "--recompute-layers")
    group = typer.main.get_command(app)
    declared = {p.name: p.opts[0] for p in group.commands["estimate"].params}
    for option, keyword in KEYWORDS.items():
        assert declared[option] == arguments.flag(keyword), option


@pytest.mark.parametrize(("argv", "kwargs"), [
    ([], {}),
    (["--tp", "2", "--pp", "2", "--vpp", "2", "--zero", "1", "--sp", "--no-vocab-parallel",
      "--tp-style", "dtensor", "--grad-buffers", "copy", "--mbs", "2", "--gbs", "64",
      "--seq", "1024", "--recompute", "full", "--recompute-layers", "2", "--precision",
      "fp16-mixed", "--optimizer", "sgd", "--optimizer-impl", "forloop", "--attention", "eager",
      "--norm", "fused", "--no-logits-fp32", "--loss-chunks", "4", "--schedule", "gpipe",
      "--gpu", "a100-80gb", "--gpu-memory", "70GiB", "--grad-sync", "last"],
     {"tp": 2, "pp": 2, "vpp": 2, "zero": 1, "sequence_parallel": True,
      "vocab_parallel": False, "tp_style": "dtensor", "grad_buffers": "copy",
      "micro_batch_size": 2, "global_batch_size": 64, "seq_len": 1024, "recompute": "full",
      "recompute_layers": 2, "precision": "fp16-mixed", "optimizer": "sgd",
      "optimizer_impl": "forloop", "attention": "eager", "norm_impl": "fused",
      "logits_fp32": False, "loss_chunks": 4, "schedule": "gpipe", "gpu": "a100-80gb",
      "gpu_memory": "70GiB", "grad_sync": "last"}),
    (["--dp", "4", "--cp", "2", "--zero", "2", "--offload", "optimizer", "--mbs", "1"],
     {"dp": 4, "cp": 2, "zero": 2, "offload": "optimizer"}),
    (["--zero", "3", "--precision", "fsdp-bf16", "--gbs", "32", "--grad-sync", "last"],
     {"zero": 3, "precision": "fsdp-bf16", "global_batch_size": 32, "grad_sync": "last"}),
    (["--precision", "bf16-pure", "--loss-impl", "torchtune-chunked", "--loss-chunks", "8",
      "--optimizer", "paged-adamw"],
     {"precision": "bf16-pure", "loss_impl": "torchtune-chunked", "loss_chunks": 8,
      "optimizer": "paged-adamw"}),
    (["--precision", "bf16-pure", "--compile"], {"precision": "bf16-pure", "compile": True}),
    (["--deltanet-kernel", "torch"], {"deltanet_kernel": "torch"}),
    (["--deltanet-kernel", "torch-solve"], {"deltanet_kernel": "torch-solve"}),
    (["--mamba-kernel", "torch"], {"mamba_kernel": "torch"}),
    (["--mla-cache", "expanded"], {"mla_cache": "expanded"}),
])
def test_every_shared_option_reaches_the_api(argv: list[str], kwargs: dict[str, Any]) -> None:
    """Each flag sets the API keyword the option table names: the CLI's JSON equals the API's."""
    cli = estimate_cli("--model", "llama-7b", "--gpus", "8", *argv)
    api = _api_json(memplan.estimate("llama-7b", gpus=8, **kwargs))
    assert cli == json.loads(json.dumps(api))


# --- bad input: one line, exit 2 -----------------------------------------------------------

M7 = ["estimate", "--model", "llama-7b"]

BAD_INPUTS = {
    "unknown-model": (["estimate", "--model", "llama2-7b", "--gpus", "8"],
                      ["model", "'llama2-7b'", "'llama-2-7b'"]),
    "unknown-gpu": ([*M7, "--gpus", "8", "--gpu", "h10"], ["GPU", "'h10'"]),
    "tp-heads": ([*M7, "--tp", "3", "--gpus", "3"], ["tp (3)", "num_attention_heads (32)"]),
    "tp-kv-heads": (["estimate", "--model", "llama-2-70b", "--tp", "16", "--gpus", "16"],
                    ["tp (16)", "num_kv_heads (8)"]),
    "pp-layers": ([*M7, "--pp", "3", "--gpus", "3"], ["pp", "(3)", "num_layers (32)"]),
    "gpus-model-parallel": ([*M7, "--tp", "2", "--pp", "2", "--gpus", "6"],
                            ["gpus (6)", "tp*pp*cp", "4"]),
    "dp-mismatch": ([*M7, "--gpus", "8", "--dp", "4"], ["dp", "4", "gpus (8)"]),
    "gbs-mbs-dp": ([*M7, "--gpus", "8", "--mbs", "2", "--gbs", "12"],
                   ["gbs (12)", "mbs*dp", "16"]),
    "ep-experts": (["estimate", "--model", "mixtral-8x7b", "--ep", "3", "--gpus", "6"],
                   ["ep (3)", "num_experts (8)"]),
    "ep-dense": ([*M7, "--gpus", "8", "--ep", "2"], ["ep (2)", "llama-7b"]),
    "compile-autocast": ([*M7, "--gpus", "8", "--compile", "--precision", "amp-bf16",
                          "--tp", "2"], ["compile", "precision amp-bf16", "tp 2"]),
    "zero-5": ([*M7, "--gpus", "8", "--zero", "5"], ["--zero", "5"]),
    "mbs-0": ([*M7, "--gpus", "8", "--mbs", "0"], ["mbs", "0"]),
    "mbs-negative": ([*M7, "--gpus", "8", "--mbs", "-1"], ["mbs", "-1"]),
    "seq-0": ([*M7, "--gpus", "8", "--seq", "0"], ["seq", "0"]),
    "gpus-0": ([*M7, "--gpus", "0"], ["gpus", "0"]),
    "tp-0": ([*M7, "--tp", "0"], ["tp", "0"]),
    "vpp-without-pp": ([*M7, "--gpus", "8", "--vpp", "2"], ["vpp (2)", "pp"]),
    "cp-seq": ([*M7, "--gpus", "8", "--cp", "2", "--seq", "2047"], ["2*cp (4)", "seq (2047)"]),
    "learned-positions": (["estimate", "--model", "gpt2", "--seq", "4096"],
                          ["seq (4096)", "1024"]),
    "gpu-memory-unit": ([*M7, "--gpus", "8", "--gpu-memory", "80XB"], ["gpu_memory", "80XB"]),
    "gpu-memory-zero": ([*M7, "--gpus", "8", "--gpu-memory", "0GB"], ["gpu_memory", "0GB"]),
    "recompute-layers-without-full": ([*M7, "--recompute-layers", "2"], ["recompute_layers"]),
    "bad-precision": ([*M7, "--precision", "bf17"], ["--precision", "bf17"]),
    "unknown-option": ([*M7, "--bogus"], ["--bogus"]),
    "missing-model": (["estimate", "--gpus", "8"], ["--model"]),
}


def assert_one_line_error(capsys: pytest.CaptureFixture[str], code: int,
                          must_mention: list[str]) -> str:
    captured = capsys.readouterr()
    assert code == 2, (code, captured.out, captured.err)
    err = captured.err
    assert err.startswith("memplan: error:"), err
    assert err.endswith("\n") and err.count("\n") == 1, err  # exactly one line
    assert len(err.strip()) > len("memplan: error:"), err  # and it says something
    assert "Traceback" not in captured.out + err
    assert captured.out == ""  # nothing half-printed on stdout
    for text in must_mention:
        assert text in err, (text, err)
    return err


@pytest.mark.parametrize("case", sorted(BAD_INPUTS))
def test_bad_input_is_one_line_exit_2(case: str, capsys: pytest.CaptureFixture[str],
                                      monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MEMPLAN_DEBUG", raising=False)
    argv, must_mention = BAD_INPUTS[case]
    assert_one_line_error(capsys, main(argv), must_mention)


@pytest.fixture
def broken_json(tmp_path: Path) -> Path:
    path = tmp_path / "config.json"
    path.write_text('{"model_type": "llama", "hidden_size": 4096,\n  "num_hidden_layers": ')
    return path


@pytest.fixture
def toml_unknown_key(tmp_path: Path) -> Path:
    path = tmp_path / "mini.toml"
    path.write_text(
        'source = "test"\nnum_layers = 2\nhidden_size = 64\nffn_hidden_size = 128\n'
        'num_attention_heads = 4\nnum_kv_heads = 4\nhead_dim = 16\nvocab_size = 100\n'
        'max_seq_len = 128\nnorm = "rmsnorm"\nmlp = "swiglu"\nposition = "rope"\n'
        'tied_embeddings = false\nnum_layer = 3\n')  # typo: num_layer
    return path


def test_malformed_config_json(broken_json: Path, capsys: pytest.CaptureFixture[str],
                               monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MEMPLAN_DEBUG", raising=False)
    code = main(["estimate", "--model", str(broken_json), "--gpus", "8"])
    assert_one_line_error(capsys, code, [str(broken_json), "line 2"])


def test_malformed_config_json_folder(broken_json: Path, capsys: pytest.CaptureFixture[str],
                                      monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MEMPLAN_DEBUG", raising=False)
    code = main(["estimate", "--model", str(broken_json.parent), "--gpus", "8"])
    assert_one_line_error(capsys, code, [str(broken_json)])


def test_toml_unknown_key(toml_unknown_key: Path, capsys: pytest.CaptureFixture[str],
                          monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MEMPLAN_DEBUG", raising=False)
    code = main(["estimate", "--model", str(toml_unknown_key), "--gpus", "1"])
    assert_one_line_error(capsys, code, [str(toml_unknown_key), "num_layer"])


def test_valid_toml_runs(toml_unknown_key: Path, capsys: pytest.CaptureFixture[str]) -> None:
    good = toml_unknown_key.with_name("good.toml")
    good.write_text(toml_unknown_key.read_text().replace("num_layer = 3\n", ""))
    assert main(["estimate", "--model", str(good), "--gpus", "1", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["model"] == "good"


def test_gpu_memory_below_one_byte_is_an_error(capsys: pytest.CaptureFixture[str],
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MEMPLAN_DEBUG", raising=False)
    code = main([*M7, "--gpus", "8", "--gpu-memory", "0.1", "--json"])
    assert_one_line_error(capsys, code, ["gpu_memory", "0.1"])


def test_recompute_layers_more_than_stage_layers(capsys: pytest.CaptureFixture[str],
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MEMPLAN_DEBUG", raising=False)
    code = main([*M7, "--gpus", "8", "--recompute", "full", "--recompute-layers", "100"])
    assert_one_line_error(capsys, code, ["recompute_layers", "100", "32"])


def test_no_arguments_prints_help_without_empty_error(capsys: pytest.CaptureFixture[str],
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MEMPLAN_DEBUG", raising=False)
    main([])
    captured = capsys.readouterr()
    assert "Usage" in captured.out + captured.err
    assert "memplan: error: \n" not in captured.err


# --- MEMPLAN_DEBUG=1 re-raises -------------------------------------------------------------

@pytest.mark.parametrize(("argv", "error"), [
    (["estimate", "--model", "llama2-7b"], MemplanError),
    ([*M7, "--tp", "3", "--gpus", "3"], MemplanError),
    ([*M7, "--mbs", "0"], MemplanError),
    ([*M7, "--gpu-memory", "80XB"], MemplanError),
    ([*M7, "--zero", "5"], TyperException),  # the CLI parser's own error type
])
def test_debug_env_reraises(argv: list[str], error: type[BaseException],
                            monkeypatch: pytest.MonkeyPatch,
                            capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("MEMPLAN_DEBUG", "1")
    with pytest.raises(error):
        main(argv)
    assert "memplan: error:" not in capsys.readouterr().err


def test_debug_env_reraises_malformed_json(broken_json: Path,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MEMPLAN_DEBUG", "1")
    with pytest.raises(MemplanError, match="config: .* is not valid JSON"):

        main(["estimate", "--model", str(broken_json)])


# --- no side effects -----------------------------------------------------------------------

def _tree(root: Path) -> dict[str, float]:
    return {str(p.relative_to(root)): p.stat().st_mtime for p in root.rglob("*")}


def test_estimate_writes_no_files(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                  capsys: pytest.CaptureFixture[str]) -> None:
    from memplan.catalog import data_dir

    work = tmp_path / "cwd"
    work.mkdir()
    monkeypatch.chdir(work)
    monkeypatch.delenv("MEMPLAN_DEBUG", raising=False)
    catalog_before = _tree(data_dir())
    assert main(["estimate", "--model", "llama-7b", "--gpus", "64"]) == 0
    assert main(["estimate", "--model", "llama-7b", "--gpus", "64", "--pp", "4", "--json"]) == 0
    assert main(["estimate", "--model", "llama-7b", "--gpus", "3", "--tp", "3"]) == 2
    assert main(["models"]) == 0 and main(["gpus", "--json"]) == 0
    assert list(work.iterdir()) == []
    assert _tree(data_dir()) == catalog_before
    capsys.readouterr()


def test_version_and_width(capsys: pytest.CaptureFixture[str], monkeypatch) -> None:
    """``--version`` names the package's version; output that is no terminal gets tables at
    their full width (240 columns: the plan table's layouts are not cut), ``--width N`` sets
    it, a width under 40 is one line and exit 2; the caller's COLUMNS is left as it was."""
    from memplan import __version__

    assert main(["--version"]) == 0
    assert capsys.readouterr().out == f"memplan {__version__}\n"
    monkeypatch.delenv("COLUMNS", raising=False)
    assert main(["plan", "-m", "llama-3.1-405b", "-n", "512", "--tp", "8", "--pp", "8",
                 "--seq", "8192", "--gbs", "256", "--top", "2"]) == 0
    out = capsys.readouterr().out
    assert "…" not in out and "[3,4x30,3]" in out
    assert "COLUMNS" not in __import__("os").environ
    assert main(["--width", "60", "models"]) == 0
    assert max(len(line) for line in capsys.readouterr().out.splitlines()) <= 60
    assert main(["models", "--width", "30"]) == 2
    assert capsys.readouterr().err == (
        "memplan: error: --width must be a whole number of columns from 40 to 10000, got "
        "'30'\n")


def test_estimate_opens_with_its_verdict_and_quiet_prints_only_that(
        capsys: pytest.CaptureFixture[str]) -> None:
    """The first line says whether it fits, the peak, its stage and phase and the headroom;
    ``--quiet`` prints that line alone; the stage table names its columns in words."""
    assert main(["estimate", "-m", "llama-2-7b", "-n", "8", "--zero", "3"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("FITS: peak ") and "capacity (stage 0, " in out[0]
    assert "headroom" in out[0]
    text = " ".join(out)
    for column in ("parameters", "gradients", "optimizer states", "activations",
                   "micro-batches in flight", "peak phase"):
        assert column in text
    assert main(["estimate", "-m", "llama-2-7b", "-n", "8", "--zero", "3", "--quiet"]) == 0
    assert capsys.readouterr().out.splitlines() == [out[0]]
    assert main(["estimate", "-m", "llama-2-7b", "-n", "8", "-q"]) == 0
    assert capsys.readouterr().out.startswith("DOES NOT FIT: peak ")


def test_shell_completion_script(capsys: pytest.CaptureFixture[str],
                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """typer's completion: ``--show-completion`` prints the script for the shell it runs
    under. typer finds that shell by walking the process tree (shellingham), which differs
    between a terminal, a background job and CI, so the test says which shell it is."""
    import shellingham

    monkeypatch.setattr(shellingham, "detect_shell", lambda *a, **k: ("bash", "/bin/bash"))
    assert main(["--show-completion"]) == 0
    assert "_memplan_completion" in capsys.readouterr().out


@pytest.mark.parametrize(("flag", "kv_cache"), [("--use-cache", True),
                                                ("--no-use-cache", False)])
def test_use_cache_sets_the_kv_cache(flag: str, kv_cache: bool) -> None:
    """``--use-cache/--no-use-cache`` is the API's ``kv_cache`` (``arguments.CLI_OPTIONS``).
    Llama-3-8B in amp-bf16 under the hf preset: with the cache, each layer's K and V are
    copied into it in fp32 (DynamicLayer.lazy_initialization takes the fp32 rotated key's
    dtype) and live until the forward's output is dropped, so the forward peaks higher
    without it by those copies: the JSON of each flag is the API's with that value, and they
    differ."""
    from memplan import arguments

    assert arguments.flag("kv_cache") == "--use-cache"
    args = ("--model", "llama-3-8b", "--framework", "hf", "--precision", "amp-bf16")
    cli = estimate_cli(*args, flag)
    api = memplan.estimate("llama-3-8b", framework="hf", precision="amp-bf16",
                           kv_cache=kv_cache)
    assert cli == json.loads(json.dumps(_api_json(api)))
    assert cli["workload"]["kv_cache"] is kv_cache
    other = estimate_cli(*args, "--no-use-cache" if kv_cache else "--use-cache")
    assert (cli["peak_bytes"] > other["peak_bytes"]) is kv_cache


def test_use_cache_defaults_to_the_framework() -> None:
    """Not given: the hf preset's use_cache (on), the generic preset's (off)."""
    assert estimate_cli("--model", "gpt2", "--framework", "hf")["workload"]["kv_cache"] is True
    assert estimate_cli("--model", "gpt2")["workload"]["kv_cache"] is False


@pytest.mark.parametrize("argv", [
    ["estimate", "-m", "llama-7b", "-n", "8", "--plot", "{dir}/stages.png"],
    ["monitor-summary", "{dir}/none.jsonl", "--plot", "{dir}/monitor.png"],
    ["analyze-trace", "{dir}/none.json", "--plot", "{dir}/ranks.png"],
])
def test_plot_without_matplotlib_is_one_line_exit_2_before_any_work(
        argv: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """``--plot`` is checked before anything is read or estimated: without matplotlib (a None
    entry in ``sys.modules`` makes ``importlib.util.find_spec`` report it absent) the command
    says so in one line and exits 2, and nothing is written (the inputs need not exist: the
    check comes first)."""
    monkeypatch.delenv("MEMPLAN_DEBUG", raising=False)
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    err = assert_one_line_error(capsys, main([a.format(dir=tmp_path) for a in argv]),
                                ["--plot", "matplotlib is not installed"])
    assert "nothing was run" in err
    assert list(tmp_path.iterdir()) == []


def test_plot_api_without_matplotlib_raises(tmp_path: Path,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """The plotting functions say the same through the API (``MemplanError``), and write
    nothing."""
    from memplan.report.plot_estimate import plot_estimate

    est = memplan.estimate("llama-7b", gpus=8)
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(MemplanError, match="matplotlib is not installed"):
        plot_estimate(est, tmp_path / "stages.png")
    assert list(tmp_path.iterdir()) == []


def test_plan_quiet_is_the_fastest_candidate_in_one_line() -> None:
    """``plan --quiet`` prints one line, the first candidate of the same plan's JSON: its
    layout, micro-batch, recompute, peak (GiB = 2^30 B, two decimals) and step time."""
    quiet = invoke("plan", "-m", "llama-7b", "-n", "8", "--quiet").stdout
    first = json.loads(invoke("plan", "-m", "llama-7b", "-n", "8", "--json").stdout)
    best = first["candidates"][0]
    lay = best["layout"]
    assert quiet.count("\n") == 1 and quiet.startswith("FITS: "), quiet
    assert (f"tp{lay['tp']} pp{lay['pp']} dp{lay['dp']} z{lay['zero']}, mbs {best['mbs']}, "
            f"recompute {best['recompute']}; peak {best['peak_bytes'] / 2**30:.2f} GiB of "
            f"{first['budget_bytes'] / 2**30:.2f} GiB usable; step "
            f"{best['step_time_s']:.2f} s") in quiet, quiet


def test_plan_quiet_keeps_its_line_and_says_what_it_searched_instead() -> None:
    """``plan --quiet --recompute auto`` on a model whose layers are not modelled op by op
    (OLMo 2's upcast-fp32 post norms under the generic framework's upcast norms): stdout the
    one line, the note naming the norms and the whole levels searched instead on stderr."""
    result = CliRunner().invoke(app, ["plan", "-m", "olmo-2-7b", "-n", "8",
                                      "--recompute", "auto", "--quiet"])
    assert result.exit_code == 0, result.stderr
    assert result.stdout.count("\n") == 1 and result.stdout.startswith("FITS: "), result.stdout
    assert result.stderr.startswith("memplan: note: recompute ops:"), result.stderr
    assert "post norms of norm_impl upcast" in result.stderr
    assert "searched the whole recompute levels" in result.stderr


def test_plan_quiet_when_nothing_fits_says_why_exit_1() -> None:
    """Nothing fits: nothing on stdout, the reason on stderr, exit 1 (as without --quiet)."""
    result = CliRunner().invoke(app, ["plan", "-m", "llama-3-70b", "-n", "1", "--quiet"])
    assert result.exit_code == 1
    assert result.stdout == ""
    assert result.stderr.startswith("memplan: nothing fits"), result.stderr


@pytest.mark.parametrize("command", [None, "estimate", "plan", "diagnose", "models", "gpus",
                                     "trace", "profile", "calibrate", "analyze-trace",
                                     "monitor-summary"])
def test_help_shows_no_type_noise(command: str | None, capsys: pytest.CaptureFixture[str],
                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """Help lists a value's type only where it helps: numbers and choices. A flag shows no
    ``<bool>``, a name or path no ``<str>`` (the help text says what it is)."""
    monkeypatch.setenv("COLUMNS", "200")
    assert main([*([command] if command else []), "--help"]) == 0
    out = capsys.readouterr().out
    assert "--help" in out
    assert "<bool>" not in out and "<str>" not in out, out
    if command == "plan":  # numbers and choices keep theirs
        assert "<int" in out and "<none|selective|full|ops|auto>" in out


def test_logits_held_option_is_the_api_setting() -> None:
    """``--logits-held output`` (peft's run.py keeping the model's output) gives the bytes the
    API's ``logits_held="output"`` gives, and more than the hf preset's default (``loss``: the
    output dropped before backward), which keeps nothing through the step."""
    import memplan

    args = ["estimate", "-m", "llama-3.2-3b", "--gpus", "1", "--framework", "hf", "--json"]
    held = json.loads(CliRunner().invoke(app, [*args, "--logits-held", "output"]).stdout)
    default = json.loads(CliRunner().invoke(app, args).stdout)
    api = memplan.estimate("llama-3.2-3b", gpus=1, framework="hf", logits_held="output")
    assert held["stages"][0]["peak_bytes"] == api.peak_bytes
    assert held["stages"][0]["peak_bytes"] > default["stages"][0]["peak_bytes"]


def test_deltanet_kernel_option_is_the_api_setting() -> None:
    """``--deltanet-kernel torch`` (transformers' torch fallbacks) gives the API's bytes, more
    than the default fla kernels save (tests/unit/test_qwen3_next.py by hand), and the
    assumption line names the kernels."""
    args = ["--model", "qwen3-next-80b-a3b", "--gpus", "8", "--ep", "8", "--framework", "hf",
            "--seq", "4096"]
    fused = estimate_cli(*args)
    torch_path = estimate_cli(*args, "--deltanet-kernel", "torch")
    api = memplan.estimate("qwen3-next-80b-a3b", gpus=8, ep=8, framework="hf", seq_len=4096,
                           deltanet_kernel="torch")
    assert torch_path == json.loads(json.dumps(estimate_json(api)))
    assert torch_path["peak_bytes"] > fused["peak_bytes"]
    assert any("flash-linear-attention" in line for line in fused["assumptions"])


def test_moe_impl_selects_the_experts_implementation() -> None:
    """``--moe-impl`` is the API's ``moe_impl``: Granite 3.1 1B-A400M under the hf preset runs
    its experts grouped (transformers 5.23's GraniteMoeExperts) unless told ``parallel``
    (transformers 5.3's GraniteMoeParallelExperts, whose per-expert weight slices make
    weight-sized zero gradients in backward: the higher peak)."""
    args = ("--model", "granite-3.1-1b-a400m", "--framework", "hf")
    cli = estimate_cli(*args, "--moe-impl", "parallel")
    api = memplan.estimate("granite-3.1-1b-a400m", framework="hf", moe_impl="parallel")
    assert cli == json.loads(json.dumps(_api_json(api)))
    assert estimate_cli(*args)["peak_bytes"] < cli["peak_bytes"]


def test_grouped_token_is_transformers_5_3s_gather() -> None:
    """``--moe-impl grouped-token`` is the API's: the grouped experts as transformers 5.3
    wrote them (the working sets by hand: tests/unit/test_moe_recompute.py)."""
    args = ("--model", "mixtral-8x7b", "--gpus", "64", "--framework", "hf",
            "--recompute", "full")
    cli = estimate_cli(*args, "--moe-impl", "grouped-token")
    api = memplan.estimate("mixtral-8x7b", gpus=64, framework="hf", recompute="full",
                           moe_impl="grouped-token")
    assert cli == json.loads(json.dumps(_api_json(api)))


@pytest.mark.parametrize("command", [None, *memplan.cli.COMMANDS])
def test_unset_options_keep_what_typer_would_coerce_them_to(command: str | None) -> None:
    """An option left unset is converted by ``memplan.cli.PlainValue`` (a path's default
    kept as it is), not by typer's coercion (~70 pydantic TypeAdapters per command line).
    That is exact only if it gives what typer's own coercion gives for every default: typer's
    is run here on each default of each command, with the adapter typer builds, and compared
    in value and type."""
    from typer._click.core import ParameterSource
    from typer._coercion import build_runtime_param

    group = memplan.cli._command_for([command] if command else [])
    commands = [group, *group.commands.values()]
    checked = 0
    for cmd in commands:
        ctx = cmd.make_context("memplan", [], resilient_parsing=True)
        for param in cmd.params:
            if not hasattr(param, "type_descriptor") or param.default is None:
                continue
            assert type(param._runtime_param).__name__ == "PlainValue", param.name
            ctx.set_parameter_source(param.name, ParameterSource.DEFAULT)
            kept = param._runtime_param.coerce(param.default, param, ctx)
            coerced = build_runtime_param(param.type_descriptor).coerce(param.default, param,
                                                                        ctx)
            assert (kept, type(kept)) == (coerced, type(coerced)), (cmd.name, param.name)
            checked += 1
    assert checked or command in {None, "models", "gpus"}


def test_a_given_option_is_coerced_by_typer() -> None:
    """A value given on the command line, or a default the user repeats, goes through typer's
    coercion (the enum, the number), and a bad one is refused with typer's message."""
    out = estimate_cli("-m", "llama-7b", "-n", "64", "--zero", "0", "--tp", "2",
                       "--recompute", "full")
    assert (out["layout"]["zero"], out["layout"]["tp"]) == (0, 2)
    assert out["workload"]["recompute"] == "full"
    assert main(["estimate", "-m", "llama-7b", "-n", "64", "--tp", "two"]) == 2

"""A job's own config as memplan's inputs: torchtitan job TOMLs and Megatron-LM arguments.

Fixtures: torchtitan's published train configs (tests/data/torchtitan: torchtitan/models/
llama3/train_configs at tag v0.2.2, the last release that reads job TOMLs) and the
model_config.yaml of every Megatron-LM CI run in benchmarks/data/published_runs.json
(tests/data/megatron, each at the commit the run cites). The published runs' hand-derived
memplan inputs and model TOMLs are what the importers must reproduce.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from typer.testing import CliRunner

from memplan.cli import app, main
from memplan.config_import import megatron, torchtitan
from memplan.errors import MemplanError
from memplan.spec import ModelSpec, load_model

DATA = Path(__file__).resolve().parents[1] / "data"
ROOT = DATA.parent.parent
RUNS = json.loads((ROOT / "benchmarks" / "data" / "published_runs.json").read_text())
TITAN = DATA / "torchtitan"
MEGATRON = DATA / "megatron"


def _megatron_runs() -> list:
    out = []
    for run in RUNS:
        if run["framework"] == "megatron":
            case = re.search(r"test_cases/gpt/([^/]+)/model_config", run["source"]).group(1)
            out.append(pytest.param(run, case, id=run["id"].removeprefix("megatron-ci/")))
    return out


# --- Megatron-LM ---------------------------------------------------------------------------

@pytest.mark.parametrize(("run", "case"), _megatron_runs())
def test_megatron_ci_args_give_the_published_runs_inputs(run: dict, case: str) -> None:
    """Each CI run's model_config.yaml maps to the inputs and the model spec written by hand
    for benchmarks/accuracy_table.py (every spec field but the name and source)."""
    args = run["memplan_args"]
    imp = megatron.read(str(MEGATRON / f"{case}.yaml"), args["gpus"])
    want = {k: v for k, v in args.items() if k not in ("model", "gpus", "gpu")}
    assert {k: imp.inputs.get(k) for k in want} == want
    spec, ref = imp.model, load_model(str(ROOT / args["model"]))
    assert isinstance(spec, ModelSpec)
    fields = [f for f in ModelSpec.model_fields if f not in ("name", "source")]
    assert {f: getattr(spec, f) for f in fields} == {f: getattr(ref, f) for f in fields}
    # every flag of the CI configs is mapped, known to hold nothing, or one of these, listed
    # as not modelled: overlapped reductions (the same grad buffer, bucketed) and the
    # unfused weight-gradient accumulation (a transient wgrad before it is added to main_grad),
    # the softmax's dtype on the unfused attention path
    assert set(imp.unread) <= {"--overlap-grad-reduce", "--overlap-param-gather",
                               "--no-gradient-accumulation-fusion",
                               "--attention-softmax-in-fp32",
                               "--apply-query-key-layer-scaling"}


def test_megatron_launch_command() -> None:
    """Shell words of a launch script: the launcher before the first flag skipped, line
    continuations and comments allowed; the model's shape from the flags' defaults (4h MLP,
    LayerNorm, learned positions, tied embeddings, biases, GPT-2 BPE vocabulary padded to a
    multiple of 128 * tp: 50257 -> 50432 at tp 2)."""
    text = """torchrun --nproc-per-node 8 pretrain_gpt.py \\
        --num-layers 24 --hidden-size 2048 --num-attention-heads 16 \\
        --seq-length 2048 --max-position-embeddings 2048  # the context
        --tensor-model-parallel-size 2 --sequence-parallel --micro-batch-size 2 \\
        --global-batch-size 256 --vocab-file vocab.json --merge-file merges.txt \\
        --recompute-granularity full --recompute-method block --recompute-num-layers 4 \\
        --use-distributed-optimizer --bf16 --lr 3e-4 --data-path a b c"""
    imp = megatron.read(text, 64)
    spec = imp.model
    assert isinstance(spec, ModelSpec)
    assert (spec.ffn_hidden_size, spec.vocab_size, spec.norm.value, spec.tied_embeddings,
            spec.position.value, spec.qkv_bias) == (8192, 50432, "layernorm", True,
                                                     "learned", True)
    assert imp.inputs == {
        "framework": "megatron", "tp": 2, "sequence_parallel": True, "zero": 1,
        "micro_batch_size": 2, "global_batch_size": 256, "seq_len": 2048,
        "recompute": "full", "recompute_layers": 4, "precision": "bf16-fp32-grads",
        "optimizer": "adamw", "attention": "flash", "te_gemm_workspace": True}
    assert imp.unread == []  # --lr, --data-path: they hold no memory


def test_megatron_deepseek_v3_shape() -> None:
    """MLA, a shared expert and leading dense layers from Megatron-LM's flags give DeepSeek-V3's
    shape: the catalog entry's parameter count (its transformers-built count)."""
    args = ("--num-layers 61 --hidden-size 7168 --ffn-hidden-size 18432 "
            "--num-attention-heads 128 --multi-latent-attention --q-lora-rank 1536 "
            "--kv-lora-rank 512 --qk-head-dim 128 --qk-pos-emb-head-dim 64 --v-head-dim 128 "
            "--num-experts 256 --moe-router-topk 8 --moe-ffn-hidden-size 2048 "
            "--moe-shared-expert-intermediate-size 2048 --moe-layer-freq '([0]*3+[1]*58)' "
            "--normalization RMSNorm --swiglu --disable-bias-linear "
            "--untie-embeddings-and-output-weights --position-embedding-type rope "
            "--tokenizer-type HuggingFaceTokenizer --vocab-size 129280 --seq-length 4096 "
            "--max-position-embeddings 163840 --expert-model-parallel-size 8 --bf16")
    spec = megatron.read(args, 256).model
    assert isinstance(spec, ModelSpec)
    assert spec.num_params == load_model("deepseek-v3").num_params
    assert spec.moe is not None and spec.moe.first_dense_layers == 3


@pytest.mark.parametrize(("extra", "flag"), [
    ("--fp8-format hybrid --fp8-recipe custom", "--fp8-recipe"),
    ("--fp8-format hybrid --first-last-layers-bf16", "--first-last-layers-bf16"),
    ("--fp8-param-gather", "--fp8-param-gather"),
    ("--mtp-num-layers 1 --pipeline-model-parallel-layout EttttL",
     "--pipeline-model-parallel-layout"),
    ("--recompute-granularity full --recompute-method uniform --recompute-num-layers 2",
     "--recompute-granularity/method/num-layers"),
    ("--num-experts 8 --moe-layer-freq '([1]*2+[0]*2)'", "--moe-layer-freq"),
    ("--use-torch-fsdp2", "--use-torch-fsdp2"),
    ("--position-embedding-type yarn", "--position-embedding-type"),
    ("--num-layers-per-virtual-pipeline-stage 3 --pipeline-model-parallel-size 2",
     "--num-layers-per-virtual-pipeline-stage"),
    ("--defer-embedding-wgrad-compute", "--defer-embedding-wgrad-compute"),
    ("--cross-entropy-loss-fusion --cross-entropy-fusion-impl te",
     "--cross-entropy-fusion-impl"),
    ("--num-experts 8 --moe-router-dtype fp64", "--moe-router-dtype"),
    ("--num-distributed-optimizer-instances 2", "--num-distributed-optimizer-instances"),
    ("--use-distributed-optimizer --num-distributed-optimizer-instances 3",
     "--num-distributed-optimizer-instances"),  # 3 does not divide dp 8
    ("--use-megatron-fsdp --data-parallel-sharding-strategy optim", "--use-megatron-fsdp"),
    ("--use-megatron-fsdp --megatron-fsdp-grad-comm-dtype bf16",
     "--megatron-fsdp-grad-comm-dtype"),  # a bucket beside the main gradients' dtype
    ("--pipeline-model-parallel-size 2 --account-for-embedding-in-pipeline-split",
     "--account-for-embedding-in-pipeline-split"),  # 4 + 1 layers do not split over 2
    # checked before the vocabulary is padded to a multiple of 128 * tp (a division by 0)
    ("--tensor-model-parallel-size 0", "--tensor-model-parallel-size"),
    ("--pipeline-model-parallel-size 2 --decoder-first-pipeline-num-layers 2 "
     "--account-for-loss-in-pipeline-split", "--account-for-loss-in-pipeline-split"),
])
def test_megatron_refuses_what_it_cannot_express(extra: str, flag: str) -> None:
    base = ("--num-layers 4 --hidden-size 256 --num-attention-heads 4 --seq-length 512 "
            "--max-position-embeddings 512 --vocab-size 1000 --tokenizer-type NullTokenizer ")
    with pytest.raises(MemplanError) as err:
        megatron.read(base + extra, 8)
    message = str(err.value)
    assert flag in message and "\n" not in message


def test_megatron_count_past_its_input_bound_names_the_flag() -> None:
    """A count past the bound of the input it sets (Workload.micro_batch_size > 0) is
    refused naming the Megatron flag and memplan's option, in one line."""
    with pytest.raises(MemplanError) as err:
        megatron.read("--num-layers 2 --hidden-size 64 --num-attention-heads 2 "
                      "--seq-length 64 --vocab-size 100 --micro-batch-size 0", 1)
    assert str(err.value) == ("Megatron-LM arguments --megatron-args: --micro-batch-size = 0: "
                              "--mbs must be more than 0")


@pytest.mark.parametrize("pattern", ["[0]*[1]+[1]*4", "[0]*(1*1)+[1]*3"])
def test_megatron_layer_pattern_of_other_products(pattern: str) -> None:
    """Only a list times a count is a run of layers: another product is no pattern memplan
    reads (refused as such), not one "of more than 10000 layers"."""
    with pytest.raises(MemplanError, match="--moe-layer-freq = .*modelled are 1") as err:
        megatron.read("--num-layers 4 --hidden-size 64 --num-attention-heads 4 --seq-length 64 "
                      f"--vocab-size 128 --num-experts 4 --moe-layer-freq '{pattern}'", 4)
    assert "10000" not in str(err.value)


def test_megatron_vocabulary_needs_a_size() -> None:
    """A tokenizer whose vocabulary is in its files: refused until --vocab-size says it."""
    with pytest.raises(MemplanError, match="--tokenizer-type = 'HuggingFaceTokenizer'.*"
                                           "--vocab-size"):
        megatron.read("--num-layers 2 --hidden-size 64 --num-attention-heads 2 "
                      "--seq-length 64 --tokenizer-type HuggingFaceTokenizer", 1)


def test_megatron_uneven_stages() -> None:
    """--decoder-first/last-pipeline-num-layers: the rest even over the middle stages."""
    imp = megatron.read("--num-layers 30 --hidden-size 64 --num-attention-heads 2 "
                        "--seq-length 64 --vocab-size 100 --tokenizer-type NullTokenizer "
                        "--pipeline-model-parallel-size 4 --decoder-first-pipeline-num-layers 6 "
                        "--decoder-last-pipeline-num-layers 6", 4)
    assert imp.inputs["stage_layers"] == "6,9,9,6"


# --- torchtitan ----------------------------------------------------------------------------

@pytest.mark.parametrize(("toml", "gpus", "model", "inputs"), [
    ("llama3_8b", 64, "llama-3-8b",
     {"dp": 64, "zero": 3, "micro_batch_size": 1, "global_batch_size": 64, "seq_len": 8192,
      "precision": "fsdp-bf16", "recompute": "selective", "optimizer_impl": "fused"}),
    ("llama3_70b", 64, "llama-3-70b",
     {"tp": 8, "dp": 8, "zero": 3, "sequence_parallel": True, "micro_batch_size": 8,
      "global_batch_size": 64, "seq_len": 8192, "recompute": "full"}),
    ("llama3_405b", 128, "llama-3.1-405b",
     {"tp": 8, "dp": 16, "zero": 3, "micro_batch_size": 2, "recompute": "full"}),
])
def test_torchtitan_published_train_configs(toml: str, gpus: int, model: str,
                                            inputs: dict) -> None:
    """data_parallel_shard_degree = -1 takes the ranks left of --gpus; FSDP2's bf16
    MixedPrecisionPolicy; SAC by op; the model by its flavor."""
    imp = torchtitan.read(TITAN / f"{toml}.toml", gpus)
    assert imp.model == model
    assert {k: imp.inputs.get(k) for k in inputs} == inputs
    assert imp.inputs["framework"] == "torchtitan"
    assert imp.unread == []


def test_torchtitan_notes_what_it_does_not_model() -> None:
    """llama3_405b.toml converts its linears to float8 (model.converters "float8", its
    [quantize.linear.float8] with no recipe_name: torchao's default tensorwise; FSDP float8
    all-gather on; "output" filtered) and compiles (compile.enable, components model and loss
    by default: the layers compiled, --compile; the loss, on logits split by tp 8, compiled
    under loss parallel, --compile-loss); only async TP is noted (timing)."""
    imported = torchtitan.read(TITAN / "llama3_405b.toml", 128)
    notes = " ".join(imported.notes)
    assert "estimated as eager" not in notes and "float8" not in notes
    assert imported.inputs["compile"] is True
    assert imported.inputs["compile_loss"] is True and imported.inputs["tp"] == 8
    assert imported.inputs["float8"] == "tensorwise"
    assert imported.inputs["float8_all_gather"] is True


def test_torchtitan_float8_head_converted_is_refused(tmp_path: Path) -> None:
    """A float8 converter that does not filter the output head would convert it: refused."""
    text = (TITAN / "llama3_405b.toml").read_text().replace('filter_fqns = ["output"]',
                                                             "filter_fqns = []")
    path = tmp_path / "job.toml"
    path.write_text(text)
    with pytest.raises(MemplanError, match="filter_fqns"):
        torchtitan.read(path, 128)


def test_torchtitan_every_nth_layer_checkpointing() -> None:
    """debug_model.toml checkpoints every 2nd layer (selective_ac_option '2'): full recompute
    of every 2nd block (v0.2.2 _apply_layer_sac); its model is the debugmodel flavor (6 layers,
    dim 256), its seq_len 2048, local batch 8 on 8 ranks of FSDP."""
    imp = torchtitan.read(TITAN / "debug_model.toml", 8)
    assert (imp.inputs["recompute"], imp.inputs["recompute_every"]) == ("full", 2)
    lines = "\n".join(imp.lines())
    assert "activation_checkpoint.selective_ac_option = '2' -> --recompute-every 2" in lines
    assert "_apply_layer_sac" in lines


@pytest.mark.parametrize(("option", "inputs"), [
    ("'1'", {"recompute": "full"}), ("'0'", {"recompute": "full"}),
    ("'3'", {"recompute": "full", "recompute_every": 3})])
def test_torchtitan_layer_counts(tmp_path: Path, option: str, inputs: dict) -> None:
    """0 and 1 wrap every block (``not ac_freq or count % ac_freq == 0``); 3 every third."""
    text = (TITAN / "debug_model.toml").read_text().replace("selective_ac_option = '2'",
                                                            f"selective_ac_option = {option}")
    job = tmp_path / "job.toml"
    job.write_text(text)
    imp = torchtitan.read(job, 8)
    got = {k: imp.inputs[k] for k in ("recompute", "recompute_every") if k in imp.inputs}
    assert got == inputs


def test_torchtitan_default_checkpointing(tmp_path: Path) -> None:
    """A job that sets no [activation_checkpoint] runs v0.2.2's defaults, mode selective with
    selective_ac_option '2' (job_config.py ActivationCheckpoint): every 2nd block, said so."""
    job = tmp_path / "job.toml"
    job.write_text('[model]\nname = "llama3"\nflavor = "debugmodel"\n')
    imp = torchtitan.read(job, 8)
    assert (imp.inputs["recompute"], imp.inputs["recompute_every"]) == ("full", 2)
    assert any("its default" in m.how for m in imp.mapping)


def test_torchtitan_layer_option_not_a_number(tmp_path: Path) -> None:
    text = (TITAN / "debug_model.toml").read_text().replace("selective_ac_option = '2'",
                                                            "selective_ac_option = 'two'")
    job = tmp_path / "job.toml"
    job.write_text(text)
    with pytest.raises(MemplanError, match="selective_ac_option = 'two'"):
        torchtitan.read(job, 8)


def test_torchtitan_float8_run_of_the_accuracy_table(tmp_path: Path) -> None:
    """The published H200 float8 run (llama3_8b.toml with --training.local_batch_size=2, its
    float8 converter, compile, which compiles the loss too; 4 nodes of 8 GPUs) gives the
    accuracy table's inputs, but for its FSDP units: the run's commit (e7c0cae) wraps the
    embedding, final norm and head in the root unit (``fsdp_units`` root-resharded), v0.2.2's
    apply_fsdp, which the reader follows, gives them units of their own."""
    run = next(r for r in RUNS if r["id"] == "torchtitan/llama3.1-8b/h200-32gpu-fsdp-sac-float8")
    text = (TITAN / "llama3_8b.toml").read_text()
    text = text.replace("local_batch_size = 1", "local_batch_size = 2")
    text = text.replace("[compile]\nenable=false", "[compile]\nenable=true")
    text = text.replace('hf_assets_path = "./assets/hf/Llama-3.1-8B"',
                        'hf_assets_path = "./assets/hf/Llama-3.1-8B"\n'
                        'converters = ["quantize.linear.float8"]')
    text = text.replace("enable_fsdp_float8_all_gather = false",
                        "enable_fsdp_float8_all_gather = true")
    path = tmp_path / "job.toml"
    path.write_text(text)
    imp = torchtitan.read(path, run["memplan_args"]["gpus"])
    want = {k: v for k, v in run["memplan_args"].items()
            if k not in ("model", "gpus", "gpu", "fsdp_units")}
    assert {k: imp.inputs.get(k) for k in want} == want
    assert run["memplan_args"]["fsdp_units"] == "root-resharded"
    assert "fsdp_units" not in imp.inputs  # the preset's: torchtitan
    assert imp.model == run["memplan_args"]["model"]
    assert imp.notes == []  # the compiled loss is --compile-loss (tp 1)


@pytest.mark.parametrize(("edit", "key"), [
    (("fsdp_reshard_after_forward", '"never"'), "fsdp_reshard_after_forward"),
    (("flavor", '"3B"'), "model.name/flavor"),
    (("mode", '"memory_budget"'), "activation_checkpoint.mode"),
    (("pipeline_parallel_schedule", '"ZBVZeroBubble"'), "pipeline_parallel_schedule"),
])
def test_torchtitan_refuses_by_name(tmp_path: Path, edit: tuple[str, str], key: str) -> None:
    key_name, value = edit
    text = (TITAN / "llama3_8b.toml").read_text()
    section = {"fsdp_reshard_after_forward": "[parallelism]", "enable_cpu_offload": "[training]",
               "mode": None, "flavor": None, "pipeline_parallel_schedule": "[parallelism]"}
    if section[key_name]:
        text = text.replace(section[key_name], f"{section[key_name]}\n{key_name} = {value}")
    else:
        text = re.sub(rf"^{key_name} = .*$", f"{key_name} = {value}", text, flags=re.M)
    if key_name == "pipeline_parallel_schedule":
        text = text.replace("pipeline_parallel_degree = 1", "pipeline_parallel_degree = 2")
    path = tmp_path / "job.toml"
    path.write_text(text)
    with pytest.raises(MemplanError) as err:
        torchtitan.read(path, 64)
    assert key in str(err.value) and "\n" not in str(err.value)


def test_torchtitan_cpu_offload_is_params(tmp_path: Path) -> None:
    """training.enable_cpu_offload: torchtitan passes CPUOffloadPolicy() to fully_shard, which
    is --offload params."""
    text = (TITAN / "llama3_8b.toml").read_text().replace(
        "[training]", "[training]\nenable_cpu_offload = true")
    path = tmp_path / "job.toml"
    path.write_text(text)
    assert torchtitan.read(path, 64).inputs["offload"] == "params"


def test_torchtitan_pipeline_stages(tmp_path: Path) -> None:
    """Interleaved1F1B without layers_per_stage: 2 stages per rank (pipeline_llm); the PP
    micro-batch splits the local batch."""
    text = (TITAN / "llama3_8b.toml").read_text().replace(
        "pipeline_parallel_degree = 1",
        'pipeline_parallel_degree = 4\npipeline_parallel_schedule = "Interleaved1F1B"\n'
        "pipeline_parallel_microbatch_size = 1")
    text = text.replace("local_batch_size = 1", "local_batch_size = 8")
    job = tmp_path / "job.toml"
    job.write_text(text)
    imp = torchtitan.read(job, 64)
    assert (imp.inputs["pp"], imp.inputs["vpp"], imp.inputs["schedule"]) == (4, 2, "1f1b")
    assert (imp.inputs["micro_batch_size"], imp.inputs["global_batch_size"]) == (1, 128)


def test_torchtitan_shard_degree_needs_gpus() -> None:
    with pytest.raises(MemplanError, match="give --gpus"):
        torchtitan.read(TITAN / "llama3_70b.toml", 12)


# --- the CLI -------------------------------------------------------------------------------

def test_cli_prints_the_mapping_then_the_estimate() -> None:
    result = CliRunner().invoke(app, ["estimate", "-n", "64", "--torchtitan-config",
                                      str(TITAN / "llama3_8b.toml")])
    assert result.exit_code == 0, result.output
    assert "training.local_batch_size = 1 -> --mbs 1" in result.output
    assert "llama-3-8b" in result.output


def test_cli_json_has_the_mapping() -> None:
    result = CliRunner().invoke(app, ["estimate", "-n", "8", "--json", "--megatron-args",
                                      str(MEGATRON / "gpt3_mcore_te_tp2_pp2_resume_torch_dist.yaml")])
    assert result.exit_code == 0, result.output
    out = json.loads(result.output)
    assert out["config"]["mapping"][0]["input"] == "--framework"
    keys = {m["key"] for m in out["config"]["mapping"]}
    assert "--tensor-model-parallel-size" in keys


def test_cli_flag_and_config_must_agree(capsys: pytest.CaptureFixture[str]) -> None:
    """A flag given with another value than the config's: one line naming both, exit 2; the
    same value is fine."""
    toml = str(TITAN / "llama3_70b.toml")
    assert main(["estimate", "-n", "64", "--tp", "4", "--torchtitan-config", toml]) == 2
    err = capsys.readouterr().err
    assert "--tp 4" in err and "tensor_parallel_degree" in err and err.count("\n") == 1
    same = CliRunner().invoke(app, ["estimate", "-n", "64", "--tp", "8",
                                    "--torchtitan-config", toml])
    assert same.exit_code == 0, same.output


def test_cli_model_replaces_the_configs() -> None:
    result = CliRunner().invoke(app, ["estimate", "-n", "64", "-m", "llama-2-7b",
                                      "--torchtitan-config", str(TITAN / "llama3_8b.toml")])
    assert result.exit_code == 0, result.output
    assert "replaced by --model" in result.output and "llama-2-7b" in result.output


def test_cli_plan_takes_a_config() -> None:
    result = CliRunner().invoke(app, ["plan", "-n", "8", "--top", "1", "--json",
                                      "--megatron-args",
                                      str(MEGATRON / "gpt3_mcore_te_tp1_pp4_vp1.yaml")])
    assert result.exit_code == 0, result.output
    out = json.loads(result.output)
    assert out["candidates"] and "config" in out


def test_cli_needs_a_model_or_a_config(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["estimate", "-n", "8"]) == 2
    assert "--model is required" in capsys.readouterr().err


# --- torchtitan's config registry (0.3 and later) -------------------------------------------

REG_030 = TITAN / "v0.3.0" / "llama3" / "config_registry.py"
REG_MAIN = TITAN / "main" / "llama3" / "config_registry.py"


@pytest.mark.parametrize(("command", "gpus", "model", "inputs"), [
    # TrainingConfig(local_batch_size=1, seq_len=8192), SelectiveAC.Config(), the llama3
    # registry's ChunkedLossWrapper (num_chunks defaults to 8), default_adamw: fused
    (f"{REG_030} --config llama3_8b", 64, "llama-3-8b",
     {"dp": 64, "zero": 3, "micro_batch_size": 1, "global_batch_size": 64, "seq_len": 8192,
      "precision": "fsdp-bf16", "recompute": "selective", "optimizer_impl": "fused",
      "loss_chunks": 8}),
    # tensor_parallel_degree=8: dp = 64 / 8; local batch 8 * dp 8 = 64; FullAC
    (f"{REG_030} --config llama3_70b", 64, "llama-3-70b",
     {"tp": 8, "dp": 8, "zero": 3, "sequence_parallel": True, "micro_batch_size": 8,
      "global_batch_size": 64, "seq_len": 8192, "recompute": "full"}),
    (f"{REG_030} --config llama3_405b", 128, "llama-3.1-405b",
     {"tp": 8, "dp": 16, "micro_batch_size": 2, "global_batch_size": 32, "recompute": "full"}),
    # main: 8 * 2048 tokens per micro-batch in sequences of 2048: 8 sequences
    (f"{REG_MAIN} --config llama3_debugmodel", 8, "torchtitan-llama3-debugmodel",
     {"dp": 8, "micro_batch_size": 8, "global_batch_size": 64, "seq_len": 2048,
      "recompute": "selective", "loss_chunks": 8}),
    # 1 * 8192 tokens, max_context_length 8192: one sequence
    (f"{REG_MAIN} --config llama3_8b", 64, "llama-3-8b",
     {"dp": 64, "micro_batch_size": 1, "global_batch_size": 64, "seq_len": 8192}),
    # 8 * 8192 tokens: 8 sequences of 8192, TP 8
    (f"{REG_MAIN} --config llama3_70b", 64, "llama-3-70b",
     {"tp": 8, "dp": 8, "micro_batch_size": 8, "global_batch_size": 64, "recompute": "full"}),
    # overrides as torchtitan's entry point takes them, both spellings
    (f"{REG_030} --config llama3_8b --training.local_batch_size=2 "
     "--parallelism.tensor_parallel_degree 2", 64, "llama-3-8b",
     {"tp": 2, "dp": 32, "micro_batch_size": 2, "global_batch_size": 64}),
    (f"--module={REG_030} --config=llama3_70b --parallelism.tensor_parallel_degree 4", 64,
     "llama-3-70b", {"tp": 4, "dp": 16, "global_batch_size": 128}),
    # 0.3 shards with FSDP2 on every layout (models/llama3/parallelize.py parallelize_llama
    # calls apply_fsdp_to_decoder whatever the degrees): one rank is FSDP2 on a one-rank
    # shard group under its MixedPrecisionPolicy, not v0.2.2's autocast; replicate 8 of
    # shard 1 is HSDP of one-rank shard groups, not DDP
    (f"{REG_030} --config llama3_8b", 1, "llama-3-8b",
     {"dp": 1, "zero": 3, "precision": "fsdp-bf16"}),
    (f"{REG_030} --config llama3_8b --parallelism.data_parallel_replicate_degree 8", 8,
     "llama-3-8b", {"dp": 8, "zero": 3, "dp_shard": 1, "precision": "fsdp-bf16"}),
    # main with PP: each of the 4 pipeline micro-batches holds 8192 tokens, one sequence;
    # a step is 4 of them on each of the 32 data-parallel ranks: 128 sequences
    (f"{REG_MAIN} --config llama3_8b --parallelism.pipeline_parallel_degree 2 "
     "--parallelism.num_pp_microbatches 4", 64, "llama-3-8b",
     {"pp": 2, "dp": 32, "micro_batch_size": 1, "global_batch_size": 128, "vpp": 1}),
])
def test_torchtitan_registry(command: str, gpus: int, model: str, inputs: dict) -> None:
    imp = torchtitan.read(command, gpus)
    assert imp.model == model or imp.model.name == model
    assert {k: imp.inputs.get(k) for k in inputs} == inputs
    assert imp.inputs["framework"] == "torchtitan"
    assert "keep_grads" not in imp.inputs  # 0.3's own: the torchtitan preset's
    assert imp.unread == []


def test_torchtitan_registry_names_its_keys() -> None:
    """Each mapping line names the registry's own field; the token budget's sequences said."""
    imp = torchtitan.read(f"{REG_MAIN} --config llama3_debugmodel", 8)
    lines = "\n".join(imp.lines())
    assert "training.num_tokens_per_microbatch_per_dp_rank = 16384 -> --mbs 8" in lines
    assert "training.max_context_length = 2048 -> --seq 2048" in lines
    assert "loss = 'ChunkedLossWrapper(num_chunks=8)' -> --loss-chunks 8" in lines
    assert imp.source.endswith("config_registry.py llama3_debugmodel")
    # modelled: the torchtitan preset's loss_chunk_backward in-loss
    assert not any("ChunkedLossWrapper: not modelled" in n for n in imp.notes)


def test_torchtitan_registry_notes() -> None:
    """llama3_405b: its Float8LinearConverter.Config(filter_fqns=["lm_head"]) mapped to
    --float8 rowwise (0.3's recipe_name default), compile mapped to --compile, its compiled
    ChunkedLossWrapper at tp 8 (each chunk's loss compiled under loss parallel) to
    --compile-loss; flex attention noted."""
    imported = torchtitan.read(f"{REG_030} --config llama3_405b", 128)
    notes = " ".join(imported.notes)
    assert "estimated as eager" not in notes and "flex" in notes
    assert imported.inputs["compile_loss"] is True and imported.inputs["loss_chunks"] == 8
    assert imported.inputs["compile"] is True
    assert imported.inputs["float8"] == "rowwise"


def _registry(tmp_path: Path, body: str, top: str = "") -> str:
    folder = tmp_path / "llama3"
    folder.mkdir(exist_ok=True)
    (folder / "config_registry.py").write_text(
        f"{top}\ndef base():\n    return Trainer.Config(model_spec=model_registry('8B'), "
        "training=TrainingConfig(local_batch_size=4, seq_len=4096))\n\n"
        f"def job():\n{body}\n")
    return f"{folder / 'config_registry.py'} --config job"


def test_torchtitan_registry_compiled_chunked_loss() -> None:
    """llama3_debugmodel with compile.enable: its ChunkedLossWrapper's inner loss compiled
    (compile.components model and loss by default: ``BaseLoss._maybe_compile``), on whole
    logits: --compile-loss beside --loss-chunks 8, no note; the estimate takes it."""
    imp = torchtitan.read(f"{REG_MAIN} --config llama3_debugmodel --compile.enable true", 8)
    assert {k: imp.inputs.get(k) for k in ("compile", "compile_loss", "loss_chunks")} == {
        "compile": True, "compile_loss": True, "loss_chunks": 8}
    assert not any("estimated as eager" in n for n in imp.notes)
    result = CliRunner().invoke(app, ["estimate", "-n", "8", "--json", "--torchtitan-config",
                                      f"{REG_MAIN} --config llama3_debugmodel "
                                      "--compile.enable true"])
    assert result.exit_code == 0, result.output
    assert "its cross-entropy compiled (each chunk's graph" in result.output


def test_torchtitan_registry_is_parsed_not_run(tmp_path: Path) -> None:
    """A top level that would fail when imported, a derived config that sets fields (as
    llama3_debugmodel_varlen_attn does), arithmetic on literals: 2 * 4 sequences of 2048."""
    command = _registry(tmp_path, "    config = base()\n"
                                  "    config.training.local_batch_size = 2 * 4\n"
                                  "    config.training.seq_len = 2048\n"
                                  "    config.training.disable_cuda_graphs = True\n"
                                  "    config.activation_checkpoint = FullAC.Config()\n"
                                  "    return config",
                        top="raise SystemExit('imported')")
    imp = torchtitan.read(command, 8)
    assert (imp.inputs["micro_batch_size"], imp.inputs["seq_len"]) == (8, 2048)
    assert (imp.inputs["recompute"], imp.inputs["keep_grads"]) == ("full", False)


@pytest.mark.parametrize(("body", "match"), [
    ("    config = base()\n    config.training.local_batch_size = helper()\n    return config",
     "training.local_batch_size = helper()"),
    ("    import os\n    os.system('x')\n    return base()", "line 6: 'import os'"),
    ("    for i in range(2):\n        pass\n    return base()", "line 6: 'for i in range(2):'"),
    ("    config = base()\n    config.activation_checkpoint = MemoryBudgetAC.Config()\n"
     "    return config", "activation_checkpoint.mode"),
    ("    return Trainer.Config(model_spec=model_registry('8B', attn_backend='varlen'))",
     "model_spec attn_backend"),
    ("    return Trainer.Config(model_spec=model_registry('8B'), "
     "training=TrainingConfig(num_tokens_per_microbatch_per_dp_rank=3000, "
     "max_context_length=2048))", "num_tokens_per_microbatch_per_dp_rank = 3000"),
    # squared line after line, past 64 bits: left unevaluated (a count is never that large)
    ("    n = 3037000500\n" + "    n = n * n\n" * 40 + "    config = base()\n"
     "    config.training.local_batch_size = n\n    return config",
     "training.local_batch_size = n * n"),
])
def test_torchtitan_registry_refuses_by_name(tmp_path: Path, body: str, match: str) -> None:
    with pytest.raises(MemplanError, match=re.escape(match)) as err:
        torchtitan.read(_registry(tmp_path, body), 8)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("terms", [1500, 50_000])  # walked too deep; parsed too deep
def test_torchtitan_registry_too_deep_is_one_line(tmp_path: Path, terms: int) -> None:
    """An expression nested past Python's recursion limit: one line naming the file, whether
    the parser or the reader's walk of the tree gives up."""
    import sys

    command = _registry(tmp_path, "    n = " + " + ".join(["1"] * terms) + "\n    return base()")
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(1000)  # CPython's default, whatever an earlier compile left
    try:
        with pytest.raises(MemplanError, match="config_registry.py") as err:
            torchtitan.read(command, 8)
    finally:
        sys.setrecursionlimit(limit)
    assert "\n" not in str(err.value)


def test_torchtitan_registry_needs_a_config_function() -> None:
    with pytest.raises(MemplanError, match="no config function 'llama3_9b'"):
        torchtitan.read(f"{REG_030} --config llama3_9b", 8)
    with pytest.raises(MemplanError, match="--module"):
        torchtitan.read("--config llama3_8b", 8)


def test_cli_reads_a_registry_entry() -> None:
    result = CliRunner().invoke(app, ["estimate", "-n", "64", "--torchtitan-config",
                                      f"{REG_030} --config llama3_8b"])
    assert result.exit_code == 0, result.output
    assert "training.local_batch_size = 1 -> --mbs 1" in result.output


def test_torchtitan_registry_module_shorthand() -> None:
    """``--module llama3``: the installed torchtitan's models/llama3/config_registry.py, found
    on the path without importing it (ConfigManager._load_config's first candidate)."""
    import importlib.util

    if importlib.util.find_spec("torchtitan") is None:
        pytest.skip("torchtitan is not installed")
    imp = torchtitan.read("--module llama3 --config llama3_70b", 64)
    assert "torchtitan/models/llama3/config_registry.py llama3_70b" in imp.source
    assert (imp.model, imp.inputs["tp"]) == ("llama-3-70b", 8)


_BASE = ("--num-layers 4 --hidden-size 256 --num-attention-heads 4 --seq-length 512 "
         "--max-position-embeddings 512 --vocab-size 1000 --tokenizer-type NullTokenizer ")


def test_megatron_flags_not_read_are_listed_as_may_change_memory() -> None:
    """A flag memplan neither reads nor knows to hold nothing is listed as not modelled
    (never as holding no memory); one that holds nothing (--lr) is left out."""
    imp = megatron.read(_BASE + "--no-bias-swiglu-fusion --data-parallel-sharding-strategy "
                        "optim_grads --lr 1e-4", 8)
    assert imp.unread == ["--no-bias-swiglu-fusion", "--data-parallel-sharding-strategy"]
    assert imp.lines()[-1] == ("  not modelled, may change memory: --no-bias-swiglu-fusion, "
                               "--data-parallel-sharding-strategy")


@pytest.mark.parametrize(("flags", "split"), [
    # 4 layers + the embedding = 5 ... over pp 5: one each, the first stage's slot is the
    # embedding's
    ("--pipeline-model-parallel-size 5 --account-for-embedding-in-pipeline-split", "0,1,1,1,1"),
    # 4 + the loss = 5 over pp 5
    ("--pipeline-model-parallel-size 5 --account-for-loss-in-pipeline-split", "1,1,1,1,0"),
    # 4 + 2 = 6 over pp 3: 2 each, one fewer on the first and on the last
    ("--pipeline-model-parallel-size 3 --account-for-embedding-in-pipeline-split "
     "--account-for-loss-in-pipeline-split", "1,2,1"),
    # 4 + 2 = 6 over pp 3 x 2 virtual stages of 1 (vpp 6 / 3 / 1 = 2): the first virtual
    # stage (chunk 0 of rank 0) and the last (chunk 1 of rank 2) empty
    ("--pipeline-model-parallel-size 3 --num-layers-per-virtual-pipeline-stage 1 "
     "--account-for-embedding-in-pipeline-split --account-for-loss-in-pipeline-split",
     "0,1,1,1,1,0"),
])
def test_megatron_embedding_and_loss_in_the_pipeline_split(flags: str, split: str) -> None:
    """get_num_layers_to_build (transformer_block.py): (layers + 1 per flag) / pp per stage,
    one fewer on the first stage for the embedding, on the last for the loss."""
    assert megatron.read(_BASE + flags, 15).inputs["stage_layers"] == split


def test_megatron_mla_qk_layernorm_is_the_latent_norms() -> None:
    """--qk-layernorm with MLA builds q_layernorm / kv_layernorm on the latents
    (gpt_layer_specs.py), which memplan's MLA holds: read, no per-head q/k norm, no note;
    without it a note says memplan counts latent norms Megatron does not build."""
    mla = (_BASE + "--multi-latent-attention --q-lora-rank 64 --kv-lora-rank 32 "
           "--qk-head-dim 32 --qk-pos-emb-head-dim 16 --v-head-dim 32 --normalization RMSNorm")
    with_norm = megatron.read(mla + " --qk-layernorm", 8)
    without = megatron.read(mla, 8)
    assert with_norm.model.qk_norm.value == "none" and not with_norm.notes
    assert with_norm.model.num_params == without.model.num_params
    assert any("latent norms" in n for n in without.notes)


def test_megatron_fused_cross_entropy_is_the_compiled_vocab_parallel_loss() -> None:
    """The native fused loss (fused_cross_entropy.py, compiled by jit_fuser) is read as
    loss_impl megatron-fused, everything else as without the flag; TE's fused loss refused."""
    fused = megatron.read(_BASE + "--cross-entropy-loss-fusion", 8)
    plain = megatron.read(_BASE, 8)
    assert fused.inputs == {**plain.inputs, "loss_impl": "megatron-fused"}
    assert fused.model == plain.model
    with pytest.raises(MemplanError, match="Transformer Engine's fused cross-entropy"):
        megatron.read(_BASE + "--cross-entropy-loss-fusion --cross-entropy-fusion-impl te", 8)


def test_megatron_expert_tensor_parallel_on_a_dense_model_is_a_note() -> None:
    """Megatron takes --expert-tensor-parallel-size on a dense model (its expert groups hold
    no tensors): read with a note, no etp set, the same inputs as without it; on an MoE model
    it is the experts' split (etp 1 under tp 2)."""
    dense = megatron.read(_BASE + "--tensor-model-parallel-size 2 "
                                  "--expert-tensor-parallel-size 4", 8)
    plain = megatron.read(_BASE + "--tensor-model-parallel-size 2", 8)
    assert dense.inputs == plain.inputs and "etp" not in dense.inputs
    assert any(n.startswith("--expert-tensor-parallel-size 4: no effect") for n in dense.notes)
    moe = megatron.read(_BASE + "--tensor-model-parallel-size 2 --num-experts 4 "
                                "--expert-model-parallel-size 4 "
                                "--expert-tensor-parallel-size 1", 8)
    assert moe.inputs["etp"] == 1


def test_megatron_pipeline_layout_is_the_split() -> None:
    """--pipeline-model-parallel-layout as Megatron's parse_str_to_list reads it: "Et*3|(tt|)*
    6L" unrolls to Ettt|tt|tt|tt|tt|tt|tt|L, 8 stages over pp 2: vpp 4, decoder layers
    3,2,2,2,2,2,2,0 (15 = --num-layers); "Et,t|ttL" (a cosmetic comma) at pp 2 is vpp 1,
    3 and 2 layers."""
    base = _BASE.replace("--num-layers 4", "--num-layers 15") + \
        "--pipeline-model-parallel-size 2 "
    imp = megatron.read(base + "--pipeline-model-parallel-layout 'Et*3|(tt|)*6L'", 8)
    assert imp.inputs["vpp"] == 4 and imp.inputs["stage_layers"] == "3,2,2,2,2,2,2,0"
    five = _BASE.replace("--num-layers 4", "--num-layers 5") + \
        "--pipeline-model-parallel-size 2 --pipeline-model-parallel-layout Et,tt|ttL"
    imp = megatron.read(five, 8)
    assert "vpp" not in imp.inputs and imp.inputs["stage_layers"] == "3,2"


def test_megatron_pipeline_layout_with_mtp_on_the_last_stage() -> None:
    """A layout whose MTP layer (m) is in the last stage string is where memplan models it:
    "Et*3|(tt|)*6mL" (Megatron's functional test gpt3_moe_mcore_te_tp2_pp2_ep4_etp1_fine_
    grained_offloading) unrolls to Ettt|tt|tt|tt|tt|tt|tt|mL, 8 stages over pp 2: stage 7 =
    chunk 7 // 2 = 3 (the last of vpp 4) of rank 7 % 2 = 1 (the last), decoder layers
    3,2,2,2,2,2,2,0, and the one m matches --mtp-num-layers 1."""
    base = _BASE.replace("--num-layers 4", "--num-layers 15") + \
        "--pipeline-model-parallel-size 2 --mtp-num-layers 1 "
    imp = megatron.read(base + "--pipeline-model-parallel-layout 'Et*3|(tt|)*6mL'", 8)
    assert imp.inputs["vpp"] == 4 and imp.inputs["stage_layers"] == "3,2,2,2,2,2,2,0"
    assert imp.inputs["mtp_layers"] == 1


@pytest.mark.parametrize(("layout", "extra", "why"), [
    ("Et*3|(tt|)*5|L", "", "has 13 decoder layers"),  # 3 + 10, an empty stage
    ("Ettt|(tt|)*6", "", "the loss \\(L\\) last"),
    ("Et*3|(tt|)*5ttL", "", "has 7 stages, which pp \\(2\\) does not divide"),
    ("Et*3|(tt|)*6xL", "", "has 'x'"),
    ("E(t)*99999999|L", "", "unrolls to more than"),
    ("Et*3|(tt|)*6L", "--num-virtual-stages-per-pipeline-rank 4",
     "no other split flag \\(--num-virtual-stages-per-pipeline-rank\\)"),
    # Megatron's standalone MTP stage: m in chunk 3 of rank 0 (stage 6), not the last stage
    ("Et*3|(tt|)*5ttm|L", "--mtp-num-layers 1", "outside the last stage"),
    ("Et*3|(tt|)*6L", "--mtp-num-layers 1", "has 0 MTP layers \\(m\\)"),
    ("Et*3|(tt|)*6mL", "", "has 1 MTP layers \\(m\\); --mtp-num-layers is 0"),
    ("Et*3|(tt|)*5m|ttL", "--mtp-num-layers 1", "a decoder layer \\(t\\) after"),
])
def test_megatron_pipeline_layout_refusals(layout: str, extra: str, why: str) -> None:
    """Megatron's own checks (PipelineParallelLayerLayout.__init__, validate_layer_layout,
    validate_args) said for the layout; an unrolling past any layout of MAX_LAYERS layers is
    refused before it is built."""
    base = _BASE.replace("--num-layers 4", "--num-layers 15") + \
        f"--pipeline-model-parallel-size 2 --pipeline-model-parallel-layout '{layout}' {extra}"
    with pytest.raises(MemplanError, match=f"--pipeline-model-parallel-layout = .*{why}"):
        megatron.read(base, 8)


def test_megatron_softmax_in_fp32_where_megatron_reads_it() -> None:
    """--attention-softmax-in-fp32 is read by Megatron's own attention only (--transformer-
    impl local), and only changes the bytes where its fused causal softmax kernel does not
    run. _BASE: 4 heads, seq 512, mbs 1. Transformer Engine's attention: a note. Local at
    seq 512: b * heads = 4, 512 keys (next power of two 512: warps of 32, 128 / 32 = 4 warps
    of 1 batch) -> 4 batches per block, 4 % 4 == 0: the kernel runs, a note. Local at seq
    8192 (past the kernel's 4096 keys), or with --no-masked-softmax-fusion: softmax_fp32."""
    base = _BASE + "--bf16 --attention-softmax-in-fp32 --attention-backend unfused "
    te = megatron.read(base, 8)
    assert "softmax_fp32" not in te.inputs
    assert any(n.startswith("--attention-softmax-in-fp32: no effect here (read only")
               for n in te.notes)
    local = megatron.read(base + "--transformer-impl local", 8)
    assert "softmax_fp32" not in local.inputs
    assert any("fused softmax kernel runs" in n for n in local.notes)
    long = megatron.read(base.replace("512", "8192") + "--transformer-impl local", 8)
    unfused = megatron.read(base + "--transformer-impl local --no-masked-softmax-fusion", 8)
    assert long.inputs["softmax_fp32"] is True and unfused.inputs["softmax_fp32"] is True


@pytest.mark.parametrize(("b", "heads", "seq", "runs"), [
    (1, 4, 1024, True),   # 4 batches per block (1024 keys: 4 warps of 32, 1 batch each)
    (1, 2, 1024, False),  # b * heads = 2, not a multiple of 4
    (1, 4, 64, False),    # 64 keys: 4 warps x 2 batches = 8 per block; 4 % 8 != 0
    (2, 4, 64, True),     # 8 % 8 == 0
    (1, 4, 16, False),    # the kernel takes 16 < sk
    (1, 4, 4100, False),  # ... <= 4096
])
def test_megatron_fused_softmax_availability(b: int, heads: int, seq: int, runs: bool) -> None:
    """fused_softmax.py is_kernel_available for causal scores, by hand."""
    from memplan.config_import.megatron import _fused_softmax
    assert _fused_softmax(b, heads, seq) is runs


def test_megatron_router_dtype_fp32() -> None:
    """RouterGatingLinearFunction saves the compute-dtype input and weight: no fp32 copies
    (the spec's router_fp32 is transformers' DeepSeek router, which saves them), a note."""
    imp = megatron.read(_BASE + "--num-experts 8 --moe-router-dtype fp32", 8)
    assert imp.model.moe.router_fp32 is False
    assert any(n.startswith("--moe-router-dtype fp32") for n in imp.notes)


def test_megatron_distributed_optimizer_instances() -> None:
    """2 instances at dp 8 (8 GPUs, tp 1): states sharded over 8 / 2 = 4 ranks, --dp-shard 4
    with ZeRO-1."""
    imp = megatron.read(_BASE + "--use-distributed-optimizer "
                        "--num-distributed-optimizer-instances 2", 8)
    assert (imp.inputs["zero"], imp.inputs["dp_shard"]) == (1, 4)


def test_megatron_microbatch_group_size() -> None:
    """--microbatch-group-size-per-virtual-pipeline-stage under interleaving: --vpp-group."""
    imp = megatron.read(_BASE + "--pipeline-model-parallel-size 2 "
                        "--num-layers-per-virtual-pipeline-stage 1 "
                        "--microbatch-group-size-per-virtual-pipeline-stage 3", 2)
    assert (imp.inputs["vpp"], imp.inputs["vpp_group"]) == (2, 3)


def test_megatron_grad_reduce_in_bf16() -> None:
    """--bf16 --grad-reduce-in-bf16: bf16 gradient buffers (validate_args turns the fp32
    accumulation off), memplan's bf16-mixed."""
    imp = megatron.read(_BASE + "--bf16 --grad-reduce-in-bf16", 8)
    assert imp.inputs["precision"] == "bf16-mixed"
    assert megatron.read(_BASE + "--bf16", 8).inputs["precision"] == "bf16-fp32-grads"

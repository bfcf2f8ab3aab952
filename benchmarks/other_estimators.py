"""Other memory estimators on the published runs: writes ``benchmarks/data/other_estimators.json``.

Runs each existing estimator that can run offline on every run of
``benchmarks/data/published_runs.json`` it can express, and stores the tool, its exact version,
the inputs given for each run and the tool's raw outputs per run id. ``accuracy_table.py``
reads that file (so ``docs/accuracy.md`` regenerates without these tools installed).

- llm-analysis (cli99/llm-analysis; ``pip install --no-deps llm-analysis==0.2.2 'fire<0.6'``:
  its pins would downgrade transformers and huggingface_hub, which it needs only to read a
  Hub config): ``llm_analysis.analysis.train`` with a model config JSON built from the run's
  model shape, one of its own GPU configs and its w16a16e16 dtype config.
- Megatron-LM ``megatron/training/theoretical_memory_usage.py`` from a Megatron-LM git checkout
  (``--megatron-lm PATH`` or ``MEGATRON_LM``; not in the megatron-core wheel):
  ``report_theoretical_memory`` on the arguments Megatron's own parser and ``validate_args``
  build from the run's CI ``model_config.yaml`` (read at the run's commit from the checkout's
  history), as ``training.py`` calls it (``num_microbatches=get_num_microbatches()``).
- DeepSpeed ``estimate_zero3_model_states_mem_needs`` (and the ZeRO-2 one): model states only
  (``--deepspeed-path DIR`` or ``DEEPSPEED_PATH``: a site directory holding ``deepspeed``, e.g.
  ``pip install --target DIR --no-deps --no-build-isolation deepspeed==0.19.8 hjson
  py-cpuinfo msgpack nvidia-ml-py``, kept out of the project's environment).

``accelerate estimate-memory`` is not run: ``create_empty_model`` asks the Hub for the model
(``verify_on_hub``) before anything else, and it has no parallelism, batch or activations.

Each tool runs in a subprocess (``--worker``) so that a Megatron-LM checkout's ``megatron``
package does not mix with the installed megatron-core. A tool that is not available keeps the
results already stored for it.

    python benchmarks/other_estimators.py --megatron-lm ~/src/Megatron-LM --deepspeed-path /tmp/ds
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
RUNS = ROOT / "benchmarks" / "data" / "published_runs.json"
OUT = ROOT / "benchmarks" / "data" / "other_estimators.json"

# GPT-2 BPE vocab.json has 50257 entries (the Megatron CI runs' --vocab-file); Megatron pads it
# in build_tokenizer (vocab_size_with_padding).
GPT2_BPE_VOCAB = 50257
# llm-analysis 0.2.2 GPU configs (llm_analysis/gpu_configs/*.json). It has no H200; the
# capacity enters only its max-batch check, never the memory it reports.
LLMA_GPU = {"h100-sxm": "h100-sxm-80gb", "h200": "h100-sxm-80gb"}
NOMINAL_GB = {"h100-sxm": 80, "h200": 141}  # NVIDIA data sheets
LLMA_RECOMPUTE = {"none": 0, "selective": 1, "full": 2}  # llm_analysis ActivationRecomputation
MEGATRON_FILE = "megatron/training/theoretical_memory_usage.py"
ARCH = {"h100-sxm": 9, "h200": 9}  # CUDA compute capability major (Hopper: 9.0)


# ---------------------------------------------------------------- run shape (parent process)

def _layout(run: dict) -> dict[str, Any]:
    a = run["memplan_args"]
    tp, pp, cp = a.get("tp", 1), a.get("pp", 1), a.get("cp", 1)
    sp = a.get("sequence_parallel")
    return {"gpus": a["gpus"], "gpu": a.get("gpu", "h100-sxm"), "tp": tp, "pp": pp,
            "vpp": a.get("vpp", 1), "cp": cp, "dp": a["gpus"] // (tp * pp * cp),
            "zero": a.get("zero", 0), "mbs": a.get("micro_batch_size", 1),
            "gbs": a.get("global_batch_size"), "seq": a["seq_len"],
            "sp": tp > 1 if sp is None else sp, "recompute": a.get("recompute", "none"),
            "attention": a.get("attention", "flash"),
            "precision": a.get("precision", "bf16-mixed")}


def _spec(run: dict):
    from memplan.spec import load_model

    model = run["memplan_args"]["model"]
    path = ROOT / model
    return load_model(str(path) if path.is_file() else model)


def _caveats(run: dict, spec, lay: dict) -> list[str]:
    out = []
    if lay["pp"] > 1:
        out.append("one number per GPU, for the first pipeline stage; the measurement is the "
                   "last stage")
    if run.get("not_expressible"):
        out.append("memplan's gaps apply too: " + "; ".join(run["not_expressible"]))
    return out


def llm_analysis_job(run: dict) -> dict:
    lay = _layout(run)
    if lay["cp"] > 1:
        return {"status": "n/a", "reason": f"no context parallelism (cp {lay['cp']})"}
    if lay["vpp"] > 1:
        return {"status": "n/a", "reason": f"no interleaved pipeline schedule (vpp {lay['vpp']})"}
    spec = _spec(run)
    gated = spec.mlp.gated
    # llm-analysis counts 2*h*ffn MLP weights and saves 2*ffn MLP activations per token; with
    # 1.5x the gated width both equal SwiGLU's 3*h*ffn and 3*ffn (its "isoparam" convention).
    ffn = spec.ffn_hidden_size * 3 // 2 if gated else spec.ffn_hidden_size
    model_config = {
        "name": spec.name, "num_layers": spec.num_layers, "n_head": spec.num_attention_heads,
        "hidden_dim": spec.hidden_size, "vocab_size": spec.vocab_size,
        "max_seq_len": lay["seq"], "num_key_value_heads": spec.num_kv_heads,
        "ffn_embed_dim": ffn, "expansion_ratio": ffn / spec.hidden_size}
    gbs = lay["gbs"] or lay["mbs"] * lay["dp"]
    gpu_config = {"base": LLMA_GPU[lay["gpu"]], "mem_per_GPU_in_GB": _nominal_gb(run, lay)}
    parallelism = {"tp_size": lay["tp"], "pp_size": lay["pp"], "dp_size": lay["dp"],
                   "sp_size": lay["tp"] if lay["sp"] else 1}
    training = {
        "batch_size_per_gpu": lay["mbs"],
        "gradient_accumulation_steps": gbs // (lay["mbs"] * lay["dp"]),
        "seq_len": lay["seq"], "activation_recomputation": LLMA_RECOMPUTE[lay["recompute"]],
        "ds_zero": lay["zero"], "flash_attn": lay["attention"] != "eager",
        # Megatron's unfused attention keeps a dropout mask (attention dropout 0.1)
        "softmax_dropout": lay["attention"] == "eager" and (spec.dropout or 0) > 0,
        "mlp_gated_linear_units": gated}
    caveats = _caveats(run, spec, lay)
    if not spec.tied_embeddings:
        caveats.append("untied output embedding not counted (training() counts one V*h "
                       "embedding)")
    if lay["precision"] == "fsdp-bf16":
        caveats.append("FSDP's sharded fp32 parameters counted as bf16 weights plus an fp32 "
                       "master copy (18 bytes per parameter / dp; torchtitan holds 16)")
    if lay["precision"] == "fp16-mixed":
        caveats.append("fp16 gradient buffers counted as fp32")
    return {"status": "ok", "inputs": {"model_config": model_config, "gpu_config": gpu_config,
                                       "dtype_name": "w16a16e16",
                                       "parallelism_config": parallelism, "training": training},
            "caveats": caveats}


def _nominal_gb(run: dict, lay: dict) -> int:
    """The nominal capacity of the run's GPU (llm-analysis's GB, times 1024**3 in training()),
    which enters only its check that the batch fits."""
    found = re.search(r"H100 (\d+)GB", run.get("notes", ""))
    return int(found.group(1)) if found else NOMINAL_GB[lay["gpu"]]


def _ci_flags(model_args: dict) -> list[str]:
    """MODEL_ARGS as Megatron-LM's CI passes them (tests/functional_tests/shell_test_utils/
    _run_training.sh: ``true`` is the bare flag, a [list] its items, anything else its value)."""
    flags: list[str] = []
    for key, value in model_args.items():
        if value is True:
            flags.append(key)
        elif isinstance(value, list):
            flags += [key, *map(str, value)]
        elif value == "":
            continue
        else:
            flags += [key, "false" if value is False else str(value)]
    return flags


def megatron_job(run: dict, checkout: Path) -> dict:
    if run["framework"] != "megatron":
        return {"status": "n/a", "reason": "Megatron-LM arguments only: no FSDP / ZeRO-3"}
    import yaml

    match = re.search(r"\(config: https://github.com/NVIDIA/Megatron-LM/blob/([0-9a-f]{40})/"
                      r"(\S+?)\)", run["source"])
    if not match:
        raise ValueError(f"{run['id']}: no Megatron-LM model_config.yaml URL in its source")
    commit, path = match.groups()
    text = subprocess.run(["git", "-C", str(checkout), "show", f"{commit}:{path}"],
                          capture_output=True, text=True, check=True).stdout
    config = yaml.safe_load(text)
    model_args = config["MODEL_ARGS"]
    env = {k: str(v) for k, v in (config.get("ENV_VARS") or {}).items()}
    flags = _ci_flags(model_args)
    if model_args.get("--tokenizer-type") == "NullTokenizer":
        vocab = int(model_args["--vocab-size"])  # NullTokenizer.vocab_size is --vocab-size
    else:
        vocab = GPT2_BPE_VOCAB
    lay = _layout(run)
    caveats = _caveats(run, _spec(run), lay)
    if lay["cp"] > 1:
        caveats.append("context_parallel_size is not read by the formula")
    if lay["attention"] == "eager":
        caveats.append("unfused attention: no s^2 score/softmax term in the formula")
    if lay["recompute"] != "none" and not (lay["recompute"] == "selective" and lay["sp"]):
        caveats.append(f"recompute {lay['recompute']}: the no-recompute formula is used")
    if lay["precision"] == "fp16-mixed":
        caveats.append("fp16 gradient buffers counted as fp32 (18 bytes per parameter)")
    return {"status": "ok", "inputs": {"model_config_yaml": f"{commit}:{path}",
                                       "flags": flags, "env": env, "WORLD_SIZE": lay["gpus"],
                                       "orig_vocab_size": vocab,
                                       "device_arch_version": ARCH[lay["gpu"]]},
            "caveats": caveats, "padded_vocab_size": _spec(run).vocab_size}


def check_megatron_vocab(jobs: dict, result: dict) -> None:
    """Megatron's padding of the run's vocabulary must give the committed spec's size."""
    for run_id, got in result["runs"].items():
        padded = got["derived_args"]["padded_vocab_size"]
        if padded != jobs[run_id]["padded_vocab_size"]:
            raise SystemExit(f"{run_id}: Megatron pads the vocabulary to {padded}, the "
                             f"committed spec has {jobs[run_id]['padded_vocab_size']}")


def deepspeed_job(run: dict) -> dict:
    lay = _layout(run)
    if lay["zero"] < 2:
        return {"status": "n/a", "reason": f"model-state estimators for ZeRO-2/3 only "
                                           f"(zero {lay['zero']})"}
    if lay["tp"] * lay["pp"] * lay["cp"] > 1:
        return {"status": "n/a", "reason": "data parallel only: no tp, pp or cp"}
    spec = _spec(run)
    counts = spec.counts()
    # the largest single module's parameters (model_to_params: parameters(recurse=False))
    largest = max(counts.embedding, counts.head, spec.hidden_size * spec.ffn_hidden_size,
                  spec.hidden_size * spec.q_size)
    nodes, per_node = (lay["gpus"] // 8, 8) if lay["gpus"] >= 8 else (1, lay["gpus"])
    func = ("estimate_zero3_model_states_mem_needs" if lay["zero"] == 3
            else "estimate_zero2_model_states_mem_needs")
    kwargs: dict[str, Any] = {"total_params": counts.total, "num_gpus_per_node": per_node,
                              "num_nodes": nodes, "cpu_offload": False}
    if lay["zero"] == 3:
        kwargs |= {"largest_layer_params": largest, "cpu_offload_params": False,
                   "zero_init": True}
    caveats = [("model states only (parameters, gradients, optimizer states): no "
                "activations, buffers or allocator"), *_caveats(run, spec, lay)]
    return {"status": "ok", "inputs": {"function": func, "kwargs": kwargs}, "caveats": caveats}


# ---------------------------------------------------------------- workers (subprocesses)

def _worker_llm_analysis(jobs: dict) -> dict:
    """As llm_analysis.analysis.train does, with a GPUConfig object for the run's capacity."""
    import dataclasses
    import importlib.metadata
    import logging

    from llm_analysis.analysis import ActivationRecomputation, DSZeRO, LLMAnalysis
    from llm_analysis.config import (
        GPUConfig,
        ModelConfig,
        ParallelismConfig,
        get_dtype_config_by_name,
        get_gpu_config_by_name,
    )
    from llm_analysis.logger import logger

    logger.setLevel(logging.ERROR)
    keep = ("num_params_total", "batch_size_per_gpu", "max_batch_size_per_gpu",
            "weight_memory_per_gpu", "gradient_memory_per_gpu", "optimizer_state_memory_per_gpu",
            "(weight+op_state+grad)_memory_per_gpu", "activation_memory_per_gpu",
            "activation_memory_embedding_output_per_gpu",
            "(weight+op_state+grad+act)_memory_per_gpu", "memory_left_per_gpu")
    out = {}
    for run_id, inputs in jobs.items():
        gpu = dict(inputs["gpu_config"])
        base = dataclasses.asdict(get_gpu_config_by_name(gpu.pop("base")))
        analysis = LLMAnalysis(ModelConfig(**inputs["model_config"]), GPUConfig(**(base | gpu)),
                               get_dtype_config_by_name(inputs["dtype_name"]),
                               ParallelismConfig(**inputs["parallelism_config"]))
        kwargs = dict(inputs["training"])
        kwargs["activation_recomputation"] = ActivationRecomputation(
            kwargs["activation_recomputation"])
        kwargs["ds_zero"] = DSZeRO(kwargs["ds_zero"])
        try:
            summary = analysis.training(**kwargs)
        except AssertionError as err:  # its only way of refusing a configuration
            out[run_id] = {"status": "refused", "error": f"AssertionError: {err}"}
            continue
        out[run_id] = {"status": "ok", "outputs": {k: summary[k] for k in keep}}
    return {"version": importlib.metadata.version("llm-analysis"), "runs": out}


def _worker_megatron(jobs: dict) -> dict:
    import contextlib
    import io
    import typing

    if not hasattr(typing, "override"):  # the checkout uses typing.override (Python 3.12)
        import typing_extensions

        typing.override = typing_extensions.override
    import megatron.training.arguments as margs
    import megatron.training.theoretical_memory_usage as tmu
    from megatron.core.num_microbatches_calculator import (
        get_num_microbatches,
        init_num_microbatches_calculator,
        unset_num_microbatches_calculator,
    )
    from megatron.core.tokenizers.utils.build_tokenizer import vocab_size_with_padding
    from megatron.training.arguments import add_megatron_arguments, parse_args, validate_args

    out = {}
    base_env = dict(os.environ)
    for run_id, inputs in jobs.items():
        os.environ.clear()
        os.environ.update(base_env | inputs["env"], WORLD_SIZE=str(inputs["WORLD_SIZE"]),
                          RANK="0")
        # validate_args asks the GPU for its architecture (tp > 1 or cp > 1; warnings only):
        # answer for the run's GPU, as there is none here
        margs.get_device_arch_version = lambda arch=inputs["device_arch_version"]: arch
        parser = add_megatron_arguments(argparse.ArgumentParser(allow_abbrev=False))
        _, unknown = parser.parse_known_args(inputs["flags"])
        sys.argv = ["pretrain_gpt.py", *inputs["flags"]]
        with contextlib.redirect_stdout(io.StringIO()):
            args = parse_args(ignore_unknown_args=True)
            validate_args(args, {})
        args.padded_vocab_size = vocab_size_with_padding(inputs["orig_vocab_size"], args,
                                                         logging_enabled=False)
        # as megatron/training/global_vars.py set_global_variables
        init_num_microbatches_calculator(
            rank=args.rank, global_batch_size=args.global_batch_size,
            micro_batch_size=args.micro_batch_size,
            data_parallel_size=args.data_parallel_size * getattr(args, "gtp_weight_remat_size", 1),
            decrease_batch_size_if_needed=args.decrease_batch_size_if_needed,
            step_batch_size_schedule=args.step_batch_size_schedule,
            seq_length=args.seq_length)
        num_microbatches = get_num_microbatches()
        unset_num_microbatches_calculator()
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            weights_mb, activation_mb, total_mb = tmu.report_theoretical_memory(
                args, num_microbatches=num_microbatches, verbose=True)
        derived = {k: getattr(args, k) for k in (
            "data_parallel_size", "tensor_model_parallel_size", "pipeline_model_parallel_size",
            "virtual_pipeline_model_parallel_size", "context_parallel_size", "sequence_parallel",
            "recompute_granularity", "use_distributed_optimizer", "num_query_groups",
            "ffn_hidden_size", "kv_channels", "untie_embeddings_and_output_weights",
            "padded_vocab_size", "swiglu", "normalization")}
        out[run_id] = {"status": "ok", "derived_args": derived | {
                           "num_microbatches": num_microbatches},
                       "unknown_flags": unknown,
                       "outputs": {"weight_and_optimizer_mb": weights_mb,
                                   "activation_mb": activation_mb, "total_mb": total_mb},
                       "printed": printed.getvalue().strip().splitlines()}
    return {"runs": out}


def _worker_deepspeed(jobs: dict) -> dict:
    import deepspeed
    from deepspeed.runtime.zero import stage3, stage_1_and_2

    out = {}
    for run_id, inputs in jobs.items():
        module = stage3 if "zero3" in inputs["function"] else stage_1_and_2
        result = getattr(module, inputs["function"])(**inputs["kwargs"])
        names = ("cpu_mem", "gpu_mem", "largest_layer_memory")
        out[run_id] = {"status": "ok", "outputs": dict(zip(names, result))}
    return {"version": deepspeed.__version__, "runs": out}


WORKERS = {"llm-analysis": _worker_llm_analysis, "megatron": _worker_megatron,
           "deepspeed": _worker_deepspeed}


def _worker_main(name: str, jobs_path: str, out_path: str) -> int:
    jobs = json.loads(Path(jobs_path).read_text())
    real_stdout = sys.stdout
    sys.stdout = sys.stderr  # the tools print; keep the result file clean
    try:
        result = WORKERS[name](jobs)
    finally:
        sys.stdout = real_stdout
    import platform

    result["python"] = platform.python_version()
    if "torch" in sys.modules:
        result["torch"] = sys.modules["torch"].__version__
    Path(out_path).write_text(json.dumps(result))
    return 0


def _run_worker(name: str, jobs: dict, pythonpath: list[str]) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([*pythonpath, env.get("PYTHONPATH", "")]).strip(os.pathsep)
    with tempfile.TemporaryDirectory() as tmp:
        jobs_path, out_path = Path(tmp) / "jobs.json", Path(tmp) / "out.json"
        jobs_path.write_text(json.dumps(jobs))
        proc = subprocess.run([sys.executable, __file__, "--worker", name, str(jobs_path),
                               str(out_path)], env=env, capture_output=True, text=True,
                              check=False)
        if proc.returncode != 0:
            raise RuntimeError(f"{name} worker failed:\n{proc.stderr[-4000:]}")
        return json.loads(out_path.read_text())


# ---------------------------------------------------------------- assembling the data file

LLMA_META = {
    "tool": "llm-analysis", "label": "llm-analysis",
    "source": "https://github.com/cli99/llm-analysis (PyPI wheel)",
    "entry": "llm_analysis.analysis.LLMAnalysis(ModelConfig, GPUConfig, "
             "get_dtype_config_by_name('w16a16e16'), ParallelismConfig).training(...), as "
             "llm_analysis.analysis.train builds it",
    "unit_bytes": 1,
    "compared": {"max_allocated": "(weight+op_state+grad+act)_memory_per_gpu",
                 "max_reserved": "(weight+op_state+grad+act)_memory_per_gpu",
                 "allocated_current": "(weight+op_state+grad)_memory_per_gpu"},
    "leaves_out": [("activations of all L layers on every GPU (the first pipeline stage's "
                    "1F1B worst case); no in-flight discount, no interleaving, no context "
                    "parallelism"),
                   "one tied V*h embedding on every pipeline stage",
                   ("no CUDA context, cuBLAS workspace, allocator reserve or fragmentation; "
                    "no step temporaries (fp32 logits, loss, optimizer step)"),
                   "no biases; norms as h weights each (2 h per layer)"],
}
MEGATRON_META = {
    "tool": "Megatron-LM theoretical_memory_usage.py", "label": "Megatron formula",
    "source": "https://github.com/NVIDIA/Megatron-LM",
    "entry": "megatron.training.theoretical_memory_usage.report_theoretical_memory(args, "
             "num_microbatches=get_num_microbatches(), verbose=True), args from "
             "megatron.training.arguments parse_args + validate_args on the run's CI flags",
    "unit_bytes": 1048576,  # NUM_BYTES_IN_MEGABYTE = 1024 * 1024 in the module
    "compared": {"max_allocated": "total_mb", "max_reserved": "total_mb",
                 "allocated_current": "weight_and_optimizer_mb"},
    "leaves_out": [("18 bytes per parameter, or 6 + 12/dp with the distributed optimizer, "
                    "whatever the precision (fp16 gradients counted as fp32)"),
                   ("activations of the first pipeline stage, by the Korthikanti et al. "
                    "formulas: no s^2 attention term for unfused attention, recompute ignored "
                    "unless sequence parallel + selective, no context-parallel division"),
                   ("no CUDA context, cuBLAS workspace, allocator reserve or fragmentation; "
                    "no logits/loss or optimizer-step temporaries beyond a 5% factor")],
}
DEEPSPEED_META = {
    "tool": "DeepSpeed", "label": "DeepSpeed (model states)",
    "source": "https://github.com/deepspeedai/DeepSpeed (PyPI sdist)",
    "entry": "deepspeed.runtime.zero.stage3.estimate_zero3_model_states_mem_needs (no offload, "
             "zero_init) / stage_1_and_2.estimate_zero2_model_states_mem_needs",
    "unit_bytes": 1,
    "compared": {"max_allocated": "gpu_mem", "max_reserved": "gpu_mem",
                 "allocated_current": "gpu_mem"},
    "leaves_out": [("everything but model states: no activations, buffers, temporaries, "
                    "CUDA context or allocator"),
                   "data parallelism only (no tp, pp, cp); no ZeRO-0/1 estimator"],
}
ACCELERATE_META = {
    "tool": "accelerate estimate-memory", "label": "accelerate", "status": "not run",
    "reason": "create_empty_model calls verify_on_hub (huggingface_hub model_info) before "
              "building anything, and there is no Hub access here; it reports model size per "
              "dtype with no parallelism, batch or activations, so it expresses none of these "
              "runs",
}


def _assemble(meta: dict, jobs: dict[str, dict], result: dict) -> dict:
    runs = {}
    for run_id, job in jobs.items():
        if job["status"] != "ok":
            runs[run_id] = job
            continue
        got = result["runs"][run_id]
        entry = {"status": got["status"], "inputs": job["inputs"]}
        entry |= {k: v for k, v in got.items() if k != "status"}
        if got["status"] == "ok":
            entry["caveats"] = job["caveats"]
        runs[run_id] = entry
    return meta | {k: v for k, v in result.items() if k != "runs"} | {"runs": runs}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--megatron-lm", default=os.environ.get("MEGATRON_LM"),
                        help="a Megatron-LM git checkout (full history: the runs' CI configs "
                             "are read at their commits)")
    parser.add_argument("--deepspeed-path", default=os.environ.get("DEEPSPEED_PATH"),
                        help="a site directory holding deepspeed (if it is not importable)")
    parser.add_argument("--worker", nargs=3, metavar=("NAME", "JOBS", "OUT"),
                        help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        return _worker_main(*args.worker)

    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    import importlib.util

    runs = json.loads(RUNS.read_text())
    stored = ({e["id"]: e for e in json.loads(OUT.read_text())["estimators"]}
              if OUT.is_file() else {})
    estimators = []

    def add(est_id: str, meta: dict, available: str | None, make_job, pythonpath: list[str],
            extra: dict | None = None, check=None) -> None:
        if available is not None:
            if est_id not in stored:
                raise SystemExit(f"{est_id}: {available}, and nothing is stored for it")
            print(f"{est_id}: {available}; keeping the stored results")
            estimators.append(stored[est_id])
            return
        jobs = {run["id"]: make_job(run) for run in runs}
        todo = {k: j["inputs"] for k, j in jobs.items() if j["status"] == "ok"}
        result = _run_worker(est_id, todo, pythonpath)
        if check is not None:
            check(jobs, result)
        entry = {"id": est_id} | _assemble(meta, jobs, result) | (extra or {})
        estimators.append(entry)
        ok = sum(r["status"] == "ok" for r in entry["runs"].values())
        print(f"{est_id}: {ok} of {len(runs)} runs estimated")

    has_llma = importlib.util.find_spec("llm_analysis") is not None
    add("llm-analysis", LLMA_META, None if has_llma else "llm_analysis is not importable",
        llm_analysis_job, [])

    checkout = Path(args.megatron_lm).expanduser() if args.megatron_lm else None
    reason = None
    if checkout is None:
        reason = "no Megatron-LM checkout given (--megatron-lm or MEGATRON_LM)"
    elif not (checkout / MEGATRON_FILE).is_file():
        reason = f"{checkout / MEGATRON_FILE} does not exist"
    extra = None
    if reason is None:
        git = ["git", "-C", str(checkout)]
        commit = subprocess.run([*git, "rev-parse", "HEAD"], capture_output=True, text=True,
                                check=True).stdout.strip()
        dirty = subprocess.run([*git, "status", "--porcelain", "--", MEGATRON_FILE],
                               capture_output=True, text=True, check=True).stdout.strip()
        if dirty:
            raise SystemExit(f"{checkout / MEGATRON_FILE} has local changes")
        date = subprocess.run([*git, "show", "-s", "--format=%cI", commit], capture_output=True,
                              text=True, check=True).stdout.strip()
        extra = {"version": f"commit {commit} ({date})"}
    add("megatron", MEGATRON_META, reason, lambda run: megatron_job(run, checkout),
        [str(checkout)] if checkout else [], extra, check_megatron_vocab)

    ds_path = [args.deepspeed_path] if args.deepspeed_path else []
    has_ds = bool(ds_path) or importlib.util.find_spec("deepspeed") is not None
    add("deepspeed", DEEPSPEED_META, None if has_ds else "deepspeed is not importable",
        deepspeed_job, ds_path)
    estimators.append({"id": "accelerate"} | ACCELERATE_META)

    data = {"generated_by": "python benchmarks/other_estimators.py", "estimators": estimators}
    OUT.write_text(json.dumps(data, indent=1, sort_keys=False) + "\n")
    print(f"wrote {OUT.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

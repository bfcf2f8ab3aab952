"""Held-out Megatron-LM functional tests: writes the Megatron part of
``benchmarks/data/heldout_runs.json`` and copies each test's ``model_config.yaml`` as it is
under ``benchmarks/data/heldout/megatron/``.

Held out means: not one of the runs in ``benchmarks/data/published_runs.json`` (which memplan's
Megatron mechanisms were checked against), and described only by the trainer's own settings:
the test's ``model_config.yaml``, read by ``memplan estimate --megatron-args FILE`` as written,
with the GPU count and GPU of the CI recipe that runs it. Nothing about a run is written by
hand apart from the selection below and its notes.

Selection (``CASES``): the functional tests under ``tests/functional_tests/test_cases/`` whose
``golden_values_dev_dgx_h100.json`` logs ``mem-max-allocated-bytes``, run by the 8-GPU H100
recipes ``tests/test_utils/recipes/h100/{gpt,moe}.yaml`` (``nodes: 1``, ``gpus: 8``), whose
arguments use a flag of ``ISSUE_FLAGS`` (Megatron features memplan's Megatron reader had
refused or read as holding no memory), one test per distinct memory-relevant argument set.
``EXCLUDED`` lists the other tests with those flags and why each is left out.

The measured value is ``mem-max-allocated-bytes`` at step 10 (as in the published runs: the
peak is reached at step 2 and is flat after it, before any checkpoint save or resume), logged
by rank world_size - 1, the last pipeline stage (megatron/training/training.py
training_log, memory logged by the rank holding the TensorBoard writer).

    python benchmarks/heldout_megatron.py --megatron-lm ~/src/Megatron-LM
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "benchmarks" / "data" / "heldout_runs.json"
CONFIGS = ROOT / "benchmarks" / "data" / "heldout" / "megatron"
CASES_DIR = "tests/functional_tests/test_cases"
GOLDEN = "golden_values_dev_dgx_h100.json"
REPO_URL = "https://github.com/NVIDIA/Megatron-LM/blob"
STEP = "10"
# recipe per test family: both say nodes: 1, gpus: 8 (spec), and no product overrides them
RECIPES = {"gpt": "tests/test_utils/recipes/h100/gpt.yaml",
           "moe": "tests/test_utils/recipes/h100/moe.yaml"}
GPUS, GPU = 8, "h100-sxm"  # dgx_h100: 8x H100 SXM 80GB

ISSUE_FLAGS = ("--cross-entropy-loss-fusion", "--defer-embedding-wgrad-compute",
               "--expert-tensor-parallel-size", "--moe-router-dtype", "--mtp-num-layers",
               "--num-distributed-optimizer-instances",
               "--account-for-embedding-in-pipeline-split",
               "--account-for-loss-in-pipeline-split", "--use-megatron-fsdp", "--qk-layernorm",
               "--multi-latent-attention", "--grad-reduce-in-bf16",
               "--num-layers-per-virtual-pipeline-stage",
               "--num-virtual-stages-per-pipeline-rank", "--fp8-format", "--fp8-recipe",
               "--fp8-param-gather")

# family/test case: a note on what it runs (the flags themselves are read from its config)
CASES = {
    "gpt/gpt3_mcore_te_tp2_pp2_cross_entropy_loss_fusion": "vocab-parallel loss fused "
    "(native implementation)",
    "gpt/gpt3_mcore_te_tp2_pp2_cp2_etp4_dp_last": "a dense model with "
    "--expert-tensor-parallel-size 4 (no experts: Megatron builds no expert layers)",
    "gpt/gpt3_mcore_te_tp2_pp2_mla": "multi-latent attention",
    "gpt/gpt3_mcore_te_tp2_pp2_resume_torch_dist_defer_embedding_wgrad_compute": "the output "
    "layer's weight gradient deferred to the step's end",
    "gpt/gpt3_mcore_te_tp2_pp1_resume_torch_dist_multi_dist_optimizer_instances": "two "
    "distributed-optimizer instances",
    "gpt/gpt3_mcore_te_tp1_pp4_vp2_account_for_embedding_loss_in_pipeline_split": "interleaved "
    "schedule with the embedding and the loss counted as layers of the split",
    "gpt/gpt3_mcore_te_tp4_pp1_resume_torch_dist_qk_layernorm_test_mode": "QK layernorm",
    "gpt/gpt3_mcore_te_tp2_zp_z3_resume_fsdp_dtensor": "Megatron FSDP (ZeRO-3)",
    "moe/gpt3_mcore_te_tp2_pp2_ep4_etp1_memory_speed": "MoE with MLA + QK layernorm, fp32 "
    "router, MTP, fused loss, interleaved schedule",
    "moe/gpt3_moe_mcore_te_tp4_ep2_etp2_pp2_resume_torch_dist_dist_optimizer": "MoE, etp 2 "
    "under tp 4, fp32 router, distributed optimizer",
    "moe/gpt3_mcore_te_tp2_pp1_te_8experts_etp1_ep4": "MoE, etp 1 under tp 2",
    "moe/gpt3_mcore_te_tp2_pp1_te_a2a_ovlp_8experts_etp1_ep4": "MoE, etp 1 under tp 2, "
    "all-to-all dispatcher with expert-parallel communication overlap",
    "moe/gpt3_mcore_te_tp2_pp1_resume_torch_dist_te_8experts2parallel_multi_dist_optimizer_"
    "instances": "MoE with two distributed-optimizer instances",
    "moe/gpt3_moe_mcore_te_ep8_resume_torch_dist_dist_optimizer": "MoE, ep 8, fp32 router",
    "moe/gpt3_mcore_tp2_pp2_ep2_etp2_te_4experts2parallel": "MoE, etp 2 under tp 4",
    "moe/gpt3_mcore_te_tp2_zp_z3_resume_torch_dist_te_8experts2parallel_top2router": "MoE "
    "under Megatron FSDP",
    "moe/deepseek_proxy_fsdp_ep2_fsdp2_ep_overlap": "DeepSeek proxy (MLA, MoE) under Megatron "
    "FSDP with two optimizer instances",
    "moe/gpt3_moe_mcore_te_tp2_pp2_ep4_etp1_fine_grained_offloading": "MoE with MLA, MTP and "
    "fine-grained activation offloading, a custom pipeline layout",
    "moe/gpt3_moe_mcore_te_tp2_pp2_ep4_etp1_no_mtp_no_a2a_ovlp_fine_grained_offloading": "as "
    "above without MTP",
    "gpt/gpt3_weekly_mcore_tp2_pp2_current_scaling_native_fp8_tp_pp_sp_tp_overlap": "fp8 "
    "(Transformer Engine, current scaling) with fp8 parameters, SP with TP communication "
    "overlap (a weekly test of recipes/h100/gpt.yaml)",
    "gpt/gpt3_weekly_mcore_tp4_cp2_current_scaling_native_fp8_tp_sp_cp_tp_overlap": "fp8 "
    "(Transformer Engine, current scaling) with fp8 parameters, SP and CP (a weekly test of "
    "recipes/h100/gpt.yaml)",
}

EXCLUDED = {
    "gpt/gpt3_mcore_te_tp2_pp2_resume_torch_dist_cross_entropy_loss_fusion": "the same "
    "memory-relevant arguments and step-10 value as gpt3_mcore_te_tp2_pp2_cross_entropy_loss_"
    "fusion (differs in checkpoint resume after step 50)",
    "gpt/gpt3_mcore_te_tp2_pp2_cp2_etp4_nondeterministic_dp_last": "differs from "
    "gpt3_mcore_te_tp2_pp2_cp2_etp4_dp_last only in NVTE_ALLOW_NONDETERMINISTIC_ALGO",
    "gpt/gpt3_mcore_te_tp2_pp2_cp2_etp4_calculate_per_token_loss_dp_last": "the same step-10 "
    "value as gpt3_mcore_te_tp2_pp2_cp2_etp4_dp_last, plus --calculate-per-token-loss",
    "gpt/gpt3_mcore_te_tp2_pp2_cp2_etp4_calculate_per_token_loss_nondeterministic_dp_last":
    "a variant of the one above",
    "moe/gpt3_mcore_tp2_pp2_ep2_etp2_te_4experts2parallel_dp_last": "differs from "
    "gpt3_mcore_tp2_pp2_ep2_etp2_te_4experts2parallel only in rank order "
    "(--use-tp-pp-dp-mapping); the same step-10 value",
    "moe/gpt3_mcore_te_tp2_pp2_ep4_etp1_selective_recompute_experimental": "commented out in "
    "tests/test_utils/recipes/h100/moe.yaml: its golden values are not from a current run",
    "moe/gpt3_mcore_te_tp2_pp2_ep4_etp1_mtp_resume_torch_dist_fp8": "fp8 training of MoE "
    "experts (memplan refuses fp8 with MoE layers by name); commented out in the recipe: its "
    "golden values are not from a current run",
    "moe/gpt3_mcore_te_tp2_pp2_ep4_etp1_resume_torch_dist_attn_cudagraph": "fp8 training of "
    "MoE experts (refused by name) and CUDA graphs",
    "moe/gpt3_moe_mcore_te_tp4_ep2_etp2_pp2_scoped_cudagraph": "fp8 training of MoE experts "
    "(refused by name) and CUDA graphs; its H100 memory values are not among the test's "
    "metrics (commented out in its model_config.yaml)",
    "moe/gpt3_moe_mcore_te_ep8_resume_torch_dist_muon": "the Muon optimizer (outside the "
    "flags checked; memplan models adam and sgd)",
    "moe/gpt3_moe_mcore_te_ep8_resume_torch_dist_dist_muon": "the Muon optimizer",
    "moe/gpt3_moe_mcore_te_ep8_resume_torch_dist_dist_muon_param_layout": "the Muon optimizer",
    "mixtral/mixtral_8x7b_tp1pp4ep8vpp8_release": "a release test: no recipe in the "
    "repository says its GPU count",
    "mixtral/deepseekv3_proxy_flex_tp1pp4emp16etp1cp1_release": "a release test: no recipe in "
    "the repository says its GPU count",
    "mixtral/deepseekv3_proxy_flex_tp1pp4emp16etp1cp1_release_sm": "a release test: no recipe "
    "in the repository says its GPU count",
    "gpt/gpt3_15b_8t_release_sm_gb200": "a release test (for GB200, by its name): no recipe in "
    "the repository says its GPU count",
}


def git(checkout: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(checkout), *args], check=True,
                          capture_output=True, text=True).stdout


def model_args(text: str) -> dict[str, str]:
    """The MODEL_ARGS block's flags and their values as text (enough for the selection and the
    quote; memplan's own reader reads the file)."""
    out, inside = {}, False
    for line in text.splitlines():
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        if not line.startswith((" ", "\t")):
            inside = line.strip() == "MODEL_ARGS:"
            continue
        if inside:
            flag, _, value = line.split(" #")[0].strip().partition(":")
            out[flag] = value.strip()
    return out


def record(checkout: Path, case: str, note: str) -> dict:
    family, name = case.split("/")
    golden_path = f"{CASES_DIR}/{case}/{GOLDEN}"
    commit = git(checkout, "log", "-1", "--format=%H", "HEAD", "--", golden_path).strip()
    golden = json.loads(git(checkout, "show", f"{commit}:{golden_path}"))
    values = golden["mem-max-allocated-bytes"]["values"]
    config_text = git(checkout, "show", f"{commit}:{CASES_DIR}/{case}/model_config.yaml")
    config_file = CONFIGS / f"{name}.yaml"
    config_file.write_text(config_text)
    args = model_args(config_text)
    flags = [f for f in ISSUE_FLAGS if f in args and args[f].lower() != "false"]
    shown = ", ".join(f"{f} {args[f]}" for f in flags)
    measured = int(values[STEP])
    return {
        "id": f"megatron-ci/{name}",
        "source": (f"{REPO_URL}/{commit}/{golden_path} (config: {REPO_URL}/{commit}/"
                   f"{CASES_DIR}/{case}/model_config.yaml)"),
        "quote": (f"{GOLDEN} \"mem-max-allocated-bytes\" step {STEP}: {values[STEP]}; step 1: "
                  f"{values['1']}; model_config.yaml: {shown}; recipe {RECIPES[family]}: "
                  f"nodes 1, gpus {GPUS}"),
        "what": ("max allocated: torch.cuda.memory_stats()['allocated_bytes.all.peak'] logged "
                 "as mem-max-allocated-bytes by rank world_size-1 (the last pipeline stage)"),
        "rank": "last",
        "quantity": "max_allocated",
        "measured_bytes": measured,
        "unit_note": "bytes, as logged by torch.cuda.memory_stats (no unit conversion)",
        "framework": "megatron",
        "trainer_settings": {"megatron_args": str(config_file.relative_to(ROOT)),
                             "gpus": GPUS, "gpu": GPU},
        "flags": flags,
        "notes": note,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--megatron-lm", type=Path, required=True,
                        help="a Megatron-LM git checkout (its history is read, not its tree)")
    args = parser.parse_args(argv)
    head = git(args.megatron_lm, "rev-parse", "HEAD").strip()
    CONFIGS.mkdir(parents=True, exist_ok=True)
    data = json.loads(OUT.read_text()) if OUT.is_file() else {}
    runs = [r for r in data.get("runs", []) if r["framework"] != "megatron"]
    runs += [record(args.megatron_lm, case, note) for case, note in CASES.items()]
    data.update({
        "megatron_lm_commit": head,
        "runs": runs,
        "excluded": {**{k: v for k, v in data.get("excluded", {}).items()
                        if not k.startswith(("gpt/", "moe/", "mixtral/"))}, **EXCLUDED},
    })
    OUT.write_text(json.dumps(data, indent=1) + "\n")
    print(f"wrote {OUT.relative_to(ROOT)}: {len(runs)} runs")
    return 0


if __name__ == "__main__":
    sys.exit(main())

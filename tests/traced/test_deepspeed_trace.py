"""DeepSpeed's own ZeRO-2 engine against memplan's deepspeed preset, traced on CPU.

Each case runs ``deepspeed.initialize`` on a transformers Llama cut to two layers
(tests/traced/hf_configs.py) on the last of two ranks of the fake process group, with
DeepSpeed's CPU accelerator, and steps it as the Trainer does (``memplan.profile.
deepspeed_trace``); every phase peak of the first step and of the steady state must be within
1% of memplan's estimate, parameters and optimizer states to the byte. A case runs in a
process of its own (DeepSpeed keeps its process groups in module globals).

Versions traced: deepspeed 0.19.8, transformers 5.3.0, torch 2.13 (CPU). The cases skip where
deepspeed is not installed (it is not in the test extra: its source build needs torch first,
pip install --no-build-isolation deepspeed==0.19.8).
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytest.importorskip("deepspeed")
pytest.importorskip("transformers")

from hf_configs import LLAMA3_TOY, hf  # tests/traced/hf_configs.py

from memplan.model.deepspeed_zero import estimate_zero2, estimate_zero3

TOY = hf("Meta-Llama-3-8B", **LLAMA3_TOY)


def _trace(dp: int = 2, **options) -> dict:
    case = dict(library="deepspeed", name="llama3", config=TOY, recipe="bf16-mixed",
                micro_batch_size=1, seq_len=64, dp=dp, options=options)
    out = subprocess.run([sys.executable, "-m", "memplan.profile.deepspeed_trace",
                          json.dumps(case)], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("options", [
    # every weight fits the bucket; the first reduce (the last layer's) makes the partition
    dict(reduce_bucket_size=300_000),
    # two buckets (overlap_comm)
    dict(reduce_bucket_size=300_000, overlap_comm=True),
    # DeepSpeed's default bucket, 5e8 elements (1e9 B): the whole model fits, the partition
    # is made at the backward's epilogue
    dict(),
    # two micro-batches per step: the second's backward makes a new partition beside the
    # accumulated one (stage_1_and_2.py independent_gradient_partition_epilogue adds it into
    # all_grad_tensors)
    dict(reduce_bucket_size=300_000, accumulation=2),
    # one rank: its partition is the whole model
    dict(reduce_bucket_size=300_000, dp=1),
], ids=["bucket-3e5", "overlap", "bucket-default", "accumulation-2", "one-rank"])
def test_zero2_phase_peaks_within_one_percent(options: dict) -> None:
    c = _trace(**options)
    diff = c["diff"]
    assert diff["params_bytes"]["bytes"] == 0
    assert diff["optimizer_bytes"]["bytes"] == 0
    # the partition is a whole number of the flat buffer's elements of the parameters it
    # overlaps (their numel, stage_1_and_2.py copy_grads_in_partition): 128 elements more here
    assert abs(diff["grads_bytes"]["pct"]) < 0.02
    for step in ("first_step", "steady"):
        for phase in ("forward", "backward", "optimizer"):
            assert abs(diff[f"{step}.{phase}_bytes"]["pct"]) <= 1.0, (step, phase, diff)


# The kept gradient is counted (memplan.model.deepspeed_zero.weight_grads_at: the down
# projection's beside the up projection's, 917,504 B, as traced); what is missing at that
# instant is one T x f and one T x h gradient of the layer's own (114,688 + 32,768 =
# 147,456 B, traced 147,336 B): the gate branch's gradient waits while the up projection's
# backward runs, which memplan's "mlp_in" moment (memplan/model/mlp.py) does not hold. Without
# a kept gradient that moment is not the peak (the other cases, tests/traced/test_frameworks.py).
_KEPT = ("a bucket smaller than the MLP weights: the down projection's gradient is kept to the "
         "next hook (extra_large_param_to_reduce), which makes the up projection's backward the "
         "peak, where memplan's mlp_in moment lacks the gate branch's T x f gradient and a "
         "T x h one (147,456 B)")


@pytest.mark.xfail(strict=True, reason=_KEPT + "; measured -1.07% at step 1's backward")
@pytest.mark.parametrize("bucket", [100_000, 65_536], ids=["bucket-1e5", "trainer-auto-h2"])
def test_zero2_bucket_smaller_than_a_weight(bucket: int) -> None:
    """1e5 elements, and hidden^2 = 65,536 (the Trainer's "auto"): traced 13,774,288 B and
    13,705,360 B at step 1's backward, estimated 13,626,952 B and 13,558,024 B (-1.07%)."""
    c = _trace(reduce_bucket_size=bucket)
    assert abs(c["diff"]["first_step.backward_bytes"]["pct"]) <= 1.0


def test_estimators_reproduced_exactly() -> None:
    """memplan.model.deepspeed_zero's estimators against DeepSpeed's own functions on a grid."""
    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs
    from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs

    for p in (124_439_808, 6_738_415_616, 70_553_706_496):
        for gpus, nodes in ((1, 1), (8, 1), (8, 4), (3, 1)):
            for off in (True, False):
                ours = estimate_zero2(p, gpus, nodes, cpu_offload=off)
                theirs = estimate_zero2_model_states_mem_needs(p, gpus, nodes, cpu_offload=off)
                assert (ours.cpu_bytes, ours.gpu_bytes) == theirs
                for off_p in (True, False):
                    for init in (True, False):
                        big = p // 50
                        assert tuple(estimate_zero3(p, big, gpus, nodes, off, off_p, init)) == (
                            estimate_zero3_model_states_mem_needs(p, big, gpus, nodes, off,
                                                                  off_p, init))

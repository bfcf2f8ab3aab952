"""Where a job died, from the traceback printed with its out-of-memory error.

The tracebacks are copied as users pasted them in GitHub issues (prefixes, layouts and
paths as printed), each citing its issue; a few are cut to the frames that matter, marked.
Each expected phase is the one the cited framework function runs in (the rule's source).
"""

from __future__ import annotations

import pytest

from memplan.diagnose import diagnose
from memplan.diagnose.fixes import addresses
from memplan.diagnose.traceback import died_in, phase_of_frames, traceback_blocks, Frame

# huggingface/trl#2776 (turn 34): torch 2.4/2.5 AdamW's foreach step, launcher prefixes
TRL_2776 = """[rank0]:   File "/home/export/base/sc100010/sc100010/.conda/envs/torch/lib/python3.10/site-packages/torch/optim/optimizer.py", line 487, in wrapper
[rank0]:     out = func(*args, **kwargs)
[rank0]:   File "/home/export/base/sc100010/sc100010/.conda/envs/torch/lib/python3.10/site-packages/torch/optim/optimizer.py", line 91, in _use_grad
[rank0]:     ret = func(self, *args, **kwargs)
[rank0]:   File "/home/export/base/sc100010/sc100010/.conda/envs/torch/lib/python3.10/site-packages/torch/optim/adamw.py", line 220, in step
[rank0]:     adamw(
[rank0]:   File "/home/export/base/sc100010/sc100010/.conda/envs/torch/lib/python3.10/site-packages/torch/optim/optimizer.py", line 154, in maybe_fallback
[rank0]:     return func(*args, **kwargs)
[rank0]:   File "/home/export/base/sc100010/sc100010/.conda/envs/torch/lib/python3.10/site-packages/torch/optim/adamw.py", line 782, in adamw
[rank0]:     func(
[rank0]:   File "/home/export/base/sc100010/sc100010/.conda/envs/torch/lib/python3.10/site-packages/torch/optim/adamw.py", line 606, in _multi_tensor_adamw
[rank0]:     exp_avg_sq_sqrt = torch._foreach_sqrt(device_exp_avg_sqs)
[rank0]: torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 130.00 MiB. GPU 0 has a total capacity of 94.99 GiB of which 87.19 MiB is free."""

# msakarvadia/AttentionLens#25: torch.optim.Adam's foreach step, the 1.13/2.0 message
ATTENTIONLENS_25 = """ERROR:  File "/home/mansisak/.conda/envs/attnlens/lib/python3.10/site-packages/torch/optim/adam.py", line 505, in _multi_tensor_adam
    exp_avg_sq_sqrt = torch._foreach_sqrt(device_exp_avg_sqs)
torch.cuda.OutOfMemoryError: CUDA out of memory. Tried to allocate 246.00 MiB (GPU 3; 39.59 GiB total capacity; 37.60 GiB already allocated; 99.69 MiB free; 38.17 GiB reserved in total by PyTorch) If reserved memory is >> allocated memory try setting max_split_size_mb to avoid fragmentation.  See documentation for Memory Management and PYTORCH_CUDA_ALLOC_CONF"""

# bmaltais/kohya_ss#1048: rich's boxed traceback, a Windows path
KOHYA_1048 = """│ C:\\kohya_ss\\venv\\lib\\site-packages\\torch\\optim\\adamw.py:566 in _multi_tensor_adamw               │
│                                                                                                  │
│   563 │   │   │   else:                                                                          │
│   564 │   │   │   │   exp_avg_sq_sqrt = torch._foreach_sqrt(device_exp_avg_sqs)                  │
│ ❱ 566 │   │   │   │   denom = torch._foreach_add(exp_avg_sq_sqrt, eps)                           │"""

# jianzhnie/LLamaTuner#4 (turn 4): rich's layout with the function on the next line
LLAMATUNER_4 = """│ /home/ub2004/anaconda3/lib/python3.10/site-packages/transformers/modeling_utils.py:698 in        │
│ _load_state_dict_into_meta_model                                                                 │
│                                                                                                  │
│ ❱  698 │   │   │   set_module_tensor_to_device(model, param_name, param_device, **set_module_kw  │"""

# hiyouga/LlamaFactory#7781: loading, rank 3 died; rank 0's traceback follows
LLAMAFACTORY_7781 = """[rank3]:   File "/root/.local/lib/python3.10/site-packages/transformers/modeling_utils.py", line 4399, in from_pretrained
[rank3]:     ) = cls._load_pretrained_model(
[rank3]:   File "/root/.local/lib/python3.10/site-packages/transformers/modeling_utils.py", line 4833, in _load_pretrained_model
[rank3]:     disk_offload_index, cpu_offload_index = _load_state_dict_into_meta_model(
[rank3]:   File "/root/.local/lib/python3.10/site-packages/torch/utils/_contextlib.py", line 116, in decorate_context
[rank3]:     return func(*args, **kwargs)
[rank3]:   File "/root/.local/lib/python3.10/site-packages/transformers/modeling_utils.py", line 787, in _load_state_dict_into_meta_model
[rank3]:     param = param[...]
[rank3]: torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 270.00 MiB. GPU 3 has a total capacity of 23.65 GiB of which 208.06 MiB is free. Process 2271798 has 23.44 GiB memory in use. Of the allocated memory 22.87 GiB is allocated by PyTorch, and 6.23 MiB is reserved by PyTorch but unallocated. If reserved but unallocated memory is large try setting PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation.  See documentation for Memory Management  (https://pytorch.org/docs/stable/notes/cuda.html#environment-variables)
[rank0]: Traceback (most recent call last):
[rank0]:   File "/root/filesystem/LOCAL/LLaMA-Factory/src/train.py", line 28, in <module>"""

# ByteDance-Seed/Bagel#157: FSDP's full state dict while saving (cut after the last frame)
BAGEL_157 = """[rank7]: Traceback (most recent call last):
[rank7]:   File "/fsx/kuoalle/dev/Bagel/pretrain_unified_navit.py", line 729, in main
[rank7]:     FSDPCheckpoint.fsdp_save_ckpt(
[rank7]:   File "/fsx/kuoalle/dev/Bagel/train/fsdp_utils.py", line 109, in fsdp_save_ckpt
[rank7]:     ema_state_dict = ema_model.state_dict()
[rank7]:                      ^^^^^^^^^^^^^^^^^^^^^^
[rank7]:   File "/opt/conda/lib/python3.11/site-packages/torch/nn/modules/module.py", line 2215, in state_dict
[rank7]:     hook(self, prefix, keep_vars)
[rank7]:   File "/opt/conda/lib/python3.11/site-packages/torch/utils/_contextlib.py", line 116, in decorate_context
[rank7]:     return func(*args, **kwargs)
[rank7]:            ^^^^^^^^^^^^^^^^^^^^^
[rank7]:   File "/opt/conda/lib/python3.11/site-packages/torch/distributed/fsdp/_state_dict_utils.py", line 782, in _pre_state_dict_hook
[rank7]:     _pre_state_dict_hook_fn[fsdp_state._state_dict_type](
[rank7]:   File "/opt/conda/lib/python3.11/site-packages/torch/distributed/fsdp/_state_dict_utils.py", line 303, in _full_pre_state_dict_hook
[rank7]:     _common_unshard_pre_state_dict_hook("""

# huggingface/transformers#24658: IPython's layout (File PATH:N, in Class.method(args)),
# DeepSpeed building the ZeRO-3 optimizer (cut to two frames)
TRANSFORMERS_24658 = """File /home/pc/miniconda3/envs/Transformers/lib/python3.11/site-packages/deepspeed/runtime/engine.py:1184, in DeepSpeedEngine._configure_optimizer(self, client_optimizer, model_parameters)
   1181 optimizer_wrapper = self._do_optimizer_sanity_check(basic_optimizer)
File /home/pc/miniconda3/envs/Transformers/lib/python3.11/site-packages/deepspeed/runtime/engine.py:1474, in DeepSpeedEngine._configure_zero_optimizer(self, optimizer)
   1472         log_dist(f'Creating {model_dtype} ZeRO stage {zero_stage} optimizer', ranks=[0])"""

# pytorch/pytorch#18853 (a comment): a forward's ReLU, then a second exception while handling
PYTORCH_18853 = """Traceback (most recent call last):
  File "memtestcase.py", line 78, in fwbw
    yhat = model(X)
  File "/private/home/roller/.conda/envs/retry-20190211/lib/python3.7/site-packages/torch/nn/modules/module.py", line 489, in __call__
    result = self.forward(*input, **kwargs)
  File "/private/home/roller/.conda/envs/retry-20190211/lib/python3.7/site-packages/torch/nn/modules/activation.py", line 50, in forward
    return F.threshold(input, self.threshold, self.value, self.inplace)
  File "/private/home/roller/.conda/envs/retry-20190211/lib/python3.7/site-packages/torch/nn/functional.py", line 840, in threshold
    result = _VF.threshold(input, threshold, value)
RuntimeError: CUDA out of memory. Tried to allocate 1024.00 MiB (GPU 0; 15.90 GiB total capacity; 14.25 GiB already allocated; 991.56 MiB free; 607.00 KiB cached)

During handling of the above exception, another exception occurred:

Traceback (most recent call last):
  File "memtestcase.py", line 155, in <module>
    main()"""


@pytest.mark.parametrize("text, phase, frame, rank", [
    (TRL_2776, "optimizer step", "torch/optim/adamw.py:606 in _multi_tensor_adamw", 0),
    (ATTENTIONLENS_25, "optimizer step", "torch/optim/adam.py:505 in _multi_tensor_adam", None),
    (KOHYA_1048, "optimizer step", "torch/optim/adamw.py:566 in _multi_tensor_adamw", None),
    (LLAMATUNER_4, "loading",
     "transformers/modeling_utils.py:698 in _load_state_dict_into_meta_model", None),
    (LLAMAFACTORY_7781, "loading",
     "transformers/modeling_utils.py:787 in _load_state_dict_into_meta_model", 3),
    (BAGEL_157, "checkpoint save",
     "torch/distributed/fsdp/_state_dict_utils.py:303 in _full_pre_state_dict_hook", 7),
    (TRANSFORMERS_24658, "setup",
     "deepspeed/runtime/engine.py:1474 in _configure_zero_optimizer", None),
    (PYTORCH_18853, "forward", "torch/nn/modules/module.py:489 in __call__", None),
    (PYTORCH_18853.replace("/private/home/roller/.conda/envs/retry-20190211/lib/python3.7/"
                           "site-packages/", ""), "forward",
     "torch/nn/modules/module.py:489 in __call__", None),
])
def test_real_tracebacks_name_their_phase(text: str, phase: str, frame: str, rank) -> None:
    """The innermost frame a rule knows names the operation; the phase is that rule's (its
    source in memplan.diagnose.traceback.RULES)."""
    where = died_in(text)
    assert where is not None
    assert (where.phase, where.frame, where.rank) == (phase, frame, rank)


def test_chained_exception_reads_the_first_traceback() -> None:
    """pytorch#18853 prints the forward's traceback, then one raised while handling it: two
    blocks, the first holds the four frames down to functional.py's threshold."""
    blocks = traceback_blocks(PYTORCH_18853)
    assert [len(frames) for _, frames in blocks] == [4, 1]
    assert blocks[0][1][-1].function == "threshold"


def _frames(*pairs: str) -> list[Frame]:
    """Frames innermost first from "path:function" strings."""
    return [Frame(p.split(":")[0], p.split(":")[1]) for p in pairs]


def test_a_collective_takes_the_phase_of_the_frames_around_it() -> None:
    """distributed_c10d.all_reduce under DeepSpeed ZeRO-1/2's average_tensor is the gradient
    reduction (stage_1_and_2.py average_tensor); under nothing known, a bare collective."""
    where = phase_of_frames(_frames(
        "site-packages/torch/distributed/distributed_c10d.py:all_reduce",
        "site-packages/deepspeed/comm/comm.py:all_reduce",
        "site-packages/deepspeed/runtime/zero/stage_1_and_2.py:average_tensor",
        "site-packages/torch/autograd/graph.py:_engine_run_backward"))
    assert (where.phase, where.operation) == ("gradient communication", "an all-reduce")
    bare = phase_of_frames(_frames("torch/distributed/distributed_c10d.py:all_gather_into_tensor"))
    assert bare.phase == "collective communication"


def test_a_forward_inside_backward_is_a_recomputation() -> None:
    """A module's forward under torch/utils/checkpoint.py's unpack_hook inside the backward:
    the backward phase, recomputing a checkpointed forward."""
    where = phase_of_frames(_frames("torch/nn/modules/module.py:_call_impl",
                                    "torch/utils/checkpoint.py:unpack_hook",
                                    "torch/autograd/graph.py:_engine_run_backward"))
    assert where.phase == "backward" and where.operation.startswith("recomputing")


def test_no_known_frame_is_no_phase() -> None:
    assert died_in('  File "train.py", line 3, in <module>\n    main()') is None
    assert died_in("CUDA out of memory. Tried to allocate 2.00 MiB") is None


@pytest.mark.parametrize("phase, change, expected", [
    ("optimizer step", {"optimizer_impl": "fused"}, True),
    ("optimizer step", {"zero": 1}, True),
    ("optimizer step", {"optimizer": "adamw8bit"}, True),
    ("optimizer step", {"recompute": "full"}, False),
    ("gradient communication", {"zero_bucket_numel": 16777216}, True),
    ("gradient communication", {"zero": 1}, False),
    ("gradient communication", {"zero": 2}, True),
    ("loading", {"zero": 3}, True),
    ("loading", {"zero": 2}, False),
    ("forward", {"offload": "activations"}, True),
    ("checkpoint save", {"zero": 3}, False),
])
def test_which_fixes_address_a_phase(phase: str, change: dict, expected: bool) -> None:
    assert addresses(phase, change) is expected


# The issue's example: llama-2-7b (6,738,415,616 parameters) under ZeRO-1 over 8 GPUs, AdamW
# foreach. One fp32 tensor over the rank's optimizer partition: 4 x 6,738,415,616 / 8 =
# 3,369,207,808 B; its segment (2 MiB multiple) 3,370,123,264 B; "3.14 GiB" prints
# 3,371,549,327 B, 1,426,063 B away, inside the message's 5,368,710 B rounding.
ISSUE_OOM = TRL_2776.replace(
    "Tried to allocate 130.00 MiB. GPU 0 has a total capacity of 94.99 GiB of which 87.19 MiB "
    "is free.", "Tried to allocate 3.14 GiB. GPU 0 has a total capacity of 79.10 GiB of which "
    "87.19 MiB is free. Of the allocated memory 75.00 GiB is allocated by PyTorch, and 1.20 GiB "
    "is reserved by PyTorch but unallocated.")


def test_the_optimizer_step_is_explained_and_its_fixes_ranked_first() -> None:
    r = diagnose("llama-2-7b", oom=ISSUE_OOM, gpus=8, zero=1, micro_batch_size=1)
    d = r.diagnosis
    assert d.died_in.phase == "optimizer step" and d.failing_phase == "optimizer"
    kinds = [f.kind for f in d.findings]
    assert kinds[:2] == ["traceback", "request"]
    request = d.findings[1]
    assert request.sizes == {"requested_bytes": 3_371_549_327, "term_bytes": 3_369_207_808}
    fitting = [f for f in r.fixes.ranked if f.fits]
    flags = [f.addresses_failure for f in fitting]
    assert flags == sorted(flags, reverse=True) and flags[0]  # the phase's fixes first
    assert any(f.change == {"optimizer_impl": f.change.get("optimizer_impl")} or
               "zero" in f.change for f in fitting if f.addresses_failure)


def test_a_snapshot_oom_event_names_its_phase(tmp_path, capsys) -> None:
    """A snapshot's "oom" trace entry carries the frames of the failed allocation (innermost
    first, as _record_memory_history records them): here DeepSpeed ZeRO-1/2's average_tensor
    under the autograd engine, so the job died in the gradient communication. The snapshot is
    synthetic, with the keys torch.cuda.memory._snapshot returns (no segments left)."""
    import json
    import pickle

    from memplan.cli import main

    snap = {"segments": [], "device_traces": [[]], "allocator_settings": {},
            "external_annotations": []}
    site = "/usr/lib/python3.12/site-packages/"
    snap["device_traces"][0].append({
        "action": "oom", "device_free": 0, "size": 64 * 2**20, "stream": 0, "time_us": 99,
        "frames": [{"filename": site + "torch/distributed/distributed_c10d.py", "line": 2800,
                    "name": "all_reduce"},
                   {"filename": site + "deepspeed/runtime/zero/stage_1_and_2.py",
                    "line": 1100, "name": "average_tensor"},
                   {"filename": site + "torch/autograd/graph.py", "line": 829,
                    "name": "_engine_run_backward"}]})
    path = tmp_path / "snap.pickle"
    path.write_bytes(pickle.dumps(snap))
    assert main(["diagnose", "-m", "tiny", "--snapshot", str(path), "--trust-pickle",
                 "--no-fixes", "--json"]) == 0
    died = json.loads(capsys.readouterr().out)["died_in"]
    assert (died["phase"], died["operation"], died["frame"]) == (
        "gradient communication", "an all-reduce",
        "torch/distributed/distributed_c10d.py:2800 in all_reduce")


def test_a_job_that_died_loading_is_explained_as_loading() -> None:
    """LlamaFactory#7781 died in _load_state_dict_into_meta_model: the traceback is the cause;
    the step's own findings (its peak phase) are context; the fixes that hold fewer weights
    per GPU (ZeRO-3, TP, PP, quantised or frozen base weights) are the ones marked."""
    r = diagnose("llama-3-8b", oom=LLAMAFACTORY_7781, gpus=4)
    d = r.diagnosis
    assert d.died_in.phase == "loading" and d.died_in.rank == 3
    first = d.findings[0]
    assert first.kind == "traceback" and first.cause and "died while loading" in first.text
    assert not next(f for f in d.findings if f.kind == "dominant").cause
    marked = {f.name for f in r.fixes.ranked if f.addresses_failure}
    assert {"ZeRO stage 3", "TP 2", "PP 2"} <= marked
    assert not any("recompute" in name for name in marked)

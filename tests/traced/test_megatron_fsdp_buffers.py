"""megatron-core 0.16.1's Megatron-FSDP built on CPU: the dtype of its main-gradient buffers
and of the whole buckets a unit's gradients are copied into, against Megatron-LM's --bf16.

``MegatronFSDP`` (megatron/core/distributed/fsdp/src/megatron_fsdp/megatron_fsdp.py) wraps a
two-unit bf16 model on rank 0 of a 4-rank fake process group (collectives return at once),
``optim_grads_params``, on the CPU (its side streams stubbed; DTensor validation, which
moves a tensor to CUDA, skipped). ``_init_fsdp_param_and_grad_buffer`` hands
``ddp_config.grad_reduce_in_fp32`` to ``ParamAndGradBuffer``, whose
``_init_each_parameter_group_buffers`` makes each group's main-gradient buffer; a weight's
``get_main_grad`` (what ``_grad_acc`` copies its gradient into) fetches its unit's whole
bucket in that buffer's dtype. Megatron-LM's ``get_model`` sets grad_reduce_in_fp32 =
accumulate_allreduce_grads_in_fp32, on with --bf16 (arguments.py validate_args): the reader
maps Megatron-FSDP under --bf16 to fp32 main gradients (memplan.config_import.megatron_flags
``_bucket_dtypes``).
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("megatron.core")

import memplan  # noqa: E402
from memplan.config_import import megatron  # noqa: E402

DP, H, FFN = 4, 64, 128


@pytest.fixture
def fake_group(monkeypatch: pytest.MonkeyPatch):
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    import megatron.core.distributed.fsdp.src.megatron_fsdp.param_and_grad_buffer as pgb

    if dist.is_initialized():
        pytest.skip("a process group is already initialised")
    monkeypatch.setattr(pgb, "validate_uneven_dtensor", lambda tensor: None)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "Stream", lambda *a, **k: None)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=DP)
    try:
        yield
    finally:
        dist.destroy_process_group()


class _Unit(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = torch.nn.Linear(H, FFN, bias=False)
        self.down = torch.nn.Linear(FFN, H, bias=False)


def _buffers(grad_reduce_in_fp32: bool) -> list[tuple[torch.dtype, int, int]]:
    """(dtype, shard bytes, whole-bucket bytes) of each unit's main-gradient buffer."""
    from torch.distributed.device_mesh import init_device_mesh

    from megatron.core.distributed.fsdp.src.megatron_fsdp.distributed_data_parallel_config \
        import DistributedDataParallelConfig
    from megatron.core.distributed.fsdp.src.megatron_fsdp.megatron_fsdp import MegatronFSDP
    from megatron.core.distributed.fsdp.src.megatron_fsdp.utils import FSDPDistributedIndex

    index = FSDPDistributedIndex(device_mesh=init_device_mesh("cpu", (DP,), mesh_dim_names=(
        "dp",)), dp_shard_dim="dp")
    model = torch.nn.Sequential(_Unit(), _Unit()).to(torch.bfloat16)
    config = DistributedDataParallelConfig(data_parallel_sharding_strategy="optim_grads_params",
                                           grad_reduce_in_fp32=grad_reduce_in_fp32)
    fsdp = MegatronFSDP(model, index, ddp_config=config, fsdp_unit_modules=[_Unit],
                        device=torch.device("cpu"))
    out = []
    for group in fsdp.param_and_grad_buffer.parameter_groups:
        gbuf = group.main_grad_buffer
        bucket = group.params[0].get_main_grad()  # _grad_acc's target: the unit's bucket
        whole = gbuf.temporary_bucket_allocator.buckets[gbuf.bucket_index.bucket_id].data
        assert bucket.dtype == whole.dtype == gbuf.dtype
        out.append((gbuf.dtype, gbuf.data.nbytes, whole.nbytes))
    return out


@pytest.mark.parametrize(("reduce_fp32", "dtype", "itemsize"), [
    (True, torch.float32, 4), (False, torch.bfloat16, 2)])
def test_megatron_fsdp_main_grads_follow_grad_reduce_in_fp32(fake_group, reduce_fp32: bool,
                                                             dtype: torch.dtype,
                                                             itemsize: int) -> None:
    """Each unit: 2 * 64 * 128 = 16,384 weights. With grad_reduce_in_fp32 its main-gradient
    shard is 16,384 / 4 ranks = 4,096 fp32 elements (16,384 B) and the whole bucket its
    gradients are copied into 16,384 fp32 elements (65,536 B); without it, bf16: 8,192 B
    and 32,768 B. The weights stay bf16 either way."""
    unit = 2 * H * FFN
    assert _buffers(reduce_fp32) == [(dtype, unit // DP * itemsize, unit * itemsize)] * 2


def test_megatron_fsdp_reader_under_bf16() -> None:
    """The same switch as Megatron-LM's --bf16 sets it, through the reader: --bf16 alone
    (grad_reduce_in_fp32 on) gives fp32 main-gradient shards, 4 B per weight of the rank's
    shard, against 2 B with --grad-reduce-in-bf16 (off, --megatron-fsdp-main-grads-dtype
    auto: the weights' bf16)."""
    base = ("--num-layers 2 --hidden-size 256 --num-attention-heads 4 --seq-length 512 "
            "--max-position-embeddings 512 --vocab-size 1000 --tokenizer-type NullTokenizer "
            "--bf16 --use-distributed-optimizer --use-megatron-fsdp")
    grads = {}
    for extra in ("", " --grad-reduce-in-bf16"):
        imp = megatron.read(base + extra, DP)
        stage = memplan.estimate(imp.model, gpus=DP, **imp.inputs).stages[0]
        grads[extra] = stage.grads_bytes
        shard = stage.params_bytes // 2  # bf16 weight shards: the rank's elements
        assert stage.grads_bytes == shard * (2 if extra else 4)
    assert grads[""] == 2 * grads[" --grad-reduce-in-bf16"]

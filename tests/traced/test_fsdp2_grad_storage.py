"""FSDP2's sharded gradients, one storage per unit: torch's own ``fully_shard`` on the CPU.

``foreach_reduce`` (torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py) makes one
``reduce_output`` per unit (on the reduce-scatter stream on a GPU) and sets each parameter's
gradient to a ``torch.as_strided`` view of it, so a unit's gradients share one storage of
the unit's shard in the reduce dtype: what the allocator replay allocates per unit
(``memplan.model.alloc_sequence._unit_gradients``). Rank 0 of a 4-rank fake process group
(collectives return at once; the sizes are real), torchtitan's wrapping (each block, then the
root), bf16 gathered weights, fp32 reduce.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

DP = 4


@pytest.fixture
def fake_group():
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        pytest.skip("a process group is already initialised")
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=DP)
    try:
        yield
    finally:
        dist.destroy_process_group()


class _Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(16)
        self.up = torch.nn.Linear(16, 32, bias=False)
        self.down = torch.nn.Linear(32, 16, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(self.norm(x))))


def test_a_units_sharded_gradients_are_one_reduce_scatter_output(fake_group) -> None:
    """A block: 16 + 16 + 32 x 16 + 16 x 32 = 1,056 elements, each tensor's dim 0 a multiple
    of 4, so 264 elements a rank: one storage of 264 x 4 = 1,056 B. The root (the input and
    output linears, 16 x 8 + 16 + 4 x 16 + 4 = 212 elements): one of 53 x 4 = 212 B."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh("cpu", (DP,))
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), _Block(), _Block(),
                                torch.nn.Linear(16, 4))
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in (model[1], model[2]):
        fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    model(torch.randn(4, 8)).sum().backward()

    def storages(params) -> set[tuple[int, int]]:
        return {(p.grad.to_local().untyped_storage().data_ptr(),
                 p.grad.to_local().untyped_storage().nbytes()) for p in params}

    units = [list(model[1].parameters()), list(model[2].parameters()),
             [*model[0].parameters(), *model[3].parameters()]]
    got = [storages(u) for u in units]
    assert [len(s) for s in got] == [1, 1, 1]
    assert [next(iter(s))[1] for s in got] == [1_056, 1_056, 212]
    assert all(p.grad.dtype == torch.float32 for u in units for p in u)

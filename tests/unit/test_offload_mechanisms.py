"""Offloading beyond ZeRO-Offload: torchao's CPUOffloadOptimizer, FSDP2's CPUOffloadPolicy and
activations saved on the host (``memplan.model.offload``), by hand.

Llama-2-7B has 6,738,415,616 parameters in 32 * 9 + 3 = 291 tensors (per layer q, k, v, o,
gate, up, down and two norms; the embedding, the final norm and the head).
"""

from __future__ import annotations

import pytest

import memplan
from memplan.api import parse_offload
from memplan.errors import MemplanError
from memplan.parallel import Offload, offload_names

N = 6_738_415_616
TENSORS = 291


def test_offload_parses_a_comma_list() -> None:
    """A comma list, a collection or "none"; written back in ``Offload``'s order."""
    both = frozenset({Offload.OPTIMIZER, Offload.ACTIVATIONS})
    assert parse_offload("activations,optimizer") == both
    assert parse_offload(["optimizer", Offload.ACTIVATIONS]) == both
    assert parse_offload("none") == parse_offload("") == frozenset()
    assert offload_names(both) == "optimizer,activations" and offload_names(frozenset()) == "none"
    with pytest.raises(MemplanError, match="offload must be none or a comma list"):
        parse_offload("optimizer,none")


def test_torchao_cpu_offload_optimizer() -> None:
    """bf16-pure AdamW on one GPU without ZeRO: the host holds a bf16 copy of every weight and
    of its gradient and the two bf16 states, 2 + 2 + 2 * 2 = 8 bytes per parameter, and a
    4-byte step count per tensor: 6,738,415,616 * 8 + 291 * 4 = 53,907,326,092. The GPU keeps
    the weights and gradients (2 bytes each per parameter), no states and no foreach
    temporary (the step runs on the host); the optimizer phase holds weights and gradients."""
    base = memplan.estimate("llama-2-7b", precision="bf16-pure")
    off = memplan.estimate("llama-2-7b", precision="bf16-pure", offload="optimizer")
    w = off.worst
    assert w.host_bytes == N * 8 + TENSORS * 4 == 53_907_326_092
    assert (w.params_bytes, w.grads_bytes) == (N * 2, N * 2) == (base.worst.params_bytes,
                                                                  base.worst.grads_bytes)
    assert w.optimizer_bytes == w.optimizer_temp_bytes == 0
    assert w.steady.optimizer == N * 2 + N * 2
    assert base.worst.steady.forward - w.steady.forward == N * 2 * 2  # the two bf16 states


def test_torchao_keeps_small_tensors_on_the_device() -> None:
    """The tiny spec (hidden 64, ffn 176, 2 layers, kv 32, vocabulary 128), fp32: tensors of at
    least 4,096 elements go to the host: per layer q and o (64 * 64 = 4,096 each) and gate, up,
    down (64 * 176 = 11,264 each), the embedding and the head (128 * 64 = 8,192 each): 100,352
    elements in 12 tensors, each with an fp32 copy, gradient and two states (16 bytes) and a
    step count: 100,352 * 16 + 12 * 4 = 1,605,680. k and v (64 * 32 = 2,048), the norms (64)
    and the final norm stay: 8,512 elements in 9 tensors, stepped by a fused AdamW on the
    device, two fp32 states each and a device step count: 8,512 * 8 + 9 * 4 = 68,132."""
    w = memplan.estimate("tiny", precision="fp32", offload="optimizer").worst
    assert w.host_bytes == 100_352 * 16 + 12 * 4 == 1_605_680
    assert w.optimizer_bytes == 8_512 * 8 + 9 * 4 == 68_132
    assert w.optimizer_temp_bytes == 0


def test_fsdp2_cpu_offload_policy() -> None:
    """fsdp-bf16 on 8 GPUs, zero 3: each rank's shard is ceil(6,738,415,616 / 8) =
    842,301,952 parameters; the host holds its fp32 weights (4), fp32 gradients (4, the reduce
    dtype) and fp32 AdamW states (8), and 291 step counts: 842,301,952 * 16 + 291 * 4 =
    13,476,832,396. The GPU holds no weight, gradient or state shard."""
    shard = 842_301_952
    base = memplan.estimate("llama-2-7b", gpus=8, zero=3, precision="fsdp-bf16")
    off = memplan.estimate("llama-2-7b", gpus=8, zero=3, precision="fsdp-bf16", offload="params")
    w = off.worst
    assert w.host_bytes == shard * 16 + TENSORS * 4 == 13_476_832_396
    assert w.params_bytes == w.grads_bytes == w.optimizer_bytes == w.optimizer_temp_bytes == 0
    assert base.worst.params_bytes == shard * 4
    # the same gathered units and reduce-scatter buffers on the GPU
    assert w.sharding_buffers_bytes == base.worst.sharding_buffers_bytes
    # the forward loses the fp32 weight and state shards (4 + 8 bytes per parameter) and the
    # gradient shards kept from step 2 on; forward is where a gradient shard is not alive yet
    # only in step 1
    assert base.worst.first_step.forward - w.first_step.forward == shard * 4
    assert any("CPUOffloadPolicy" in line for line in off.assumptions)


@pytest.mark.parametrize(("kwargs", "message"), [
    (dict(gpus=8, zero=2, offload="params"), "offload params needs zero 3"),
    (dict(gpus=8, zero=3, pp=2, precision="fsdp-bf16", offload="params"),
     r"offload params with pp \(2\) > 1"),
    (dict(gpus=8, zero=3, precision="bf16-mixed", offload="params"),
     "offload params with precision bf16-mixed"),
    (dict(offload="activations", precision="amp-bf16"),
     "offload activations with precision amp-bf16"),
    (dict(gpus=8, zero=3, precision="fsdp-bf16", offload="optimizer"), "--offload params"),
    (dict(offload="activations", attention="eager"), "offload activations with eager attention"),
    (dict(model="gpt2", offload="activations"), r"with a non-gated MLP \(gpt2\)"),
    (dict(model="mixtral-8x7b", gpus=8, ep=8, offload="activations"), "with MoE layers"),
])
def test_refused_by_name(kwargs: dict, message: str) -> None:
    kwargs = dict(kwargs)
    with pytest.raises(MemplanError, match=message):
        memplan.estimate(kwargs.pop("model", "llama-2-7b"), **kwargs)


def test_activations_on_the_host() -> None:
    """The decoder layers' saved tensors leave the GPU: only the embedding's and the head's
    stay (llama-2-7b, bf16-pure, one sequence of 4,096: the ids and targets, 2 * 4,096 * 8 B
    int64, and the final norm, head and loss terms, unchanged). The host holds, per
    micro-batch, what the layers saved without offloading (the layers' part of the base
    estimate's saved activations: everything but the rope tables, embedding and head terms,
    which are listed by name) and every layer weight a matmul saves: 32 layers of 202,383,360
    parameters in bf16 (q, k, v, o 4,096^2 each, gate, up, down 4,096 * 11,008 each, two norms
    of 4,096), 12,952,535,040 bytes."""
    base = memplan.estimate("llama-2-7b", precision="bf16-pure", seq_len=4096)
    off = memplan.estimate("llama-2-7b", precision="bf16-pure", seq_len=4096,
                           offload="activations")
    layer_params = 4 * 4096 ** 2 + 3 * 4096 * 11008 + 2 * 4096
    assert layer_params == 202_383_360
    outside = {name: size for name, size in base.worst.activation_terms
               if not name.startswith(("attn", "mlp"))}
    layers_saved = base.worst.activations_bytes - sum(outside.values())
    rope = sum(size for name, size in outside.items() if name.startswith("rope"))
    assert off.worst.activations_bytes == base.worst.activations_bytes - layers_saved - rope
    assert off.worst.host_activations_bytes == layers_saved + rope + 32 * layer_params * 2
    assert off.worst.host_bytes == off.worst.host_activations_bytes
    assert off.worst.steady.backward < base.worst.steady.backward
    assert off.worst.steady.forward < base.worst.steady.forward

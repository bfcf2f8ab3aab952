"""Megatron-LM's global memory buffer under --transformer-impl local
(``Workload.attention_global_buffer``, ``memplan.model.attention.global_buffer_bytes``): the
core attention's baddbmm input, b * np * s * s elements in the compute dtype, or the
sequence-parallel linears' gathered input, s * b * h, whichever is larger, kept by every stage
from the first forward on. Bytes derived by hand; the traced check is
tests/traced/test_megatron_model.py (megatron-core's local-spec GPTModel)."""

from __future__ import annotations

import pytest

from memplan import api
from memplan.config_import import megatron
from memplan.errors import MemplanError

LLAMA_7B = dict(framework="megatron", attention="eager", seq_len=4096)


def _buffers(**kw) -> tuple[int, int, int]:
    """(buffers, tensor peak, optimizer-phase peak) of stage 0 with the buffer less without."""
    on = api.estimate("llama-7b", attention_global_buffer=True, **kw).stages[0]
    off = api.estimate("llama-7b", **kw).stages[0]
    return (on.buffers_bytes - off.buffers_bytes, on.tensor_peak_bytes - off.tensor_peak_bytes,
            on.steady.optimizer - off.steady.optimizer)


def test_the_scores_buffer_at_a_long_sequence() -> None:
    """llama-7b (32 heads), tp 2, micro-batch 2, seq 4,096, bf16: 2 x 16 x 4,096 x 4,096 x 2 B
    = 1,073,741,824 B, in every phase (made before any peak, kept to the end)."""
    assert _buffers(gpus=8, tp=2, micro_batch_size=2, **LLAMA_7B) == (1_073_741_824,) * 3


def test_the_gathered_input_where_it_is_larger() -> None:
    """tp 8 with sequence parallelism, micro-batch 1, seq 256: the scores' request is
    1 x 4 x 256 x 256 = 262,144 elements, the gathered input 256 x 1 x 4,096 = 1,048,576:
    2,097,152 B in bf16. Without sequence parallelism the scores' 524,288 B."""
    kw = dict(LLAMA_7B, seq_len=256, gpus=8, tp=8, micro_batch_size=1)
    assert _buffers(sequence_parallel=True, **kw)[0] == 2_097_152
    assert _buffers(sequence_parallel=False, **kw)[0] == 524_288


def test_the_buffer_follows_the_micro_batch() -> None:
    """The states are shared across micro-batch sizes elsewhere; this buffer is not: micro-
    batch 4 keeps twice micro-batch 2's (2,147,483,648 B)."""
    assert _buffers(gpus=8, tp=2, micro_batch_size=4, **LLAMA_7B)[0] == 2_147_483_648


def test_transformer_impl_local_sets_it() -> None:
    args = ("--num-layers 2 --hidden-size 256 --num-attention-heads 4 --seq-length 512 "
            "--max-position-embeddings 512 --micro-batch-size 1 --global-batch-size 8 --bf16 "
            "--vocab-size 1024 ")
    assert megatron.read(args + "--transformer-impl local", 8).inputs[
        "attention_global_buffer"] is True
    assert "attention_global_buffer" not in megatron.read(args, 8).inputs


@pytest.mark.parametrize(("extra", "why"), [
    ({"cp": 2}, "cp 2 and attention eager"),
    ({"attention": "flash"}, "cp 1 and attention flash"),
])
def test_refused_where_megatrons_own_attention_cannot_run(extra: dict, why: str) -> None:
    kw = {**LLAMA_7B, "gpus": 8, "attention_global_buffer": True, **extra}
    with pytest.raises(MemplanError, match=why):
        api.estimate("llama-7b", **kw)

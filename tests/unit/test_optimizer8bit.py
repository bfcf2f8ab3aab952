"""bitsandbytes' 8-bit optimizer states (``memplan.model.optimizer.Blockwise``), by hand.

Per tensor of n elements (bitsandbytes 0.50.2 ``Optimizer2State.init_state``): n < 4096: two
fp32 states, 8n bytes; else two uint8 states (2n) and two fp32 absmax per 256-element block
(2 * 4 * ceil(n / 256)); once per optimizer two quantization maps of 256 fp32 (2048 bytes).
"""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from memplan.api import estimate
from memplan.cli import app, main
from memplan.errors import MemplanError
from memplan.model.optimizer import Blockwise, optimizer_policy
from memplan.workload import Optimizer, OptimizerImpl

FOREACH = OptimizerImpl.FOREACH

MAPS = 2 * 256 * 4


def test_tensor_states_by_size() -> None:
    """4095: 8 * 4095 = 32,760 (fp32); 4096: 8192 + 8 * 16 = 8320; 4097: 8194 + 8 * 17 = 8330
    (a partial last block has its own absmax)."""
    b = Blockwise()
    assert b.tensor_states(4095).device_bytes == 32_760
    assert b.tensor_states(4096).device_bytes == 8_320
    assert b.tensor_states(4097).device_bytes == 8_330


def test_tiny_model_states() -> None:
    """Tiny (2 layers, h 64, kv 32, f 176, V 128, untied), bf16-pure, one GPU. Per layer:
    q, o (4096): 8320 each; gate, up, down (11,264): 22,528 + 8 * 44 = 22,880 each; k, v
    (2048): 16,384 each; two norms (64): 512 each -> 119,072. Embedding and head (8192):
    16,384 + 8 * 32 = 16,640 each; final norm 512. 2 x 119,072 + 2 x 16,640 + 512 + 2048
    (maps) = 273,984 (the traced figure in tests/traced/test_optimizers.py)."""
    est = estimate("tiny", optimizer="adamw8bit", precision="bf16-pure", seq_len=128)
    assert est.worst.optimizer_bytes == 273_984
    assert est.worst.optimizer_temp_bytes == 0  # the CUDA kernel updates in place
    mixed = estimate("tiny", optimizer="adamw8bit", precision="bf16-mixed", seq_len=128)
    # + the fp32 master copy, 108,864 x 4 = 435,456; the states do not follow the dtype
    assert mixed.worst.optimizer_bytes == 273_984 + 435_456


def test_paged_states_split() -> None:
    """Paged from 100,000 elements (``get_state_buffer``): 100,000 -> 200,000 paged and
    8 * 391 = 3128 absmax on the device; 99,999 -> 199,998 + 3128 on the device; 4000 ->
    32,000 (fp32); maps 2048. The step prefetches the largest paged tensor's 200,000."""
    b = optimizer_policy(Optimizer.PAGED_ADAMW8BIT).per_tensor
    states = b.states([(100_000,), (99_999,), (40, 100)])
    assert states.paged_bytes == 200_000
    assert states.device_bytes == 3128 + 199_998 + 3128 + 32_000 + MAPS
    assert states.setup_bytes == MAPS
    assert b.temp_bytes([(100_000,), (99_999,), (300, 1000)], 2, FOREACH) == 600_000
    assert Blockwise().states([(100_000,)]).paged_bytes == 0  # not paged without is_paged


def test_paged_estimate_holds_the_pages_of_one_tensor() -> None:
    """llama-3-8b, bf16-pure: every 2-D weight is paged (8,030,261,248 parameters less the
    65 norms of 4096: 8,029,995,008 elements -> 16,059,990,016 bytes paged); the largest,
    the embedding (128,256 x 4096 = 525,336,576), is on the device during the step."""
    est = estimate("llama-3-8b", optimizer="paged-adamw8bit", precision="bf16-pure",
                   seq_len=1024)
    assert est.worst.paged_bytes == 16_059_990_016
    assert est.worst.optimizer_temp_bytes == 2 * 525_336_576


def test_cli_names_the_optimizer_and_what_the_gpu_holds() -> None:
    runner = CliRunner()
    out = runner.invoke(app, ["estimate", "-m", "llama-3-8b", "--optimizer",
                              "paged-adamw8bit", "--precision", "bf16-pure", "--json"])
    assert out.exit_code == 0, out.output
    data = json.loads(out.output)
    assert data["workload"]["optimizer"] == "paged-adamw8bit"
    assert data["paged_bytes"] == 16_059_990_016
    text = runner.invoke(app, ["estimate", "-m", "llama-3-8b", "--optimizer",
                               "paged-adamw8bit", "--precision", "bf16-pure"],
                         env={"COLUMNS": "400"})
    assert "unified memory" in text.output and "the GPU holds" in text.output
    adamw = json.loads(runner.invoke(app, ["estimate", "-m", "tiny", "--json"]).output)
    assert "paged_bytes" not in adamw


def test_offload_with_an_8bit_optimizer_is_refused(capsys) -> None:
    with pytest.raises(MemplanError, match="offload optimizer"):
        estimate("tiny", gpus=2, zero=1, offload="optimizer", optimizer="adamw8bit")
    assert main(["estimate", "-m", "tiny", "--gpus", "2", "--zero", "1", "--offload",
                 "optimizer", "--optimizer", "adamw8bit"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "optimizer adamw8bit" in err[0]


def test_paged_32bit_states_split() -> None:
    """bitsandbytes' PagedAdamW (32-bit): two fp32 states per element, 8n bytes per tensor,
    paged from 100,000 elements (``get_state_buffer``), no quantization maps: 100,000 ->
    800,000 paged; 99,999 -> 799,992 and 40 x 100 -> 32,000 on the device. The step
    prefetches the largest paged tensor's states: 300 x 1000 -> 2,400,000."""
    p = optimizer_policy(Optimizer.PAGED_ADAMW).per_tensor
    states = p.states([(100_000,), (99_999,), (40, 100)])
    assert states.paged_bytes == 800_000
    assert states.device_bytes == 799_992 + 32_000
    assert states.setup_bytes == 0
    assert p.temp_bytes([(100_000,), (99_999,), (300, 1000)], 2, FOREACH) == 2_400_000
    assert p.temp_bytes([(99_999,)], 2, FOREACH) == 0


def test_paged_32bit_estimate() -> None:
    """llama-3-8b, bf16-pure: the 65 norms of 4096 stay on the device, 65 x 4096 x 8 =
    2,129,920; the 8,029,995,008 other elements are paged, x 8 = 64,239,960,064; the
    embedding's (128,256 x 4096 = 525,336,576) x 8 = 4,202,692,608 are prefetched during
    the step. Tiny (108,864 parameters, all tensors under 100,000): 870,912 on the device."""
    est = estimate("llama-3-8b", optimizer="paged-adamw", precision="bf16-pure",
                   seq_len=1024)
    assert est.worst.optimizer_bytes == 2_129_920
    assert est.worst.paged_bytes == 64_239_960_064
    assert est.worst.optimizer_temp_bytes == 4_202_692_608
    tiny = estimate("tiny", optimizer="paged-adamw", precision="bf16-pure", seq_len=128)
    assert (tiny.worst.optimizer_bytes, tiny.worst.paged_bytes) == (870_912, 0)

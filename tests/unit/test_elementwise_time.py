"""The memory-bound per-token kernels of a Megatron-LM step and its GEMMs at their measured
rates (``memplan.planning.kernels.elementwise_bytes``, ``gemm_time_factor``;
``memplan.planning.timing.elementwise_seconds``). Bytes are counted by hand below from the
kernels' reads and writes (the kernels.py comment block cites each); seconds are those bytes
over the A100 80GB datasheet's 2,039 GB/s times torchao's measured 92%."""

import pytest

import memplan
from memplan.hardware import load_gpu
from memplan.planning.kernels import (elementwise_bytes, gemm_best_rate, gemm_time_factor,
                                      loss_bytes_per_token)
from memplan.planning.timing import (Columns, elementwise_seconds, optimizer_step_seconds,
                                     step_time)
from memplan.spec import ModelSpec

A100 = load_gpu("a100-80gb")


def _gpt(**kw) -> ModelSpec:
    """A Megatron GPT in miniature: h 64, ffn 256, 4 heads of 16, LayerNorm, GeLU, biases,
    learned positions, dropout 0.1, 2 layers, vocabulary 128."""
    args = dict(name="gpt", source="test", num_layers=2, hidden_size=64, ffn_hidden_size=256,
                num_attention_heads=4, num_kv_heads=4, head_dim=16, vocab_size=128,
                max_seq_len=8, norm="layernorm", mlp="gelu", position="learned",
                tied_embeddings=True, qkv_bias=True, attn_out_bias=True, mlp_bias=True,
                norm_bias=True, dropout=0.1)
    args.update(kw)
    return ModelSpec(**args)


def test_megatron_layer_bytes_by_hand():
    """tp 2 without sequence parallelism, 8 keys, bf16 (e = 2): H = 64 (the norms and the
    residual stream are whole on every rank), F = 256 / 2 = 128, 4 / 2 = 2 heads x 8 keys =
    16 score elements per token.

    forward: two layer norms 2 x (64 + 64) x 2 = 512; two bias-dropout-adds 2 x (3 x 2 + 1)
    x 64 = 896; bias-GeLU 2 x 128 x 2 = 512; the softmax (half the row read, the row written)
    16 x 1.5 x 2 = 48 and the attention dropout (read, write, 1-byte mask) 16 x 5 = 80:
    core 128; forward 2048.
    backward: norms 2 x 3 x 64 x 2 = 768; dropout's backward (gradient, mask, dx) and the bias
    gradient 2 x (5 x 64 + 2 x 64) = 896; the residual gradients' sums 2 x 3 x 64 x 2 = 768;
    GeLU's backward 3 x 128 x 2 = 768 and the fc1 bias gradient 128 x 2 = 256; the QKV bias
    gradient (4 + 8) x 16 / 2 x 2 = 192; the softmax's backward 16 x 2 x 2 = 64 and the
    dropout's 16 x 5 = 80: 3792."""
    b = elementwise_bytes(_gpt(), 2, False, 8, 2, True, False, True)
    assert b.core == 128
    assert b.forward == 2048
    assert b.backward == 3792


def test_sequence_parallel_splits_the_norms_and_the_residual_stream():
    """With sequence parallelism a rank holds h / tp = 32 of each token's residual stream:
    the H terms halve (forward 512 + 896 = 1408 -> 704; backward 768 + 768 + 768 = 2304 ->
    1152 less the bias gradient's share: (5 x 32 + 2 x 32) x 2 = 448 in place of 896), the
    F and score terms do not: forward 704 + 512 + 128 = 1344, backward 384 + 448 + 384 + 1024
    + 192 + 144 = 2576."""
    b = elementwise_bytes(_gpt(), 2, True, 8, 2, True, False, True)
    assert b.forward == 1344
    assert b.backward == 2576


def test_flash_attention_has_no_score_bytes_and_swiglu_eager_is_two_kernels():
    """Flash: the softmax is inside the attention kernel, no core bytes. torchtitan's SwiGLU
    (no dropout, no biases, RMSNorm, RoPE) at tp 1, h 64, F 256, 4 + 4 heads of 16: forward
    norms 512, residual adds 2 x 3 x 64 x 2 = 768, eager silu and mul 5 x 256 x 2 = 2560, RoPE
    2 x (4 + 4) x 16 x 2 = 512: 4352; compiled, the fused SwiGLU 3 x 256 x 2 = 1536: 3328.
    Backward eager: norms 768, residual sums 768, 9 x 256 x 2 = 4608, RoPE 512: 6656;
    compiled 5 x 256 x 2 = 2560: 4608."""
    spec = _gpt(norm="rmsnorm", mlp="swiglu", position="rope", qkv_bias=False,
                attn_out_bias=False, mlp_bias=False, norm_bias=False, dropout=0.0)
    eager = elementwise_bytes(spec, 1, False, 8, 2, False, False, False)
    fused = elementwise_bytes(spec, 1, False, 8, 2, False, True, False)
    assert (eager.core, eager.forward, eager.backward) == (0, 4352, 6656)
    assert (fused.forward, fused.backward) == (3328, 4608)


def test_loss_bytes():
    """(2 e + 28) bytes an entry of the rank's v / tp: bf16, v 128, tp 2: 32 x 64 = 2048."""
    assert loss_bytes_per_token(_gpt(), 2, 2) == 2048


def test_elementwise_seconds_by_hand():
    """Megatron, tp 2 without SP, full recompute of both layers, micro-batch 1 of 8 tokens,
    one micro-batch, no pipeline: per token 2 layers x (2048 forward + 3792 backward + 2048
    rerun) + 2048 of loss = 17824 bytes; 8 tokens: 142592 bytes over 2,039 GB/s x 0.92."""
    spec = _gpt()
    wl = memplan.make_workload(spec, seq_len=8, recompute="full", step_model="kernels",
                               attention="eager")
    par = memplan.make_layout(2, tp=2, sequence_parallel=False)
    c = Columns.one(par, 1, 1, spec.num_params, num_layers=2, rerun=1.0)
    assert elementwise_seconds(spec, A100, wl, c) == pytest.approx(142592 / (2039e9 * 0.92))


def test_torch_kernels_are_the_modules_own():
    """``step_model`` kernels-torch times the step kernel by kernel with the PyTorch modules'
    pointwise kernels (torchtitan's TransformerBlock and FeedForward), not Megatron-LM's.
    torchtitan's miniature (as in the test above: RMSNorm, SwiGLU, RoPE, no biases, no
    dropout), tp 1, flash attention, no recompute, micro-batch 1 of 8 tokens, no pipeline:
    per token 2 layers x (4352 + 6656) eager bytes + the loss's (2 e + 28) x v = 32 x 128 =
    4096: 2 x 11008 + 4096 = 26112; compiled 2 x (3328 + 4608) + 4096 = 19968. Megatron's
    kernels (``kernels``) on the same layer: forward as compiled (its bias-dropout-adds
    without dropout read two and write one, (3 e + 0) x 64 x 2 = 768, as the residual adds),
    3328; backward the compiled 4608 and the bias-dropout-adds' own backward, (2 e + 0) x 64
    x 2 = 512: 5120; 2 x 8448 + 4096 = 20992. 8 tokens each, over 2,039 GB/s x 0.92."""
    spec = _gpt(norm="rmsnorm", mlp="swiglu", position="rope", qkv_bias=False,
                attn_out_bias=False, mlp_bias=False, norm_bias=False, dropout=0.0)
    par = memplan.make_layout(1)
    c = Columns.one(par, 1, 1, spec.num_params, num_layers=2)
    hbm = 2039e9 * 0.92

    def seconds(step_model: str, compile: bool) -> float:
        wl = memplan.make_workload(spec, seq_len=8, step_model=step_model, compile=compile)
        return elementwise_seconds(spec, A100, wl, c)

    assert seconds("kernels-torch", False) == pytest.approx(8 * 26112 / hbm)
    assert seconds("kernels-torch", True) == pytest.approx(8 * 19968 / hbm)
    assert seconds("kernels", False) == pytest.approx(8 * 20992 / hbm)


def test_torch_kernel_step_is_gemms_plus_memory_bound_kernels():
    """kernels-torch times the compute as kernels does (the GEMMs at the measured rate, here
    the A100's 271.2 TFLOP/s with eager attention, plus the memory-bound seconds and the
    optimizer's), independent of the flat fraction."""
    spec = _gpt(norm="rmsnorm", mlp="swiglu", position="rope", qkv_bias=False,
                attn_out_bias=False, mlp_bias=False, norm_bias=False, dropout=0.0)
    _assert_gemms_plus_memory_bound(spec, "kernels-torch")


def _assert_gemms_plus_memory_bound(spec, step_model: str) -> None:
    """One A100, eager attention, no recompute: the compute is every FLOP at 271.2 TFLOP/s
    plus the memory-bound seconds and the optimizer's, the same at any flat fraction."""
    wl = memplan.make_workload(spec, seq_len=8, step_model=step_model, attention="eager")
    par = memplan.make_layout(1)
    t = step_time(spec, A100, par, wl, 1, 1, spec.num_params)
    c = Columns.one(par, 1, 1, spec.num_params, num_layers=2)
    assert t.compute_s == pytest.approx(t.hardware_flops / 271.2e12
                                        + elementwise_seconds(spec, A100, wl, c)
                                        + optimizer_step_seconds(A100, wl, c))
    slow = step_time(spec, A100, par, wl, 1, 1, spec.num_params, mfu=0.2)
    assert slow.compute_s == pytest.approx(t.compute_s)


def test_gemm_rates_are_measured_ones():
    """A100: stas00's measured 271.2 TFLOP/s; the linears at it take 0.4 x 312 / 271.2 =
    0.4602 of their time at 40% of peak. H100: the table's largest, 788.7 TFLOP/s. L40S: no
    measured GEMM rate."""
    assert gemm_best_rate(A100) == 271.2e12
    assert gemm_time_factor(_gpt(), A100, 2, False, 0.4) == pytest.approx(0.4 * 312 / 271.2)
    assert gemm_best_rate(load_gpu("h100-sxm")) == 788699393418751
    assert gemm_best_rate(load_gpu("l40s")) is None


def test_kernel_step_is_gemms_plus_memory_bound_kernels():
    """One A100, the miniature GPT timed kernel by kernel (``step_model`` kernels, what the
    Megatron-LM preset selects) with eager attention, no recompute: the compute is every FLOP
    at 271.2 TFLOP/s (no flash table read for eager attention) plus the memory-bound seconds;
    the flat fraction of peak plays no part (the same at any mfu). The flat step model (the
    default) keeps the flat fraction, whatever the framework's name."""
    spec = _gpt()
    _assert_gemms_plus_memory_bound(spec, "kernels")
    par = memplan.make_layout(1)
    generic = memplan.make_workload(spec, seq_len=8, attention="eager")
    g = step_time(spec, A100, par, generic, 1, 1, spec.num_params)
    assert g.compute_s == pytest.approx(g.hardware_flops / (312e12 * 0.4))
    named = memplan.make_workload(spec, seq_len=8, attention="eager", framework="megatron")
    assert step_time(spec, A100, par, named, 1, 1, spec.num_params).compute_s == g.compute_s


def test_optimizer_step_by_its_bytes():
    """The kernel step model times the optimizer's step by the bytes it moves on the rank's
    partition. AdamW (two states) on fp32 main weights with fp32 gradients (bf16-fp32-grads,
    Megatron-LM's main_grad): the fused step reads the weight, the gradient and the two
    states (4 + 4 + 8) and writes the weight and the states (4 + 8), and the copy into the
    bf16 model weight reads 4 and writes 2: 34 B a parameter. 1e9 parameters on the rank,
    dp 4: without ZeRO all of them, 34e9 B; with ZeRO-1 (the distributed optimizer) a
    quarter, 8.5e9 B; each over 2,039 GB/s x 0.92. bf16-pure (no master copy, bf16 states):
    2 x (2 + 4) + 2 = 14 B a parameter. With the optimizer on the host: nothing on the
    GPU."""
    spec = _gpt()
    hbm = 2039e9 * 0.92

    def seconds(precision: str, **layout) -> float:
        wl = memplan.make_workload(spec, seq_len=8, precision=precision, step_model="kernels")
        par = memplan.make_layout(4, **layout)
        return optimizer_step_seconds(A100, wl, Columns.one(par, 1, 1, 10**9, num_layers=2))

    assert seconds("bf16-fp32-grads") == pytest.approx(34e9 / hbm)
    assert seconds("bf16-fp32-grads", zero=1) == pytest.approx(8.5e9 / hbm)
    assert seconds("bf16-pure") == pytest.approx(14e9 / hbm)
    assert seconds("bf16-fp32-grads", zero=1, offload="optimizer") == 0.0


def test_blocking_pipeline_sends_are_exposed_whole():
    """Megatron-LM's non-interleaved 1F1B waits on each send and receive before the next
    compute (``PipelineP2p.BLOCKING``, the Megatron-LM preset's): the pipeline's
    communication is exposed whole, where the overlapped default hides the stated half of it
    (``OVERLAP['pp']``): the exposed seconds differ by 0.5 x the pipeline's seconds, the
    bubble by the same times (p - 1) / m. With virtual stages (the interleaved schedule)
    nothing changes."""
    from memplan.planning.timing import OVERLAP

    spec = _gpt()
    assert OVERLAP["pp"] == 0.5

    def timed(p2p: str, vpp: int = 1):
        wl = memplan.make_workload(spec, seq_len=8, pipeline_p2p=p2p)
        par = memplan.make_layout(2, pp=2, vpp=vpp, stage_layers=None if vpp == 1 else
                                  "0,1,1,0")
        return step_time(spec, A100, par, wl, 4, 4, spec.num_params)

    blocking, overlapped = timed("blocking"), timed("overlapped")
    assert blocking.comm_s["pp"] > 0
    assert blocking.exposed_comm_s - overlapped.exposed_comm_s == pytest.approx(
        0.5 * blocking.comm_s["pp"])
    assert blocking.bubble_s - overlapped.bubble_s == pytest.approx(
        0.5 * blocking.comm_s["pp"] * (2 - 1) / 4)
    assert timed("blocking", vpp=2).step_s == timed("overlapped", vpp=2).step_s

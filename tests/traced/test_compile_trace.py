"""A compiled decoder layer's saved set, from Inductor's real partitioner, against memplan.

transformers' ``LlamaDecoderLayer`` (the Llama 3 config of tests/traced/hf_configs.py, cut to
h = 256, 8 heads, 2 KV heads, ffn 896) and torchtitan's Llama3 block (0.3.0, the same widths,
ffn 768) are compiled on their own with the Inductor backend on CPU,
as torchtitan compiles each decoder layer, optionally inside full activation checkpointing
(``memplan.profile.compiled_trace``); the tensors ``min_cut_rematerialization_partition``
saves for backward are recorded from the partitioned forward graph. memplan's saved terms of
one layer with ``compile=True`` must match them to the byte: the tensors the forward made,
and of its graph inputs the layer's input (the weights and the RoPE tables, one per model,
are not a layer's activations).

Traced (torch 2.13.0 CPU, transformers 5.3.0), 2 sequences of 64 tokens (T = 128):
fp32 2,233,344 B = the layer input, each norm's rsqrt (T fp32) and output, the post-attention
norm's input (kept as the output projection's output, the residual sum recomputed), q and k
after RoPE, v, SDPA's output and logsumexp, gate, up and SiLU(gate) * up; bf16 1,119,232 B
(the statistics fp32). Inside checkpointing the layer saves its input alone (and the RNG
state, a symbolic-size uint8 tensor of the checkpoint, not counted).
"""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("transformers")

from hf_configs import GEMMA2_TOY, LLAMA3_TOY, OLMO2_TOY, hf  # tests/traced/hf_configs.py

from memplan.model.compiled_order import held_by_lone_layer
from memplan.model.dims import Dims
from memplan.model.layer import layer_kind
from memplan.parallel import ParallelConfig
from memplan.spec import spec_from_hf_dict
from memplan.workload import Recompute, Workload
from recorded import compiled_layer_saved  # tests/traced/recorded.py

TOY = hf("Meta-Llama-3-8B", **LLAMA3_TOY)
# torchtitan's Llama3 block at the same width (ffn 768 by its compute_ffn_hidden_dim)
TITAN = {"torchtitan": dict(dim=256, n_layers=1, n_heads=8, n_kv_heads=2, vocab_size=1000)}
BATCH, SEQ = 2, 64


def _traced_activations(config: dict, dtype: str, checkpoint: str, width: int = 256) -> int:
    saved = compiled_layer_saved(config, dtype, BATCH, SEQ, checkpoint=checkpoint)
    return _activations(saved, width)


def _activations(saved, width: int = 256) -> int:
    stream = (BATCH, SEQ, width)
    return sum(t.size_bytes for t in saved if not t.graph_input or t.shape == stream)


def _model_backward(kind: Any, groups: dict[str, int], grad_bytes: int, stream: int = 0,
                    held: int = 0) -> int:
    """memplan's backward peak of one compiled layer (``kind``): each backward moment's alive
    and transient bytes with the weight gradients made by then (``groups``' elements, of
    ``grad_bytes`` each), less ``stream`` (the incoming gradient the trace does not hold)
    but at the layer's end; with the layer's input and the incoming gradient (``held``
    bytes each) that the traced step holds itself where a step has freed them
    (``compiled_order.held_by_lone_layer``)."""
    return max(m.alive_bytes + m.transient_bytes
               + grad_bytes * sum(groups[g] for g in m.grads_before)
               + held_by_lone_layer(m, held)
               - (0 if m.name == "compiled_end" else stream) for m in kind.moments)


def _spec(library: str, fuse_qkv: bool):
    if library == "transformers":
        return spec_from_hf_dict(TOY, "llama3-toy", "llama3-toy")
    from memplan.profile.frameworks import torchtitan_config, torchtitan_spec

    cfg = torchtitan_config(**TITAN["torchtitan"], seq_len=SEQ, fuse_qkv=fuse_qkv)
    return torchtitan_spec(cfg, "llama3-toy")


@pytest.mark.parametrize("library,fuse_qkv", [("transformers", False), ("torchtitan", True),
                                              ("torchtitan", False)])
@pytest.mark.parametrize("dtype,precision", [("float32", "fp32"), ("bfloat16", "bf16-pure")])
@pytest.mark.parametrize("checkpoint", ["none", "full", "op"])
def test_compiled_layer_saves_what_the_partitioner_saves(library: str, fuse_qkv: bool,
                                                         dtype: str, precision: str,
                                                         checkpoint: str) -> None:
    """transformers' layer and torchtitan's block (fused wqkv or not; 0.3's default fuses):
    torchtitan's fp32 2,036,736 B and bf16 1,020,928 B traced (its ffn 768: three T x 768
    tensors where transformers' layer saves three T x 896). Under torchtitan's per-op SAC
    (its policy, a torchtitan block's) the input, the odd matmuls' outputs but the down
    projection's, SDPA's output and logsumexp: fp32 856,064 B fused, 823,296 B separate.

    Inside full checkpointing, from the same compile, the forward's peak too
    (``compiled_layer_step``, one kernel per scheduler node): at the up projection's matmul,
    beside the input, the output projection's output, the MLP norm's output and the gate
    and up outputs (``compiled.checkpointed_mlp_working_bytes``: SiLU(gate) * up written
    into the gate's buffer), 2 x T x h + 2 x T x f in the layer's dtype: transformers' fp32
    2 x 131,072 + 2 x 458,752 = 1,179,648 B, bf16 589,824 B; torchtitan's (f 768) fp32
    1,048,576 B, bf16 524,288 B. The trace holds 5,056 B more, the CPU generator's state
    the checkpoint saves (a CUDA generator's is a seed and an offset). Before, memplan
    counted SiLU(gate) as eager holds it, one T x f more: transformers' fp32 1,638,400 B
    against 1,184,704 traced (+38%)."""
    if checkpoint == "op" and library != "torchtitan":
        pytest.skip("per-op SAC is torchtitan's policy")
    config = TOY if library == "transformers" else {
        "torchtitan": dict(TITAN["torchtitan"], fuse_qkv=fuse_qkv)}
    spec = _spec(library, fuse_qkv)
    recompute = {"none": Recompute.NONE, "full": Recompute.FULL,
                 "op": Recompute.SELECTIVE}[checkpoint]
    # torchtitan's RoPE cache is its attention's buffer (the preset's rope_cache "layer"):
    # the complex RoPE returns q token-major, SDPA's output with it, no copy for wo
    rope = {} if library == "transformers" else {"rope_cache": "layer", "selective_impl": "op"}
    wl = Workload(micro_batch_size=BATCH, seq_len=SEQ, precision=precision,
                  recompute=recompute, compile=True, **rope)
    dm = Dims.of(spec, ParallelConfig(), wl)
    kind = layer_kind(spec, wl, dm, False, recompute)
    if checkpoint != "full":
        assert kind.saved_bytes == _traced_activations(config, dtype, checkpoint)
        return
    from recorded import compiled_layer_step  # tests/traced/recorded.py

    saved, forward, _ = compiled_layer_step(config, dtype, BATCH, SEQ, checkpoint="full")
    assert kind.saved_bytes == _activations(saved)
    stream = dm.rows * spec.hidden_size * dm.e  # the input, made before the step
    assert forward - (kind.forward_peak_bytes - stream) == 5_056


@pytest.mark.parametrize("dtype,precision,grad_bytes,backward_over", [
    ("float32", "fp32", 4, 68_608), ("bfloat16", "bf16-pure", 2, 0)])
def test_compiled_layer_phase_peaks(dtype: str, precision: str, grad_bytes: int,
                                    backward_over: int) -> None:
    """The compiled layer's forward and backward peaks (``compiled_layer_peaks``: above the
    weights, the input and the output's gradient, the output held through backward; oneDNN
    off) against memplan's layer moments, each with the gradients of the parameter groups made
    by then (in the weights' dtype), less one residual-sized tensor: memplan counts the
    layer's input (saved by its first norm) and the incoming gradient, the trace the held
    output in their place (the same size), the input made before the step.

    Forward, traced fp32 2,233,344 B, bf16 1,119,232 B: the saved set less the input and the
    output, which the residual add writes into the down projection's output (Inductor's
    in-place reuse, ``memplan.model.compiled.MLP_OUTPUTS``): byte-exact. Backward, traced fp32
    4,261,888 B, bf16 2,130,944 B at the MLP's weight gradients, 2 x 64 tokens, below the MLP's
    weight-gradient threshold: in bf16 memplan takes lpmf's order there, its end exact
    (``compiled_order.with_mlp_grads_last``; 36,864 B, +1.73%, over before, at ``mlp_in``); in
    fp32, where that order is not taken, over by 68,608 B (+1.61%) at the same moment: the
    backward's buffers are the eager model's, not Inductor's schedule of them. Traced with
    Inductor's GPU realization rules (``gpu_realize``): the same bytes as with the CPU's."""
    from memplan.model.layer import grad_group_params
    from recorded import compiled_layer_peaks  # tests/traced/recorded.py

    spec = spec_from_hf_dict(TOY, "llama3-toy", "llama3-toy")
    wl = Workload(micro_batch_size=BATCH, seq_len=SEQ, precision=precision, compile=True)
    dm = Dims.of(spec, ParallelConfig(), wl)
    kind = layer_kind(spec, wl, dm, False, Recompute.NONE)
    groups = grad_group_params(spec, 1, 1, False)
    stream = BATCH * SEQ * TOY["hidden_size"] * grad_bytes
    backward = _model_backward(kind, groups, grad_bytes, held=stream)
    traced_forward, traced_backward = compiled_layer_peaks(TOY, dtype, BATCH, SEQ,
                                                           gpu_realize=True)
    assert kind.forward_peak_bytes - stream == traced_forward
    assert backward - stream - traced_backward == backward_over
    assert backward - stream == pytest.approx(traced_backward, rel=0.03)


def _autocast_kind(precision: str, checkpoint: str):
    """memplan's layer of the transformers toy, fp32 weights under ``precision``
    (``amp-*``), compiled, recompute ``checkpoint``, and its gradient groups."""
    from memplan.model.layer import grad_group_params
    from memplan.parallel import validate

    spec = spec_from_hf_dict(TOY, "llama3-toy", "llama3-toy")
    recompute = Recompute.FULL if checkpoint == "full" else Recompute.NONE
    wl = Workload(micro_batch_size=BATCH, seq_len=SEQ, precision=precision,
                  recompute=recompute, compile=True)
    validate(spec, ParallelConfig(), wl)  # no longer refused
    dm = Dims.of(spec, ParallelConfig(), wl)
    return layer_kind(spec, wl, dm, False, recompute), grad_group_params(spec, 1, 1, False)


@pytest.mark.parametrize("autocast,precision,checkpoint", [
    ("bfloat16", "amp-bf16", "none"), ("bfloat16", "amp-bf16", "full")])
def test_compiled_autocast_layer_matches_trace(autocast: str, precision: str,
                                               checkpoint: str) -> None:
    """transformers' layer with fp32 weights compiled under CPU autocast to bf16 (the region
    inside the compiled function, as accelerate's ``prepare_model`` puts it), one compile:
    its saved set, forward and backward peaks (``compiled_layer_step``; one kernel per
    scheduler node, as a GPU backend launches them). T = 128, h 256, f 896.

    Saved, traced 2,888,704 B: the fp32 input 131,072, two rsqrt 512 each, the attention
    norm's bf16 cast 65,536 (one for q, k and v: ``linear.input_copies``), v 16,384, the bf16
    casts of k and q after the fp32 RoPE 16,384 and 65,536, SDPA's output 65,536 and
    logsumexp 4,096, the output projection's bf16 output 65,536 (the MLP norm's fp32 input
    recomputed from it: ``compiled.norm_input_e``), the MLP norm's cast 65,536, gate, up and
    the product 229,376 each, and the bf16 casts of the seven weights 1,703,936
    (``is_materialized_backwards``: the grad-input matmuls read them). Inside full
    checkpointing the input alone (131,072; the RNG state, symbolic, not counted).

    Forward, none: the saved set less the input, with the fp32 output beside the down
    projection's bf16 output (``compiled.mlp_outputs_bytes``): 2,954,240 B, exact. Full:
    traced 1,053,632 B at the MLP's activation (``compiled.
    autocast_checkpointed_forward_bytes``: 2 x 65,536 + 2 x 229,376 + 458,752), memplan
    5,056 B under (-0.48%): the CPU generator's state the checkpoint saves. Backward,
    memplan 4,130,816 B at the compiled backward's end (``compiled.autocast_end_bytes``):
    every fp32 gradient 3,409,920, the up projection's bf16 one 458,752, the input's
    gradient and the held output 131,072 each (memplan's end moment counts the incoming
    gradient in the held output's place and not the input, freed by then: no residual-sized
    tensor to take off, as the other moments need). Traced with Inductor's GPU realization
    rules (``gpu_realize``): full exact; none 4,101,120 B, memplan 29,696 B over (+0.72%):
    there Inductor schedules each MLP weight gradient's fp32 cast right after its matmul
    (``cpp_fused__to_copy_1``) and SDPA's backward later, another order of the backward
    at 2 x 64, not modelled (with the CPU's rules 4,130,816 B, exact)."""
    from recorded import compiled_layer_step  # tests/traced/recorded.py

    saved, forward, backward = compiled_layer_step(TOY, "float32", BATCH, SEQ,
                                                   autocast=autocast, checkpoint=checkpoint,
                                                   gpu_realize=True)
    stream = BATCH * SEQ * TOY["hidden_size"] * 4
    traced = sum(t.size_bytes for t in saved
                 if not t.graph_input or t.shape == (BATCH, SEQ, TOY["hidden_size"]))
    kind, groups = _autocast_kind(precision, checkpoint)
    assert kind.saved_bytes == traced == (2_888_704 if checkpoint == "none" else stream)
    if checkpoint == "none":
        assert kind.forward_peak_bytes - stream == forward == 2_954_240
    else:
        assert forward - (kind.forward_peak_bytes - stream) == 5_056
    modelled = _model_backward(kind, groups, 4, stream)
    assert modelled == 4_130_816
    assert backward == (4_101_120 if checkpoint == "none" else 4_130_816)


@pytest.mark.parametrize("seq,saved,backward", [(192, 5_258_240, 6_372_352),
                                                 (256, 6_443_008, 7_819_264)])
def test_compiled_autocast_swiglu_backward(seq: int, saved: int, backward: int) -> None:
    """The autocast toy (fp32 weights, CPU autocast to bf16, no recompute) at 2 x 192 and
    2 x 256 tokens, where the backward peaks at the MLP's fused SiLU-backward kernel
    (``compiled.swiglu_moments``), one kernel per scheduler node. Inductor's
    ``reorder_for_peak_memory`` keeps the lower of two orders there
    (``compiled.down_grad_deferred``): the down weight's fp32 gradient h*f*4 = 917,504
    against the product T*f*2 and the incoming gradient's bf16 cast T*h*2.

    T = 384: 688,128 + 196,608 = 884,736 < 917,504, deferred: the saved set (5,258,240, the
    fp32 input 393,216 among it) less the input and the down weight's bf16 cast 458,752,
    with the cast 196,608, the kernel's input gradient and its new gradient 688,128 each (up's
    written in up's buffer) and the held output 393,216: 6,372,352.
    T = 512: 917,504 + 262,144 > 917,504, the down weight's gradient first: the saved set
    (6,443,008) less the input 524,288, the product 917,504 and the down weight's cast,
    with that gradient 917,504 (fp32; its bf16 source freed by its cast), the kernel's two
    gradients 917,504 each (the cast freed with the grad-input matmul) and the held output
    524,288: 7,819,264. Both exact; the forward peak as ``test_compiled_autocast_layer_
    matches_trace`` models it."""
    from memplan.model.layer import grad_group_params
    from recorded import compiled_layer_step  # tests/traced/recorded.py

    traced, forward, peak = compiled_layer_step(TOY, "float32", BATCH, seq, autocast="bfloat16")
    spec = spec_from_hf_dict(TOY, "llama3-toy", "llama3-toy")
    wl = Workload(micro_batch_size=BATCH, seq_len=seq, precision="amp-bf16", compile=True)
    kind = layer_kind(spec, wl, Dims.of(spec, ParallelConfig(), wl), False, Recompute.NONE)
    groups = grad_group_params(spec, 1, 1, False)
    stream = BATCH * seq * TOY["hidden_size"] * 4
    assert kind.saved_bytes == saved == sum(
        t.size_bytes for t in traced
        if not t.graph_input or t.shape == (BATCH, seq, TOY["hidden_size"]))
    assert kind.forward_peak_bytes - stream == forward
    modelled = _model_backward(kind, groups, 4, stream)
    assert modelled == peak == backward


def test_compiled_fp16_autocast_layer_saves_what_the_partitioner_saves() -> None:
    """As ``test_compiled_autocast_layer_matches_trace`` under CPU autocast to fp16 (which
    CPU autocast runs: its lower-precision list takes float16 as bfloat16): the same saved
    set, the casts in fp16, 2,888,704 B."""
    saved = compiled_layer_saved(TOY, "float32", BATCH, SEQ, autocast="float16")
    assert {t.dtype for t in saved if not t.graph_input} == {"float16", "float32"}
    traced = sum(t.size_bytes for t in saved
                 if not t.graph_input or t.shape == (BATCH, SEQ, TOY["hidden_size"]))
    assert _autocast_kind("amp-fp16", "none")[0].saved_bytes == traced == 2_888_704


@pytest.mark.parametrize("fuse_qkv,checkpoint,seq,saved,forward,backward", [
    (False, "none", 256, 5_853_184, 6_115_328, 7_032_832),
    (False, "none", 1024, 18_890_752, 19_939_328, 22_429_696),
    (True, "full", 256, 524_288, 2_495_424, 8_081_408),
    (True, "full", 1024, 2_097_152, 8_786_880, 28_983_296)])
def test_compiled_autocast_titan_block_matches_trace(fuse_qkv: bool, checkpoint: str, seq: int,
                                                     saved: int, forward: int,
                                                     backward: int) -> None:
    """torchtitan 0.3.0's Llama3 block (h 256, f 768, fp32 weights, its complex RoPE; wqkv
    fused or not) compiled under CPU autocast to bf16, the checkpoint inside the compiled
    graph (torchtitan applies AC, then compiles each block: models/llama3/parallelize.py),
    one kernel per scheduler node, Inductor's GPU realization rules; 2 x ``seq`` tokens.

    Recompute none, separate q/k/v: saved set, forward and backward peaks exact, as the
    transformers toy's mechanisms model them (the casts in the graph, the MLP norm's input
    as the output projection's bf16 output, ``compiled.autocast_end_bytes``...). Full, fused
    wqkv: the input alone saved (T*h*4), backward exact; forward 5,056 B under at
    ``compiled.autocast_checkpointed_forward_bytes`` (the CPU generator's state the
    checkpoint saves, as for the transformers toy): T = 512, 2 x 262,144 + 2 x 786,432 +
    393,216 = 2,490,368 (traced 2,495,424). Separate q/k/v under full traced the same
    bytes. Not modelled, refused (``parallel._compile_autocast_refusal``): fused wqkv
    without recompute, its backward traced 7,313,408 at 2 x 256 (at the q RoPE's complex
    multiply's backward, beside the k and v gradients the fused projection's grad-input
    matmul waits for; memplan's moments 7,032,832, -3.8%; exact at 2 x 1,024). Per-op SAC:
    ``test_compiled_autocast_titan_block_under_per_op_sac``."""
    from memplan.model.layer import grad_group_params
    from memplan.parallel import validate
    from recorded import compiled_layer_step  # tests/traced/recorded.py
    from memplan.profile.frameworks import torchtitan_config, torchtitan_spec

    fields = dict(TITAN["torchtitan"], fuse_qkv=fuse_qkv)
    traced, traced_forward, traced_backward = compiled_layer_step(
        {"torchtitan": fields}, "float32", BATCH, seq, autocast="bfloat16",
        checkpoint=checkpoint, gpu_realize=True)
    spec = torchtitan_spec(torchtitan_config(**fields, seq_len=seq), "llama3-toy")
    recompute = Recompute.FULL if checkpoint == "full" else Recompute.NONE
    wl = Workload(micro_batch_size=BATCH, seq_len=seq, precision="amp-bf16",
                  recompute=recompute, compile=True, rope_cache="layer", selective_impl="op")
    validate(spec, ParallelConfig(), wl)  # no longer refused
    kind = layer_kind(spec, wl, Dims.of(spec, ParallelConfig(), wl), False, recompute)
    stream = BATCH * seq * TITAN["torchtitan"]["dim"] * 4
    width = TITAN["torchtitan"]["dim"]
    assert sum(t.size_bytes for t in traced if not t.graph_input
               or t.shape == (BATCH, seq, width)) == saved == kind.saved_bytes
    assert (traced_forward, traced_backward) == (forward, backward)
    modelled_forward = kind.forward_peak_bytes - stream
    assert forward - modelled_forward == (0 if checkpoint == "none" else 5_056)
    groups = grad_group_params(spec, 1, 1, False)
    assert _model_backward(kind, groups, 4, stream) == backward


@pytest.mark.parametrize("fuse_qkv,seq,saved,forward,backward,modelled", [
    (True, 256, 1_982_464, 3_162_112, 7_227_392, 7_227_392),
    (False, 256, 1_916_928, 3_096_576, 7_161_856, 7_161_856),
    (True, 1024, 7_929_856, 11_468_800, 27_336_704, 27_336_704),
    (False, 1024, 7_667_712, 11_206_656, 27_074_560, 27_074_560)])
def test_compiled_autocast_titan_block_under_per_op_sac(fuse_qkv: bool, seq: int, saved: int,
                                                        forward: int, backward: int,
                                                        modelled: int) -> None:
    """torchtitan 0.3.0's Llama3 block as ``test_compiled_autocast_titan_block_matches_
    trace``, inside torchtitan's per-op SAC (its policy, ``_per_op_sac``), compiled around
    it. Saved set exact: the input and the policy's kept outputs (fused: wqkv's T x (h +
    2 kv); separate: q's and v's; the gate's T x f, SDPA's output and logsumexp). Forward
    exact: at the MLP's activation kernel the full recompute's moment
    (``compiled.autocast_checkpointed_forward_bytes``) with the kept tensors, the gate
    counted once (``layer.layer_kind``). Backward, fused wqkv: exact at the MLP's kernel
    (``compiled.autocast_sac_deferred``; T = 2,048: the kept 5,832,704, the held output
    2,097,152, the incoming gradient's bf16 cast, the rebuilt output projection's output
    and the MLP norm's cast 1,048,576 each, wo's cast 131,072, the MLP norm's statistics
    8,192, up's cast 393,216, up's output, the product's gradient and the kernel's three
    T x f outputs 3,145,728 each: 27,336,704). Separate q/k/v: the same moment without
    the fused projection's kept k (T = 512: 7,161,856, exact; at 2 x 1,024 27,074,560,
    exact too), SDPA's CPU backward counted as its outputs (``memplan.profile.
    compiled_trace``: its per-thread scratch had put the 2 x 256 trace's peak there, at
    7,262,464)."""
    from memplan.model.layer import grad_group_params
    from memplan.parallel import validate
    from recorded import compiled_layer_step  # tests/traced/recorded.py
    from memplan.profile.frameworks import torchtitan_config, torchtitan_spec

    fields = dict(TITAN["torchtitan"], fuse_qkv=fuse_qkv)
    traced, traced_forward, traced_backward = compiled_layer_step(
        {"torchtitan": fields}, "float32", BATCH, seq, autocast="bfloat16", checkpoint="op",
        gpu_realize=True)
    spec = torchtitan_spec(torchtitan_config(**fields, seq_len=seq), "llama3-toy")
    wl = Workload(micro_batch_size=BATCH, seq_len=seq, precision="amp-bf16",
                  recompute=Recompute.SELECTIVE, compile=True, rope_cache="layer",
                  selective_impl="op")
    validate(spec, ParallelConfig(), wl)  # not refused
    kind = layer_kind(spec, wl, Dims.of(spec, ParallelConfig(), wl), False,
                      Recompute.SELECTIVE)
    width = TITAN["torchtitan"]["dim"]
    stream = BATCH * seq * width * 4
    assert sum(t.size_bytes for t in traced if not t.graph_input
               or t.shape == (BATCH, seq, width)) == saved == kind.saved_bytes
    assert traced_forward == forward == kind.forward_peak_bytes - stream
    groups = grad_group_params(spec, 1, 1, False)
    assert (traced_backward, _model_backward(kind, groups, 4, stream)) == (backward, modelled)


@pytest.mark.parametrize("fuse_qkv,recipe,checkpoint", [
    (False, "tensorwise", "none"), (False, "rowwise", "none"), (True, "tensorwise", "none"),
    (True, "rowwise", "full")])
def test_compiled_float8_layer_saves_what_the_partitioner_saves(fuse_qkv: bool, recipe: str,
                                                                checkpoint: str) -> None:
    """torchtitan's block (bf16) with torchao's Float8Linear on its linears (torchtitan's
    float8 converter), compiled: the backward's matmuls read float8 casts, so the norms'
    outputs and SiLU(gate) * up, pointwise, are recomputed (``memplan.model.compiled.
    float8_recomputed``): separate q/k/v 1,020,928 - 2 * 65,536 - 196,608 = 693,248 B traced
    rowwise; tensorwise + 7 linears x (a bf16 amax + an fp32 scale) = 693,290 B. Inside full
    checkpointing the layer's input alone, as without float8. torchao 0.18.0."""
    pytest.importorskip("torchao.float8")
    config = {"torchtitan": dict(TITAN["torchtitan"], fuse_qkv=fuse_qkv, float8=recipe)}
    spec = _spec("torchtitan", fuse_qkv)
    recompute = Recompute.FULL if checkpoint == "full" else Recompute.NONE
    wl = Workload(micro_batch_size=BATCH, seq_len=SEQ, precision="bf16-pure",
                  recompute=recompute, compile=True, rope_cache="layer", float8=recipe)
    dm = Dims.of(spec, ParallelConfig(), wl)
    modelled = layer_kind(spec, wl, dm, False, recompute).saved_bytes
    assert modelled == _traced_activations(config, "bfloat16", checkpoint)


def test_compiled_float8_layer_under_per_op_sac() -> None:
    """torchtitan's block (fused wqkv, bf16, tensorwise Float8Linears) inside its per-op SAC,
    compiled: the tagged matmul outputs backward reads (qkv, w1), SDPA's output and logsumexp
    and the input, as without float8 (430,080 B), and the save list's amaxes (``aten.max``,
    7 bf16 scalars) with 4 fp32 scales: 430,110 B traced, memplan 30 B under."""
    pytest.importorskip("torchao.float8")
    config = {"torchtitan": dict(TITAN["torchtitan"], fuse_qkv=True, float8="tensorwise")}
    spec = _spec("torchtitan", True)
    wl = Workload(micro_batch_size=BATCH, seq_len=SEQ, precision="bf16-pure",
                  recompute=Recompute.SELECTIVE, compile=True, rope_cache="layer",
                  selective_impl="op", float8="tensorwise")
    dm = Dims.of(spec, ParallelConfig(), wl)
    modelled = layer_kind(spec, wl, dm, False, Recompute.SELECTIVE).saved_bytes
    assert _traced_activations(config, "bfloat16", "op") - modelled == 30


def _float8_peaks(recipe: str, checkpoint: str, seq: int) -> tuple[int, int]:
    """memplan's (forward peak, backward peak) of torchtitan's compiled float8 block (fused
    wqkv, bf16), each less one residual-stream tensor, as ``test_compiled_layer_phase_peaks``
    compares them (benchmarks/compiled_backward.py ``memplan_peaks``)."""
    from memplan.model.layer import grad_group_params

    recompute = {"none": Recompute.NONE, "full": Recompute.FULL,
                 "op": Recompute.SELECTIVE}[checkpoint]
    from memplan.profile.frameworks import torchtitan_config, torchtitan_spec

    spec = torchtitan_spec(torchtitan_config(**TITAN["torchtitan"], seq_len=seq), "toy")
    wl = Workload(micro_batch_size=BATCH, seq_len=seq, precision="bf16-pure",
                  recompute=recompute, compile=True, rope_cache="layer",
                  selective_impl="op", float8=recipe)
    dm = Dims.of(spec, ParallelConfig(), wl)
    kind = layer_kind(spec, wl, dm, False, recompute)
    groups = grad_group_params(spec, 1, 1, False)
    stream = dm.rows * spec.hidden_size * dm.e
    backward = _model_backward(kind, groups, dm.e)
    return kind.forward_peak_bytes - stream, backward - stream


def test_compiled_float8_layer_phase_peaks() -> None:
    """torchtitan's block (fused wqkv, bf16) with torchao's rowwise Float8Linears, compiled,
    no recompute, 2 x 256 tokens (T 512, h 256, f 768), traced with Inductor's GPU
    realization rules, one kernel per scheduler node (``compiled_layer_step``; CPU's
    ``_scaled_mm`` counted as its output alone: ``compiled_trace._calls_whole``).

    Forward, 3,365,888 B exact: at the down projection's ``_scaled_mm`` the saved set
    (2,772,992: four times the 2 x 64 set of ``test_compiled_float8_layer_saves_what_the_
    partitioner_saves``) less the input (262,144), beside the product's float8 cast T x f
    393,216 with its row scales 512 x 4, w2's cast 196,608 with 256 x 4, and the output
    T x h x 2 = 262,144. Backward, memplan 6,315,008 B at Inductor's cast kernel after the
    down projection's grad-input matmul (``compiled.float8_swiglu_casts``): the saved set
    beside the product's gradient and up's output gradient (T x f x 2 = 786,432 each),
    gate's in fp32 (1,572,864), the product's float8 cast (393,216) and three bf16 row
    amaxes (3 x 512 x 2), the incoming gradient in the held output's place. The trace holds
    6,148 B more there, the weights' amaxes Inductor hoists to the backward's start (w2's
    per row 768 x 2, four 256 x 2, the product's and two per-column 768 x 2 + 2 x 256 x 2,
    a 4 B scale of ones), not modelled, and 512 B more since the block keeps its complex64
    RoPE table (``compiled_trace._titan_params_to``; with the table cast to a real bf16 one
    the trace read 6,321,156 B), not identified: 6,321,668 B (-0.11%). torchao 0.18.0."""
    pytest.importorskip("torchao.float8")
    from recorded import compiled_layer_step  # tests/traced/recorded.py

    config = {"torchtitan": dict(TITAN["torchtitan"], float8="rowwise")}
    _, forward, backward = compiled_layer_step(config, "bfloat16", BATCH, 256,
                                               gpu_realize=True)
    assert _float8_peaks("rowwise", "none", 256) == (forward, 6_315_008) == (3_365_888,
                                                                             6_315_008)
    assert backward - 6_315_008 == 6_148 + 512


def test_compiled_float8_rebuilt_layer_backward_peak() -> None:
    """torchtitan's block (bf16) with torchao's rowwise Float8Linears, compiled, fully
    recomputed inside the graph, 2 x 256 tokens (T 512, h = q 256, f 768), traced as
    ``test_compiled_float8_layer_phase_peaks``. The backward peaks at the same cast kernel
    (``compiled.float8_swiglu_casts``) beside the rebuilt set, which is the saved set of the
    layer not recomputed (memplan 6,315,008 B there) and the backward's casts that Inductor
    writes in the rebuild, fused with the rebuilt forward's casts of the same tensors
    (``compiled.float8_rebuilt_casts``): the output projection's input cast T x q =
    131,072, its weight's cast q x h = 65,536 and their per-column amaxes 2 x 256 x 2
    (197,632), gate's and up's weights' casts 2 x (768 x 256 + 256 x 2) = 394,240:
    6,906,880 B (memplan 591,872 under before, -8.6%). The trace holds 3,076 B more, not
    identified (the layer not recomputed: 6,148 B of hoisted amaxes). torchao 0.18.0."""
    pytest.importorskip("torchao.float8")
    from recorded import compiled_layer_step  # tests/traced/recorded.py

    config = {"torchtitan": dict(TITAN["torchtitan"], float8="rowwise")}
    _, _, backward = compiled_layer_step(config, "bfloat16", BATCH, 256, checkpoint="full",
                                         gpu_realize=True)
    assert _float8_peaks("rowwise", "full", 256)[1] == 6_315_008 + 197_632 + 394_240
    assert backward - 6_906_880 == 3_076


@pytest.mark.parametrize("recipe,modelled,traced", [("rowwise", 7_102_976, 7_105_028),
                                                     ("tensorwise", 5_722_160, 5_720_094)])
def test_compiled_float8_per_op_sac_backward_peak(recipe: str, modelled: int,
                                                  traced: int) -> None:
    """torchtitan's block (fused wqkv, bf16) with torchao's Float8Linears inside its per-op
    SAC, compiled, 2 x 256 tokens (T 512, h = q 256, f 768), traced as
    ``test_compiled_float8_layer_phase_peaks``: the backward peaks at the activation's cast
    kernels (``compiled.float8_swiglu_casts``) beside the rebuilt set.

    Rowwise: the layer not recomputed's moment (6,315,008 B), the output projection's
    rebuilt casts (197,632, as in ``test_compiled_float8_rebuilt_layer_backward_peak``) and
    what per-op SAC's rebuild holds of the MLP's backward casts (``compiled.
    float8_sac_mlp_casts``): up's transposed weight cast 768 x 256 with its amax 256 x 2
    (gate's output is kept, its weight cast made later), the MLP norm output's two dim-1
    casts 2 x T x h = 262,144 and the incoming gradient's T x h = 131,072: 7,102,976 B
    (memplan 6,906,880 before, the full recompute's gate and up weight casts, -2.79%). The
    trace holds 2,052 B more: the weights' amaxes Inductor hoists (6,148 B without
    recompute) less one norm's statistics (T x 4) memplan counts and the rebuild does not
    hold (the attention norm's: the kept qkv output stands for its rerun).
    Tensorwise (unchanged): the cast kernel of ``float8_swiglu_casts`` (the product's
    gradient, the four T x f casts and the down weight's gradient) beside gate's kept and
    up's rebuilt outputs, qkv, SDPA's output and logsumexp, the output projection's
    rebuilt output and its two casts: memplan 2,066 B over, that norm's statistics and
    18 B of scalars; Inductor's baseline order, as at 2 x 1,024 tokens
    (``test_compiled_float8_per_op_sac_baseline_order``). Both within 0.05% of the trace.
    torchao 0.18.0."""
    pytest.importorskip("torchao.float8")
    from recorded import compiled_layer_step  # tests/traced/recorded.py

    config = {"torchtitan": dict(TITAN["torchtitan"], float8=recipe)}
    _, _, backward = compiled_layer_step(config, "bfloat16", BATCH, 256, checkpoint="op",
                                         gpu_realize=True)
    assert _float8_peaks(recipe, "op", 256)[1] == modelled
    if recipe == "rowwise":
        assert modelled == 6_315_008 + 197_632 + (196_608 + 512 + 3 * 131_072)
    assert backward == traced
    assert abs(modelled - traced) <= 0.0005 * traced


def test_compiled_float8_per_op_sac_baseline_order() -> None:
    """torchtitan's block (fused wqkv, bf16, its complex64 RoPE table) with torchao's
    tensorwise Float8Linears inside its per-op SAC, compiled, 2 x 1,024 tokens (T 2,048,
    h = q 256, kv 64, f 768), traced as ``test_compiled_float8_layer_phase_peaks`` (SDPA's
    CPU flash backward counted as its outputs: ``compiled_trace._calls_whole``). Inductor's
    ``reorder_for_peak_memory`` keeps its baseline order (its log: baseline 19,144,734 B,
    lpmf 19,374,128, dfs 20,914,212, bfs 24,223,776), so the backward peaks at the kernels
    ``compiled.float8_swiglu_casts`` models: beside the rebuilt set and the product's
    gradient (T x f x 2 = 3,145,728) the four T x f float8 casts 4 x (1,572,864 + 4) and
    down's weight gradient 256 x 768 x 2 = 393,216: memplan 21,512,240 B, 8,210 B over the
    trace's 21,504,030 (the attention norm's statistics, T x 4, recomputed at the layer's
    end, and 18 B of scalars). (With the table cast to a real one, as the trace harness did
    before ``compiled_trace._titan_params_to``, Inductor estimated lpmf at 18,980,912 B and
    kept lpmf's order, the trace's peak at 20,029,488 B.)"""
    pytest.importorskip("torchao.float8")
    from recorded import compiled_layer_step  # tests/traced/recorded.py

    config = {"torchtitan": dict(TITAN["torchtitan"], float8="tensorwise")}
    _, _, backward = compiled_layer_step(config, "bfloat16", BATCH, 1024, checkpoint="op",
                                         gpu_realize=True)
    assert backward == 21_504_030
    assert _float8_peaks("tensorwise", "op", 1024)[1] == backward + 8_210
    assert _float8_peaks("tensorwise", "op", 256)[1] == 5_722_160  # the same order


def test_compiled_float8_separate_qkv_lpmf_order() -> None:
    """torchtitan's block with separate q/k/v (bf16, its complex64 RoPE table) and torchao's
    tensorwise Float8Linears, compiled, no recompute, 2 x 1,024 tokens (T 2,048, h = q 256,
    kv 64, f 768), traced as ``test_compiled_float8_layer_phase_peaks``. Inductor's
    ``reorder_for_peak_memory`` keeps ``topological_sort_lpmf``'s order (its log: baseline
    19,873,832 B, lpmf 19,382,334; ``compiled.float8_lpmf_grad_in_first``): the backward
    peaks at up's grad-input ``_scaled_mm``, beside the saved set and the product's gradient
    (T x f x 2 = 3,145,728): gate's and up's dim-0 casts 2 x (1,572,864 + 4), up's input
    gradient T x h x 2 = 1,048,576, the transposed float8 weights of q, k, v, o, gate and up
    65,536 + 2 x 16,384 + 65,536 + 2 x 196,608 = 557,056, the casts of SDPA's output and of
    the incoming gradient's dim 1 2 x 524,288, the RoPE table's conjugate 1,024 x 16 x 8 =
    131,072, 20 B of scalars (``compiled.float8_lpmf_scalars``) and no weight gradient:
    memplan 20,168,766 B, the trace exact (3.7% over before, the baseline's moment: the four
    casts and down's weight gradient). Inductor's estimates, less the held output
    (1,048,576): the baseline's moment with its own scalars, 20,922,426 - 18 - 1,048,576 =
    19,873,832 (its log the same); lpmf's plus two tables (the RoPE table's ``reshape`` and
    ``_conj`` fallbacks, each estimated at two tables, freed as one), 20,168,766 - 1,048,576
    + 262,144 = 19,382,334 (its log the same). With
    fused wqkv the baseline stays (``_float8_peaks("tensorwise", "none", 1024)``, the trace
    20,922,396 B: benchmarks/data/compiled_backward.json). torchao 0.18.0."""
    pytest.importorskip("torchao.float8")
    from memplan.model.layer import grad_group_params
    from recorded import compiled_layer_step  # tests/traced/recorded.py
    from memplan.profile.frameworks import torchtitan_config, torchtitan_spec

    config = {"torchtitan": dict(TITAN["torchtitan"], fuse_qkv=False, float8="tensorwise")}
    _, _, backward = compiled_layer_step(config, "bfloat16", BATCH, 1024, gpu_realize=True)
    assert backward == 20_168_766
    spec = torchtitan_spec(torchtitan_config(**TITAN["torchtitan"], seq_len=1024,
                                             fuse_qkv=False), "toy")
    wl = Workload(micro_batch_size=BATCH, seq_len=1024, precision="bf16-pure",
                  recompute=Recompute.NONE, compile=True, rope_cache="layer",
                  float8="tensorwise")
    dm = Dims.of(spec, ParallelConfig(), wl)
    kind = layer_kind(spec, wl, dm, False, Recompute.NONE)
    stream = dm.rows * spec.hidden_size * dm.e
    modelled = _model_backward(kind, grad_group_params(spec, 1, 1, False), dm.e) - stream
    assert modelled == 20_168_766 == backward


@pytest.mark.parametrize("checkpoint,seq,traced,modelled", [
    ("full", 1024, 21_512_234, 21_512_252), ("op", 1024, 19_914_814, 19_914_814),
    ("op", 256, 5_408_830, 5_408_830)])
def test_compiled_float8_separate_qkv_rebuilt(checkpoint: str, seq: int, traced: int,
                                              modelled: int) -> None:
    """torchtitan's block as torchtitan builds it (separate q/k/v, bf16, its complex64 RoPE
    table) with tensorwise Float8Linears, compiled, the checkpoint inside the graph, 2 x
    1,024 or 2 x 256 tokens (h = q 256, kv 64, f 768). Full AC: Inductor keeps its baseline
    order (its log: baseline = lpmf), so the backward peaks at ``compiled.
    float8_swiglu_casts``' cast kernels beside the rebuilt set, the fused block's moment and
    its 18 B of scalars (``test_compiled_float8_per_op_sac_baseline_order``): the trace
    21,512,234 B, the fused block's 21,512,240 less 6 B of scalars (memplan was 753,642 B
    under, -3.5%, with the lpmf moment of the block not rebuilt, ``compiled.
    float8_lpmf_grad_in_first``, which now leaves full AC out).

    Per-op SAC: Inductor takes lpmf (its log: 19,259,454 B against the baseline's
    20,193,324 at 2 x 1,024; 5,244,990 against 5,392,428 at 2 x 256), and the backward
    peaks at up's grad-input ``_scaled_mm`` (``compiled_order.with_float8_sac_lpmf``). By
    hand at T 2,048, beside the held output: the policy's kept outputs (q T x q x 2 =
    1,048,576, v T x kv x 2 = 262,144, gate T x f x 2 = 3,145,728, SDPA's output
    1,048,576 and logsumexp 2 x 8 x 1,024 x 4 = 65,536; the kept q now the RoPE'd q), the
    input 1,048,576, the MLP norm's statistics T x 4 = 8,192, the rebuilt outputs of the
    output projection (1,048,576) and up (3,145,728), the product's gradient 3,145,728,
    gate's and up's dim-0 gradient casts 2 x 1,572,864, the casts of SDPA's output and of
    the incoming gradient's dim 1 2 x 524,288, the transposed float8 weights of q, k, v, o,
    gate and up 557,056, the rerun k projection's weight cast 64 x 256 = 16,384, up's input
    gradient 1,048,576, the RoPE table's conjugate 1,024 x 16 x 8 = 131,072, the incoming
    gradient 1,048,576 and 62 B of scalars: 19,914,814 B, the trace exact (memplan 843,778
    B over before, +4.2%, the rerun's whole saved set; +5.8% at 2 x 256). torchao 0.18.0."""
    pytest.importorskip("torchao.float8")
    from memplan.model.layer import grad_group_params
    from memplan.profile.frameworks import torchtitan_config, torchtitan_spec
    from recorded import compiled_layer_step  # tests/traced/recorded.py

    config = {"torchtitan": dict(TITAN["torchtitan"], fuse_qkv=False, float8="tensorwise")}
    _, _, backward = compiled_layer_step(config, "bfloat16", BATCH, seq,
                                         checkpoint=checkpoint, gpu_realize=True)
    assert backward == traced
    spec = torchtitan_spec(torchtitan_config(**TITAN["torchtitan"], seq_len=seq,
                                             fuse_qkv=False), "toy")
    recompute = Recompute.FULL if checkpoint == "full" else Recompute.SELECTIVE
    wl = Workload(micro_batch_size=BATCH, seq_len=seq, precision="bf16-pure",
                  recompute=recompute, selective_impl="op", compile=True,
                  rope_cache="layer", float8="tensorwise")
    dm = Dims.of(spec, ParallelConfig(), wl)
    kind = layer_kind(spec, wl, dm, False, recompute)
    stream = dm.rows * spec.hidden_size * dm.e
    assert _model_backward(kind, grad_group_params(spec, 1, 1, False), dm.e) - stream == modelled
    if checkpoint == "full":
        assert modelled - traced == 18
    elif seq == 1024:
        t = BATCH * seq
        th, tf = t * 256 * 2, t * 768 * 2
        assert modelled == (th + t * 64 * 2 + tf + th + 2 * 8 * seq * 4  # kept
                            + t * 4 + th + tf + tf + 2 * t * 768 + 2 * t * 256 + 557_056
                            + 16_384 + th + seq * 16 * 8 + th + 62)  # + the input, - held


def test_cpu_flash_backward_counted_as_its_outputs() -> None:
    """SDPA's CPU flash backward (q 2 x 8 x 1,024 x 32 bf16, k and v alike, causal) holds
    per-thread scratch inside the call (FlashAttentionKernel.cpp
    ``cpu_flash_attention_backward``: ``buf``, ``buf_reduced``), which grows with the
    thread count, and a contiguous copy of the output's gradient, both freed before it
    returns; ``compiled_trace._calls_whole`` counts the call as its outputs, dq, dk and
    dv, 3 x 2 x 8 x 1,024 x 32 x 2 = 3,145,728 B, on one thread and on two (the gradients
    taken with ``torch.autograd.grad``: no leaf's copy of them)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from memplan.profile.compiled_trace import _calls_whole

    threads = torch.get_num_threads()
    q, k, v = (torch.randn(2, 8, 1024, 32, dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))
    peaks = []
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
            grad = torch.ones_like(out)
            with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
                grads = torch.autograd.grad(out, (q, k, v), grad)
            events = prof.profiler.kineto_results.events()
            raw = alive = whole = 0
            for event in sorted((e for e in events if e.name() == "[memory]"),
                                key=lambda e: e.start_ns()):
                alive += event.nbytes()
                raw = max(raw, alive)
            alive = 0
            for _, nbytes in _calls_whole(events):
                alive += nbytes
                whole = max(whole, alive)
            peaks.append((raw, whole))
            del grads
    finally:
        torch.set_num_threads(threads)
    assert [whole for _, whole in peaks] == [3_145_728, 3_145_728]
    assert peaks[1][0] > peaks[0][0] > 3_145_728  # the scratch, by thread count


@pytest.mark.parametrize("recipe,checkpoint,over", [("tensorwise", "full", 5_056),
                                                    ("rowwise", "op", 0)])
def test_compiled_float8_checkpointed_forward(recipe: str, checkpoint: str, over: int) -> None:
    """torchtitan's block (fused wqkv, bf16, torchao's Float8Linears) checkpointed inside the
    compiled graph, 2 x 64 tokens (T 128, h 256, f 768): the forward peaks at up's matmul.

    Full: the output projection's output (T x h x 2 = 65,536), the MLP norm's float8 cast
    (T x h + a 4 B scale: 32,772), gate's output (T x f x 2 = 196,608), up's weight cast
    (196,608 + 4) and up's output (196,608): 688,136 B, no bf16 norm output (Inductor fuses
    the norm into the casts' kernels: ``compiled.float8_input_fused``; memplan one T x h
    over before). The trace holds 5,056 B more, the CPU generator's state the checkpoint
    saves, as without float8. Per-op SAC, rowwise: the same moment (the casts' scales one
    per row: 128 x 4 for the norm's, 768 x 4 for w3's: 691,712) and the save list's outputs
    but the gate's, which is that moment's own (``compiled.float8_gate_held``: memplan
    196,608 over before): the input 65,536, qkv T x 384 x 2 = 98,304, SDPA's output 65,536
    and logsumexp 4,096 (430,080 less the input and the gate), 859,648 B exact."""
    pytest.importorskip("torchao.float8")
    from recorded import compiled_layer_step  # tests/traced/recorded.py

    config = {"torchtitan": dict(TITAN["torchtitan"], float8=recipe)}
    _, forward, _ = compiled_layer_step(config, "bfloat16", BATCH, SEQ, checkpoint=checkpoint,
                                        gpu_realize=True)
    modelled = _float8_peaks(recipe, checkpoint, SEQ)[0]
    assert modelled == (688_136 if checkpoint == "full" else 859_648)
    assert forward - modelled == over


def _traced_tp_activations(config: dict, checkpoint: str, rows: int) -> int:
    """The saved bytes of a compiled TP block on its rank: what the forward made (not the
    views of the sharded weights, their transposes for backward) and the layer's input."""
    saved = compiled_layer_saved(config, "bfloat16", BATCH, SEQ, checkpoint=checkpoint)
    stream = (BATCH, rows, 256)
    return sum(t.size_bytes for t in saved
               if not t.input_view and (not t.graph_input or t.shape == stream))


@pytest.mark.parametrize("tp,sp,recipe,fuse_qkv,over", [
    (2, True, "rowwise", False, 0), (2, False, "rowwise", False, 0),
    (4, True, "rowwise", False, 0), (2, True, "rowwise", True, 0),
    (2, True, "tensorwise", False, 50), (2, False, "tensorwise", False, 50),
    (2, True, "none", False, 0)])
def test_compiled_tp_layer_under_per_op_sac(tp: int, sp: bool, recipe: str, fuse_qkv: bool,
                                            over: int) -> None:
    """torchtitan's block (bf16) on rank 0 of a TP mesh of the fake process
    group, inside its per-op SAC, compiled (``memplan.model.compiled.sac_tp_terms``; torchao
    0.18.0, rowwise: 0.3.0's sharding configs with Float8Linear, tensorwise: torchao's float8
    TP styles). At tp 2 with SP (T = 128, h 256, 4 local heads of 32, 1 KV head, ffn 384 a
    rank, bf16): the input shard 64 x 256 x 2 = 32,768, the odd matmuls' outputs q
    128 x 128 x 2 = 32,768, v 8,192 and w1 128 x 384 x 2 = 98,304, SDPA's output 32,768 and
    logsumexp 2 x 4 x 64 x 4 = 2,048, the output projection's reduce-scattered output
    32,768: 239,616 B traced in bf16. Rowwise adds per norm the gathered input's row scales
    (128 x 4) and per column-parallel linear (q, k, v, w1, w3) its weight's backward scales
    (256 x 4): 239,616 + 1,024 + 5,120 = 245,760 B traced. Without SP the input is
    65,536, no reduce-scatter, and the down projection's output 128 x 256 x 2 = 65,536 is
    saved: 305,152 B (rowwise 311,296 traced). Tensorwise: the bf16 set and 11 bf16 amaxes
    and 7 fp32 scalars, 50 B memplan leaves out. At tp 4 (4 KV heads) rowwise: 130,048 B.
    Fused wqkv (0.3.0's default) at tp 2 with SP: qkv 128 x 192 x 2 = 49,152 kept in place
    of q and v, so no rerun reads the attention input's cast: 247,808 + 512 + 3 x 1,024 =
    251,392 B traced."""
    pytest.importorskip("torchao.float8")
    pytest.importorskip("torchtitan")
    kv = 4 if tp == 4 else 2
    fields = dict(TITAN["torchtitan"], n_kv_heads=kv, fuse_qkv=fuse_qkv)
    config = {"torchtitan": dict(fields, tp=tp, sp=sp, float8=recipe)}
    from memplan.profile.frameworks import torchtitan_config, torchtitan_spec

    spec = torchtitan_spec(torchtitan_config(**fields, seq_len=SEQ), "llama3-toy")
    wl = Workload(micro_batch_size=BATCH, seq_len=SEQ, precision="bf16-pure",
                  recompute=Recompute.SELECTIVE, compile=True, rope_cache="layer",
                  selective_impl="op", float8=recipe)
    par = ParallelConfig(tp=tp, sequence_parallel=sp, tp_style="dtensor")
    dm = Dims.of(spec, par, wl)
    modelled = layer_kind(spec, wl, dm, False, Recompute.SELECTIVE).saved_bytes
    traced = _traced_tp_activations(config, "op", SEQ // tp if sp else SEQ)
    assert traced - modelled == over


@pytest.mark.parametrize("tp,sp,kv,under", [(2, True, 2, 14), (2, False, 2, 2),
                                             (4, True, 4, 14)])
def test_compiled_float8_tp_layer_without_recompute(tp: int, sp: bool, kv: int,
                                                    under: int) -> None:
    """torchtitan's block (bf16, separate q/k/v) with torchao's tensorwise float8 TP styles on
    rank 0 of a TP mesh of the fake process group, compiled, no recompute
    (``memplan.model.compiled.float8_tp_weights``, ``float8_tp_gathered_kept``; torchao
    0.18.0). At tp 2 with SP (T = 128, h 256, 4 local heads of 32, 1 KV head, ffn 384 a
    rank): the compiled float8 set at tp 1 on the rank's shards (the input shard 64 x 256 x 2
    = 32,768, q 32,768, k and v 8,192 each, SDPA's output 32,768 and logsumexp 2,048, the
    reduce-scattered output projection 32,768, the gate and up outputs 98,304 each, two norms'
    statistics 256 each, the float8 inputs of the output and down projections 128 x 128 and
    128 x 384: 16,384 + 49,152), and beyond it the float8 casts of the seven weight shards,
    (128 + 32 + 32) x 256 + 256 x 128 + 2 x 384 x 256 + 256 x 384 = 376,832 B, and of the
    two norms' all-gathered outputs, 2 x 128 x 256 = 65,536 B: 854,572 B traced with the fp32
    scalars. memplan counts 14 B of scalars more (one fp32 scale per float8 cast, the bf16
    amaxes); without SP the norms' casts are recomputed (2 B); at tp 4 (4 KV heads) the
    shards are half as wide."""
    pytest.importorskip("torchao.float8")
    pytest.importorskip("torchtitan")
    fields = dict(TITAN["torchtitan"], n_kv_heads=kv, fuse_qkv=False)
    config = {"torchtitan": dict(fields, tp=tp, sp=sp, float8="tensorwise")}
    from memplan.profile.frameworks import torchtitan_config, torchtitan_spec

    spec = torchtitan_spec(torchtitan_config(**fields, seq_len=SEQ), "llama3-toy")
    wl = Workload(micro_batch_size=BATCH, seq_len=SEQ, precision="bf16-pure",
                  recompute=Recompute.NONE, compile=True, rope_cache="layer",
                  float8="tensorwise")
    par = ParallelConfig(tp=tp, sequence_parallel=sp, tp_style="dtensor")
    from memplan.parallel import validate

    validate(spec, par, wl)  # no longer refused
    dm = Dims.of(spec, par, wl)
    modelled = layer_kind(spec, wl, dm, False, Recompute.NONE).saved_bytes
    traced = _traced_tp_activations(config, "none", SEQ // tp if sp else SEQ)
    assert modelled - traced == under
    if (tp, sp) == (2, True):
        assert traced == 854_572


# transformers' MoE layers cut to one layer of toy widths (tests/traced/test_frameworks.py's)
QWEN3_MOE = hf("Qwen3-30B-A3B", num_hidden_layers=1, hidden_size=128, intermediate_size=256,
               num_attention_heads=4, num_key_value_heads=2, head_dim=32, vocab_size=512,
               num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64)
MIXTRAL = hf("Mixtral-8x7B-v0.1", num_hidden_layers=1, hidden_size=128, intermediate_size=256,
             num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
             vocab_size=512)


def _moe_spec(config: dict):
    """The MoE toy's spec with the installed transformers' router dtype (``frameworks.
    _router_dtype``: 5.23's Qwen-style router casts its top-k weights, 5.3's kept them
    fp32), read off the model built on the meta device."""
    import torch
    import transformers

    from memplan.profile.frameworks import _router_dtype

    keep = {k: v for k, v in config.items() if k not in ("quantization_config", "auto_map")}
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(
            transformers.AutoConfig.for_model(**keep))
    return _router_dtype(model, spec_from_hf_dict(config, "moe-toy", "moe-toy"))


def _moe_impl() -> str:
    """How the installed transformers' grouped experts gather (``frameworks.
    gathers_by_token``): 5.3 by token, then a sorted copy (grouped-token); 5.23 once, sorted
    (grouped)."""
    from memplan.profile.frameworks import gathers_by_token

    return "grouped-token" if gathers_by_token() else "grouped"


# the MoE toys' compiled saved set (``test_compiled_moe_layer_saves_what_the_partitioner_
# saves``), traced per gather: 5.23's (grouped) saves perm // k (S int64, 2,048) and neither
# the flattened top-k indices (2,048) nor the sorted fp32 weights (1,024): 1,024 fewer
_MOE_SAVED = {("qwen3-moe", "grouped-token"): 525_328, ("mixtral", "grouped-token"): 768_016,
              ("qwen3-moe", "grouped"): 524_304, ("mixtral", "grouped"): 766_992}


@pytest.mark.parametrize("config,name", [(QWEN3_MOE, "qwen3-moe"), (MIXTRAL, "mixtral")],
                         ids=["qwen3-moe", "mixtral"])
@pytest.mark.parametrize("checkpoint", ["none", "full"])
def test_compiled_moe_layer_saves_what_the_partitioner_saves(config: dict, name: str,
                                                             checkpoint: str) -> None:
    """transformers' grouped experts (``grouped_mm_experts_forward``: ``aten._grouped_mm`` on
    CPU in bf16) compiled in a Qwen3-MoE and a Mixtral layer (``memplan.model.compiled.
    moe_terms``), the installed version's gather (``_moe_impl``): T = 128 tokens, k = 2
    (S = 256 routed rows), E = 4, h = 128. The MoE block saves the router's bf16 logits
    128 x 4 x 2 = 1,024, the fp32 top-k values 128 x 2 x 4 = 1,024 (5.23's Qwen3-MoE router
    casts them to bf16: the cast is recomputed), the top-k indices, the sort and its inverse
    (int64, 256 x 8 = 2,048 each), the sorted gathered rows 256 x 128 x 2 = 65,536, gate/up
    256 x 2f x 2, SiLU(gate) * up 256 x f x 2, the down output 65,536 and the offsets (4
    int32, 16); 5.3 (grouped-token) the flattened top-k indices (2,048) and the sorted fp32
    weights (1,024) too, 5.23 (grouped) the gathered rows' token index perm // k (2,048)
    instead. With Qwen3-MoE's f = 64, 5.3: 238,608 + 2,048 = 240,656 of its 525,328 B (its
    attention and norms as a dense layer's, the q/k norms among them), 5.23: 524,304;
    Mixtral's f = 256: 768,016 B, 5.23 766,992. Inside full checkpointing the layer's
    input."""
    impl = _moe_impl()
    wl = Workload(micro_batch_size=BATCH, seq_len=SEQ, precision="bf16-pure", compile=True,
                  moe_impl=impl,
                  recompute=Recompute.FULL if checkpoint == "full" else Recompute.NONE)
    spec = _moe_spec(config)
    from memplan.parallel import validate

    validate(spec, ParallelConfig(), wl)
    dm = Dims.of(spec, ParallelConfig(), wl)
    modelled = layer_kind(spec, wl, dm, True, wl.recompute).saved_bytes
    assert modelled == _traced_activations(config, "bfloat16", checkpoint, width=128)
    if checkpoint == "none":
        assert modelled == _MOE_SAVED[name, impl]


@pytest.mark.parametrize("name,model", [("qwen3-moe-toy", "Qwen3-30B-A3B"),
                                        ("mixtral-toy", "Mixtral-8x7B-v0.1")])
def test_compiled_moe_model_step_matches_trace(name: str, model: str) -> None:
    """A whole transformers MoE model (2 layers, the toy widths above) in bf16, each decoder
    layer compiled on its own as torchtune and torchtitan compile them (``build_hf``'s
    ``compile``; Dynamo breaks each MoE block's graph at transformers'
    ``is_grouped_mm_available`` logger, as a real run does), two training steps traced on
    real tensors: states and saved activations exact, every phase within 1% (Qwen3-MoE
    within 0.04%)."""
    from memplan.profile.frameworks import FrameworkCase
    from recorded import compare_framework  # tests/traced/recorded.py

    widths = {"Qwen3-30B-A3B": {"head_dim": 32, "num_experts": 4, "num_experts_per_tok": 2,
                                "moe_intermediate_size": 64},
              "Mixtral-8x7B-v0.1": {"num_local_experts": 4}}[model]
    config = hf(model, num_hidden_layers=2, hidden_size=128, intermediate_size=256,
                num_attention_heads=4, num_key_value_heads=2, vocab_size=512, **widths)
    rows = compare_framework(FrameworkCase("transformers", name, config, "bf16-pure", 2, 64,
                                           options={"compile": True})).rows
    shown = "\n".join(f"{r.name}: measured {r.measured_bytes:,} estimated "
                      f"{r.estimated_bytes:,}" for r in rows)
    for row in rows:
        if row.name in ("params_bytes", "grads_bytes", "optimizer_bytes", "activations_bytes"):
            assert row.estimated_bytes == row.measured_bytes, shown
        else:
            assert row.estimated_bytes == pytest.approx(row.measured_bytes, rel=0.01), shown


# memplan's compiled MoE layer's backward peak less the traced one, per gather
# (``test_compiled_moe_layer_phase_peaks``): Inductor's backward schedule is not modelled
_MOE_BACKWARD_OVER = {("qwen3-moe", "grouped-token"): -2_048,
                      ("mixtral", "grouped-token"): 133_616,
                      ("qwen3-moe", "grouped"): -19_472, ("mixtral", "grouped"): 133_616}


@pytest.mark.parametrize("config,name", [(QWEN3_MOE, "qwen3-moe"), (MIXTRAL, "mixtral")],
                         ids=["qwen3-moe", "mixtral"])
def test_compiled_moe_layer_phase_peaks(config: dict, name: str) -> None:
    """The compiled MoE layer's forward and backward peaks (``compiled_layer_peaks``, as
    ``test_compiled_layer_phase_peaks``) against memplan's layer moments, the installed
    version's gather (``_moe_impl``). Forward: the saved set and the block's output, no eager
    working set (``MoEBlock.forward_moments`` compiled): traced 525,328 B (Qwen3-MoE) and
    768,016 B (Mixtral) on 5.3, 524,304 B and 766,992 B on 5.23, exact. Backward, from the
    unsort's compiled start (R h of the index_put in the routing weights' width and the bf16
    down output's gradient beside the saved set, ``_compiled_unsort``) and the eager grouped
    MLP's buffers. 5.3, traced with Inductor's GPU realization rules (``gpu_realize``):
    Qwen3-MoE 723,984 B, memplan 2,048 under (-0.28%); Mixtral (expert ffn 256) 1,279,504 B,
    memplan 133,616 over (+10.44%) at the gate/up weight gradient, whose buffers are the
    eager model's, not Inductor's schedule (with the CPU's rules 1,355,792 B: Inductor orders
    the backward otherwise at 2 x 64). 5.23 (grouped, traced with the CPU's rules:
    one gather, so one index backward fewer): Qwen3-MoE traced 698,384 B at the unsort
    (its weights bf16: beside the saved set two R h bf16 tensors, a T h bf16 one, four S
    int64 ones and some of S or T elements), memplan 678,912, 19,472 under
    (-2.79%); Mixtral 1,279,504 B at the gate/up weight gradient, memplan 1,413,120,
    133,616 over (+10.44%). Not modelled: Inductor's backward buffers."""
    from memplan.model.layer import grad_group_params
    from recorded import compiled_layer_peaks  # tests/traced/recorded.py

    spec = _moe_spec(config)
    impl = _moe_impl()
    wl = Workload(micro_batch_size=BATCH, seq_len=SEQ, precision="bf16-pure", compile=True,
                  moe_impl=impl)
    dm = Dims.of(spec, ParallelConfig(), wl)
    kind = layer_kind(spec, wl, dm, True, Recompute.NONE)
    groups = grad_group_params(spec, 1, 1, True)
    stream = BATCH * SEQ * config["hidden_size"] * 2
    backward = _model_backward(kind, groups, 2)
    traced_forward, traced_backward = compiled_layer_peaks(config, "bfloat16", BATCH, SEQ,
                                                           gpu_realize=True)
    assert kind.forward_peak_bytes - stream == traced_forward
    assert backward - stream - traced_backward == _MOE_BACKWARD_OVER[name, impl]


# torchtitan's block with fused wqkv, as the compiled-layer traces build it
TITAN_FUSED = {"torchtitan": dict(TITAN["torchtitan"], fuse_qkv=True)}


def _titan_rebuilt(checkpoint: str, batch: int, seq: int) -> tuple:
    """(spec, workload, dims, layer kind, backward peak with its weight gradients, one
    stream tensor's bytes) of ``TITAN_FUSED`` in bf16 recomputed inside the compiled graph
    (``checkpoint`` "full", else torchtitan's per-op SAC)."""
    from memplan.model.layer import grad_group_params

    spec = _spec("torchtitan", True)
    recompute = Recompute.FULL if checkpoint == "full" else Recompute.SELECTIVE
    wl = Workload(micro_batch_size=batch, seq_len=seq, precision="bf16-pure",
                  recompute=recompute, compile=True, rope_cache="layer", selective_impl="op")
    dm = Dims.of(spec, ParallelConfig(), wl)
    kind = layer_kind(spec, wl, dm, False, recompute)
    groups = grad_group_params(spec, 1, 1, False)
    stream = batch * seq * 256 * 2
    backward = _model_backward(kind, groups, 2, held=stream)
    return spec, wl, dm, kind, backward, stream


@pytest.mark.parametrize("checkpoint,traced_backward", [("full", 6_443_008),
                                                      ("op", 6_178_816)])
def test_compiled_recompute_backward_at_the_mlp_kernel(checkpoint: str,
                                                       traced_backward: int) -> None:
    """torchtitan's block (fused wqkv, bf16) recomputed inside the compiled graph, at 2 x 256
    tokens (T = 512, where the MLP's T x f activations outweigh its weights' gradients,
    unlike the 2 x 64 toy; one kernel per scheduler node): the backward peaks at the fused
    kernel of the product's and SiLU's backward, which reads gate, up and the down
    projection's input gradient and writes three new T x f tensors (the product, for the down
    weight's gradient, and both gradients), before any of the MLP's weight gradients
    (``compiled.swiglu_moments``). By hand, S = T h 2 = 262,144 B, F = T f 2 = 786,432 B.

    Full AC: the rebuilt set is the layer's saved set without recompute (6.5 S + 3 F + the
    two rsqrt, 4,096 B, and the logsumexp, 16,384 B = 4,083,712 B) less the layer's input plus
    the held output, and 3 F: 6,443,008 B traced, memplan exact (before, the eager order's
    moments: 6,049,792 B, -6.1%; at 2 x 1,024 tokens -10.7%: benchmarks/
    compiled_backward.py). torchtitan's per-op SAC: the attention side is rebuilt later, for
    its own backward (``compiled.sac_deferred``), so its norm's output (S) and rsqrt
    (2,048 B) are not alive there, and the kept qkv output stands for q, k and v: 6,443,008
    - 264,192 = 6,178,816 B traced, memplan exact (before, +4.3% at 2 x 1,024 with the
    kernel's moment, -2.1% here without it); its forward peaks as full AC's, whose working
    set holds the gate's output the policy keeps: 2,768,896 B traced, memplan exact (before,
    the gate counted twice: +28.4%). Traced with Inductor's GPU realization rules
    (``gpu_realize``), the same bytes as with the CPU's."""
    from recorded import compiled_layer_step  # tests/traced/recorded.py

    batch, seq = 2, 256
    spec, wl, dm, kind, backward, stream = _titan_rebuilt(checkpoint, batch, seq)
    saved_none = layer_kind(spec, wl.model_copy(update={"recompute": Recompute.NONE}), dm,
                            False, Recompute.NONE).saved_bytes
    assert saved_none == 4_083_712
    assert 6_443_008 == saved_none + 3 * batch * seq * 768 * 2
    _, forward, traced = compiled_layer_step(TITAN_FUSED, "bfloat16", batch, seq,
                                             checkpoint=checkpoint, gpu_realize=True)
    assert traced == traced_backward
    assert backward - stream == traced
    if checkpoint == "op":
        assert kind.forward_peak_bytes - stream == forward == 2_768_896


@pytest.mark.parametrize("checkpoint,seq,traced_backward,over", [
    ("full", 96, 2_422_272, 0), ("full", 64, 1_901_568, 0), ("op", 64, 1_901_568, 0),
    ("op", 96, 2_427_648, 0), ("op", 88, 2_171_264, 0)])
def test_compiled_attention_backward_below_hidden(checkpoint: str, seq: int,
                                                  traced_backward: int, over: int) -> None:
    """torchtitan's block (fused wqkv, bf16) recomputed inside the compiled graph with fewer
    tokens than the hidden size (T 192 and 128 < h 256), where the MLP's weight gradients
    outweigh its T x f activations, traced with Inductor's GPU realization rules
    (``gpu_realize``; one kernel per scheduler node). By hand, S = T h 2, K = T 64 2, F = T f
    2, the MLP's weight gradients 1,179,648 B, all of the layer's 1,508,352 B, the table
    seq x 16 x 8:

    - full AC at 2 x 96 (S 98,304, K 24,576), Inductor's own order (lpmf does not defer the
      MLP's weight gradients: 768 x 64 = 192 x 256, ``compiled_order.lpmf_defers_mlp_grads``):
      the peak at q's RoPE backward after SDPA's, the norms' and the attention projections'
      weight gradients and the residual sums deferred to the layer's end
      (``compiled.attention_backward_moments``): alive 7 S + two statistics (2 x 768) =
      689,664; in flight 2 S + 2 K + q's fp32 upcast and product (2 x 196,608) + the table's
      conjugate (12,288) = 651,264; less one stream: 2,422,272 B, the trace exact. The SDPA
      output's gradient (S) is freed after SDPA's backward, not held for the q/k/v input
      gradient (``compiled.with_sdpa_grad_reuse``): Inductor's reuse check estimates
      2,250,240 + 98,304 B against its peak 2,342,400 (the MLP's kernel);
    - 2 x 64 (S 65,536, F 196,608), full AC and per-op SAC alike: Inductor takes lpmf's order
      (``compiled_order.with_lpmf_order``: estimates 1,852,416 B against the baseline's
      1,893,376 and 1,888,768), which runs the MLP's weight gradients last: at the gate's,
      every weight gradient, the input gradient, the MLP norm's output and gate's output
      gradient beside the held output: 3 S + F + 1,508,352 = 1,901,568 B, the trace exact
      (memplan +5.6% and +10.7% before, at q's RoPE backward in the baseline's order);
    - per-op SAC at 2 x 96, the baseline's order: the peak at the rerun's RoPE of q after the
      MLP's backward (``compiled_order.sac_rerun_rope``): alive 5 S + SDPA's output gradient
      S + the kept q/k/v (T 384 2 = 147,456), SDPA output (S) and logsumexp (6,144) + the MLP
      norm's statistics 768 = 842,496; in flight S + 2 x 196,608 + 12,288 = 503,808; less one
      stream: 2,427,648 B, the trace exact. At q's RoPE backward the wrapper holds k's fp32
      upcast but neither S buffer (``compiled_order.with_sac_order``): 2,372,352 B there
      (memplan +5.8% before, holding both);
    - per-op SAC at 2 x 88 (S 90,112, F 270,336; 176 x 1,024 < 768 x 256): lpmf's order,
      its peak at q's RoPE backward (``compiled_order.sac_lpmf_rope``): alive 6 S + 3 F + 704
      + the held SDPA output gradient and RoPE'd q (2 S) and statistics (704); in flight S +
      the q/k/v gradient 135,168 + 2 x 180,224 + 11,264; the output projection's weight
      gradient 131,072; less one stream: 2,171,264 B, the trace exact (-1.7% before)."""
    from recorded import compiled_layer_step  # tests/traced/recorded.py

    batch = 2
    _, _, _, kind, backward, stream = _titan_rebuilt(checkpoint, batch, seq)
    s, k, q32, table = stream, batch * seq * 64 * 2, 2 * stream, seq * 16 * 8
    f, stats = batch * seq * 768 * 2, batch * seq * 4
    if seq == 64:
        assert any(m.name == "mlp_grads_last" for m in kind.moments)
        assert backward - stream == 3 * s + f + 1_508_352
    elif seq == 88:
        assert backward - stream == 8 * s + 3 * f + 2 * stats + s + 135_168 + 2 * q32 \
            + table + 131_072 - stream
    elif checkpoint == "full":
        assert backward - stream == 7 * s + 2 * stats + 2 * s + 2 * k + 2 * q32 + table \
            + 1_179_648 - stream
    else:
        attn = batch * seq * 384 * 2 + s + 2 * 8 * seq * 4
        assert backward - stream == 6 * s + attn + stats + s + 2 * q32 + table \
            + 1_179_648 - stream
    assert backward - stream - traced_backward == over
    _, _, traced = compiled_layer_step(TITAN_FUSED, "bfloat16", batch, seq, checkpoint=checkpoint,
                                       gpu_realize=True)
    assert traced == traced_backward


def test_compiled_full_ac_transformers_output_copy() -> None:
    """transformers' ``LlamaDecoderLayer`` (bf16) under full AC inside the compiled graph at
    2 x 256 tokens (T 512 > h 256; one kernel per scheduler node): the backward peaks at the
    MLP's fused kernel, where the rerun holds SDPA's output (head-major, q's layout: RoPE
    rotates the transposed q) and its token-major copy for the output projection
    (``compiled.rerun_output_copy_bytes``). By hand, S = T h 2 = 262,144, F = T f 2 =
    917,504, K = T 64 2 = 65,536: the kernel's six F; the layer's input and incoming
    gradient, the attention norm's output, the RoPE'd q, SDPA's output and its copy, the
    output projection's output, the MLP norm's output (8 S); the RoPE'd k and v (2 K); the
    logsumexp (2 x 8 x 256 x 4 = 16,384) and two norms' statistics (2 x 2,048): 7,753,728,
    less one stream 7,491,584 B traced (Inductor's GPU realization rules, ``gpu_realize``; the
    CPU's the same), memplan exact (before, without the copy: -3.5%)."""
    from memplan.model.layer import grad_group_params
    from recorded import compiled_layer_step  # tests/traced/recorded.py

    batch, seq = 2, 256
    s, f, k = batch * seq * 256 * 2, batch * seq * 896 * 2, batch * seq * 64 * 2
    assert 6 * f + 8 * s + 2 * k + 16_384 + 2 * 2_048 - s == 7_491_584
    spec = _spec("transformers", False)
    wl = Workload(micro_batch_size=batch, seq_len=seq, precision="bf16-pure",
                  recompute=Recompute.FULL, compile=True)
    dm = Dims.of(spec, ParallelConfig(), wl)
    kind = layer_kind(spec, wl, dm, False, Recompute.FULL)
    groups = grad_group_params(spec, 1, 1, False)
    backward = _model_backward(kind, groups, 2)
    assert backward - s == 7_491_584
    _, _, traced = compiled_layer_step(TOY, "bfloat16", batch, seq, checkpoint="full",
                                       gpu_realize=True)
    assert traced == 7_491_584


OLMO2 = hf("OLMo-2-1124-7B", **OLMO2_TOY)


@pytest.mark.parametrize("checkpoint,saved,forward,backward", [
    ("none", 4_759_552, 4_759_552, 5_816_320), ("full", 262_144, 1_839_104, 6_078_464)])
def test_compiled_post_norm_layer_matches_trace(checkpoint: str, saved: int, forward: int,
                                                backward: int) -> None:
    """transformers' ``Olmo2DecoderLayer`` (post norms, full-width q/k norms; h 256, 8 heads
    of 32, all KV heads, ffn 688) in bf16, compiled, at 2 x 256 tokens (T 512; one kernel per
    scheduler node, Inductor's GPU realization rules: ``gpu_realize``), its saved set and
    phase peaks against memplan's layer
    (``compiled.post_norm_backward_bytes``, ``with_post_norm_schedule``,
    ``rerun_whole_mlp``, ``qk_norm_stats_bytes``). By hand, S = T h 2 = 262,144, F = T f 2 =
    704,512, r = T 4 = 2,048, the logsumexp 2 x 8 x 256 x 4 = 16,384, the down weight's
    gradient W = h f 2 = 352,256:

    - no recompute: saved 10 S (the layer's input, q and k before their norms, RoPE'd q and
      k, v, SDPA's output, the output projection's output, the residual sum, the down
      projection's output) + 3 F (gate, up, product) + 4 r + the logsumexp = 4,759,552 B,
      the forward's peak (the output in the input's place); the backward's at the MLP's
      fused kernel: the saved set, the product freed and its gradient and the gate's made,
      the MLP post norm's input and statistics still alive (its weight gradient later), W:
      + F + W = 5,816,320 B. Before: refused; the refusal lifted, the eager moments gave
      5,552,640 B (-4.5%: the post norm's input freed at its own backward);
    - full recompute, the checkpoint inside the compiled graph (transformers' gradient
      checkpointing under the Trainer's ``torch_compile``): saved the input; forward at
      RoPE's kernel 7 S + the q and k norms' statistics 2 r = 1,839,104 B (before, without
      them: -0.2%); backward at the MLP's fused kernel: the rerun's whole MLP (the saved
      set's 10 S, 3 F, 4 r and logsumexp; the product's buffer holding its gradient; no
      SiLU(gate) buffer: a GPU's lowering inlines it), SDPA output's token-major copy S, the
      output's held place S, the gate's gradient F and W (the post norm's input gradient
      freed): 11 S + 4 F + 4 r + 16,384 + W = 6,078,464 B. Inductor's CPU rules also make
      SiLU(gate) a buffer (a heavy ``sigmoid`` read twice: torch/_inductor/ir.py
      ``StorageBox.should_realize_on_reuse``), alive until that kernel writes the gate's
      gradient into it: the CPU trace peaks at the down weight's gradient, 12 S + 4 F + 4 r
      + 16,384 + W = 6,340,608 B (+4.3%; memplan modelled it until the GPU rules' trace).
      At 2 x 64 tokens Inductor orders the weight gradients otherwise
      (benchmarks/compiled_backward.py), not modelled."""
    from memplan.model.layer import grad_group_params
    from recorded import compiled_layer_step  # tests/traced/recorded.py

    s, f, r, w = 262_144, 704_512, 2_048, 352_256
    if checkpoint == "none":
        assert saved == forward == 10 * s + 3 * f + 4 * r + 16_384
        assert backward == saved + f + w
    else:
        assert forward == 7 * s + 2 * r
        assert backward == 11 * s + 4 * f + 4 * r + 16_384 + w
    batch, seq = 2, 256
    spec = spec_from_hf_dict(OLMO2, "olmo2-toy", "olmo2-toy")
    recompute = Recompute(checkpoint)
    wl = Workload(micro_batch_size=batch, seq_len=seq, precision="bf16-pure",
                  recompute=recompute, compile=True)
    from memplan.parallel import validate

    validate(spec, ParallelConfig(), wl)  # no longer refused
    dm = Dims.of(spec, ParallelConfig(), wl)
    kind = layer_kind(spec, wl, dm, False, recompute)
    groups = grad_group_params(spec, 1, 1, False)
    model_backward = _model_backward(kind, groups, 2)
    assert kind.saved_bytes == saved
    assert kind.forward_peak_bytes - s == forward
    assert model_backward - s == backward
    traced_saved, traced_forward, traced_backward = compiled_layer_step(
        OLMO2, "bfloat16", batch, seq, checkpoint=checkpoint, gpu_realize=True)
    stream = (batch, seq, 256)
    assert sum(t.size_bytes for t in traced_saved
               if not t.graph_input or t.shape == stream) == saved
    assert (traced_forward, traced_backward) == (forward, backward)


GEMMA2 = hf("gemma-2-9b", **GEMMA2_TOY)


def _hf_layer_peaks(config: dict, checkpoint: str, amp: bool = False
                    ) -> tuple[int, int, int, int]:
    """One transformers layer of ``config`` in bf16, compiled, at 2 x 256 tokens (one kernel
    per scheduler node, GPU realization rules), ``checkpoint`` none or full (the checkpoint
    inside the graph): memplan's (forward peak, backward peak), each less one residual-stream
    tensor (its input and incoming gradient against the trace's held output), and the
    trace's. The layout is validated first: the layer is not refused. ``amp``: under
    autocast instead (fp32 weights, ``torch.autocast`` to bf16 around the compiled forward,
    accelerate's ``prepare_model``: ``compiled_trace._autocast``; precision ``amp-bf16``, the
    residual stream and the weights' gradients in fp32)."""
    from memplan.model.layer import grad_group_params
    from memplan.parallel import validate
    from recorded import compiled_layer_step  # tests/traced/recorded.py

    batch, seq = 2, 256
    spec = spec_from_hf_dict(config, "toy", "toy")
    recompute = Recompute.FULL if checkpoint == "full" else Recompute.NONE
    wl = Workload(micro_batch_size=batch, seq_len=seq, compile=True, recompute=recompute,
                  precision="amp-bf16" if amp else "bf16-pure")
    validate(spec, ParallelConfig(), wl)
    dm = Dims.of(spec, ParallelConfig(), wl)
    kind = layer_kind(spec, wl, dm, False, recompute)
    e = dm.stream_e  # the residual stream's and the weights' gradients'
    s = dm.rows * spec.hidden_size * e
    groups = grad_group_params(spec, 1, 1, False)
    model_backward = (_model_backward(kind, groups, e, s) if amp
                      else _model_backward(kind, groups, e) - s)
    # (the records' calls as made: the autocast keyword only where it is set)
    cast = {"autocast": "bfloat16"} if amp else {}
    _, traced_forward, traced_backward = compiled_layer_step(
        config, "float32" if amp else "bfloat16", batch, seq, **cast, checkpoint=checkpoint,
        gpu_realize=True)
    return kind.forward_peak_bytes - s, model_backward, traced_forward, traced_backward


@pytest.mark.parametrize("act", ["gelu", "gelu_pytorch_tanh"])
def test_compiled_geglu_rebuilt_after_pre_norms(act: str) -> None:
    """transformers' ``GemmaDecoderLayer`` (Gemma 1: pre norms, GeGLU with exact or tanh
    GELU; h 256, 8 heads of 32, all KV heads, ffn 896) in bf16, compiled, the checkpoint
    inside the graph, 2 x 256 tokens (T 512, one kernel per scheduler node, GPU realization
    rules). The backward peaks at the MLP's fused kernel as in a SwiGLU layer
    (``compiled.swiglu_backward``): gate's and up's rerun matmuls and the product's gradient
    matmul made, the kernel writes the product and the two input gradients, the down weight's
    gradient after it. By hand, S = T h 2 = 262,144, F = T f 2 = 917,504, r = T 4 = 2,048:
    the rebuilt attention side 9 S (the input's held place, the incoming gradient, the input
    norm's output, RoPE'd q and k, v, SDPA's output, the output projection's output, the MLP
    norm's output) + 2 r + the logsumexp 2 x 8 x 256 x 4 = 16,384, and six F: 7,884,800 B
    (memplan 7,163,904 before, the eager order's moments: -9.1%)."""
    s, f, r = 262_144, 917_504, 2_048
    backward = 9 * s + 2 * r + 16_384 + 6 * f
    assert backward == 7_884_800
    config = hf("gemma-7b", **GEMMA2_TOY | {"num_key_value_heads": 8, "hidden_act": act})
    _, model_backward, _, traced = _hf_layer_peaks(config, "full")
    assert model_backward == traced == backward


# (model, KV heads, checkpoint, forward peak, backward peak), the toy widths of
# ``test_compiled_fused_gate_up_layer``
FUSED_GATE_UP = [("Phi-3-mini-4k-instruct", 8, "none", 5_394_432, 7_688_192),
                 ("Phi-3-mini-4k-instruct", 8, "full", 3_019_712, 8_409_088),
                 ("Phi-4-mini-instruct", 2, "none", 5_066_752, 7_360_512),
                 ("Phi-4-mini-instruct", 2, "full", 3_019_712, 7_819_264)]


@pytest.mark.parametrize("model,kv,checkpoint,forward,backward", FUSED_GATE_UP)
def test_compiled_fused_gate_up_layer(model: str, kv: int, checkpoint: str, forward: int,
                                      backward: int) -> None:
    """transformers' Phi-3 layer (fused qkv_proj and gate_up_proj, full rotate-half RoPE) and
    Phi-4-mini's (the same, RoPE on 3/4 of each head: ``torch.cat``), h 256, 8 heads of 32,
    ``kv`` KV heads, ffn 896, bf16, compiled, at 2 x 256 tokens (T 512, one kernel per
    scheduler node, GPU realization rules). By hand, S = T h 2 = 262,144, F = T f 2 =
    917,504, W = h f 2 = 458,752, r = T 4 = 2,048, the logsumexp 2 x 8 x 256 x 4 = 16,384;
    v is a view of the fused qkv output, which stays whole (Phi-3: 3 S, Phi-4-mini: 1.5 S):

    - no recompute, forward (the output in the input's place): the input norm's output S,
      the qkv storage, RoPE'd q S and k (S, S / 4), SDPA's output S, the o_proj output S
      (the residual recomputed from it), the MLP norm's output S, the gate/up output 2 F,
      the product F, 2 r, the logsumexp, the output S; Phi-4-mini also the reshape's copy of
      SDPA's head-major output S (its q made by ``torch.cat``; Phi-3's rotate-half output
      is laid out token-major by Inductor: no copy, ``attention.head_major_core``): Phi-3 10
      S + 3 F + 2 r + 16,384 = 5,394,432, Phi-4-mini 8.75 S + ... = 5,066,752. Backward:
      the down weight's gradient W, the product freed for its gradient F, then the kernel
      writing the fused gradient 2 F beside the fused output: + W + 2 F.
    - full recompute (the checkpoint inside the graph), forward at the product's kernel: the
      o_proj output S, the fused output 2 F and the product F (no in-place reuse: not the
      fused buffer's size), the MLP norm's output freed: 3 F + S = 3,014,656, the trace
      5,056 B more (the CPU generator's state, as for separate projections). Backward at the
      SwiGLU kernels' moment (``compiled.swiglu_moments``): the rebuilt attention side (the
      input's held place, the incoming gradient, the input norm's output, the qkv storage,
      q, k, SDPA's output, the o_proj output, the MLP norm's output: Phi-3 11 S, Phi-4-mini
      8.75 S; 2 r, the logsumexp) and six F (the rerun's fused output, the product's
      gradient, the kernel's product and fused gradient): Phi-3 8,409,088 B, Phi-4-mini
      7,819,264 B.

    Before: Phi-3's saved set counted the reshape's copy (+S), its full-recompute backward
    in the eager order (-5.5% at Phi-3, -5.9% at Phi-4-mini) and its forward as eager's
    (+38.9%)."""
    s, f, w, r, lse = 262_144, 917_504, 458_752, 2_048, 16_384
    phi3 = model.startswith("Phi-3")
    if checkpoint == "none":
        by_hand = (10 * s if phi3 else 8.75 * s) + 3 * f + 2 * r + lse
        assert (by_hand, by_hand + w + 2 * f) == (forward, backward)
    else:
        assert 3 * f + s + 5_056 == forward
        assert (11 * s if phi3 else 8.75 * s) + 2 * r + lse + 6 * f == backward
    config = hf(model, num_hidden_layers=2, hidden_size=256, intermediate_size=896,
                num_attention_heads=8, num_key_value_heads=kv, head_dim=32, vocab_size=1000)
    generator = 5_056 if checkpoint == "full" else 0
    assert _hf_layer_peaks(config, checkpoint) == (forward - generator, backward, forward,
                                                   backward)


@pytest.mark.parametrize("checkpoint,backward", [("none", 5_853_184), ("full", 7_753_728)])
def test_compiled_scaled_residual_layer(checkpoint: str, backward: int) -> None:
    """transformers' Granite layer (``residual + hidden_states * residual_multiplier``:
    ``ModelSpec.scaled_residual``; h 256, 8 heads of 32, 2 KV heads, ffn 896) in bf16,
    compiled, at 2 x 256 tokens (T 512, one kernel per scheduler node, GPU realization
    rules). The backward first makes the down projection's output gradient, the incoming
    gradient times the multiplier, a T x h tensor of its own (``compiled.swiglu_moments``'
    ``scaled_grad``). By hand, S = T h 2 = 262,144, F = T f 2 = 917,504, W = h f 2 =
    458,752, r = T 4 = 2,048, the logsumexp 2 x 8 x 256 x 4 = 16,384:

    - no recompute: the forward's saved set with the output 4,476,928 B (as Llama's); the
      scaled gradient is freed at the down projection's grad-input matmul, before the
      kernel, where the product (freed by the weight gradient), its gradient F and the
      gate's F are: 4,476,928 - F + 2 F + W = 5,853,184 B, exact either way;
    - full recompute (the checkpoint inside the graph): the rebuilt attention side (the
      input's held place, the incoming gradient, the input norm's output, RoPE'd q, k and v
      (S, S / 4, S / 4), SDPA's output, the o_proj output, the MLP norm's output: 7.5 S; 2 r,
      the logsumexp) and the scaled gradient S, alive through the kernel to the down
      weight's gradient, beside six F: 8.5 S + 2 r + 16,384 + 6 F = 7,753,728 B (memplan
      7,491,584 before, -3.4%)."""
    s, f, w, r, lse = 262_144, 917_504, 458_752, 2_048, 16_384
    if checkpoint == "none":
        assert 4_476_928 + f + w == backward
    else:
        assert 8.5 * s + 2 * r + lse + 6 * f == backward
    config = hf("granite-3.3-8b-instruct", num_hidden_layers=2, hidden_size=256,
                intermediate_size=896, num_attention_heads=8, num_key_value_heads=2,
                head_dim=32, vocab_size=1000)
    assert spec_from_hf_dict(config, "toy", "toy").scaled_residual
    _, model_backward, _, traced = _hf_layer_peaks(config, checkpoint)
    assert model_backward == traced == backward


@pytest.mark.parametrize("checkpoint,forward,backward", [("none", 4_214_784, 5_328_896),
                                                         ("full", 2_364_352, 6_038_464)])
def test_compiled_parallel_layer(checkpoint: str, forward: int, backward: int) -> None:
    """transformers' Cohere layer (Command R7B: one LayerNorm centring twice, attention and
    MLP in parallel on its output, ``ModelSpec.parallel_block``; h 256, 8 heads of 32, 2 KV
    heads, ffn 896) in bf16, compiled, at 2 x 256 tokens (T 512, one kernel per scheduler
    node, GPU realization rules). By hand, S = T h 2 = 262,144, F = T f 2 = 917,504, W = h f
    2 = 458,752, r = T 4 = 2,048, the logsumexp 2 x 8 x 256 x 4 = 16,384:

    - no recompute: saved the norm's mean and rsqrt (2 r: the partitioner saves both
      reductions and recomputes the centred input, ``norm._norm_terms``; eager saves rsqrt's
      alone), its output S, RoPE'd q S, k and v S / 4 each, SDPA's output S, the logsumexp,
      gate, up and product 3 F: 3,690,496 B; the forward peaks at the down projection's
      matmul, the o_proj output S beside it until the one kernel summing the input and both
      branches writes into it: + 2 S = 4,214,784 B (memplan 6.3% under before). Backward at
      the MLP's kernel: the product freed by the down weight's gradient W, its gradient and
      the gate's: 3,690,496 - F + 2 F + W + the output S = 5,328,896 B.
    - full recompute (the checkpoint inside the graph): Inductor reruns and differentiates
      the MLP branch first, which reads the norm's output alone, and reruns the attention
      after it (``layer.backward_moments``' ``mlp_first``): at the MLP's kernel the input's
      held place S, the norm's rebuilt output S and 2 r, six F: 6,033,408 B (memplan 15.4%
      over before, the whole rebuilt set); the trace holds 5,056 B more, the CPU generator's
      state for SDPA's rerun, not rerun yet (a GPU's philox state is 16 B). Forward as
      Llama's layer: 2,359,296 B and those 5,056."""
    s, f, w, r, lse = 262_144, 917_504, 458_752, 2_048, 16_384
    saved = 3.5 * s + 2 * r + lse + 3 * f
    if checkpoint == "none":
        assert (saved + 2 * s, saved + f + w + s) == (forward, backward)
    else:
        assert (9 * s + 5_056, s + s + 2 * r + 6 * f + 5_056) == (forward, backward)
    config = hf("c4ai-command-r7b-12-2024", num_hidden_layers=2, hidden_size=256,
                intermediate_size=896, num_attention_heads=8, num_key_value_heads=2,
                head_dim=32, vocab_size=1000)
    spec = spec_from_hf_dict(config, "toy", "toy")
    assert spec.parallel_block and spec.norm_centres_twice
    generator = 0 if checkpoint == "none" else 5_056
    assert _hf_layer_peaks(config, checkpoint) == (forward - generator, backward - generator,
                                                   forward, backward)


def test_compiled_qk_norm_layer_rebuilt() -> None:
    """transformers' Qwen3 layer (per-head q and k RMSNorms before RoPE: ``QkNorm.HEAD``; h
    256, 8 heads of 32, 2 KV heads, ffn 896) in bf16, compiled, the checkpoint inside the
    graph, 2 x 256 tokens (T 512, one kernel per scheduler node, GPU realization rules). The
    q norm's reduction kernel also writes RoPE's output, token-major, so o_proj reads SDPA's
    output itself: no rerun copy (``compiled.rerun_output_copy_bytes``). By hand, S = T h 2
    = 262,144, F = T f 2 = 917,504: at the MLP's kernel the input's held place, the input
    norm's output, q_proj's output S and k_proj's S / 4 (the norms' inputs), v S / 4, RoPE'd
    q S and k S / 4, SDPA's output, the o_proj output, the MLP norm's output: 7.75 S; the
    norms' statistics 2 x T x 4 + T x 8 x 4 + T x 2 x 4 and the logsumexp 2 x 8 x 256 x 4:
    40,960; six F: 7,577,600 B (memplan 7,839,744 before, the copy counted: +3.5%)."""
    s, f, t = 262_144, 917_504, 512
    backward = 7.75 * s + 2 * t * 4 + t * 8 * 4 + t * 2 * 4 + 2 * 8 * 256 * 4 + 6 * f
    assert backward == 7_577_600
    config = hf("Qwen3-8B", num_hidden_layers=2, hidden_size=256, intermediate_size=896,
                num_attention_heads=8, num_key_value_heads=2, head_dim=32, vocab_size=1000)
    _, model_backward, _, traced = _hf_layer_peaks(config, "full")
    assert model_backward == traced == backward


@pytest.mark.parametrize("checkpoint,forward,backward", [("none", 5_292_032, 6_668_288),
                                                         ("full", 2_366_400, 7_191_040)])
def test_compiled_sandwich_qk_norm_layer(checkpoint: str, forward: int, backward: int) -> None:
    """transformers' Gemma 3 layer (sandwich norms, per-head q and k RMSNorms on the
    transposed q and k, GeGLU with ``gelu_pytorch_tanh``; h 256, 8 heads of 32, 4 KV heads,
    ffn 896) in bf16, compiled, at 2 x 256 tokens (T 512, one kernel per scheduler node, GPU
    realization rules; its window 1,024 longer than the sequence). By hand, S = T h 2 =
    262,144, K = T 128 2 = 131,072, F = T f 2 = 917,504, W = h f 2 = 458,752:

    - no recompute: saved the input, the input norm's output, q_proj's output (the q norm's
      input), RoPE'd q, SDPA's output, the o_proj output (the post-attention norm's input),
      the pre-feedforward norm's output, the down projection's output (the post-feedforward
      norm's): 8 S; k_proj's output, v, RoPE'd k: 3 K; four norms' rsqrt 4 x T x 4, the q and
      k norms' T x 8 x 4 and T x 4 x 4, the logsumexp 2 x 8 x 256 x 4: 49,152; gate, up and
      product 3 F: 5,292,032 B, the forward's peak; backward as Gemma 2's, + F + W.
    - full recompute (the checkpoint inside the graph), at GeGLU's backward kernel (the down
      weight's gradient and the post-feedforward norm's weight gradient, 512 B, made before
      it): the input's held place, the input norm's output, q_proj's output, RoPE'd q, SDPA's
      output and the token-major copy o_proj reads (q is normalised after the transpose:
      ``ModelSpec.qk_norm_token_major`` false), the o_proj output, the pre-feedforward norm's
      output: 8 S; 3 K; the pre-feedforward norm's fp32 normalised input 2 S
      (``compiled.sandwich_rerun_norm_bytes``); the input, q, k and post-attention norms'
      statistics and the logsumexp 47,104; gate, up (its gradient written into it), the
      product's gradient and the gate's: 4 F: 7,191,040 B. The forward as Gemma 2's, 5,056 B
      above memplan's (the CPU generator's state). Before: refused (untraced)."""
    s, k, f, w, t = 262_144, 131_072, 917_504, 458_752, 512
    stats = 4 * t * 4 + t * 8 * 4 + t * 4 * 4 + 2 * 8 * 256 * 4
    if checkpoint == "none":
        assert (8 * s + 3 * k + stats + 3 * f, 8 * s + 3 * k + stats + 4 * f + w) == (
            forward, backward)
    else:
        assert 8 * s + 3 * k + 2 * s + (stats - t * 4) + 4 * f + w + 512 == backward
    config = hf("gemma-3-12b-pt", num_hidden_layers=2, hidden_size=256, intermediate_size=896,
                num_attention_heads=8, num_key_value_heads=4, head_dim=32, vocab_size=1000)
    assert not spec_from_hf_dict(config, "toy", "toy").qk_norm_token_major
    generator = 0 if checkpoint == "none" else 5_056
    assert _hf_layer_peaks(config, checkpoint) == (forward - generator, backward, forward,
                                                   backward)  # no longer refused


def test_compiled_sandwich_layer_matches_trace() -> None:
    """transformers' ``Gemma2DecoderLayer`` (sandwich norms: input, post-attention,
    pre-feedforward, post-feedforward RMSNorms scaling by 1 + weight in fp32; GeGLU with
    ``gelu_pytorch_tanh``; h 256, 8 heads of 32, 4 KV heads, ffn 896) in bf16, compiled, no
    recompute, at 2 x 256 tokens (T 512, one kernel per scheduler node, Inductor's GPU
    realization rules: ``gpu_realize``; its window, 4,096, longer than the sequence: no mask,
    as transformers skips it). By hand, S = T h 2 =
    262,144, K = T 128 2 = 131,072 (k and v), F = T f 2 = 917,504, r = T 4 = 2,048, the
    logsumexp 2 x 8 x 256 x 4 = 16,384, the down weight's gradient W = h f 2 = 458,752:

    - saved 7 S (the layer's input, the input norm's output, RoPE'd q, SDPA's output, the
      output projection's output, the pre-feedforward norm's output, the down projection's
      output) + 2 K + 3 F + 4 r + the logsumexp = 4,874,240 B, the forward's peak; the
      residual sum the pre-feedforward norm reads is not saved (``compiled.norm_input_e``:
      before, counted: +5.4%);
    - backward at the MLP's fused kernel: the saved set less the product (the MLP post
      norm's input and statistic alive, its weight gradient fused with the other norms'
      after the attention's backward: ``with_post_norm_schedule``), with the product's and
      the gate's gradients and W: 4,874,240 - F + 2 F + W = 6,250,496 B. With Inductor's
      CPU rules that norm's weight gradient runs first and its input gradient is written
      into its input's buffer (the CPU's read and op-count realization thresholds,
      ``StorageBox.has_exceeded_max_reads`` / ``Loops.has_large_inner_fn``): 4,874,240 - S
      - r - F + 2 F + W + 512 = 5,986,816 B, which memplan modelled until the GPU rules'
      trace (-4.2%)."""
    from memplan.model.layer import grad_group_params
    from memplan.parallel import validate
    from recorded import compiled_layer_step  # tests/traced/recorded.py

    s, k, f, r, w = 262_144, 131_072, 917_504, 2_048, 458_752
    saved = 7 * s + 2 * k + 3 * f + 4 * r + 16_384
    backward = saved + f + w
    assert (saved, backward) == (4_874_240, 6_250_496)
    batch, seq = 2, 256
    spec = spec_from_hf_dict(GEMMA2, "gemma2-toy", "gemma2-toy")
    wl = Workload(micro_batch_size=batch, seq_len=seq, precision="bf16-pure", compile=True)
    validate(spec, ParallelConfig(), wl)  # no longer refused
    dm = Dims.of(spec, ParallelConfig(), wl)
    kind = layer_kind(spec, wl, dm, False, Recompute.NONE)
    groups = grad_group_params(spec, 1, 1, False)
    model_backward = _model_backward(kind, groups, 2)
    assert kind.saved_bytes == kind.forward_peak_bytes - s == saved
    assert model_backward - s == backward
    traced_saved, traced_forward, traced_backward = compiled_layer_step(
        GEMMA2, "bfloat16", batch, seq, gpu_realize=True)
    stream = (batch, seq, 256)
    assert sum(t.size_bytes for t in traced_saved
               if not t.graph_input or t.shape == stream) == saved
    assert (traced_forward, traced_backward) == (saved, backward)


@pytest.mark.parametrize("gpu_realize", [True, False])
def test_compiled_sandwich_layer_rebuilt_matches_trace(gpu_realize: bool) -> None:
    """transformers' ``Gemma2DecoderLayer`` (as ``test_compiled_sandwich_layer_matches_trace``)
    in bf16 under full recompute, the checkpoint inside the compiled graph (transformers'
    gradient checkpointing under the Trainer's ``torch_compile``), at 2 x 256 tokens, one
    kernel per scheduler node. By hand, S = 262,144, K = 131,072, F = 917,504, r = 2,048, the
    logsumexp 16,384, W = 458,752, and N = T h 4 = 524,288 (the pre-feedforward norm's fp32
    normalised input, ``compiled.sandwich_rerun_norm_bytes``):

    - saved the layer's input S; forward at up's matmul: the output projection's output (the
      residual sum recomputed from it at the end), the post-attention norm's statistics
      (``compiled.sandwich_sum_stats_bytes``), the pre-feedforward norm's output, gate and up:
      2 S + r + 2 F = 2,361,344 B (the trace 5,056 B more: the CPU generator's state the
      checkpoint saves around SDPA, ``run_and_save_rng_state``; a CUDA generator's is a seed
      and an offset). Before: refused; the refusal bypassed, 2,359,296 (-0.3%);
    - backward at GeGLU's fused kernel (``cpp_fused__unsafe_view_gelu_gelu_backward_mul_
      view_12``): the held output S, the rerun's attention side (the input norm's output S
      and statistics r, RoPE'd q S in SDPA backward's layout, k and v 2 K, SDPA's output S,
      its token-major copy S, the logsumexp), the output projection's output S and r, the
      pre-feedforward norm's output S, its statistics r and N, gate F, up F (up's gradient
      written into it), the product's gradient F (in the product's buffer) and the gate's F,
      W and the post-feedforward norm's weight gradient (h 2 = 512): 7 S + 2 K + 3 r +
      16,384 + N + 4 F + W + 512 = 6,773,248 B with Inductor's GPU realization rules
      (``gpu_realize``), memplan exact. Before, the refusal bypassed: 6,904,320 (+1.9%, the
      eager GeGLU order: the product beside its gradient, no copy, no N).
    - Inductor's CPU rules (the default) also make GELU's fp32 ``tanh`` a buffer (T f 4 =
      1,835,008: a heavy op read twice, realized on CPU alone) alive from the rerun to that
      kernel: 8,608,256 B, memplan (a GPU's) 21% under by exactly that buffer; nothing else
      differs."""
    from memplan.model.layer import grad_group_params
    from memplan.parallel import validate
    from recorded import compiled_layer_step  # tests/traced/recorded.py

    s, k, f, r, w, n = 262_144, 131_072, 917_504, 2_048, 458_752, 524_288
    forward = 2 * s + r + 2 * f
    backward = 7 * s + 2 * k + 3 * r + 16_384 + n + 4 * f + w + 512
    assert (forward, backward) == (2_361_344, 6_773_248)
    batch, seq = 2, 256
    spec = spec_from_hf_dict(GEMMA2, "gemma2-toy", "gemma2-toy")
    wl = Workload(micro_batch_size=batch, seq_len=seq, precision="bf16-pure",
                  recompute=Recompute.FULL, compile=True)
    validate(spec, ParallelConfig(), wl)  # no longer refused
    dm = Dims.of(spec, ParallelConfig(), wl)
    kind = layer_kind(spec, wl, dm, False, Recompute.FULL)
    groups = grad_group_params(spec, 1, 1, False)
    model_backward = _model_backward(kind, groups, 2)
    assert kind.saved_bytes == s
    assert kind.forward_peak_bytes - s == forward
    assert model_backward - s == backward
    traced_saved, traced_forward, traced_backward = compiled_layer_step(
        GEMMA2, "bfloat16", batch, seq, checkpoint="full", gpu_realize=gpu_realize)
    stream = (batch, seq, 256)
    assert sum(t.size_bytes for t in traced_saved
               if not t.graph_input or t.shape == stream) == s
    tanh = 0 if gpu_realize else batch * seq * 896 * 4
    assert (traced_forward, traced_backward) == (forward + 5_056, backward + tanh)


# torchtitan 0.3.0's Qwen3 MoE block (frameworks.torchtitan_moe_config: T = 128 tokens, h 128,
# 4 experts of f 64, top-2, routing held balanced), compiled whole with fullgraph as
# apply_compile compiles it, its gate on fp32 copies as CUDA's fp32 autocast runs it
TITAN_MOE = {"torchtitan_moe": dict(dim=128, n_layers=1, n_heads=4, n_kv_heads=2, head_dim=32,
                                    vocab_size=512, moe_hidden_dim=64, num_experts=4,
                                    top_k=2)}


def _titan_moe_kind(recompute: Recompute, seq: int = SEQ, fields: dict | None = None,
                    name: str = "qwen3-moe-toy", check: bool = True):
    """memplan's layer and gradient groups for torchtitan's Qwen3 MoE block (``fields``, the
    toy's by default) at ``BATCH`` x ``seq`` tokens, compiled, as the torchtitan preset runs
    it; ``check``: the layout validated first (off: a refused case's moments, to compare)."""
    from memplan.model.layer import grad_group_params
    from memplan.parallel import validate
    from memplan.profile.frameworks import torchtitan_moe_config, torchtitan_moe_spec

    fields = TITAN_MOE["torchtitan_moe"] if fields is None else fields
    spec = torchtitan_moe_spec(torchtitan_moe_config(**fields, seq_len=seq), name)
    wl = Workload(micro_batch_size=BATCH, seq_len=seq, precision="bf16-pure", compile=True,
                  moe_impl="titan", framework="torchtitan", rope_cache="layer-cossin",
                  recompute=recompute)
    if check:
        validate(spec, ParallelConfig(), wl)
    dm = Dims.of(spec, ParallelConfig(), wl)
    return layer_kind(spec, wl, dm, True, recompute), grad_group_params(spec, 1, 1, True)


@pytest.mark.parametrize("checkpoint,saved", [("none", 589_840), ("full", 32_768)])
def test_compiled_titan_moe_block_saves_what_the_partitioner_saves(checkpoint: str,
                                                                   saved: int) -> None:
    """torchtitan's MoE block compiled (``memplan.model.compiled.titan_moe_terms``): of the
    MoE, the gate's fp32 input copy (T h x 4 = 65,536) and weight copy (E h x 4 = 2,048), its
    fp32 logits (T E x 4 = 2,048), the expert ids, the argsort and the token index (3 x
    2,048), the gathered rows (R h x 2 = 65,536), gate, up and product (3 x R f x 2 =
    98,304), the offsets (16), the experts' bf16 output (65,536) and the combine's zeros
    (T h x 2 = 32,768): 337,936 of the block's 589,840 B. Inside full checkpointing the
    block's input alone."""
    kind, _ = _titan_moe_kind(Recompute.FULL if checkpoint == "full" else Recompute.NONE)
    assert kind.saved_bytes == saved
    assert _traced_activations(TITAN_MOE, "bfloat16", checkpoint, width=128) == saved


def test_compiled_titan_moe_block_phase_peaks() -> None:
    """The compiled block's forward peak: its saved set, the output and, at the combine, the
    weighted rows cast back (R h x 2 = 65,536) and the sorted scores (R x 4 = 1,024): memplan
    656,400 above the stream (``moe_titan_compiled.compiled_combine_bytes``), traced with two
    intra-op threads 656,400, exact (pinned: with one, the C++ kernels' forward is 512 B lower,
    655,888; torch 2.13). Its backward (the same with one and two threads), one kernel per
    scheduler node as a GPU launches them (``moe_titan_compiled.compiled_backward``: the scores'
    gradient first, then the router's, then the experts' MLP in Inductor's order,
    ``moe_titan_compiled._compiled_routed``): traced 713,744 B at w3's input gradient (located by
    replaying Inductor's wrapper code), memplan exact (the eager order's moments were
    2,064 B under). The C++ backend's kernel groups (``kernel_per_node=False``) peak in the
    attention's backward instead (729,984 B), the MoE's input gradients held there: no GPU
    schedule."""
    import torch

    from recorded import compiled_layer_peaks  # tests/traced/recorded.py

    kind, groups = _titan_moe_kind(Recompute.NONE)
    stream = BATCH * SEQ * 128 * 2
    before = torch.get_num_threads()
    torch.set_num_threads(2)  # the traced forward follows the thread count (docstring)
    try:
        traced_forward, traced_backward = compiled_layer_peaks(
            TITAN_MOE, "bfloat16", BATCH, SEQ, kernel_per_node=True, gpu_realize=True)
    finally:
        torch.set_num_threads(before)
    assert traced_forward == 656_400 and traced_backward == 713_744
    assert kind.forward_peak_bytes - stream == traced_forward
    assert _model_backward(kind, groups, 2) - stream - traced_backward == 0


@pytest.mark.parametrize("seq,saved,forward,over,backward,diff", [
    (128, 1_177_616, 1_309_712, 1_024, 1_192_960, -11_248),
    (256, 2_353_168, 2_616_336, 3_072, 2_361_360, 0)])
def test_compiled_titan_moe_block_without_a_shared_expert(seq: int, saved: int, forward: int,
                                                          over: int, backward: int,
                                                          diff: int) -> None:
    """torchtitan's MoE block with routed experts alone compiled whole at 2 x 128 and 2 x 256
    tokens (2 x 64: ``test_compiled_titan_moe_block_phase_peaks``), one kernel per
    scheduler node, GPU realization, two intra-op threads. Saved exact
    (``compiled.titan_moe_terms``). Forward (traced, pinned): memplan 1,024 and 3,072 B over
    (the combine's moment, ``moe_titan_compiled.compiled_combine_bytes``; not located). Backward in
    Inductor's lpmf order (``moe_titan_compiled._compiled_routed``; located by replaying the
    wrapper code): the router's input gradient after the routed experts'
    (``moe_titan_compiled.router_grad_first``: a tie at 2 x 128, 2,048 B more at 2 x 256), w2's
    weight gradient before the product's gradient. 2 x 256: the first moment, the scores'
    gradient beside the whole saved set (2,353,168 + 2 x 4,096), exact (the eager order's
    experts' moments were 188,416 B over). 2 x 128: the traced peak is the attention's
    backward (its three input gradients beside the MoE's input gradients, which wait for
    the ffn norm's weight gradient fused into the block's last kernel), memplan's the first
    moment (1,177,616 + 2 x 2,048 = 1,181,712), 11,248 B under (-0.94%; the eager order's
    moments were 115,728 B over)."""
    import torch

    from recorded import compiled_layer_step  # tests/traced/recorded.py

    kind, groups = _titan_moe_kind(Recompute.NONE, seq)
    stream = BATCH * seq * 128 * 2
    before = torch.get_num_threads()
    torch.set_num_threads(2)  # the traced forward follows the thread count
    try:
        traced, traced_forward, traced_backward = compiled_layer_step(
            TITAN_MOE, "bfloat16", BATCH, seq, gpu_realize=True)
    finally:
        torch.set_num_threads(before)
    activations = sum(t.size_bytes for t in traced
                      if not t.graph_input or t.shape == (BATCH, seq, 128))
    assert activations == kind.saved_bytes == saved
    assert traced_forward == forward
    assert kind.forward_peak_bytes - stream - forward == over
    assert traced_backward == backward
    assert _model_backward(kind, groups, 2) - stream - traced_backward == diff


# traced (one compile each, one kernel per scheduler node, GPU realization, two intra-op
# threads): (shared expert width, tokens per sequence, forward peak, backward peak)
TITAN_MOE_FULL_AC = [(0, 64, 206_800, 730_128), (0, 128, 408_528, 1_337_360),
                     (0, 256, 890_816, 2_672_656), (96, 64, 273_344, 869_392),
                     (96, 128, 532_928, 1_542_160), (96, 256, 1_159_104, 3_008_528),
                     (256, 64, 273_344, 992_272), (256, 128, 532_928, 1_665_040),
                     (256, 256, 1_159_104, 3_131_408)]


@pytest.mark.parametrize("width,seq,forward,backward", TITAN_MOE_FULL_AC)
def test_compiled_titan_moe_block_under_full_ac(width: int, seq: int, forward: int,
                                                backward: int) -> None:
    """torchtitan's MoE block compiled whole with the checkpoint inside its graph (full AC),
    routed experts alone and with a shared expert 96 and 256 wide. Saved: the block's input
    alone (T h x 2). Backward: Inductor interleaves the rerun with the gradients
    (``moe_titan_compiled.full_ac_backward``; the peaks located by replaying the wrapper
    code): 2 x 64 tokens at w1's input gradient, 2 x 128 and 2 x 256 at the experts' SiLU
    backward kernel, memplan exact in all nine. By hand, routed alone at 2 x 64 (T 128, R
    256): the attention's rebuilt tensors (its no-recompute saved set with the block's
    input, 251,904, and the rerun's wqkv value third, T kv x 2 = 16,384), the router's input gradient (T h x 4 = 65,536), the
    combine's zeros (32,768), up's output gradient (R f x 2 = 32,768), the sort index (2,048),
    the offsets (16), w3's and w1's input gradients (2 x 65,536) and every weight gradient
    (197,632): 730,128. A shared expert adds its weight gradients (3 x 128 x width x 2) and
    its two input gradients (2 x T h x 2) at either moment: 96 wide 139,264 at 2 x 64, 204,800
    at 2 x 128, 335,872 at 2 x 256; 256 wide 122,880 more at each size. Forward (traced,
    pinned; not modelled: memplan's is the no-recompute saved set beside the output, 500,256
    B at 2 x 64, 1,000,480 at 2 x 128, 2,000,928 at 2 x 256: +142%, +145% and +125% routed
    alone, +83%, +88% and +73% with a shared expert): the same with either
    shared width; replayed from the wrapper code, routed alone, 2 x 64 and 2 x 128 peak at
    up's grouped matmul (the ffn norm's fp32 output, the gathered rows, gate's and up's
    outputs) as traced; 2 x 256 and the shared expert's forwards peak inside an op the
    wrapper does not show (the CPU harness's extern kernels' own buffers: not located).
    memplan's forward stays below its backward (the same rebuilt set and the gradients), so
    the step's peak is the backward's; the output says the forward is over
    (``memplan.model.estimate.TITAN_MOE_FULL_AC_LINE``) and the layout is estimated, with a
    shared expert too (``parallel._compile_titan_moe_refusal``)."""
    from memplan.parallel import validate
    from recorded import compiled_layer_step  # tests/traced/recorded.py

    fields = TITAN_MOE["torchtitan_moe"] | ({"shared_hidden_dim": width} if width else {})
    name = "qwen3-moe-shared" if width else "qwen3-moe-toy"
    kind, groups = _titan_moe_kind(Recompute.FULL, seq, fields, name, check=not width)
    stream = BATCH * seq * 128 * 2
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(2)  # the traced forward follows the thread count
    try:
        traced, traced_forward, traced_backward = compiled_layer_step(
            {"torchtitan_moe": fields}, "bfloat16", BATCH, seq, checkpoint="full",
            gpu_realize=True)
    finally:
        torch.set_num_threads(before)
    activations = sum(t.size_bytes for t in traced
                      if not t.graph_input or t.shape == (BATCH, seq, 128))
    assert activations == kind.saved_bytes == stream
    assert (traced_forward, traced_backward) == (forward, backward)
    assert _model_backward(kind, groups, 2) - stream == backward
    assert kind.forward_peak_bytes - stream > forward  # over, not under (docstring)
    assert kind.forward_peak_bytes - stream < backward  # the step peaks in backward
    from memplan.hardware import load_gpu
    from memplan.model.estimate import TITAN_MOE_FULL_AC_LINE, estimate
    from memplan.overheads import no_overheads
    from memplan.profile.frameworks import torchtitan_moe_config, torchtitan_moe_spec

    spec = torchtitan_moe_spec(torchtitan_moe_config(**fields, seq_len=seq), name)
    wl = Workload(micro_batch_size=BATCH, seq_len=seq, precision="bf16-pure",
                  compile=True, moe_impl="titan", framework="torchtitan",
                  rope_cache="layer-cossin", recompute=Recompute.FULL)
    validate(spec, ParallelConfig(), wl)
    est = estimate(spec, load_gpu("h100-sxm"), ParallelConfig(), wl, overheads=no_overheads())
    assert TITAN_MOE_FULL_AC_LINE in est.assumptions


@pytest.mark.parametrize("config,dtype,cache_dtype,cache_bytes", [
    (TITAN, "bfloat16", "complex64", 8_192), (TITAN, "float32", "complex64", 8_192),
    (TITAN_MOE, "bfloat16", "float32", 16_384)])
def test_titan_block_keeps_its_rope_cache(config: dict, dtype: str, cache_dtype: str,
                                          cache_bytes: int) -> None:
    """The harness casts torchtitan's parameters only: its RoPE cache stays as 0.3.0's
    ``init_states`` makes it under FSDP's bf16 policy or ``training.dtype`` bfloat16
    (``compiled_trace._titan_params_to``), never cast to a real dtype (``nn.Module.to``
    would drop the imaginary part). Llama3's complex cache: 64 positions x 16 pairs x 8 B =
    8,192 B; Qwen3's cos/sin cache: 64 x (2 x 32) x 4 B = 16,384 B; memplan's
    ``rope_buffer_bytes`` ("layer", "layer-cossin") the same for one layer."""
    import warnings

    from memplan.model.attention import rope_buffer_bytes
    from memplan.profile.compiled_trace import _layer
    from memplan.profile.frameworks import torchtitan_moe_config, torchtitan_moe_spec

    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*discards the imaginary part")
        layer, _, _ = _layer(config, dtype, BATCH, SEQ)
    (cache,) = [b for n, b in layer.named_buffers() if n.endswith("rope.cache")]
    assert str(cache.dtype) == f"torch.{cache_dtype}"
    assert cache.nbytes == cache_bytes
    if "torchtitan_moe" in config:
        cfg = torchtitan_moe_config(**config["torchtitan_moe"], seq_len=SEQ)
        spec, rope = torchtitan_moe_spec(cfg, "qwen3-moe-toy"), "layer-cossin"
    else:
        spec, rope = _spec("torchtitan", True), "layer"
    wl = Workload(micro_batch_size=BATCH, seq_len=SEQ, compile=True, rope_cache=rope)
    assert rope_buffer_bytes(spec, wl, 1) == cache_bytes


@pytest.mark.parametrize("seq,width,saved,forward,backward,diff", [
    (64, 96, 696_336, 729_104, 853_008, 0),
    (256, 96, 2_779_152, 2_910_224, 2_787_344, 0),
    (128, 96, 1_390_608, 1_456_144, 1_397_760, -3_056),
    (128, 256, 1_636_368, 1_701_904, 1_652_736, -12_272)])
def test_compiled_titan_moe_block_with_a_shared_expert(seq: int, width: int, saved: int,
                                                       forward: int, backward: int,
                                                       diff: int) -> None:
    """torchtitan's MoE block with a shared expert compiled whole (one compile per size, one
    kernel per scheduler node as a GPU launches them, GPU realization). Saved: the routed
    block's set and, of the shared expert, its input (the ffn norm's output, T h x 2), w1's
    and w3's outputs and their product (3 x T f x 2; SiLU recomputed): at T = 128 589,840 +
    32,768 + 73,728 = 696,336, exact at both sizes (``compiled.titan_moe_terms``). Forward:
    the shared w2's matmul, the whole saved set beside the routed output and w2's own (T h x
    2 each; ``moe_titan_compiled.compiled_forward``): exact at both sizes. Backward
    (``moe_titan_compiled.compiled_backward``; the peaks located by replaying Inductor's wrapper
    code): at 2 x 256 its first kernel, the scores' gradient (2 R x 4) beside the whole saved
    set, exact; at 2 x 64 w3's input gradient (beside w1's, every expert and shared weight
    gradient made, the shared expert's two input gradients and the router's held;
    ``moe_titan_compiled._compiled_routed``), exact (the eager order's experts' moments were 2,064
    B under). At 2 x 128 the traced peak is the attention's backward (the MoE's input
    gradients held through it), memplan's the first moment: 3,056 B under (-0.22%; the
    eager order's experts' moments were +2.35%), with a 256-wide shared expert 12,272 B
    under (-0.74%; the eager order's shared moments were +10.9%:
    ``moe_titan_compiled._compiled_shared``)."""
    from recorded import compiled_layer_step  # tests/traced/recorded.py

    # a shared expert of that width (FeedForward, make_ffn_config), run after the routed ones
    config = {"torchtitan_moe": TITAN_MOE["torchtitan_moe"] | {"shared_hidden_dim": width}}
    kind, groups = _titan_moe_kind(Recompute.NONE, seq, config["torchtitan_moe"],
                                   "qwen3-moe-shared")
    stream = BATCH * seq * 128 * 2
    traced, traced_forward, traced_backward = compiled_layer_step(
        config, "bfloat16", BATCH, seq, gpu_realize=True)
    activations = sum(t.size_bytes for t in traced
                      if not t.graph_input or t.shape == (BATCH, seq, 128))
    assert activations == kind.saved_bytes == saved
    assert traced_forward == kind.forward_peak_bytes - stream == forward
    assert traced_backward == backward
    assert _model_backward(kind, groups, 2) - stream - traced_backward == diff


# benchmarks/compiled_backward.py's "hf:" widths
AMP_TOY = dict(num_hidden_layers=2, hidden_size=256, intermediate_size=896,
               num_attention_heads=8, head_dim=32, vocab_size=1000)
# the Llama-like layer at those widths under autocast (Mistral's: its window 4,096 is
# longer than the sequence, so transformers passes SDPA no mask: a Llama layer)
AMP_LLAMA = {"none": (6_705_152, 7_819_264), "full": (2_823_104, 9_261_056)}


@pytest.mark.parametrize("model,kv,checkpoint,forward,backward", [
    ("Mistral-7B-v0.1", 2, "none", *AMP_LLAMA["none"]),
    ("Mistral-7B-v0.1", 2, "full", *AMP_LLAMA["full"]),
    ("Qwen2.5-7B", 2, "none", *AMP_LLAMA["none"]),
    ("Qwen2.5-7B", 2, "full", *AMP_LLAMA["full"]),
    ("granite-3.3-8b-instruct", 2, "none", *AMP_LLAMA["none"]),
    ("granite-3.3-8b-instruct", 2, "full", *AMP_LLAMA["full"]),
    ("Qwen3-8B", 2, "none", 7_053_312, 8_167_424),
    ("Qwen3-8B", 2, "full", 2_823_104, 9_347_072),
    ("gemma-7b", 8, "none", 7_294_976, 8_409_088),
    ("gemma-7b", 8, "full", 2_823_104, 9_850_880),
    ("Phi-3-mini-4k-instruct", 8, "none", 7_819_264, 9_850_880),
    ("Phi-3-mini-4k-instruct", 8, "full", 3_281_856, 10_375_168),
    ("Phi-4-mini-instruct", 2, "none", 7_294_976, 9_326_592),
    ("Phi-4-mini-instruct", 2, "full", 3_281_856, 9_588_736)])
def test_compiled_autocast_hf_layers(model: str, kv: int, checkpoint: str, forward: int,
                                     backward: int) -> None:
    """transformers' layers of other families under autocast (fp32 weights, bf16 compute),
    compiled, 2 x 256 tokens (T 512, h 256, 8 heads of 32, ffn 896; one kernel per scheduler
    node, GPU realization rules), ``checkpoint`` none or full (the checkpoint inside the
    graph), the traces' peaks less one fp32 residual-stream tensor. Each family memplan
    refused under autocast before, now expressed, the forward exact but under full
    recompute (5,056 B: the CPU generator's state, as for Llama's layer), the backward exact:

    - Qwen2.5's q/k/v biases (fp32 parameters: the bias is added inside the projection's
      bf16 matmul, nothing more saved), Mistral's sliding window longer than the sequence
      (transformers passes SDPA no mask) and Granite's scaled residual branches (the
      multiplier fused into the incoming gradient's cast: ``compiled.scaled_residual_grad``;
      memplan one rows x h over before, +0.8% and +2.8%): the Llama layer's bytes;
    - Qwen3's per-head q/k RMSNorms before the transpose: without recompute q_proj's and
      k_proj's bf16 outputs (the norms' inputs, T x 256 x 2 + T x 64 x 2 = 327,680) and the
      norms' statistics (T x (8 + 2) x 4 = 20,480) saved beside the Llama layer's set, the
      forward 348,160 B above it; with full recompute rebuilt in the backward;
    - Gemma's GeGLU (GELU's tanh form) with all 8 KV heads, Gemma's ``1 + weight`` norms;
    - Phi-3's fused qkv and gate/up projections, and Phi-4-mini's (RoPE on 3/4 of each
      head, ``torch.cat``; refused before) (full recompute: as
      ``test_compiled_autocast_fused_gate_up_rebuilt`` at 2 x 1,024; memplan was 14.1%
      under in the forward and 5.1% in the backward with the separate projections' moments,
      and refused)."""
    config = hf(model, **AMP_TOY, num_key_value_heads=kv)
    model_forward, model_backward, traced_forward, traced_backward = _hf_layer_peaks(
        config, checkpoint, amp=True)
    assert (traced_forward, traced_backward) == (forward, backward)
    assert model_forward == forward - (5_056 if checkpoint == "full" else 0)
    assert model_backward == backward
    if model == "Qwen3-8B" and checkpoint == "none":
        assert forward - AMP_LLAMA["none"][0] == 512 * (256 + 64) * 2 + 512 * 10 * 4


def test_compiled_autocast_fused_gate_up_rebuilt() -> None:
    """transformers' Phi-3 layer (fused qkv_proj and gate_up_proj; h 256, 8 heads of 32, all
    8 KV heads, ffn 896) under autocast (fp32 weights, bf16 compute), compiled, the
    checkpoint inside the graph, 2 x 1,024 tokens (T 2,048; one kernel per scheduler node, GPU
    realization rules). By hand, S = T h 2 = 1,048,576, F = T f 2 = 3,670,016, W = h f 2 =
    458,752, beside the held output (T h fp32, 2 S):

    - forward, at the product's kernel: the output projection's output S, the fused gate/up
      output 2 F and the product F (a buffer of its own: ``compiled.
      autocast_checkpointed_forward_bytes``), the MLP norm's cast freed after the fused
      matmul: 12,058,624 B, the trace 5,056 B more (the CPU generator's state);
    - backward, at the rebuilt SwiGLU kernel (``compiled.swiglu_backward``, as in bf16):
      the rebuilt attention side (the incoming gradient's bf16 cast, the input norm's cast,
      the fused qkv output 3 S, RoPE'd q and k 2 S, SDPA's output and its token-major copy,
      the o_proj output, the MLP norm's cast: 11 S), the norms' statistics 2 x T x 4, the
      logsumexp 2 x 8 x 1,024 x 4, the transposed weight casts of qkv (3 h h 2 = 393,216),
      o_proj (h h 2) and gate/up (2 W), the rerun's fused output, the product's gradient,
      the kernel's product and fused gradient (six F), no weight gradient made: 37,175,296 B,
      the trace exact (memplan 32,325,632 B before: the eager SwiGLU moment with the down
      weight's gradient made first, -13.0%; the forward -17.9%)."""
    s, f, w, t = 1_048_576, 3_670_016, 458_752, 2_048
    forward = s + 3 * f
    backward = (11 * s + 2 * t * 4 + 2 * 8 * 1_024 * 4 + 3 * 256 * 256 * 2
                + 256 * 256 * 2 + 2 * w + 6 * f)  # beside the held output
    assert (forward, backward + 2 * s) == (12_058_624, 37_175_296)
    config = hf("Phi-3-mini-4k-instruct", **AMP_TOY, num_key_value_heads=8)
    from memplan.model.layer import grad_group_params
    from memplan.parallel import validate
    from recorded import compiled_layer_step  # tests/traced/recorded.py

    spec = spec_from_hf_dict(config, "toy", "toy")
    wl = Workload(micro_batch_size=2, seq_len=1024, precision="amp-bf16", compile=True,
                  recompute=Recompute.FULL)
    validate(spec, ParallelConfig(), wl)
    dm = Dims.of(spec, ParallelConfig(), wl)
    kind = layer_kind(spec, wl, dm, False, Recompute.FULL)
    stream = dm.rows * spec.hidden_size * 4
    _, traced_forward, traced_backward = compiled_layer_step(
        config, "float32", 2, 1024, autocast="bfloat16", checkpoint="full", gpu_realize=True)
    assert (traced_forward, traced_backward) == (forward + 5_056, backward + 2 * s)
    assert kind.forward_peak_bytes - stream == forward
    assert _model_backward(kind, grad_group_params(spec, 1, 1, False), 4, stream) == (
        backward + 2 * s)


@pytest.mark.parametrize("model,checkpoint,forward,backward", [
    ("gemma2", "none", 6_905_856, 8_018_944), ("gemma2", "full", 2_825_152, 8_805_376),
    ("gemma3", "none", 7_323_648, 8_436_736), ("gemma3", "full", 2_825_152, 9_223_168)])
def test_compiled_autocast_sandwich_layers(model: str, checkpoint: str, forward: int,
                                           backward: int) -> None:
    """transformers' Gemma 2 and Gemma 3 layers (sandwich norms, GeGLU; Gemma 3's per-head
    q/k norms on the transposed q and k; h 256, 8 heads of 32, 4 KV heads, ffn 896) under
    autocast (fp32 weights, bf16 compute), compiled, 2 x 256 tokens (one kernel per
    scheduler node, GPU realization rules), the traces' peaks less one fp32 residual-stream
    tensor. memplan refused them before; traced, they differ from the bf16 layers in three
    places, each now modelled:

    - the post norms' inputs are saved as the projections wrote them, in bf16
      (``compiled.norm_input_e``; memplan counted the fp32 stream's size: +2 S in the
      forward, +7.6%);
    - without recompute the MLP post norm's backward runs first (its weight's reduction,
      then its input gradient written into its saved input: ``with_post_norm_schedule``
      holds nothing), and that gradient, in bf16, is the down projection's operand: no cast
      of the incoming gradient (``swiglu_moments``; before +4.1% and +3.7%);
    - the checkpointed forward holds the post-attention norm's statistics beside the output
      projection's output, for the residual sum rebuilt at the layer's end (``compiled.
      autocast_checkpointed_forward_bytes``; T x 4 under before).

    By hand, Gemma 2 without recompute, S = T h 2 = 262,144, F = T f 2 = 917,504, W = h f 2
    = 458,752: the forward's peak is its saved set beside the fp32 input (2 S): the input
    norm's output, RoPE'd q, SDPA's output, the two post norms' inputs and the pre-
    feedforward norm's output (6 S), k and v 2 x 131,072, the logsumexp 16,384, gate, up and
    the product 3 F, four norms' statistics 4 x T x 4, the weights' bf16 casts (gate, up,
    down 3 W; q and o 2 x 131,072; k and v 2 x 65,536): 6,905,856 B. The full recompute's
    forward is 5,056 B above memplan's (the CPU generator's state); every other peak exact."""
    s, f, w, t = 262_144, 917_504, 458_752, 512
    if model == "gemma2" and checkpoint == "none":
        assert forward == (2 * s + 6 * s + 2 * 131_072 + 16_384 + 3 * f + 4 * t * 4 + 3 * w
                           + 2 * 131_072 + 2 * 65_536)
    config = (GEMMA2 if model == "gemma2"
              else hf("gemma-3-12b-pt", **AMP_TOY, num_key_value_heads=4))
    model_forward, model_backward, traced_forward, traced_backward = _hf_layer_peaks(
        config, checkpoint, amp=True)
    assert (traced_forward, traced_backward) == (forward, backward)
    assert model_forward == forward - (5_056 if checkpoint == "full" else 0)
    assert model_backward == backward


@pytest.mark.parametrize("checkpoint,forward,backward", [("none", 6_443_008, 7_016_448),
                                                         ("full", 2_823_104, 7_480_256)])
def test_compiled_autocast_parallel_layer(checkpoint: str, forward: int,
                                          backward: int) -> None:
    """transformers' Command R7B layer (Cohere2: a parallel block, Cohere's LayerNorm, RoPE
    in the input's dtype; h 256, 8 heads of 32, 2 KV heads, ffn 896) under autocast (fp32
    weights, bf16 compute), compiled, 2 x 256 tokens: layer 0, a sliding-window layer with
    RoPE (its window longer than the sequence). The catalog model stays refused under
    autocast for its layers without RoPE (every fourth), not traced
    (``parallel._compile_autocast_refusal``, tests/unit/test_compiled.py); this two-layer toy
    has none. Without recompute, after the down and output
    projections' matmuls (both read one bf16 cast of the incoming gradient: ``layer.
    _first_output_grad``, no second cast), Inductor runs SDPA's backward before the MLP's
    kernel (``compiled_order.with_parallel_attention_first``). By hand at that kernel, S = T
    h 2 = 262,144, F = T f 2 = 917,504, W = h f 2 = 458,752: the held output 2 S, the norm's
    output S and its mean and rsqrt 2 x T x 4, q's, k's and v's weight casts 131,072 + 2 x
    32,768, gate's and up's outputs and weight casts 2 F + 2 W, the product's gradient and
    the kernel's new gradient 2 F, down's weight gradient in fp32 (h f 4 = 917,504), the
    output projection's bf16 weight gradient 131,072, dq, dk and dv S + 2 x 65,536:
    7,016,448 B (memplan 7.7% over before: the attention's saved set at the kernel and a
    second cast). memplan's backward peak is now its moment at the down projection's
    grad-input matmul, 81,920 B over the trace's peak (+1.2%): it counts down's weight
    gradient in fp32 where the trace holds it in bf16 until the cast after (h f x 2 =
    458,752 B over there, ``compiled.swiglu_moments``). Full recompute: 5,056 B under the
    trace in both phases (the CPU generator's state; +3.4% over before, the second cast)."""
    from memplan.model.layer import grad_group_params
    from memplan.parallel import validate
    from recorded import compiled_layer_step  # tests/traced/recorded.py

    s, f, w, t = 262_144, 917_504, 458_752, 512
    if checkpoint == "none":
        assert backward == (2 * s + s + 2 * t * 4 + 131_072 + 2 * 32_768 + 2 * f + 2 * w
                            + 2 * f + 256 * 896 * 4 + 131_072 + s + 2 * 65_536)
    config = hf("c4ai-command-r7b-12-2024", **AMP_TOY, num_key_value_heads=2)
    spec = spec_from_hf_dict(config, "toy", "toy")
    recompute = Recompute.FULL if checkpoint == "full" else Recompute.NONE
    wl = Workload(micro_batch_size=2, seq_len=256, precision="amp-bf16", compile=True,
                  recompute=recompute)
    validate(spec, ParallelConfig(), wl)  # two layers, both with RoPE: not refused
    dm = Dims.of(spec, ParallelConfig(), wl)
    kind = layer_kind(spec, wl, dm, False, recompute)
    stream = dm.rows * spec.hidden_size * 4
    _, traced_forward, traced_backward = compiled_layer_step(
        config, "float32", 2, 256, autocast="bfloat16", checkpoint=checkpoint,
        gpu_realize=True)
    generator = 5_056 if checkpoint == "full" else 0
    assert (traced_forward, traced_backward) == (forward, backward)
    assert kind.forward_peak_bytes - stream == forward - generator
    modelled = _model_backward(kind, grad_group_params(spec, 1, 1, False), 4, stream)
    assert modelled - backward == (81_920 if checkpoint == "none" else -generator)
    if checkpoint == "none":  # the kernel's moment itself, exact
        at_kernel = next(m for m in kind.moments if m.name == "mlp_act")
        assert (at_kernel.alive_bytes + at_kernel.transient_bytes - stream
                + 4 * 256 * 896) == backward


# held out from every layer above: wider heads (6 of 64), a batch of three (3 x 160 tokens)
WIDE = dict(num_hidden_layers=2, hidden_size=384, num_attention_heads=6, head_dim=64,
            vocab_size=1000)


@pytest.mark.parametrize("model, kv, ffn", [("gemma-2-9b", 3, 1152),
                                            ("gemma-3-12b-pt", 3, 1152),
                                            ("Meta-Llama-3-8B", 6, 512)])
def test_compiled_norm_reductions_after_attention(model: str, kv: int, ffn: int) -> None:
    """transformers' layers in bf16, compiled, no recompute, 3 x 160 tokens (T 480, h 384,
    one kernel per scheduler node, GPU realization rules), where the backward peaks at
    SDPA's backward, not at the MLP's kernel as in the layers above. Inductor fuses the
    norms' weight-gradient reductions, all but the attention norm's, into one kernel after
    the attention's input-gradient matmuls, and their inputs are alive through SDPA's
    backward (``compiled_order.with_norm_reductions_last``). Before, memplan's attention
    moments held none of them: Gemma 2 -2.6%, Gemma 3 -2.5%, Llama (all KV heads, ffn
    512) -15.5%.

    Gemma 2 and 3 (sandwich norms, the fp32 residual gradient, the output projection's own
    output gradient) are exact. Llama's layer holds its residual gradient (``buf10``) beside
    the incoming gradient, which the graph deletes after the MLP norm's kernel but its
    caller holds; it is 294,912 B over: Inductor keeps its baseline order there (its log:
    baseline 5,987,328 B, bfs the same, lpmf and dfs above), which runs the output
    projection's weight gradient (h x h x 2 B, counted) after SDPA's backward."""
    from memplan.model.layer import grad_group_params
    from memplan.parallel import validate
    from recorded import compiled_layer_step  # tests/traced/recorded.py

    config = hf(model, **WIDE, intermediate_size=ffn, num_key_value_heads=kv)
    spec = spec_from_hf_dict(config, "toy", "toy")
    wl = Workload(micro_batch_size=3, seq_len=160, compile=True, recompute=Recompute.NONE,
                  precision="bf16-pure")
    validate(spec, ParallelConfig(), wl)
    dm = Dims.of(spec, ParallelConfig(), wl)
    kind = layer_kind(spec, wl, dm, False, Recompute.NONE)
    s = dm.rows * spec.hidden_size * dm.stream_e
    backward = _model_backward(kind, grad_group_params(spec, 1, 1, False), dm.stream_e) - s
    _, forward, traced = compiled_layer_step(config, "bfloat16", 3, 160, checkpoint="none",
                                             gpu_realize=True)
    assert kind.forward_peak_bytes - s == forward
    attention = max(kind.moments, key=lambda m: m.alive_bytes + m.transient_bytes
                    + dm.stream_e * sum(grad_group_params(spec, 1, 1, False)[g]
                                        for g in m.grads_before))
    assert attention.name == "attention.0"
    if model == "Meta-Llama-3-8B":
        assert backward - traced == 384 * 384 * 2
    else:
        assert backward == traced


@pytest.mark.parametrize("kv, traced_bytes", [(8, 26_338_304), (2, 23_370_752)])
def test_compiled_qk_norm_input_grads(kv: int, traced_bytes: int) -> None:
    """transformers' Qwen3 layer (per-head q/k norms before RoPE) under autocast, compiled,
    no recompute, h 512, 8 heads of 64, ffn 1,376, 1 x 768 tokens (one kernel per scheduler
    node, GPU realization rules). Inductor keeps its baseline order (its log: baseline, lpmf
    and bfs 25,458,688 B for 8 KV heads), which runs every attention weight gradient after
    the attention's input-gradient matmuls: the backward peaks at q's (``mm_20``), holding
    RoPE's fp32 backward outputs, the norms' input gradients, dv, the three input gradients
    and the output projection's output gradient (``compiled_order.with_qk_norm_input_grads``):
    exact, -3.90% (8 KV heads) and -4.04% (2) before, at SDPA's backward."""
    from memplan.model.layer import grad_group_params
    from recorded import compiled_layer_step  # tests/traced/recorded.py

    config = hf("Qwen3-8B", num_hidden_layers=2, hidden_size=512, intermediate_size=1376,
                num_attention_heads=8, head_dim=64, vocab_size=1000, num_key_value_heads=kv)
    spec = spec_from_hf_dict(config, "toy", "toy")
    wl = Workload(micro_batch_size=1, seq_len=768, compile=True, recompute=Recompute.NONE,
                  precision="amp-bf16")
    dm = Dims.of(spec, ParallelConfig(), wl)
    kind = layer_kind(spec, wl, dm, False, Recompute.NONE)
    s = dm.rows * spec.hidden_size * dm.stream_e
    groups = grad_group_params(spec, 1, 1, False)
    _, forward, backward = compiled_layer_step(config, "float32", 1, 768,
                                               autocast="bfloat16", checkpoint="none",
                                               gpu_realize=True)
    assert backward == traced_bytes
    assert kind.forward_peak_bytes - s == forward
    assert _model_backward(kind, groups, dm.stream_e, s) == backward
    peak = max(kind.moments, key=lambda m: m.alive_bytes + m.transient_bytes
               + dm.stream_e * sum(groups[g] for g in m.grads_before))
    assert peak.name == "attention_qk_norm"


@pytest.mark.parametrize("amp", [False, True])
def test_compiled_norm_reductions_rebuilt(amp: bool) -> None:
    """The same Llama layer (all KV heads, ffn 512) rebuilt inside the compiled graph (full
    recompute, the checkpoint inside it), 3 x 160 tokens (S = 480 x 384 x 2 B = 368,640).

    Forward, bf16 and under autocast alike: the peak at RoPE's kernel
    (``compiled_order.rebuilt_rope_bytes``), q, k, v, each rotated half and both rotated
    outputs, 7 S, the norm's output freed after the projections (+14.3% in bf16 and -18.1%
    under autocast before), beside the input (not counted here).

    Backward, bf16: Inductor takes lpmf's order (its log: 6,282,240 B against the baseline's
    6,355,968), which runs the output projection's weight gradient before SDPA's backward,
    and peaks there beside the MLP norm's deferred reduction's inputs and the residual
    gradient: exact (-5.5% before). Under autocast not modelled to the kernel: -0.27%."""
    from memplan.model.layer import grad_group_params
    from recorded import compiled_layer_step  # tests/traced/recorded.py

    config = hf("Meta-Llama-3-8B", **WIDE, intermediate_size=512, num_key_value_heads=6)
    spec = spec_from_hf_dict(config, "toy", "toy")
    wl = Workload(micro_batch_size=3, seq_len=160, compile=True, recompute=Recompute.FULL,
                  precision="amp-bf16" if amp else "bf16-pure")
    dm = Dims.of(spec, ParallelConfig(), wl)
    kind = layer_kind(spec, wl, dm, False, Recompute.FULL)
    s = dm.rows * spec.hidden_size * dm.stream_e
    groups = grad_group_params(spec, 1, 1, False)
    cast = {"autocast": "bfloat16"} if amp else {}
    _, forward, traced = compiled_layer_step(config, "float32" if amp else "bfloat16", 3, 160,
                                             **cast, checkpoint="full", gpu_realize=True)
    assert kind.forward_peak_bytes - s == forward == 7 * 368_640
    if amp:
        backward = _model_backward(kind, groups, dm.stream_e, s)
        assert backward - traced == -24_576
    else:
        backward = _model_backward(kind, groups, dm.stream_e) - s
        assert backward == traced == 6_650_880


def test_compiled_autocast_sandwich_weight_gradients_first() -> None:
    """Gemma 2's layer under autocast without recompute (h 384, 6 heads of 64, 3 KV, ffn
    1,152), 1 x 640 tokens. Deferring the MLP's weight gradients (dfs's order) would also defer
    the MLP post norm's reduction, whose saved input and statistics it then holds beside the
    down projection's output gradient; with those counted ``compiled.down_grad_deferred`` keeps
    them first, as Inductor does (at 3 x 160 tokens its log: dfs 74,112 B above the baseline,
    exactly that difference). The backward is exact (2.1% under before, deferring)."""
    from memplan.model.layer import grad_group_params
    from recorded import compiled_layer_step  # tests/traced/recorded.py

    config = hf("gemma-2-9b", **WIDE, intermediate_size=1152, num_key_value_heads=3)
    spec = spec_from_hf_dict(config, "toy", "toy")
    wl = Workload(micro_batch_size=1, seq_len=640, compile=True, recompute=Recompute.NONE,
                  precision="amp-bf16")
    dm = Dims.of(spec, ParallelConfig(), wl)
    kind = layer_kind(spec, wl, dm, False, Recompute.NONE)
    s = dm.rows * spec.hidden_size * dm.stream_e
    backward = _model_backward(kind, grad_group_params(spec, 1, 1, False), dm.stream_e, s)
    _, _, traced = compiled_layer_step(config, "float32", 1, 640, autocast="bfloat16",
                                       checkpoint="none", gpu_realize=True)
    assert "mlp" in {m.name: m for m in kind.moments}["attention.0"].grads_before
    assert backward == traced


@pytest.mark.parametrize("checkpoint,fused", [("none", True), ("full", True), ("full", False)])
def test_compiled_titan_block_all_kv_heads(checkpoint: str, fused: bool) -> None:
    """torchtitan's block with as many KV heads as query heads (dim 384, 6 heads of 64, its
    ffn 1,024), bf16, compiled, 3 x 160 tokens (S = 480 x 384 x 2 B = 368,640).

    Backward, fused wqkv: q and k are the same size, so Inductor's wrapper holds q's fp32
    upcast (T x q x 4 B) for k's RoPE backward while q's complex product and the fused q/k/v
    gradient are made (``compiled.attention_backward_moments``' third moment: S + 2 x 3 S +
    2 x 2 S + the table), the backward's peak. Without recompute the same kernels follow the
    MLP's (``compiled.rebuilt_attention_schedule``). Before: -13.4% (none) and -1.96% (full);
    now exact rebuilt, and without recompute one row's fp32 statistics under (1,920 B).
    Separate wq/wk/wv rebuilt: -1.96% (that schedule modelled for the fused block alone).

    Forward rebuilt (``compiled_order._titan_rope_bytes``): fused, Inductor takes lpmf's order
    (its estimate of RoPE's moment in the baseline, 9 S and the table, 3,358,720 B, above
    the MLP's, 3,322,816 B), at k's fp32 upcast the input, wqkv's output 3 S, v's split copy
    S and both upcasts 2 x 2 S; separate, at q's complex product, the input, k, v and three
    fp32 tensors: 9 S either way (8.4% under before), and the attention norm's fp32
    statistics (480 x 4 B), which the wrapper holds for the MLP norm's: exact."""
    from memplan.model.layer import grad_group_params
    from memplan.profile.frameworks import torchtitan_config, torchtitan_spec
    from recorded import compiled_layer_step  # tests/traced/recorded.py

    fields = dict(dim=384, n_layers=1, n_heads=6, n_kv_heads=6, vocab_size=1000)
    spec = torchtitan_spec(torchtitan_config(**fields, seq_len=160, fuse_qkv=fused), "toy")
    recompute = Recompute.FULL if checkpoint == "full" else Recompute.NONE
    wl = Workload(micro_batch_size=3, seq_len=160, precision="bf16-pure", recompute=recompute,
                  compile=True, rope_cache="layer", selective_impl="op")
    dm = Dims.of(spec, ParallelConfig(), wl)
    kind = layer_kind(spec, wl, dm, False, recompute)
    s = dm.rows * spec.hidden_size * dm.e
    backward = _model_backward(kind, grad_group_params(spec, 1, 1, False), dm.e) - s
    _, forward, traced = compiled_layer_step({"torchtitan": dict(fields, fuse_qkv=fused)},
                                             "bfloat16", 3, 160, checkpoint=checkpoint,
                                             gpu_realize=True)
    if checkpoint == "full":
        assert kind.forward_peak_bytes == 9 * 368_640 + 480 * 4
        assert forward == kind.forward_peak_bytes - s
    if not fused:
        assert traced - backward == 176_896  # (-1.96%)
        return
    peak = max(kind.moments, key=lambda m: m.alive_bytes + m.transient_bytes + dm.e * sum(
        grad_group_params(spec, 1, 1, False)[g] for g in m.grads_before))
    assert peak.name == "attention_cat"
    assert traced - backward == (480 * 4 if checkpoint == "none" else 0)


@pytest.mark.parametrize("dim,heads,held,float8", [(256, 16, 0, "none"), (320, 5, 1, "none"),
                                                   (384, 6, 0, "rowwise")])
def test_compiled_titan_debugmodel_rebuilt_forward(dim: int, heads: int, held: int,
                                                   float8: str) -> None:
    """torchtitan 0.3.0's debugmodel block (dim 256, 16 heads of 16, all KV heads, fused
    wqkv, ffn 768), bf16, compiled, full recompute, 2 x 256 tokens (S = 512 x 256 x 2 B =
    262,144). Inductor's estimate of the MLP's act kernel (the output projection's output
    and three T x f buffers: 10 S) is above its estimate of RoPE's moment in its baseline
    order (9 S and the table), so every sort ties and the baseline stays
    (``compiled_order._titan_rope_bytes``): v is copied out of wqkv's output last, and at
    q's complex product wqkv's output (3 S), both fp32 upcasts (2 x 2 S), the product (2 S)
    and the attention norm's statistics (512 x 4 B) are alive beside the input: 9 S +
    2,048 B (memplan 8 S, lpmf's order, -11.2% before). The backward was exact before.

    Held out, dim 320 (5 heads of 64, ffn 1,024: the MLP's estimate 10.6 S): the baseline
    stays, and the wrapper holds the norm's output for q's bf16 cast, as that keeps its
    estimate below the MLP's (9 S + the table + S): 10 S + 2,048 B (-10.0% without).
    Float8 rowwise at dim 384 (6 heads of 64, ffn 1,024), where bf16 takes lpmf's order:
    the baseline, 9 S, the norm fused into the input's float8 cast, no statistics buffer
    (-11.1% before)."""
    from memplan.model.layer import grad_group_params
    from memplan.profile.frameworks import torchtitan_config, torchtitan_spec
    from recorded import compiled_layer_step  # tests/traced/recorded.py

    fields = dict(dim=dim, n_layers=1, n_heads=heads, n_kv_heads=heads, vocab_size=2048)
    spec = torchtitan_spec(torchtitan_config(**fields, seq_len=256), "toy")
    assert spec.ffn_hidden_size == {256: 768, 320: 1024, 384: 1024}[dim]
    wl = Workload(micro_batch_size=2, seq_len=256, precision="bf16-pure",
                  recompute=Recompute.FULL, compile=True, rope_cache="layer",
                  selective_impl="op", float8=float8)
    dm = Dims.of(spec, ParallelConfig(), wl)
    kind = layer_kind(spec, wl, dm, False, Recompute.FULL)
    s = 512 * dim * 2
    backward = _model_backward(kind, grad_group_params(spec, 1, 1, False), dm.e) - s
    titan = dict(fields, fuse_qkv=True, **({"float8": float8} if float8 != "none" else {}))
    _, forward, traced = compiled_layer_step({"torchtitan": titan}, "bfloat16", 2, 256,
                                             checkpoint="full", gpu_realize=True)
    assert forward == (9 + held) * s + (512 * 4 if float8 == "none" else 0)
    assert kind.forward_peak_bytes - s == forward
    if float8 == "none":
        assert backward == traced
    else:  # the rowwise scales' rows (memplan's count of them: benchmarks/compiled_backward)
        assert abs(backward - traced) <= 0.001 * traced

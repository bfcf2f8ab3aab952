"""``--framework`` presets: what each fills in, what the user keeps, and the bytes they change."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

import memplan
from memplan import presets
from memplan.cli import app, main
from memplan.errors import MemplanError
from memplan.overheads import no_overheads
from memplan.parallel import ParallelConfig
from memplan.spec import load_model
from memplan.workload import Framework, GradSync, LogitsHeld, NormImpl, OptimizerImpl, Workload

# tiny: V 128, h 64; at b 2, s 128: T = 256 tokens
T, V = 256, 128


def _est(**kw):
    return memplan.estimate("tiny", gpus=1, seq_len=128, micro_batch_size=2,
                            overheads=no_overheads(), **kw)


@pytest.mark.parametrize("framework", [f.value for f in Framework])
def test_every_preset_default_is_a_preset_field_with_a_source(framework: str) -> None:
    """Each preset's defaults are fields a preset may set, each with its source: a file and a
    function of that framework, and the version checked; applied to no options, the preset
    gives exactly its own fields (the rest keep the models' defaults)."""
    fw = presets.parse(framework)
    for default in presets.defaults(fw):
        assert default.field in presets.FIELDS
        assert ".py" in default.source and any(ch.isdigit() for ch in default.source)
    spec = load_model("llama-3-8b")
    filled = presets.apply(fw, spec, {})
    assert set(filled) == {default.field for default in presets.defaults(fw)}


@pytest.mark.parametrize("framework", [f.value for f in Framework])
def test_every_preset_is_a_selection_of_mechanisms(framework: str) -> None:
    """A preset selects each mechanism at most once, with settings of that mechanism only
    (``presets.SETTINGS``), no setting twice; the mechanisms' settings are disjoint."""
    selections = presets.PRESETS[presets.parse(framework)]
    mechanisms = [s.mechanism for s in selections]
    assert len(mechanisms) == len(set(mechanisms))
    for selection in selections:
        assert selection.defaults
        assert {d.field for d in selection.defaults} <= presets.SETTINGS[selection.mechanism]
    fields = [d.field for d in presets.defaults(presets.parse(framework))]
    assert len(fields) == len(set(fields))
    assert sum(map(len, presets.SETTINGS.values())) == len(frozenset().union(
        *presets.SETTINGS.values()))


def test_preset_fields_are_layout_or_workload_fields() -> None:
    """What a preset may set is a field of the layout (its two) or of the workload, so the
    default it leaves is the model's own."""
    assert presets.LAYOUT_FIELDS <= set(ParallelConfig.model_fields)
    assert presets.FIELDS - presets.LAYOUT_FIELDS <= set(Workload.model_fields)


def test_explicit_options_win_over_the_preset() -> None:
    est = memplan.estimate("llama-3-8b", gpus=8, framework="torchtitan",
                           optimizer_impl="foreach", norm_impl="upcast")
    assert est.workload.optimizer_impl is OptimizerImpl.FOREACH
    assert est.workload.norm_impl is NormImpl.UPCAST
    titan = memplan.estimate("llama-3-8b", gpus=8, framework="torchtitan")
    assert titan.workload.optimizer_impl is OptimizerImpl.FUSED
    assert titan.workload.norm_impl is NormImpl.FUSED
    assert titan.parallel.tp_style.value == "dtensor"


def test_hf_norm_follows_the_architecture() -> None:
    """transformers' Llama RMSNorm is a Python upcast; GPT-2's nn.LayerNorm one kernel."""
    assert memplan.estimate("llama-3-8b", framework="hf").workload.norm_impl is NormImpl.UPCAST
    assert memplan.estimate("gpt2", framework="hf").workload.norm_impl is NormImpl.FUSED


def test_generic_is_the_reference_model() -> None:
    """No preset: the defaults every earlier estimate used."""
    est = memplan.estimate("llama-3-8b", gpus=8)
    wl = est.workload
    assert wl.framework is Framework.GENERIC and wl.optimizer_impl is OptimizerImpl.FOREACH
    assert wl.logits_held is LogitsHeld.NONE and not wl.softmax_fp32 and not wl.kv_cache
    assert est.assumptions[0].startswith("framework: generic")


def test_assumptions_name_each_default_and_its_source() -> None:
    est = memplan.estimate("llama-3-8b", gpus=8, framework="hf")
    lines = [a for a in est.assumptions if a.startswith("hf: ")]
    assert len(lines) == len(presets.defaults(Framework.HF))
    assert any("training_args.py" in a and "fused" in a for a in lines)
    # a default the user overrode is not claimed as the framework's
    own = memplan.estimate("llama-3-8b", gpus=8, framework="hf", optimizer_impl="foreach")
    assert not any(a.startswith("hf: optimizer_impl") for a in own.assumptions)


def test_hf_holds_the_compute_dtype_logits_through_the_loss() -> None:
    """bf16-pure tiny at b 2, s 128: the forward peaks at the loss, where transformers' output
    keeps the bf16 logits (T * V * 2 = 65,536 B) beside the fp32 copy the loss reads. The
    generic estimate with the same optimizer is lower by exactly that; in fp32 the upcast is
    the tensor itself and nothing is added."""
    hf = _est(precision="bf16-pure", framework="hf").worst
    generic = _est(precision="bf16-pure", optimizer_impl="fused").worst
    assert hf.steady.forward - generic.steady.forward == T * V * 2 == 65_536
    assert hf.steady.backward == generic.steady.backward
    fp32_hf = _est(precision="fp32", framework="hf").worst
    fp32 = _est(precision="fp32", optimizer_impl="fused").worst
    assert fp32_hf.steady.forward == fp32.steady.forward


def test_lightning_keeps_the_logits_to_the_next_forward() -> None:
    """litgpt's pretrain loop keeps the fp32 logits the loss read (T * V * 4 = 131,072 B)
    through backward and the optimizer step; from step 2 they are alive in forward until the
    new logits replace them (so not at step 1's forward)."""
    lit = _est(precision="bf16-pure", framework="lightning").worst
    generic = _est(precision="bf16-pure", framework="lightning", logits_held="none").worst
    held = T * V * 4
    assert lit.steady.backward - generic.steady.backward == held == 131_072
    assert lit.steady.optimizer - generic.steady.optimizer == held
    assert lit.first_step.forward == generic.first_step.forward


def test_hf_eager_softmax_in_fp32() -> None:
    """transformers' eager attention saves the fp32 softmax and its bf16 copy: per layer
    b * heads * s * s * (4 + 2) where the generic eager core saves one bf16 softmax."""
    scores = 2 * 4 * 128 * 128
    hf = _est(precision="bf16-pure", framework="hf", attention="eager").worst
    generic = _est(precision="bf16-pure", attention="eager", optimizer_impl="fused").worst
    assert hf.activations_bytes - generic.activations_bytes == 2 * scores * (4 + 2 - 2)


@pytest.mark.parametrize(("framework", "option", "kwargs"), [
    ("hf", "--recompute selective", {"recompute": "selective"}),
    ("torchtitan", "--zero 1 or 2", {"zero": 2}),
    ("megatron", "--zero 2 or 3", {"zero": 3}),
])
def test_options_a_framework_lacks_are_refused(framework: str, option: str,
                                               kwargs: dict) -> None:
    with pytest.raises(MemplanError, match=f"--framework {framework} with {option}"):
        memplan.estimate("llama-3-8b", gpus=8, framework=framework, **kwargs)


def test_cli_framework_json_and_refusal(capsys: pytest.CaptureFixture[str]) -> None:
    ok = CliRunner().invoke(app, ["estimate", "-m", "llama-3-8b", "-n", "8", "--framework",
                                  "hf", "--json"], catch_exceptions=False)
    assert ok.exit_code == 0
    data = json.loads(ok.stdout)
    assert data["framework"] == "hf" and data["workload"]["logits_held"] == "loss"
    assert data["workload"]["optimizer_impl"] == "fused"
    for args in (["estimate", "-m", "llama-3-8b", "--framework", "hf", "--recompute",
                  "selective"],
                 ["plan", "-m", "llama-3-8b", "-n", "8", "--framework", "hf", "--recompute",
                  "selective"]):
        assert main(args) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "--framework hf with --recompute selective" in err
    assert main(["estimate", "-m", "llama-3-8b", "--framework", "jax"]) == 2
    assert "jax" in capsys.readouterr().err


def test_plan_searches_only_what_the_framework_offers() -> None:
    result = memplan.plan("llama-3-8b", gpus=8, framework="hf")
    assert result.candidates
    assert all(c.recompute.label != "selective" for c in result.candidates)


def test_megatron_cross_entropy_terms_by_hand() -> None:
    """_VocabParallelCrossEntropy on tiny (V 128) at b 2, s 128, T 256: the saved fp32
    softmax T * V * 4 (the log-softmax's size), the target mask and indices T * (1 + 8); at
    the loss only the bf16 logits beside it (T * V * 2, where PyTorch's loss holds fp32
    logits, T * V * 4); its backward works in place: only the bf16 gradient (T * V * 2, where
    PyTorch's makes two fp32 ones)."""
    from memplan.model.dims import Dims
    from memplan.model.head import forward_extra_bytes, head_terms, loss_backward_bytes

    spec = load_model("tiny")
    for loss_impl, softmax, fwd, bwd in (("megatron", T * V * 4, T * V * 2, T * V * 2),
                                          ("generic", T * V * 4, T * V * 4, 2 * T * V * 4)):
        wl = memplan.api.make_workload(spec, seq_len=128, micro_batch_size=2,
                                       loss_impl=loss_impl)
        dm = Dims.of(spec, memplan.api.make_layout(1), wl)
        terms = {t.name: t.size_bytes for t in head_terms(spec, wl, dm)}
        assert terms.get("loss.softmax", terms.get("loss.log_softmax")) == softmax
        assert forward_extra_bytes(spec, wl, dm) == fwd
        assert loss_backward_bytes(spec, wl, dm, 0) == bwd
    assert terms.get("loss.target_mask") is None
    megatron = memplan.estimate("tiny", framework="megatron", seq_len=128, micro_batch_size=2)
    assert megatron.workload.loss_impl.value == "megatron"


def test_megatron_fused_cross_entropy_backward_by_hand() -> None:
    """--cross-entropy-loss-fusion compiled (loss_impl megatron-fused) on tiny (V 128) at b 2,
    s 128, T 256: the same saved fp32 softmax T * V * 4 and forward (bf16 logits T * V * 2)
    as the unfused loss; its backward holds the bf16 gradient T * V * 2 and the fp32 copy of
    the softmax the functionalized index_put writes into, T * V * 4: 196,608 B."""
    from memplan.model.dims import Dims
    from memplan.model.head import forward_extra_bytes, head_terms, loss_backward_bytes

    spec = load_model("tiny")
    wl = memplan.api.make_workload(spec, seq_len=128, micro_batch_size=2,
                                   loss_impl="megatron-fused")
    dm = Dims.of(spec, memplan.api.make_layout(1), wl)
    terms = {t.name: t.size_bytes for t in head_terms(spec, wl, dm)}
    assert terms["loss.softmax"] == T * V * 4 == 131_072
    assert forward_extra_bytes(spec, wl, dm) == T * V * 2
    assert loss_backward_bytes(spec, wl, dm, 0) == T * V * (2 + 4) == 196_608
    # a chunked loss is PyTorch's whichever the implementation: no copy
    chunked = memplan.api.make_workload(spec, seq_len=128, micro_batch_size=2,
                                        loss_impl="megatron-fused", loss_chunks=2)
    generic = memplan.api.make_workload(spec, seq_len=128, micro_batch_size=2, loss_chunks=2)
    assert (loss_backward_bytes(spec, chunked, Dims.of(spec, memplan.api.make_layout(1),
                                                       chunked), 0)
            == loss_backward_bytes(spec, generic, Dims.of(spec, memplan.api.make_layout(1),
                                                          generic), 0))


def test_torchtitan_per_op_sac_by_hand() -> None:
    """Llama-3-8B at b 2, s 8192 (T 16,384 tokens, bf16) under torchtitan's per-op SAC, one
    layer: its input T*h*2, then of the matmuls wqkv, wo, w1, w3, w2 (fused q/k/v) the 1st,
    3rd and 5th outputs kept: qkv T*(q+2kv)*2, w1 T*f*2, w2 T*h*2; and the attention kernel's
    output T*q*2 and fp32 logsumexp b*a*s*4. 1,075,838,976 B a layer, where memplan's
    core-recompute selective keeps 3.29 GB."""
    from memplan.model.dims import Dims
    from memplan.model.layer import layer_kind
    from memplan.workload import Recompute

    spec = load_model("llama-3-8b")
    t, h, q, kv, f = 16_384, 4096, 4096, 1024, 14_336
    wl = memplan.api.make_workload(spec, framework="torchtitan", selective_impl="op",
                                   fused_qkv=True, recompute="selective", seq_len=8192,
                                   micro_batch_size=2, precision="fsdp-bf16")
    dm = Dims.of(spec, memplan.api.make_layout(8, zero=3), wl)
    kind = layer_kind(spec, wl, dm, False, Recompute.SELECTIVE)
    expected = (t * h * 2 + t * (q + 2 * kv) * 2 + t * f * 2 + t * h * 2 + t * q * 2
                + 2 * 32 * 8192 * 4)
    assert kind.saved_bytes == expected == 1_075_838_976
    core = memplan.api.make_workload(spec, recompute="selective", seq_len=8192,
                                     micro_batch_size=2, precision="fsdp-bf16")
    assert layer_kind(spec, core, dm, False, Recompute.SELECTIVE).saved_bytes > 3 * expected


def test_litgpt_rmsnorm_saves_fp32_normed_and_weight() -> None:
    """litgpt's RMSNorm multiplies by weight.float() before the cast back: per norm the
    normalised tensor is saved in fp32 (T*h*4 where the HF-style upcast saves T*h*2) and the
    fp32 weight copy (h*4). tiny, bf16-pure, b 2, s 128: 5 norms (2 per layer and the final)."""
    upcast = _est(precision="bf16-pure", norm_impl="upcast").worst
    litgpt = _est(precision="bf16-pure", norm_impl="upcast-fp32").worst
    assert litgpt.activations_bytes - upcast.activations_bytes == 5 * (T * 64 * 2 + 64 * 4)


def test_rope_tables_as_registered_buffers() -> None:
    """torchtitan: a complex64 cache per layer, s * d/2 * 8 B (2 layers * 128 * 8 * 8 =
    16,384); litgpt: model-wide cos and sin in the weights' dtype (2 * 128 * 16 * 2 = 8,192).
    Resident in every phase, and no longer saved per micro-batch (2 * s * d * e = 8,192)."""
    titan = _est(precision="bf16-pure", framework="torchtitan").worst
    lit = _est(precision="bf16-pure", framework="lightning").worst
    assert (titan.buffers_bytes, lit.buffers_bytes) == (16_384, 8_192)
    assert _est(precision="bf16-pure").worst.buffers_bytes == 0
    for est, fw in ((titan, "torchtitan"), (lit, "lightning")):
        assert "rope.cos_sin" not in {t.name for t in est.activation_terms}
        computed = _est(precision="bf16-pure", framework=fw, rope_cache="forward").worst
        assert computed.activations_bytes - est.activations_bytes == 2 * 128 * 16 * 2
        assert est.steady.optimizer - computed.steady.optimizer == est.buffers_bytes
    fp32 = _est(precision="fp32", framework="lightning").worst
    assert fp32.buffers_bytes == 2 * 128 * 16 * 4


def test_rope_table_one_complex_buffer_on_the_model() -> None:
    """torchtitan before 0.3 (``Transformer.freqs_cis`` at 9dec370, e7c0cae, v0.2.2): one
    complex64 table on the model for every position, s * d/2 * 8 B = 128 * 8 * 8 = 8,192
    whatever the layer count (the per-layer cache of 0.3 is 2 * 8,192 on tiny's 2 layers) and
    the weights' dtype; resident in every phase like the others."""
    one = _est(precision="fsdp-bf16", framework="torchtitan", rope_cache="model-complex").worst
    per_layer = _est(precision="fsdp-bf16", framework="torchtitan").worst
    assert (one.buffers_bytes, per_layer.buffers_bytes) == (8_192, 16_384)
    fp32 = _est(precision="fp32", framework="torchtitan", rope_cache="model-complex").worst
    assert fp32.buffers_bytes == 8_192
    assert per_layer.steady.optimizer - one.steady.optimizer == 8_192


def test_litgpt_attention_terms() -> None:
    """litgpt's CausalSelfAttention: with grouped K/V (tiny: 2 of 4 heads) k and v are saved
    repeated to the query width (T * 64 * 2 = 32,768 each, not 16,384); the core's head-major
    output is saved beside its copy for the projection (32,768). Without grouping (Llama 2
    7B) v's view keeps the whole qkv output: its q and k parts, T * (4096 + 4096) * 2."""
    from memplan.model.attention import attention_terms
    from memplan.model.dims import Dims
    from memplan.parallel import ParallelConfig
    from memplan.workload import Recompute, Workload

    wl = Workload(precision="bf16-pure", micro_batch_size=2, seq_len=128,
                  attention_impl="litgpt")
    spec = load_model("tiny")
    terms = {t.name: t.size_bytes for t in attention_terms(spec, wl, Dims.of(
        spec, ParallelConfig(), wl), Recompute.NONE)}
    assert (terms["attn.k"], terms["attn.v"], terms["attn.core_out"]) == (32_768,) * 3
    assert "attn.qkv_pinned" not in terms
    mha = load_model("llama-2-7b")
    terms = {t.name: t.size_bytes for t in attention_terms(mha, wl, Dims.of(
        mha, ParallelConfig(), wl), Recompute.NONE)}
    assert terms["attn.qkv_pinned"] == 256 * 8192 * 2
    assert terms["attn.v"] == 256 * 4096 * 2


def test_split_loss_backward_holds_one_logits_gradient() -> None:
    """litgpt's chunked_cross_entropy splits the T = 256 tokens into 128-token pieces: once
    every piece's backward has freed its log-softmax, the split's backward concatenates their
    gradients: L = T * V * 4 = 131,072 beyond the rest, where one piece holds 2 L."""
    from memplan.model.dims import Dims
    from memplan.model.head import loss_backward_bytes
    from memplan.parallel import ParallelConfig
    from memplan.workload import Workload

    spec = load_model("tiny")
    for split, expected in ((128, 131_072), (0, 262_144), (256, 262_144)):
        wl = Workload(precision="bf16-pure", micro_batch_size=2, seq_len=128, loss_split=split)
        assert loss_backward_bytes(spec, wl, Dims.of(spec, ParallelConfig(), wl), 0) == expected


def test_kv_cache_with_fused_qkv_pins_the_projection() -> None:
    """GPT-2 under transformers with use_cache: the DynamicCache's K/V copies go to SDPA while
    q, a view of c_attn's output, keeps all of it: its k and v parts, T * 2 * 768 * 4 (the
    spec transformers' GPT2Config maps to: one fused c_attn parameter)."""
    spec = load_model("gpt2").model_copy(update={"fused_qkv": True})
    gpt2 = memplan.estimate(spec, gpus=1, seq_len=128, micro_batch_size=2, precision="fp32",
                            framework="hf", overheads=no_overheads()).worst
    off = memplan.estimate(spec, gpus=1, seq_len=128, micro_batch_size=2, precision="fp32",
                           framework="hf", kv_cache=False, overheads=no_overheads()).worst
    names = {t.name: t.size_bytes for t in gpt2.activation_terms}
    assert names["attn.qkv_pinned"] == 12 * 256 * 2 * 768 * 4
    assert gpt2.activations_bytes - off.activations_bytes == 12 * 256 * 2 * 768 * 4


def test_megatron_gradient_buffer_exists_from_the_wrap() -> None:
    """Megatron-LM wraps the model in its DDP even on one rank: the contiguous fp32 gradient
    buffer (numel * 4 B) is allocated then, so it is in step 1's forward too."""
    kw = dict(precision="bf16-fp32-grads", optimizer_impl="fused", norm_impl="fused",
              loss_impl="megatron")
    megatron = _est(framework="megatron", **kw).worst
    plain = _est(**kw).worst
    # tiny's 108,864 parameters (tests/unit/test_states.py) at 4 B
    assert megatron.grads_bytes == plain.grads_bytes == 108_864 * 4 == 435_456
    assert megatron.first_step.forward - plain.first_step.forward == megatron.grads_bytes


def test_torchtitan_vocab_parallel_loss_holds_one_more_logits_tensor() -> None:
    """torchtitan's _LossParallelCrossEntropy (components/loss.py) under TP: its forward keeps
    ``shifted`` beside the fp32 logits and the log-probabilities, its fused backward makes
    zeros_like, exp and their sum where F.cross_entropy's makes two. llama-3-8b at tp 2,
    2,048 tokens: one vocabulary shard of fp32 logits is 2,048 * 64,128 * 4 = 525,336,576 B
    more at the loss in both phases; at tp 1 the logits are whole and the loss is
    F.cross_entropy."""
    shard = 2048 * 64_128 * 4
    kw = dict(gpus=8, zero=3, framework="torchtitan", precision="fsdp-bf16", seq_len=2048)
    titan = memplan.estimate("llama-3-8b", tp=2, **kw).stages[0]
    generic = memplan.estimate("llama-3-8b", tp=2, loss_impl="generic", **kw).stages[0]
    assert titan.first_step.forward - generic.first_step.forward == shard
    assert titan.first_step.backward - generic.first_step.backward == shard
    one = memplan.estimate("llama-3-8b", **kw).stages[0]
    same = memplan.estimate("llama-3-8b", loss_impl="generic", **kw).stages[0]
    assert one.first_step == same.first_step


def test_hf_accumulates_without_sync_but_under_deepspeed() -> None:
    """hf's Trainer syncs only a step's last micro-batch under DDP and FSDP2 (grad_sync last,
    the preset's), and every one under DeepSpeed: there ZeRO-2, which refuses "last" from
    other loops, is accepted and holds what "every" holds (only FSDP2 units change)."""
    fsdp = memplan.estimate("tiny", gpus=2, zero=3, seq_len=128, micro_batch_size=2,
                            global_batch_size=8, framework="hf", overheads=no_overheads())
    assert fsdp.workload.grad_sync is GradSync.LAST
    assert any(line.startswith("hf: grad_sync = last (trainer.py")
               for line in fsdp.assumptions)
    ds = dict(gpus=2, zero=2, seq_len=128, micro_batch_size=2, global_batch_size=8,
              overheads=no_overheads())
    hf = memplan.estimate("tiny", framework="hf", **ds)
    assert hf.workload.grad_sync is GradSync.LAST
    every = memplan.estimate("tiny", framework="hf", grad_sync="every", **ds)
    assert hf.peak_bytes == every.peak_bytes
    with pytest.raises(MemplanError, match="grad_sync last with zero 2"):
        memplan.estimate("tiny", grad_sync="last", **ds)


def test_lightning_accumulates_without_sync_but_under_deepspeed() -> None:
    """litgpt's loops run every micro-batch but a step's last under
    fabric.no_backward_sync (grad_sync last, the preset's); Fabric's DeepSpeed strategy has
    no backward sync control, so ZeRO-2 is accepted and holds what "every" holds."""
    fsdp = memplan.estimate("tiny", gpus=2, zero=3, seq_len=128, micro_batch_size=2,
                            global_batch_size=8, framework="lightning",
                            overheads=no_overheads())
    assert fsdp.workload.grad_sync is GradSync.LAST
    assert any(line.startswith("lightning: grad_sync = last (litgpt/pretrain.py")
               for line in fsdp.assumptions)
    ds = dict(gpus=2, zero=2, seq_len=128, micro_batch_size=2, global_batch_size=8,
              overheads=no_overheads())
    lit = memplan.estimate("tiny", framework="lightning", **ds)
    every = memplan.estimate("tiny", framework="lightning", grad_sync="every", **ds)
    assert lit.workload.grad_sync is GradSync.LAST and lit.peak_bytes == every.peak_bytes


def test_torchtitan_chunked_loss_runs_its_backward_in_the_loss_by_hand() -> None:
    """torchtitan's ChunkedLossWrapper (the preset's loss_chunk_backward in-loss), tiny (V 128,
    h 64) at b 2, s 128 (T 256), fsdp-bf16, 8 chunks of c = 32 tokens on 2 ranks.

    Held through the loss call: the chunks' copies of the final norm's output T*h*2 = 32,768
    and of the targets T*8 = 2,048 (b > 1), the fp32 input-gradient sum T*h*4 = 65,536, the
    fp32 total 4: 100,356. The head's summed weight gradient, fp32 and whole: V*h*4 = 32,768.
    A later chunk's loss backward: that sum, the bf16 logits c*V*2 = 8,192 and three fp32
    logits-sized tensors 3*c*V*4 = 49,152 (90,112); its projection's backward: the sum, the
    logits and their gradient 2*8,192, the new bf16 weight gradient V*h*2 = 16,384, the
    chunk's input gradient c*h*2 = 4,096 (69,632). So the loss's forward holds 100,356 +
    90,112 = 190,468 beyond what is saved. The last chunk's reduce: 100,356 + 32,768 + the
    logits 8,192 + the input gradient 4,096 = 145,412 beside the reduce's own bytes; its
    reduce-scatter input (V*h*4 = 32,768 whole) stays held into the backward. The loss's and
    the projection's backward add nothing, and what is saved has the same bytes as with the
    rerun chunks (the summed input gradient in place of the final norm's output)."""
    from memplan.model import head, loss_in_call
    from memplan.model.dims import Dims

    spec, par, wl = memplan.api.resolve("tiny", gpus=2, zero=3, framework="torchtitan",
                                        loss_chunks=8, seq_len=128, micro_batch_size=2,
                                        precision="fsdp-bf16")
    assert head.in_loss(wl)
    dm = Dims.of(spec, par, wl)
    assert loss_in_call.held_bytes(spec, wl, dm) == 100_356
    assert loss_in_call.forward_extra_bytes(spec, wl, dm) == 190_468
    assert loss_in_call.last_chunk_bytes(spec, wl, dm, 0) == 145_412
    assert head.loss_backward_bytes(spec, wl, dm, V * 64 * 2) == 0
    assert head.linear_backward_bytes(spec, wl, dm, V * 64 * 2) == 0
    rerun = wl.model_copy(update={"loss_chunk_backward": "rerun"})
    saved = {t.name: t.size_bytes for t in head.head_terms(spec, wl, dm)}
    assert saved["loss.input_grad"] == T * 64 * 2
    assert sum(saved.values()) == sum(t.size_bytes for t in head.head_terms(spec, rerun, dm))
    est = memplan.estimate("tiny", gpus=2, zero=3, seq_len=128, micro_batch_size=2,
                           loss_chunks=8, framework="torchtitan", overheads=no_overheads())
    assert est.workload.loss_chunk_backward.value == "in-loss"
    from memplan.model.estimate import IN_LOSS_CAVEAT, LOSS_CHUNKS_CAVEAT

    assert IN_LOSS_CAVEAT in est.caveats and LOSS_CHUNKS_CAVEAT not in est.caveats


def test_torchtitan_exchanges_cp_by_all_gather() -> None:
    """torchtitan hands PyTorch's context_parallel its rotate method, 'allgather' by default
    (job_config.py ``context_parallel_rotate_method``); Megatron-LM's (Transformer Engine's
    p2p ring) and the reference model's is the ring. An explicit choice wins."""
    from memplan.workload import CpExchange

    def exchange(**kw: object) -> CpExchange:
        return memplan.estimate("llama-3.1-8b", gpus=8, cp=2, seq_len=8192, **kw).workload \
            .cp_exchange

    assert exchange(framework="torchtitan") is CpExchange.ALLGATHER
    assert exchange(framework="megatron") is CpExchange.RING
    assert exchange() is CpExchange.RING
    assert exchange(framework="torchtitan", cp_exchange="ring") is CpExchange.RING


def test_megatron_selects_the_kernel_step_model() -> None:
    """How a step is timed is a mechanism a preset selects (``Mechanism.STEP_TIME``), not a
    framework name read by the step-time model: Megatron-LM's preset times it kernel by kernel
    (its fused pointwise kernels, megatron/core/fusions) with blocking pipeline sends (its
    non-interleaved 1F1B), every other preset at the flat end-to-end MFU with the stated
    overlap; an explicit choice wins either way."""
    from memplan.workload import PipelineP2p, StepModel

    def model(**kw: object) -> StepModel:
        return memplan.api.resolve("llama-3-8b", gpus=8, **kw)[2].step_model

    def p2p(**kw: object) -> PipelineP2p:
        return memplan.api.resolve("llama-3-8b", gpus=8, **kw)[2].pipeline_p2p

    assert model(framework="megatron") is StepModel.KERNELS
    assert p2p(framework="megatron") is PipelineP2p.BLOCKING
    for fw in ("generic", "hf", "torchtitan", "lightning", "deepspeed"):
        assert model(framework=fw) is StepModel.MFU
        assert p2p(framework=fw) is PipelineP2p.OVERLAPPED
    assert model(framework="megatron", step_model="mfu") is StepModel.MFU
    assert model(framework="torchtitan", step_model="kernels") is StepModel.KERNELS

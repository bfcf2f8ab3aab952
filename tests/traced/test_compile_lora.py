"""LoRA on compiled decoder layers (``--compile`` with ``--lora-rank``), against Inductor's
real partitioner on CPU.

1. torchtune's ``TransformerSelfAttentionLayer`` built by ``lora_llama3`` (its ``LoRALinear``:
   frozen base weight, ``lora_a``, ``lora_b``, dropout or ``nn.Identity``, ``alpha / rank``
   scaling), compiled on its own as ``training.compile_model`` compiles it: the tensors
   ``min_cut_rematerialization_partition`` saves for backward (``memplan.profile.
   compiled_trace``'s recording) against memplan's saved terms of one compiled layer, to the
   byte, in fp32 (torchtune's bf16 adapters are not peft's fp32 ones, which memplan models).
   Eight query and eight key/value heads: torchtune expands grouped K/V to every query head
   before SDPA, which SDPA then saves, eagerly and compiled alike; memplan does not model
   that expansion. Traced (T = 128, h 256, ffn 896, rank 8): no adapter 2,429,952 B; q,v
   1,848,320 B (the frozen MLP's product and its norm's output recomputed, two rank-8
   outputs saved); all seven 2,458,624 B; all seven with dropout 0.05 3,294,208 B (each
   adapter's bool mask and dropout output, no norm output); q,v with dropout 2,044,928 B.
2. peft on a 2-layer transformers Llama (``memplan.profile.finetune.build_peft`` with
   ``compile``: each ``LlamaDecoderLayer`` compiled on its own), two training steps on real
   tensors under the exact tracker's compile-aware form (``CompiledLibraryTracker``): weights,
   gradients, optimizer states and saved activations to the byte, every phase peak within
   1% (all within 0.25%). bf16 base with fp32 adapters: the adapters reading one tensor share
   one fp32 cast of it (AOTAutograd's CSE), which eager peft makes per projection. With
   gradient checkpointing (the compiled layer inside the checkpoint, ``compile_in_checkpoint``)
   on the attention's projections: within 2% (q,v 0.05%, q,k,v,o backward +1.7%). LoRA on
   every linear inside the checkpoint: the compiled forward peaks at Inductor's one fused
   pointwise kernel of the MLP, the ``lora_B`` outputs of gate and up alive together, and its
   backward at the fused SiLU backward (``memplan.model.compiled.lora_mlp_forward``,
   ``lora_mlp_backward``): bf16 forward 10,477,184 B traced, 10,479,104 modelled (+0.02%),
   backward 11,594,376 / 11,599,458 (+0.04%; before: -10% and -17%); fp32 forward
   15,845,504 / 15,847,424 (+0.01%), backward 17,979,528 / 18,016,354 (+0.2%). Part of the
   MLP adapted inside the checkpoint stays refused (the down projection alone: backward +3%,
   Inductor reusing the saved up output in place; gate alone: -5%).

Versions traced: torchtune 0.6.1, peft 0.21.2, transformers 5.3.0, torch 2.13.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from hf_configs import LLAMA3_TOY, hf  # tests/traced/hf_configs.py

from memplan.model.dims import Dims
from memplan.model.layer import layer_kind
from memplan.parallel import ParallelConfig
from memplan.spec import spec_from_hf_dict
from memplan.workload import Recompute, Workload

BATCH, SEQ, RANK = 2, 64, 8
TUNE = dict(vocab_size=1000, num_layers=2, num_heads=8, num_kv_heads=8, embed_dim=256,
            max_seq_len=128, intermediate_dim=896)
TUNE_TARGETS = {"q,v": (["q_proj", "v_proj"], False),
                "q,k,v,o,gate,up,down": (["q_proj", "k_proj", "v_proj", "output_proj"], True)}


def _partitioned(layer, x) -> list:
    """``layer`` compiled with Inductor, one forward and backward of ``x``: the tensors the
    partitioner saved for backward (``memplan.profile.compiled_trace``'s recording; one
    graph)."""
    from memplan.profile.compiled_trace import _record

    rows: list = []
    module, original, recording = _record(rows)
    module.min_cut_rematerialization_partition = recording
    layer.compile(backend="inductor")
    try:
        with torch._functorch.config.patch(enable_autograd_cache=False), \
                torch._inductor.config.patch(fx_graph_cache=False):
            layer(x).sum().backward()
    finally:
        module.min_cut_rematerialization_partition = original
        torch._dynamo.reset()
    assert len(rows) == 1
    return rows[0]


def _torchtune_saved(targets: str | None, dropout: float) -> int:
    """The partitioner's saved bytes for torchtune's first decoder layer (fp32): the tensors
    the forward made and, of its graph inputs, the layer's input."""
    pytest.importorskip("torchtune")
    from torchtune.models.llama3 import llama3, lora_llama3

    torch._dynamo.reset()
    torch.manual_seed(0)
    if targets is None:
        model = llama3(**TUNE)
    else:
        modules, mlp = TUNE_TARGETS[targets]
        model = lora_llama3(modules, apply_lora_to_mlp=mlp, lora_rank=RANK, lora_alpha=2 * RANK,
                            lora_dropout=dropout, **TUNE)
        for name, param in model.named_parameters():
            param.requires_grad_("lora_" in name)
    layer = model.layers[0]
    x = torch.randn(BATCH, SEQ, TUNE["embed_dim"], requires_grad=True)
    saved = _partitioned(layer, x)
    return sum(t.size_bytes for t in saved if not t.graph_input or t.shape == tuple(x.shape))


@pytest.mark.parametrize("targets,dropout,traced", [
    (None, 0.0, 2_429_952), ("q,v", 0.0, 1_848_320), ("q,k,v,o,gate,up,down", 0.0, 2_458_624),
    ("q,k,v,o,gate,up,down", 0.05, 3_294_208), ("q,v", 0.05, 2_044_928)])
def test_torchtune_lora_layer_saves_what_the_partitioner_saves(targets, dropout,
                                                                traced) -> None:
    lora = dict(lora_rank=RANK, lora_targets=targets, lora_dropout=dropout) if targets else {}
    spec = spec_from_hf_dict(hf("Meta-Llama-3-8B", **dict(LLAMA3_TOY, num_key_value_heads=8)),
                             "llama3-toy-mha", "llama3-toy-mha")
    wl = Workload(micro_batch_size=BATCH, seq_len=SEQ, precision="fp32", compile=True, **lora)
    dm = Dims.of(spec, ParallelConfig(), wl)
    modelled = layer_kind(spec, wl, dm, False, Recompute.NONE).saved_bytes
    assert modelled == traced
    assert _torchtune_saved(targets, dropout) == traced


LLAMA = hf("Meta-Llama-3-8B", **LLAMA3_TOY)
PEFT = [("bf16-pure", dict(lora_rank=8)),
        ("bf16-pure", dict(lora_rank=8, lora_targets="all-linear")),
        ("bf16-pure", dict(lora_rank=8, lora_targets="all-linear", lora_dropout=0.1)),
        ("fp32", dict(lora_rank=8, lora_targets="q,v,o")),
        # gradient checkpointing around each compiled layer (--compile-in-checkpoint): the
        # forward's moments the uncheckpointed compiled layer's; traced q,v: every phase
        # within 0.05%, q,k,v,o: backward +1.7% (memplan over)
        ("bf16-pure", dict(lora_rank=8, gc=True)),
        ("bf16-pure", dict(lora_rank=8, lora_targets="q,k,v,o", gc=True)),
        # every linear inside the checkpoint: the MLP's fused kernels (module docstring)
        ("bf16-pure", dict(lora_rank=8, lora_targets="all-linear", gc=True)),
        ("fp32", dict(lora_rank=8, lora_targets="all-linear", gc=True))]


@pytest.mark.parametrize("recipe,options", PEFT)
def test_peft_compiled_matches_estimate(recipe: str, options: dict) -> None:
    pytest.importorskip("transformers")
    pytest.importorskip("peft")
    from memplan.profile import finetune  # noqa: F401 (registers the "peft" builder)
    from memplan.profile.frameworks import FrameworkCase
    from recorded import compare_framework  # tests/traced/recorded.py

    case = FrameworkCase("peft", "llama3-toy", LLAMA, recipe, 2, 128,
                         options=dict(options, compile=True))
    result = compare_framework(case)
    # with checkpointing the saved bytes are within 0.07% (one T x 4 B tensor of the
    # embedding's input-grad hook, not the layers'); without, exact
    exact = ("params_bytes", "grads_bytes", "optimizer_bytes",
             *(() if options.get("gc") else ("activations_bytes",)))
    for name in exact:
        row = result.row(name)
        assert row.estimated_bytes == row.measured_bytes, row
    bad = [r for r in result.rows if abs(r.diff_pct) > (2.0 if options.get("gc") else 1.0)]
    assert not bad, bad



def test_torchtune_qlora_layer_saves_what_the_partitioner_saves() -> None:
    """QLoRA compiled (``lora_llama3(quantize_base=True)``: torchao's ``NF4Tensor`` base
    weights, ``linear_nf4``), bf16 with torchtune's bf16 adapters (``adapters_in_model_dtype``),
    h 256, ffn 1024, 2 x 64 tokens, rank 8 on all seven projections: Dynamo traces
    ``linear_nf4``'s autograd Function into the layer's one graph, and the partitioner saves
    each NF4 linear's dequantized bf16 weight for its input gradient
    (``linear.compiled_dequant_terms``): 4 x 256 x 256 x 2 + 3 x 1024 x 256 x 2 = 2,097,152 B
    beside the unquantized layer's 1,330,176 B: 3,427,328 B, memplan's to the byte (traced,
    torchao 0.10.0; fp32 likewise: 6,849,536 B)."""
    import importlib.metadata

    pytest.importorskip("torchtune")
    pytest.importorskip("torchao")
    if importlib.metadata.version("torchao") != "0.10.0":
        pytest.skip("traced with torchao 0.10.0")
    from torchtune.models.llama3 import lora_llama3

    dims = dict(TUNE, num_layers=1, intermediate_dim=1024)
    spec = spec_from_hf_dict(hf("Meta-Llama-3-8B", **dict(LLAMA3_TOY, num_key_value_heads=8,
                                                          intermediate_size=1024)),
                             "llama3-toy-mha", "llama3-toy-mha")
    wl = Workload(micro_batch_size=BATCH, seq_len=SEQ, precision="bf16-pure", compile=True,
                  lora_rank=RANK, lora_targets="all-linear", base_quant="nf4-torchao-0.1",
                  adapters_in_model_dtype=True)
    modelled = layer_kind(spec, wl, Dims.of(spec, ParallelConfig(), wl), False,
                          Recompute.NONE).saved_bytes
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = lora_llama3(["q_proj", "k_proj", "v_proj", "output_proj"], apply_lora_to_mlp=True,
                        lora_rank=RANK, lora_alpha=2 * RANK, quantize_base=True,
                        **dims).to(torch.bfloat16)
    for name, param in model.named_parameters():
        param.requires_grad_("lora_" in name)
    layer = model.layers[0]
    x = torch.randn(BATCH, SEQ, TUNE["embed_dim"], dtype=torch.bfloat16, requires_grad=True)
    saved = _partitioned(layer, x)
    kept = [t for t in saved
            if (not t.graph_input and not t.input_view) or t.shape == tuple(x.shape)]
    weights = [t for t in kept if t.op == "prims.convert_element_type.default"
               and len(t.shape) == 2 and t.dtype == "bfloat16"]
    assert sum(t.size_bytes for t in weights) == 2_097_152
    assert sum(t.size_bytes for t in kept) == modelled == 3_427_328

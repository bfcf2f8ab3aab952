"""Multi-token prediction in megatron-core 0.16.1, traced on CPU: what ``mtp_layers`` counts.

megatron-core's ``GPTModel`` (local layer spec: ``torch.nn.RMSNorm`` under CUDA's fused-kernel
rule, megatron's own ``DotProductAttention``, SwiGLU, RoPE, GQA 2:1, untied head, fp32) is
built at tiny's shape (h 64, 4 query heads of 16, 2 KV groups, ffn 176, V 128) three ways: 2
decoder layers with one MTP depth (``get_gpt_mtp_block_spec``, ``mtp_num_layers=1``), 3
decoder layers without, 2 without. One forward with labels and a float loss mask (as
``pretrain_gpt.py forward_step`` calls it) runs under the exact tracker on a one-rank gloo
group (``memplan.profile.megatron_model``: ``megatron_group``, ``megatron_on_cpu``).

The MTP depth's transformer layer is a layer of the decoder's kind: what it saves is what
the third decoder layer saves. So (2 layers + MTP) - (3 layers), in bytes alive at the
forward's end, is the depth's own terms (``memplan.model.mtp.depth_terms``): the rolled ids,
enorm's, hnorm's and the final norm's inputs and statistics, the concatenation ``eh_proj``
saves, one more chunk of the concatenated hidden states, the depth's loss (fp32 softmax,
target mask and indices), its rolled loss mask and scaled loss; and in parameters, the
depth's norms and ``eh_proj`` (``depth_params``). Megatron's own per-layer extras that
memplan does not count (``tests/traced/test_megatron_model.py`` ``CAUSES``) cancel in the
difference.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("megatron.core")

from memplan.api import make_layout, make_workload  # noqa: E402
from memplan.model.dims import Dims, total  # noqa: E402
from memplan.model.head import head_terms  # noqa: E402
from memplan.model.mtp import depth_params, depth_terms  # noqa: E402
from memplan.profile.cuda_rules import cuda_kernels  # noqa: E402
from memplan.profile.megatron_model import (  # noqa: E402
    megatron_group,
    megatron_on_cpu,
    megatron_spec,
)
from memplan.profile.tracker import MemoryTracker  # noqa: E402

B, S, V = 2, 64, 128
SHAPE = dict(hidden_size=64, num_attention_heads=4, num_query_groups=2, kv_channels=16,
             ffn_hidden_size=176)


def _config(layers: int, mtp: int | None):
    import torch.nn.functional as F
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(
        num_layers=layers, **SHAPE, mtp_num_layers=mtp, gated_linear_unit=True,
        activation_func=F.silu, normalization="RMSNorm", add_bias_linear=False,
        hidden_dropout=0.0, attention_dropout=0.0, params_dtype=torch.float32,
        pipeline_dtype=torch.float32, use_cpu_initialization=True, bias_dropout_fusion=False,
        apply_rope_fusion=False, masked_softmax_fusion=False,
        gradient_accumulation_fusion=False, persist_layer_norm=False)


def _run(layers: int, mtp: int | None) -> tuple[int, int]:
    """(bytes alive at the forward's end, parameters) of one micro-batch."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_layer_local_spec,
        get_gpt_mtp_block_spec,
    )

    config = _config(layers, mtp)
    layer_spec = get_gpt_layer_local_spec(normalization="RMSNorm")
    mtp_spec = (get_gpt_mtp_block_spec(config, layer_spec, use_transformer_engine=False)
                if mtp else None)
    torch.manual_seed(0)
    model = GPTModel(config=config, transformer_layer_spec=layer_spec, vocab_size=V,
                     max_sequence_length=S, position_embedding_type="rope",
                     share_embeddings_and_output_weights=False, mtp_block_spec=mtp_spec)
    ids = torch.randint(0, V, (B, S + 1))
    tokens, labels = ids[:, :S].contiguous(), ids[:, 1:].contiguous()
    loss_mask = torch.ones(B, S, dtype=torch.float)
    position_ids = torch.arange(S).unsqueeze(0).expand(B, S).contiguous()
    tracker = MemoryTracker()
    with tracker, cuda_kernels():
        # the weights, made before the tracker, are no activations where an op views them
        tracker.register(list(model.parameters()), "parameters")
        tracker.set_phase("forward", step=1)
        out = model(tokens, position_ids, None, labels=labels, loss_mask=loss_mask)
        alive = tracker.bytes_in("activations")
        del out
    return alive, sum(p.numel() for p in model.parameters())


@pytest.fixture(scope="module")
def runs():
    with megatron_group(), megatron_on_cpu():
        yield {key: _run(*key) for key in ((2, 1), (3, None), (2, None))}


def test_one_depth_saves_its_terms_beside_a_decoder_layer(runs) -> None:
    """(2 layers + MTP) - (3 layers) at the forward's end equals the depth's terms memplan
    counts at fp32 (e 4) on one rank, 128 tokens: ids 1,024; three norms' inputs and rstd
    3 x (32,768 + 512); the concatenation 65,536; the chunk 32,768; the fp32 softmax 65,536,
    target mask and indices 1,152; loss mask and scaled loss 1,024 (together 266,880), up to
    the division's 4-byte token count the scaled loss keeps."""
    spec = megatron_spec(_config(2, 1), V, S, "mtp")
    wl = make_workload(spec, framework="megatron", micro_batch_size=B, seq_len=S,
                       precision="fp32", attention="eager", loss_impl="megatron",
                       norm_impl="fused", mtp_layers=1)
    dm = Dims.of(spec, make_layout(1), wl)
    loss = [t for t in head_terms(spec, wl.model_copy(update={"mtp_layers": 0}), dm)
            if t.name in ("loss.softmax", "loss.target_mask")]
    expected = total(depth_terms(spec, wl, dm, loss))
    assert expected == 266_880
    measured = runs[(2, 1)][0] - runs[(3, None)][0]
    # the scaled loss's division keeps the 4-byte token count, the loss tracker its 4-byte
    # slot (MTPLossLoggingHelper.save_loss_to_tracker)
    assert 0 <= measured - expected <= 8
    # and one MTP depth adds more than one decoder layer: the depth's terms
    assert runs[(2, 1)][0] - runs[(2, None)][0] > measured


def test_one_depth_parameters(runs) -> None:
    """(2 layers + MTP) - (3 layers) in parameters: enorm, hnorm and the final norm (64 each)
    and eh_proj 128 x 64: 8,384 (pp 1: the embedding is the first stage's)."""
    assert runs[(2, 1)][1] - runs[(3, None)][1] == depth_params(
        megatron_spec(_config(2, 1), V, S, "mtp"), 1) == 8_384

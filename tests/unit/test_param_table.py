"""A model's parameter tensors by layer (memplan.hf.param_table), the table the fallback
(memplan.hf.fallback) builds from transformers' meta-device build: without transformers,
from a small synthetic list of named tensors. Every expected number is derived by hand here.

The synthetic model: h = 4, V = 10, tied embeddings, two layers that differ (a hybrid):

    model.embed_tokens.weight                  (10, 4)   token embedding          40
    layer 0 (attention)
      self_attn.q_proj.weight                  (8, 4)    column                   32
      self_attn.q_proj.bias                    (8,)      column (its weight's)     8
      self_attn.o_proj.weight                  (4, 8)    row                      32
      self_attn.o_proj.bias                    (4,)      whole (a row bias)        4
      input_layernorm.weight                   (4,)      whole                     4
      -> split 72, whole 8, expert 0                                              80
    layer 1 (state-space mixer and experts)
      mamba.in_proj.weight                     (12, 4)   column                   48
      mamba.conv1d.weight                      (6, 1, 3) column                   18
      mamba.conv1d.bias                        (6,)      column                    6
      mamba.A_log                              (2,)      whole                     2
      mamba.out_proj.weight                    (4, 6)    row                      24
      block_sparse_moe.router.weight           (3, 4)    whole (a router)         12
      block_sparse_moe.experts.gate_up_proj    (3, 8, 4) expert                   96
      input_layernorm.weight                   (4,)      whole                     4
      -> split 96, whole 18, expert 96                                           210
    model.norm.weight                          (4,)      final                     4
    total 40 + 80 + 210 + 4                                                      334
"""

from __future__ import annotations

from memplan.hf.param_table import ParamTable, build_table, classify, table_from_build
from memplan.model.model_states import count_stage_params
from memplan.model.stage_parts import build_kinds
from memplan.spec import ModelSpec, param_counts
from memplan.workload import Workload

TENSORS = [
    ("model.embed_tokens.weight", (10, 4)),
    ("model.layers.0.self_attn.q_proj.weight", (8, 4)),
    ("model.layers.0.self_attn.q_proj.bias", (8,)),
    ("model.layers.0.self_attn.o_proj.weight", (4, 8)),
    ("model.layers.0.self_attn.o_proj.bias", (4,)),
    ("model.layers.0.input_layernorm.weight", (4,)),
    ("model.layers.1.mamba.in_proj.weight", (12, 4)),
    ("model.layers.1.mamba.conv1d.weight", (6, 1, 3)),
    ("model.layers.1.mamba.conv1d.bias", (6,)),
    ("model.layers.1.mamba.A_log", (2,)),
    ("model.layers.1.mamba.out_proj.weight", (4, 6)),
    ("model.layers.1.block_sparse_moe.router.weight", (3, 4)),
    ("model.layers.1.block_sparse_moe.experts.gate_up_proj", (3, 8, 4)),
    ("model.layers.1.input_layernorm.weight", (4,)),
    ("model.norm.weight", (4,)),
]


def _table() -> ParamTable:
    table = build_table(TENSORS, 2, 10, 4, tied=True)
    assert isinstance(table, ParamTable)
    return table


def _spec(**update) -> ModelSpec:
    """Its approximate blocks: two heads of 2, an FFN of 8 (their own count is not used)."""
    return ModelSpec(name="hybrid-toy", source="test: a synthetic table", num_layers=2,
                     hidden_size=4, ffn_hidden_size=8, num_attention_heads=2, num_kv_heads=2,
                     head_dim=2, vocab_size=10, max_seq_len=64, norm="rmsnorm", mlp="swiglu",
                     position="rope", tied_embeddings=True, param_table=_table(), **update)


def test_split_rules() -> None:
    weights = dict(TENSORS)
    expect = ["column", "column", "row", "whole", "whole", "column", "column", "column",
              "whole", "row", "whole", "expert", "whole"]
    assert [classify(n, s, weights) for n, s in TENSORS[1:-1]] == expect


def test_layers_split_by_how_tp_treats_them() -> None:
    table = _table()
    assert table.layer_split(0) == (72, 8, 0)
    assert table.layer_split(1) == (96, 18, 96)
    assert table.final_elements() == 4 and len(table.rows) == 2


def test_spec_counts_the_table() -> None:
    """334 in all: 40 + 80 + 210 + 4, the head tied."""
    counts = param_counts(_spec())
    assert counts.total == _spec().num_params == 334
    assert [lp.total for lp in counts.layers] == [80, 210] and counts.final_norm == 4


def test_stage_params_per_tp_rank_and_stage() -> None:
    """tp = 2 (the vocabulary split 2 ways, ceil(10/2) * 4 = 20 rows' elements), pp = 2.
    Stage 0: layer 0 ceil(72/2) + 8 = 44, the embedding 20: 64 dense.
    Stage 1: layer 1 ceil(96/2) + 18 = 66 dense and 96 / (ep 1 * tp 2) = 48 expert; the final
    norm 4 and, tied under pipeline parallelism, its own copy of the embedding 20: 90 dense."""
    first = count_stage_params(_spec(), 2, 1, 2, (0,), True, False, 2)
    last = count_stage_params(_spec(), 2, 1, 2, (1,), False, True, 2)
    assert (first.dense, first.expert, first.layers, first.embedding) == (64, 0, (44,), 20)
    assert (last.dense, last.expert, last.layers, last.head) == (90, 48, (114,), 24)
    # every tensor on the rank: its split dimension halved (ceil), the experts' second
    assert first.tensor_shapes == ((5, 4), (4, 4), (4,), (4, 4), (4,), (4,))
    assert last.tensor_shapes == ((6, 4), (3, 1, 3), (3,), (2,), (4, 3), (3, 4), (3, 4, 4),
                                  (4,), (4,), (5, 4))


def test_estimate_holds_the_tables_bytes() -> None:
    """fp32 on 4 GPUs, tp = 2, pp = 2: 4 B a weight and 4 B a gradient, the stages' counts of
    ``test_stage_params_per_tp_rank_and_stage``: stage 0 64 * 4 = 256, stage 1
    (90 + 48) * 4 = 552 bytes each of weights and of gradients."""
    from memplan.api import estimate

    est = estimate(_spec(), gpus=4, tp=2, pp=2, micro_batch_size=1, seq_len=8, precision="fp32")
    assert [(s.params_bytes, s.grads_bytes) for s in est.stages] == [(256, 256), (552, 552)]
    assert [s.num_params for s in est.stages] == [64, 138]


def test_runs_split_where_the_layers_tensors_differ() -> None:
    """Both layers are one kind of the approximate blocks; their tensors differ, so the walk
    takes each as its own run, whose gradients are its own layer's."""
    kinds = build_kinds(_spec(), Workload(), 1, 1, 0)
    assert len(kinds.counts) == 1 and len(kinds.runs) == 2 and kinds.run_starts == (0, 1)


def test_experts_built_one_module_each_are_stacked() -> None:
    """experts.0.w and experts.1.w of (8, 4) each: one (2, 8, 4) expert tensor."""
    named = [("model.embed_tokens.weight", (10, 4)),
             ("model.layers.0.mlp.experts.0.w.weight", (8, 4)),
             ("model.layers.0.mlp.experts.1.w.weight", (8, 4)),
             ("model.layers.0.mlp.gate.weight", (2, 4)),
             ("model.norm.weight", (4,)), ("lm_head.weight", (10, 4))]
    table = table_from_build(named, 1, 10, 4, tied=False)
    assert isinstance(table, ParamTable)
    assert table.rows[0] == (("expert", (2, 8, 4)), ("whole", (2, 4)))


def test_tensors_that_do_not_fit_the_config_are_a_reason() -> None:
    assert "token embedding" in build_table(TENSORS[1:], 2, 10, 4, tied=True)
    untied = [*TENSORS, ("lm_head.weight", (12, 4))]
    assert "output projection" in build_table(untied, 2, 10, 4, tied=False)
    assert "beyond" in build_table(TENSORS, 1, 10, 4, tied=True)


def test_modules_no_approximate_block_stands_for() -> None:
    """Falcon-H1's layers hold a mamba mixer beside self_attn and feed_forward: named, so the
    approximate line says its activations are not estimated; norms and Llama's parts are not."""
    from memplan.hf.fallback import _other_mixers

    names = [("model.layers.0.mamba.in_proj.weight", (12, 4)),
             ("model.layers.0.self_attn.q_proj.weight", (8, 4)),
             ("model.layers.0.feed_forward.w1.weight", (8, 4)),
             ("model.layers.0.pre_ff_layernorm.weight", (4,)),
             ("model.final_layernorm.weight", (4,))]
    assert _other_mixers(tuple(names)) == {"mamba"}

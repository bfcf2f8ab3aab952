"""Expert tensor parallelism (``etp``, Megatron-LM's --expert-tensor-parallel-size): the
routed experts' weights split by etp while the rest of the model is split by tp; the experts'
groups carved from tp x dp x cp ranks (megatron/core/parallel_state.py
initialize_model_parallel). Values derived by hand for Mixtral-8x7B (h 4096, expert FFN
14336, 8 experts top-2, 32 layers, GQA 8 of 32 heads, vocabulary 32000, untied)."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

import memplan
from memplan.cli import app
from memplan.config_import import megatron
from memplan.errors import LayoutError, MemplanError
from memplan.parallel import ParallelConfig, expert_rule

# one layer's routed experts: 8 experts x 3 projections x 4096 x 14336
EXPERTS_PER_LAYER = 8 * 3 * 4096 * 14336  # 1,409,286,144
# one layer's dense parameters at tp 4: q and o 4096^2 each, k and v 4096 x 1024 each, split
# by 4 (10,485,760); two RMSNorms 2 x 4096 and the router 4096 x 8, replicated (40,960)
DENSE_PER_LAYER_TP4 = (2 * 4096 * 4096 + 2 * 4096 * 1024) // 4 + 2 * 4096 + 4096 * 8
# the embedding and the head, 32000 x 4096 each, split by tp 4, and the final norm
EMBED_HEAD_TP4 = 2 * 32000 * 4096 // 4 + 4096


def _mixtral(**layout: object) -> memplan.Estimate:
    return memplan.estimate("mixtral-8x7b", gpus=16, tp=4, pp=1, zero=1, seq_len=4096,
                            framework="megatron", **layout)


def test_expert_weights_split_by_etp() -> None:
    """tp 4, ep 8, etp 1 on 16 GPUs (dp 4): each rank holds one expert whole:
    1,409,286,144 / (8 * 1) = 176,160,768 per layer, x 32 = 5,637,144,576; dense
    (10,485,760 + 40,960) x 32 = 336,855,040; embedding, head and norm 65,540,096; total
    6,039,539,712. (ep 8 needs etp: with the experts split by tp 4, ep must divide dp 4.)"""
    est = _mixtral(ep=8, etp=1)
    assert est.stages[0].num_params == (EXPERTS_PER_LAYER // 8 * 32
                                        + DENSE_PER_LAYER_TP4 * 32 + EMBED_HEAD_TP4)
    assert est.stages[0].num_params == 6_039_539_712


def test_etp_equal_to_tp_is_the_default() -> None:
    """etp 4 at tp 4 is what None means: the same bytes everywhere; ep 4: experts
    1,409,286,144 / 16 x 32 = 2,818,572,288, total 3,220,967,424."""
    given, default = _mixtral(ep=4, etp=4), _mixtral(ep=4)
    assert given.stages[0].num_params == default.stages[0].num_params == 3_220_967_424
    assert given.peak_bytes == default.peak_bytes


def test_expert_inner_activations_split_by_etp() -> None:
    """The experts' saved gate output: the routed rows (4096 tokens x top-2 = 8192) x the
    expert FFN width over etp, bf16: 8192 x 14336 x 2 = 234,881,024 at etp 1; / 4 at tp 4."""
    def gate_term(est: memplan.Estimate) -> int:
        return next(t.size_bytes for _, terms in est.stages[0].activation_groups
                    for t in terms if t.name == "moe.expert.gate")
    assert gate_term(_mixtral(ep=8, etp=1)) == 8192 * 14336 * 2 == 234_881_024
    assert gate_term(_mixtral(ep=4)) == 8192 * 14336 * 2 // 4


def test_expert_shard_degree() -> None:
    """The expert-data-parallel group: tp * dp * cp / (ep * etp) = 4 * 4 / (8 * 1) = 2; without
    etp dp * cp / ep = 4 / 4 = 1."""
    assert ParallelConfig(tp=4, dp=4, ep=8, etp=1).expert_shard_degree == 2
    assert ParallelConfig(tp=4, dp=4, ep=4).expert_shard_degree == 1


@pytest.mark.parametrize(("model", "layout", "rule"), [
    ("llama-2-7b", {"etp": 1}, "etp needs a mixture-of-experts model"),
    ("mixtral-8x7b", {"ep": 8, "etp": 3}, "etp must divide expert_ffn_hidden_size"),
    ("mixtral-8x7b", {"ep": 8, "etp": 4}, "ep*etp must divide tp*dp*cp"),
])
def test_etp_rules(model: str, layout: dict, rule: str) -> None:
    """14336 is not a multiple of 3; ep 8 x etp 4 = 32 ranks do not divide tp 4 x dp 4."""
    with pytest.raises(LayoutError) as err:
        memplan.estimate(model, gpus=16, tp=4, seq_len=4096, **layout)
    assert err.value.rule == rule


def test_expert_states_shard_within_a_replica() -> None:
    """Megatron-LM's --num-distributed-optimizer-instances 2 (memplan's dp_shard dp / 2) with
    ep 2 at tp 4 on 16 GPUs (dp 4): dense states shard over dp / 2 = 2 ranks, expert states
    over the expert-data-parallel group dp / ep = 2 over the 2 instances = 1 (parallel_state.py
    intra_partial_expert_data_parallel_size). Per rank the experts are 1,409,286,144 / (2 * 4)
    x 32 = 5,637,144,576 parameters, the dense 402,395,136; at 12 B of fp32 master and Adam
    states each, one instance holds 12 x (402,395,136 / 4 + 5,637,144,576 / 2) =
    35,030,052,864 B less than two."""
    one, two = _mixtral(ep=2), _mixtral(ep=2, dp_shard=2)
    assert ParallelConfig(tp=4, dp=4, ep=2, zero=1, dp_shard=2).expert_shard_degree == 1
    assert ParallelConfig(tp=4, dp=4, ep=2, zero=1).expert_shard_degree == 2
    dense, experts = DENSE_PER_LAYER_TP4 * 32 + EMBED_HEAD_TP4, EXPERTS_PER_LAYER // 8 * 32
    assert (dense, experts) == (402_395_136, 5_637_144_576)
    assert (two.stages[0].optimizer_bytes - one.stages[0].optimizer_bytes
            == 12 * (dense // 4 + experts // 2) == 35_030_052_864)


def test_replicas_must_divide_the_expert_data_parallel_group() -> None:
    """ep 4 at dp 4 leaves an expert-data-parallel group of 1 rank: 2 replicas (dp_shard 2)
    cannot split it (Megatron-LM asserts the same); with etp 2 the group is tp * dp / (ep *
    etp) = 2 ranks and the message names that form."""
    with pytest.raises(LayoutError) as err:
        memplan.estimate("mixtral-8x7b", gpus=16, tp=4, seq_len=4096, zero=1, dp_shard=2,
                         ep=4)
    assert err.value.rule == "the replicas must divide the expert-data-parallel group"
    assert "(1 ranks: dp*cp/ep)" in str(err.value)
    est = memplan.estimate("mixtral-8x7b", gpus=16, tp=4, seq_len=4096, zero=3, dp_shard=2,
                           etp=2)
    assert est.peak_bytes > 0


def test_expert_rule_on_degrees() -> None:
    assert expert_rule(8, 14336, 8, 1, 16) is None
    assert expert_rule(8, 14336, 8, 2, 16) is None
    assert expert_rule(8, 14336, 8, 4, 16) is not None


def test_plan_searches_etp() -> None:
    """At tp 4, pp 1 on 16 GPUs (dp 4), ep 8 is possible only with the experts split by less
    than tp: the largest etp that allows it is 2 (8 x 2 = 16 ranks); ep 1, 2, 4 keep the
    experts split by tp. A given etp is kept."""
    result = memplan.plan("mixtral-8x7b", gpus=16, tp=4, pp=1, cp=1, zero=1, seq_len=4096,
                          global_batch_size=64, framework="megatron", top=None)
    pairs = {(c.layout.ep, c.layout.etp) for c in result.candidates}
    assert (8, 2) in pairs and (8, None) not in pairs and (8, 1) not in pairs
    assert {etp for ep, etp in pairs if ep < 8} == {None}
    fixed = memplan.plan("mixtral-8x7b", gpus=16, tp=4, pp=1, cp=1, zero=1, etp=1,
                         seq_len=4096, global_batch_size=64, framework="megatron")
    assert fixed.candidates and {c.layout.etp for c in fixed.candidates} == {1}


def test_cli_etp() -> None:
    result = CliRunner().invoke(app, ["estimate", "--model", "mixtral-8x7b", "-n", "16",
                                      "--tp", "4", "--ep", "8", "--etp", "1", "--seq", "4096",
                                      "--zero", "1", "--framework", "megatron", "--json"])
    assert result.exit_code == 0, result.output
    out = json.loads(result.output)
    assert out["layout"]["etp"] == 1 and out["num_params"] == 46_702_792_704


def test_megatron_expert_tensor_parallel_size() -> None:
    """--expert-tensor-parallel-size 1 with --tensor-model-parallel-size 2 maps to etp 1;
    equal to tp it is the default and sets nothing."""
    base = ("--num-layers 4 --hidden-size 256 --num-attention-heads 4 --seq-length 512 "
            "--max-position-embeddings 512 --vocab-size 1000 --tokenizer-type NullTokenizer "
            "--num-experts 8 --tensor-model-parallel-size 2 --expert-model-parallel-size 8 ")
    assert megatron.read(base + "--expert-tensor-parallel-size 1", 16).inputs["etp"] == 1
    assert "etp" not in megatron.read(base + "--expert-tensor-parallel-size 2", 16).inputs
    with pytest.raises(MemplanError, match="--expert-tensor-parallel-size"):
        megatron.read(base + "--expert-tensor-parallel-size 0", 16)

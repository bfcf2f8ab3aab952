"""Save lists per layer kind and per pipeline stage (``--recompute-save`` names scoped
``SCOPE:name``; ``memplan.model.sac_ops``), ``--recompute auto`` per stage and the torch
policy per layer index: bytes derived by hand for the tiny spec.

tiny: 2 layers, h 64, q 64, SwiGLU f 176, bf16. At seq 128 and micro-batch 2 a layer's
tokens are T = 256: q's output T*q*e = 256*64*2 = 32,768 B, the gate's T*f*e = 90,112 B.
With pp 2 each stage holds one layer; under 1F1B with 4 micro-batches stage 0 holds 2
micro-batches in flight, stage 1 one.
"""

from __future__ import annotations

import pytest
from memplan.api import estimate
from memplan.cli import main
from memplan.errors import MemplanError
from memplan.model import sac_ops
from memplan.spec import load_model

PP2 = dict(gpus=2, pp=2, seq_len=128, micro_batch_size=2, global_batch_size=8)


def _activations(save: str) -> list[int]:
    est = estimate("tiny", **PP2, recompute="ops", recompute_save=save)
    return [s.activations_bytes for s in est.stages]


def test_for_stage_and_stage_lists() -> None:
    save = ("attn.q", "dense:mlp.up", "stage0:mlp.gate", "stage1:dense:norms")
    assert sac_ops.for_stage(save, 0) == ("attn.q", "dense:mlp.up", "mlp.gate")
    assert sac_ops.for_stage(save, 1) == ("attn.q", "dense:mlp.up", "dense:norms")
    assert sac_ops.for_stage(save, 2) == ("attn.q", "dense:mlp.up")
    assert sac_ops.scoped_stages(save) == [0, 1]
    assert not sac_ops.stage_scoped(("attn.q", "dense:mlp.up"))
    # the names every stage keeps unscoped, the rest scoped
    assert sac_ops.stage_lists([("attn.q",), ("attn.q", "mlp.gate")]) == \
        ("attn.q", "stage1:mlp.gate")
    assert sac_ops.stage_lists([("a",), ("a",)]) == ("a",)


def test_a_stage_keeps_only_its_list() -> None:
    """attn.q kept on stage 1 alone adds 32,768 B there (one layer, one micro-batch in
    flight) and nothing on stage 0; on stage 0 alone 2 x 32,768 = 65,536 B there (two in
    flight); unscoped, both."""
    base = _activations("")
    assert [a - b for a, b in zip(_activations("stage1:attn.q"), base)] == [0, 32_768]
    assert [a - b for a, b in zip(_activations("stage0:attn.q"), base)] == [65_536, 0]
    assert [a - b for a, b in zip(_activations("attn.q"), base)] == [65_536, 32_768]
    # the gate on stage 1 beside q everywhere: 90,112 more on stage 1
    assert [a - b for a, b in zip(_activations("attn.q,stage1:mlp.gate"), base)] == \
        [65_536, 32_768 + 90_112]


def test_kind_scope_applies_to_its_layers() -> None:
    """tiny's layers are dense: ``dense:attn.q`` is ``attn.q``."""
    assert _activations("dense:attn.q") == _activations("attn.q")


@pytest.mark.parametrize(("save", "why"), [
    ("moe:attn.q", "unknown scope 'moe' in 'moe:attn.q'; a scope is a layer kind of tiny "
                   "(dense)"),
    ("stage2:attn.q", "'stage2:attn.q' names stage 2; with pp 2 the stages are "
                      "stage0..stage1"),
    ("stage0:attn.z", "unknown name 'attn.z'"),
])
def test_bad_scopes_are_refused_by_name(save: str, why: str) -> None:
    with pytest.raises(MemplanError, match=why.replace("(", r"\(").replace(")", r"\)")
                       .replace(".", r"\.")):
        estimate("tiny", **PP2, recompute="ops", recompute_save=save)


def test_cli_bad_scope_one_line_exit_2(capsys) -> None:
    code = main(["estimate", "-m", "tiny", "-n", "2", "--pp", "2", "--seq", "128",
                 "--recompute", "ops", "--recompute-save", "stage3:attn.q"])
    assert code == 2
    err = capsys.readouterr().err.strip()
    assert "names stage 3" in err and len(err.splitlines()) == 1


def test_auto_chooses_per_stage() -> None:
    """llama-2-7b on 8 GPUs (tp 2, pp 4, ZeRO 1, 24 GiB): stage 0 holds four micro-batches in
    flight, stage 3 one; each stage keeps its own set, every stage fits, and a stage with
    fewer in flight keeps at least as many bytes (the last stage's head aside: it is
    compared with stage 1)."""
    kw = dict(gpus=8, pp=4, tp=2, zero=1, seq_len=4096, global_batch_size=64,
              gpu_memory="24GiB")
    est = estimate("llama-2-7b", **kw, recompute="auto")
    assert est.fits and sac_ops.stage_scoped(est.workload.recompute_save)
    lists = sac_ops.per_stage(est.workload.recompute_save, 4)
    assert lists is not None
    spec = load_model("llama-2-7b")
    from memplan.model.dims import Dims
    from memplan.model.layer import ops_items

    items = ops_items(spec, est.workload, Dims.of(spec, est.parallel, est.workload))
    kept = [sum(i.size_bytes for i in sac_ops.resolve(items, lists[s], spec)) for s in range(4)]
    assert kept[0] <= kept[1] <= kept[2]
    # one list for every stage, stage 0's: it fits there, and stage 1 keeps more than it
    uniform = estimate("llama-2-7b", **kw, recompute="ops",
                       recompute_save=",".join(lists[0]))
    assert uniform.fits and kept[1] > kept[0]


def test_torch_policy_per_layer_index() -> None:
    """q kept everywhere, the gate on stage 1 (tiny's layer 1): SAVE is q (the 0th 64-wide
    matmul); layer 1's own set adds the gate (the 0th 176-wide matmul)."""
    from memplan.report.sac_policy import emit_for

    est = estimate("tiny", **PP2, recompute="ops", recompute_save="attn.q,stage1:mlp.gate")
    text = emit_for("torch", est)
    compile(text, "policy.py", "exec")
    assert "SAVE = {('matmul', 64, 0)}" in text
    assert "LAYER_SAVE = {1: {('matmul', 64, 0), ('matmul', 176, 0)}}" in text
    for target in ("torchtitan", "megatron"):
        assert "Not expressible: a save list per layer" in emit_for(target, est)


def test_plan_auto_per_stage_fits() -> None:
    """plan --recompute ops (auto's save-set search) with pipeline layouts: each op-level
    candidate's estimate (its list per stage) fits and peaks where the plan says."""
    from memplan.api import plan

    # the search's per-stage save sets (reserved=False: op-level sets are chosen against the
    # analytic peak, not re-chosen for the allocator's reserved peak)
    result = plan("llama-2-7b", gpus=8, pp=2, seq_len=4096, recompute=["ops"], top=3,
                  gpu_memory="40GiB", reserved=False)
    assert result.candidates
    for c in result.candidates:
        assert c.recompute == "ops" and c.peak_bytes <= result.budget_bytes
        assert c.estimate.peak_bytes == c.peak_bytes


def test_reserved_replay_per_stage() -> None:
    """The caching-allocator replay walks each stage with its own list: stage 0 of
    ``attn.q,stage1:mlp.gate`` replays as ``attn.q`` everywhere, stage 1 as
    ``attn.q,mlp.gate`` everywhere."""
    from memplan.model.reserved import estimate_reserved

    kw = dict(gpus=8, pp=2, tp=4, seq_len=1024, global_batch_size=8, recompute="ops")

    def reserved(save: str) -> list[int]:
        est = estimate("llama-2-7b", **kw, recompute_save=save)
        return [r.reserved_peak_bytes for r in estimate_reserved(est)]

    staged = reserved("attn.q,stage1:mlp.gate")
    assert staged[0] == reserved("attn.q")[0]
    assert staged[1] == reserved("attn.q,mlp.gate")[1]
    assert reserved("attn.q")[1] < staged[1]

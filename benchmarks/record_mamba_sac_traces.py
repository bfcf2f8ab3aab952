"""Record op-level checkpointing of Mamba2 layers on transformers 5.23's einsum scan
(``mamba_kernel`` torch-einsum) with the installed transformers, for
tests/unit/test_sac_mamba_einsum.py, which checks memplan against them where 5.23 is not
installed (CI runs 5.3).

Two kinds of records, both on toys of tests/traced/test_sac_policy.py (Granite 4.0-H's Mamba2,
attention, Mamba2 layers, with and without experts; Falcon-H1's parallel layers, its gated
norm too):

- ``keys``: the (family, output width) of every op the emitted torch policy's ``_key``
  recognises (``memplan.report.sac_policy``), in execution order, over one decoder layer's
  forward on real CPU tensors (a Mamba2 layer: Granite's first, Falcon-H1's first), for
  shapes whose widths collide (d = h, f = C, the sequence equal to the MLP's width, two
  groups) in fp32, bf16 and amp-bf16;
- ``cases``: ``memplan.profile.frameworks.compare_framework`` of the toy stepped twice under
  the exact tracker with the policy memplan emits for a save list (and with full recompute,
  each list's reference), the measured rows with the spec, layout and workload memplan was
  given.

Run with transformers 5.23 installed::

    python benchmarks/record_mamba_sac_traces.py tests/data/traces/mamba_einsum/sac-5.23.json
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests" / "traced"))
sys.path.insert(0, str(ROOT))

GRANITE = "heldout/granite-4.0-h-tiny"
FALCON = "heldout/Falcon-H1-1.5B-Instruct"
TWO_GROUPS = dict(mamba_chunk_size=40, mamba_n_heads=8, mamba_d_head=32, mamba_d_state=20,
                  mamba_n_groups=2)
FALCON_2 = dict(mamba_n_heads=2, mamba_d_ssm=128, mamba_d_state=16, mamba_n_groups=2,
                mamba_chunk_size=32, intermediate_size=384)
FALCON_RMS = dict(mamba_n_groups=2, mamba_rms_norm=True)
# (model, toy overrides, precision, batch, sequence)
KEYS = [(m, o, p, 2, s) for m, o, s in [
    ("granite", {}, 64), ("granite", TWO_GROUPS, 100), ("granite", {}, 256),
    ("granite", {"hidden_size": 256, "mamba_expand": 1}, 96),
    ("granite", {"shared_intermediate_size": 320}, 320),
    ("falcon", {}, 64), ("falcon", FALCON_2, 200),
    ("falcon", {**FALCON_RMS, "mamba_norm_before_gate": False}, 256),
    ("falcon", {**FALCON_RMS, "mamba_norm_before_gate": True}, 256)]
    for p in ("fp32", "bf16-pure", "amp-bf16")]
# (model, toy overrides, precision, sequence, save list): each with full recompute too
CASES = [
    ("granite", {}, "bf16-pure", 512,
     "mamba:mamba.in_proj,mamba:mamba.conv_out,mamba:norms,attn:attention"),
    ("granite", {}, "bf16-pure", 512,
     "mamba:mlp_norm.input_fp32,mamba:mlp_norm.stats,mamba:mlp_norm.normed,"
     "mamba:mlp_norm.output"),
    ("granite", {}, "bf16-pure", 512, "mamba:mamba.out,mamba:mamba.out_proj"),
    ("granite", {}, "bf16-pure", 512, "mamba:norms,mamba:mlp,mamba:mamba.out"),
    ("granite", {}, "fp32", 512,
     "mamba:mamba.act,mamba:mamba.out,mamba:mamba.out_proj,mamba:mlp,attn:attn.v"),
    ("granite", {"mamba_n_groups": 2}, "bf16-pure", 512,
     "mamba:mamba.in_proj,mamba:mamba.conv_out,mamba:mamba.out,mamba:mlp.gate_up,"
     "attn:attn.out"),
    ("granite", {"shared_intermediate_size": 512}, "bf16-pure", 512,
     "mamba:mamba.act,mamba:mlp.prod,attn:attention"),
    ("granite-moe", {}, "bf16-pure", 256,
     "mamba:moe.topk_weights,mamba:moe.expert.gate_up,mamba:moe.shared.gate_up,"
     "attn:moe.expert.act"),
    ("granite-moe", {}, "fp32", 256,
     "mamba:moe.topk_weights,mamba:mamba.out,attn:moe.router,attn:moe.shared.gate_up"),
    ("falcon", {}, "bf16-pure", 256, "attention,mlp,mamba,norms"),
    ("falcon", {}, "bf16-pure", 256, "attn_norm.output"),
    ("falcon", {}, "fp32", 256, "attention,mlp"),
    ("falcon", FALCON_2, "fp32", 200, "mlp"),
    ("falcon", FALCON_2, "fp32", 200, "attention,mlp"),
    ("falcon", {**FALCON_2, **FALCON_RMS, "mamba_norm_before_gate": True}, "bf16-pure", 200,
     "attention,mlp,mamba,norms"),
    ("falcon", {**FALCON_RMS, "mamba_norm_before_gate": False}, "bf16-pure", 256, "mamba"),
    # under autocast (amp-bf16: fp32 weights), the two lists the grid's midway budget gives
    # (``--recompute auto``, tests/traced/test_sac_policy.py ``_midway_list``) among them
    ("granite", {}, "amp-bf16", 512, "mamba:mlp.gate_up"),
    ("granite", {}, "amp-bf16", 256, "attention,mlp"),
    ("granite", {}, "amp-bf16", 1024, "mamba:mamba.act,mamba:mamba.out_proj,attn:attention"),
    ("granite", {"mamba_n_groups": 2}, "amp-bf16", 512,
     "mamba:mamba.in_proj,mamba:mamba.conv_out,mamba:mlp.gate_up,attn:attn.out"),
    ("granite", {}, "amp-bf16", 512,
     "attn:attn.k,attn:attn.o_proj,attn:attn.out,attn:attn.q,attn:attn.v,attn:mlp.act,"
     "attn:mlp.gate_up,attn:mlp.prod,mamba:mamba.act,mamba:mamba.in_proj,mamba:mamba.out_proj,"
     "mamba:mlp.act,mamba:mlp.gate_up,mamba:mlp.prod"),
    ("falcon", {}, "amp-bf16", 256, "mamba.act"),
    ("falcon", {}, "amp-bf16", 256, "attention,mlp,mamba"),
    ("falcon", FALCON_2, "amp-bf16", 200, "mamba,attention"),
    ("falcon", {}, "amp-bf16", 256,
     "attn.k,attn.o_proj,attn.out,attn.q,attn.v,mamba.act,mamba.in_proj,mamba.mup,"
     "mamba.out_proj,mlp.act,mlp.gate_proj,mlp.prod,mlp.up"),
]


def _config(model: str, overrides: dict) -> dict:
    from hf_configs import hf
    from test_sac_policy import FALCON_TOY, GRANITE_H_MOE_TOY, GRANITE_H_TOY

    name, toy = {"granite": (GRANITE, GRANITE_H_TOY), "granite-moe": (GRANITE, GRANITE_H_MOE_TOY),
                 "falcon": (FALCON, FALCON_TOY)}[model]
    return hf(name, **{**toy, **overrides})


def _policy_key():
    """The emitted torch policy's ``_key`` (the same function whatever the model: taken from
    the module emitted for the catalog's tiny model, ``memplan.profile.sac_policy``)."""
    from memplan.api import make_workload
    from memplan.profile.sac_policy import emitted_module
    from memplan.spec import load_model

    spec = load_model("tiny")
    return emitted_module(spec, make_workload(spec, recompute="ops"))["_key"]


def layer_keys(config: dict, precision: str, b: int, s: int) -> list[tuple[str, int]]:
    """The policy's keys over the first decoder layer's forward (real tensors, seeded)."""
    import torch
    import transformers
    from torch.utils._python_dispatch import TorchDispatchMode

    key = _policy_key()

    class Log(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.keys: list[tuple[str, int]] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            got = key(func, args)
            out = func(*args, **(kwargs or {}))
            if got is not None:
                self.keys.append((got[0], int(got[1])))
            return out

    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(
        transformers.AutoConfig.for_model(**config))
    dtype = torch.bfloat16 if precision == "bf16-pure" else torch.float32
    model = model.to(dtype)
    layer = model.model.layers[0]
    x = torch.randn(b, s, config["hidden_size"], dtype=dtype)
    pos = torch.arange(s)[None].expand(b, s)
    rotary = getattr(model.model, "rotary_emb", None)
    emb = rotary(x, pos) if rotary is not None else None
    amp = torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "amp-bf16")
    log = Log()
    with amp, log:
        layer(x, position_embeddings=emb, position_ids=pos)
    return log.keys


def main(out: str) -> int:
    import torch
    import transformers

    from memplan.profile.frameworks import FrameworkCase, compare_framework

    keys = [{"model": m, "overrides": o, "precision": p, "batch": b, "seq": s,
             "config": _config(m, o), "keys": layer_keys(_config(m, o), p, b, s)}
            for m, o, p, b, s in KEYS]
    cases = []
    for model, overrides, precision, seq, save in CASES:
        for options in ({"recompute": "ops", "recompute_save": save}, {"recompute": "full"}):
            c = compare_framework(FrameworkCase("transformers", f"{model}-einsum",
                                                _config(model, overrides), precision, 2, seq,
                                                options=options))
            assert c.workload.mamba_kernel.value == "torch-einsum", c.workload.mamba_kernel
            cases.append({
                "id": f"{model}-{precision}-{seq}-{options.get('recompute_save', 'full')}",
                "save": options.get("recompute_save"),
                "spec": c.spec.model_dump(mode="json", exclude_defaults=True),
                "layout": c.parallel.model_dump(mode="json", exclude_defaults=True),
                "workload": {**c.workload.model_dump(mode="json", exclude_defaults=True),
                             "mamba_kernel": c.workload.mamba_kernel.value},
                "measured": {r.name: r.measured_bytes for r in c.rows},
            })
    data = {"transformers": transformers.__version__, "torch": torch.__version__,
            "source": "benchmarks/record_mamba_sac_traces.py", "keys": keys, "cases": cases}
    Path(out).write_text(json.dumps(data, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))

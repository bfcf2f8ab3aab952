"""Record transformers' own steps of Granite 4.0-H's Mamba2 layers on the torch path of the
installed transformers (tests/data/traces/mamba_einsum/), for tests/unit/test_mamba_einsum.py,
which replays memplan's estimate against them where that transformers version is not
installed (CI runs 5.3).

Each case is the held-out Granite 4.0-H Tiny config cut to three toy layers (Mamba2,
attention, Mamba2, no experts: tests/traced/test_hf_heldout.py ``granitemoehybrid-h``), with
the Mamba sizes below, stepped twice under the exact tracker (fake tensors), as
``memplan.profile.frameworks.compare_framework`` runs it. Run with the transformers version to
record (5.23 for the einsum scan)::

    python benchmarks/record_mamba_traces.py tests/data/traces/mamba_einsum/transformers-5.23.json
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests" / "traced"))

# (name, batch, sequence, overrides of the toy config): the toy itself (chunks of 48 over 64
# tokens, the second padded; the loss and the gated norm set its peaks), the chunk matrices
# dominant (c H = 512 elements a token against d = 256; 120 tokens padded to 128), the state
# larger than the chunk (n = 64 over chunks of 32: B, C and the passed states dominant), and
# two groups with one whole chunk
SHAPES = [
    ("toy", 2, 64, {}),
    ("chunk-mats", 2, 120, dict(mamba_chunk_size=64, mamba_n_heads=8, mamba_d_head=32,
                                mamba_d_state=24, vocab_size=64)),
    ("wide-state", 2, 100, dict(mamba_chunk_size=32, mamba_n_heads=4, mamba_d_head=64,
                                mamba_d_state=64, vocab_size=64)),
    ("two-groups", 1, 256, dict(mamba_chunk_size=128, mamba_n_heads=16, mamba_d_head=16,
                                mamba_d_state=16, mamba_n_groups=2, vocab_size=64)),
]
RECIPES = [("fp32", {}), ("bf16-pure", {}), ("bf16-pure", {"recompute": "full"}),
           ("amp-bf16", {})]


def main(out: str) -> int:
    import test_hf_heldout as heldout
    import transformers

    from memplan.profile.frameworks import FrameworkCase, compare_framework

    cases = []
    for name, b, s, overrides in SHAPES:
        config = {**heldout.TRACED["granitemoehybrid-h"], **overrides}
        for precision, options in RECIPES:
            c = compare_framework(FrameworkCase("transformers", "granitemoehybrid-h", config,
                                                precision, b, s, options=options))
            cases.append({
                "id": f"{name}-{precision}" + ("-full" if options else ""),
                "config": config, "spec": c.spec.model_dump(mode="json", exclude_defaults=True),
                "layout": c.parallel.model_dump(mode="json", exclude_defaults=True),
                "workload": {**c.workload.model_dump(mode="json", exclude_defaults=True),
                             "mamba_kernel": c.workload.mamba_kernel.value},
                "measured": {r.name: r.measured_bytes for r in c.rows},
            })
    data = {"transformers": transformers.__version__, "torch": __import__("torch").__version__,
            "source": "benchmarks/record_mamba_traces.py", "cases": cases}
    Path(out).write_text(json.dumps(data, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))

"""A compiled decoder layer's phase peaks at several token counts: the trace against memplan.

Not a test (each case compiles a layer with Inductor on CPU, tens of seconds): run by hand from
the repository root, with transformers and torchtitan installed::

    .venv/bin/python benchmarks/compiled_backward.py [--write benchmarks/data/compiled_backward.json]

(``--stored FILE`` takes the traced peaks from a stored file and recomputes memplan's.)

Each case is traced twice: with Inductor's GPU realization rules (``compiled_layer_step(...,
gpu_realize=True)``, ``compiled_trace._gpu_realization``), the ground truth memplan models (a
GPU planner: the buffers a GPU run holds), and with the CPU's own (``cpu_traced_*``, for the
record). On CPU Inductor's lowering gives a reused pointwise value computed with a heavy op
(``exp``, ``sigmoid``, ``tanh``...) a buffer of its own where a GPU's inlines it into each
reader (torch/_inductor/ir.py ``StorageBox.should_realize_on_reuse``, torch 2.13), and reads
and op counts have CPU thresholds (``has_exceeded_max_reads``, ``Loops.has_large_inner_fn``).

``tests/traced/test_compile_trace.py`` pins the toy layer (h 256) at 2 x 64 tokens, where the
MLP's weight gradients (3 h f elements) outweigh its activations (T f each); a training micro-
batch holds thousands of tokens per layer, and Inductor's schedule of the backward
(``torch/_inductor/memory.py reorder_for_peak_memory`` picks among orders by their estimated
peak, from the buffers' sizes) may differ there. Each case is traced with
``memplan.profile.compiled_trace.compiled_layer_step`` (one kernel per scheduler node, as a
GPU backend launches them) and set beside memplan's layer: its forward peak and the largest
backward moment with the gradients made by then, less one residual-stream tensor (the
comparison ``test_compiled_layer_phase_peaks`` makes: memplan counts the layer's input and the
incoming gradient, the trace the held output in their place).

The float8 cases (a seventh field: torchao's recipe, ``--float8`` runs them alone; torchao
installed) convert the block's linears as torchtitan's float8 converter does. On CPU
``aten::_scaled_mm`` runs emulated, with fp32 copies of both float8 operands inside the call;
the trace counts each call as its output alone, as a GPU's cuBLASLt kernel allocates it
(``compiled_trace._calls_whole``). So it counts SDPA's CPU flash backward, whose per-thread
scratch follows the machine's thread count (a GPU's flash backward allocates other scratch,
modelled by neither: ``_calls_whole``).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "traced"))

TITAN = dict(dim=256, n_layers=1, n_heads=8, n_kv_heads=2, vocab_size=1000)
CASES = [  # (library: torchtitan, transformers (Llama), olmo2 or gemma2, fused q/k/v,
    #        dtype or amp-bf16, checkpoint: none, full or op (per-op SAC), batch, seq)
    ("torchtitan", True, "bfloat16", "full", 2, 64),
    ("torchtitan", True, "bfloat16", "full", 2, 96),  # T < h, no size coincidence
    ("torchtitan", True, "bfloat16", "full", 2, 1024),
    ("torchtitan", True, "bfloat16", "none", 2, 64),
    ("torchtitan", True, "bfloat16", "none", 2, 1024),
    ("transformers", False, "bfloat16", "full", 2, 1024),
    ("transformers", False, "bfloat16", "none", 2, 1024),
    ("torchtitan", True, "bfloat16", "op", 2, 64),  # torchtitan's per-op SAC
    ("torchtitan", True, "bfloat16", "op", 2, 96),
    ("torchtitan", True, "bfloat16", "op", 2, 1024),
    # around lpmf's threshold (T (f + h) < f h: ``compiled_order.lpmf_defers_mlp_grads``)
    ("torchtitan", True, "bfloat16", "full", 2, 32),
    ("torchtitan", True, "bfloat16", "op", 2, 32),
    ("torchtitan", True, "bfloat16", "full", 2, 80),
    ("torchtitan", True, "bfloat16", "op", 2, 80),
    ("torchtitan", True, "bfloat16", "full", 2, 88),
    ("torchtitan", True, "bfloat16", "op", 2, 88),
    # fp32 weights under torch.autocast(bfloat16) around the compiled forward (accelerate's
    # prepare_model: ``compiled_trace._autocast``)
    ("transformers", False, "amp-bf16", "none", 2, 128),  # MLP weight gradients deferred
    ("transformers", False, "amp-bf16", "none", 2, 192),  # (compiled.down_grad_deferred)
    ("transformers", False, "amp-bf16", "none", 2, 256),
    ("transformers", False, "amp-bf16", "full", 2, 256),
    ("transformers", False, "amp-bf16", "none", 2, 1024),
    ("transformers", False, "amp-bf16", "full", 2, 1024),
    # transformers' OLMo 2 layer (post norms, full-width q/k norms: hf_configs.OLMO2_TOY);
    # full: the checkpoint inside the compiled graph, as transformers' gradient checkpointing
    # under the Trainer's torch_compile
    ("olmo2", False, "bfloat16", "none", 2, 64),
    ("olmo2", False, "bfloat16", "none", 2, 1024),
    ("olmo2", False, "bfloat16", "full", 2, 64),
    ("olmo2", False, "bfloat16", "full", 2, 256),
    ("olmo2", False, "bfloat16", "full", 2, 1024),
    # transformers' Gemma 2 layer (sandwich norms, GeGLU: hf_configs.GEMMA2_TOY); full: the
    # checkpoint inside the compiled graph
    ("gemma2", False, "bfloat16", "none", 2, 64),
    ("gemma2", False, "bfloat16", "none", 2, 1024),
    ("gemma2", False, "bfloat16", "full", 2, 256),
    ("gemma2", False, "bfloat16", "full", 2, 1024),
    # torchao's Float8Linear on the block's linears (torchtitan's float8 converter:
    # ``frameworks._float8``), tensorwise or rowwise scaling, torchao 0.18.0; a seventh field
    ("torchtitan", True, "bfloat16", "none", 2, 64, "tensorwise"),
    ("torchtitan", True, "bfloat16", "none", 2, 64, "rowwise"),
    ("torchtitan", False, "bfloat16", "none", 2, 64, "tensorwise"),
    ("torchtitan", False, "bfloat16", "none", 2, 64, "rowwise"),
    ("torchtitan", True, "bfloat16", "full", 2, 64, "tensorwise"),
    ("torchtitan", True, "bfloat16", "full", 2, 64, "rowwise"),
    ("torchtitan", True, "bfloat16", "op", 2, 64, "tensorwise"),
    ("torchtitan", True, "bfloat16", "op", 2, 64, "rowwise"),
    ("torchtitan", True, "bfloat16", "none", 2, 1024, "tensorwise"),
    ("torchtitan", True, "bfloat16", "none", 2, 1024, "rowwise"),
    ("torchtitan", False, "bfloat16", "none", 2, 1024, "tensorwise"),
    ("torchtitan", True, "bfloat16", "full", 2, 1024, "tensorwise"),
    ("torchtitan", True, "bfloat16", "full", 2, 1024, "rowwise"),
    ("torchtitan", True, "bfloat16", "op", 2, 1024, "tensorwise"),
    ("torchtitan", True, "bfloat16", "op", 2, 1024, "rowwise"),
    # held out (none of the cases above, nor the tests): below lpmf's threshold, transformers'
    # Llama, OLMo 2 and Gemma 2 layers and torchtitan's block as torchtitan builds it
    # (separate q/k/v), which Inductor orders by lpmf or dfs there (not modelled: memplan's
    # eager order, over); above it, the same layers and float8 in torchtitan's own block
    ("transformers", False, "bfloat16", "none", 2, 64),
    ("transformers", False, "bfloat16", "full", 2, 64),
    ("transformers", False, "bfloat16", "none", 2, 80),
    ("transformers", False, "bfloat16", "none", 2, 96),
    ("transformers", False, "bfloat16", "full", 2, 96),
    ("torchtitan", False, "bfloat16", "full", 2, 64),
    ("torchtitan", False, "bfloat16", "op", 2, 64),
    ("torchtitan", False, "bfloat16", "none", 2, 64),
    ("torchtitan", True, "bfloat16", "none", 2, 96),
    ("olmo2", False, "bfloat16", "none", 2, 128),
    ("gemma2", False, "bfloat16", "none", 2, 64),
    ("gemma2", False, "bfloat16", "full", 2, 64),
    ("transformers", False, "amp-bf16", "full", 2, 64),
    ("transformers", False, "bfloat16", "none", 1, 512),
    ("transformers", False, "bfloat16", "full", 4, 128),
    ("torchtitan", False, "bfloat16", "op", 2, 256),
    ("torchtitan", False, "bfloat16", "full", 2, 96, "rowwise"),
    ("torchtitan", False, "bfloat16", "op", 2, 256, "rowwise"),
    ("torchtitan", False, "bfloat16", "op", 2, 256, "tensorwise"),
    ("torchtitan", True, "bfloat16", "op", 2, 256, "tensorwise"),
    ("torchtitan", False, "bfloat16", "full", 2, 1024, "tensorwise"),
    ("torchtitan", False, "bfloat16", "op", 2, 1024, "tensorwise"),
    # per-op SAC in torchtitan's block, tensorwise: lpmf's order (2 x 128) and dfs's (2 x 64)
    ("torchtitan", False, "bfloat16", "op", 2, 128, "tensorwise"),
    ("torchtitan", False, "bfloat16", "op", 2, 64, "tensorwise"),
    # transformers' layers of other families ("hf:<config.json folder>:<KV heads>", the toy
    # widths ``HF_TOY``), traced at 2 x 256 tokens (tests/traced/test_compile_trace.py's
    # held-out layer tests pin the same peaks)
    *[(f"hf:{name}:{kv}", False, "bfloat16", checkpoint, 2, 256)
      for name, kv in (("gemma-7b", 8), ("Phi-3-mini-4k-instruct", 8),
                       ("Phi-4-mini-instruct", 2), ("granite-3.3-8b-instruct", 2),
                       ("c4ai-command-r7b-12-2024", 2), ("Qwen3-8B", 2),
                       ("gemma-3-12b-pt", 4), ("Qwen2.5-7B", 2), ("Mistral-7B-v0.1", 2))
      for checkpoint in ("none", "full")],
    # the same under autocast (fp32 weights, bf16 compute: accelerate's prepare_model), the
    # families expressed there (tests/traced/test_compile_trace.py's autocast layer tests)
    # and those refused, traced over (Granite, Command R) or under (Phi-3 rebuilt)
    *[(f"hf:{name}:{kv}", False, "amp-bf16", checkpoint, 2, 256)
      for name, kv in (("Qwen2.5-7B", 2), ("Mistral-7B-v0.1", 2), ("Qwen3-8B", 2),
                       ("gemma-7b", 8), ("Phi-3-mini-4k-instruct", 8),
                       ("Phi-4-mini-instruct", 2), ("granite-3.3-8b-instruct", 2),
                       ("c4ai-command-r7b-12-2024", 2), ("gemma-3-12b-pt", 4))
      for checkpoint in ("none", "full")],
    *[(library, False, "amp-bf16", checkpoint, 2, 256)
      for library in ("gemma2", "olmo2") for checkpoint in ("none", "full")],
    # held out: the same at 2 x 1,024 tokens
    *[(library, False, "amp-bf16", checkpoint, 2, 1024)
      for library in ("gemma2", "hf:Qwen3-8B:2", "hf:granite-3.3-8b-instruct:2")
      for checkpoint in ("none", "full")],
]
# the widths of the "hf:" cases: two layers, h 256, 8 heads of 32, ffn 896
HF_TOY = dict(num_hidden_layers=2, hidden_size=256, intermediate_size=896,
              num_attention_heads=8, head_dim=32, vocab_size=1000)
# wider layers in a real model's proportions (an eighth field names them): the MLP 3 to 3.5
# times the width, heads of 64, tokens per micro-batch 2 to 8 times the width (Llama 3.1 8B at
# 8,192 tokens: 3.5 and 2); torchtitan's ffn from its own rule (4 dim x 2 / 3, rounded up to
# a multiple of 256: 1,536 at dim 512, 2,816 at dim 1,024)
WIDTHS = {
    "d512": (dict(TITAN, dim=512, n_heads=8, n_kv_heads=2),
             dict(HF_TOY, hidden_size=512, intermediate_size=1792, head_dim=64)),
    "d1024": (dict(TITAN, dim=1024, n_heads=16, n_kv_heads=4), None),
    # Gemma 2's own MLP ratio (9B: 14,336 / 3,584 = 4)
    "d512f4": (None, dict(HF_TOY, hidden_size=512, intermediate_size=2048, head_dim=64)),
}
CASES += [
    # held out at those proportions: torchtitan's block as torchtitan builds it (separate
    # q/k/v), bf16 and both float8 recipes, each recompute; transformers' Mistral and Qwen3
    # layers (2 KV heads) in bf16 and under autocast
    *[("torchtitan", False, "bfloat16", checkpoint, 1, 2048, float8, "d512")
      for float8 in ("none", "tensorwise", "rowwise") for checkpoint in ("none", "full", "op")],
    ("torchtitan", False, "bfloat16", "none", 2, 1024, "rowwise", "d512"),
    ("torchtitan", False, "bfloat16", "full", 1, 4096, "tensorwise", "d1024"),
    *[(f"hf:{name}:2", False, dtype, checkpoint, 1, seq, "none", "d512")
      for name in ("Mistral-7B-v0.1", "Qwen3-8B")
      for dtype, seq in (("bfloat16", 4096), ("amp-bf16", 2048))
      for checkpoint in ("none", "full")],
    # the same widths below the MLP's weight-gradient threshold (T (f + h) < f h: fewer than
    # 399 tokens at h 512, ffn 1,792; Llama 3.1 8B: fewer than 3,186, so a fine-tuning
    # micro-batch of 1 x 2,048 is below it), 1 x 256 tokens
    *[("torchtitan", False, "bfloat16", checkpoint, 1, 256, "none", "d512")
      for checkpoint in ("none", "full", "op")],
    *[("torchtitan", False, "bfloat16", checkpoint, 1, 256, float8, "d512")
      for float8 in ("tensorwise", "rowwise") for checkpoint in ("none", "full", "op")],
    *[(f"hf:{name}:2", False, dtype, checkpoint, 1, 256, "none", "d512")
      for name in ("Mistral-7B-v0.1", "Qwen3-8B") for dtype in ("bfloat16", "amp-bf16")
      for checkpoint in ("none", "full")],
    # Gemma 2's sandwich layer at its own MLP ratio, 4 KV heads
    ("hf:gemma-2-9b:4", False, "amp-bf16", "none", 2, 256, "none", "d512f4"),
    ("hf:gemma-2-9b:4", False, "amp-bf16", "none", 1, 2048, "none", "d512f4"),
    ("hf:gemma-2-9b:4", False, "bfloat16", "none", 1, 2048, "none", "d512f4"),
    ("hf:gemma-2-9b:4", False, "amp-bf16", "full", 1, 2048, "none", "d512f4"),
]


def _widths(library: str, widths: str) -> dict | None:
    """The torchtitan block's or the "hf:" case's widths (None: the library's toy ones)."""
    if widths == "toy":
        return None
    titan, hf_toy = WIDTHS[widths]
    got = titan if library == "torchtitan" else hf_toy
    if got is None:  # not the toy widths under another name
        raise ValueError(f"widths {widths!r} name no widths for {library!r}")
    return got


def _hf_case(library: str, widths: str = "toy") -> dict:
    """An "hf:<folder>:<KV heads>" case's config.json, cut to ``HF_TOY`` (or ``widths``)."""
    from hf_configs import hf

    _, name, kv = library.split(":")
    return hf(name, **(_widths(library, widths) or HF_TOY), num_key_value_heads=int(kv))


def memplan_peaks(library: str, fused: bool, dtype: str, checkpoint: str, batch: int,
                  seq: int, float8: str = "none", widths: str = "toy") -> tuple[int, int]:
    """memplan's (forward peak, backward peak) of the layer, each less one stream tensor."""
    from hf_configs import GEMMA2_TOY, LLAMA3_TOY, OLMO2_TOY, hf

    from memplan.model.compiled_order import held_by_lone_layer
    from memplan.model.dims import Dims
    from memplan.model.layer import grad_group_params, layer_kind
    from memplan.parallel import ParallelConfig
    from memplan.spec import spec_from_hf_dict
    from memplan.workload import Recompute, Workload

    recompute = {"none": Recompute.NONE, "full": Recompute.FULL,
                 "op": Recompute.SELECTIVE}[checkpoint]
    precision = {"bfloat16": "bf16-pure", "float32": "fp32"}.get(dtype, dtype)
    if library.startswith("hf:"):
        spec, extra = spec_from_hf_dict(_hf_case(library, widths), "toy", "toy"), {}
    elif library == "transformers":
        spec, extra = spec_from_hf_dict(hf("Meta-Llama-3-8B", **LLAMA3_TOY), "toy", "toy"), {}
    elif library == "olmo2":
        spec, extra = spec_from_hf_dict(hf("OLMo-2-1124-7B", **OLMO2_TOY), "toy", "toy"), {}
    elif library == "gemma2":
        spec, extra = spec_from_hf_dict(hf("gemma-2-9b", **GEMMA2_TOY), "toy", "toy"), {}
    else:
        from memplan.profile.frameworks import torchtitan_config, torchtitan_spec

        titan = _widths(library, widths) or TITAN
        spec = torchtitan_spec(torchtitan_config(**titan, seq_len=seq, fuse_qkv=fused), "toy")
        extra = {"rope_cache": "layer", "selective_impl": "op", "float8": float8}
    wl = Workload(micro_batch_size=batch, seq_len=seq, precision=precision,
                  recompute=recompute, compile=True, **extra)
    dm = Dims.of(spec, ParallelConfig(), wl)
    kind = layer_kind(spec, wl, dm, False, recompute)
    groups = grad_group_params(spec, 1, 1, False)
    stream = dm.rows * spec.hidden_size * dm.stream_e
    grad_e = dm.stream_e  # the weights' gradients in the parameters' dtype
    # the end moment under autocast counts the incoming gradient in the held output's place
    # and not the input, freed by then (``compiled.autocast_end_bytes``); lpmf's end as in a
    # step neither, which this one holds (``compiled_order.held_by_lone_layer``)
    backward = max(m.alive_bytes + m.transient_bytes
                   + grad_e * sum(groups[g] for g in m.grads_before)
                   + held_by_lone_layer(m, stream)
                   - (0 if m.name == "compiled_end" else stream) for m in kind.moments)
    return kind.forward_peak_bytes - stream, backward


def traced_peaks(library: str, fused: bool, dtype: str, checkpoint: str, batch: int,
                 seq: int, float8: str = "none", widths: str = "toy",
                 gpu_realize: bool = True) -> tuple[int, int]:
    """The traced (forward peak, backward peak), by default with Inductor's GPU realization
    rules (``gpu_realize``)."""
    from hf_configs import GEMMA2_TOY, LLAMA3_TOY, OLMO2_TOY, hf

    from memplan.profile.compiled_trace import compiled_layer_step

    config = (_hf_case(library, widths) if library.startswith("hf:")
              else hf("Meta-Llama-3-8B", **LLAMA3_TOY) if library == "transformers"
              else hf("OLMo-2-1124-7B", **OLMO2_TOY) if library == "olmo2"
              else hf("gemma-2-9b", **GEMMA2_TOY) if library == "gemma2"
              else {"torchtitan": dict(_widths(library, widths) or TITAN, fuse_qkv=fused,
                                       float8=float8)})
    weights, autocast = ("float32", "bfloat16") if dtype == "amp-bf16" else (dtype, None)
    _, forward, backward = compiled_layer_step(
        config, weights, batch, seq, autocast, checkpoint, gpu_realize=gpu_realize)
    return forward, backward


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", type=Path, help="store the rows as JSON")
    parser.add_argument("--float8", action="store_true",
                        help="the float8 cases alone (torchao installed)")
    parser.add_argument("--stored", type=Path,
                        help="read the traced peaks from this file (written by --write with the "
                             "same torch) instead of tracing again; memplan's are computed")
    args = parser.parse_args()
    stored = ({_key(r): r for r in json.loads(args.stored.read_text())["rows"]}
              if args.stored else {})
    rows = []
    for case in CASES:
        case = _padded(case)
        if args.float8 and case[6] == "none":
            continue
        row = stored.get(case)
        traced = ((row["traced_forward_bytes"], row["traced_backward_bytes"]) if row
                  else traced_peaks(*case))
        cpu = ((row["cpu_traced_forward_bytes"], row["cpu_traced_backward_bytes"]) if row
               else traced_peaks(*case, gpu_realize=False))
        model = memplan_peaks(*case)
        library, fused, dtype, checkpoint, batch, seq, float8, widths = case
        row = {"library": library, "fused_qkv": fused, "dtype": dtype, "checkpoint": checkpoint,
               "batch": batch, "seq": seq, **({"float8": float8} if float8 != "none" else {}),
               **({"widths": widths} if widths != "toy" else {}),
               "traced_forward_bytes": traced[0],
               "memplan_forward_bytes": model[0], "traced_backward_bytes": traced[1],
               "memplan_backward_bytes": model[1], "cpu_traced_forward_bytes": cpu[0],
               "cpu_traced_backward_bytes": cpu[1]}
        rows.append(row)
        print(f"{library:12s} {checkpoint:4s} {batch} x {seq:5d} {dtype}"
              f"{'' if float8 == 'none' else ' float8 ' + float8}"
              f"{'' if fused else ' q/k/v'}{'' if widths == 'toy' else ' ' + widths}: forward (B) "
              f"{model[0]:,} vs {traced[0]:,} ({model[0] / traced[0] - 1:+.2%}), backward "
              f"{model[1]:,} vs {traced[1]:,} ({model[1] / traced[1] - 1:+.2%}); CPU rules "
              f"{cpu[0]:,} / {cpu[1]:,}", flush=True)
    if args.write:
        import torch

        args.write.write_text(json.dumps({
            "torch": torch.__version__, "traced": "compiled_layer_step(gpu_realize=True): "
            "Inductor's GPU realization rules; cpu_traced_*: its CPU rules", "rows": rows},
            indent=1) + "\n")
    return 0


def _key(row: dict) -> tuple:
    """A stored row's case, every field given (``memplan_peaks``' arguments)."""
    return (row["library"], row["fused_qkv"], row["dtype"], row["checkpoint"], row["batch"],
            row["seq"], row.get("float8", "none"), row.get("widths", "toy"))


def _padded(case: tuple) -> tuple:
    """A case with its optional float8 recipe and widths given."""
    return case + ("none", "toy")[len(case) - 6:]


if __name__ == "__main__":
    raise SystemExit(main())

"""Ground truth for fine-tuning: a transformers model wrapped by peft's LoRA, its base weights
optionally quantized by bitsandbytes, stepped as ``transformers.Trainer`` steps it.

``build_peft(case)`` (the ``"peft"`` library of ``memplan.profile.frameworks``) builds the
model as ``build_hf`` does, then:

- ``base_quant`` ``nf4``/``int8``: every ``nn.Linear`` of the decoder layers becomes a
  bitsandbytes ``Linear4bit`` (NF4, blocksize 64, double quantization, the bf16 compute dtype:
  QLoRA's ``BitsAndBytesConfig``) or ``Linear8bitLt`` (``has_fp16_weights=False``), its weight
  quantized by moving it to the CPU device as transformers' loader does (bitsandbytes' CPU
  backend: ``backends/cpu`` and ``backends/default``); the head stays in the model's dtype
  (transformers keeps the output embedding unquantized, ``get_keys_to_not_convert``);
- ``gc``: ``model.gradient_checkpointing_enable()`` before ``get_peft_model``, which then calls
  ``enable_input_require_grads`` (``peft/utils/other.py``
  ``_prepare_model_for_gradient_checkpointing``): the embedding's output requires grad;
- ``get_peft_model(model, LoraConfig(r, lora_alpha=2r, lora_dropout, target_modules))`` with
  peft's defaults (``autocast_adapter_dtype=True``: fp32 adapters).

The frozen base weights (and a quantized weight's ``quant_state`` tensors) are parameters in the
trace, as memplan's ``params_bytes`` counts them; AdamW(fused) runs over the adapters alone.

With ``case.dp`` > 1 the peft model is sharded by FSDP2 (``_fully_shard``: each decoder layer,
then the root) on the fake process group, as zero 3; 4-bit weights are then stored as bf16
(``bnb_4bit_quant_storage=torch.bfloat16``, FSDP-QLoRA's setting), so FSDP2 shards and gathers
``Params4bit``'s packed data as a plain tensor (traced on CPU: it works, and
``Linear4bit.forward`` restores the quant_state from the module), while the quant_state stays
whole on every rank. ``offload="params"``: FSDP2's ``CPUOffloadPolicy``. Option ``fsdp1`` (a
dict of workload fields): FSDP1 instead, as peft's FSDP recipe and the Trainer wrap a peft
model (``_fsdp1_lora_wrap``), estimated with ``fsdp_version`` 1 (``memplan.model.fsdp1``).

CPU against CUDA: bitsandbytes' 4-bit forward ``gemm_4bit`` is one custom op, whose CPU
implementation (dequantize, then ``F.linear``) runs below the tracker's dispatch, as CUDA's
kernel does at training row counts (``backends/cuda/ops.py``: past its M threshold it runs the
same dequantize and linear); the backward's ``dequantize_4bit`` is a visible op on both.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch

from memplan import api

from memplan.profile.frameworks import BUILDERS, HELD, Built, FrameworkCase, Mark, build_hf

LORA_NAMES = {"q": "q_proj", "k": "k_proj", "v": "v_proj", "o": "o_proj", "gate": "gate_proj",
              "up": "up_proj", "down": "down_proj", "output": "lm_head", "lm_head": "lm_head"}


def _quantize(model: torch.nn.Module, quant: str,
              storage: torch.dtype = torch.uint8) -> list[torch.Tensor]:
    """Replace the decoder layers' linears by bitsandbytes' quantized ones; the tensors each
    quantized weight keeps beside its data (absmax, nested absmax, offset, code)."""
    import bitsandbytes as bnb

    extra: list[torch.Tensor] = []
    for layer in model.model.layers:
        for name, child in list(layer.named_modules()):
            if not isinstance(child, torch.nn.Linear):
                continue
            parent = layer.get_submodule(name.rpartition(".")[0]) if "." in name else layer
            w = child.weight.data
            if quant == "nf4":
                new = bnb.nn.Linear4bit(child.in_features, child.out_features,
                                        bias=child.bias is not None, compute_dtype=w.dtype,
                                        quant_type="nf4", compress_statistics=True,
                                        quant_storage=storage)
                # module=new: the module keeps the quant_state, which FSDP's resharding of
                # the weight drops (fix_4bit_weight_quant_state_from_module restores it)
                new.weight = bnb.nn.Params4bit(w, requires_grad=False, quant_type="nf4",
                                               compress_statistics=True, blocksize=64,
                                               quant_storage=storage, module=new)
            else:
                new = bnb.nn.Linear8bitLt(child.in_features, child.out_features,
                                          bias=child.bias is not None, has_fp16_weights=False)
                new.weight = bnb.nn.Int8Params(w, requires_grad=False, has_fp16_weights=False)
            new = new.to("cpu")
            setattr(parent, name.rpartition(".")[2], new)
            if storage == torch.uint8:  # the packed data: Params4bit is a subclass (under
                # FSDP, storage bf16, it is the sharded parameter, counted as one)
                extra.append(new.weight.data)
            state = getattr(new.weight, "quant_state", None)
            if state is not None:
                extra += [state.absmax, state.code, state.offset, state.state2.absmax]
            scb = getattr(new.weight, "SCB", None)
            if scb is not None:
                extra.append(scb)
    return extra


def build_peft(case: FrameworkCase) -> Built:
    """``build_hf``'s model under peft LoRA (module docstring); options: ``lora_rank``,
    ``lora_targets`` (memplan's names, comma-separated; None: peft's default),
    ``lora_dropout``, ``base_quant`` (``none``, ``nf4``, ``int8``), ``gc`` (gradient
    checkpointing), ``attn`` as ``build_hf``."""
    from peft import LoraConfig, get_peft_model

    opts = case.options
    built = build_hf(FrameworkCase("transformers", case.name, case.config, case.recipe,
                                   case.micro_batch_size, case.seq_len,
                                   options={"attn": opts.get("attn", "sdpa")}))
    model = built.model
    quant = opts.get("base_quant", "none")
    # FSDP-QLoRA stores the packed 4-bit data as bf16 (bnb_4bit_quant_storage: peft's
    # docs/source/accelerate/fsdp.md, "QLoRA with FSDP"), a unit's one dtype
    storage = torch.bfloat16 if case.dp > 1 else torch.uint8
    extra = _quantize(model, quant, storage) if quant != "none" else []
    if opts.get("gc"):
        model.config.use_cache = False
        model.gradient_checkpointing_enable()
    if opts.get("compile"):
        # each decoder layer compiled on its own (torchtune's training.compile_model, and
        # torchtitan's apply_compile), inside the checkpoint when gradient checkpointing is
        # on; no key/value cache (neither library fills one in training; a compiled layer's
        # DynamicCache.update outlives the step)
        model.config.use_cache = False
        for layer in model.model.layers:
            layer.compile(backend="inductor")
    rank = opts["lora_rank"]
    targets = opts.get("lora_targets")
    modules: Any = None
    if targets == "all-linear":
        modules = targets
    elif targets is not None:
        modules = [LORA_NAMES[t] for t in targets.split(",")]
    model = get_peft_model(model, LoraConfig(r=rank, lora_alpha=2 * rank,
                                             lora_dropout=opts.get("lora_dropout", 0.0),
                                             target_modules=modules))
    offload = opts.get("offload", "none")
    fsdp1 = opts.get("fsdp1")
    if fsdp1 is not None:
        model, context = _fsdp1_lora_wrap(model, case, fsdp1), _follow_flat_storage
    else:
        context = _fully_shard(model, case.dp, offload == "params") if case.dp > 1 else None
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-4, weight_decay=0.1, fused=True)
    b, s, vocab = case.micro_batch_size, case.seq_len, model.config.vocab_size

    held: dict[str, Any] = {}
    if opts.get("hold_outputs"):
        if context is not None:
            raise ValueError("hold_outputs is traced on one device")

        @contextlib.contextmanager
        def context(tracker: Any) -> Iterator[None]:
            held["tracker"] = tracker
            yield

    def step(k: int, mark: Mark) -> None:
        ids = torch.randint(0, vocab, (b, s))
        outputs = model(input_ids=ids, labels=ids)
        if opts.get("hold_outputs"):
            # peft's method_comparison/MetaMathQA/run.py ``train``: ``outputs = model(**batch)``
            # stays referenced through backward and the step, until the next call's returns;
            # its logits are the loop's, not saved by the graph (its cache is what SDPA saved)
            held["outputs"] = outputs
            held["tracker"].relabel(outputs.logits, HELD)
        loss = outputs.loss
        del outputs
        mark("backward")
        loss.backward()
        del loss
        mark("optimizer")
        if fsdp1 is not None:  # Accelerator.clip_grad_norm_ on FSDP1: the module's own
            model.clip_grad_norm_(1.0)
        else:
            torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)

    workload: dict[str, Any] = dict(built.workload, lora_rank=rank, lora_targets=targets,
                                    lora_dropout=opts.get("lora_dropout", 0.0),
                                    base_quant=quant)
    if opts.get("gc"):
        workload.update(recompute="full", kv_cache=False)
    if opts.get("compile"):
        workload.update(compile=True, kv_cache=False,
                        compile_in_checkpoint=bool(opts.get("gc")))
    if opts.get("hold_outputs"):
        workload.update(logits_held="output")
    if fsdp1 is not None:
        workload.update(fsdp_version=1, **{"use_orig_params": False, **fsdp1})
    elif case.dp > 1:  # fully_shard, not the hf preset's FSDP1 (Accelerate's default)
        workload.update(fsdp_version=2)
    frozen = [p for p in model.parameters() if not p.requires_grad] + extra
    layout = api.make_layout(case.dp, zero=3, offload=offload) if case.dp > 1 else built.layout
    return Built("peft", model, built.spec, layout, workload, step, opt, frozen=frozen,
                 context=context)


def _fully_shard(model: torch.nn.Module, dp: int,
                 offload: bool = False) -> Callable[[Any], Any]:
    """FSDP2 over the peft model on ``dp`` ranks of the process group: ``fully_shard`` on
    each decoder layer, then on the root (the transformers model inside peft's wrappers), its
    default ``MixedPrecisionPolicy`` (the weights' own dtypes: bf16 base, fp32 adapters; a
    unit of mixed dtypes is all-gathered as bytes); ``offload``: ``CPUOffloadPolicy``
    (unpinned: a CPU-only build cannot pin; ``trace_case`` then counts the host apart). The
    context the steps run in follows FSDP2's storage resizes
    (``memplan.profile.distributed``)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

    from memplan.profile.distributed import _follow_fsdp_storage

    mesh = init_device_mesh("cpu", (dp,))
    policy = {"offload_policy": CPUOffloadPolicy(pin_memory=False)} if offload else {}
    inner = model.base_model.model
    for layer in inner.model.layers:
        fully_shard(layer, mesh=mesh, **policy)
    fully_shard(inner, mesh=mesh, **policy)
    return _follow_fsdp_storage


def _fsdp1_lora_wrap(model: torch.nn.Module, case: FrameworkCase,
                     fields: dict[str, Any]) -> torch.nn.Module:
    """``FullyShardedDataParallel`` over the peft model as peft's documented FSDP recipe wraps
    it (peft 0.21.2 ``utils/other.py fsdp_auto_wrap_policy``: ``_or_policy`` of a
    ``lambda_auto_wrap_policy`` for every leaf module whose ``weight`` requires grad and a
    ``transformer_auto_wrap_policy`` on ``_no_split_modules``), which is torchtune's
    ``lora_finetune_distributed`` wrap too (torchtune fef3ed10
    ``utils/_distributed.py lora_fsdp_wrap_policy``: LoRA's A and B linears each their own
    unit, then the decoder layers): each adapter linear a unit nested in its decoder layer's,
    whose flat parameter holds the frozen base weights only; the root the embedding, final
    norm and head; FULL_SHARD, ``use_orig_params=False`` (torchtune's, Accelerate's
    plugin's default), ``limit_all_gathers``; ``fields``: workload fields
    (``backward_prefetch``, default none as Accelerate's; ``pre``: torch's and torchtune's);
    ``fsdp-bf16``: ``MixedPrecision(param_dtype=bf16, reduce_dtype=fp32)``."""
    from peft.utils.other import fsdp_auto_wrap_policy
    from torch.distributed.fsdp import BackwardPrefetch, FullyShardedDataParallel, MixedPrecision

    if case.dp < 2 or not fields.get("reshard_after_forward", True):
        raise ValueError("fsdp1 LoRA is traced with FULL_SHARD over dp > 1")
    prefetch = {"pre": "BACKWARD_PRE", "post": "BACKWARD_POST", "none": None}[
        fields.get("backward_prefetch", "none")]
    mp = (MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
          if case.recipe == "fsdp-bf16" else None)
    return FullyShardedDataParallel(
        model, auto_wrap_policy=fsdp_auto_wrap_policy(model), device_id=torch.device("cpu"),
        mixed_precision=mp, backward_prefetch=BackwardPrefetch[prefetch] if prefetch else None,
        use_orig_params=fields.get("use_orig_params", False), limit_all_gathers=True)


def _follow_flat_storage(tracker: Any) -> Any:
    from memplan.profile.fsdp1 import follow_flat_storage

    return follow_flat_storage(tracker)


BUILDERS["peft"] = build_peft

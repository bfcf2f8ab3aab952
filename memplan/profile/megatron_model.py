"""Ground truth from Megatron-LM: megatron-core's ``GPTModel``, stepped on CPU as its loop steps it.

``build_megatron(case)`` builds megatron-core 0.16.1's ``GPTModel`` with the local layer spec
(``get_gpt_layer_local_spec``: no Transformer Engine, so the core attention is megatron's own
``DotProductAttention``, which materialises the scores, i.e. memplan's eager attention), wraps it
as ``megatron/training/training.py get_model`` does (``Float16Module`` for bf16, then
megatron-core's ``DistributedDataParallel`` with its contiguous gradient buffer), makes the
optimizer with ``megatron.core.optimizer.get_megatron_optimizer`` (``FP32Optimizer`` for fp32,
``Float16OptimizerWithFloat16Params`` with fp32 master copies for bf16, or the
``DistributedOptimizer``), and steps it as ``training.py train_step`` does: ``zero_grad_buffer``
and ``optimizer.zero_grad()``, then core's own ``forward_backward_no_pipelining``
(``megatron/core/pipeline_parallel/schedules.py``) with a ``forward_step_func`` and ``loss_func``
as ``pretrain_gpt.py`` writes them (the per-token losses the model returns, masked and summed in
fp32, divided by the token count in ``schedules.forward_step_calc_loss``), ``finalize_model_grads``
after backward, then ``optimizer.step()`` (gradient clipping at 1.0, Megatron's default).

``trace_megatron(case)`` runs two such steps under memplan's exact tensor tracker on a one-rank
gloo group, and ``compare_megatron(case)`` compares them with ``estimate`` of the matching spec and
``framework="megatron"`` workload (``memplan.profile.frameworks.compare_built``).

What runs differently from a GPU run, and why (each swap is in ``megatron_on_cpu`` or below):

- megatron-core allocates on ``torch.cuda.current_device()`` and ``device="cuda"`` in places
  (``param_and_grad_buffer.py _ParamAndGradBuffer.__init__``, ``rotary_pos_embedding.py
  RotaryEmbedding.get_emb``, ``transformer/utils.py get_default_causal_mask``,
  ``schedules.py forward_backward_no_pipelining``'s token counter): those allocations go to the
  CPU, same shapes and dtypes.
- Its CUDA RNG tracker (``tensor_parallel/random.py``) cannot run: the forks are no-ops (the
  inference tracker's ``fork``), and the CUDA RNG state ``CheckpointFunction`` keeps is None.
  Dropout is off in the cases traced, so no random number is drawn under a fork.
- Transformer Engine and Apex are absent, so ``get_megatron_optimizer`` falls back to
  ``torch.optim.AdamW`` (``optimizer/__init__.py``, ``USING_PYTORCH_OPTIMIZER``); its param
  groups are switched to ``fused=True``, the fused kernel the preset models (Apex / TE
  FusedAdam). One difference stays: torch's fused AdamW keeps a 4-byte ``step`` tensor per
  parameter, where Apex / TE FusedAdam keep one Python int per group.
- Gradient clipping scales in place, as Apex's ``multi_tensor_scale`` does
  (``_scale_in_place``), not through the fallback's temporary per gradient.
- ``gradient_accumulation_fusion`` (Apex's ``fused_weight_gradient_mlp_cuda``, on by default in
  ``megatron/training/arguments.py`` when Apex is there) is off: each weight gradient is made by
  autograd and added into ``main_grad`` by DDP's hook (``distributed_data_parallel.py
  _make_backward_post_hook``), where the fused kernel accumulates into ``main_grad`` directly.
- ``F.rms_norm`` runs CUDA's fused kernel (``memplan.profile.cuda_rules.cuda_kernels``):
  the local spec's RMSNorm is ``torch.nn.RMSNorm`` (``transformer/torch_norm.py``).

Imports torch and megatron-core; memplan's CLI and ``estimate`` never import it.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from memplan import api
from memplan.errors import MemplanError
from memplan.profile.compare import Comparison
from memplan.profile.frameworks import (
    Built,
    FrameworkCase,
    LibraryTracker,
    Mark,
    compare_built,
    cuda_kernels,
    run_library_steps,
)
from memplan.profile.trace import TraceResult
from memplan.spec import ModelSpec, spec_from_hf_dict

# the recipes Megatron-LM runs, by memplan precision: fp32 (no --bf16), and --bf16 with its
# default --accumulate-allreduce-grads-in-fp32 (fp32 main grads and master weights)
MEGATRON_RECIPES = {"fp32": torch.float32, "bf16-fp32-grads": torch.bfloat16}

# two layers, GQA 4:1, SwiGLU, RMSNorm, RoPE, no biases, untied head
MEGATRON_TOY = dict(num_layers=2, hidden_size=256, num_attention_heads=8, num_query_groups=2,
                    ffn_hidden_size=896, vocab_size=1024)


# --- megatron-core on a CPU ----------------------------------------------------------------

def _is_cuda(device: Any) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.startswith("cuda")
    return isinstance(device, int) and not isinstance(device, bool)


class _CudaToCpu(TorchFunctionMode):
    """Factory calls and ``.to``/``.cuda`` that name a CUDA device land on the CPU, and
    ``Tensor.type()`` names the CUDA type a GPU run would see."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            # megatron checks types by name ('torch.cuda.FloatTensor': optimizer.py
            # Float16OptimizerWithFloat16Params.__init__, clip_grads.py)
            return func(*args).replace("torch.", "torch.cuda.", 1)
        if _is_cuda(kwargs.get("device")):
            kwargs["device"] = "cpu"
        if func is torch.Tensor.to and len(args) > 1 and _is_cuda(args[1]):
            args = (args[0], "cpu", *args[2:])
        return func(*args, **kwargs)


@contextlib.contextmanager
def megatron_on_cpu() -> Iterator[None]:
    """megatron-core's CUDA calls made CPU ones while inside (see the module's docstring):
    ``torch.cuda.current_device()`` is ``"cpu"``, ``device="cuda"`` is the CPU, the CUDA RNG
    tracker's forks and states are no-ops."""
    from megatron.core.tensor_parallel import random as mrandom

    from megatron.core.fusions import fused_softmax
    from megatron.core.optimizer import clip_grads

    saved = (torch.cuda.current_device, mrandom._get_cuda_rng_state,
             mrandom._set_cuda_rng_state, clip_grads.multi_tensor_scale_impl,
             fused_softmax.get_default_causal_mask)
    torch.cuda.current_device = lambda: "cpu"
    clip_grads.multi_tensor_scale_impl = _scale_in_place
    # called inside autograd Functions (tensor_parallel.checkpoint's forward and its rerun),
    # where no torch function mode applies
    fused_softmax.get_default_causal_mask = _causal_mask
    mrandom._get_cuda_rng_state = lambda *a, **k: None
    mrandom._set_cuda_rng_state = lambda *a, **k: None
    # the inference tracker: fork() is a nullcontext, add/set_states do nothing
    mrandom.initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)
    try:
        with _CudaToCpu():
            yield
    finally:
        (torch.cuda.current_device, mrandom._get_cuda_rng_state,
         mrandom._set_cuda_rng_state, clip_grads.multi_tensor_scale_impl,
         fused_softmax.get_default_causal_mask) = saved
        mrandom.initialize_rng_tracker(force_reset=True)


def _causal_mask(sq: int) -> torch.Tensor:
    """``transformer/utils.py get_default_causal_mask`` on the CPU (it names ``device="cuda"``):
    an fp32 ones (sq, sq), its upper triangle, cast to bool, made at every attention call."""
    return torch.triu(torch.ones(sq, sq), diagonal=1).bool()


def _scale_in_place(chunk_size, noop_flag, tensor_lists, scale) -> None:
    """Apex's ``amp_C.multi_tensor_scale`` as its kernel runs it: each output written in place.
    megatron-core's fallback (``utils.py local_multi_tensor_scale``: ``dst.copy_(src * scale)``)
    makes a gradient-sized temporary per tensor, which a GPU run with Apex / TE does not."""
    for src, dst in zip(tensor_lists[0], tensor_lists[1]):
        torch.mul(src, scale, out=dst)



@contextlib.contextmanager
def megatron_group() -> Iterator[None]:
    """One gloo rank with megatron-core's model-parallel groups (tp = pp = 1)."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    if dist.is_initialized():
        raise MemplanError("a process group is already initialised")
    # one rank: an in-process store, no TCP port to find free (or to race another job for)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        parallel_state.initialize_model_parallel(1, 1)
        yield
    finally:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()


# --- the model -----------------------------------------------------------------------------

def megatron_spec(config, vocab_size: int, seq_len: int, name: str) -> ModelSpec:
    """memplan's spec of a ``TransformerConfig`` (Llama field names: RMSNorm, SwiGLU, RoPE);
    ``linear_qkv`` is one parameter (fused_qkv)."""
    data = {"model_type": "llama", "hidden_size": config.hidden_size,
            "num_hidden_layers": config.num_layers,
            "num_attention_heads": config.num_attention_heads,
            "num_key_value_heads": config.num_query_groups, "head_dim": config.kv_channels,
            "intermediate_size": config.ffn_hidden_size, "vocab_size": vocab_size,
            "max_position_embeddings": seq_len, "hidden_act": "silu",
            "attention_bias": config.add_bias_linear, "mlp_bias": config.add_bias_linear,
            "tie_word_embeddings": False, "rms_norm_eps": config.layernorm_epsilon}
    return spec_from_hf_dict(data, f"megatron-core {name}", name).model_copy(
        update={"fused_qkv": True})


def _transformer_config(case: FrameworkCase):
    import torch.nn.functional as F
    from megatron.core.transformer.transformer_config import TransformerConfig

    dtype = MEGATRON_RECIPES[case.recipe]
    fields = {k: v for k, v in case.config.items() if k != "vocab_size"}
    recompute = case.options.get("recompute", "none")
    rc: dict[str, Any] = {}
    if recompute == "selective":  # --recompute-granularity selective: core_attn by default
        rc = dict(recompute_granularity="selective")
    elif recompute == "full":  # --recompute-granularity full --recompute-method uniform
        rc = dict(recompute_granularity="full", recompute_method="uniform",
                  recompute_num_layers=1)
    elif recompute != "none":
        raise MemplanError(f"recompute must be none, selective or full, got {recompute!r}")
    return TransformerConfig(
        **fields, gated_linear_unit=True, activation_func=F.silu, normalization="RMSNorm",
        add_bias_linear=False, hidden_dropout=0.0, attention_dropout=0.0,
        params_dtype=dtype, pipeline_dtype=dtype, bf16=dtype is torch.bfloat16,
        use_cpu_initialization=True,
        # the CUDA-only fusions (Apex / TE / the jit kernels' CUDA paths)
        bias_dropout_fusion=False, apply_rope_fusion=False, masked_softmax_fusion=False,
        gradient_accumulation_fusion=False, persist_layer_norm=False,
        **rc)


def build_megatron(case: FrameworkCase) -> Built:
    """megatron-core's ``GPTModel`` of ``case.config`` (``TransformerConfig`` fields and
    ``vocab_size``), wrapped, optimised and stepped as Megatron-LM's training loop does (see the
    module's docstring). Must run inside ``megatron_group()`` and ``megatron_on_cpu()``.

    options: ``recompute`` (``"none"``, ``"selective"``: Megatron's core-attention recompute,
    ``"full"``: each layer, uniform), ``distributed_optimizer`` (False; True:
    ``--use-distributed-optimizer``, memplan's zero 1)."""
    from megatron.core.distributed import (
        DistributedDataParallel,
        DistributedDataParallelConfig,
        finalize_model_grads,
    )
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.pipeline_parallel import schedules
    from megatron.core.transformer.module import Float16Module

    if case.recipe not in MEGATRON_RECIPES:
        raise MemplanError(f"megatron: recipe one of {', '.join(MEGATRON_RECIPES)}, "
                           f"got {case.recipe!r}")
    if case.dp != 1:
        raise MemplanError("megatron: one rank (dp 1) only")
    bf16 = case.recipe == "bf16-fp32-grads"
    vocab, b, s = case.config["vocab_size"], case.micro_batch_size, case.seq_len
    dist_opt = bool(case.options.get("distributed_optimizer", False))
    config = _transformer_config(case)
    spec = megatron_spec(config, vocab, s, case.name)
    # training.py get_model: the model built in params_dtype, Float16Module for bf16, then DDP
    model = GPTModel(config=config, transformer_layer_spec=get_gpt_layer_local_spec(
        normalization="RMSNorm"), vocab_size=vocab, max_sequence_length=s,
        position_embedding_type="rope", share_embeddings_and_output_weights=False)
    if bf16:
        model = Float16Module(config, model)
    # arguments.py: --bf16 turns on accumulate_allreduce_grads_in_fp32 (grad_reduce_in_fp32)
    ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=bf16,
                                               use_distributed_optimizer=dist_opt)
    ddp = DistributedDataParallel(config, ddp_config, module=model)
    opt_config = OptimizerConfig(optimizer="adam", lr=1e-4, weight_decay=0.1, bf16=bf16,
                                 params_dtype=config.params_dtype, clip_grad=1.0,
                                 use_distributed_optimizer=dist_opt)
    optimizer = get_megatron_optimizer(opt_config, [ddp])
    # a ChainedOptimizer of one (dense parameters only) around torch.optim.AdamW (no Apex/TE)
    (wrapper,) = getattr(optimizer, "chained_optimizers", [optimizer])
    inner = wrapper.optimizer
    for group in inner.param_groups:  # the fused kernel the preset models (FusedAdam)
        group["fused"], group["foreach"] = True, False
    # training.py setup_model_and_optimizer / train: the schedule's hooks
    config.finalize_model_grads_func = finalize_model_grads
    config.no_sync_func = ddp.no_sync

    def loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor):
        # pretrain_gpt.py loss_func: per-token losses masked and summed in fp32
        losses = output_tensor.view(-1).float()
        loss_mask = loss_mask.view(-1).float()
        loss = torch.sum(losses * loss_mask)
        num_tokens = loss_mask.sum().clone().detach().to(torch.int)
        reporting_loss = torch.cat([loss.clone().detach().view(1), num_tokens.view(1)])
        return loss, num_tokens, {"lm loss": reporting_loss}

    def forward_step(data_iterator, model):
        # pretrain_gpt.py forward_step: get_batch, then the model with labels (its loss)
        tokens, labels, loss_mask, position_ids = next(data_iterator)
        output_tensor = model(tokens, position_ids, None, labels=labels)
        return output_tensor, lambda out: loss_func(loss_mask, out)

    def batch():
        # pretrain_gpt.py get_batch (GPTDataset, --no-create-attention-mask-in-dataloader)
        ids = torch.randint(0, vocab, (b, s + 1))
        tokens, labels = ids[:, :s].contiguous(), ids[:, 1:].contiguous()
        loss_mask = torch.ones(b, s, dtype=torch.float)
        position_ids = torch.arange(s).unsqueeze(0).expand(b, s).contiguous()
        yield tokens, labels, loss_mask, position_ids

    def step(k: int, mark: Mark) -> None:
        # training.py train_step
        ddp.zero_grad_buffer()
        optimizer.zero_grad()
        backward_step = schedules.backward_step

        def marked_backward(*args, **kwargs):
            mark("backward")
            return backward_step(*args, **kwargs)

        def marked_finalize(*args, **kwargs):
            finalize_model_grads(*args, **kwargs)
            mark("optimizer")

        schedules.backward_step = marked_backward
        config.finalize_model_grads_func = marked_finalize
        try:
            schedules.forward_backward_no_pipelining(
                forward_step_func=forward_step, data_iterator=batch(), model=[ddp],
                num_microbatches=1, seq_length=s, micro_batch_size=b)
        finally:
            schedules.backward_step = backward_step
            config.finalize_model_grads_func = finalize_model_grads
        optimizer.step()

    # the local spec's core attention: Megatron's DotProductAttention (--transformer-impl local)
    workload = dict(framework="megatron", micro_batch_size=b, seq_len=s, precision=case.recipe,
                    recompute=case.options.get("recompute", "none"), attention="eager",
                    attention_global_buffer=True)
    layout = api.make_layout(1, zero=1) if dist_opt else api.make_layout(1)

    @contextlib.contextmanager
    def context(tracker: LibraryTracker) -> Iterator[None]:
        # persistent state made at setup, before the tracker: DDP's gradient buffers (what
        # main_grad views) and the optimizer's fp32 master copies
        tracker.register([buf.grad_data for buf in ddp.buffers], "gradients")
        tracker.register(_masters(wrapper), "optimizer")
        yield

    # the module DDP wraps: DDP's own `buffers` attribute is its list of gradient buffers
    return Built("megatron", model, spec, layout, workload, step, inner, context=context)


def _masters(optimizer) -> list[torch.Tensor]:
    """The fp32 master copies a Megatron mixed-precision optimizer keeps (none for fp32)."""
    out: list[torch.Tensor] = []
    for name in ("fp32_from_float16_groups", "shard_fp32_from_float16_groups"):
        for group in getattr(optimizer, name, None) or []:
            out += [t for t in group if isinstance(t, torch.Tensor)]
    return out


def trace_megatron(case: FrameworkCase, *, steps: int = 2) -> tuple[Built, TraceResult]:
    """Build ``case`` with megatron-core on a one-rank gloo group and trace ``steps`` training
    steps (``memplan.profile.frameworks.trace_case`` for megatron)."""
    with megatron_group(), megatron_on_cpu(), cuda_kernels():
        torch.manual_seed(0)
        built = build_megatron(case)
        return built, run_library_steps(built, LibraryTracker(), steps=steps)


def compare_megatron(case: FrameworkCase, *, steps: int = 2) -> Comparison:
    """Trace ``case`` and compare it with memplan's estimate."""
    built, result = trace_megatron(case, steps=steps)
    return compare_built(built, result)


__all__ = ["MEGATRON_RECIPES", "MEGATRON_TOY", "build_megatron", "compare_megatron",
           "megatron_group", "megatron_on_cpu", "megatron_spec", "trace_megatron"]

"""What one training step runs: batch, sequence, precision recipe, optimizer, recompute, kernels.

Each choice that changes the bytes held is a field here; each enum documents what it means for
memory, with the source of the convention.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

from memplan.choices import Field, Record, field_validator, model_validator
from memplan.choices import PlainEnum, RankedEnum
from memplan.errors import MemplanError
from memplan.spec import MAX_LAYERS
from memplan.units import DType


class Precision(PlainEnum):
    """Precision recipes, each a policy of dtypes (``PrecisionPolicy``).

    bf16-mixed       bf16 weights and grads, fp32 master + optimizer states (ZeRO paper's 16 B/param)
    bf16-fp32-grads  bf16 weights, fp32 main grads, fp32 master + states (Megatron-LM default, 18)
    fp16-mixed       fp16 weights and grads, fp32 master + states (ZeRO paper, 16)
    fp32             fp32 everything, no master copy (16 with Adam)
    fsdp-bf16        FSDP2 MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32): fp32 sharded
                     weights and grads, bf16 copies gathered for compute (torchtitan's default)
    bf16-pure        bf16 weights and grads, no master copy, optimizer states in bf16
                     (torch.optim creates them with zeros_like(param)): 8 B/param with Adam
    amp-bf16         fp32 weights, grads and states (16 B/param with Adam); the forward runs
                     under torch.autocast(dtype=bf16): matmuls read bf16 casts of their inputs
                     and weights, the residual stream and norms stay fp32
    amp-fp16         as amp-bf16 with fp16 autocast and torch.amp.GradScaler (its scale and
                     growth tracker; the loss scaled before backward, gradients unscaled in
                     place before the step)
    """

    BF16_MIXED = "bf16-mixed"
    BF16_FP32_GRADS = "bf16-fp32-grads"
    FP16_MIXED = "fp16-mixed"
    FP32 = "fp32"
    FSDP_BF16 = "fsdp-bf16"
    BF16_PURE = "bf16-pure"
    AMP_BF16 = "amp-bf16"
    AMP_FP16 = "amp-fp16"

    @property
    def policy(self) -> PrecisionPolicy:
        return _POLICIES[self]


@dataclass(frozen=True)
class PrecisionPolicy:
    """Which dtype each copy of the model is held in.

    The optimizer's states and its step's temporaries are in the dtype of what it updates
    (``updated``): torch.optim's AdamW and SGD create their states with ``zeros_like(param)``
    (``torch/optim/adamw.py``, ``_init_group``), so an fp32 master copy gets fp32 states and
    bf16 weights updated directly get bf16 states.
    """

    params: DType  # the resident (possibly sharded) weight copy
    compute: DType  # activations, and the weights matmuls read (FSDP's gathered copies)
    grads: DType  # gradients as held (fp32 main gradients for bf16-fp32-grads)
    master: DType | None  # the optimizer's own copy of the weights; None: it updates them
    autocast: DType | None = None  # torch.autocast's dtype around forward and loss, if any
    grad_scaler: bool = False  # torch.amp.GradScaler scales the loss (fp16 autocast)

    @cached_property
    def updated(self) -> DType:
        """The tensors the optimizer updates: its master copy, else the weights."""
        return self.master or self.params

    @cached_property
    def unsharded(self) -> DType:
        """The dtype ZeRO-3 / FSDP2 gathers weights (and makes their unsharded gradients) in:
        the compute dtype (FSDP2's ``MixedPrecisionPolicy.param_dtype``), or under autocast
        the weights' own, which autocast casts after the gather."""
        return self.params if self.autocast else self.compute

    @cached_property
    def param_bytes(self) -> int:
        return self.params.itemsize

    @cached_property
    def grad_bytes(self) -> int:
        return self.grads.itemsize

    @cached_property
    def master_bytes(self) -> int:
        return self.master.itemsize if self.master else 0


_POLICIES = {
    Precision.BF16_MIXED: PrecisionPolicy(DType.BF16, DType.BF16, DType.BF16, DType.FP32),
    Precision.BF16_FP32_GRADS: PrecisionPolicy(DType.BF16, DType.BF16, DType.FP32, DType.FP32),
    Precision.FP16_MIXED: PrecisionPolicy(DType.FP16, DType.FP16, DType.FP16, DType.FP32),
    Precision.FP32: PrecisionPolicy(DType.FP32, DType.FP32, DType.FP32, None),
    Precision.FSDP_BF16: PrecisionPolicy(DType.FP32, DType.BF16, DType.FP32, None),
    Precision.BF16_PURE: PrecisionPolicy(DType.BF16, DType.BF16, DType.BF16, None),
    Precision.AMP_BF16: PrecisionPolicy(DType.FP32, DType.BF16, DType.FP32, None,
                                        autocast=DType.BF16),
    Precision.AMP_FP16: PrecisionPolicy(DType.FP32, DType.FP16, DType.FP32, None,
                                        autocast=DType.FP16, grad_scaler=True),
}


class Optimizer(PlainEnum):
    """The optimizer: its states and its step's temporaries are
    ``memplan.model.optimizer.POLICIES``.

    adamw            torch.optim.AdamW: two states per parameter
    sgd              torch.optim.SGD with momentum 0.9: one momentum buffer per parameter
    adamw8bit        bitsandbytes AdamW8bit: two blockwise 8-bit states
    paged-adamw8bit  bitsandbytes PagedAdamW8bit: the same states, the large ones in unified
                     memory the driver pages out to the host under pressure
    paged-adamw      bitsandbytes PagedAdamW (32-bit): two fp32 states, the large ones paged
    adafactor        torch.optim.Adafactor: row and column factors for matrices, full for vectors
    muon             torch.optim.Muon on the 2-D parameters, torch.optim.AdamW on the others
    """

    ADAMW = "adamw"
    SGD = "sgd"
    ADAMW8BIT = "adamw8bit"
    PAGED_ADAMW8BIT = "paged-adamw8bit"
    PAGED_ADAMW = "paged-adamw"
    ADAFACTOR = "adafactor"
    MUON = "muon"


class OptimizerImpl(PlainEnum):
    """How torch.optim runs the update, which decides the step's temporaries.

    foreach  CUDA default: one intermediate the size of all parameters it updates
    fused    fused kernel: no parameter-sized intermediate
    forloop  CPU default: per-tensor intermediates, 3x the largest parameter (traced)
    """

    FOREACH = "foreach"
    FUSED = "fused"
    FORLOOP = "forloop"


class Recompute(RankedEnum):
    """Activation recomputation, ordered by memory saved (and compute spent):
    ``NONE < SELECTIVE < FULL``.

    SELECTIVE recomputes the attention core (Korthikanti et al. 2022, section 5); FULL keeps only
    each layer's input (for ``recompute_layers`` of the stage's layers, all when None). OPS
    checkpoints each layer op by op (PyTorch's selective activation checkpointing): it keeps
    its input and the outputs of the ops ``Workload.recompute_save`` names, and recomputes the
    rest in backward (``memplan.model.sac_ops``); it sits between SELECTIVE and FULL.
    """

    NONE = "none"
    SELECTIVE = "selective"
    OPS = "ops"
    FULL = "full"

    @classmethod
    def parse(cls, value: object) -> Recompute:
        """A policy from its name (any case), itself, or its rank 0, 1, 2 (how records written
        before the policies were strings hold it): the one place recompute is parsed."""
        if isinstance(value, Recompute):
            return value
        if isinstance(value, str) and value.upper() in cls.__members__:
            return cls[value.upper()]
        old_ranks = (cls.NONE, cls.SELECTIVE, cls.FULL)  # the levels before OPS existed
        if isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 3:
            return old_ranks[value]
        raise MemplanError(f"recompute must be none, selective, ops or full, got {value!r}")

    @property
    def label(self) -> str:
        return self.value


class Attention(PlainEnum):
    """flash: fused kernel saving output and logsumexp (SDPA flash / memory-efficient);
    eager: materialised scores, saving the softmax output (the s-squared term)."""

    FLASH = "flash"
    EAGER = "eager"


class NormImpl(PlainEnum):
    """upcast: Hugging Face style, the norm runs in fp32 on an upcast copy of its input;
    fused: one kernel saving its input and per-token statistics (Apex / Transformer Engine);
    upcast-fp32: litgpt's RMSNorm (litgpt/model.py RMSNorm.forward), as upcast but the weight
    multiplies the fp32 normalised tensor (``weight.float()``) before the cast back, so the
    normalised tensor and an fp32 copy of the weight are saved."""

    UPCAST = "upcast"
    FUSED = "fused"
    UPCAST_FP32 = "upcast-fp32"

    @property
    def upcast(self) -> bool:
        """Normalises an fp32 copy of its input in Python (``upcast``, ``upcast-fp32``)."""
        return self is not NormImpl.FUSED


class Framework(PlainEnum):
    """The training framework whose implementation defaults apply (``memplan.presets``)."""

    GENERIC = "generic"
    MEGATRON = "megatron"
    TORCHTITAN = "torchtitan"
    HF = "hf"
    LIGHTNING = "lightning"
    DEEPSPEED = "deepspeed"


class ChunkBackward(PlainEnum):
    """When a chunked loss (``Workload.loss_chunks`` > 1) runs each chunk's backward.

    rerun    in the model's backward: each chunk checkpointed (only its input kept), its head
             and loss rerun there
    in-loss  inside the loss call, chunk after chunk: the head's weight gradient summed over
             the chunks then, the chunks' input gradients into one fp32 buffer, cast and saved
             for the model's backward (torchtitan's ChunkedLossWrapper, components/loss.py)
    """

    RERUN = "rerun"
    IN_LOSS = "in-loss"


class DeltaNetKernel(PlainEnum):
    """The kernels of Qwen3-Next's gated DeltaNet layers (Qwen3NextGatedDeltaNet: transformers
    picks each one at import, models/qwen3_next/modeling_qwen3_next.py).

    fla    flash-linear-attention's ``chunk_gated_delta_rule`` and ``FusedRMSNormGated`` with
           causal-conv1d's ``causal_conv1d_fn`` (both packages installed: transformers'
           ``is_fast_path_available``, what GPU training runs; memplan.model.deltanet_fla)
    torch  transformers' torch fallbacks (``torch_chunk_gated_delta_rule``, ``nn.Conv1d``
           and silu, Qwen3NextRMSNormGated): an install without them, every CPU run, as
           transformers up to 5.16 writes the rule (a forward substitution loop;
           memplan.model.deltanet)
    torch-solve  the same fallbacks as transformers 5.17 on writes the rule
           (``torch.linalg.solve_triangular``, decays applied once before the chunk scan;
           memplan.model.deltanet_solve)
    """

    FLA = "fla"
    TORCH = "torch"
    TORCH_SOLVE = "torch-solve"


class MambaKernel(PlainEnum):
    """How Granite 4.0-H's Mamba2 layers run (GraniteMoeHybridMambaLayer, models/
    granitemoehybrid/modeling_granitemoehybrid.py; Falcon-H1's FalconH1Mixer alike, models/
    falcon_h1/modeling_falcon_h1.py), without mamba_ssm and causal-conv1d (an
    install without them, every CPU run): mamba_ssm's fused kernel is not modelled.

    torch         ``torch_forward`` as transformers 5.3 writes it: the naive chunked scan,
                  its broadcasting products summed after (memplan.model.mamba)
    torch-einsum  ``forward`` as transformers 5.23 writes it: ``causal_conv1d_fn``'s torch
                  fallback and ``mamba2_chunk_scan``, the chunked scan as einsums
                  (memplan.model.mamba_einsum)
    """

    TORCH = "torch"
    TORCH_EINSUM = "torch-einsum"


class MlaCache(PlainEnum):
    """What a training forward's key/value cache (``Workload.kv_cache``) holds of a DeepSeek
    multi-head latent attention layer (DeepseekV3Attention.forward).

    latent    the compressed latents (kv_nope after kv_a_layernorm, the rotated k_rot), the
              key and value then rebuilt from them (``expand_kv``): the core's value is a
              view of kv_b_proj's output, which it keeps whole (transformers 5.23)
    expanded  the expanded key and value (DynamicLayer.update's copies), which the core
              saves instead of kv_b_proj's output (transformers 5.3)
    """

    LATENT = "latent"
    EXPANDED = "expanded"


class LogitsHeld(PlainEnum):
    """Who keeps the logits beyond what autograd saves.

    none  the loss's input is freed once the loss has its own copy (memplan's reference loop)
    loss  the model's output keeps the compute-dtype logits while the loss upcasts and
          log-softmaxes a copy; dropped with the output before backward (transformers)
    step  the training loop keeps the logits the loss read (fp32) through backward and the
          optimizer step, until the next forward returns (litgpt's pretrain loop variable)
    output  as loss, and the training loop keeps the model's output (its compute-dtype logits)
          through backward and the optimizer step, until the next model call returns, its
          loss included (``outputs = model(**batch)``: peft's method_comparison run.py)
    """

    NONE = "none"
    LOSS = "loss"
    STEP = "step"
    OUTPUT = "output"


class LossImpl(PlainEnum):
    """The cross-entropy implementation.

    generic   PyTorch's F.cross_entropy on fp32 logits: log_softmax saved, the loss's backward
              makes two logits-sized fp32 tensors
    megatron  Megatron-LM's _VocabParallelCrossEntropy (core/tensor_parallel/cross_entropy.py):
              one fp32 copy of the compute-dtype logits turned into the saved softmax in place
              (max subtracted, exp and normalised in place), the backward computed in place
              on that buffer; the compute-dtype logits stay alive in the model's forward
    megatron-fused  --cross-entropy-loss-fusion: the same steps in fusions/fused_cross_entropy.py
              run through megatron/core/jit.py jit_fuser (torch.compile from torch 2.2): the
              forward holds what megatron's does; calculate_gradients, functionalized, makes
              the target's index_put on an fp32 copy of the saved softmax (then writes the
              result back into it), so its backward holds one fp32 logits-sized buffer more
    torchtitan  torchtitan's _LossParallelCrossEntropy on vocab-sharded logits under TP
              (components/loss.py, torchtitan 0.3.0): its forward holds the shifted logits
              beside the fp32 logits and the saved log-probabilities, its fused backward a
              zeros-like gradient, exp(log_probs) and their sum; without TP,
              F.cross_entropy as generic
    torchtune-chunked  torchtune's chunked output (TransformerDecoder.chunked_output) with
              CEWithChunkedOutputLoss, on ``loss_chunks`` chunks of the sequence, no
              checkpoint: the compute-dtype logits chunks stay alive through the loss, each
              upcast to fp32 in turn, every chunk's fp32 log-softmax saved
    """

    GENERIC = "generic"
    MEGATRON = "megatron"
    MEGATRON_FUSED = "megatron-fused"
    TORCHTITAN = "torchtitan"
    TORCHTUNE_CHUNKED = "torchtune-chunked"


class SelectiveImpl(PlainEnum):
    """What ``--recompute selective`` recomputes.

    core  the attention core (Korthikanti et al. 2022, section 5; Megatron-LM's
          --recompute-granularity selective)
    op    torchtitan's per-op SAC: every op's output recomputed but those of its save list
          (matmuls but every second one, the attention kernels), ``memplan.model.sac``
    """

    CORE = "core"
    OP = "op"


class FsdpUnits(PlainEnum):
    """How ZeRO-3 / FSDP2 groups the weights that are not in a block.

    root        every block a unit, one root unit with the embedding, final norm and head,
                gathered from the forward to the end of backward (memplan's reference wrapping)
    torchtitan  the embedding its own unit (resharded after forward, gathered again for its
                backward) and [final norm, head] another (not resharded after forward): its
                ``apply_fsdp_to_decoder``; with tied embeddings one unit, as the root
    buckets     every block a unit whose weights are one bucket, gathered into a temporary
                bucket ahead of use (a window of units in elements) and released after its
                forward and its backward; the other weights gathered from their forward to
                the end of backward; each unit's gradients in a whole temporary bucket of
                the main-gradient dtype, held after its reduce-scatter while the queue of
                reduced buckets is under its capacity (Megatron-FSDP:
                ``memplan.model.fsdp_buckets``)
    root-resharded
                every block a unit (the last not resharded after forward), one root unit
                with the embedding, final norm and head resharded after the model's forward
                and gathered again in its pre-backward, a hook on the logits that fires once
                the loss's backward has made their gradient: the loss runs beside the last
                block alone (torchtitan before 0.3: ``apply_fsdp``'s
                ``fully_shard(model, reshard_after_forward=not pp_enabled)``,
                torchtitan/parallelisms/parallelize_llama.py at 9dec370,
                torchtitan/models/llama3/parallelize_llama.py at e7c0cae); under pipeline
                parallelism kept gathered as ``torchtitan``'s
    """

    ROOT = "root"
    TORCHTITAN = "torchtitan"
    BUCKETS = "buckets"
    ROOT_RESHARDED = "root-resharded"


class BackwardPrefetch(PlainEnum):
    """FSDP1's ``backward_prefetch`` (``--fsdp-version 1``; torch/distributed/fsdp/
    _runtime_utils.py ``_get_handle_to_prefetch``): when a unit's backward all-gathers the unit
    that runs its backward next.

    pre   in the unit's pre-backward hook, before its gradients are computed
          (``BackwardPrefetch.BACKWARD_PRE``, torch's default): two units gathered while a
          block's backward runs
    post  in its post-backward hook, after its own unsharded weights are freed
          (``BACKWARD_POST``): the next unit gathered beside the unit's reduce-scatter
    none  no prefetch (``backward_prefetch=None``; Accelerate's and the Trainer's default,
          ``NO_PREFETCH``): each unit gathered in its own pre-backward hook
    """

    PRE = "pre"
    POST = "post"
    NONE = "none"


class GradSync(PlainEnum):
    """When a training loop that accumulates gradients over micro-batches reduces them across
    data-parallel ranks.

    every  after every micro-batch's backward (FSDP2's default: ``FSDPModule.
           set_requires_gradient_sync`` is True unless a loop turns it off; DeepSpeed ZeRO-2/3
           reduce in every backward's hooks)
    last   only in the last micro-batch's backward: FSDP2 with
           ``set_requires_gradient_sync(False)`` on the others (each unit's gradients stay
           unsharded, in the reduce dtype, across micro-batches:
           ``FSDPParam.to_accumulated_grad_if_needed``), DDP under ``no_sync()`` (gradients
           accumulate in ``param.grad``, the buckets untouched), ZeRO-1 (gradients unsharded
           anyway); torch's pipeline stage always runs this way
           (``torch/distributed/pipelining/stage.py`` ``backward_maybe_with_nosync``)
    """

    EVERY = "every"
    LAST = "last"


class RopeCache(PlainEnum):
    """Where the RoPE cos/sin tables live.

    forward  computed in every forward at the sequence's length and saved by the layers
             (memplan's reference model; transformers' rotary embedding module)
    model    one pair of registered buffers on the model, in the weights' dtype, for the
             training sequence's positions, sliced (views) by each forward (litgpt's
             ``GPT.cos`` / ``GPT.sin``)
    layer    a registered buffer in every attention layer, complex64 for the training
             sequence's positions (torchtitan's ``RoPE.cache``)
    model-complex
             one complex64 buffer on the model for the training sequence's positions, handed
             to each layer (torchtitan before 0.3: ``Transformer.freqs_cis``,
             torchtitan/models/llama/model.py at 9dec370, torchtitan/models/llama3/model.py
             at e7c0cae, models/llama3/model/model.py at v0.2.2; max_seq_len =
             training.seq_len)
    layer-max
             a registered fp32 (cos, sin) buffer in every attention layer for the model's
             ``max_seq_len`` positions, beside its fp32 frequencies, sliced (views) by each
             forward (torchtune up to 0.1: modules/position_embeddings.py
             ``RotaryPositionalEmbeddings._rope_init`` and ``build_rope_cache``; every layer
             its own copy, ``_get_clones`` in modules/transformer.py;
             ``memplan.model.attention.max_positions_rope_bytes``)
    layer-cossin
             a registered fp32 buffer in every attention layer for the training sequence's
             positions, cos and sin concatenated over the doubled frequencies: (seq, 2 x
             rope_dim), twice ``layer``'s (torchtitan 0.3.0's ``CosSinRoPE``, models/common/
             rope.py ``_precompute_cache``: ``torch.cat([cos, sin], dim=-1)`` of
             ``torch.cat([freqs, freqs])``; its qwen3 flavors)
    """

    FORWARD = "forward"
    MODEL = "model"
    LAYER = "layer"
    MODEL_COMPLEX = "model-complex"
    LAYER_MAX = "layer-max"
    LAYER_COSSIN = "layer-cossin"


class AttentionImpl(PlainEnum):
    """How the attention module feeds its core.

    generic  q, k and v reach the core as their own tensors, the core's output is token-major
             (memplan's reference model, transformers, torchtitan)
    litgpt   litgpt's ``CausalSelfAttention``: q, k and v are views of the one qkv output;
             RoPE's ``torch.cat`` makes head-major q and k; with grouped K/V both are
             ``repeat_interleave``d to every query head before SDPA (which saves the
             copies), without, SDPA saves v, a view that keeps the whole qkv output alive;
             the core's output follows q's head-major layout, so the reshape for the output
             projection copies it
    """

    GENERIC = "generic"
    LITGPT = "litgpt"


class MlpImpl(PlainEnum):
    """The order of a gated MLP's operations in forward, which sets its backward's order
    (autograd runs the ready node made last first).

    generic  act(gate(x)) * up(x): the activation before the up projection, so the up
             projection's backward runs while the activation's waits with its saved input
             (transformers' LlamaMLP, torchtitan's FeedForward; memplan's reference model)
    litgpt   litgpt's ``LLaMAMLP``: both projections, then the activation
             (``F.silu(x_fc_1) * x_fc_2``), whose backward runs first and frees its input
    """

    GENERIC = "generic"
    LITGPT = "litgpt"


class CpExchange(PlainEnum):
    """How context parallelism's ranks exchange K and V around the attention kernel (step
    time only: ``memplan.planning.timing``).

    ring       each of the cp steps sends the next K/V chunk while the current block's
               attention runs, forward and backward (Megatron-LM / Transformer Engine's
               AttnFuncWithCPAndKVP2P; PyTorch's context_parallel with rotate method alltoall)
    allgather  PyTorch's context_parallel with rotate method allgather: K and V all-gathered
               once per call, waited for at the second block (only the first block's attention
               hides it), again in backward; there the fp32 K/V gradients travel the ring step by
               step, each beside the next block's backward, the last one after the loop
               (torch/distributed/tensor/experimental/_attention.py _AllGatherRotater,
               _templated_ring_attention_backward)
    """

    RING = "ring"
    ALLGATHER = "allgather"


class StepModel(PlainEnum):
    """How the step-time model times a step's compute (step time only:
    ``memplan.planning.timing``).

    mfu      every FLOP at a flat end-to-end fraction of peak (``DEFAULT_MFU`` or a
             calibration's), which holds the GEMMs, the memory-bound kernels and whatever
             else a step spends per FLOP; the decoder's linears and the attention scaled by
             their measured rates where the GPU has them
    kernels  kernel by kernel: the GEMMs alone at their measured rates and the memory-bound
             per-token kernels by the bytes they move over the HBM, as Megatron-LM's fused
             kernels move them (megatron/core/fusions: fused_layer_norm, fused_bias_dropout
             bias_dropout_add_fused_train, fused_bias_gelu bias_gelu_impl, fused_bias_swiglu
             bias_swiglu_impl, fused_softmax scaled_upper_triang_masked_softmax;
             ``memplan.planning.kernels.elementwise_bytes``). A calibrated MFU, measured on
             the device, times the step at its flat rate instead
    kernels-torch
             kernel by kernel as ``kernels``, the memory-bound per-token kernels those the
             PyTorch modules run (torchtitan's models/llama3/model.py TransformerBlock and
             FeedForward, transformers' LlamaDecoderLayer): eager, one kernel per pointwise
             op (SiLU, then the product; residual adds without bias or dropout); under
             torch.compile, Inductor's fused pointwise kernel for the activation
             (``memplan.planning.kernels.elementwise_bytes`` with ``megatron_kernels``
             false)
    """

    MFU = "mfu"
    KERNELS = "kernels"
    KERNELS_TORCH = "kernels-torch"


class PipelineP2p(PlainEnum):
    """How a pipeline's sends and receives sit beside its compute (step time only:
    ``memplan.planning.timing``).

    overlapped  a micro-batch's sends overlap the next one's compute, the stated share
                (``memplan.planning.timing.OVERLAP``)
    blocking    with one model chunk per rank each send and receive is waited for before the
                next compute: Megatron-LM's non-interleaved 1F1B
                (megatron/core/pipeline_parallel/schedules.py
                forward_backward_pipelining_without_interleaving calls
                P2PCommunicator.send_forward_recv_backward and send_backward_recv_forward,
                whose _communicate waits on its requests, wait_on_reqs True:
                p2p_communication.py); with virtual stages the interleaved schedule's
                overlap_p2p_comm keeps the stated share
    """

    OVERLAPPED = "overlapped"
    BLOCKING = "blocking"


class PipelineSplit(PlainEnum):
    """How decoder layers are split over pipeline stages when no split is given.

    even      pp*vpp equal parts, refused where they do not divide the layers (Megatron-LM's
              default: megatron/core/transformer/transformer_block.py get_num_layers_to_build
              asserts "num_layers should be divisible by pipeline_model_parallel_size")
    weighted  torchtitan's automatic split: the embedding and the final norm + head count as
              one layer each and the sum is split evenly (distributed/pipeline_parallel.py
              _generate_llm_fqn_per_model_part), at any pp, divisible or not
    """

    EVEN = "even"
    WEIGHTED = "weighted"


class PipelineBuffers(PlainEnum):
    """What a pipeline stage's runtime keeps of its micro-batches beyond the model's own
    activations (``memplan.model.pipeline_buffers``).

    none   nothing: each received activation and gradient is a fresh tensor, a stage's output
           freed once sent (Megatron-LM's schedules, deallocate_pipeline_outputs)
    torch  torch.distributed.pipelining's PipelineStage (torch 2.13, stage.py): a receive
           buffer per micro-batch of the step for the stage's input and one for its output's
           gradient, made at step 1's start and kept; each micro-batch's output kept until
           its backward (``fwd_cache``); Schedule1F1B's last sent input gradient kept until
           the next backward (``bwd_sends``; ``stage_backward`` takes each off its buffer)
    """

    NONE = "none"
    TORCH = "torch"


# Bounds that keep a mistyped number from a search that never ends or byte counts past the
# planner's 64-bit arrays: 2^24 sequences per step (Llama 3 trained with ~4k sequences of 4k
# tokens, Dubey et al. 2024) and 2^24 tokens per sequence (the longest published training
# contexts are 1M-10M tokens).
MAX_SEQUENCES = 2**24
MAX_SEQ_LEN = 2**24
# A common pre-training context (Llama 2: 4096 tokens, Touvron et al. 2023, arXiv 2307.09288);
# the API caps it at the model's maximum (``memplan.api.default_seq``).
DEFAULT_SEQ_LEN = 4096
# the largest LoRA rank taken: far above any low-rank adapter, so a mistyped rank fails here
MAX_LORA_RANK = 65_536


class MoeImpl(PlainEnum):
    """How an MoE feed-forward runs its routed experts.

    loop     one expert after another over its gathered rows, the weighted outputs combined
             out of place with index_add (memplan's reference model, ``memplan.profile.
             reference.MoE``)
    grouped  transformers' default experts implementation (integrations/moe.py
             ``grouped_mm_experts_forward``; ``get_correct_experts_implementation`` picks
             grouped_mm): the routed rows sorted by expert, one grouped matmul over all of
             them for gate/up and one for down, weighted, unsorted and summed per token (the
             sum saves nothing); as transformers 5.23 writes it, the pairs sorted first and
             the rows gathered once in that order (``hidden_states[perm // num_top_k]``),
             the unsort index made after the down projection
    grouped-token  the same as transformers 5.3 wrote it: the rows gathered by token
             (``hidden_states[token_idx]``), then a sorted copy, both indices made first (a
             checkpointed forward holds one more gathered copy and two more indices)
    parallel the model's own experts as transformers 5.3's Granite MoE runs them
             (``MoESpec.parallel_experts``: models/granitemoe/modeling_granitemoe.py
             GraniteMoeMoE.forward; 5.23 runs them grouped): the rows
             gathered in expert order, one F.linear per expert over its split (torch.cat of
             the outputs) for gate/up and for down, weighted, index_add into zeros
    every    the model's own experts over every token (``MoESpec.every_expert``: Llama 4's
             Llama4TextMoe.forward): the input repeated per expert and scaled by the router's
             scores, two batched matmuls over all of it, the outputs summed per token
    titan    torchtitan 0.3.0's own block (models/common/moe.py ``MoE.forward``): the
             ``TokenChoiceTopKRouter`` gate under fp32 autocast, its softmax or sigmoid in
             fp32, top-k and gather of the scores (route_norm, route_scale); the routing map
             summed to counts; ``RoutedExperts.forward``: ``LocalTokenDispatcher.dispatch``
             (models/common/token_dispatcher.py ``_local_reorder``: argsort of the expert ids,
             the scores sorted, token indices ``// top_k``, ``x_TD[idx]``),
             ``GroupedExperts.forward`` (``torch._grouped_mm`` in bf16 for w1 and w3, silu
             times the product, w2, ``.type_as``), ``LocalTokenDispatcher.combine`` (an fp32
             product with the sorted scores, cast back, ``deterministic_scatter_add`` into
             zeros); shared experts after them, added (``memplan.model.moe_titan``)
    """

    LOOP = "loop"
    GROUPED = "grouped"
    GROUPED_TOKEN = "grouped-token"
    EVERY = "every"
    PARALLEL = "parallel"
    TITAN = "titan"

    @property
    def grouped(self) -> bool:
        """transformers' grouped experts, as either version writes them."""
        return self in (MoeImpl.GROUPED, MoeImpl.GROUPED_TOKEN)


class Float8Recipe(PlainEnum):
    """torchao's float8 training of the decoder layers' linears, as torchtitan applies it
    (``convert_to_float8_training`` with ``Float8LinearConfig.from_recipe_name``:
    ``torchao/float8/config.py``; the output head is not converted).

    none        plain linears
    tensorwise  dynamic scaling, one fp32 scale per cast tensor (``ScalingGranularity.
                TENSORWISE``, the ``CastConfig`` default)
    rowwise     dynamic scaling, one fp32 scale per row of each cast (``ScalingGranularity.
                AXISWISE``: ``tensor_to_amax``'s ``amax(abs(x), dim=axiswise_dim,
                keepdim=True)``, ``torchao/float8/float8_utils.py``)
    """

    NONE = "none"
    TENSORWISE = "tensorwise"
    ROWWISE = "rowwise"


class TeFp8Recipe(PlainEnum):
    """Transformer Engine's fp8 training of the decoder layers' TE linears (Megatron-LM's
    ``--fp8-recipe`` with ``--fp8-format``; megatron/core/fp8_utils.py ``get_fp8_recipe``),
    what each holds read from TE's source (v2.9 and b9d690e: ``memplan.model.te_fp8``). fp8
    data is one byte an element whatever the format (e4m3 or hybrid's e5m2 gradients).

    none        TE's linears in the compute dtype
    delayed     ``DelayedScaling``: ``Float8Quantizer``, one fp32 scale per tensor from an
                amax history kept per module (``amax_history_len`` rows)
    tensorwise  ``Float8CurrentScaling``: ``Float8CurrentScalingQuantizer``, one fp32 scale
                per tensor from the tensor's own amax
    mxfp8       ``MXFP8BlockScaling``: ``MXFP8Quantizer``, one E8M0 byte scale per 32
                elements, rowwise and columnwise copies each with its own scales
    blockwise   ``Float8BlockScaling``: ``Float8BlockQuantizer``, an fp32 scale per 1x128
                block of activations and gradients and per 128x128 block of weights
    """

    NONE = "none"
    DELAYED = "delayed"
    TENSORWISE = "tensorwise"
    MXFP8 = "mxfp8"
    BLOCKWISE = "blockwise"


class BaseQuant(PlainEnum):
    """How frozen base weights are stored under LoRA (``memplan.model.adapters``).

    none  in the weights' dtype (the precision recipe's)
    nf4   bitsandbytes ``Linear4bit`` NF4 with double quantization, as QLoRA loads a model
          (``BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
          bnb_4bit_use_double_quant=True)``): the decoder's linears only
    int8  bitsandbytes ``Linear8bitLt`` (LLM.int8, ``load_in_8bit=True``): int8 rows and an
          fp32 scale per row, the decoder's linears only
    nf4-torchao-0.1
          torchao 0.1's ``NF4Tensor`` (``torchao/dtypes/nf4tensor.py``: ``to_nf4``,
          ``linear_nf4``), as torchtune's QLoRA (``LoRALinear(quantize_base=True)``) used it
          while it pinned ``torchao==0.1``: the same NF4 blocks as bitsandbytes, dequantized
          by plain PyTorch ops in forward and backward, and each weight quantized on the GPU
          at load in one piece (``memplan.model.adapters``); the adapted linears only
    nf4-torchao
          torchao's ``NF4Tensor`` as released since 0.3 (``torchao/quantization/quantize_/
          workflows/nf4/nf4_tensor.py`` of 0.18; torchtune's QLoRA since it left 0.1): the
          same blocks and dequantization as 0.1, the scales' factors one bf16 element per 256
          blocks (contiguous since torchao commit 9dbc5542, 0.3), each weight quantized at
          load 1024**2 weights at a time (since 6081796b, 0.2), and shardable by FSDP2
          (``fsdp_pre_all_gather``, 0.2); the adapted linears only
    """

    NONE = "none"
    NF4 = "nf4"
    INT8 = "int8"
    NF4_TORCHAO_01 = "nf4-torchao-0.1"
    NF4_TORCHAO = "nf4-torchao"


LORA_PROJECTIONS = ("q", "k", "v", "o", "gate", "up", "down")  # --lora-targets' names
ALL_LINEAR = "all-linear"  # peft's target_modules="all-linear": every projection but the head
# the output projection: torchtune's apply_lora_to_output (output_proj), peft's "lm_head"
LORA_HEAD = ("output", "lm_head")


class Workload(Record):
    """One training step. Token counts are per micro-batch, per data-parallel replica."""

    micro_batch_size: int = Field(default=1, gt=0, le=MAX_SEQUENCES)
    global_batch_size: int | None = Field(default=None, gt=0, le=MAX_SEQUENCES,
                                          description="None: mbs*dp*pp")
    seq_len: int = Field(default=DEFAULT_SEQ_LEN, gt=0, le=MAX_SEQ_LEN)

    precision: Precision = Precision.BF16_MIXED
    optimizer: Optimizer = Optimizer.ADAMW
    optimizer_impl: OptimizerImpl = OptimizerImpl.FOREACH
    recompute: Recompute = Recompute.NONE
    # layers to recompute: at most as many as a model may have (spec.MAX_LAYERS)
    recompute_layers: int | None = Field(default=None, ge=0, le=MAX_LAYERS)
    recompute_save: tuple[str, ...] = Field(default=(), max_length=1024, description=(
        "with recompute ops: the saved terms (attn.q, mlp.gate, ...) or groups (attention, "
        "mlp, norms) each layer keeps; everything else in it is recomputed in backward "
        "(memplan.model.sac_ops); empty: only the layer's input is kept. SCOPE:name keeps "
        "name only in layers of a kind (dense:, moe:) or on a pipeline stage (stage0:, "
        "stage1:, ...)"))
    recompute_every: int | None = Field(default=None, ge=1, le=MAX_LAYERS, description=(
        "with recompute full: only every n-th layer of a pipeline rank is recomputed (its "
        "n-th, 2n-th, ... layer, its model chunks in order: torchtitan's "
        "selective_ac_option = n); None: every layer"))
    attention: Attention = Attention.FLASH
    norm_impl: NormImpl = NormImpl.UPCAST
    logits_fp32: bool = Field(default=True, description="loss computed on fp32 logits")
    framework: Framework = Framework.GENERIC
    fsdp_units: FsdpUnits = FsdpUnits.ROOT
    loss_impl: LossImpl = LossImpl.GENERIC
    fsdp_version: int = Field(default=2, ge=1, le=2, description=(
        "which FSDP shards under --zero 2/3 with data parallelism: 2, fully_shard (per-parameter "
        "DTensors); 1, FullyShardedDataParallel (one flat parameter per wrapped unit, "
        "memplan.model.fsdp1): --zero 3 is FULL_SHARD, --zero 2 SHARD_GRAD_OP"))
    backward_prefetch: BackwardPrefetch = BackwardPrefetch.PRE
    reshard_after_forward: bool = Field(default=True, description=(
        "FSDP1 (fsdp_version 1): False is SHARD_GRAD_OP, each unit kept gathered from its "
        "forward to its post-backward (memplan.model.fsdp1); True is FULL_SHARD"))
    use_orig_params: bool = Field(default=False, description=(
        "FSDP1's use_orig_params: zero_grad(set_to_none=True) clears the original parameters' "
        "gradient views only, so the flat parameters' sharded gradients live until the next "
        "step's root pre-forward"))
    forward_prefetch: bool = Field(default=False, description=(
        "FSDP1's forward_prefetch: a unit's pre-forward all-gathers the next unit's weights "
        "(two blocks gathered in forward); False: one at a time"))
    selective_impl: SelectiveImpl = SelectiveImpl.CORE
    fused_qkv: bool = Field(default=False, description=(
        "one q/k/v projection (torchtitan's FusedQKVLinear): one matmul where three run"))
    keep_grads: bool = Field(default=False, description=(
        "zero_grad(set_to_none=False): from step 2 on the zeroed gradients stay allocated "
        "through forward, and backward accumulates into them"))
    logits_held: LogitsHeld = LogitsHeld.NONE
    embeds_held: bool = Field(default=False, description=(
        "the model's forward keeps the embedding's output in a local until it returns, after "
        "the final norm (transformers' XModel.forward: inputs_embeds), beside the layers "
        "where no layer saves it (memplan.model.stage.embeds_held_bytes); its attention "
        "masks (causal_mask_mapping) are such locals too, freed when it returns, before the "
        "head and the loss (HeadBlock.mask_released)"))
    attn_weights_held: bool = Field(default=False, description=(
        "the decoder layer keeps what its attention returns beside the output in a local "
        "until it returns (transformers: hidden_states, _ = self.self_attn(...)); eager "
        "attention returns its probabilities, which then outlive the attention through the "
        "rest of a checkpointed layer's forward (memplan.model.attention.held_weights_bytes)"))
    positions_held: bool = Field(default=False, description=(
        "the model's forward hands every layer its positions (one int64 row of the sequence) "
        "as a keyword argument, which a checkpointed layer's checkpoint keeps to its backward "
        "(transformers' GradientCheckpointingLayer.__call__: partial(super().__call__, "
        "**kwargs); memplan.model.attention.positions_terms)"))
    mask_per_sequence: bool = Field(default=False, description=(
        "eager attention's additive mask is one per sequence, (b, 1, s, s_kv) (transformers' "
        "masking_utils.py eager_mask: torch.where over sdpa_mask's boolean, expanded to the "
        "batch), where it is one (s, s_kv) table (memplan.model.attention.eager_mask_bytes)"))
    deltanet_kernel: DeltaNetKernel = Field(default=DeltaNetKernel.FLA, description=(
        "the gated DeltaNet layers' kernels (DeltaNetKernel); the default assumes "
        "flash-linear-attention and causal-conv1d are installed, as transformers then runs "
        "them"))
    mamba_kernel: MambaKernel = Field(default=MambaKernel.TORCH_EINSUM, description=(
        "how the Mamba2 layers run (MambaKernel); the default is transformers' torch path as "
        "5.23 writes it (torch-einsum), what an install without mamba_ssm runs; torch: as 5.3 "
        "wrote it"))
    mla_cache: MlaCache = Field(default=MlaCache.LATENT, description=(
        "what a training forward's cache holds of a latent-attention layer (MlaCache): the "
        "latents, as transformers 5.23's DeepseekV3Attention caches them, or the expanded "
        "key and value (5.3)"))
    grad_sync: GradSync = GradSync.EVERY
    # DeepSpeed's ZeRO-1/2 gradient buckets and step (memplan.model.deepspeed_zero)
    zero_bucket_numel: int = Field(default=0, ge=0, le=10**12, description=(
        "elements of each preallocated reduce bucket (DeepSpeed's reduce_bucket_size: "
        "stage_1_and_2.py setup_buckets); 0: no preallocated bucket"))
    zero_bucket_buffers: int = Field(default=0, ge=0, le=2, description=(
        "how many such buckets a backward allocates: 1, or 2 with overlap_comm; 0 without "
        "contiguous_gradients"))
    zero3_plain_gathers: bool = Field(default=False, description=(
        "DeepSpeed's ZeRO-3 with each module's own weights gathered while it runs, forward "
        "and backward, and released after it: stage3_prefetch_bucket_size, "
        "stage3_max_reuse_distance and stage3_param_persistence_threshold 0 "
        "(partitioned_param_coordinator.py fetch_sub_module / release_sub_module), whatever "
        "the zero3_*_numel fields say"))
    # DeepSpeed's ZeRO-3 parameter coordinator (memplan.model.deepspeed_coordinator), in
    # elements; DeepSpeedZeroConfig's defaults (runtime/zero/config.py, 0.19.8)
    zero3_prefetch_numel: int = Field(default=50_000_000, ge=0, le=10**13, description=(
        "stage3_prefetch_bucket_size: elements of the parameters the coordinator gathers ahead "
        "of the module trace at each module's fetch (fetch_sub_module)"))
    zero3_max_live_numel: int = Field(default=1_000_000_000, ge=0, le=10**13, description=(
        "stage3_max_live_parameters: no prefetch beyond this many gathered elements"))
    zero3_reuse_distance_numel: int = Field(default=1_000_000_000, ge=0, le=10**13,
                                            description=(
        "stage3_max_reuse_distance: a module's parameters stay gathered after its run when "
        "used again within this many elements of the trace (__params_to_release)"))
    zero3_persistence_numel: int = Field(default=100_000, ge=0, le=10**13, description=(
        "stage3_param_persistence_threshold: parameters of at most this many elements stay "
        "gathered from the first step's end on (mark_persistent_parameters)"))
    flat_partition: bool = Field(default=False, description=(
        "the optimizer updates one flat fp32 partition per parameter group, whose gradient "
        "the step makes by flattening the rank's gradient partition (a copy in the "
        "gradients' dtype) and upcasting it (DeepSpeed's DeepSpeedZeroOptimizer.step)"))
    softmax_fp32: bool = Field(default=False, description=(
        "eager attention's softmax in fp32 with a compute-dtype copy for the value matmul "
        "(transformers' eager_attention_forward)"))
    kv_cache: bool = Field(default=False, description=(
        "the training forward fills a key/value cache (transformers with use_cache): under "
        "autocast its fp32 copies of K and V live until the forward's output is dropped"))
    compile: bool = Field(default=False, description=(
        "each decoder layer runs under torch.compile (Inductor): AOTAutograd's min-cut "
        "partitioner decides what its forward saves (memplan.model.compiled)"))
    compile_in_checkpoint: bool = Field(default=False, description=(
        "with compile and full recompute, each compiled layer runs inside its activation "
        "checkpoint (torchtune's compile_model after set_activation_checkpointing, "
        "transformers' gradient checkpointing): the compiled forward returns the layer's "
        "whole saved set before the checkpoint drops it; off: the checkpoint inside the "
        "compiled graph (torchtitan)"))
    compile_loss: bool = Field(default=False, description=(
        "torchtune's chunked cross-entropy runs compiled (training.compile_loss: each chunk's "
        "upcast and cross-entropy under torch.compile, Inductor): each chunk saves its "
        "logits and two fp32 per-row statistics, not an fp32 log-softmax "
        "(memplan.model.chunked_output); with loss_impl torchtitan its loss compiled: "
        "unchunked the same saved set, under loss parallel the fp32 softmax less the "
        "one-hot targets (memplan.model.head), each chunk of its ChunkedLossWrapper "
        "(loss_chunk_backward in-loss) the unchunked graph's (memplan.model.loss_in_call)"))
    optimizer_in_backward: bool = Field(default=False, description=(
        "each parameter's optimizer step runs in backward, in a hook after its gradient is "
        "accumulated, which then frees it (torchtune's optimizer_in_bwd; memplan.model."
        "step_in_backward): gradients never accumulate and no step follows backward"))
    float8: Float8Recipe = Field(default=Float8Recipe.NONE, description=(
        "the decoder layers' linears train as torchao's Float8Linear with this recipe "
        "(memplan.model.linear: float8_forward_bytes)"))
    float8_all_gather: bool = Field(default=False, description=(
        "FSDP2 all-gathers the converted linears' weights in float8 (torchao's "
        "enable_fsdp_float8_all_gather, WeightWithDynamicFloat8CastTensor: one byte an "
        "element gathered, the Float8Linear casts no weight); tensorwise only"))
    async_tp: bool = Field(default=False, description=(
        "tensor parallelism's sequence all-gathers and reduce-scatters run micro-pipelined "
        "with the matmuls beside them (torchtitan's enable_async_tensor_parallel: Inductor's "
        "_micro_pipeline_tp pass, torch/distributed/_symmetric_memory fused_all_gather_matmul "
        "and fused_matmul_reduce_scatter); needs compile. Step time only: memory is read as "
        "plain tensor parallelism (the gathered input is the same size)"))
    ddp_any_size: bool = Field(default=False, description=(
        "the model is wrapped in data-parallel buffers at any data-parallel size, one rank "
        "included (Megatron-LM's DDP): its gradient buffer exists from the wrap on"))
    loss_split: int = Field(default=0, ge=0, le=MAX_SEQ_LEN, description=(
        "tokens per piece of a cross-entropy split without checkpointing (litgpt's "
        "chunked_cross_entropy: logits.split(128)); 0: one piece"))
    rope_cache: RopeCache = RopeCache.FORWARD
    attention_impl: AttentionImpl = AttentionImpl.GENERIC
    mlp_impl: MlpImpl = MlpImpl.GENERIC
    cp_exchange: CpExchange = CpExchange.RING
    step_model: StepModel = Field(default=StepModel.MFU, description=(
        "how a step's compute is timed (StepModel): at a flat end-to-end fraction of peak, "
        "or kernel by kernel with Megatron-LM's fused pointwise kernels (kernels) or the "
        "PyTorch modules' own (kernels-torch). Step time only"))
    pipeline_p2p: PipelineP2p = Field(default=PipelineP2p.OVERLAPPED, description=(
        "whether the pipeline's sends overlap compute (PipelineP2p): overlapped by the "
        "stated share, or blocking without virtual stages (Megatron-LM's non-interleaved "
        "1F1B). Step time only"))
    moe_impl: MoeImpl = MoeImpl.LOOP
    window_mask: bool = Field(default=False, description=(
        "sliding-window layers attend through an explicit mask once the sequence reaches the "
        "window, which SDPA converts to the query's dtype and saves, K and V repeated to every "
        "query head for it (transformers' SDPA path)"))
    pipeline_split: PipelineSplit = PipelineSplit.EVEN
    pipeline_buffers: PipelineBuffers = Field(default=PipelineBuffers.NONE, description=(
        "what a pipeline stage's runtime keeps per micro-batch beyond the activations "
        "(PipelineBuffers): nothing (Megatron-LM), or torch.distributed.pipelining's "
        "PipelineStage receive buffers, kept outputs and input gradients (torchtitan); "
        "read at pp > 1 only"))
    loss_chunks: int = Field(default=1, gt=0, le=MAX_SEQ_LEN, description=(
        "1: the head and cross-entropy run on all tokens at once; n > 1: on n chunks of the "
        "tokens, each under activation checkpointing (logits never exist for all tokens)"))
    head_wgrad_deferral: int | None = Field(default=None, ge=0, le=MAX_SEQUENCES, description=(
        "the output layer's weight gradient deferred to the step's end for the first n "
        "micro-batches (0: all), its input and logits' gradient kept until then "
        "(memplan.model.deferred_wgrad; Megatron-LM's --defer-embedding-wgrad-compute, "
        "--wgrad-deferral-limit n); None: computed in each backward"))
    loss_chunk_backward: ChunkBackward = ChunkBackward.RERUN
    te_grouped_gemm: bool = Field(default=False, description=(
        "the routed experts run Transformer Engine's grouped GEMM (its GroupedLinear; "
        "Megatron-LM's --moe-grouped-gemm): one cuBLAS workspace per TE compute stream, "
        "made at the first grouped GEMM and kept (memplan.overheads.with_library_workspaces)"))
    attention_global_buffer: bool = Field(default=False, description=(
        "Megatron-LM's own core attention (--transformer-impl local: megatron/core/"
        "transformer/dot_product_attention.py DotProductAttention.forward) takes its scores' "
        "baddbmm input from the global memory buffer (parallel_state."
        "get_global_memory_buffer().get_tensor(..., 'mpu')), made at the first attention and "
        "kept; its sequence-parallel linears gather into the same buffer "
        "(memplan.model.attention.global_buffer_bytes)"))
    te_gemm_workspace: bool = Field(default=False, description=(
        "Transformer Engine's modules run their GEMMs on TE's own cuBLAS workspace, made at "
        "the first TE GEMM and kept beside PyTorch's (memplan.overheads."
        "with_library_workspaces; Megatron-LM's --transformer-impl transformer_engine)"))
    te_ub_workspace: bool = Field(default=False, description=(
        "with Userbuffers' GEMM and communication overlap, TE keeps a second workspace for "
        "those GEMMs, one per overlap stream (Megatron-LM's --tp-comm-overlap)"))
    te_fp8: TeFp8Recipe = Field(default=TeFp8Recipe.NONE, description=(
        "the decoder layers' Transformer Engine linears run fp8 GEMMs with this recipe: "
        "fp8 copies of their inputs saved, fp8 weight caches kept (memplan.model.te_fp8; "
        "Megatron-LM's --fp8-format with --fp8-recipe)"))
    te_fp8_param_gather: bool = Field(default=False, description=(
        "with te_fp8: the TE linears' weights are stored in fp8 (fp8_model_init), the "
        "distributed optimizer's fp32 main copy beside them (Megatron-LM's "
        "--fp8-param-gather)"))
    te_fp8_transposes: bool | None = Field(default=None, description=(
        "with te_fp8 delayed or tensorwise: the columnwise copies are transposes of their own "
        "(Hopper's GEMMs take only TN layouts; TE's nvte_is_non_tn_fp8_gemm_supported is "
        "false below compute capability 10), else the rowwise data serves both; None: from "
        "the GPU (memplan.model.te_fp8.for_gpu)"))
    te_fp8_amax_history_len: int = Field(default=1, ge=1, le=1 << 20, description=(
        "with te_fp8 delayed: rows of each TE module's amax history (Megatron-LM's "
        "--fp8-amax-history-len, default 1)"))
    mtp_layers: int = Field(default=0, ge=0, le=MAX_LAYERS, description=(
        "multi-token prediction depths D on the last pipeline stage (memplan.model.mtp; "
        "Megatron-LM's --mtp-num-layers): per depth a layer of the decoder's last kind, two "
        "norms, a 2h -> h projection, a final norm, and the output layer's logits and loss"))

    # fine-tuning: LoRA adapters on frozen base weights (memplan.model.adapters)
    lora_rank: int = Field(default=0, ge=0, le=MAX_LORA_RANK, description="0: no adapters")
    lora_targets: tuple[str, ...] | None = Field(default=None, description=(
        "projections q,k,v,o,gate,up,down, output (lm_head: the untied head) or all-linear; "
        "None: peft's default per family"))
    lora_dropout: float = Field(default=0.0, ge=0.0, lt=1.0)
    base_quant: BaseQuant = BaseQuant.NONE
    adapters_in_model_dtype: bool = Field(default=False, description=(
        "the adapters are in the model's bf16/fp16: peft's fp32 ones cast before training "
        "(DeepSpeed's engine.py _cast_module_mixed_precision), or built in it (torchtune's "
        "LoRALinear under the recipe's set_default_dtype); adapters and their gradients in "
        "that dtype, with an fp32 master copy under a mixed precision; off: fp32 adapters "
        "updated directly (peft's autocast_adapter_dtype)"))

    @field_validator("lora_targets", mode="before")
    @classmethod
    def _targets_by_name(cls, value: object) -> object:
        if isinstance(value, str):
            value = tuple(v.strip() for v in value.split(",") if v.strip())
        if isinstance(value, (tuple, list)):
            names = (*LORA_PROJECTIONS, *LORA_HEAD, ALL_LINEAR)
            if not value or any(v not in names for v in value):
                raise ValueError(f"must name projections of "
                                 f"{','.join((*LORA_PROJECTIONS, *LORA_HEAD))} or {ALL_LINEAR}")
        return value

    @model_validator(mode="after")
    def _adapters_need_rank(self) -> Workload:
        if self.lora_rank == 0:
            for name, value, off in (("lora_targets", self.lora_targets, None),
                                     ("lora_dropout", self.lora_dropout, 0.0),
                                     ("base_quant", self.base_quant.value, "none")):
                if value != off:
                    shown_value = ",".join(value) if isinstance(value, tuple) else value
                    raise ValueError(f"{name} ({shown_value}) needs lora_rank > 0 (frozen "
                                     "base weights train through adapters), got lora_rank 0")
        return self

    @field_validator("recompute_save", mode="before")
    @classmethod
    def _save_by_name(cls, value: object) -> object:
        if isinstance(value, str):
            value = tuple(v.strip() for v in value.split(",") if v.strip())
        if isinstance(value, list):
            value = tuple(value)
        if isinstance(value, tuple):  # one order, so equal sets make one cache key
            value = tuple(sorted(set(value)))
        return value

    @model_validator(mode="after")
    def _save_needs_ops(self) -> Workload:
        if self.recompute_save and self.recompute is not Recompute.OPS:
            raise ValueError(f"recompute_save ({','.join(self.recompute_save)}) needs "
                             f"recompute ops, got recompute {self.recompute.value}")
        return self

    @field_validator("recompute", mode="before")
    @classmethod
    def _recompute_by_name(cls, value: object) -> object:
        return (Recompute.parse(value) if isinstance(value, (str, int))
                and not isinstance(value, bool) else value)

    @property
    def loss_checkpointed(self) -> bool:
        """A chunked loss whose chunks are checkpointed (``loss_chunks`` > 1); torchtune's
        chunked output and loss (``LossImpl.TORCHTUNE_CHUNKED``) checkpoints nothing."""
        return self.loss_chunks > 1 and self.loss_impl is not LossImpl.TORCHTUNE_CHUNKED

    @property
    def compute_dtype(self) -> DType:
        return self.precision.policy.compute

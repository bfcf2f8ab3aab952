"""FSDP1 (``FullyShardedDataParallel``, ``--fsdp-version 1``) as Accelerate and the Trainer wrap
a decoder: every decoder layer its own unit (``transformer_layer_cls_to_wrap``, by default the
model's ``_no_split_modules``), the root unit holding the rest (embedding, final norm, head):
what it gathers beside each block, on one rank, in bytes (torch 2.13,
torch/distributed/fsdp/; docs/fsdp1.md has the whole reading).

- One flat parameter per unit (``_flat_param.py FlatParamHandle._init_flat_param_and_metadata``):
  the unit's parameters concatenated; its shard is ``ceil(numel / world)`` elements, the last
  ranks' padded with zeros (``FlatParamHandle._get_shard``); the all-gather fills a padded
  unsharded flat parameter of ``ceil(numel / world) x world`` elements in the forward/backward
  dtype (``_full_param_padded``, made in ``FlatParamHandle._init_param_attributes``, allocated
  in ``_alloc_padded_unsharded_flat_param`` and freed by ``_free_unsharded_flat_param``).
- Under ``MixedPrecision(param_dtype=...)`` the shard is first cast into a low-precision copy
  on the device (``_mp_shard``, ``FlatParamHandle._use_low_precision_shard`` in
  ``pre_unshard``), the all-gather's input, freed once it returns (``post_unshard``): one shard
  in the compute dtype beside the unit's gather.
- Forward (``_runtime_utils.py _pre_forward_unshard``, ``_post_forward_reshard``): a unit is
  gathered in its pre-forward and freed after its forward, but the root, which is not freed
  after forward (``free_unsharded_flat_param = not state._is_root and ...``) and stays
  gathered until its post-backward after the embedding's backward. ``forward_prefetch``
  (``_prefetch_handle`` in ``_pre_forward_unshard``) gathers the next unit beside the running
  one; without it one block is gathered at a time, and at the loss only the root.
- Backward (``_pre_backward_hook``, ``_post_backward_reshard``, ``_get_handle_to_prefetch``):
  each unit is gathered again in its pre-backward; ``BACKWARD_PRE`` prefetches the next unit
  there (two blocks while a block's backward runs, the root's hook on the loss gathering the
  last block at the head), ``BACKWARD_POST`` after the unit is freed in its post-backward, no
  prefetch (Accelerate's and the Trainer's default) in each unit's own hook: one block.
"""

from __future__ import annotations

from memplan.model.adapters import ADAPTER_BYTES
from memplan.model.model_states import ShardingBuffers, StageParams
from memplan.model.trainable import ALL, TrainablePolicy
from memplan.model.sharding import DataParallel
from memplan.parallel import Offload, ParallelConfig, ZeroStage
from memplan.spec import ModelSpec
from memplan.units import ceil_div
from memplan.workload import BackwardPrefetch, BaseQuant, GradSync, Workload


def flat_units(spec: ModelSpec, par: ParallelConfig, wl: Workload) -> bool:
    """FSDP1's FULL_SHARD units are modelled: ``fsdp_version`` 1 at zero 3 over more than one
    rank (on one rank FSDP1 runs NO_SHARD, ``_init_utils.py _init_core_state``: the weights and
    gradients whole, as without FSDP), in the layout it was traced in (``unmodelled``)."""
    return (wl.fsdp_version == 1 and par.zero >= ZeroStage.PARAMETERS
            and par.dense_shard_degree > 1 and not unmodelled(spec, par, wl))


def unmodelled(spec: ModelSpec, par: ParallelConfig, wl: Workload) -> str | None:
    """What of the job FSDP1's model does not cover (None: nothing): there FSDP2's units
    stand for it, and the estimate says so (``assumptions``)."""
    return ("tp, pp, cp or ep > 1" if max(par.tp, par.pp, par.cp, par.ep) > 1
            else "offload params (CPUOffload)" if Offload.PARAMS in par.offload
            else _lora_unmodelled(par, wl) if wl.lora_rank
            else "mixture-of-experts layers" if spec.moe is not None else None)


def _lora_unmodelled(par: ParallelConfig, wl: Workload) -> str | None:
    """What of LoRA under FSDP1 is not modelled. Modelled (``_adapter_units``, traced on
    peft's wrap): the adapters' linears each a unit of their own, nested in the decoder
    layers' units, whose flat parameters then hold the frozen base weights alone. That is the
    wrap of peft's FSDP recipe (peft 0.21.2 ``utils/other.py fsdp_auto_wrap_policy``), which
    the Trainer applies to a peft model (transformers ``integrations/fsdp.py
    update_fsdp_plugin_peft``), and of torchtune's ``lora_finetune_distributed`` (torchtune
    fef3ed10 ``utils/_distributed.py lora_fsdp_wrap_policy``); with ``use_orig_params=False``
    it is the only wrap FSDP1 accepts (``_flat_param.py _init_flat_param_and_metadata``:
    "Must flatten tensors with uniform requires_grad"). Not traced: the adapters inside the
    decoder layer's flat parameter (``use_orig_params=True`` without peft's policy: the
    unit's flat gradient is then full-size, frozen weights included), a quantized base but
    bitsandbytes' NF4 stored as bf16 under bf16 weights (QLoRA, traced: ``base_elements``),
    adapters on the head, ``MixedPrecision(param_dtype=...)``, SHARD_GRAD_OP (forward prefetch is refused for FSDP1 as a whole). Accumulation under
    ``no_sync()`` is modelled as without LoRA (only the adapters' units accumulate, a few MB)
    but not traced: the estimate says so (``assumptions``); the states are built without
    the batch, so it cannot decide the units."""
    from memplan.model.adapters import BF16_BYTES
    from memplan.workload import LORA_HEAD, Precision

    quantized = wl.base_quant is not BaseQuant.NONE
    return ("LoRA with a quantized base other than nf4" if quantized
            and wl.base_quant is not BaseQuant.NF4
            else f"LoRA with an nf4 base under precision {wl.precision.value} (its bf16-stored "
                 "data flattens with bf16 weights only)" if quantized
            and wl.precision.policy.param_bytes != BF16_BYTES
            else "LoRA on the output projection" if set(LORA_HEAD) & set(wl.lora_targets or ())
            else "LoRA under MixedPrecision(param_dtype)" if wl.precision is Precision.FSDP_BF16
            else "LoRA with SHARD_GRAD_OP" if not wl.reshard_after_forward else None)


def assumptions(spec: ModelSpec, par: ParallelConfig, wl: Workload) -> tuple[str, ...]:
    """The estimate's line about FSDP1, where ``fsdp_version`` 1 shards (zero 3, dp > 1)."""
    if wl.fsdp_version != 1 or par.zero < ZeroStage.PARAMETERS or par.dense_shard_degree == 1:
        return ()
    if (why := unmodelled(spec, par, wl)) is not None:
        return (f"fsdp_version 1 with {why}: FSDP2's units stand for FSDP1's flat parameters "
                "(not modelled or traced there)",)
    if wl.lora_rank:
        accumulating = (wl.global_batch_size or 0) > wl.micro_batch_size * par.dp
        unsynced = ("; no_sync() accumulation not traced with LoRA"
                    if accumulating and wl.grad_sync is GradSync.LAST else "")
        quant = ("; the NF4 base's packed data (bf16 storage) in the decoder layers' flat "
                 "parameters, its quant_state whole on every rank"
                 if wl.base_quant is not BaseQuant.NONE else "")
        return ("FSDP1 FULL_SHARD with LoRA (memplan.model.fsdp1): each adapter linear a unit "
                "of its own (peft's fsdp_auto_wrap_policy, torchtune's lora_fsdp_wrap_policy), "
                "the decoder layers' flat parameters frozen (no gradient; resharded by a hook "
                "on their inputs' gradients, so the previous layer is gathered first), the "
                f"root holding embedding, final norm and head; backward_prefetch "
                f"{wl.backward_prefetch.value} (a prefetch gathers the previous layer from the "
                "hook of a layer's first adapter); a wrap with the adapters inside "
                "the decoder layer's flat parameter (use_orig_params=True without peft's "
                f"policy) is not modelled{quant}{unsynced}",)
    return (f"FSDP1 FULL_SHARD (memplan.model.fsdp1): a flat parameter per decoder layer, the "
            f"root unit holding embedding, final norm and head; backward_prefetch "
            f"{wl.backward_prefetch.value}; limit_all_gathers and use_orig_params change no "
            f"allocated byte modelled",)


def padded(numel: int, world: int) -> int:
    """Elements of a unit's padded unsharded flat parameter: its shard, ``ceil(numel /
    world)`` (``FlatParamHandle._get_shard``), on each of ``world`` ranks."""
    return ceil_div(numel, world) * world


def fsdp1_buffers(params: StageParams, par: ParallelConfig, wl: Workload,
                  trainable: TrainablePolicy = ALL) -> ShardingBuffers:
    """FULL_SHARD units (``--zero 3``): the root gathered from its forward to the end of
    backward; one block gathered in forward (two with ``forward_prefetch``, fewer over the
    stage's last), the root alone at the loss; in backward one block, or two with
    ``BACKWARD_PRE``; at a block's gather in forward, under parameter mixed precision, its
    low-precision shard beside it. SHARD_GRAD_OP (``reshard_after_forward`` False):
    ``_kept_units``. LoRA's adapters as units of their own: ``_adapter_units``."""
    if trainable.adapters:
        return _adapter_units(params, par, wl, trainable)
    policy, world = wl.precision.policy, par.dense_shard_degree
    e = policy.unsharded.itemsize
    layer = max(params.layers, default=0)
    layer_b = padded(layer, world) * e
    root_b = padded(params.embedding + params.head, world) * e
    many = len(params.layers) > 1
    ahead = 1 if wl.forward_prefetch and many else 0
    # the _mp_shard exists only where the gathered dtype differs from the weights'
    mp_shard = ceil_div(layer, world) * e if e != policy.param_bytes else 0
    start = root_b + (1 + ahead) * layer_b + mp_shard if mp_shard else 0
    back = 1 if wl.backward_prefetch is BackwardPrefetch.PRE and many else 0
    prefetch = wl.backward_prefetch is not BackwardPrefetch.NONE
    common = dict(flat_units=True, lazy_init_bytes=lazy_init(params, world, policy.param_bytes, e),
                  # use_orig_params: the optimizer holds the original parameters, whose
                  # gradients are views of the flat parameter's; zero_grad(set_to_none=True)
                  # drops the views, and the flat gradient lives until the next step's root
                  # pre-forward (_runtime_utils.py _reset_flat_param_grad_info_if_needed)
                  grads_to_forward=wl.use_orig_params)
    if not wl.reshard_after_forward:
        return _kept_units(params, world, e, root_b, layer_b + mp_shard, policy.grad_bytes,
                           common)
    return ShardingBuffers(
        root_b + (1 + ahead) * layer_b, root_b, params.largest_unit * policy.grad_bytes,
        backward_head_bytes=root_b + (layer_b if wl.backward_prefetch is BackwardPrefetch.PRE
                                      else 0),
        backward_block_bytes=root_b + (1 + back) * layer_b,
        backward_last_block_bytes=root_b + layer_b, backward_end_bytes=root_b,
        forward_start_bytes=start, forward_first_start_bytes=start,
        window_units=1 + ahead if ahead else 0, window_unit=layer_b if ahead else 0,
        # at a block's reduce its weights are freed; the block before it is gathered by
        # then where BACKWARD_PRE prefetched it in the pre-backward hook or BACKWARD_POST in
        # the post-backward hook, before the reduce (_post_backward_reshard)
        backward_reduce_bytes=root_b + (layer_b if prefetch and many else 0), **common)


def _adapter_units(params: StageParams, par: ParallelConfig, wl: Workload,
                   trainable: TrainablePolicy) -> ShardingBuffers:
    """LoRA, each adapter linear its own unit (``_lora_unmodelled``), traced
    (tests/traced/test_fsdp1_trace.py ``test_peft_lora_under_fsdp1``): a decoder layer's unit
    gathers its frozen base weights (the layer less its adapters); the adapters' units, a
    tensor each, are gathered while their own linear runs (the largest beside a block) and
    reduce their own gradients in their own post-backward hooks. In backward (torch 2.13
    ``_runtime_utils.py``):

    - a frozen flat parameter gets no gradient, so no post-backward hook:
      ``_register_post_backward_reshard_only_hook`` registers a multi-grad hook on the unit's
      inputs that require grad, which reshards it once their gradients are computed
      (``_post_backward_reshard_only_hook``). The input of block i is block i-1's output,
      on which block i-1's ``_pre_backward_hook`` was registered first (at its forward's
      end, ``_register_pre_backward_hooks``) and so runs first: block i-1 is gathered
      before block i is freed, the root and two blocks at a block's end beside the
      gradient of its input (``backward_reduce_bytes``);
    - without a backward prefetch (Accelerate's and the Trainer's default) each unit is
      gathered in its own ``_pre_backward_hook``: one block while a block's backward runs,
      the root alone at the loss. A prefetch (``_exec_order_utils.py
      get_handle_to_backward_prefetch``) takes the unit before in the *post-forward* order:
      before a block's first adapter (q's lora_A) the block before, gathered in that
      adapter's pre-backward hook (BACKWARD_PRE) or after its weight gradient
      (BACKWARD_POST), inside the block's input projections' backward: the block before
      beside the block's ``PREFETCH_TAIL`` moments (``prefetch_tail_bytes``); before the root
      the last block, which BACKWARD_PRE gathers at the loss; before a block an adapter;
    - the stage's first block, whose input (the frozen embedding's output) needs no grad,
      gets no hook and is freed with the root, whose inputs need none either, by the final
      callback (``_post_backward_final_callback`` -> ``_catch_all_reshard``): both gathered
      at the backward's end."""
    policy, world = wl.precision.policy, par.dense_shard_degree
    e = policy.unsharded.itemsize
    base = max(base_elements(params, trainable, e), default=0)
    layer_b = padded(base, world) * e
    root_b = padded(params.embedding + params.head, world) * e
    both = root_b + layer_b
    largest = max(trainable.adapters) * ADAPTER_BYTES
    # the largest adapter's unit, gathered while its linear runs (in the weights' fp32)
    adapter_b = padded(max(trainable.adapters), world) * ADAPTER_BYTES
    init = max(padded(max(base, params.embedding + params.head), world)
               * max(policy.param_bytes, e), adapter_b)
    many = len(params.layers) > 1
    prefetch = wl.backward_prefetch is not BackwardPrefetch.NONE and many
    head = layer_b if wl.backward_prefetch is BackwardPrefetch.PRE and many else 0
    return ShardingBuffers(
        both + adapter_b, root_b, largest, backward_head_bytes=root_b + head,
        prefetch_tail_bytes=layer_b if prefetch else 0,
        backward_block_bytes=both + adapter_b, backward_last_block_bytes=both + adapter_b,
        backward_end_bytes=both,
        backward_reduce_bytes=both + (layer_b if many else 0),
        flat_units=True, lazy_init_bytes=init, grads_to_forward=wl.use_orig_params)


def base_elements(params: StageParams, trainable: TrainablePolicy, e: int) -> list[int]:
    """Elements of each decoder layer's frozen flat parameter (the layer less its adapters):
    the unquantized weights, and a quantized weight's own data (``adapters.quant_data_bytes``)
    as elements of the unit's dtype, ``e`` bytes each: bitsandbytes' packed NF4 data stored
    as bf16 (``bnb_4bit_quant_storage=torch.bfloat16``: ``Params4bit`` of ``ceil(n / 2) / 2``
    bf16 elements), flattened with the layer's bf16 norms into one flat parameter
    (``_flat_param.py _init_flat_param_and_metadata``, one dtype per unit); the quant_state is
    no parameter and is never gathered."""
    return [n - a - q + ceil_div(data, e) for n, a, q, data in zip(
        params.layers, trainable.layer_adapters,
        trainable.layer_quantized or (0,) * len(params.layers),
        trainable.layer_quant_data_bytes or (0,) * len(params.layers))]


def _kept_units(params: StageParams, world: int, e: int, root_b: int, gather: int,
                grad_bytes: int, common: dict) -> ShardingBuffers:
    """SHARD_GRAD_OP: no unit is freed after its forward (``_post_forward_reshard``: it is
    not in ``RESHARD_AFTER_FORWARD_HANDLE_STRATEGIES``), so each block's padded flat
    parameter stays alive from its gather (``gather``: it and its low-precision shard) to its
    post-backward, which frees it before the reduce (``_should_free_in_backward`` with a
    sync); a backward prefetch finds every block gathered already. The root as with
    FULL_SHARD. Traced (tests/traced/test_fsdp1_trace.py)."""
    kept = [padded(n, world) * e for n in params.layers]
    layer_b = max(kept, default=0)
    return ShardingBuffers(
        root_b, root_b, params.largest_unit * grad_bytes,
        backward_head_bytes=root_b + sum(kept), backward_block_bytes=root_b,
        backward_last_block_bytes=root_b, backward_end_bytes=root_b,
        forward_start_bytes=root_b + gather, forward_first_start_bytes=root_b + gather,
        backward_reduce_bytes=root_b, kept_layer_bytes=layer_b, kept_layers_bytes=sum(kept),
        **common)


def lazy_init(params: StageParams, world: int, param_bytes: int, e: int) -> int:
    """The first forward's largest buffer: the root's ``_lazy_init`` runs
    ``FlatParamHandle._init_param_attributes`` on every unit, which makes each of its padded
    unsharded flat parameters with ``torch.empty`` and frees it (``_free_storage``) at once,
    one after another: in the compute dtype, and under parameter mixed precision also in the
    weights' own (``_full_prec_full_param_padded``); the largest unit's, alone."""
    unit = padded(max(*params.layers, params.embedding + params.head, 0), world)
    return unit * max(param_bytes, e)


def last_reduce(dp: DataParallel, unit_grad_bytes: int, wl: Workload) -> tuple[int, int, int]:
    """The reduce of a unit's accumulated gradient in the last micro-batch after unsynced ones
    (``unit_grad_bytes``: the largest unit's unsharded gradient in the reduce dtype): (the
    bytes made beside the accumulators at the reduce, the output shard, the accumulator bytes
    the reduce drops). FSDP2 (``memplan.model.grad_sync``): its reduce-scatter input in the
    reduce dtype, which replaces the accumulator. FSDP1 (``flat``): ``_reduce_grad`` copies
    the accumulator into the reduce dtype where that differs from the gathered weights' (the
    accumulator is the reduce-scatter input itself otherwise) and makes the output shard; it
    sets ``flat_param.grad = None``, so the accumulator is freed when it returns. The hook runs
    as a post-hook of the flat parameter's ``AccumulateGrad`` node
    (``_register_post_backward_hook``: ``acc_grad.register_hook``), whose incoming gradient,
    added into the accumulator, is still referenced: the unit's new flat gradient too."""
    output_shard = dp.shard_of(unit_grad_bytes)
    if not dp.flat:
        return unit_grad_bytes, output_shard, 0
    policy = wl.precision.policy
    e = policy.unsharded.itemsize
    copy = unit_grad_bytes if e != policy.grad_bytes else 0
    accumulator = unit_grad_bytes * e // policy.grad_bytes
    return copy + output_shard + accumulator, output_shard, accumulator

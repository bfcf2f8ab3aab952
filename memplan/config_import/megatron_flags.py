"""Megatron-LM flags whose memory memplan reads from megatron-core's source beside the
rest of ``memplan.config_import.megatron``'s reading: multi-token prediction
(``Workload.mtp_layers``), Megatron FSDP's sharding strategies (no_shard read, the others
refused) and the deferred output-layer weight gradient (``Workload.head_wgrad_deferral``). Each takes the
reader of ``memplan.config_import.megatron`` (``r``), whose typed access marks a flag read.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from memplan.config_import.megatron import _Reader


def mtp(r: _Reader) -> None:
    """--mtp-num-layers D as ``Workload.mtp_layers`` (``memplan.model.mtp``, read from
    megatron/core/transformer/multi_token_prediction.py and models/gpt/gpt_model.py
    ``GPTModel.__init__`` and ``_postprocess``): all D modules on the last pipeline stage
    (``mtp_on_this_rank`` without a custom layout), each a transformer layer of the decoder's
    last layer's spec, enorm/hnorm, a 2h -> h ``eh_proj`` and a final norm, with the stage's
    copy of the embedding, the concatenated (1 + D) x [s, b, h] hidden states and one set of
    logits and one loss per depth. --mtp-loss-scaling-factor only scales the losses'
    gradient (no memory). A custom --pipeline-model-parallel-layout is read by
    ``memplan.config_import.megatron_layout``, which accepts its ``m`` only in the last
    stage."""
    depth = r.int("--mtp-num-layers", None)
    r.float("--mtp-loss-scaling-factor", 0.1)  # a scale of the loss: no tensor
    if not depth:
        return
    r.imp.set("--mtp-num-layers", depth, "mtp_layers", depth,
              f"{depth} multi-token prediction depth(s) on the last stage: a layer, norms, "
              "eh_proj, the embedding's copy, and one more set of logits and loss each")


# Megatron FSDP's sharding strategies memplan models: the ZeRO stage and what it shards
# (param_and_grad_buffer.py ParamAndGradBuffer._init_each_parameter_group_buffers); "optim"
# is refused by name (``_refuse_optim``)
_SHARDED = {"optim_grads": (2, "gradients and fp32 main weights sharded, weights whole"),
            "optim_grads_params": (3, "weights, gradients and fp32 main weights sharded")}
# --megatron-fsdp-*-dtype values as memplan's dtype names (arguments.py map_dtype; "auto":
# megatron_fsdp/mixed_precision.py MixedPrecisionPolicy leaves the dtype to the weights')
_DTYPES = {"fp32": "fp32", "bf16": "bf16", "fp16": "fp16"}


def megatron_fsdp(r: _Reader) -> bool:
    """--use-megatron-fsdp with --data-parallel-sharding-strategy (default
    optim_grads_params at the commit this reader follows, Megatron-LM 93ebf8d). Returns
    whether it was read (it then sets the ZeRO stage itself).

    no_shard (param_and_grad_buffer.py ParamAndGradBuffer._init_each_parameter_group_
    buffers) builds no model-weight buffer (the module's own weights), a whole fp32
    main-weight buffer that the optimizer updates with whole states (update_main_grads: no
    shard), and a whole gradient buffer; GradReducePipeline._bucket_group_gradient_reduce
    all-reduces it in place on the last micro-batch, after megatron_fsdp.py _grad_acc added
    each weight's gradient in: Megatron's DDP without the distributed optimizer (--zero 0).

    optim_grads_params (--zero 3) and optim_grads (--zero 2) shard the fp32 main weights
    and the main gradients (and the weights under optim_grads_params) with temporary
    buckets per transformer layer: ``FsdpUnits.BUCKETS`` (memplan.model.fsdp_buckets). The
    main gradients' dtype is ``_bucket_dtypes``'s (``fsdp_main_grads`` for ``_precision``):
    fp32 under --bf16 as Megatron-LM launches it, else --megatron-fsdp-main-grads-dtype;
    with bf16 ones update_main_grads hands the optimizer an fp32 copy of the shard (the
    step's temporary memplan counts for bf16 gradients with an fp32 master)."""
    flag = "--use-megatron-fsdp"
    strategy = r.str("--data-parallel-sharding-strategy", "optim_grads_params")
    if not r.flag(flag):
        r.used.discard("--data-parallel-sharding-strategy")  # without it: not read
        return False
    key = f"{flag} --data-parallel-sharding-strategy"
    if strategy in _SHARDED:
        zero, what = _SHARDED[strategy]
        r.fsdp_main_grads = _bucket_dtypes(r)
        r.imp.set(key, strategy, "zero", zero, what)
        r.imp.set(key, strategy, "fsdp_units", "buckets",
                  "each transformer layer a unit of temporary buckets: weights gathered ahead "
                  "(a window of 5e8 elements), gradient buckets queued up to 1e9 elements "
                  "(megatron_fsdp.py _init_fsdp_param_and_grad_buffer)")
        return True
    if strategy != "no_shard":
        raise r.imp.refuse(key, strategy, _refuse_optim(strategy))
    for dtype_flag in ("--megatron-fsdp-main-params-dtype", "--megatron-fsdp-main-grads-dtype",
                       "--megatron-fsdp-grad-comm-dtype"):
        if dtype_flag in r.args:
            r.used.add(dtype_flag)
            raise r.refuse(dtype_flag, "with no_shard Megatron FSDP's own buffer dtypes are "
                                       "not modelled")
    if r.flag("--grad-reduce-in-bf16") or r.str("--main-grads-dtype", "fp32") != "fp32":
        raise r.refuse(flag, "with bf16 main gradients update_main_grads makes an fp32 copy "
                             "of every gradient for the optimizer, which is not modelled")
    sharded = "; --use-distributed-optimizer shards nothing under no_shard" if r.args.get(
        "--use-distributed-optimizer") else ""
    r.imp.set(key, "no_shard", "zero", 0,
              "whole weights, fp32 main weights, gradients and optimizer states (Megatron "
              f"FSDP no_shard's buffers, as Megatron's DDP{sharded})")
    return True


def _refuse_optim(strategy: str) -> str:
    if strategy == "optim":
        return ("reduce-scatters each bucket group into a new gradient shard beside whole "
                "gradient buffers (_bucket_group_gradient_reduce), which is not modelled")
    return "not a strategy of Megatron FSDP"


def _bucket_dtypes(r: _Reader) -> str | None:
    """The main gradients' dtype the sharded strategies hold (None: the weights'), from
    --megatron-fsdp-main-params-dtype (fp32 modelled), --megatron-fsdp-main-grads-dtype and
    --megatron-fsdp-grad-comm-dtype (the buckets' dtype: modelled where it is the main
    gradients').

    Megatron-LM's get_model hands DDP's config grad_reduce_in_fp32 =
    accumulate_allreduce_grads_in_fp32, which validate_args (arguments.py) turns on with
    --bf16 unless --grad-reduce-in-bf16 or --main-grads-dtype bf16. Under it megatron-core
    0.16.1's Megatron-FSDP keeps fp32 main gradients: megatron_fsdp.py
    MegatronFSDP._init_fsdp_param_and_grad_buffer passes it to ParamAndGradBuffer, whose
    _init_each_parameter_group_buffers makes each group's main-gradient buffer
    torch.float32, and the whole buckets _grad_acc fills (main_grad_getter: fetch_bucket in
    the buffer's dtype) fp32 too. Megatron-LM's own Megatron-FSDP adapter kept that over the
    --megatron-fsdp-*-dtype flags from their start (b969f76, 2026-03-02) to adfe9e1
    (2026-07-02): mcore_fsdp_adapter.py FullyShardedDataParallel.__init__ sets
    MixedPrecisionPolicy's main_grads_dtype and grad_comm_dtype to fp32 when
    grad_reduce_in_fp32 (the functional tests' golden values of febd25e ran it); from
    adfe9e1 on the flags decide ("auto": the weights' dtype). memplan follows 0.16.1."""
    params = r.str("--megatron-fsdp-main-params-dtype", "fp32")
    if params != "fp32":
        raise r.refuse("--megatron-fsdp-main-params-dtype",
                       "main weights other than fp32 are not modelled")
    grads = _DTYPES.get(r.str("--megatron-fsdp-main-grads-dtype", "auto"))
    comm = _DTYPES.get(r.str("--megatron-fsdp-grad-comm-dtype", "auto"))
    if _grad_reduce_in_fp32(r):
        r.imp.notes.append(
            "--bf16 accumulates and reduces gradients in fp32 (grad_reduce_in_fp32): Megatron "
            "FSDP's main gradient shards and gradient buckets in fp32 (megatron-core 0.16.1 "
            "param_and_grad_buffer.py ParamAndGradBuffer; --megatron-fsdp-main-grads-dtype "
            f"{grads or 'auto'} and --megatron-fsdp-grad-comm-dtype {comm or 'auto'} decide "
            "only without it, or in Megatron-LM from adfe9e1)")
        return "fp32"
    if r.flag("--grad-reduce-in-bf16"):  # validate_args: the communication dtype bf16
        comm = "bf16"
    weights = "bf16" if r.flag("--bf16") else "fp16" if r.flag("--fp16") else "fp32"
    if comm is not None and comm != (grads or weights):
        raise r.refuse("--megatron-fsdp-grad-comm-dtype",
                       "a communication dtype other than the main gradients' adds a bucket "
                       "of its own, which is not modelled")
    if grads == "fp16":
        raise r.refuse("--megatron-fsdp-main-grads-dtype", "fp16 is not modelled")
    r.imp.notes.append(f"--megatron-fsdp-main-grads-dtype = {grads or 'auto'}: main gradient "
                       f"shards and gradient buckets in {grads or 'the weights dtype'}")
    return grads


def _grad_reduce_in_fp32(r: _Reader) -> bool:
    """Megatron-LM's accumulate_allreduce_grads_in_fp32 (validate_args): with --bf16, unless
    --grad-reduce-in-bf16 or --main-grads-dtype bf16 (--fp16 with
    --accumulate-allreduce-grads-in-fp32 is refused by ``_precision``)."""
    return (r.flag("--bf16") and not r.flag("--grad-reduce-in-bf16")
            and r.str("--main-grads-dtype", "fp32") == "fp32")


def deferred_wgrad(r: _Reader, pp: int) -> None:
    """--defer-embedding-wgrad-compute with --wgrad-deferral-limit N (0: every
    micro-batch): the output layer's input and its logits' gradient kept per micro-batch
    until the step's end, where the weight gradients are computed (tensor_parallel/
    layers.py ColumnParallelLinear.forward ``embedding_activation_buffer``, Linear
    WithGradAccumulationAndAsyncCommunication.backward ``grad_output_buffer``, utils.py
    drain_embedding_wgrad_compute): ``head_wgrad_deferral`` (memplan.model.
    deferred_wgrad). megatron-core's ModelParallelConfig.__post_init__ raises without
    pipeline parallelism, without gradient-accumulation fusion and for a limit below 0."""
    flag = "--defer-embedding-wgrad-compute"
    limit = r.int("--wgrad-deferral-limit", 0)
    if not r.flag(flag):
        return
    if pp == 1:
        raise r.refuse(flag, "needs pipeline parallelism (megatron-core raises without it)")
    if r.flag("--no-gradient-accumulation-fusion"):
        raise r.refuse(flag, "needs gradient-accumulation fusion (megatron-core raises with "
                             "--no-gradient-accumulation-fusion)")
    if limit < 0:
        raise r.refuse("--wgrad-deferral-limit", "must be at least 0")
    which = "(all of them)" if limit == 0 else f"(the first {limit})"
    r.imp.set(flag if limit == 0 else f"{flag} --wgrad-deferral-limit",
              True if limit == 0 else limit, "head_wgrad_deferral", limit,
              f"the output layer's input and logits' gradient kept per micro-batch {which} to "
              "the step's end")


# --fp8-recipe's values (megatron/core/transformer/transformer_config.py fp8_recipe) as
# memplan's te_fp8 (megatron/core/fp8_utils.py get_fp8_recipe: TEDelayedScaling,
# Float8CurrentScaling, MXFP8BlockScaling, Float8BlockScaling); "custom" is refused
_FP8_RECIPES = {"delayed": "delayed", "tensorwise": "tensorwise", "mxfp8": "mxfp8",
                "blockwise": "blockwise"}
# fp8 settings memplan does not model, each refused by name
_FP8_REFUSED = {
    "--no-fp8-wgrad": "the weight gradient in high precision (fp8_wgrad False: TE saves "
                      "high-precision inputs) is not modelled",
    "--first-last-layers-bf16": "layers kept in bf16 beside fp8 ones are not modelled",
    "--fp8-dot-product-attention": "fp8 attention is not modelled",
    "--fp8-multi-head-attention": "fp8 attention is not modelled",
    "--disable-parameter-transpose-cache": "fp8 weights cast in every micro-batch (no "
                                           "cached transpose) are not modelled",
    "--fp8-output-proj": "an fp8 output layer is not modelled",
}


def fp8(r: _Reader) -> None:
    """--fp8-format (e4m3 or hybrid: one byte an element either way) with --fp8-recipe
    (Megatron's default delayed) as ``te_fp8``: the decoder layers' TE modules run fp8
    GEMMs (``memplan.model.te_fp8``, read from Transformer Engine v2.9); --fp8-param-gather
    as ``te_fp8_param_gather`` (fp8_model_init: the weights stored in fp8, the distributed
    optimizer's fp32 main copy and the all-gather in fp8, in the DDP parameter buffer:
    megatron/core/distributed/param_and_grad_buffer.py, ``param_dtype`` torch.uint8);
    --fp8-amax-history-len as ``te_fp8_amax_history_len``. --fp8-margin,
    --fp8-amax-compute-algo and --fp8-interval change how a scale is computed, not what is
    held."""
    fmt = r.str("--fp8-format", None)
    recipe = r.str("--fp8-recipe", "delayed")
    gather = r.flag("--fp8-param-gather")
    history = r.int("--fp8-amax-history-len", 1)
    for flag in ("--fp8-margin", "--fp8-interval"):
        r.int(flag, 0)
    r.str("--fp8-amax-compute-algo", "most_recent")
    if fmt is None:
        for flag in ("--fp8-param-gather", "--fp8-recipe", "--fp8-amax-history-len"):
            if r.has(flag):
                raise r.refuse(flag, "needs --fp8-format (fp8 training is off without it)")
        return
    if fmt not in ("e4m3", "hybrid"):
        raise r.refuse("--fp8-format", "expected e4m3 or hybrid")
    if recipe not in _FP8_RECIPES:
        raise r.refuse("--fp8-recipe", f"modelled are {', '.join(_FP8_RECIPES)}")
    if r.str("--transformer-impl", "transformer_engine") != "transformer_engine":
        raise r.refuse("--fp8-format", "fp8 training runs Transformer Engine's layers "
                                       "(--transformer-impl transformer_engine)")
    if not 0 < history <= 1 << 20:
        raise r.refuse("--fp8-amax-history-len", "expected 1 to 1048576 rows")
    if gather and not (r.has("--use-distributed-optimizer") or r.has("--use-megatron-fsdp")
                       or r.has("--use-torch-fsdp2")):
        # megatron/training/arguments.py validate_args asserts it
        raise r.refuse("--fp8-param-gather", "needs --use-distributed-optimizer (or Megatron "
                                             "FSDP), as Megatron-LM asserts")
    for flag, why in _FP8_REFUSED.items():
        if r.flag(flag):
            raise r.refuse(flag, why)
    r.imp.set("--fp8-format/--fp8-recipe", f"{fmt}/{recipe}", "te_fp8", _FP8_RECIPES[recipe],
              "Transformer Engine fp8 GEMMs: fp8 copies of the TE modules' inputs saved, "
              "their weights' fp8 copies cached (memplan.model.te_fp8)")
    if recipe == "delayed":
        r.imp.set("--fp8-amax-history-len", history, "te_fp8_amax_history_len", history,
                  "rows of each TE module's amax history")
    if gather:
        r.imp.set("--fp8-param-gather", True, "te_fp8_param_gather", True,
                  "TE weights stored in fp8 (one byte an element), gathered in fp8")

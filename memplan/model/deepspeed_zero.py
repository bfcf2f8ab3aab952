"""DeepSpeed's ZeRO optimizer (``DeepSpeedZeroOptimizer``, stages 1 and 2): the buffers it holds
beside the model states on one rank, in bytes, and DeepSpeed's own model-state estimators.

Read in DeepSpeed 0.19.8, ``deepspeed/runtime/zero/stage_1_and_2.py`` (``docs/deepspeed.md``
lists what each piece holds, with the function):

- ``setup_buckets`` (from the first gradient hook of a backward, ``process_gradients``) allocates
  the reduce bucket, ``torch.empty(reduce_bucket_size)`` in the gradients' dtype, whole, and a
  second one with ``overlap_comm`` (double buffering); ``_release_ipg_buffers`` (the backward's
  epilogue, ``independent_gradient_partition_epilogue``) drops them. Only with
  ``contiguous_gradients`` (its default): without it no bucket is preallocated.
- ``step``: ``flatten(self.averaged_gradients[i])`` makes a new flat copy of the rank's gradient
  partition (the gradients' dtype) while the partition (``grads_in_partition``, views of it in
  ``averaged_gradients``) is alive; ``.to(fp32)`` makes the fp32 gradient the optimizer reads
  (``single_partition_of_fp32_groups[i].grad``), then the flat copy and the partition are freed
  and the optimizer steps (FusedAdam's ``multi_tensor_apply``: no temporaries beyond its states).
  The fp32 gradient is one fp32 tensor of a 1/N partition: the 3.14 GiB request of the 8-GPU
  ZeRO-2 out-of-memory report is one of them (a 6.7B model: 6.7e9 / 8 x 4 B = 3.14 GiB).

The estimators (``estimate_zero2_model_states_mem_needs`` in stage_1_and_2.py,
``estimate_zero3_model_states_mem_needs`` in stage3.py) are reproduced as written: what they
count and what they leave out is their own (no buckets, no activations, no step transients).
"""

from __future__ import annotations

from typing import Any, NamedTuple

# DeepSpeedZeroConfig defaults (deepspeed/runtime/zero/config.py, 0.19.8): reduce_bucket_size
# and allgather_bucket_size 5e8 elements, contiguous_gradients True, overlap_comm None ->
# True for stage 3 only (overlap_comm_valid)
REDUCE_BUCKET_SIZE = 500_000_000
ALLGATHER_BUCKET_SIZE = 500_000_000
# the estimators' default additional_buffer_factor
ADDITIONAL_BUFFER_FACTOR = 1.5


def bucket_buffers(contiguous_gradients: bool, overlap_comm: bool) -> int:
    """Reduce buckets a backward allocates (``setup_buckets``): none without contiguous
    gradients, two with ``overlap_comm`` (``buf_1``), else one."""
    if not contiguous_gradients:
        return 0
    return 2 if overlap_comm else 1


def bucket_bytes(numel: int, buffers: int, grad_bytes: int) -> int:
    """Bytes of the reduce buckets: ``buffers`` of ``numel`` elements of ``grad_bytes`` each
    (``_gradient_reduction_buffer_dtype``: the gradients' dtype without a separate fp32
    accumulation dtype)."""
    return numel * buffers * grad_bytes


def step_flat_copy_bytes(partition_numel: int, grad_bytes: int) -> int:
    """The step's flat copy of the rank's gradient partition (``flatten(averaged_gradients)``),
    in the gradients' dtype, alive with the partition and its fp32 copy."""
    return partition_numel * grad_bytes


def first_reduce(head: int, layers: tuple[int, ...], embedding: int, bucket_numel: int) -> int:
    """Where in backward the last rank's gradient partition is allocated, whole: the first
    bucket reduce (``reduce_independent_p_g_buckets_and_remove_grads``: a gradient that does
    not fit reduces the bucket first; ``reduce_ipg_grads`` -> ``copy_grads_in_partition``
    allocates ``grads_in_partition``, the rank's whole partition, at the first of its
    parameters reduced). The last rank owns the flat buffer's tail (the head, the last
    layers), whose gradients come first, so its partition is the earliest. Gradients come
    in backward order: the head (its projection, then the final norm), the layers last to
    first, the embedding. Returns -1 for the head's backward, i (0 = the last layer) for the
    i-th layer in backward, len(layers) for the embedding's, len(layers) + 1 when everything
    fits in one bucket (the backward's epilogue reduces it). ``head``, ``layers`` and
    ``embedding`` in elements; a unit is counted from its start where the crossing falls
    inside it."""
    done = 0
    for index, numel in ((-1, head), *enumerate(reversed(layers)), (len(layers), embedding)):
        # (a first gradient larger than the bucket waits alone for the next one's hook:
        # inside the same unit, each has more than one tensor)
        if numel and done + numel > bucket_numel:
            return index
        done += numel
    return len(layers) + 1


def weight_grads_at(fresh: tuple[int, ...], bucket_numel: int, grad_bytes: int) -> tuple[int, ...]:
    """Unsharded weight gradients alive at each of a layer's backward moments (``fresh``: the
    elements of the weight whose gradient was just made there, 0 where none was): a gradient
    exists at its own moment, until its hook copies it into the bucket; one larger than the
    bucket is not copied (``reduce_independent_p_g_buckets_and_remove_grads``:
    ``extra_large_param_to_reduce``) and stays until the next weight's hook reduces it, so
    it is alive at the moments between, the next weight's included."""
    out, carried = [], 0
    for numel in fresh:
        out.append((numel + carried) * grad_bytes)
        if numel:
            carried = numel if numel > bucket_numel else 0
    return tuple(out)


class EstimatorBytes(NamedTuple):
    """What a DeepSpeed estimator returns, int bytes: CPU, GPU per rank (and for ZeRO-3 the
    largest layer's 4 B/param term)."""

    cpu_bytes: int
    gpu_bytes: int
    largest_layer_bytes: int = 0


def estimate_zero2(total_params: int, num_gpus_per_node: int = 1, num_nodes: int = 1,
                   cpu_offload: bool = True,
                   additional_buffer_factor: float = ADDITIONAL_BUFFER_FACTOR) -> EstimatorBytes:
    """``estimate_zero2_model_states_mem_needs`` (stage_1_and_2.py) as written: GPU 2P with
    offload, else 2P + int(18P / N) ("2 = params_16bit, 18 = 2_grads_16bit + 4_grads_32bit +
    4_params_32bit + 8_optimizer_states_32bit"); CPU P x max(4N, 16) x factor with offload, else
    P x 4 x gpus per node x factor; both truncated by int()."""
    total_gpus = num_nodes * num_gpus_per_node
    if cpu_offload:
        gpu = 2 * total_params
        cpu = total_params * max(4 * total_gpus, 16) * additional_buffer_factor
    else:
        gpu = 2 * total_params + int(18 * total_params / total_gpus)
        cpu = total_params * 4 * num_gpus_per_node * additional_buffer_factor
    return EstimatorBytes(int(cpu), int(gpu))


def estimate_zero3(total_params: int, largest_layer_params: int, num_gpus_per_node: int = 1,
                   num_nodes: int = 1, cpu_offload: bool = True, cpu_offload_params: bool = True,
                   zero_init: bool = True,
                   additional_buffer_factor: float = ADDITIONAL_BUFFER_FACTOR) -> EstimatorBytes:
    """``estimate_zero3_model_states_mem_needs`` (stage3.py) as written. ``largest_layer_params``
    is its ``model_to_params``'s: the most parameters one module holds itself
    (``parameters(recurse=False)``), e.g. the embedding or the output projection, not a
    decoder layer."""
    total_gpus = num_nodes * num_gpus_per_node
    gpus_factor = 1 / num_nodes
    largest = 4 * largest_layer_params
    f = additional_buffer_factor
    if cpu_offload and cpu_offload_params:
        gpu = largest
        cpu = total_params * (18 * gpus_factor if zero_init
                              else max(4 * num_gpus_per_node, 18 * gpus_factor)) * f
    elif cpu_offload:
        gpu = largest + int(2 * total_params / total_gpus)
        cpu = total_params * (16 * gpus_factor if zero_init
                              else max(4 * num_gpus_per_node, 16 * gpus_factor)) * f
    else:
        gpu = largest + int(18 * total_params / total_gpus)
        cpu = (largest_layer_params if zero_init else total_params) * 4 * num_gpus_per_node * f
    return EstimatorBytes(int(cpu), int(gpu), largest)


# --- ZeRO stage 3 (runtime/zero/stage3.py DeepSpeedZeroOptimizer_Stage3) -------------------

# DeepSpeedZeroConfig defaults (runtime/zero/config.py, 0.19.8): sub_group_size 1e9 elements,
# stage3_param_persistence_threshold 1e5 elements
SUB_GROUP_SIZE = 1_000_000_000
PARAM_PERSISTENCE_THRESHOLD = 100_000


def partition_numel(numel: int, dp: int) -> int:
    """One parameter's partition on each rank (partition_parameters.py ``_aligned_size``: the
    parameter padded to a multiple of the ranks, ``partition_size = tensor_size // world``)."""
    return -(-numel // dp)


def sub_groups(partitions: tuple[int, ...], sub_group_size: int = SUB_GROUP_SIZE
               ) -> tuple[int, ...]:
    """Elements of each optimizer sub-group (stage3.py ``_create_fp16_sub_groups``): the
    parameters' partitions in the group's order, a sub-group closed once it reaches
    ``sub_group_size``; one sub-group when the whole group is no larger."""
    if sub_group_size >= sum(partitions):
        return (sum(partitions),)
    out, size = [], 0
    for i, numel in enumerate(partitions):
        size += numel
        if size >= sub_group_size or i == len(partitions) - 1:
            out.append(size)
            size = 0
    return tuple(out)


class Zero3States(NamedTuple):
    """What a ZeRO-3 rank holds from ``deepspeed.initialize`` on, int bytes, fp32 master weights
    and Adam (stage3.py ``DeepSpeedZeroOptimizer_Stage3``):

    - ``weights``: its bit16 partitions (``lp_param_buffer``, each parameter's ``ds_tensor`` a
      view), plus ``persistent`` (parameters of at most stage3_param_persistence_threshold
      elements stay gathered whole, parameter_offload.py ``persistent_parameters``);
    - ``gradients``: ``grad_partitions_flat_buffer`` (``_setup_for_real_optimizer``:
      torch.zeros of the partitions' elements, the gradient accumulation dtype, the model's
      unless data_types.grad_accum_dtype), kept: the epilogue's partitions are views of it;
    - ``bucket``: the reduce bucket (``_setup_for_real_optimizer``: torch.empty(
      reduce_bucket_size) per communication dtype, with contiguous_gradients), kept;
    - ``master``: the fp32 partitions, one flat tensor per sub-group (``_create_fp32_partitions``);
    - ``states``: exp_avg and exp_avg_sq on them, made at the first step."""

    weights: int
    persistent: int
    gradients: int
    bucket: int
    master: int
    states: int


def zero3_states(partitions: tuple[int, ...], persistent_numel: int, bucket_numel: int,
                 weight_bytes: int, grad_bytes: int, contiguous: bool = True) -> Zero3States:
    """``Zero3States`` of a rank whose parameters have the partitions ``partitions`` (elements,
    ``partition_numel``); ``persistent_numel``: the elements of the persistent parameters."""
    numel = sum(partitions)
    return Zero3States(weights=numel * weight_bytes, persistent=persistent_numel * weight_bytes,
                       gradients=numel * grad_bytes,
                       bucket=bucket_numel * weight_bytes if contiguous else 0,
                       master=numel * 4, states=numel * 8)


class Zero3Gathers(NamedTuple):
    """Weights the parameter coordinator holds gathered (whole) beside the module running,
    bytes, with no prefetch, no reuse and no persistent parameter."""

    in_layer: int  # the largest module of a decoder layer (forward and backward)
    head: int  # the output projection, at its forward and backward
    embedding: int  # the embedding, at its forward and backward


def zero3_gathers(tensor_sizes: tuple[int, ...], embedding_tensors: int, head_tensors: int,
                  weight_bytes: int) -> Zero3Gathers:
    """``Zero3Gathers`` of a model whose parameters are ``tensor_sizes`` (elements, in
    registration order: the embedding's ``embedding_tensors`` first, the final norm's and the
    head's ``head_tensors`` last). ``partitioned_param_coordinator.py fetch_sub_module``
    gathers a module's own parameters (``parameters(recurse=False)``: each ``nn.Linear``,
    norm and the embedding apart, one weight each in a Llama) before it runs, forward and
    backward, and ``release_sub_module`` frees them after it (``stage3_max_reuse_distance``
    0, ``stage3_prefetch_bucket_size`` 0, ``stage3_param_persistence_threshold`` 0; the
    coordinator's behaviour on the first step, which records the module trace)."""
    inner = tensor_sizes[embedding_tensors:len(tensor_sizes) - head_tensors]
    head = tensor_sizes[-1] if head_tensors else 0
    embedding = max(tensor_sizes[:embedding_tensors], default=0)
    return Zero3Gathers(in_layer=max(inner, default=0) * weight_bytes,
                        head=head * weight_bytes, embedding=embedding * weight_bytes)


def zero3_step_bytes(groups: tuple[int, ...], grad_bytes: int, first: bool) -> int:
    """The Adam states and the step's temporaries at the step's peak, bytes (stage3.py
    ``step``, one sub-group at a time): ``_prepare_fp32_grad_for_sub_group`` makes
    ``flatten(averaged_gradients)`` (the gradient dtype) and its ``.to(fp32)`` together, the
    flat copy then dropped; the wrapped optimizer steps; ``_release_sub_group`` drops the fp32
    gradient. From the second step on every sub-group's states are there; at the first the
    sub-group's exp_avg and exp_avg_sq are made beside its fp32 gradient, those of the
    sub-groups before it already made."""
    if not first:
        return 8 * sum(groups) + (grad_bytes + 4) * max(groups)
    most, made = 0, 0
    for g in groups:
        most = max(most, made + max((grad_bytes + 4) * g, (4 + 8) * g))
        made += 8 * g
    return most


# --- ZeRO stage 1 (stage_1_and_2.py with partition_grads False) -------------------------------

def stage1_reduce_bytes(numels: tuple[int, ...], bucket_numel: int, dp: int, rank: int,
                        grad_bytes: int) -> int:
    """Gradient bytes (whole gradients, the bucket and the rank's gradient partition) at the
    moment stage 1 makes the partition of ``rank``, after backward: ``engine.backward`` ->
    ``allreduce_gradients`` -> ``reduce_gradients`` walks the parameters in forward order
    (``numels``, the flat buffer's order), copying each whole gradient into the bucket (its own
    storage dropped, ``.grad`` a view of the bucket) and reducing the bucket when the next one
    does not fit (``reduce_independent_p_g_buckets_and_remove_grads``); the reduce that holds
    the rank's first parameter allocates ``grads_in_partition`` (``copy_grads_in_partition``:
    the elements of every parameter overlapping the partition, of the flat buffer padded to
    2 x ``dp`` elements). The gradients not yet moved are alive then; later reduces only drop
    more. The first rank's partition is made at the first reduce, the most loaded."""
    total = sum(numels)
    size = -(-total // (2 * dp)) * 2  # the padded flat buffer's 1/dp
    lo, hi = rank * size, (rank + 1) * size
    spans, start = [], 0
    for n in numels:
        spans.append((start, n))
        start += n
    part = sum(n for s, n in spans if s < hi and s + n > lo)
    moved, bucket = 0, []
    for s, n in [*spans, (total, 0)]:  # the last: the epilogue's reduce of what is left
        if bucket and (n == 0 or sum(b[1] for b in bucket) + n > bucket_numel):
            if any(b0 < hi and b0 + b1 > lo for b0, b1 in bucket):
                break
            bucket = []
        bucket.append((s, n))
        moved += n
    return (total - moved + bucket_numel + part) * grad_bytes


# per element of the rank's slice of a gradient at a ZeRO-Offload reduce (stage_1_and_2.py
# copy_grads_in_partition with cpu_offload): set_norm_for_param_grad_in_gpu's fp64 copy
# (runtime/zero/utils.py get_norm_dtype: fp64 where the device has it), freed after its norm;
# async_inplace_copy_grad_to_fp32_buffer_from_gpu's fp32 copy (4 B) comes after it
OFFLOAD_NORM_COPY_BYTES = 8


def stage1_offload_reduce_bytes(numels: tuple[int, ...], bucket_numel: int, dp: int,
                                rank: int, grad_bytes: int) -> int:
    """Device bytes (whole gradients, the bucket, the reduce's copies) at the most loaded
    moment of ZeRO-1's reduce after backward with ``offload_optimizer`` cpu, for ``rank``
    (stage_1_and_2.py, DeepSpeed 0.19.8). ``reduce_gradients`` walks the parameters in
    forward order (``numels``, the flat buffer's order) as ``stage1_reduce_bytes`` does, but
    no partition is made on the device: ``reduce_ipg_grads`` -> ``copy_grads_in_partition``
    takes the ``cpu_offload`` path for each of the bucket's parameters overlapping the
    rank's partition, one at a time: an fp64 copy of its slice for the norm
    (``set_norm_for_param_grad_in_gpu``), then an fp32 one copied to the host
    (``async_inplace_copy_grad_to_fp32_buffer_from_gpu``), which then drops the gradient
    (``clear_grad_attribute``). At each reduce: the gradients not yet moved into the bucket,
    the bucket, and ``OFFLOAD_NORM_COPY_BYTES`` per element of the largest such slice.

    A gradient larger than the bucket is not copied into it
    (``reduce_independent_p_g_buckets_and_remove_grads``): with offload it is first cloned
    (``_offload_gradient_safety_enabled``: ``grad_reduc.detach().clone()``, both alive at
    that moment), reduced alone at the next parameter's call, and freed there if the rank
    owns part of it (``clear_grad_attribute``), else kept to the epilogue
    (``_clear_param_grad_only``). The reduce's own flattened copies
    (``allreduce_no_retain`` -> ``allreduce_bucket``: one contiguous run per destination
    rank, a view) are not counted."""
    total = sum(numels)
    size = -(-total // (2 * dp)) * 2  # the padded flat buffer's 1/dp
    lo, hi = rank * size, (rank + 1) * size
    alive = total  # whole gradients not yet moved (or freed)
    most = 0
    bucket: list[tuple[int, int]] = []  # (start, numel) of the bucket's parameters
    elements, start = 0, 0

    def own(s: int, n: int) -> int:
        return max(0, min(s + n, hi) - max(s, lo))

    def reduce() -> int:
        """The reduce of ``bucket``: its moment's bytes; frees an owned oversized gradient."""
        nonlocal alive
        slice_ = max((own(s, n) for s, n in bucket), default=0)
        moment = (alive + bucket_numel) * grad_bytes + OFFLOAD_NORM_COPY_BYTES * slice_
        for s, n in bucket:
            if n > bucket_numel and own(s, n):
                alive -= n
        return moment

    for n in (*numels, None):  # None: the epilogue's reduce of what is left
        if n is None or (elements + n > bucket_numel):
            if bucket:
                most = max(most, reduce())
            bucket, elements = [], 0
        if n is None:
            break
        if n > bucket_numel:  # the clone beside the gradient, then kept out of the bucket
            most = max(most, (alive + n + bucket_numel) * grad_bytes)
        else:
            alive -= n  # copied into the bucket, its own storage freed
        bucket.append((start, n))
        elements += n
        start += n
    return most


# --- ZeRO stage 3 with offload_optimizer / offload_param (cpu) --------------------------------

class Zero3Offload(NamedTuple):
    """Where a ZeRO-3 rank's states live with ``offload_optimizer`` cpu (and ``offload_param``
    cpu), int bytes."""

    device_weights: int  # the bit16 partitions on the device (0 with offload_param)
    host: int  # everything the host holds for the rank


def zero3_offload(partition_numel: int, params_offloaded: bool, weight_bytes: int,
                  grad_bytes: int, state_bytes_per_param: int) -> Zero3Offload:
    """ZeRO-3 with ``offload_optimizer: {device: cpu}`` (DeepSpeed 0.19.8, runtime/zero/
    stage3.py ``DeepSpeedZeroOptimizer_Stage3``, ``self.device`` the CPU once
    ``_configure_offloading`` sets ``offload_optimizer``), for a rank whose partitions hold
    ``partition_numel`` elements (S):

    - host: the fp32 partitions (``_create_fp32_partitions``: ``fp16_partitioned_groups_flat
      [i].to('cpu', fp32)``), 4S; their fp32 gradient (``initialize_optimizer_states``:
      ``subgroup_gradient_buffer``, ``torch.zeros(num_elements, fp32, device=self.device)``,
      kept as ``.grad``), 4S; the optimizer's states on them (made at its first step, on the
      host); the gradient partitions (``_setup_for_real_optimizer``:
      ``grad_partitions_flat_buffer``, ``device=self.device``), S x ``grad_bytes``;
    - device: the bit16 partitions (``lp_param_buffer``), S x ``weight_bytes``; with
      ``offload_param`` they are host memory instead (``_create_fp16_partitions_with_
      defragmentation``: ``_create_param_groups_fp16_flat_cpu_memory``, one flat CPU buffer
      per group, pinned unless ``pin_memory`` is false), and only gathered copies reach the
      device. Nothing of the optimizer, no gradient partition, no step temporary: the step
      runs on the host (``_prepare_sub_group`` skips ``_prepare_fp32_grad_for_sub_group``,
      ``_release_sub_group`` keeps the host gradient), and ``_reassign_or_swap_out_
      partitioned_parameters`` copies the fp32 partition into the bit16 one in place (a
      host-to-device copy converts on the host side)."""
    s = partition_numel
    host = s * (4 + 4 + state_bytes_per_param + grad_bytes)
    if params_offloaded:
        return Zero3Offload(device_weights=0, host=host + s * weight_bytes)
    return Zero3Offload(device_weights=s * weight_bytes, host=host)


# per element of a gradient slice at a ZeRO-3 offload reduce, on the device:
# stage3.py partition_grads -> grad_buffer.to(grad_partition.device) (a device copy of the
# host partition's slice, the gradients' dtype) and, at the accumulation boundary,
# _offload_grad_partition_at_boundary -> _constant_buffered_norm2 (part.to(fp64), runtime/zero/
# utils.py get_norm_dtype) beside it; the fp32 copy for the host (4 B) comes after the fp64
# one is freed
ZERO3_OFFLOAD_NORM_BYTES = 8


class Zero3Reduces(NamedTuple):
    """Device bytes of ZeRO-3's bucket reduces beyond the bucket and the gradients
    (``zero3_reduce_bytes``): the first reduce's, and the most of any later one's."""

    first: int
    later: int


class Zero3ReducesAt(NamedTuple):
    """``zero3_reduces_at``: where the first reduce falls and its bytes; the most a later
    reduce makes at each hook of a layer; at the epilogue (and the head, before the layers)."""

    first_layer: int  # -1 the head's hooks, i the i-th layer in backward, len(layers) the end
    first_hook: int  # ... the hook in that layer (its tensors in backward order)
    first: int
    later: tuple[int, ...]  # by hook index within a layer, over the layers after the first's
    end: int  # the epilogue's (the embedding's gradient) and any other outside the layers
    kept: int = 0  # where the first reduce falls among the head's hooks: the gradient it reads
    #                outside the bucket, bytes (one larger than the bucket, kept from its own
    #                hook to the next, where it is reduced alone; a layer's is counted by
    #                ``weight_grads_at``)


def _reduced(bucket: list[int], dp: int, grad_bytes: int, offload: bool) -> int:
    """One reduce's bytes (``zero3_reduce_bytes``)."""
    divisible = len(bucket) == 1 and bucket[0] % dp == 0
    flat = 0 if divisible else sum(dp * partition_numel(n, dp) for n in bucket)
    copies = (partition_numel(max(bucket), dp) * (grad_bytes + ZERO3_OFFLOAD_NORM_BYTES)
              if offload else 0)
    return flat * grad_bytes + copies


def zero3_reduces_at(head: tuple[int, ...], layers: tuple[tuple[int, ...], ...],
                     end: tuple[int, ...], bucket_numel: int, dp: int, grad_bytes: int,
                     offload: bool) -> Zero3ReducesAt:
    """``zero3_reduce_bytes`` with where each reduce falls: the hooks in backward order, the
    head's tensors (``head``: the output projection, the final norm), each layer's (``layers``,
    last layer first, each in backward order), then ``end`` (the embedding), whose epilogue
    reduces what is left. A reduce runs in the hook of the gradient that would pass
    ``bucket_numel`` (stage3.py ``reduce_independent_p_g_buckets_and_remove_grads``)."""
    return _reduces_at(head, layers, end, bucket_numel, lambda n: n,
                       lambda bucket: _reduced(bucket, dp, grad_bytes, offload), grad_bytes)


def zero2_offload_reduces_at(head: tuple[tuple[int, int], ...],
                             layers: tuple[tuple[tuple[int, int], ...], ...],
                             end: tuple[tuple[int, int], ...], bucket_numel: int,
                             lo: int, hi: int, grad_bytes: int) -> Zero3ReducesAt:
    """ZeRO-2 with ``offload_optimizer`` (stage_1_and_2.py ``cpu_offload``): where each bucket
    reduce falls in backward (as ``zero3_reduces_at``: in the hook of the gradient that would
    pass ``bucket_numel``, ``reduce_independent_p_g_buckets_and_remove_grads``; the epilogue
    reduces what is left) and its device bytes: ``copy_grads_in_partition`` sends each of the
    bucket's parameters overlapping the rank's partition ([``lo``, ``hi``) of the flat buffer)
    to the host one at a time, through an fp64 copy of its slice for the norm
    (``set_norm_for_param_grad_in_gpu``) and then an fp32 one
    (``async_inplace_copy_grad_to_fp32_buffer_from_gpu``): ``OFFLOAD_NORM_COPY_BYTES`` per
    element of the largest owned slice. Hooks as (start in the flat buffer, elements). A
    gradient larger than the bucket is not copied into it: it is cloned in its hook
    (``_offload_gradient_safety_enabled``: ``grad_reduc.detach().clone()``, the original
    freed), counted in the bucket's elements, so the next hook reduces it alone
    (``reduce_ipg_grads``: ``extra_large_param_to_reduce``), the clone alive until its slice
    is copied to the host (``clear_grad_attribute``); placed as any other reduce, the clone
    among the head's hooks as ``kept`` (``grad_bytes`` each element)."""
    def owned(bucket: list[tuple[int, int]]) -> int:
        return OFFLOAD_NORM_COPY_BYTES * max(
            (max(0, min(s + n, hi) - max(s, lo)) for s, n in bucket), default=0)

    return _reduces_at(head, layers, end, bucket_numel, lambda h: h[1], owned, grad_bytes)


def _reduces_at(head: tuple[Any, ...], layers: tuple[tuple[Any, ...], ...],
                end: tuple[Any, ...], bucket_numel: int, numel: Any, made_of: Any,
                grad_bytes: int) -> Zero3ReducesAt:
    """``Zero3ReducesAt`` of hooks whose elements ``numel`` gives, each reduce's bytes
    ``made_of`` its bucket's hooks; a first reduce among the head's hooks of one gradient
    larger than the bucket reads it outside the bucket (``kept``, ``grad_bytes`` each)."""
    hooks = [(-1, 0, n) for n in head]
    hooks += [(i, j, n) for i, layer in enumerate(layers) for j, n in enumerate(layer)]
    hooks += [(len(layers), 0, n) for n in end]
    width = max((len(layer) for layer in layers), default=0)
    first, later, outside, bucket, kept = None, [0] * width, 0, [], 0
    for at in (*hooks, None):  # None: the epilogue's reduce
        if bucket and (at is None or sum(numel(h) for h in bucket) + numel(at[2])
                       > bucket_numel):
            made = made_of(bucket)
            where = (len(layers), 0) if at is None else at[:2]
            if first is None:
                first = (*where, made)
                if where[0] < 0 and len(bucket) == 1 and numel(bucket[0]) > bucket_numel:
                    kept = numel(bucket[0]) * grad_bytes
            elif 0 <= where[0] < len(layers):
                later[where[1]] = max(later[where[1]], made)
            else:
                outside = max(outside, made)
            bucket = []
        if at is not None:
            bucket.append(at[2])
    first = first or (len(layers), 0, 0)
    return Zero3ReducesAt(first[0], first[1], first[2], tuple(later), outside, kept)


def zero3_reduce_bytes(hook_numels: tuple[int, ...], bucket_numel: int, dp: int,
                       grad_bytes: int, offload: bool) -> Zero3Reduces:
    """The device bytes each ZeRO-3 bucket reduce makes beyond the bucket and the gradients
    (stage3.py ``reduce_independent_p_g_buckets_and_remove_grads``: a gradient whose elements
    would pass ``reduce_bucket_size`` reduces the bucket first, in its own hook; the epilogue
    reduces what is left): the first reduce's and the most of a later one's.
    ``hook_numels``: the parameters' elements in the order their gradient hooks run
    (backward order). Each reduce:

    - ``__avg_scatter_grads`` -> ``runtime/comm/coalesced_collectives.py
      reduce_scatter_coalesced``: ``torch.cat`` of every gradient's ``dp`` chunks, each padded
      to ceil(numel / dp), interleaved rank by rank, in the communication dtype (none for one
      tensor divisible by ``dp``: it is reduced in place); the rank's partitions are views of
      it, alive through ``partition_grads``;
    - with ``offload`` (offload_optimizer), in ``partition_grads`` one gradient partition at a
      time: a device copy of its host slice (``grad_buffer.to(grad_partition.device)``, the
      gradients' dtype) and the norm's fp64 copy (``ZERO3_OFFLOAD_NORM_BYTES``), the largest
      partition of the bucket's."""
    at = zero3_reduces_at(hook_numels, (), (), bucket_numel, dp, grad_bytes, offload)
    return Zero3Reduces(at.first, at.end)

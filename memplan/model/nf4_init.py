"""The allocations of torchtune's QLoRA model set-up with torchao 0.1's ``NF4Tensor``, in order.

What the caching allocator reserves for a QLoRA run of this kind is set before the first step:
torchtune (commit 0914d5cf, ``recipes/lora_finetune_single_device.py``, ``_setup_model``)
builds the model on the device and then copies the checkpoint into it, and every quantized
base weight passes through ``to_nf4`` several times on the way, each pass holding 68 bytes per
weight at once (``adapters.torchao_quantize_bytes``) in large blocks that later requests split:

1. construction: ``lora_llama2`` (``torchtune/models/llama2/_component_builders.py``) builds one
   ``TransformerDecoderLayer`` (its ``LoRALinear``\\ s: ``_create_weight_and_bias`` makes an
   ``nn.Linear``'s bf16 weight and returns ``to_nf4(linear.weight)``; the bf16 weight dies with
   the ``nn.Linear``), then the embedding, the output projection and the final norm;
2. ``TransformerDecoder.__init__`` clones that layer ``num_layers`` times
   (``torchtune/modules/transformer.py``, ``_get_clones``: ``copy.deepcopy``); a parameter's
   ``__deepcopy__`` runs ``clone``, which torchtune's ``NF4Tensor`` override turns into
   ``to_nf4(get_original_weight())`` (``torchtune/utils/_register_nf4_dispatch_ops.py``,
   ``clone``): dequantized to bf16 and quantized again, per weight of every layer;
3. the template layer dies when the builder returns;
4. ``load_state_dict``: each quantized weight's ``copy_`` runs ``inplace_copy``: the
   checkpoint's bf16 weight moved to the device, ``to_nf4`` on it, the moved copy freed as
   ``to_nf4`` returns, then the old weight's pieces replaced attribute by attribute
   (``quantized_scalers``, ``quantization_factor``, ``scaler_mean``, ``quantized_data``,
   ``nf4``), each freed as it goes. Plain parameters copy from the host in place.

The order and sizes of ``to_nf4``'s and ``get_original_weight``'s own tensors are those of
torchao 0.1's ``torchao/dtypes/nf4tensor.py`` (``NF4Tensor.from_tensor``,
``double_quantize_scalers``, ``get_block_absmax``, ``convert_to_norm_float_weight``,
``quantize_tensor_nearest``, ``get_original_weight``, ``dequantize_scalers``), as the exact
tracker records them on CPU (``tests/traced/test_nf4_init_traced.py``): ``TO_NF4`` and
``GET_ORIGINAL_WEIGHT`` below, sizes as multiples of the weight's elements ``n``, its blocks of
64 (``n / 64``) and its scaler blocks of 256 blocks (``n / 16384``).
"""

from __future__ import annotations

from fractions import Fraction
from typing import NamedTuple, Protocol

NF4_BLOCK = 64  # to_nf4's block_size default
SCALER_BLOCK = 256  # to_nf4's scaler_block_size default


class Size(NamedTuple):
    """``per_weight * n + per_block * n / 64 + per_scaler_block * n / 16384 + fixed`` bytes."""

    per_weight: Fraction = Fraction(0)
    per_block: int = 0
    per_scaler_block: int = 0
    fixed: int = 0

    def of(self, n: int) -> int:
        blocks = n // NF4_BLOCK
        return int(self.per_weight * n) + self.per_block * blocks + (
            self.per_scaler_block * (blocks // SCALER_BLOCK)) + self.fixed


W2, B2, B8 = Size(Fraction(2)), Size(per_block=2), Size(per_block=8)
# ("a", id, size) / ("f", id): to_nf4 on a bf16 weight already alive (id 0 stands for it);
# the ids left alive are the NF4Tensor's pieces (KEPT)
TO_NF4: tuple[tuple, ...] = (
    ("a", 1, Size(fixed=32)),  # from_tensor: the 16-entry bf16 code (nf4)
    # double_quantize_scalers: get_block_absmax (abs, max over blocks: values and indices)
    ("a", 2, W2), ("a", 3, B2), ("a", 4, B8), ("f", 2), ("f", 4),
    ("a", 5, Size(fixed=2)),  # scalers_1.mean(): scaler_mean
    ("a", 6, B2), ("f", 3),  # scalers_1 - mean
    # get_block_absmax of the scalers by 256
    ("a", 7, B2), ("a", 8, Size(per_scaler_block=2)), ("a", 9, Size(per_scaler_block=8)),
    ("f", 7), ("f", 9),
    # 256 / (2 * absmax) expanded, scaled, round, clamp, to(int8)
    ("a", 10, B2), ("a", 11, B2), ("a", 12, B2), ("f", 11), ("f", 10),
    ("a", 13, B2), ("a", 14, B2), ("f", 13), ("a", 15, B2), ("f", 14),
    ("a", 16, Size(per_block=1)), ("f", 6), ("f", 8), ("f", 15),
    # convert_to_norm_float_weight: the blocks' absmax again, blocks / scales
    ("a", 17, W2), ("a", 18, B2), ("a", 19, B8), ("f", 17), ("f", 19),
    ("a", 20, W2),
    # quantize_tensor_nearest: (value - nf4) and its abs, (n, 16) bf16 each; min's indices
    ("a", 21, Size(Fraction(32))), ("a", 22, Size(Fraction(32))), ("f", 21),
    ("a", 23, W2), ("a", 24, Size(Fraction(8))), ("f", 23), ("f", 22),
    # the nibbles shifted and or-ed (int64, n / 2 each), then to(uint8): quantized_data
    ("a", 25, Size(Fraction(4))), ("a", 26, Size(Fraction(4))), ("f", 25),
    ("a", 27, Size(Fraction(1, 2))), ("f", 18), ("f", 20), ("f", 24), ("f", 26),
)
# the pieces to_nf4 leaves, in inplace_copy's order of replacing them: quantized_scalers,
# quantization_factor (a view of tensor 12), scaler_mean, quantized_data, nf4
KEPT = (16, 12, 5, 27, 1)
# get_original_weight on a stored NF4Tensor: the nibbles as int64 indices, looked up, the
# dequantized scalers, each half scaled, stacked: the bf16 weight (id 17) is returned
GET_ORIGINAL_WEIGHT: tuple[tuple, ...] = (
    ("a", 5, Size(Fraction(1, 2))), ("a", 6, Size(Fraction(4))), ("f", 5),
    ("a", 7, Size(Fraction(1, 2))), ("a", 8, Size(Fraction(4))), ("f", 7),
    ("a", 9, Size(Fraction(1))), ("a", 10, Size(Fraction(1))),
    ("a", 11, B2), ("a", 12, B2), ("f", 11),
    ("a", 13, Size(Fraction(1))), ("a", 14, Size(Fraction(1))), ("f", 13),
    ("a", 15, Size(Fraction(1))), ("a", 16, Size(Fraction(1))), ("f", 15),
    ("a", 17, W2), ("f", 6), ("f", 8), ("f", 9), ("f", 10), ("f", 12), ("f", 14), ("f", 16),
)


class Events(Protocol):
    """What the patterns need of ``memplan.model.alloc_sequence.Builder``."""

    def alloc(self, size: int, stream: int = 0) -> int | None: ...

    def free(self, key: int | None) -> None: ...


def _run(b: Events, pattern: tuple[tuple, ...], n: int,
         given: dict[int, int | None]) -> dict[int, int | None]:
    keys = dict(given)
    for op in pattern:
        if op[0] == "a":
            keys[op[1]] = b.alloc(op[2].of(n))
        else:
            b.free(keys.pop(op[1]))
    return keys


def to_nf4(b: Events, n: int) -> tuple[int | None, ...]:
    """``to_nf4`` of a bf16 weight of ``n`` elements already alive: its tensors made and
    freed; the NF4Tensor's pieces returned alive, in ``KEPT``'s order."""
    keys = _run(b, TO_NF4, n, {})
    return tuple(keys[k] for k in KEPT)


def get_original_weight(b: Events, n: int) -> int | None:
    """``get_original_weight`` of a stored NF4 weight: the bf16 weight it returns, alive."""
    return _run(b, GET_ORIGINAL_WEIGHT, n, {})[17]


def stored_bytes(n: int) -> int:
    """Bytes of ``KEPT``'s pieces (``adapters.nf4_torchao_01_bytes``)."""
    sizes = {op[1]: op[2].of(n) for op in TO_NF4 if op[0] == "a"}
    return sum(sizes[k] for k in KEPT)


def qlora_setup(b: Events, layers: tuple[tuple[int, ...], ...], rest: list[int]) -> None:
    """torchtune's QLoRA set-up (module docstring) for a stage whose layers hold NF4 weights
    of ``layers`` elements each (in registration order; the template is the first layer);
    ``rest``: bytes of every other parameter tensor (embedding, head, norms, adapters), made
    after the template layer, as the builder makes them."""
    if not layers:
        return
    template = []
    for n in layers[0]:
        weight = b.alloc(2 * n)  # the nn.Linear's bf16 weight (initialised in place)
        template.append(to_nf4(b, n))
        b.free(weight)
    for size in rest:
        b.alloc(size)
    clones = []
    for layer in layers:  # copy.deepcopy of the template: clone -> to_nf4(get_original_weight())
        row = []
        for n in layer:
            bf16 = get_original_weight(b, n)
            row.append(to_nf4(b, n))
            b.free(bf16)
        clones.append(row)
    for pieces in template:
        for key in pieces:
            b.free(key)
    for layer, row in zip(layers, clones):  # load_state_dict: inplace_copy per NF4 weight
        for n, old in zip(layer, row):
            moved = b.alloc(2 * n)
            to_nf4(b, n)
            b.free(moved)
            for key in old:
                b.free(key)

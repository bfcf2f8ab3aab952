"""Per-rank sizes of one micro-batch, derived once, and the saved-tensor ``Term``.

Notation (``reference/formulas.md``): T = mbs * seq / cp local tokens; h hidden; a, g query and
KV heads; d head dim; f FFN width; V vocab; t TP degree; e bytes per element of the compute
dtype. Under autocast with fp32 weights (``amp-*``) the residual stream, the norms and the
tensors made outside autocast's matmuls stay fp32 (``stream_e``), the matmuls read low-precision
casts of their inputs and weights and return low-precision outputs (``e``). Tensors in the
residual stream are split by t only with sequence parallelism (``rows``); tensors inside the
attention and MLP blocks are split by t always.
"""

from __future__ import annotations

from fractions import Fraction
from typing import NamedTuple

from memplan.model.adapters import Adapters, adapters_of
from memplan.parallel import ParallelConfig, TpStyle, local_seq
from memplan.spec import ModelSpec
from memplan.units import FP32_BYTES as FP32_BYTES  # the blocks read it here
from memplan.units import DType
from memplan.workload import Float8Recipe, TeFp8Recipe, Workload

INDEX_BYTES = DType.INT64.itemsize  # token ids and targets are int64 (torch.long)
MASK_BYTES = 1  # torch's native_dropout returns a bool mask, one byte per element
# torchtitan's RoPE.cache: complex64, one (real, imaginary) fp32 pair per two rotated dims
# (models/common/rope.py ComplexRoPE._precompute_cache: torch.polar of fp32 frequencies)
COMPLEX64_PAIR_BYTES = 2 * FP32_BYTES


class Term(NamedTuple):
    """One saved tensor (or group) for one micro-batch on one rank."""

    name: str
    size_bytes: int


def total(terms: list[Term] | tuple[Term, ...]) -> int:
    return sum(term.size_bytes for term in terms)


class Dims(NamedTuple):
    """Per-rank sizes of one micro-batch, derived once from spec, layout and workload."""

    b: int  # micro-batch size
    s: int  # local sequence length (seq / cp)
    s_kv: int  # keys each query attends to (the full sequence)
    tokens: int  # b * s
    res_tokens_div: int  # divisor of residual-stream tensors (tp with SP, else 1)
    tp: int
    e: int  # bytes per element of the compute dtype
    vocab_shard: int  # vocabulary rows on this rank: ceil(V / tp) when vocab-parallel, else V
    gathered_linear_input: bool = False  # SP with DTensor: linears save full-sequence inputs
    stream_e: int = 0  # bytes per element of the residual stream (fp32 under autocast; else e)
    autocast: bool = False  # fp32 weights under torch.autocast: matmuls save cast copies
    etp: int = 0  # TP degree of the routed experts (ParallelConfig.etp); 0: tp
    adapters: Adapters | None = None  # LoRA on frozen base weights (memplan.model.adapters)
    float8: Float8Recipe = Float8Recipe.NONE  # torchao Float8Linear (memplan.model.linear)
    te_fp8: TeFp8Recipe = TeFp8Recipe.NONE  # Transformer Engine fp8 (memplan.model.te_fp8)
    te_fp8_transposes: bool = True  # per-tensor fp8 keeps transposed copies (Hopper)
    compiled: bool = False  # the layers under torch.compile (memplan.model.compiled)
    float8_gathered: bool = False  # FSDP2 gathers converted weights in float8: no weight cast
    float8_tp: bool = False  # torchao's float8 TP styles: linear inputs cast before them
    # DeepSpeed's ZeRO-3 module hooks keep a frozen head's input (the final norm's output)
    # alive into backward (traced under LoRA: memplan.model.norm.output_kept)
    head_input_kept: bool = False
    ep: int = 1  # expert-parallel degree: this rank holds num_experts / ep routed experts
    # a fully recomputed layer's forward as its backward reruns it (``layer.backward_moments``):
    # what it rebuilds, not what a compiled layer without recompute saves from its forward
    # (``memplan.model.compiled.float8_tp_weights``)
    rerun: bool = False

    @classmethod
    def of(cls, spec: ModelSpec, par: ParallelConfig, wl: Workload) -> Dims:
        s = local_seq(wl.seq_len, par.cp)
        policy = wl.precision.policy
        e = wl.compute_dtype.itemsize
        # (positional, in the fields' order, as each is named: made in every estimate, where
        # a call with a score of keywords costs several times the tuple)
        return cls(wl.micro_batch_size, s, wl.seq_len, wl.micro_batch_size * s,  # b .. tokens
                   par.sp_divisor, par.tp, e,  # res_tokens_div, tp, e
                   par.vocab_shard(spec.vocab_size),  # vocab_shard
                   (par.sequence_parallel and par.tp > 1  # gathered_linear_input
                    and par.tp_style is TpStyle.DTENSOR),
                   policy.params.itemsize if policy.autocast else e,  # stream_e
                   policy.autocast is not None, par.etp or 0,  # autocast, etp
                   adapters_of(wl, spec.fused_qkv or wl.fused_qkv),  # adapters
                   wl.float8, wl.te_fp8,  # float8, te_fp8
                   wl.te_fp8_transposes is not False,  # te_fp8_transposes
                   wl.compile,  # compiled
                   wl.float8_all_gather and par.zero >= 3,  # float8_gathered
                   wl.float8 is Float8Recipe.TENSORWISE and par.tp > 1,  # float8_tp
                   wl.flat_partition and par.zero >= 3,  # head_input_kept
                   par.ep)  # ep (rerun: its default)

    def experts(self) -> Dims:
        """These dims for the routed experts' projections: their inner widths split by etp.
        Under float8 they are no ``Float8Linear``s: their grouped matmuls' casts are
        ``memplan.model.float8_grouped``'s, read by the MoE block itself."""
        dm = self._replace(tp=self.etp) if self.etp else self
        if dm.float8 is Float8Recipe.NONE:
            return dm
        return dm._replace(float8=Float8Recipe.NONE, float8_tp=False, float8_gathered=False)

    def stream(self, hidden: int) -> int:
        """Bytes of one residual-stream tensor of width ``hidden`` on this rank."""
        return self.rows * hidden * self.stream_e

    @property
    def rows(self) -> int:
        """Token rows of a residual-stream tensor on this rank (T / t under SP)."""
        return self.tokens // self.res_tokens_div

    @property
    def linear_rows(self) -> int:
        """Token rows of a column-parallel linear's saved input: its sequence shard, or the
        all-gathered full sequence under DTensor sequence parallelism."""
        return self.tokens if self.gathered_linear_input else self.rows


def residual_dropout_mask(prefix: str, spec: ModelSpec, dm: Dims) -> list[Term]:
    """Dropout on a block's output before the residual add: a bool mask per residual element."""
    if spec.dropout <= 0:
        return []
    return [Term(f"{prefix}.dropout_mask", dm.rows * spec.hidden_size * MASK_BYTES)]


def exact_ratio(numerator: int, denominator: int = 1) -> int | Fraction:
    """``numerator / denominator`` exactly: an int where it divides (ints carry their own
    ``numerator`` and ``denominator``, read without a Python call, so the common whole ratio
    costs ``whole_bytes`` nothing), else a ``Fraction``."""
    if numerator % denominator == 0:
        return numerator // denominator
    return Fraction(numerator, denominator)


def whole_bytes_each(counts: tuple[int, ...], per_item: int | Fraction) -> tuple[int, ...]:
    """``whole_bytes`` of each of ``counts``."""
    return tuple(whole_bytes(n, per_item) for n in counts)


def whole_bytes(count: int, per_item: int | Fraction) -> int:
    """``count`` items at ``per_item`` bytes each (an exact ratio: a shard's bytes over its
    parameters need not be whole), in whole bytes rounded toward zero, without a float."""
    scaled = count * per_item.numerator
    if scaled >= 0:
        return scaled // per_item.denominator
    return -(-scaled // per_item.denominator)

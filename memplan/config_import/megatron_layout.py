"""Megatron-LM's ``--pipeline-model-parallel-layout`` as memplan's split: the decoder layers of
each virtual pipeline stage (``ParallelConfig.stage_layers``) and the virtual stages per rank.

The string is read as megatron/core/transformer/pipeline_parallel_layer_layout.py
``PipelineParallelLayerLayout.parse_str_to_list`` reads it (commas dropped, ``(...)*n`` then
``x*n`` unrolled, stages split on ``|``; ``E`` the embedding, ``t`` a decoder layer, ``L`` the
loss, ``m`` an MTP layer) and checked as its ``__init__`` and ``validate_layer_layout`` check
it: the stages divide over pp (vpp = stages / pp; stage ``c * pp + r`` is model chunk ``c`` of
rank ``r``, memplan's order), the embedding first and the loss last, each once, as many
``t`` as --num-layers and as many ``m`` as --mtp-num-layers, no ``t`` after an ``m``.
memplan places the MTP layers where megatron-core does without a layout: all in the last
virtual stage of the last rank (``memplan.model.stage_parts.build_kinds``); a layout that puts
an ``m`` in any other stage (Megatron's "standalone" MTP stage, ``validate_layer_layout``'s
``mtp_standalone``) is refused by name. torch-free.
"""

from __future__ import annotations

import re

from memplan.spec import MAX_LAYERS

# the longest layout read once unrolled: one character per layer, embedding, loss and stage
# separator, for MAX_LAYERS layers over as many stages, with room to spare
MAX_LAYOUT_CHARS = 4 * MAX_LAYERS + 64
# pipeline_parallel_layer_layout.py parse_str_to_list: parentheses first, then single chars
_UNROLL = (r"\(([^)]+)\)\*(\d+)", r"(.)\*(\d+)")
_KINDS = frozenset("ELtm")


def _unroll(text: str) -> str:
    """``text`` with ``(ab)*n`` and ``x*n`` repeated, as Megatron's regular expressions do;
    a result longer than any layout of MAX_LAYERS layers is refused before it is built."""
    for pattern in _UNROLL:
        size = len(text)
        for match in re.finditer(pattern, text):
            size += len(match.group(1)) * int(match.group(2)) - len(match.group(0))
            if size > MAX_LAYOUT_CHARS:
                raise ValueError(f"unrolls to more than {MAX_LAYOUT_CHARS:,} characters, more "
                                 f"than a layout of {MAX_LAYERS} layers")
        text = re.sub(pattern, lambda m: m.group(1) * int(m.group(2)), text)
    return text


def stage_split(layout: str, pp: int, num_layers: int,
                mtp_layers: int = 0) -> tuple[int, tuple[int, ...]]:
    """(vpp, decoder layers of each virtual stage in order) of a layout string, or
    ``ValueError`` saying which of Megatron's checks it fails or where the MTP layers (``m``,
    ``mtp_layers`` of them) sit outside the last stage memplan models them on."""
    if len(layout) > MAX_LAYOUT_CHARS:
        raise ValueError(f"is {len(layout):,} characters long, more than a layout of "
                         f"{MAX_LAYERS} layers")
    stages = _unroll(layout.replace(",", "")).split("|")
    bad = sorted({c for stage in stages for c in stage} - _KINDS)
    if bad:
        raise ValueError(f"has {''.join(bad)!r}: the layer characters are E, t, L and m")
    if len(stages) % pp:
        raise ValueError(f"has {len(stages)} stages, which pp ({pp}) does not divide")
    flat = "".join(stages)
    if not flat.startswith("E") or not flat.endswith("L") or flat.count("E") != 1 \
            or flat.count("L") != 1:
        raise ValueError("needs the embedding (E) first and the loss (L) last, each once")
    _check_mtp(stages, mtp_layers)
    if flat.count("t") != num_layers:
        raise ValueError(f"has {flat.count('t')} decoder layers (t); --num-layers is "
                         f"{num_layers}")
    return len(stages) // pp, tuple(stage.count("t") for stage in stages)


def _check_mtp(stages: list[str], mtp_layers: int) -> None:
    """Megatron's MTP checks (``validate_layer_layout``: as many ``m`` as --mtp-num-layers,
    no decoder layer after the first) and memplan's placement: every ``m`` in the last stage
    string, which is the last virtual stage (chunk vpp - 1) of the last rank (pp - 1)."""
    flat = "".join(stages)
    if flat.count("m") != mtp_layers:
        raise ValueError(f"has {flat.count('m')} MTP layers (m); --mtp-num-layers is "
                         f"{mtp_layers}")
    if "m" in flat and "t" in flat[flat.index("m"):]:
        raise ValueError("places a decoder layer (t) after an MTP layer (m)")
    if stages[-1].count("m") != mtp_layers:
        raise ValueError("places MTP layers (m) outside the last stage (the last rank's last "
                         "virtual stage), where memplan models them")

"""What a config reader returns (``Imported``: the model, the inputs, each key's ``Mapped``
target) and how its inputs merge with a command line's (``merge``); see
``memplan.config_import``."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from memplan import arguments
from memplan.errors import MemplanError, shown
from memplan.spec import ModelSpec

# How the mapping names a target that no shared option's keyword is: the model (the CLI's
# first option), and the inputs only a config sets. Every other target is a ``memplan.api``
# keyword, named by its flag (``memplan.arguments.CLI_OPTIONS``).
_NOT_KEYWORDS = {"model": "--model", "fused_qkv": "(fused q/k/v)", "rope_cache": "(RoPE tables)",
                 "head_wgrad_deferral": "(deferred output-layer weight gradient)",
                 "fsdp_units": "(FSDP units)",
                 "loss_impl": "(loss)", "softmax_fp32": "(fp32 softmax)",
                 "zero_bucket_numel": "(reduce bucket elements)",
                 "zero_bucket_buffers": "(reduce buckets)",
                 "forward_prefetch": "(FSDP1 forward prefetch)",
                 "zero3_plain_gathers": "(ZeRO-3 gathers, each module for its own run)",
                 "zero3_prefetch_numel": "(ZeRO-3 prefetch elements)",
                 "zero3_max_live_numel": "(ZeRO-3 live elements)",
                 "zero3_reuse_distance_numel": "(ZeRO-3 reuse distance)",
                 "zero3_persistence_numel": "(ZeRO-3 persistence threshold)"}


def flag(target: str) -> str:
    """The CLI flag a user would give for ``target`` (a ``memplan.api`` keyword), for the
    mapping's text."""
    if target in arguments.CLI_OPTIONS:
        return arguments.flag(target)
    return _NOT_KEYWORDS.get(target, target)


# the layout degrees a config sets: at most arguments.MAX_GPUS, as memplan.api checks them
_DEGREES = frozenset({"gpus", "tp", "pp", "vpp", "cp", "ep", "etp", "dp", "dp_shard"})


def _past_bound(target: str, value: Any) -> str | None:
    """What ``value`` must be for the input ``target`` when it is an int past that input's
    bound (a Workload field's ``gt``/``ge``/``le``, a layout degree's MAX_GPUS), else None."""
    from memplan.workload import Workload

    if type(value) is not int:
        return None
    if target in _DEGREES:
        return None if 0 < value <= arguments.MAX_GPUS else f"from 1 to {arguments.MAX_GPUS}"
    rule = Workload.model_fields.get(target)
    if rule is None:
        return None
    if rule.gt is not None and value <= rule.gt:
        return f"more than {rule.gt}"
    if rule.ge is not None and value < rule.ge:
        return f"at least {rule.ge}"
    if rule.le is not None and value > rule.le:
        return f"at most {rule.le}"
    return None


@dataclass(frozen=True)
class Mapped:
    """One key of the config and the memplan input it became (``target``: a ``memplan.api``
    keyword, or ``model`` for a key that shapes the model spec)."""

    key: str
    given: Any
    target: str
    value: Any
    how: str = ""

    def line(self) -> str:
        shown_flag = flag(self.target)
        value = self.value if isinstance(self.value, str) else shown(self.value)
        how = f" ({self.how})" if self.how else ""
        return f"{self.key} = {shown(self.given)} -> {shown_flag} {value}{how}"


@dataclass
class Imported:
    """What a config sets: ``model`` (a catalog name, a ModelSpec, or None when the config
    does not name one), ``inputs`` (``memplan.api`` keywords), the ``mapping`` that made
    them, ``notes`` (read, not modelled) and ``unread`` keys."""

    source: str
    model: str | ModelSpec | None = None
    inputs: dict[str, Any] = field(default_factory=dict)
    mapping: list[Mapped] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    unread: list[str] = field(default_factory=list)

    def set(self, key: str, given: Any, target: str, value: Any, how: str = "") -> None:
        """Record that ``key`` (= ``given``) sets the memplan input ``target`` to ``value``;
        a count past the bound of the input it sets is refused here, naming ``key`` (the
        input's own check would name only the input)."""
        bound = _past_bound(target, value)
        if bound is not None:
            raise self.refuse(key, given, f"{flag(target)} must be {bound}")
        self.mapping.append(Mapped(key, given, target, value, how))
        if target != "model":
            self.inputs[target] = value

    def refuse(self, key: str, given: Any, why: str) -> MemplanError:
        return MemplanError(f"{self.source}: {key} = {shown(given)}: {why}")

    def lines(self) -> list[str]:
        """The mapping as text, one line per key, then the notes and the keys not read."""
        out = [f"inputs from {self.source}:"]
        out += [f"  {m.line()}" for m in self.mapping]
        out += [f"  note: {n}" for n in self.notes]
        if self.unread:
            out.append("  not modelled, may change memory: " + ", ".join(self.unread))
        return out

    def as_json(self) -> dict[str, Any]:
        return {"source": self.source,
                "mapping": [{"key": m.key, "given": m.given, "input": flag(m.target),
                             "value": m.value if not isinstance(m.value, ModelSpec)
                             else m.value.name, "how": m.how} for m in self.mapping],
                "notes": list(self.notes), "unread": list(self.unread)}


def merge(imported: Imported, given: dict[str, Any], defaults: dict[str, Any]) -> dict[str, Any]:
    """``given`` (the API keywords of the command line) with the config's inputs: a value the
    command line left at its default takes the config's; one given there too must agree
    (else one line naming both)."""
    out = dict(given)
    for key, value in imported.inputs.items():
        if key in given and given[key] != defaults.get(key) and given[key] != value:
            source = next(m.key for m in imported.mapping if m.target == key)
            raise MemplanError(f"{flag(key)} {shown(given[key])} and {source} in {imported.source} "
                               f"({shown(value)}) disagree: give one of them")
        out[key] = value
    return out


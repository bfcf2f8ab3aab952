"""A torchtitan config registry entry (torchtitan 0.3's ``--module``/``--config``) as the job
tables ``memplan.config_import.torchtitan`` maps, read without running it.

torchtitan 0.3 replaced job TOMLs with Python: ``torchtitan/models/<module>/config_registry.py``
holds functions returning a ``Trainer.Config``; its entry point (``torchtitan/config/manager.py``
``ConfigManager._load_config``) imports ``--module``'s registry, calls ``--config``'s function,
then applies ``--<section>.<key> value`` overrides (tyro). memplan takes the same words:

    --torchtitan-config "--module llama3 --config llama3_8b --training.local_batch_size 2"
    --torchtitan-config "path/to/config_registry.py --config llama3_8b"

The registry file is parsed with ``ast``, never imported or run: a config function's body may
assign names, call the module's other config functions (``config = llama3_8b()``), set fields
(``config.training.seq_len = 4096``) and return; its values are literals (numbers, strings,
lists, arithmetic on numbers) and constructor calls with keyword arguments
(``TrainingConfig(local_batch_size=1)``, ``FullAC.Config()``, ``model_registry("8B")``). Any
other statement is refused by its line; a value memplan reads that is not a literal (a call
of a helper, an expression on other fields) is refused by its key.
"""

from __future__ import annotations

import ast
import shlex
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from memplan.errors import MemplanError
from memplan.inputs import MODEL_FILE_BYTES, read_text, too_large

_SRC = "torchtitan 0.3 config/manager.py ConfigManager._load_config"


@dataclass
class Call:
    """A constructor call of the registry: ``name`` as written (``FullAC.Config``), its
    positional and keyword arguments (values, or ``Opaque`` for what is not a literal)."""

    name: str
    args: list[Any] = field(default_factory=list)
    kwargs: dict[str, Any] = field(default_factory=dict)
    text: str = ""  # the call's source
    unevaluated = True  # a value the reader does not run (memplan.config_import.torchtitan)

    def __repr__(self) -> str:
        return self.text or f"{self.name}(...)"


@dataclass(frozen=True)
class Opaque:
    """A value memplan does not evaluate (a helper's call, an expression on other values):
    refused where it is read, by ``text``, its source."""

    text: str
    unevaluated = True

    def __repr__(self) -> str:
        return self.text


class _Body:
    """Evaluates one config function of a parsed registry module."""

    def __init__(self, tree: ast.Module, where: str) -> None:
        self.where = where
        self.functions = {n.name: n for n in tree.body if isinstance(n, ast.FunctionDef)}

    def refuse(self, node: ast.AST, why: str) -> MemplanError:
        text = ast.unparse(node).splitlines()[0][:80]
        return MemplanError(f"{self.where} line {getattr(node, 'lineno', '?')}: "
                            f"{text!r}: {why}")

    def run(self, name: str, depth: int = 0) -> Any:
        fn = self.functions.get(name)
        if fn is None:
            known = ", ".join(n for n in self.functions if not n.startswith("_"))
            raise MemplanError(f"{self.where}: no config function {name!r} (it has {known})")
        if depth > 8 or fn.args.args or fn.args.kwonlyargs:
            raise self.refuse(fn, "a config function takes no arguments (--config calls it "
                                  "so)")
        names: dict[str, Any] = {}
        for stmt in fn.body:
            if isinstance(stmt, ast.Return) and stmt.value is not None:
                return self.value(stmt.value, names, depth)
            if isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Constant):
                continue  # a docstring
            if isinstance(stmt, ast.Assert):
                continue  # checks nothing memplan reads
            if isinstance(stmt, (ast.Assign, ast.AnnAssign)) and stmt.value is not None:
                targets = stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target]
                value = self.value(stmt.value, names, depth)
                for target in targets:
                    self.assign(target, value, names)
                continue
            raise self.refuse(stmt, "only assignments and a return are read (the function "
                                    "is parsed, not run)")
        raise self.refuse(fn, "the config function returns no config")

    def assign(self, target: ast.AST, value: Any, names: dict[str, Any]) -> None:
        if isinstance(target, ast.Name):
            names[target.id] = value
            return
        if isinstance(target, ast.Attribute):
            owner = self.section(target.value, names)
            if isinstance(owner, Call):
                owner.kwargs[target.attr] = value
                return
        raise self.refuse(target, "only a name or a config's field is assigned")

    def section(self, node: ast.AST, names: dict[str, Any]) -> Any:
        """The config a field assignment writes into (``config.parallelism`` in
        ``config.parallelism.x = 1``), made at its defaults where the config leaves it."""
        if isinstance(node, ast.Attribute):
            owner = self.section(node.value, names)
            if isinstance(owner, Call):
                return owner.kwargs.setdefault(node.attr, Call(f"({node.attr} defaults)"))
            return owner
        return self.value(node, names, 0)

    def value(self, node: ast.AST, names: dict[str, Any], depth: int) -> Any:
        """A literal, a ``Call`` of a constructor, the result of the module's config function,
        a field of a config the body holds, or ``Opaque``."""
        if isinstance(node, ast.Constant):
            return node.value
        if isinstance(node, (ast.List, ast.Tuple)):
            return [self.value(e, names, depth) for e in node.elts]
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            inner = self.value(node.operand, names, depth)
            return -inner if _number(inner) else Opaque(ast.unparse(node))
        if isinstance(node, ast.BinOp) and isinstance(node.op, tuple(_ARITHMETIC)):
            a, b = self.value(node.left, names, depth), self.value(node.right, names, depth)
            if _number(a) and _number(b) and not (isinstance(node.op, ast.FloorDiv)
                                                  and b == 0):
                result = _ARITHMETIC[type(node.op)](a, b)
                # past 64 bits no count is: left unevaluated, so a chain of products
                # (x = x * x, line after line) never grows a number without bound
                if not too_large(result):
                    return result
            return Opaque(ast.unparse(node))
        if isinstance(node, ast.Name):
            return names.get(node.id, Opaque(node.id))
        if isinstance(node, ast.Attribute):
            owner = self.value(node.value, names, depth)
            if isinstance(owner, Call):
                return owner.kwargs.get(node.attr, Opaque(ast.unparse(node)))
            return Opaque(ast.unparse(node))
        if isinstance(node, ast.Call):
            name = ast.unparse(node.func)
            if (isinstance(node.func, ast.Name) and node.func.id in self.functions
                    and not node.args and not node.keywords):
                return self.run(node.func.id, depth + 1)  # config = llama3_8b()
            if any(k.arg is None for k in node.keywords) or any(
                    isinstance(a, ast.Starred) for a in node.args):
                return Opaque(ast.unparse(node))
            return Call(name, [self.value(a, names, depth) for a in node.args],
                        {k.arg: self.value(k.value, names, depth) for k in node.keywords},
                        ast.unparse(node))
        return Opaque(ast.unparse(node))


_ARITHMETIC = {ast.Add: lambda a, b: a + b, ast.Sub: lambda a, b: a - b,
               ast.Mult: lambda a, b: a * b, ast.FloorDiv: lambda a, b: a // b}


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


@dataclass
class Command:
    """``--module``/``--config`` and the overrides, as torchtitan's entry point takes them."""

    file: Path
    module: str  # the model the registry is for: --module's name, or the file's folder
    config: str
    overrides: list[tuple[str, str]]
    words: str


def parse_command(text: str) -> Command:
    """The registry file, config name and ``--section.key value`` overrides of ``text``
    (``ConfigManager._load_config``: ``--module X`` or ``--module=X``, likewise ``--config``;
    everything else is tyro's overrides). A ``--module`` shorthand is the installed
    torchtitan's ``torchtitan/models/<module>/config_registry.py`` (found on ``sys.path``,
    not imported); a path to a ``.py`` file is that file."""
    try:
        words = shlex.split(text)
    except ValueError as err:
        raise MemplanError(f"torchtitan config {text!r}: {err}") from None
    module = config = None
    rest: list[str] = []
    i = 0
    while i < len(words):
        word = words[i]
        key, eq, value = word.partition("=")
        if key in ("--module", "--config"):
            if not eq:
                if i + 1 >= len(words):
                    raise MemplanError(f"torchtitan config: {key} requires a value")
                value, i = words[i + 1], i + 1
            if key == "--module":
                module = value
            else:
                config = value
        elif word.endswith(".py") and module is None and not word.startswith("-"):
            module = word
        else:
            rest.append(word)
        i += 1
    if module is None or config is None:
        raise MemplanError(f"torchtitan config {text!r}: give a job TOML, or --module (a name "
                           "like llama3, or a config_registry.py) and --config (its function), "
                           "as torchtitan's train entry point takes them")
    file = _registry_file(module)
    name = module if not module.endswith(".py") and "." not in module else file.parent.name
    return Command(file, name, config, _overrides(rest, text), text)


def _registry_file(module: str) -> Path:
    path = Path(module)
    if module.endswith(".py"):
        if not path.is_file():
            raise MemplanError(f"torchtitan config: no file {module}")
        return path
    parts = module.split(".")
    if len(parts) == 1:
        parts = ["torchtitan", "models", module]
    for root in sys.path:  # the file torchtitan's importlib would find, not imported
        for tail in (("config_registry.py",), ()):
            candidate = Path(root or ".", *parts, *tail)
            if candidate.suffix != ".py":
                candidate = candidate.with_suffix(".py")
            if candidate.is_file():
                return candidate
    raise MemplanError(f"torchtitan config: --module {module}: no "
                       f"{'/'.join(parts)}/config_registry.py on the Python path (install "
                       "torchtitan, or give the registry file's path)")


def _overrides(words: list[str], text: str) -> list[tuple[str, str]]:
    out: list[tuple[str, str]] = []
    i = 0
    while i < len(words):
        word = words[i]
        if not word.startswith("--") or "." not in word.split("=", 1)[0]:
            raise MemplanError(f"torchtitan config {text!r}: {word!r}: expected "
                               "--<section>.<key> <value> (an override of the config)")
        key, eq, value = word[2:].partition("=")
        if not eq:
            if i + 1 >= len(words):
                raise MemplanError(f"torchtitan config: --{key} requires a value")
            value, i = words[i + 1], i + 1
        out.append((key.replace("-", "_"), value))
        i += 1
    return out


def evaluate(command: Command) -> Call:
    """The ``Trainer.Config(...)`` call the config function returns, overrides applied."""
    path = command.file
    where = f"{path} {command.config}"
    text = read_text(path, "torchtitan config registry", MODEL_FILE_BYTES)
    try:
        tree = ast.parse(text, filename=str(path))
    except (SyntaxError, ValueError, RecursionError) as err:
        raise MemplanError(f"{path}: not Python memplan can parse ({err})") from None
    try:
        trainer = _Body(tree, where).run(command.config)
    except RecursionError:  # an expression the parser took, too deep to walk (1 + 1 + ...)
        raise MemplanError(f"{where}: nests deeper than memplan reads") from None
    if not isinstance(trainer, Call) or not trainer.name.endswith("Config"):
        raise MemplanError(f"{where}: returns {trainer!r}, not a Trainer.Config(...)")
    for key, text in command.overrides:
        _override(trainer, key, text, where)
    return trainer


def _override(trainer: Call, key: str, text: str, where: str) -> None:
    *path, name = key.split(".")
    owner: Any = trainer
    for part in path:
        owner = owner.kwargs.get(part) if isinstance(owner, Call) else None
        if owner is None:  # a section the function leaves at its default
            owner = trainer.kwargs.setdefault(part, Call(f"({part} defaults)"))
    if not isinstance(owner, Call):
        raise MemplanError(f"{where}: --{key}: {'.'.join(path)} is not a config section")
    owner.kwargs[name] = _scalar(text)


def _scalar(text: str) -> Any:
    """An override's value as tyro reads a field's: bool, int, float, else the string."""
    if text in ("True", "true"):
        return True
    if text in ("False", "false"):
        return False
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


# Trainer.Config's fields that hold nothing memplan's memory model reads
QUIET = ("hf_assets_path", "profiler", "metrics", "lr_scheduler", "checkpoint", "validator",
         "dataloader", "comm", "debug", "tokenizer", "dump_folder", "fault_tolerance",
         "override", "float8", "quantize", "job")
# the activation-checkpointing policies (distributed/activation_checkpoint.py: SelectiveAC is
# per-op SAC, FullAC every block; Trainer.Config's default is SelectiveAC.Config())
_AC = {"SelectiveAC.Config": {"mode": "selective", "selective_ac_option": "op"},
       "FullAC.Config": {"mode": "full"}, "MemoryBudgetAC.Config": {"mode": "memory_budget"}}
_CONVERTERS = {"Float8LinearConverter.Config": "float8", "MXFP8LinearConverter.Config": "mx"}


def tables(trainer: Call, module: str, refuse: Any) -> tuple[dict[str, Any], list[str]]:
    """The job tables of a ``Trainer.Config(...)`` call, named as the job TOMLs named them
    (training, parallelism, activation_checkpoint, compile, model, optimizer), and the
    notes of how each was read; ``module``: the registry's model (llama3); ``refuse(key,
    given, why)``: the error naming a key."""
    kw, notes = trainer.kwargs, []
    data: dict[str, Any] = {}
    for section in ("training", "parallelism", "compile"):
        value = kw.get(section)
        if value is not None:
            if not isinstance(value, Call):
                raise refuse(section, value, "expected a constructor call of literals")
            data[section] = dict(value.kwargs)
    data["activation_checkpoint"] = _checkpointing(kw, notes, refuse)
    if "model_spec" in kw:
        data["model"] = _model(kw["model_spec"], module, notes, refuse)
    if "optimizer" in kw:
        data["optimizer"] = _optimizer(kw["optimizer"], refuse)
    _tokens(data.setdefault("training", {}), data.get("parallelism", {}), notes, refuse)
    for name in kw:
        if name not in (*data, "model_spec", "loss") and name not in QUIET:
            data.setdefault("(unread)", []).append(name)
    return data, notes


def _checkpointing(kw: dict[str, Any], notes: list[str], refuse: Any) -> dict[str, Any]:
    if "activation_checkpoint" not in kw:
        notes.append("activation_checkpoint: not set, Trainer.Config's default "
                     "SelectiveAC.Config() (per-op SAC)")
        return dict(_AC["SelectiveAC.Config"])
    value = kw["activation_checkpoint"]
    if value is None:
        return {"mode": "none"}
    name = value.name.rsplit(".", 2)[-2:] if isinstance(value, Call) else None
    policy = _AC.get(".".join(name)) if name else None
    if policy is None:
        raise refuse("activation_checkpoint", value, "modelled are SelectiveAC.Config(), "
                     "FullAC.Config() and None")
    return dict(policy)


def _model(spec: Any, module: str, notes: list[str], refuse: Any) -> dict[str, Any]:
    """``model_registry(flavor, attn_backend=..., tp_gemm_backend=..., converters=[...])``
    (models/<module>/__init__.py)."""
    if not (isinstance(spec, Call) and spec.name.endswith("model_registry") and spec.args
            and isinstance(spec.args[0], str)):
        raise refuse("model_spec", spec, "expected model_registry(\"<flavor>\", ...); or "
                                         "give --model")
    out: dict[str, Any] = {"name": module, "flavor": spec.args[0]}
    for key, value in spec.kwargs.items():
        if key == "converters":
            names = [c.name if isinstance(c, Call) else c for c in value or []]
            unknown = [n for n in names if n not in _CONVERTERS]
            if unknown:
                raise refuse("model_spec converters", unknown[0],
                             f"known are {', '.join(_CONVERTERS)}")
            out["converters"] = [_CONVERTERS[n] for n in names]
            for conv in value or []:  # its recipe and filter (float8 linears: --float8)
                if isinstance(conv, Call) and conv.name == "Float8LinearConverter.Config":
                    out["float8_options"] = {k: conv.kwargs[k] for k in (
                        "recipe_name", "filter_fqns") if k in conv.kwargs}
        elif key == "attn_backend" and value in ("flex", "sdpa"):
            notes.append(f"model_spec attn_backend {value!r}: estimated as memplan's flash "
                         "attention (saves the output and the log-sum-exp per row)")
        elif key == "tp_gemm_backend":
            notes.append(f"model_spec tp_gemm_backend {value!r}: timing, no bytes modelled")
        else:
            raise refuse(f"model_spec {key}", value, "not modelled")
    if "attn_backend" not in spec.kwargs:
        notes.append("model_spec attn_backend: model_registry's default 'flex', estimated as "
                     "memplan's flash attention (saves the output and the log-sum-exp)")
    return out


def _optimizer(value: Any, refuse: Any) -> dict[str, Any]:
    """``default_adamw(lr=...)`` (components/optimizer/optimizer.py: an AdamW param group;
    OptimizersContainer.Config's implementation stays 'fused')."""
    if isinstance(value, Call) and value.name.endswith("default_adamw"):
        return {"name": "AdamW", "implementation": "fused"}
    if isinstance(value, Call) and value.name.endswith("OptimizersContainer.Config"):
        impl = value.kwargs.get("implementation", "fused")
        if "param_groups" in value.kwargs:
            raise refuse("optimizer param_groups", "...", "read are default_adamw(...) and "
                         "OptimizersContainer.Config(implementation=...)")
        return {"name": "AdamW", "implementation": impl}
    raise refuse("optimizer", value, "expected default_adamw(...)")


def _tokens(training: dict[str, Any], parallelism: dict[str, Any], notes: list[str],
            refuse: Any) -> None:
    """Later torchtitan sizes a micro-batch in tokens (config/configs.py TrainingConfig
    ``num_tokens_per_microbatch_per_dp_rank``, default 16384, packed into sequences of
    ``max_context_length``, default 2048; trainer.py: a step's tokens are ``num_tokens_per_
    train_step`` or those of every micro-batch of every DP rank): as sequences per
    micro-batch, the local batch and the global batch in sequences."""
    names = ("num_tokens_per_microbatch_per_dp_rank", "max_context_length",
             "num_tokens_per_train_step")
    if not any(n in training for n in names):
        return
    tokens = training.pop(names[0], 16384)
    context = training.pop(names[1], 2048)
    step = training.pop(names[2], -1)
    for key, value in zip(names, (tokens, context, step)):
        if not isinstance(value, int) or isinstance(value, bool):
            raise refuse(f"training.{key}", value, "expected int")
    if context < 1 or tokens % context:
        raise refuse("training.num_tokens_per_microbatch_per_dp_rank", tokens,
                     f"not a whole number of sequences of max_context_length {context}")
    mbs = tokens // context
    pp_mbs = parallelism.pop("num_pp_microbatches", 1)
    pp = parallelism.get("pipeline_parallel_degree", 1)
    n = pp_mbs if isinstance(pp, int) and pp > 1 else 1
    training["local_batch_size"], training["seq_len"] = mbs * n, context
    per_step = f"training.{names[0]}" + (" * parallelism.num_pp_microbatches" if n > 1 else "")
    aliases = {"training.local_batch_size": (per_step, tokens * n),
               "training.seq_len": (f"training.{names[1]}", context)}
    if n > 1:
        parallelism["pipeline_parallel_microbatch_size"] = mbs
        aliases["parallelism.pipeline_parallel_microbatch_size"] = (f"training.{names[0]}",
                                                                    tokens)
    if step != -1:
        if step % context:
            raise refuse("training.num_tokens_per_train_step", step,
                         f"not a whole number of sequences of {context} tokens")
        training["global_batch_size"] = step // context
        aliases["training.global_batch_size"] = (f"training.{names[2]}", step)
    training["(aliases)"] = aliases
    notes.append(f"training: {tokens} tokens per micro-batch per DP rank in packed sequences "
                 f"of {context}: {mbs} sequences"
                 + (f", {n} pipeline micro-batches a step" if n > 1 else ""))

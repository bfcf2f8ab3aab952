"""Megatron-LM launch arguments (``--megatron-args "..."`` or a file of them) as memplan's
inputs: the model's shape (a ``ModelSpec``), the layout, the batch, recompute, the
distributed optimizer and the precision.

The flags and their defaults are Megatron-LM's (megatron/training/arguments.py at commit
6e091e1b68c6856c9eeea3069cc167061c0acb64, which builds most of them from megatron-core's
dataclass fields: ``TransformerConfig.num_layers`` is ``--num-layers``; megatron-core 0.16
holds the same defaults); each rule cites the function it follows. A file is read as a
launch script's training command (``memplan.config_import.shell``: variables, arrays and
branches expanded as bash would, nothing run), else as shell words (comments and line
continuations allowed), a launcher and its own flags before the training script skipped
(``torchrun --nproc-per-node 8 pretrain_gpt.py``); or, when it holds a ``MODEL_ARGS:``
block, as Megatron-LM's own test configs (tests/functional_tests/test_cases/*/
model_config.yaml). Multi-token prediction, Megatron FSDP and the deferred output-layer
weight gradient are read in ``memplan.config_import.megatron_flags``.
"""

from __future__ import annotations

import ast
import math
import shlex
from pathlib import Path
from typing import Any

from memplan.arguments import MAX_GPUS
from memplan.config_import import megatron_flags, megatron_layout, shell
from memplan.config_import.imported import Imported
from memplan.errors import MemplanError, ValidationError, shown, validation_message
from memplan.inputs import MODEL_FILE_BYTES, read_text
from memplan.spec import MAX_LAYERS, ModelSpec

ARGS = "megatron/training/arguments.py"
# the longest --moe-layer-freq read: a list of MAX_LAYERS "0, " items fits; the parser's
# recursion and the list it builds stay small
MAX_PATTERN_CHARS = 4 * MAX_LAYERS + 64
# the largest integer argument read: every one memplan reads is a width, a count, a length
# or a degree, each bounded far lower where it is used (memplan.spec, memplan.workload);
# this bound comes first, before any list is built from one
MAX_INT_ARG = 2**31 - 1
# the GPT-2 BPE vocabulary (vocab.json: 50257 tokens), Megatron's GPT2BPETokenizer
GPT2_VOCAB = 50257
# Megatron-LM's training scripts for models other than GPTModel (the repository's root)
OTHER_MODELS = {"pretrain_bert.py": "BERT (an encoder)", "pretrain_t5.py": "T5 (encoder-decoder)",
                "pretrain_mamba.py": "a Mamba hybrid", "pretrain_hybrid.py": "a Mamba hybrid",
                "pretrain_vlm.py": "a vision-language model",
                "pretrain_vision_classify.py": "a vision model",
                "pretrain_retro.py": "RETRO", "pretrain_ict.py": "a retriever (ICT)"}
# flags that hold no GPU memory: logging, data paths, checkpoint files, schedules of the
# learning rate, seeds and tokenizer files (--vocab-size and --tokenizer-type are read). Any
# other flag memplan does not read is listed as not modelled, one that may change memory:
# fusions switched off (--no-bias-*-fusion, --no-masked-softmax-fusion,
# --no-gradient-accumulation-fusion), overlapped reductions and
# Megatron FSDP's --data-parallel-* are among them
QUIET_PREFIXES = ("--log-", "--lr", "--min-lr", "--save", "--load", "--eval-", "--tensorboard",
                  "--data-path", "--data-cache-path", "--split", "--train-iters",
                  "--train-samples", "--timing-", "--distributed-backend", "--weight-decay",
                  "--exit-", "--seed", "--ckpt-", "--dist-ckpt", "--no-ckpt-",
                  "--use-checkpoint-", "--mock-data", "--no-mmap-bin-files",
                  "--use-mcore-models", "--merge-file", "--init-method-std", "--adam-",
                  "--wandb", "--rotary-base", "--norm-epsilon", "--tokenizer-model",
                  "--vocab-file", "--padded-vocab-size",
                  "--no-load-", "--decoupled-", "--num-workers", "--tiktoken-",
                  "--distributed-timeout-minutes", "--clip-grad", "--deterministic-mode",
                  "--async-save", "--use-persistent-ckpt", "--verify-integrity")


def words(text: str, where: str = "Megatron arguments") -> list[str]:
    """Shell words of a launch command: comments dropped, lines joined. ``where`` names the
    arguments in a message (the file, or --megatron-args)."""
    try:  # a backslash before a newline continues the line, as in a shell
        return shlex.split(text.replace("\\\n", " "), comments=True)
    except ValueError as err:
        raise MemplanError(f"{where}: {err} (quote them as a shell would)") from err


def _scalar(text: str) -> Any:
    """A value as argparse's ``type=int`` or ``type=float`` would read it, else the text. A
    value no count or fraction can be is kept as its text, so the flag that reads it says
    "expected an integer": one of more digits than Python's ``int()`` reads (it raises, and
    ``float()`` would read it as inf), or one that reads as inf or nan."""
    low = text.strip().strip("'\"")
    if low.lower() in ("true", "false"):
        return low.lower() == "true"
    try:
        return int(low)
    except ValueError:
        pass
    try:
        value = float(low)
    except ValueError:
        return low
    return value if math.isfinite(value) else low


def parse(text: str, where: str) -> dict[str, Any]:
    """Flag -> value (True for a flag without one, a list for several values)."""
    if "MODEL_ARGS:" in text:
        return _model_args(text, where)
    # a launch script's training command as bash would expand it (arrays, variables,
    # branches; nothing run), else the text's words
    tokens = shell.training_command(text, where) or words(text, where)
    # the training script's flags follow it (torchrun's own come before it)
    script = next((i + 1 for i, t in enumerate(tokens) if t.endswith(".py")), 0)
    if script and Path(tokens[script - 1]).name in OTHER_MODELS:
        raise MemplanError(f"{where}: {Path(tokens[script - 1]).name} trains "
                           f"{OTHER_MODELS[Path(tokens[script - 1]).name]}, which memplan "
                           "does not model (it models pretrain_gpt.py's GPTModel)")
    start = next((i for i, t in enumerate(tokens) if i >= script and t.startswith("--")),
                 len(tokens))
    out: dict[str, Any] = {}
    flag = None
    for tok in tokens[start:]:
        if tok.startswith("--"):
            flag, _, value = tok.partition("=")
            out[flag] = _scalar(value) if value else True
            continue
        if flag is None:
            raise MemplanError(f"{where}: {tok!r} is not a flag")
        prev = out[flag]
        out[flag] = _scalar(tok) if prev is True else (
            [*prev, _scalar(tok)] if isinstance(prev, list) else [prev, _scalar(tok)])
    if not out:
        raise MemplanError(f"{where}: no --flags found")
    return out


def _model_args(text: str, where: str) -> dict[str, Any]:
    """The ``MODEL_ARGS:`` mapping of a Megatron-LM test config: one ``--flag: value`` per
    indented line (the one YAML form those files use)."""
    out: dict[str, Any] = {}
    inside = False
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        if not line.startswith((" ", "\t")):
            inside = line.strip() == "MODEL_ARGS:"
            continue
        if inside:
            flag, sep, value = line.split(" #")[0].strip().partition(":")
            if not sep or not flag.startswith("--"):
                raise MemplanError(f"{where}: line {n}: expected '--flag: value' under "
                                   f"MODEL_ARGS, got {line.strip()!r}")
            out[flag] = _scalar(value) if value.strip() else True
    return out


def read(given: str, gpus: int) -> Imported:
    """The inputs of Megatron-LM arguments: ``given`` is a file of them or the arguments."""
    path = Path(given)
    if not given.lstrip().startswith("-") and "\n" not in given and path.is_file():
        text, source = read_text(path, "Megatron arguments", MODEL_FILE_BYTES), str(path)
    else:
        text, source = given, "--megatron-args"
    args = parse(text, f"Megatron arguments {source}")
    imp = Imported(source=f"Megatron-LM arguments {source}")
    _Reader(args, imp, gpus).run()
    return imp


class _Reader:
    def __init__(self, args: dict[str, Any], imp: Imported, gpus: int) -> None:
        self.args, self.imp, self.gpus = args, imp, gpus
        self.used: set[str] = set()
        self.fsdp_main_grads: str | None = None  # Megatron FSDP's main-gradient dtype

    # --- typed access ---------------------------------------------------------------------
    def has(self, flag: str) -> bool:
        return flag in self.args and self.args[flag] is not False

    def int(self, flag: str, default: Any = None) -> Any:
        self.used.add(flag)
        value = self.args.get(flag, default)
        if value is not default and (isinstance(value, bool) or not isinstance(value, int)):
            raise self.imp.refuse(flag, value, "expected an integer")
        if value is not default and abs(value) > MAX_INT_ARG:  # read before any is built on
            raise self.imp.refuse(flag, value, f"expected an integer of at most {MAX_INT_ARG} "
                                               "(no width, count or length is larger)")
        return value

    def degree(self, flag: str, default: int | None) -> int | None:
        """A parallel degree: an integer from 1 to ``MAX_GPUS`` (or ``default``, None)."""
        value = self.int(flag, default)
        if value is not None and not 0 < value <= MAX_GPUS:
            raise self.refuse(flag, f"expected a degree from 1 to {MAX_GPUS}")
        return value

    def float(self, flag: str, default: float) -> float:
        self.used.add(flag)
        value = self.args.get(flag, default)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise self.imp.refuse(flag, value, "expected a number")
        return float(value)

    def str(self, flag: str, default: Any = None) -> Any:
        self.used.add(flag)
        value = self.args.get(flag, default)
        return value if value is default else str(value)

    def flag(self, flag: str) -> bool:
        self.used.add(flag)
        value = self.args.get(flag, False)
        if not isinstance(value, bool):
            raise self.imp.refuse(flag, value, "a switch takes no value (or true/false)")
        return value

    def refuse(self, flag: str, why: str) -> MemplanError:
        return self.imp.refuse(flag, self.args.get(flag), why)

    # --- the reading ----------------------------------------------------------------------
    def run(self) -> None:
        imp = self.imp
        imp.set("(framework)", "megatron", "framework", "megatron",
                "Megatron-LM's implementation defaults")
        self._refusals()
        tp = self.degree("--tensor-model-parallel-size", 1)  # before the vocabulary's padding
        spec = self._model(tp)
        imp.model = spec
        imp.set("(model shape)", spec.name, "model", spec.name, f"{spec.num_params:,} "
                "parameters")
        self._layout(spec, tp)
        self._workload(spec)
        for flag in self.args:
            if flag not in self.used and not flag.startswith(QUIET_PREFIXES):
                imp.unread.append(flag)

    def _refusals(self) -> None:
        """Settings that change the bytes in ways memplan does not model."""
        refused = {
            "--fp8": "fp8 training is not modelled",
            "--fp4-format": "fp4 training is not modelled",
            "--use-torch-fsdp2": "PyTorch FSDP2 under Megatron-LM is not modelled",
            "--cpu-offloading": "activation and weight CPU offloading is not modelled",
            "--hybrid-layer-pattern": "hybrid (Mamba) layers are not modelled",
            "--encoder-num-layers": "encoder-decoder models are not modelled",
            "--distribute-saved-activations": "saved activations split over TP are not "
                                              "modelled",
        }
        for flag, why in refused.items():
            self.used.add(flag)
            if self.has(flag):
                raise self.refuse(flag, why)
        self._loss_fusion()
        self._router_dtype()
        megatron_flags.mtp(self)
        megatron_flags.fp8(self)
        for flag in ("--exp-avg-dtype", "--exp-avg-sq-dtype"):
            if self.str(flag, "fp32") != "fp32":
                raise self.refuse(flag, "optimizer states below fp32 are not modelled")

    def _router_dtype(self) -> None:
        """--moe-router-dtype fp32: the router's matmul runs in fp32
        (megatron/core/transformer/moe/router.py TopKRouter.gating), through
        moe_utils.py RouterGatingLinearFunction, which saves the compute-dtype input and
        weight (no fp32 copies, unlike an autocast or transformers' fp32 router) and returns
        [tokens, experts] fp32 logits: memplan counts the router's probabilities in fp32
        already. fp64 is refused."""
        dtype = self.str("--moe-router-dtype", None)
        if dtype is None:
            return
        if dtype != "fp32":
            raise self.refuse("--moe-router-dtype", "modelled is fp32 (the router's "
                                                    "probabilities memplan counts in fp32)")
        self.imp.notes.append("--moe-router-dtype fp32: the router's fp32 logits, which "
                              "memplan counts as its fp32 probabilities; its saved input and "
                              "weight stay in the compute dtype (RouterGatingLinearFunction)")

    def _loss_fusion(self) -> None:
        """--cross-entropy-loss-fusion with the native implementation (the only one
        validate_args allows): megatron/core/fusions/fused_cross_entropy.py
        _VocabParallelCrossEntropy runs the unfused loss's steps (tensor_parallel/
        cross_entropy.py) through megatron/core/jit.py jit_fuser, torch.compile from torch
        2.2: its forward saves and holds the same tensors, and its compiled
        calculate_gradients makes the target's index_put on an fp32 copy of the softmax
        (``loss_impl`` megatron-fused; traced: tests/traced/test_megatron_loss.py)."""
        impl = self.str("--cross-entropy-fusion-impl", "native")
        if not self.flag("--cross-entropy-loss-fusion"):
            return
        if impl != "native":
            raise self.refuse("--cross-entropy-fusion-impl", "Transformer Engine's fused "
                                                             "cross-entropy is not modelled")
        self.imp.set("--cross-entropy-loss-fusion", True, "loss_impl", "megatron-fused",
                     "fused_cross_entropy.py compiled: the backward's index_put on an fp32 "
                     "copy of the softmax")

    def _vocab(self, tp: int) -> tuple[int, str]:
        """The padded vocabulary (megatron/core/tokenizers/utils/build_tokenizer.py
        vocab_size_with_padding: up to a multiple of make_vocab_size_divisible_by * tp) of
        the tokenizer's: NullTokenizer's --vocab-size (null_tokenizer.py), GPT2BPETokenizer's
        50257 (the default with --vocab-file); another tokenizer's vocabulary is in its files,
        which memplan reads as --vocab-size when given."""
        kind = self.str("--tokenizer-type", None)
        size = self.int("--vocab-size", None)
        if kind in (None, "GPT2BPETokenizer") and size is None and "--vocab-file" in self.args:
            size, how = GPT2_VOCAB, "GPT-2 BPE (vocab.json 50257)"
        elif size is not None:
            how = f"--vocab-size {size}" + (f" ({kind})" if kind else "")
        else:
            raise self.imp.refuse("--tokenizer-type", kind, "the vocabulary comes from the "
                                  "tokenizer's files: add --vocab-size N (the tokenizer's size)")
        multiple = self.int("--make-vocab-size-divisible-by", 128) * tp
        return math.ceil(size / multiple) * multiple, f"{how} padded to a multiple of {multiple}"

    def _model(self, tp: int) -> ModelSpec:
        """A GPTModel's shape (megatron-core TransformerConfig fields; the defaults of
        arguments.py validate_args: ffn 4h, or int(4h*2/3/64)*64 with --swiglu; kv_channels
        h / heads)."""
        layers, h = self.int("--num-layers"), self.int("--hidden-size")
        heads = self.int("--num-attention-heads")
        for flag, value in (("--num-layers", layers), ("--hidden-size", h),
                            ("--num-attention-heads", heads)):
            if value is None:
                raise self.imp.refuse(flag, None, "required for the model's shape")
        gated = self.flag("--swiglu")
        ffn = self.int("--ffn-hidden-size", None) or (int((4 * h * 2 / 3) / 64) * 64 if gated
                                                      else 4 * h)
        kv = self.int("--num-query-groups", heads) if self.flag("--group-query-attention") \
            else heads
        head_dim = self.int("--kv-channels", None) or h // heads
        vocab, vocab_how = self._vocab(tp)
        seq = self.int("--seq-length", None)
        max_seq = self.int("--max-position-embeddings", seq)
        norm = self.str("--normalization", "LayerNorm")
        if norm not in ("LayerNorm", "RMSNorm"):
            raise self.refuse("--normalization", "modelled are LayerNorm and RMSNorm")
        position = self._position()
        bias = not self.flag("--disable-bias-linear")
        hidden_dropout = self.float("--hidden-dropout", 0.1)
        fields: dict[str, Any] = dict(
            num_layers=layers, hidden_size=h, ffn_hidden_size=ffn, num_attention_heads=heads,
            num_kv_heads=kv, head_dim=head_dim, vocab_size=vocab, max_seq_len=max_seq,
            norm="rmsnorm" if norm == "RMSNorm" else "layernorm",
            norm_bias=norm == "LayerNorm", mlp="swiglu" if gated else "gelu",
            position=position,
            tied_embeddings=not self.flag("--untie-embeddings-and-output-weights"),
            qkv_bias=bias or self.flag("--add-qkv-bias"), attn_out_bias=bias, mlp_bias=bias,
            dropout=max(hidden_dropout, self.float("--attention-dropout", 0.1)),
            qk_norm="head" if self.flag("--qk-layernorm") else "none")
        self._activation()
        fields.update(self._mla(heads))
        moe = self._moe(layers, ffn)
        if moe:
            fields["moe"] = moe
        name = f"megatron-{layers}x{h}"
        try:
            return ModelSpec(name=name, source=f"{self.imp.source}: {vocab_how}", **fields)
        except ValidationError as err:  # a bound of the spec's: said for these arguments
            raise MemplanError(f"{self.imp.source}: {validation_message(err)}") from None

    def _activation(self) -> None:
        for flag in ("--squared-relu", "--quick-geglu", "--openai-gelu"):
            if self.flag(flag):
                raise self.refuse(flag, "modelled are GeLU and SwiGLU MLPs")

    def _position(self) -> str:
        kind = self.str("--position-embedding-type", "learned_absolute")
        if self.flag("--use-rotary-position-embeddings"):
            kind = "rope"
        if self.float("--rotary-percent", 1.0) != 1.0:
            raise self.refuse("--rotary-percent", "partial rotary embeddings are not modelled")
        kinds = {"learned_absolute": "learned", "rope": "rope", "none": "none"}
        if kind not in kinds:
            raise self.imp.refuse("--position-embedding-type", kind,
                                  f"modelled are {', '.join(kinds)}")
        return kinds[kind]

    def _mla(self, heads: int) -> dict[str, Any]:
        """--multi-latent-attention (megatron/core/transformer/multi_latent_attention.py):
        the query/key head is --qk-head-dim + --qk-pos-emb-head-dim, one KV head per query
        head."""
        if not self.flag("--multi-latent-attention"):
            return {}
        # Megatron's MLA builds q_layernorm / kv_layernorm on the low-rank latents only with
        # --qk-layernorm (megatron/core/models/gpt/gpt_layer_specs.py
        # get_gpt_layer_with_transformer_engine_spec); memplan's MLA always holds them
        if not self.flag("--qk-layernorm"):
            self.imp.notes.append("--multi-latent-attention without --qk-layernorm: memplan "
                                  "counts the latent norms Megatron does not build "
                                  "(q_lora_rank + kv_lora_rank weights per layer, and their "
                                  "saved inputs)")
        nope, rope = self.int("--qk-head-dim", 128), self.int("--qk-pos-emb-head-dim", 64)
        return {"head_dim": nope + rope, "num_kv_heads": heads, "qk_norm": "none",
                "mla": {"q_lora_rank": self.int("--q-lora-rank", None) or 0,
                        "kv_lora_rank": self.int("--kv-lora-rank", 32),
                        "qk_nope_head_dim": nope, "qk_rope_head_dim": rope,
                        "v_head_dim": self.int("--v-head-dim", 128)}}

    def _moe(self, layers: int, ffn: int) -> dict[str, Any] | None:
        """--num-experts and its companions (arguments.py _add_moe_args; megatron-core
        TransformerConfig moe_*): --moe-layer-freq 1, or a pattern of leading dense layers
        then MoE layers ("([0]*3+[1]*58)")."""
        experts = self.int("--num-experts", None)
        if not experts:
            return None
        moe: dict[str, Any] = {
            "num_experts": experts, "top_k": self.int("--moe-router-topk", 2),
            "expert_ffn_hidden_size": self.int("--moe-ffn-hidden-size", None) or ffn}
        shared = self.int("--moe-shared-expert-intermediate-size", None)
        if shared:
            moe.update(num_shared_experts=1, shared_expert_ffn_hidden_size=shared,
                       shared_expert_gate=self.flag("--moe-shared-expert-gate"))
        moe["first_dense_layers"] = self._dense_lead(layers)
        return moe

    def _dense_lead(self, layers: int) -> int:
        freq = self.args.get("--moe-layer-freq", 1)
        self.used.add("--moe-layer-freq")
        if freq in (1, "1"):
            return 0
        pattern = _bounded_pattern(freq, self.imp.source) if isinstance(freq, str) else None
        lead = pattern.index(1) if pattern and 1 in pattern else 0
        if (pattern is None or len(pattern) != layers or not lead  # (length first: no list
                or pattern != [0] * lead + [1] * (layers - lead)):  # as long as a bad count)
            raise self.refuse("--moe-layer-freq", f"modelled are 1 (every layer MoE) and "
                                                  f"leading dense layers then MoE layers, "
                                                  f"{layers} in all")
        return lead

    def _layout(self, spec: ModelSpec, tp: int) -> None:
        imp = self.imp
        pp = self.degree("--pipeline-model-parallel-size", 1)
        cp = self.degree("--context-parallel-size", 1)
        ep = self.degree("--expert-model-parallel-size", 1)
        # megatron-core ModelParallelConfig.expert_tensor_parallel_size: None is tp
        etp = self.degree("--expert-tensor-parallel-size", None)
        if etp is not None and etp != tp and spec.moe is None:
            # a dense GPTModel builds no expert layers: the expert groups parallel_state.py
            # initialize_model_parallel makes hold no tensors
            imp.notes.append(f"--expert-tensor-parallel-size {etp}: no effect on a dense model "
                             "(Megatron builds no expert layers to split)")
        elif etp is not None and etp != tp:
            imp.set("--expert-tensor-parallel-size", etp, "etp", etp,
                    f"the routed experts split by {etp}, the rest by tp {tp}")
        for flag, value, target in (("--tensor-model-parallel-size", tp, "tp"),
                                    ("--pipeline-model-parallel-size", pp, "pp"),
                                    ("--context-parallel-size", cp, "cp"),
                                    ("--expert-model-parallel-size", ep, "ep")):
            if value != 1 or flag in self.args:
                imp.set(flag, value, target, value)
        # Megatron's sequence parallelism is off unless asked for (TransformerConfig
        # sequence_parallel = False; validate_args turns it off at tp 1)
        sp = self.flag("--sequence-parallel") and tp > 1
        imp.set("--sequence-parallel", self.args.get("--sequence-parallel", False),
                "sequence_parallel", sp)
        self._pipeline_layout(spec.num_layers, pp)
        self._virtual(spec.num_layers, pp)
        self._uneven(spec.num_layers, pp)
        self._account(spec.num_layers, pp)
        dist = self.flag("--use-distributed-optimizer")
        if megatron_flags.megatron_fsdp(self):
            dist = False  # Megatron FSDP's strategy sets the ZeRO stage
        else:
            imp.set("--use-distributed-optimizer", dist, "zero", 1 if dist else 0,
                    "ZeRO-1: optimizer states sharded over DP" if dist else "")
        self._optimizer_instances(dist, tp * pp * cp)
        megatron_flags.deferred_wgrad(self, pp)
        if self.flag("--optimizer-cpu-offload"):
            if self.float("--optimizer-offload-fraction", 1.0) != 1.0:
                raise self.refuse("--optimizer-offload-fraction",
                                  "part of the optimizer offloaded is not modelled")
            imp.set("--optimizer-cpu-offload", True, "offload", "optimizer")

    def _optimizer_instances(self, dist: bool, model_parallel: int) -> None:
        """--num-distributed-optimizer-instances N: the distributed optimizer shards its
        states over dp * cp / N ranks and N instances hold the same shards
        (megatron/core/parallel_state.py initialize_model_parallel:
        intra_partial_data_parallel_size), memplan's shard group (--dp-shard dp / N, its
        shard degree dp_shard * cp)."""
        flag = "--num-distributed-optimizer-instances"
        instances = self.int(flag, 1)
        if instances == 1:
            return
        if not dist:
            raise self.refuse(flag, "needs --use-distributed-optimizer")
        dp = self.gpus // model_parallel if self.gpus % model_parallel == 0 else 0
        if instances < 1 or not dp or dp % instances:
            raise self.refuse(flag, f"modelled where it divides the data-parallel degree "
                                    f"({self.gpus} GPUs / tp*pp*cp {model_parallel})")
        self.imp.set(flag, instances, "dp_shard", dp // instances,
                     f"optimizer states sharded over dp {dp} / {instances} instances")

    def _pipeline_layout(self, layers: int, pp: int) -> None:
        """--pipeline-model-parallel-layout: the virtual stages and their decoder layers
        (``memplan.config_import.megatron_layout``); Megatron takes no other split flag with
        it (validate_args; TransformerConfig.__post_init__ raises for the first/last stage
        layers and the account-for flags)."""
        flag = "--pipeline-model-parallel-layout"
        text = self.str(flag, None)
        if text is None:
            return
        others = ("--num-layers-per-virtual-pipeline-stage",
                  "--num-virtual-stages-per-pipeline-rank",
                  "--decoder-first-pipeline-num-layers", "--decoder-last-pipeline-num-layers",
                  "--account-for-embedding-in-pipeline-split",
                  "--account-for-loss-in-pipeline-split")
        given = [f for f in others if self.has(f)]
        if given:
            raise self.refuse(flag, f"Megatron takes it with no other split flag ({given[0]})")
        try:
            vpp, split = megatron_layout.stage_split(
                text, pp, layers, self.int("--mtp-num-layers", None) or 0)
        except ValueError as err:
            raise self.refuse(flag, str(err)) from None
        if vpp > 1:
            self.imp.set(flag, text, "vpp", vpp, f"{len(split)} stages / pp {pp}")
        self.imp.set(flag, text, "stage_layers", ",".join(map(str, split)),
                     "decoder layers (t) of each stage")

    def _virtual(self, layers: int, pp: int) -> None:
        """arguments.py validate_args: num_layers_per_pipeline_stage //
        num_layers_per_virtual_pipeline_stage stages per rank. The interleaved schedule runs
        micro-batches in groups of pp per virtual stage (model_parallel_config.py
        microbatch_group_size_per_vp_stage, default pp) and raises when the last group has
        fewer than pp (pipeline_parallel/schedules.py forward_backward_pipelining_with_
        interleaving), so with the default the micro-batches per step divide by pp; another
        group size (--vpp-group) runs other counts and changes the warm-up micro-batches in
        flight (get_pp_rank_microbatches: (pp - rank - 1) * 2 + (chunks - 1) * group)."""
        per_virtual = self.int("--num-layers-per-virtual-pipeline-stage", None)
        stages = self.int("--num-virtual-stages-per-pipeline-rank", None)
        if per_virtual is not None:
            # the embedding and the loss count as layers of the split when accounted for
            # (validate_args)
            layers += sum(self.flag(f"--account-for-{part}-in-pipeline-split")
                          for part in ("embedding", "loss"))
            per_stage = layers // pp
            if layers % pp or per_stage % per_virtual:
                raise self.refuse("--num-layers-per-virtual-pipeline-stage",
                                  f"{layers} layers over pp {pp} do not split into "
                                  f"{per_virtual}-layer virtual stages")
            self.imp.set("--num-layers-per-virtual-pipeline-stage", per_virtual, "vpp",
                         per_stage // per_virtual, f"{per_stage} layers per rank / "
                                                   f"{per_virtual}")
        elif stages is not None:
            self.imp.set("--num-virtual-stages-per-pipeline-rank", stages, "vpp", stages)
        flag = "--microbatch-group-size-per-virtual-pipeline-stage"
        group = self.int(flag, None)
        if group is not None and group != pp and self.imp.inputs.get("vpp", 1) > 1:
            self.imp.set(flag, group, "vpp_group", group, "micro-batches per group of the "
                         "interleaved schedule (default pp)")

    def _account(self, layers: int, pp: int) -> None:
        """--account-for-embedding/loss-in-pipeline-split: the embedding (the loss) counts as
        one layer of the split, so the first (last) virtual stage builds one layer fewer
        (megatron/core/transformer/transformer_block.py get_num_layers_to_build: num_layers
        + 1 per flag over pp * vpp stages; the first virtual stage is chunk 0 of rank 0, the
        last chunk vpp-1 of rank pp-1, memplan's first and last --stage-layers entries)."""
        embedding = self.flag("--account-for-embedding-in-pipeline-split")
        loss = self.flag("--account-for-loss-in-pipeline-split")
        if not (embedding or loss):
            return
        flag = ("--account-for-embedding-in-pipeline-split" if embedding
                else "--account-for-loss-in-pipeline-split")
        if "stage_layers" in self.imp.inputs:  # Megatron asserts the same
            raise self.refuse(flag, "with --decoder-first/last-pipeline-num-layers Megatron "
                                    "does not take it")
        stages = pp * self.imp.inputs.get("vpp", 1)
        total = layers + embedding + loss
        if total % stages or (total // stages) < 1 + (embedding and loss and stages == 1):
            raise self.refuse(flag, f"{layers} layers + {embedding + loss} do not divide over "
                                    f"{stages} stages (Megatron asserts the same)")
        split = [total // stages] * stages
        split[0] -= embedding
        split[-1] -= loss
        self.imp.set(flag if not (embedding and loss) else "--account-for-embedding/loss-in-"
                     "pipeline-split", True, "stage_layers", ",".join(str(n) for n in split),
                     f"({layers} + {embedding + loss}) / {stages} per stage, one fewer on the "
                     + ("first and last" if embedding and loss else
                        "first" if embedding else "last"))

    def _uneven(self, layers: int, pp: int) -> None:
        """--decoder-first/last-pipeline-num-layers: the rest split evenly over the middle
        stages (megatron/core/transformer/transformer_block.py get_num_layers_to_build)."""
        first = self.int("--decoder-first-pipeline-num-layers", None)
        last = self.int("--decoder-last-pipeline-num-layers", None)
        if first is None and last is None:
            return
        if "vpp" in self.imp.inputs:
            raise self.refuse("--decoder-first-pipeline-num-layers",
                              "uneven first/last stages with virtual stages are not modelled")
        middle_stages = pp - (first is not None) - (last is not None)
        rest = layers - (first or 0) - (last or 0)
        if middle_stages < 0 or rest < 0 or (middle_stages and rest % middle_stages) or \
                (not middle_stages and rest):
            raise self.refuse("--decoder-first-pipeline-num-layers",
                              f"{layers} layers do not split over pp {pp} that way")
        even = [rest // middle_stages] * middle_stages if middle_stages else []
        split = ([first] if first is not None else []) + even + ([last] if last is not None
                                                                 else [])
        self.imp.set("--decoder-first/last-pipeline-num-layers", f"{first}/{last}",
                     "stage_layers", ",".join(str(n) for n in split))

    def _workload(self, spec: ModelSpec) -> None:
        imp = self.imp
        mbs = self.int("--micro-batch-size", 1)
        imp.set("--micro-batch-size", mbs, "micro_batch_size", mbs)
        gbs = self.int("--global-batch-size", None)
        if gbs is not None:
            imp.set("--global-batch-size", gbs, "global_batch_size", gbs)
        seq = self.int("--seq-length", None)
        if seq is None:
            raise self.imp.refuse("--seq-length", None, "required for the activations")
        imp.set("--seq-length", seq, "seq_len", seq)
        self._recompute()
        self._precision()
        optimizer = self.str("--optimizer", "adam")
        if optimizer not in ("adam", "sgd"):
            raise self.refuse("--optimizer", "modelled are adam and sgd")
        imp.set("--optimizer", optimizer, "optimizer", "adamw" if optimizer == "adam" else "sgd")
        impl = self.str("--transformer-impl", "transformer_engine")
        backend = self.str("--attention-backend", "auto")
        if impl == "local":  # megatron/core/transformer/dot_product_attention.py
            imp.set("--transformer-impl", impl, "attention", "eager", "scores materialised")
            imp.set("--transformer-impl", impl, "attention_global_buffer", True,
                    "its core attention's baddbmm input taken from Megatron's global memory "
                    "buffer, kept (DotProductAttention.forward)")
        else:
            eager = backend == "unfused"
            imp.set("--attention-backend", backend, "attention", "eager" if eager else "flash",
                    "scores materialised" if eager else "a fused kernel (flash / cuDNN)")
        if impl == "local":
            imp.notes.append("--transformer-impl local: Megatron's own (non-TE) layers; "
                             "memplan's megatron preset (fused norms) stands for them")
        self._grouped_gemm(impl == "local", spec)
        self._te_workspaces(impl == "local")
        self._softmax_fp32(impl == "local", spec, mbs, seq)

    def _te_workspaces(self, local: bool) -> None:
        """Transformer Engine's layers (--transformer-impl transformer_engine, the default)
        run their GEMMs on TE's own cuBLAS workspace, kept beside PyTorch's
        (``te_gemm_workspace``; memplan.overheads.te_gemm_workspace_bytes); --tp-comm-overlap
        (Userbuffers) adds TE's workspace for the overlapped GEMMs (``te_ub_workspace``).
        Userbuffers' own buffers are outside PyTorch's allocator: not counted."""
        if local:
            return
        self.imp.set("--transformer-impl", "transformer_engine", "te_gemm_workspace", True,
                     "Transformer Engine's cuBLAS workspace, 32 MiB + 1,024 B on Hopper, kept")
        if self.flag("--tp-comm-overlap"):
            self.str("--tp-comm-overlap-cfg", None)  # which GEMMs overlap: not their memory
            self.imp.set("--tp-comm-overlap", True, "te_ub_workspace", True,
                         "TE's Userbuffers GEMM workspace, 3 x (32 MiB + 1,024 B) on Hopper "
                         "(Userbuffers' communication buffers are outside PyTorch's "
                         "allocator: not counted)")

    def _grouped_gemm(self, local: bool, spec: ModelSpec) -> None:
        """--moe-grouped-gemm with Transformer Engine's layers: the experts are TEGroupedMLP
        (megatron/core/models/gpt/gpt_layer_specs.py, megatron-core 0.16.1), whose
        TEColumn/RowParallelGroupedLinear are TE's GroupedLinear, run by general_grouped_gemm
        on TE's four grouped-GEMM cuBLAS workspaces (``te_grouped_gemm``,
        memplan.overheads.te_grouped_gemm_workspace_bytes). With --transformer-impl local it
        is Megatron's GroupedMLP (the grouped_gemm package), which memplan does not model:
        left as not read."""
        if local or spec.moe is None or not self.has("--moe-grouped-gemm"):
            return
        if self.flag("--moe-grouped-gemm"):
            self.imp.set("--moe-grouped-gemm", True, "te_grouped_gemm", True,
                         "Transformer Engine's grouped GEMM: 4 cuBLAS workspaces kept "
                         "(transformer_engine/pytorch/cpp_extensions/gemm.py "
                         "get_cublas_workspace)")

    def _softmax_fp32(self, local: bool, spec: ModelSpec, mbs: int, seq: int) -> None:
        """--attention-softmax-in-fp32 is read only by Megatron's own core attention
        (megatron/core/transformer/dot_product_attention.py, --transformer-impl local: its
        FusedScaleMaskSoftmax); Transformer Engine's attention, unfused too, keeps its own
        softmax (transformer_engine/pytorch/attention/dot_product_attention/softmax.py).
        Megatron's fused kernel, where it runs, takes and saves 16-bit scores whatever the
        flag; its PyTorch fallback (fused_softmax.py forward_torch_softmax) upcasts, saves
        the fp32 softmax and casts it back: memplan's ``softmax_fp32``."""
        flag = "--attention-softmax-in-fp32"
        if not self.flag(flag):
            return
        low = self.imp.inputs.get("precision") in ("bf16-fp32-grads", "bf16-mixed",
                                                   "fp16-mixed")
        if not local or not low or self.imp.inputs.get("attention") != "eager":
            self.imp.notes.append(f"{flag}: no effect here (read only by Megatron's own "
                                  "attention with 16-bit scores, dot_product_attention.py)")
            return
        heads = spec.num_attention_heads // self.imp.inputs.get("tp", 1)
        if not self.flag("--no-masked-softmax-fusion") and _fused_softmax(mbs, heads, seq):
            self.imp.notes.append(f"{flag}: no effect here (Megatron's fused softmax kernel "
                                  "runs: fused_softmax.py is_kernel_available)")
            return
        self.imp.set(flag, True, "softmax_fp32", True, "the PyTorch softmax fallback in fp32 "
                     "(fused_softmax.py forward_torch_softmax)")

    def _recompute(self) -> None:
        """--recompute-activations is selective (validate_args); full needs a method:
        uniform with 1 layer per checkpoint is every layer, block with N is the first N of a
        stage (megatron/core/transformer/transformer_block.py _checkpointed_forward)."""
        imp = self.imp
        gran = "selective" if self.flag("--recompute-activations") else self.str(
            "--recompute-granularity", None)
        method = self.str("--recompute-method", None)
        layers = self.int("--recompute-num-layers", None)
        if gran is None:
            imp.set("--recompute-granularity", None, "recompute", "none")
        elif gran == "selective":
            imp.set("--recompute-granularity", gran, "recompute", "selective",
                    "the attention core")
        elif gran == "full" and method == "uniform" and layers == 1:
            imp.set("--recompute-method/num-layers", "uniform/1", "recompute", "full")
        elif gran == "full" and method == "block" and layers:
            imp.set("--recompute-granularity", gran, "recompute", "full")
            imp.set("--recompute-method/num-layers", f"block/{layers}", "recompute_layers",
                    layers, "the first N layers of each stage")
        else:
            raise imp.refuse("--recompute-granularity/method/num-layers",
                             f"{gran}/{method}/{layers}",
                             "modelled are selective, full uniform 1, and full block N")

    def _precision(self) -> None:
        """arguments.py validate_args: --bf16 accumulates and all-reduces gradients in fp32
        (main gradients) unless --main-grads-dtype bf16 or --grad-reduce-in-bf16; --fp16 keeps
        fp16 gradients unless
        --accumulate-allreduce-grads-in-fp32; neither is fp32."""
        imp = self.imp
        main = self.str("--main-grads-dtype", "fp32")
        # validate_args: --grad-reduce-in-bf16 turns accumulate_allreduce_grads_in_fp32 off,
        # so DDP's grad_reduce_in_fp32 is off and the gradient buffers take the parameters'
        # bf16 (megatron/core/distributed/distributed_data_parallel.py)
        if self.flag("--grad-reduce-in-bf16") and self.flag("--bf16"):
            main = "bf16"
        if self.fsdp_main_grads is not None:  # Megatron FSDP's own main-gradient dtype
            main = self.fsdp_main_grads
        elif self.imp.inputs.get("fsdp_units") == "buckets":  # "auto": the weights' dtype
            main = "bf16"
        fp32_acc = self.flag("--accumulate-allreduce-grads-in-fp32")
        if self.flag("--bf16"):
            imp.set("--bf16", True, "precision", "bf16-fp32-grads" if main == "fp32"
                    else "bf16-mixed", "bf16 weights, fp32 master and optimizer states, "
                    + ("fp32 main gradients" if main == "fp32" else "bf16 gradients"))
        elif self.flag("--fp16"):
            if fp32_acc:
                raise self.refuse("--accumulate-allreduce-grads-in-fp32",
                                  "fp16 weights with fp32 main gradients are not modelled")
            imp.set("--fp16", True, "precision", "fp16-mixed",
                    "fp16 weights and gradients, fp32 master and optimizer states")
        else:
            imp.set("(no --bf16 / --fp16)", None, "precision", "fp32")


def _fused_softmax(b: int, heads: int, seq: int) -> bool:
    """Whether Megatron's causal fused softmax kernel runs on [b, heads, seq, seq] scores
    (megatron/core/fusions/fused_softmax.py FusedScaleMaskSoftmax.is_kernel_available: 16 <
    sk <= 4096, sq and sk multiples of 4, b * heads a multiple of 4 and of the kernel's
    batches per block: 128 threads over warps of min(32, sk's next power of two), two
    batches per warp up to 128 keys; the same formula as Transformer Engine's
    FusedScaleMaskSoftmax.get_batch_per_block)."""
    if not (16 < seq <= 4096 and seq % 4 == 0 and (b * heads) % 4 == 0):
        return False
    pow2 = 1 << (seq - 1).bit_length()
    per_block = (128 // min(pow2, 32)) * (2 if pow2 <= 128 else 1)
    return (b * heads) % per_block == 0


def _pattern(text: str) -> list[int] | None:
    """A --moe-layer-freq pattern such as "([0]*3+[1]*58)": lists of 0/1, + and *, nothing
    else evaluated."""
    try:
        tree = ast.parse(text.strip(), mode="eval")
    except SyntaxError:
        return None

    def value(node: ast.AST) -> Any:
        if isinstance(node, ast.Expression):
            return value(node.body)
        if isinstance(node, ast.List):
            items = [value(e) for e in node.elts]
            return items if all(i in (0, 1) for i in items) else None
        if isinstance(node, ast.Constant) and isinstance(node.value, int):
            return node.value
        if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Mult)):
            left, right = value(node.left), value(node.right)
            if left is None or right is None:
                return None
            if isinstance(node.op, ast.Add):
                return left + right if isinstance(left, list) == isinstance(right, list) \
                    else None
            if not (isinstance(left, list) and isinstance(right, int) and right >= 0):
                return None  # only a list repeated is a pattern (not 3*4, [0]*-1, [0]*[1])
            if len(left) * right > MAX_LAYERS:  # a layer pattern: one per layer
                raise ValueError(f"a pattern of more than {MAX_LAYERS} layers (memplan's "
                                 "limit)")
            return left * right
        return None

    result = value(tree)
    return result if isinstance(result, list) else None


def _bounded_pattern(text: str, where: str) -> list[int] | None:
    """``_pattern``, its size checked before any list is made: one line (naming ``where``,
    the arguments' source) for a pattern longer than a model can be (``[0]*4096*4096*4096``
    would ask for 2^36 items)."""
    if len(text) > MAX_PATTERN_CHARS:
        raise MemplanError(f"{where}: --moe-layer-freq is {len(text):,} characters long, over "
                           f"the {MAX_PATTERN_CHARS:,} a pattern of {MAX_LAYERS} layers needs")
    try:
        return _pattern(text)
    except ValueError as err:
        raise MemplanError(f"{where}: --moe-layer-freq {shown(text)} is {err}") from None
    except RecursionError:  # a chain of thousands of + parses as a tree as deep
        raise MemplanError(f"{where}: --moe-layer-freq {shown(text)} nests deeper than "
                           "Python's parser reads: write a run of layers as [0]*N") from None


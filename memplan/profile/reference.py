"""The reference decoder-only transformer, built from any ``ModelSpec``.

It is the model memplan's analytic terms are written against and the one GPU calibration runs:
Llama family (RMSNorm, RoPE, GQA through ``F.scaled_dot_product_attention``, SwiGLU), GPT family
(LayerNorm, learned positions, GELU, dropout) and MoE blocks (top-k router, experts). The
implementation choices that change what autograd saves are parameters (``RefOptions``): norm
upcast to fp32 or one fused kernel, flash (SDPA) or eager attention, loss on fp32 logits or not,
recompute none / selective (attention core) / full / full for k of L layers through
non-reentrant ``torch.utils.checkpoint``, and the loss on all tokens at once or chunked.

Weights are created directly in the target dtype (under ``FakeTensorMode`` a later ``.to()``
would allocate a second copy) with a deterministic small init; nothing is downloaded.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts

from memplan.spec import MlpKind, ModelSpec, NormKind, PositionKind
from memplan.workload import Attention, NormImpl, Recompute


@dataclass(frozen=True)
class RefOptions:
    dtype: torch.dtype = torch.bfloat16
    norm_impl: NormImpl = NormImpl.UPCAST
    attention: Attention = Attention.FLASH
    logits_fp32: bool = True
    recompute: Recompute = Recompute.NONE
    recompute_layers: int | None = None  # with FULL: only the first k layers
    recompute_every: int | None = None  # with FULL: only every n-th layer (the n-th, 2n-th...)
    loss_chunks: int = 1  # > 1: head and loss per chunk of tokens, each checkpointed
    torchtune_chunks: bool = False  # loss_chunks as torchtune's chunked output and loss
    compile_loss: bool = False  # torchtune's own chunked loss, its cross-entropy compiled;
    #                             without torchtune_chunks torchtitan's loss compiled whole
    norm_eps: float = 1e-5
    # recompute ops: each layer's selective checkpointing policy (``memplan.profile.
    # sac_policy``), one per layer index
    policy_fns: tuple | None = None


class FusedRMSNorm(torch.autograd.Function):
    """RMSNorm as a fused kernel saves it (Apex, Transformer Engine, Liger): its input and one
    fp32 rstd per row. PyTorch's CPU ``F.rms_norm`` decomposes into upcast ops, so the reference
    model uses this instead. Its forward allocates only its output; its backward holds the
    weighted gradient, the normalised input and one product (three compute-dtype tensors) at
    its peak, which ``memplan.model.norm`` counts. The reductions accumulate in fp32."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        h = x.shape[-1]
        norm = torch.linalg.vector_norm(x, dim=-1, keepdim=True, dtype=torch.float32)
        rstd = torch.rsqrt(norm.pow(2) / h + eps)
        out = x * rstd.to(x.dtype)
        out.mul_(weight)
        ctx.save_for_backward(x, weight, rstd)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, weight, rstd = ctx.saved_tensors
        h = x.shape[-1]
        r = rstd.to(x.dtype)
        weighted = grad * weight
        normed = x * r
        grad_w = (grad * normed).sum(dim=tuple(range(grad.dim() - 1)), dtype=torch.float32)
        dot = (weighted * normed).sum(-1, keepdim=True, dtype=torch.float32)
        normed.mul_((dot / h).to(x.dtype))
        weighted.sub_(normed).mul_(r)
        return weighted, grad_w.to(weight.dtype), None


class Norm(nn.Module):
    """RMSNorm or LayerNorm. ``upcast``: Hugging Face style, normalise an fp32 copy, cast back,
    then apply the affine weight in the compute dtype. ``upcast-fp32``: litgpt style, the
    weight multiplies the fp32 normalised tensor before the cast back. ``fused``: one aten
    kernel."""

    def __init__(self, spec: ModelSpec, opts: RefOptions, device: torch.device | str) -> None:
        super().__init__()
        h = spec.hidden_size
        self.kind, self.impl, self.eps = spec.norm, opts.norm_impl, opts.norm_eps
        self.weight = nn.Parameter(torch.ones(h, dtype=opts.dtype, device=device))
        self.bias = (nn.Parameter(torch.zeros(h, dtype=opts.dtype, device=device))
                     if spec.norm_bias else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.shape[-1]
        if self.impl is NormImpl.FUSED:
            if self.kind is NormKind.LAYERNORM:
                return F.layer_norm(x, (h,), self.weight, self.bias, self.eps)
            return FusedRMSNorm.apply(x, self.weight, self.eps)
        xf = x.float()
        if self.kind is NormKind.LAYERNORM:
            normed = F.layer_norm(xf, (h,), None, None, self.eps)
        else:
            normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.impl is NormImpl.UPCAST_FP32:  # litgpt: the weight multiplies in fp32
            out = normed * self.weight.float()
            if self.bias is not None:
                out = out + self.bias.float()
            return out.to(x.dtype)
        out = self.weight * normed.to(x.dtype)
        return out + self.bias if self.bias is not None else out


def dropout(x: torch.Tensor, p: float, training: bool) -> torch.Tensor:
    """Dropout that saves a 1-byte bool mask on every device, as CUDA's fused kernel does
    (``F.dropout`` on CPU falls back to multiplying by a noise tensor in the input dtype)."""
    if not training or p == 0.0:
        return x
    return torch.native_dropout(x, p, True)[0]


def _linear(d_in: int, d_out: int, bias: bool, opts: RefOptions, device) -> nn.Linear:
    layer = nn.Linear(d_in, d_out, bias=bias, dtype=opts.dtype, device=device)
    return layer


def rope_tables(seq: int, head_dim: int, dtype: torch.dtype, device, base: float = 10000.0):
    """cos and sin of shape (seq, head_dim), the Llama convention (halves rotated)."""
    inv = 1.0 / (base ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32)
                          / head_dim))
    angles = torch.outer(torch.arange(seq, device=device, dtype=torch.float32), inv)
    emb = torch.cat((angles, angles), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return x * cos + _rotate_half(x) * sin


class SelfAttention(nn.Module):
    def __init__(self, spec: ModelSpec, opts: RefOptions, device) -> None:
        super().__init__()
        h = spec.hidden_size
        self.spec, self.opts = spec, opts
        self.q_proj = _linear(h, spec.q_size, spec.qkv_bias, opts, device)
        self.k_proj = _linear(h, spec.kv_size, spec.qkv_bias, opts, device)
        self.v_proj = _linear(h, spec.kv_size, spec.qkv_bias, opts, device)
        self.o_proj = _linear(spec.q_size, h, spec.attn_out_bias, opts, device)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None,
                mask: torch.Tensor | None) -> torch.Tensor:
        b, s, _ = x.shape
        d = self.spec.head_dim
        # Head counts come from the projections' widths, not the spec: under tensor parallelism
        # q/k/v are column-sharded and each rank computes only its heads / tp.
        q = self.q_proj(x).view(b, s, -1, d).transpose(1, 2)
        k = self.k_proj(x).view(b, s, -1, d).transpose(1, 2)
        v = self.v_proj(x).view(b, s, -1, d).transpose(1, 2)
        if rope is not None:
            q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        if self.opts.recompute is Recompute.SELECTIVE:
            out = checkpoint(self._core, q, k, v, mask, use_reentrant=False)
        else:
            out = self._core(q, k, v, mask)
        return self.o_proj(out.transpose(1, 2).reshape(b, s, -1))

    def _core(self, q, k, v, mask):
        if self.opts.attention is Attention.FLASH:
            from torch.nn.attention import SDPBackend, sdpa_kernel

            with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
                return F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                                      enable_gqa=q.shape[1] != k.shape[1])
        rep = q.shape[1] // k.shape[1]
        if rep > 1:  # eager GQA repeats K and V to every query head (as Hugging Face does)
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        scores = torch.matmul(q, k.transpose(-1, -2)) * (1.0 / math.sqrt(q.shape[-1])) + mask
        probs = F.softmax(scores, dim=-1)
        probs = dropout(probs, self.spec.dropout, self.training)
        return torch.matmul(probs, v)


class MLP(nn.Module):
    def __init__(self, spec: ModelSpec, ffn: int, opts: RefOptions, device) -> None:
        super().__init__()
        h, bias = spec.hidden_size, spec.mlp_bias
        self.kind = spec.mlp
        self.up = _linear(h, ffn, bias, opts, device)
        self.gate = _linear(h, ffn, bias, opts, device) if spec.mlp.gated else None
        self.down = _linear(ffn, h, bias, opts, device)

    def _act(self, x: torch.Tensor) -> torch.Tensor:
        if self.kind is MlpKind.RELU:
            return F.relu(x)
        if self.kind is MlpKind.SWIGLU:
            return F.silu(x)
        return F.gelu(x, approximate="tanh")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate is not None:
            return self.down(self._act(self.gate(x)) * self.up(x))
        return self.down(self._act(self.up(x)))


class ClampedExpert(nn.Module):
    """GPT-OSS's expert (``MoESpec.clamped_swiglu``: transformers 5.3 models/gpt_oss/
    modeling_gpt_oss.py GptOssExperts.forward's per-expert branch and ``_apply_gate``): one
    gate/up projection h -> 2f, biased where ``ModelSpec.mlp_bias`` (``current_state @
    self.gate_up_proj[expert_idx] + self.gate_up_proj_bias[expert_idx]``, here one linear,
    as memplan's terms count it: ``moe.expert.gate_up``), the gate and up halves interleaved
    (views), ``gate.clamp(max=limit)``, ``up.clamp(-limit, limit)``, ``gate *
    sigmoid(gate * alpha)``, ``(up + 1) * glu`` and the down projection f -> h, biased alike.
    ``alpha`` 1.702 and ``limit`` 7.0 as GptOssExperts.__init__ sets them."""

    alpha, limit = 1.702, 7.0

    def __init__(self, spec: ModelSpec, ffn: int, opts: RefOptions, device) -> None:
        super().__init__()
        h, bias = spec.hidden_size, spec.mlp_bias
        self.gate_up = _linear(h, 2 * ffn, bias, opts, device)
        self.down = _linear(ffn, h, bias, opts, device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up(x)
        gate, up = gate_up[..., ::2], gate_up[..., 1::2]
        gate = gate.clamp(min=None, max=self.limit)
        up = up.clamp(min=-self.limit, max=self.limit)
        glu = gate * torch.sigmoid(gate * self.alpha)
        return self.down((up + 1) * glu)


class Fp32Linear(nn.Linear):
    """A router's linear on fp32 copies of its input and weight (``MoESpec.router_fp32``:
    transformers 5.3 models/deepseek_v3/modeling_deepseek_v3.py DeepseekV3TopkRouter.forward,
    ``F.linear(hidden_states.type(torch.float32), self.weight.type(torch.float32))``), which
    the linear saves; its logits fp32. A module, so that forward hooks see its logits."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x, weight = x.float(), self.weight.float()  # (the casts in this order)
        return F.linear(x, weight, None if self.bias is None else self.bias.float())


class MoE(nn.Module):
    """Top-k router over a list of expert MLPs, as the spec's router fields say (``_route``:
    Mixtral's softmax in fp32 with renormalised weights unless a field names another), the
    weights cast to the block's dtype; GPT-OSS's clamped experts where the spec says so
    (``ClampedExpert``); shared experts after the loop, behind a sigmoid gate
    where the spec has one."""

    def __init__(self, spec: ModelSpec, opts: RefOptions, device) -> None:
        super().__init__()
        moe = spec.moe
        assert moe is not None
        self.moe, self.top_k = moe, moe.top_k
        self.router = (Fp32Linear if moe.router_fp32 else nn.Linear)(
            spec.hidden_size, moe.num_experts, bias=moe.router_bias, dtype=opts.dtype,
            device=device)
        expert = ClampedExpert if moe.clamped_swiglu else MLP
        self.experts = nn.ModuleList(
            expert(spec, moe.expert_ffn_hidden_size, opts, device)
            for _ in range(moe.num_experts))
        self.shared = (MLP(spec, moe.num_shared_experts * moe.shared_expert_ffn_hidden_size,
                           opts, device) if moe.num_shared_experts else None)
        # Qwen2-MoE's shared_expert_gate (models/qwen2_moe/modeling_qwen2_moe.py
        # Qwen2MoeSparseMoeBlock.__init__: nn.Linear(hidden_size, 1, bias=False))
        self.shared_gate = (_linear(spec.hidden_size, 1, False, opts, device)
                            if self.shared is not None and moe.shared_expert_gate else None)

    def _route(self, flat: torch.Tensor, dtype: torch.dtype
               ) -> tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, ...]]:
        """(the top-k weights in ``dtype``, the chosen experts, the tensors the block binds to
        its end). Mixtral's (models/mixtral/modeling_mixtral.py MixtralTopKRouter.forward):
        the fp32 softmax of the logits (bound), its top-k renormalised; with
        ``router_norm_clamped`` by their sum clamped from below (ERNIE 4.5's
        Ernie4_5_MoeTopKRouter.forward, ``torch.clamp(..., min=self.norm_min)``, 1e-12 in
        Ernie4_5_MoeConfig). With ``router_topk_softmax`` the softmax of the top-k logits
        alone, in their dtype (GPT-OSS's GptOssTopKRouter.forward); ``router_logits_fp32``
        casts the logits to fp32 first (Granite's GraniteMoeTopKRouter.forward,
        ``F.linear(x, w).float()``), which the block binds, as ``router_logits_held``'s
        (Ernie4_5_MoeSparseMoeBlock.forward's ``_``); ``router_fp32``: ``Fp32Linear``. The
        weights' cast to ``dtype`` is ``router_weights_cast``'s (Granite's ``.type_as``,
        ERNIE's ``.to``), which the reference makes whatever the spec says."""
        moe = self.moe
        logits = self.router(flat)
        if moe.router_logits_fp32:
            logits = logits.float()
        held = (logits,) if moe.router_logits_fp32 or moe.router_logits_held else ()
        if moe.router_topk_softmax:
            top, chosen = torch.topk(logits, self.top_k, dim=-1)
            del logits
            return F.softmax(top, dim=-1, dtype=top.dtype).to(dtype), chosen, held
        probs = F.softmax(logits, dim=-1, dtype=torch.float32)
        del logits
        weights, chosen = torch.topk(probs, self.top_k, dim=-1)
        total = weights.sum(dim=-1, keepdim=True)
        if moe.router_norm_clamped:
            total = torch.clamp(total, min=1e-12)
        return (weights / total).to(dtype), chosen, held + (probs,)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        flat = x.reshape(b * s, h)
        weights, chosen, _held = self._route(flat, x.dtype)
        out = torch.zeros_like(flat)
        for e, expert in enumerate(self.experts):
            rows, slot = torch.where(chosen == e)
            if rows.numel() == 0:
                continue
            y = expert(flat[rows]) * weights[rows, slot, None]
            out = out.index_add(0, rows, y)
        if self.shared is not None:
            shared = self.shared(flat)
            if self.shared_gate is not None:
                # Qwen2MoeSparseMoeBlock.forward: F.sigmoid(self.shared_expert_gate(
                # hidden_states)) * shared_expert_output, the shared output made first
                shared = torch.sigmoid(self.shared_gate(flat)) * shared
            out = out + shared
        return out.view(b, s, h)


class Block(nn.Module):
    def __init__(self, spec: ModelSpec, opts: RefOptions, index: int, device) -> None:
        super().__init__()
        self.dropout = spec.dropout
        self.attn_norm = Norm(spec, opts, device)
        self.attn = SelfAttention(spec, opts, device)
        self.mlp_norm = Norm(spec, opts, device)
        self.mlp = (MoE(spec, opts, device) if spec.is_moe_layer(index)
                    else MLP(spec, spec.ffn_hidden_size, opts, device))

    def forward(self, x, rope, mask):
        x = x + dropout(self.attn(self.attn_norm(x), rope, mask), self.dropout, self.training)
        return x + dropout(self.mlp(self.mlp_norm(x)), self.dropout, self.training)


class ReferenceModel(nn.Module):
    """Embedding, blocks, final norm, head, cross-entropy loss. ``forward(ids, targets)``."""

    def __init__(self, spec: ModelSpec, opts: RefOptions | None = None,
                 device: torch.device | str = "cpu") -> None:
        super().__init__()
        opts = opts or RefOptions()
        if opts.recompute is Recompute.OPS and opts.policy_fns is None:
            from memplan.errors import MemplanError

            raise MemplanError("recompute ops: the reference model runs it only where its "
                               "layers' policies are given (memplan trace; memplan.profile."
                               "sac_policy), not here")
        self.spec, self.opts = spec, opts
        h = spec.hidden_size
        self.embed = nn.Embedding(spec.vocab_size, h, dtype=opts.dtype, device=device)
        self.pos_embed = (nn.Embedding(spec.max_seq_len, h, dtype=opts.dtype, device=device)
                          if spec.position is PositionKind.LEARNED else None)
        self.blocks = nn.ModuleList(Block(spec, opts, i, device) for i in range(spec.num_layers))
        self.final_norm = Norm(spec, opts, device)
        self.head = (None if spec.tied_embeddings
                     else _linear(h, spec.vocab_size, False, opts, device))
        if opts.compile_loss:
            self._compiled_loss = (_torchtune_compiled_loss(opts.loss_chunks)
                                   if opts.torchtune_chunks
                                   else torch.compile(titan_cross_entropy_loss))

    def _full_recompute(self, index: int) -> bool:
        if self.opts.recompute is not Recompute.FULL:
            return False
        k, every = self.opts.recompute_layers, self.opts.recompute_every
        if every is not None:
            return (index + 1) % every == 0
        return k is None or index < k

    def forward(self, ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        spec, opts = self.spec, self.opts
        b, s = ids.shape
        x = self.embed(ids)
        if self.pos_embed is not None:
            x = x + self.pos_embed(torch.arange(s, device=ids.device))
        x = dropout(x, spec.dropout, self.training)
        rope = (rope_tables(s, spec.head_dim, opts.dtype, ids.device)
                if spec.position is PositionKind.ROPE else None)
        mask = None
        if opts.attention is Attention.EAGER:
            mask = torch.full((s, s), float("-inf"), dtype=opts.dtype, device=ids.device).triu(1)
        for i, block in enumerate(self.blocks):
            if self._full_recompute(i):
                x = checkpoint(block, x, rope, mask, use_reentrant=False)
            elif opts.policy_fns is not None:
                context = functools.partial(create_selective_checkpoint_contexts,
                                            opts.policy_fns[i])
                x = checkpoint(block, x, rope, mask, use_reentrant=False, context_fn=context)
            else:
                x = block(x, rope, mask)
        x = self.final_norm(x)
        if opts.torchtune_chunks:
            # the model's output (its list of logits chunks) is held by the loop while the loss
            # runs and dropped after it (``del logits``); the hidden state is not
            logits = self._chunked_output(x)
            del x
            if opts.compile_loss:
                return self._compiled_loss(logits, targets)
            return ce_with_chunked_output(logits, targets, opts.loss_chunks)
        if opts.compile_loss:  # torchtitan's loop: ``pred = model(inputs)``, then the loss
            return self._compiled_loss(self._logits(x), targets)
        if opts.loss_chunks == 1:
            return self._loss(x, targets, "mean")
        # Chunked cross-entropy: each chunk's logits exist only inside its checkpointed region
        # (and again when its backward recomputes them); the sum over chunks is divided once.
        total = None
        for xc, tc in zip(x.view(b * s, -1).chunk(opts.loss_chunks),
                          targets.view(b * s).chunk(opts.loss_chunks)):
            part = checkpoint(self._loss, xc, tc, "sum", use_reentrant=False)
            total = part if total is None else total + part
        return total / (b * s)

    def _chunked_output(self, h: torch.Tensor) -> list[torch.Tensor]:
        """torchtune 0.6.1's ``TransformerDecoder.chunked_output``: the output projection on
        each chunk of the sequence (dim 1), in the compute dtype."""
        head = ((lambda c: F.linear(c, self.embed.weight)) if self.head is None
                else self.head)
        return [head(chunk) for chunk in h.chunk(self.opts.loss_chunks, dim=1)]

    def _logits(self, x: torch.Tensor) -> torch.Tensor:
        # The head is called as a module (not F.linear on its weight) so that tensor-parallel
        # styles, which are module hooks, apply to it.
        return F.linear(x, self.embed.weight) if self.head is None else self.head(x)

    def _loss(self, x: torch.Tensor, targets: torch.Tensor, reduction: str) -> torch.Tensor:
        logits = self._logits(x)
        if self.opts.logits_fp32:
            logits = logits.float()
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.reshape(-1),
                               reduction=reduction)


def titan_cross_entropy_loss(pred: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """torchtitan's ``cross_entropy_loss`` (torchtitan/components/loss.py at e7c0cae),
    statement for statement; ``build_cross_entropy_loss`` compiles it when the job compiles."""
    return F.cross_entropy(pred.flatten(0, 1).float(), labels.flatten(0, 1))


def _torchtune_compiled_loss(chunks: int):
    """torchtune's own ``CEWithChunkedOutputLoss`` after ``training.compile_loss``
    (torchtune/training/_compile.py: its ``compute_cross_entropy`` replaced by its
    ``torch.compile``, the Inductor backend)."""
    try:
        from torchtune.modules.loss import CEWithChunkedOutputLoss
        from torchtune.training import compile_loss
    except ImportError as exc:
        from memplan.errors import MemplanError

        raise MemplanError(f"compile_loss traces run torchtune's own loss: {exc}") from exc
    return compile_loss(CEWithChunkedOutputLoss(chunks), verbose=False)


def ce_with_chunked_output(logits: list[torch.Tensor], labels: torch.Tensor, chunks: int,
                           ignore_index: int = -100) -> torch.Tensor:
    """torchtune 0.6.1's ``CEWithChunkedOutputLoss.forward`` (torchtune/modules/loss/
    ce_chunked_output_loss.py), statement for statement: each chunk's logits upcast to fp32
    and ``F.cross_entropy(..., reduction="sum")``, one chunk at a time, the sum divided by the
    number of labels not ignored. (torchtune itself does not import without torchao.)"""
    total_elements = (labels != ignore_index).sum()
    labels = [target_chunk.reshape(-1) for target_chunk in labels.chunk(chunks, dim=1)]
    logits = [logit_chunk.reshape(-1, logit_chunk.size(-1)) for logit_chunk in logits]
    total_loss = 0.0
    for logits_chunk, labels_chunk in zip(logits, labels):
        total_loss += F.cross_entropy(logits_chunk.float(), labels_chunk,
                                      ignore_index=ignore_index, reduction="sum")
    return total_loss / total_elements

"""A small Llama written the way Hugging Face's modeling_llama writes it, not memplan's
reference model: eager attention with a 4-D additive mask, rotary tables from position ids,
K/V repeated to every head, the softmax in fp32, and the loss on shifted labels. Used by
tests/traced/test_calibrate.py as a user model (``memplan calibrate --module``)."""

from __future__ import annotations

import math
import os
from types import SimpleNamespace

import torch
import torch.nn.functional as F
from torch import nn

VOCAB, HIDDEN, HEADS, KV_HEADS, HEAD_DIM, FFN = 128, 64, 4, 2, 16, 176
LAYERS = int(os.environ.get("HF_STYLE_LAYERS", "3"))


class RMSNorm(nn.Module):
    def __init__(self, dtype, device) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(HIDDEN, dtype=dtype, device=device))

    def forward(self, x):
        dtype = x.dtype
        x = x.to(torch.float32)
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
        return self.weight * x.to(dtype)


def rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class Attention(nn.Module):
    def __init__(self, dtype, device) -> None:
        super().__init__()
        kw = {"bias": False, "dtype": dtype, "device": device}
        self.q_proj = nn.Linear(HIDDEN, HEADS * HEAD_DIM, **kw)
        self.k_proj = nn.Linear(HIDDEN, KV_HEADS * HEAD_DIM, **kw)
        self.v_proj = nn.Linear(HIDDEN, KV_HEADS * HEAD_DIM, **kw)
        self.o_proj = nn.Linear(HEADS * HEAD_DIM, HIDDEN, **kw)

    def forward(self, x, cos, sin, mask):
        b, s, _ = x.shape
        q = self.q_proj(x).view(b, s, HEADS, HEAD_DIM).transpose(1, 2)
        k = self.k_proj(x).view(b, s, KV_HEADS, HEAD_DIM).transpose(1, 2)
        v = self.v_proj(x).view(b, s, KV_HEADS, HEAD_DIM).transpose(1, 2)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        rep = HEADS // KV_HEADS
        k = k[:, :, None].expand(b, KV_HEADS, rep, s, HEAD_DIM).reshape(b, HEADS, s, HEAD_DIM)
        v = v[:, :, None].expand(b, KV_HEADS, rep, s, HEAD_DIM).reshape(b, HEADS, s, HEAD_DIM)
        scores = torch.matmul(q, k.transpose(2, 3)) / math.sqrt(HEAD_DIM) + mask
        probs = F.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        out = torch.matmul(probs, v).transpose(1, 2).reshape(b, s, -1)
        return self.o_proj(out)


class MLP(nn.Module):
    def __init__(self, dtype, device) -> None:
        super().__init__()
        kw = {"bias": False, "dtype": dtype, "device": device}
        self.gate_proj = nn.Linear(HIDDEN, FFN, **kw)
        self.up_proj = nn.Linear(HIDDEN, FFN, **kw)
        self.down_proj = nn.Linear(FFN, HIDDEN, **kw)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, dtype, device) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(dtype, device)
        self.self_attn = Attention(dtype, device)
        self.post_attention_layernorm = RMSNorm(dtype, device)
        self.mlp = MLP(dtype, device)

    def forward(self, x, cos, sin, mask):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, mask)
        return x + self.mlp(self.post_attention_layernorm(x))


class CausalLM(nn.Module):
    def __init__(self, dtype, device) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(VOCAB, HIDDEN, dtype=dtype, device=device)
        self.layers = nn.ModuleList(DecoderLayer(dtype, device) for _ in range(LAYERS))
        self.norm = RMSNorm(dtype, device)
        self.lm_head = nn.Linear(HIDDEN, VOCAB, bias=False, dtype=dtype, device=device)

    def forward(self, input_ids, labels=None):
        b, s = input_ids.shape
        x = self.embed_tokens(input_ids)
        pos = torch.arange(s, device=x.device)[None].expand(b, s)
        inv = 1.0 / (10000 ** (torch.arange(0, HEAD_DIM, 2, device=x.device).float() / HEAD_DIM))
        freqs = pos[..., None].float() * inv
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos().to(x.dtype), emb.sin().to(x.dtype)
        mask = torch.full((s, s), torch.finfo(x.dtype).min, dtype=x.dtype, device=x.device)
        mask = torch.triu(mask, 1)[None, None].expand(b, 1, s, s).contiguous()
        for layer in self.layers:
            x = layer(x, cos, sin, mask)
        logits = self.lm_head(self.norm(x))
        loss = None
        if labels is not None:
            shift_logits = logits[:, :-1, :].contiguous().float()
            shift_labels = labels[:, 1:].contiguous()
            loss = F.cross_entropy(shift_logits.view(-1, VOCAB), shift_labels.view(-1))
        return SimpleNamespace(loss=loss, logits=logits)


def build(*, dtype: torch.dtype, device: torch.device | str = "cpu") -> nn.Module:
    return CausalLM(dtype, device)

"""A GPT written the way nanoGPT writes it, for tests/traced/test_calibrate.py: fused qkv projection,
``scaled_dot_product_attention`` with attention dropout, LayerNorm, learned positions, a head
tied to the embedding, and ``forward(idx, targets) -> (logits, loss)``."""

import torch
import torch.nn.functional as F
from torch import nn

VOCAB, HIDDEN, HEADS, LAYERS, MAX_POS, DROPOUT = 96, 48, 4, 3, 128, 0.1


class Block(nn.Module):
    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(HIDDEN, dtype=dtype)
        self.c_attn = nn.Linear(HIDDEN, 3 * HIDDEN, dtype=dtype)
        self.c_proj = nn.Linear(HIDDEN, HIDDEN, dtype=dtype)
        self.ln_2 = nn.LayerNorm(HIDDEN, dtype=dtype)
        self.c_fc = nn.Linear(HIDDEN, 4 * HIDDEN, dtype=dtype)
        self.mlp_proj = nn.Linear(4 * HIDDEN, HIDDEN, dtype=dtype)
        self.drop = nn.Dropout(DROPOUT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.c_attn(self.ln_1(x)).split(HIDDEN, dim=2)
        q, k, v = (z.view(b, t, HEADS, c // HEADS).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                           dropout_p=DROPOUT if self.training else 0.0)
        x = x + self.drop(self.c_proj(y.transpose(1, 2).contiguous().view(b, t, c)))
        return x + self.drop(self.mlp_proj(F.gelu(self.c_fc(self.ln_2(x)))))


class GPT(nn.Module):
    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        self.wte = nn.Embedding(VOCAB, HIDDEN, dtype=dtype)
        self.wpe = nn.Embedding(MAX_POS, HIDDEN, dtype=dtype)
        self.drop = nn.Dropout(DROPOUT)
        self.h = nn.ModuleList(Block(dtype) for _ in range(LAYERS))
        self.ln_f = nn.LayerNorm(HIDDEN, dtype=dtype)
        self.lm_head = nn.Linear(HIDDEN, VOCAB, bias=False, dtype=dtype)
        self.wte.weight = self.lm_head.weight

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None):
        t = idx.shape[1]
        x = self.drop(self.wte(idx) + self.wpe(torch.arange(t, device=idx.device)))
        for block in self.h:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.view(-1, VOCAB), targets.view(-1))
        return logits, loss


def build(*, dtype: torch.dtype, device: torch.device | str = "cpu") -> nn.Module:
    return GPT(dtype)

"""Small models that exercise what real models do to an offload engine."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class Block(nn.Module):
    """A pre-norm transformer block with hand-written causal attention."""

    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.ln2 = nn.LayerNorm(dim)
        self.fc = nn.Linear(dim, 4 * dim)
        self.out = nn.Linear(4 * dim, dim)

    def forward(self, x):
        B, T, D = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(B, T, 3, self.heads, D // self.heads).transpose(1, 3).unbind(2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, T, D)
        x = x + self.proj(y)
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class MHABlock(nn.Module):
    """A block around nn.MultiheadAttention, which reads out_proj.weight outside out_proj.forward."""

    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.ln = nn.LayerNorm(dim)
        self.attn = nn.MultiheadAttention(dim, heads, batch_first=True)
        self.fc = nn.Linear(dim, dim)

    def forward(self, x):
        h = self.ln(x)
        y, _ = self.attn(h, h, h, need_weights=False)
        return x + self.fc(torch.tanh(y))


class TinyGPT(nn.Module):
    """Tied input/output embeddings, and a position table the root's own forward reads."""

    def __init__(self, vocab: int = 96, dim: int = 32, layers: int = 3, heads: int = 4,
                 seq: int = 16, block: type = Block):
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.pos = nn.Parameter(torch.empty(seq, dim))
        self.blocks = nn.ModuleList(block(dim, heads) for _ in range(layers))
        self.ln = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.emb.weight
        self.reset_parameters()

    def reset_parameters(self):
        nn.init.normal_(self.pos, std=0.02)

    def forward(self, idx):
        x = self.emb(idx) + self.pos[: idx.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))


def lm_loss(logits: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """Next-token cross entropy in fp32."""
    return F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), idx[:, 1:].flatten())

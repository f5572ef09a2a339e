"""A GPT in plain PyTorch: the model of the example, the benchmark and the tests."""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from tiered.ops.long_sequence import IGNORE_INDEX, chunked_cross_entropy, tiled


class Block(nn.Module):
    """Pre-norm transformer block: causal self-attention and a 4x GELU MLP."""

    def __init__(self, dim: int, heads: int, qkv_bias: bool = True):
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim, bias=qkv_bias)
        self.proj = nn.Linear(dim, dim)
        self.ln2 = nn.LayerNorm(dim)
        self.fc = nn.Linear(dim, 4 * dim)
        self.out = nn.Linear(4 * dim, dim)

    mlp_tile_tokens = 0
    """Compute the MLP this many tokens at a time (0: all at once): one tile's 4x intermediate
    is alive at a time, in forward and in backward (tiered.ops.long_sequence)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, D = x.shape
        qkv = self.qkv(self.ln1(x)).view(B, T, 3, self.heads, D // self.heads)
        q, k, v = qkv.transpose(1, 3).unbind(2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(B, T, D))
        normed = self.ln2(x)
        if self.mlp_tile_tokens:
            return x + tiled(self.mlp, normed, self.mlp_tile_tokens)
        return x + self.mlp(normed)

    def mlp(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(F.gelu(self.fc(x)))


class GPT(nn.Module):
    """Token embedding, optional learned positions, blocks, final norm, vocabulary head.

    ``tied=True`` shares the embedding with the head; ``max_seq > 0`` adds a position table
    that the model's own forward reads (not a submodule's). ``qkv_bias=False`` drops the bias
    of the attention input projection: its key part has no true gradient (softmax ignores a
    shift shared by all keys), so it moves by rounding noise alone, which parity tests avoid.
    """

    def __init__(self, vocab: int, dim: int, layers: int, heads: int, max_seq: int = 0,
                 tied: bool = False, qkv_bias: bool = True, block: type[nn.Module] = Block):
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.pos = nn.Parameter(torch.empty(max_seq, dim)) if max_seq else None
        self.blocks = nn.ModuleList(block(dim, heads, qkv_bias) for _ in range(layers))
        self.ln = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        if tied:
            self.head.weight = self.emb.weight
        self.reset_parameters()

    checkpointed = False
    """Run each block under non-reentrant activation checkpointing: backward recomputes its
    insides, and the forward keeps only its input."""

    def reset_parameters(self) -> None:
        if self.pos is not None:
            nn.init.normal_(self.pos, std=0.02)

    loss_chunk_tokens = 0
    """With labels, compute the vocabulary head and the loss this many tokens at a time (0: all
    at once): the logits of one chunk are alive at a time (tiered.ops.long_sequence)."""

    def tile_sequence(self, mlp_tokens: int = 0, loss_tokens: int = 0) -> "GPT":
        """Bound a long sequence's memory: the MLPs run ``mlp_tokens`` tokens at a time, the
        head and loss ``loss_tokens`` at a time (0: all at once)."""
        for block in self.blocks:
            block.mlp_tile_tokens = mlp_tokens
        self.loss_chunk_tokens = loss_tokens
        return self

    def forward(self, idx: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        """The logits of ``idx``; with ``labels`` (of idx's shape; often idx itself), the mean
        cross entropy of predicting each position's next label instead."""
        x = self.emb(idx)
        if self.pos is not None:
            x = x + self.pos[: idx.shape[1]]
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=False) if self.checkpointed else block(x)
        x = self.ln(x)
        if labels is None:
            return self.head(x)
        if self.loss_chunk_tokens:
            # The last position predicts nothing: labelled as ignored rather than sliced off,
            # which would copy the hidden states.
            following = F.pad(labels[:, 1:], (0, 1), value=IGNORE_INDEX)
            return chunked_cross_entropy(x, self.head, following, self.loss_chunk_tokens)
        return next_token_loss(self.head(x), labels)


class LoRALinear(nn.Linear):
    """A linear layer and a trainable low-rank update of it: ``x W^T + b + x A^T B^T`` (LoRA).
    ``B`` starts at zero, as in PEFT, so the model starts as the base model. The layer's own
    weight and bias keep ``nn.Linear``'s names, so a pretrained model's tensors load into it."""

    def __init__(self, in_features: int, out_features: int, rank: int, bias: bool = True):
        super().__init__(in_features, out_features, bias)
        self.lora_a = nn.Parameter(torch.empty(rank, in_features))
        self.lora_b = nn.Parameter(torch.empty(out_features, rank))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        super().reset_parameters()
        if hasattr(self, "lora_a"):  # nn.Linear's __init__ calls this before they exist
            nn.init.kaiming_uniform_(self.lora_a, a=math.sqrt(5))
            nn.init.zeros_(self.lora_b)

    @classmethod
    def around(cls, linear: nn.Linear, rank: int) -> "LoRALinear":
        """Adapters on ``linear``, sharing its weight and bias."""
        lora = cls(linear.in_features, linear.out_features, rank, linear.bias is not None)
        lora.weight = linear.weight
        lora.bias = linear.bias
        return lora

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) + x @ self.lora_a.t() @ self.lora_b.t()


def add_lora(model: GPT, rank: int) -> GPT:
    """Adapters of ``rank`` on every block's linear layers; every other parameter frozen."""
    for block in model.blocks:
        for name in ("qkv", "proj", "fc", "out"):
            setattr(block, name, LoRALinear.around(getattr(block, name), rank))
    for name, param in model.named_parameters():
        param.requires_grad_(name.rsplit(".", 1)[-1].startswith("lora_"))
    return model


def next_token_loss(logits: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """Cross entropy of predicting token t+1 from tokens up to t, in fp32."""
    return F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), idx[:, 1:].flatten())

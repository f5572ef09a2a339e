"""Tiled MLPs and a chunked loss for Hugging Face causal language models (Llama, Mistral,
Qwen2 and their kind, peft-wrapped or not): ``tile_sequence(model, mlp_tokens, loss_tokens)``.
transformers is not imported: what this needs of it, the model gives (its decoder, its head, the
module its outputs' classes come from), so the planner and the trainer's integration, which
build such models, both use it.

The computation is tiered.ops.long_sequence's ([Note: tiles of the sequence]); what this module
adds is where it goes in a Hugging Face model:
- Each decoder layer's ``mlp`` module runs its forward ``mlp_tokens`` tokens at a time.
- With ``labels`` and gradients on (training), the causal LM's forward runs its decoder, then
  the head and the loss ``loss_tokens`` tokens at a time, with Hugging Face's shift of the
  labels, ignored index and ``num_items_in_batch``; its output has the loss and no logits
  (there never were all of them). Without labels, or under ``no_grad`` (evaluation, which may
  want the logits), the model's own forward runs.
A model whose logits are not its head's output (a final soft cap) is refused: its loss would
not be the head's cross entropy.
"""
from __future__ import annotations

import sys
from functools import update_wrapper
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..core.errors import TieredError
from .long_sequence import IGNORE_INDEX, chunked_cross_entropy, tiled


def tile_sequence(model: nn.Module, mlp_tokens: int = 0, loss_tokens: int = 0) -> nn.Module:
    """Bound a long sequence's memory in ``model``: MLPs ``mlp_tokens`` tokens at a time, the
    head and loss ``loss_tokens`` at a time (0: all at once, as the model computes them; a
    second call replaces the first's)."""
    unwrap = getattr(model, "get_base_model", None)  # a peft model's wrapped one
    causal: Any = model if unwrap is None else unwrap()
    head, decoder = causal.get_output_embeddings(), getattr(causal, "get_decoder", None)
    if head is None or decoder is None:
        raise TieredError(f"tile_sequence: {type(causal).__name__} is not a causal language "
                          f"model (no output embeddings or decoder)")
    if loss_tokens and getattr(causal.config, "final_logit_softcapping", None):
        raise TieredError(f"tile_sequence: {type(causal).__name__} caps its logits "
                          f"(final_logit_softcapping), so its loss is not the head's cross "
                          f"entropy; chunk its loss with loss_tokens=0")
    mlps = [module for name, module in causal.named_modules() if name.rsplit(".", 1)[-1] == "mlp"]
    if mlp_tokens and not mlps:
        raise TieredError(f"tile_sequence: {type(causal).__name__} has no module named 'mlp' "
                          f"to tile")
    for mlp in mlps:
        _rewrap(mlp, _TiledMlp, mlp_tokens)
    _rewrap(causal, _ChunkedLoss, loss_tokens)
    return model


class _TiledMlp:
    """An MLP's forward, a tile of tokens at a time."""

    def __init__(self, untiled, tokens: int):
        self.untiled, self.tokens = untiled, tokens
        update_wrapper(self, untiled)

    def __call__(self, x):
        return tiled(self._checked, x, self.tokens)

    def _checked(self, x):
        out = self.untiled(x)
        if not isinstance(out, type(x)):
            raise TieredError(f"tile_sequence: an mlp returned {type(out).__name__}, not a "
                              f"tensor (a mixture of experts?); tile it with mlp_tokens=0")
        return out


class _ChunkedLoss:
    """A causal LM's forward whose loss is computed a chunk of tokens at a time."""

    def __init__(self, untiled, tokens: int):
        self.untiled, self.tokens = untiled, tokens
        update_wrapper(self, untiled)

    def __call__(self, input_ids=None, labels=None, **kwargs):
        causal = self.untiled.__self__
        if labels is None or not torch.is_grad_enabled():
            return self.untiled(input_ids=input_ids, labels=labels, **kwargs)
        num_items = kwargs.pop("num_items_in_batch", None)
        ignore_index = kwargs.pop("ignore_index", IGNORE_INDEX)
        shift_labels = kwargs.pop("shift_labels", None)
        kwargs.pop("logits_to_keep", None)
        outputs = causal.get_decoder()(input_ids=input_ids, **kwargs)
        hidden = outputs.last_hidden_state
        if shift_labels is None:  # each position predicts the next label, the last nothing
            shift_labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
        loss = chunked_cross_entropy(hidden, causal.get_output_embeddings(),
                                     shift_labels.to(hidden.device), self.tokens, num_items,
                                     ignore_index)
        # The class the model's own forward returns, from the module of its decoder's outputs
        # (transformers.modeling_outputs).
        returned = sys.modules[type(outputs).__module__].CausalLMOutputWithPast
        return returned(loss=loss, hidden_states=outputs.hidden_states,
                        attentions=outputs.attentions)


def _rewrap(module: nn.Module, wrapper: type, tokens: int) -> None:
    """Give ``module`` a forward wrapped by ``wrapper`` (``tokens`` > 0) or its own again."""
    forward = module.forward
    if isinstance(forward, (_TiledMlp, _ChunkedLoss)):
        forward = forward.untiled
    if tokens:
        module.forward = wrapper(forward, tokens)
    elif "forward" in vars(module):
        del module.forward


"""Memory-centric tiling of huge linear layers (ZeRO-Infinity's idea).

``TiledLinear`` computes what ``nn.Linear`` computes, but its weight is held by a grid of tiles,
each a module of its own and therefore a unit of the engine: a tile's weights are gathered, used
and released on their own, in forward and in backward, so a layer whose weight alone does not
fit in HBM still trains. Output columns are split ``out_splits`` ways and input columns
``in_splits`` ways; tile (i, j) multiplies input piece j into a partial sum of output piece i,
and only tiles (i, 0) carry a bias. Its state dict has ``weight`` and ``bias`` as ``nn.Linear``
has them, so it loads and exports the untiled layer's tensors.

``tile_large_linears`` replaces every ``nn.Linear`` whose weight exceeds ``tiling.max_unit_bytes``
(in the compute dtype) with a ``TiledLinear`` that keeps each tile under it, splitting output
columns first (no partial sums) and input columns only when one row is too large.
"""
from __future__ import annotations

import math

import torch
from torch import nn


def _split(total: int, parts: int) -> list[int]:
    """``total`` in ``parts`` near-equal sizes, the larger ones first."""
    base, extra = divmod(total, parts)
    return [base + (i < extra) for i in range(parts)]


class _GradientSum(torch.autograd.Function):
    """The start of a chain of :class:`_Fork`: gives ``x`` the fp32 sum the chain carries
    back, rounded once to ``x``'s dtype."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        ctx.set_materialize_grads(False)
        ctx.dtype = x.dtype
        # A zero-stride fp32 tensor of x's shape: no memory, only a path for the fp32 gradient.
        return torch.zeros((), dtype=torch.float32, device=x.device).expand(x.shape)

    @staticmethod
    def backward(ctx, total: torch.Tensor | None):
        return None if total is None else total.to(ctx.dtype)


class _Fork(torch.autograd.Function):
    """Hands ``x`` to one more row of tiles (as itself: a view, no copy) and adds that row's
    input gradient into the fp32 sum ``carry`` brings back from the rows after it."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, carry: torch.Tensor):
        ctx.set_materialize_grads(False)  # the last row's carry has no gradient: no zeros
        return x.view_as(x), carry.view_as(carry)

    @staticmethod
    def backward(ctx, grad: torch.Tensor | None, total: torch.Tensor | None):
        if grad is None:
            return None, total
        return None, grad.float() if total is None else total + grad


def _row_inputs(x: torch.Tensor, rows: int) -> list[torch.Tensor]:
    """``x`` once for each row of tiles. Every row reads all of ``x``, so its gradient is a
    sum over rows, which autograd would add up in ``x``'s dtype, rounding each partial sum
    (in bf16 1e-2 relative error at 64 rows against nn.Linear's 3e-3, which sums in fp32 and
    rounds once); through a chain of forks the sum is kept in fp32 instead."""
    if rows == 1 or not x.requires_grad or x.dtype.itemsize >= 4 or not x.is_floating_point():
        return [x] * rows
    carry = _GradientSum.apply(x)
    out = []
    for _ in range(rows):
        row_input, carry = _Fork.apply(x, carry)
        out.append(row_input)
    return out


class LinearTile(nn.Module):
    """One tile: ``x_j @ W_ij^T (+ b_i)``."""

    def __init__(self, in_features: int, out_features: int, bias: bool, fan_in: int,
                 device=None, dtype=None):
        super().__init__()
        self.fan_in = fan_in
        """The whole layer's input size, which nn.Linear's initialization depends on."""
        self.weight = nn.Parameter(torch.empty(out_features, in_features, device=device,
                                               dtype=dtype))
        self.bias = (nn.Parameter(torch.empty(out_features, device=device, dtype=dtype))
                     if bias else None)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        # nn.Linear's: kaiming_uniform(a=sqrt(5)) and the bias bound, both from the layer's fan-in.
        bound = 1 / math.sqrt(self.fan_in) if self.fan_in > 0 else 0.0
        nn.init.uniform_(self.weight, -bound, bound)
        if self.bias is not None:
            nn.init.uniform_(self.bias, -bound, bound)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.linear(x, self.weight, self.bias)


class TiledLinear(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool = True,
                 in_splits: int = 1, out_splits: int = 1, device=None, dtype=None):
        super().__init__()
        if not 1 <= in_splits <= in_features or not 1 <= out_splits <= out_features:
            raise ValueError(f"in_splits must be in [1, {in_features}] and out_splits in "
                             f"[1, {out_features}], got {in_splits} and {out_splits}")
        self.in_features, self.out_features = in_features, out_features
        self.has_bias = bias
        self.in_sizes = _split(in_features, in_splits)
        self.out_sizes = _split(out_features, out_splits)
        self.tiles = nn.ModuleList(
            LinearTile(cols, rows, bias and j == 0, in_features, device=device, dtype=dtype)
            for rows in self.out_sizes for j, cols in enumerate(self.in_sizes))
        self._register_state_dict_hook(merge_layer_tiles)
        self._register_load_state_dict_pre_hook(_split_tiles, with_module=True)

    def tile(self, i: int, j: int) -> LinearTile:
        tile = self.tiles[i * len(self.in_sizes) + j]
        assert isinstance(tile, LinearTile)
        return tile

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        outputs = []
        for i, row_input in enumerate(_row_inputs(x, len(self.out_sizes))):
            pieces = row_input.split(self.in_sizes, dim=-1)
            out = self.tile(i, 0)(pieces[0])
            if len(self.in_sizes) > 1:
                # nn.Linear sums the products in fp32 and rounds once; rounding each partial
                # sum to bf16 would add an error per input tile (1e-2 relative at 64 tiles).
                # fp32 + bf16 is fp32; the add keeps nothing for backward.
                total = out.float()
                for j in range(1, len(self.in_sizes)):
                    total = total + self.tile(i, j)(pieces[j])
                out = total.to(out.dtype)
            outputs.append(out)
        return outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=-1)

    def merge(self, tile_weights: list[torch.Tensor],
              tile_biases: list[torch.Tensor | None]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The whole weight and bias from the tiles' (in tile order)."""
        cols = len(self.in_sizes)
        rows = [torch.cat(tile_weights[i * cols:(i + 1) * cols], dim=1)
                for i in range(len(self.out_sizes))]
        biases = [tile_biases[i * cols] for i in range(len(self.out_sizes))]
        bias = None if biases[0] is None else torch.cat([b for b in biases if b is not None])
        return torch.cat(rows, dim=0), bias

    def block(self, k: int) -> tuple[int, int, int, int]:
        """Where tile ``k`` lies in the layer's weight: (first row, rows, first column,
        columns); its bias, if it has one, is the same rows of the layer's."""
        i, j = divmod(k, len(self.in_sizes))
        return (sum(self.out_sizes[:i]), self.out_sizes[i], sum(self.in_sizes[:j]),
                self.in_sizes[j])

    def pieces(self, weight: torch.Tensor, bias: torch.Tensor | None):
        """(tile weight, tile bias or None) for each tile, as views of ``weight`` and ``bias``."""
        out = []
        for rows, weight_rows, bias_rows in zip(
                self.out_sizes, weight.split(self.out_sizes, dim=0),
                bias.split(self.out_sizes) if bias is not None else [None] * len(self.out_sizes)):
            for j, tile_weight in enumerate(weight_rows.split(self.in_sizes, dim=1)):
                out.append((tile_weight, bias_rows if j == 0 else None))
        return out

    @classmethod
    def from_linear(cls, linear: nn.Linear, in_splits: int, out_splits: int) -> "TiledLinear":
        """The same layer, tiled; its tiles' parameters are views of ``linear``'s (meta stays
        meta: nothing is materialized)."""
        weight = linear.weight
        with torch.device("meta"):
            tiled = cls(linear.in_features, linear.out_features, linear.bias is not None,
                        in_splits, out_splits, dtype=weight.dtype)
        for tile, (tile_weight, tile_bias) in zip(tiled.tiles, tiled.pieces(weight, linear.bias)):
            tile.weight = nn.Parameter(tile_weight, requires_grad=weight.requires_grad)
            if tile_bias is not None:
                tile.bias = nn.Parameter(tile_bias, requires_grad=linear.bias.requires_grad)
        return tiled


def merge_layer_tiles(module: TiledLinear, state: dict, prefix: str,
                      local_metadata=None) -> None:
    """``state``'s entries of one layer's tiles become its ``weight`` and ``bias`` in
    nn.Linear's shapes. Also the layer's state-dict hook (a layer whose tiles an engine has
    taken has none there: the engine's full_state_dict and export merge them)."""
    names = [f"{prefix}tiles.{k}." for k in range(len(module.tiles))]
    if names[0] + "weight" not in state:
        return
    weights = [state.pop(name + "weight") for name in names]
    biases = [state.pop(name + "bias", None) for name in names]
    weight, bias = module.merge(weights, biases)
    state[prefix + "weight"] = weight
    if bias is not None:
        state[prefix + "bias"] = bias


def _split_tiles(module: TiledLinear, state: dict, prefix: str, *args) -> None:
    """Load-state-dict pre-hook: nn.Linear's ``weight`` and ``bias`` into the tiles."""
    if prefix + "weight" not in state:
        return
    weight, bias = state.pop(prefix + "weight"), state.pop(prefix + "bias", None)
    for k, (tile_weight, tile_bias) in enumerate(module.pieces(weight, bias)):
        state[f"{prefix}tiles.{k}.weight"] = tile_weight
        if tile_bias is not None:
            state[f"{prefix}tiles.{k}.bias"] = tile_bias


def tile_shape(out_features: int, in_features: int, itemsize: int,
               max_bytes: int, bias: bool = False) -> tuple[int, int]:
    """(in_splits, out_splits) keeping every tile's unit (its weight, and in the first column
    of tiles its bias) within ``max_bytes``: rows split first (each tile's product then has
    the layer's full inner size, large enough to run at the device's rate), columns only when
    a single row with its bias element is over the limit. A tile holds at least one weight
    (and its bias), whatever the limit."""
    # Whole elements: a limit of 1001 bytes holds 250 fp32 elements, not 250.25.
    most = max(1, max_bytes // itemsize)
    in_splits = math.ceil(in_features / max(1, most - bias))
    cols = math.ceil(in_features / in_splits)  # the first (widest) column of tiles
    rows_per_tile = max(1, most // (cols + bias))
    return in_splits, max(1, math.ceil(out_features / rows_per_tile))


def tiled_layers(model: nn.Module) -> dict[str, TiledLinear]:
    """Every TiledLinear of ``model``, by its state-dict prefix ("" for the model itself,
    "head." for one called head)."""
    return {f"{path}." if path else "": module for path, module in model.named_modules()
            if isinstance(module, TiledLinear)}


def layer_of_tile(name: str, tiled: dict[str, TiledLinear]) -> str | None:
    """The state-dict prefix of the TiledLinear (of :func:`tiled_layers`) whose tile holds the
    parameter ``name``, if any."""
    for prefix in tiled:
        if name.startswith(f"{prefix}tiles."):
            return prefix
    return None


def merge_tiles(model: nn.Module, state: dict) -> None:
    """Turn tile entries of ``state`` (a model's full state dict) into nn.Linear's."""
    for prefix, module in tiled_layers(model).items():
        merge_layer_tiles(module, state, prefix)


Replaced = list[tuple[nn.Module, str, nn.Linear]]
"""What tile_large_linears replaced: (parent module, attribute, the original layer)."""


def tile_large_linears(model: nn.Module, max_bytes: int, itemsize: int) -> Replaced:
    """Replace each ``nn.Linear`` whose weight is over ``max_bytes`` (at ``itemsize`` bytes an
    element) by a ``TiledLinear`` whose tiles view its weight; returns what it replaced, for
    :func:`untile`. A layer whose weight is shared with another module (tied embeddings) is left
    whole: tiles cannot share it."""
    held: dict[int, int] = {}
    for _, param in model.named_parameters(remove_duplicate=False):
        held[id(param)] = held.get(id(param), 0) + 1
    replaced = []
    for path, module in list(model.named_modules()):
        for name, child in list(module.named_children()):
            if (type(child) is nn.Linear and child.weight.numel() * itemsize > max_bytes
                    and held[id(child.weight)] == 1):
                in_splits, out_splits = tile_shape(child.out_features, child.in_features,
                                                   itemsize, max_bytes, child.bias is not None)
                setattr(module, name, TiledLinear.from_linear(child, in_splits, out_splits))
                replaced.append((module, name, child))
    return replaced


def untile(replaced: Replaced) -> None:
    """Put the original layers back (they kept their weights: the tiles only viewed them)."""
    for module, name, linear in replaced:
        setattr(module, name, linear)

"""Operators the engine treats specially."""
from .tiled_linear import LinearTile, TiledLinear, merge_tiles, tile_large_linears

__all__ = ["LinearTile", "TiledLinear", "merge_tiles", "tile_large_linears"]

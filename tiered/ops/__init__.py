"""Operators the engine treats specially."""
from .long_sequence import chunked_cross_entropy, tiled
from .tiled_linear import LinearTile, TiledLinear, merge_tiles, tile_large_linears

__all__ = ["LinearTile", "TiledLinear", "chunked_cross_entropy", "merge_tiles",
           "tile_large_linears", "tiled"]

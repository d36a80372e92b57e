"""benchmarks/ncu_grouped_gemm.py's --tiles: the HopperTiles(...) text that
fp8_gemm_sweep.py prints, read back as literals (nothing in it is run)."""

import ncu_grouped_gemm as ncu
import pytest

from deep_ep_jax.experts import grouped_gemm as gg


def test_printed_tiles_read_back():
    for tiles in (gg.DEFAULT_ALIGNED_TILES.fp8, gg.DEFAULT_ALIGNED_TILES.fp8_weight_grad):
        assert ncu.parse_tiles(repr(tiles)) == tiles
    assert ncu.parse_tiles("HopperTiles(tile_n=64)").tile_n == 64


@pytest.mark.parametrize(
    "text",
    [
        "HopperTiles(128)",
        "Tiles(tile_n=64)",
        "__import__('os').getpid()",
        "HopperTiles(**{'tile_n': 64})",
        "HopperTiles(",
        "HopperTiles(tile_n=64",
    ],
)
def test_anything_else_refused(text):
    with pytest.raises(SystemExit, match="--tiles: expected HopperTiles"):
        ncu.parse_tiles(text)


@pytest.mark.parametrize("text", ["HopperTiles(tile_n=__import__('os').getpid())", "HopperTiles(tile_q=64)"])
def test_names_and_literals_only(text):
    with pytest.raises(SystemExit, match="--tiles: "):
        ncu.parse_tiles(text)

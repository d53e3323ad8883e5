"""Lossless DSpark speculative decoding through `generate()`."""

from .decoding import HalfPrecisionGreedyWarning, dspark_generate
from .records import DSparkGenerateOutput, DSparkRound
from .ssd import SSDConfig

__all__ = ["dspark_generate", "SSDConfig", "HalfPrecisionGreedyWarning", "DSparkGenerateOutput", "DSparkRound"]

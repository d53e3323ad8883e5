"""Lossless DSpark speculative decoding through `generate()`."""

from .decoding import HalfPrecisionGreedyWarning, dspark_generate
from .records import DSparkGenerateOutput, DSparkRound

__all__ = ["dspark_generate", "HalfPrecisionGreedyWarning", "DSparkGenerateOutput", "DSparkRound"]

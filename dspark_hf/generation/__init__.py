"""Lossless DSpark speculative decoding through `generate()`."""

from .decoding import dspark_generate
from .records import DSparkGenerateOutput, DSparkRound
from .request import HalfPrecisionGreedyWarning
from .ssd import SSDConfig

__all__ = ["dspark_generate", "SSDConfig", "HalfPrecisionGreedyWarning", "DSparkGenerateOutput", "DSparkRound"]

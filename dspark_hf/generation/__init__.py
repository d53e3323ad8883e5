"""Lossless DSpark speculative decoding through `generate()`."""

from .decoding import dspark_generate
from .records import DSparkGenerateOutput, DSparkRound

__all__ = ["dspark_generate", "DSparkGenerateOutput", "DSparkRound"]

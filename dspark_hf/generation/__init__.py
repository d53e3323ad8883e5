"""Lossless DSpark speculative decoding through `generate()`."""

from .candidate_generator import DSparkCandidateGenerator
from .decoding import dspark_generate
from .records import DSparkGenerateOutput, DSparkRound
from .request import HalfPrecisionGreedyWarning
from .ssd import SSDConfig

__all__ = ["dspark_generate", "DSparkCandidateGenerator", "SSDConfig", "HalfPrecisionGreedyWarning", "DSparkGenerateOutput", "DSparkRound"]

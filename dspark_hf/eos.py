"""EOS ids of a generation config, and token rows cut after their first EOS.

Shared by data regeneration (an answer ends at its EOS; what follows is padding) and by the benchmarks that compare
outputs with plain generate() (tokens after EOS are padding, whose width depends on the batch).
"""

from __future__ import annotations


def eos_token_ids(generation_config) -> set[int]:
    """The EOS ids of a GenerationConfig (none, one, or a list)."""
    eos = generation_config.eos_token_id
    return set(eos if isinstance(eos, list) else [eos]) if eos is not None else set()


def until_eos(tokens: list[int], eos_ids: set[int]) -> list[int]:
    """`tokens` up to and including the first EOS (all of them when there is none)."""
    return tokens[: next((i + 1 for i, t in enumerate(tokens) if t in eos_ids), len(tokens))]

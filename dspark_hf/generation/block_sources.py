"""Where a round's block comes from: a [`BlockSource`].

A source proposes each round's block, may work while the target verifies it, and learns the outcome. Two ship:
[`Drafter`] drafts in time, with the draft's own draws (`dspark_hf.model.sampling.sample_block`) or a
[`BlockProposer`]'s (the oracle of `dspark bench oracle`); `ssd.SSDSource` takes blocks from a speculation cache
built during verification. Another way to produce blocks (a tree, a GPU-resident fast path, another drafter) is
another source: the decoding loop stays as it is.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import ContextManager, Protocol, runtime_checkable

import torch

from ..model.modeling_dspark import DSparkContext, DSparkDraftModel
from ..model.sampling import BlockProposer, DraftBlock, ProcessLogits, drafter, sample_block

# BlockProposer, DraftBlock and sample_block are model.sampling's, importable from here as before
__all__ = ["BlockSource", "Drafter", "Outcome", "Proposal", "empty_block", "BlockProposer", "DraftBlock",
           "sample_block"]


@dataclass
class Proposal:
    """A round's block for the B rows, and what its source says of it. reach (B,): how many of its tokens a row may
    verify, where fewer than the block (an n-gram lookup proposes fewer), else None; cache_hit (B,) bool: whether
    the block came ready from a speculation cache, None for a source without one."""

    block: DraftBlock
    reach: torch.Tensor | None = None
    cache_hit: torch.Tensor | None = None

    @property
    def drafted(self) -> bool:
        """Whether the round drafted at all (a policy may switch drafting off, and a last round drafts nothing)."""
        return self.block.tokens.shape[1] > 0


@dataclass
class Outcome:
    """What verification made of a round's proposal, per row (B,): how many tokens it verified and accepted, the
    target's own next token, and how many tokens reached the output (fewer where a stop cut the chunk short, none
    for a row that had finished)."""

    proposal: Proposal
    verified: torch.Tensor
    accepted: torch.Tensor
    next_token: torch.Tensor
    committed: torch.Tensor


@runtime_checkable
class BlockSource(Protocol):
    """How a round gets its block and what the source learns from the outcome, called in the order of a round."""

    def propose(self, rows: torch.Tensor, anchor: torch.Tensor, anchor_positions: torch.Tensor,
                context: DSparkContext, process_logits: ProcessLogits) -> Proposal:
        """The block for every row of the batch (rows (B,): their index), from their anchors (B,) at
        `anchor_positions` (B,) after `context`; `process_logits` applies the call's logits processors to them.
        A row that has finished gets a block too (its outcome is never used): the batch keeps its shape."""

    def verifying(self, proposal: Proposal, verify_len: torch.Tensor, anchor: torch.Tensor,
                  anchor_positions: torch.Tensor, context: DSparkContext) -> ContextManager[None]:
        """Held while the target verifies the first verify_len (R,) tokens of the block: a source may work meanwhile
        (SSD prepares the next blocks)."""

    def learn(self, outcome: Outcome, rows: list[int]) -> None:
        """The round's outcome (B,) for every row of the batch; `rows`: those that decoded in the round (the others
        had finished before it)."""


class Drafter:
    """A [`BlockSource`] that drafts each block in time: `sample_block`, or a [`BlockProposer`]'s own (through
    `draft_block`, the call's drafting step: compiled or not, see `steps.Steps`). Its blocks are drawn without
    their finiteness check, which the round reads with its other values."""

    def __init__(self, draft: DSparkDraftModel, do_sample: bool, draft_block=None):
        self.draft_block, self.do_sample = draft_block or drafter(draft), do_sample

    def propose(self, rows, anchor, anchor_positions, context, process_logits) -> Proposal:
        return Proposal(self.draft_block(anchor, anchor_positions, context, self.do_sample,
                                         process_logits=process_logits, check=False))

    def verifying(self, proposal, verify_len, anchor, anchor_positions, context) -> ContextManager[None]:
        return contextlib.nullcontext()

    def learn(self, outcome: Outcome, rows: list[int]) -> None:
        """A drafter learns nothing: each block depends on the context alone."""


def empty_block(draft: DSparkDraftModel, anchor_ids: torch.Tensor) -> DraftBlock:
    """The block of a round without a draft: no tokens for each of the (N,) anchors."""
    N = anchor_ids.shape[0]
    return DraftBlock(anchor_ids.new_zeros(N, 0),
                      torch.zeros(N, 0, draft.config.target_vocab_size, device=anchor_ids.device), None)

"""DSpark's drafting step as a transformers `CandidateGenerator`: [`DSparkCandidateGenerator`].

transformers' assisted decoding asks a candidate generator for candidates (`get_candidates`) and tells it how many
matched (`update_candidate_strategy`). DSpark's loop drafts through one too, the only way it drafts: each round's
block comes from a [`BlockSource`] (the draft's pass, or SSD's speculation cache), the verification policy trims it
per row from the block's confidences, and what was accepted goes back to the source and the policy.

What differs from transformers' contract, and why:
- any batch size: candidates are per row, trimmed to each row's own length (`verify_lengths`);
- `num_matches` is a (B,) tensor of accepted counts on the device (transformers passes one int, batch 1, which
  would cost a host read a round);
- the loop runs the two halves of `get_candidates` apart, `propose` (on the device, while the previous round is
  still computing) and `plan` (once the confidences reach the host with the round's one read), and its rows keep
  their tokens in the decoding state, so it passes no `input_ids`; `get_candidates` itself is both halves at once,
  for a caller that drives the generator as transformers does. It asks whether the next block is drafted at all
  (`drafts`) before the round's forward, which then leaves the draft's context alone when it is not.
transformers may change these methods' signatures between releases: this class follows 5.23 and 5.24 (CI tests
both) and promises only what is documented here.
"""

from __future__ import annotations

import torch
from transformers.generation.candidate_generator import CandidateGenerator

from ..model.modeling_dspark import DSparkContext, DSparkDraftModel
from ..model.sampling import ProcessLogits, raise_if_not_finite
from ..scheduling.policies import VerificationPolicy, checked_lengths
from .drafting import BlockSource, Outcome, Proposal, empty_block


class DSparkCandidateGenerator(CandidateGenerator):
    """Proposes each round's block from `source` and trims it per row by `policy` (see the module)."""

    def __init__(self, draft: DSparkDraftModel, source: BlockSource, policy: VerificationPolicy):
        self.draft, self.source, self.policy = draft, source, policy
        self.verify_lengths: list[int] | None = None  # per row, of the last get_candidates

    # -- transformers' interface -------------------------------------------------------------------------------------
    def get_candidates(self, input_ids: torch.LongTensor | None = None, *, anchor: torch.Tensor,
                       anchor_positions: torch.Tensor, context: DSparkContext, process_logits: ProcessLogits = None,
                       remaining: list[int] | None = None) -> tuple[torch.LongTensor, torch.Tensor]:
        """The block for every row, trimmed by the policy: (candidates (B, L), the draft's probabilities of them
        (B, L, V)), L the longest row's length; each row's own length is in `verify_lengths` (positions past it
        are not to be verified). With `input_ids` (B, S), candidates are appended to them, as transformers returns
        them. anchor, anchor_positions (B,): each row's last token and its position; context: the draft's view of
        the rows' committed tokens; remaining: each row's most tokens left (default: no limit)."""
        B = anchor.shape[0]
        rows, remaining = list(range(B)), remaining or [self.draft.config.block_size + 1] * B
        proposal = self.propose(anchor, anchor_positions, context, process_logits, self.drafts(rows, remaining))
        block = proposal.block
        if proposal.drafted and block.finite is not None:  # drawn unchecked: checked here, as the loop's read does
            raise_if_not_finite(block.finite.tolist())
        confidences = block.confidences.tolist() if proposal.drafted and block.confidences is not None else None
        reach = proposal.reach.tolist() if proposal.reach is not None else None
        proposal, self.verify_lengths = self.plan(proposal, confidences, reach, rows, remaining)
        L = max(self.verify_lengths, default=0)
        block = proposal.block
        candidates = block.tokens[:, :L]
        if input_ids is not None:
            candidates = torch.cat([input_ids, candidates], 1)
        return candidates, block.probs[:, :L]

    def update_candidate_strategy(self, input_ids: torch.LongTensor | None, scores: torch.Tensor | None,
                                  num_matches: torch.Tensor, *, outcome: Outcome | None = None,
                                  rows: list[int] | None = None) -> None:
        """What verification accepted, for the block source: num_matches (B,) per row, on the device (no host read),
        with the whole `outcome` (and the `rows` that decoded), before the next block is proposed. The policy learns
        the round from the host's copy of it, once read (`learn`)."""
        if outcome is None:
            raise ValueError("DSparkCandidateGenerator.update_candidate_strategy needs outcome= (the round's Outcome): "
                             "num_matches alone does not say what each row verified and committed.")
        self.source.learn(outcome, list(range(num_matches.shape[0])) if rows is None else rows)

    # -- the two halves the pipelined loop calls apart ---------------------------------------------------------------
    def drafts(self, rows: list[int], remaining: list[int]) -> bool:
        """Whether the next block is drafted: not where the policy pauses drafting (decided from past rounds only,
        so it cannot depend on the block: lossless), nor where no row of `rows` can have more than one token left
        (`remaining`: each one's most tokens left; nothing could be verified). Asked once per block."""
        return not all(r <= 1 for r in remaining) and self.policy.draft_this_round(len(rows))

    def propose(self, anchor: torch.Tensor, anchor_positions: torch.Tensor, context: DSparkContext | None,
                process_logits: ProcessLogits | None, drafting: bool) -> Proposal:
        """The next block, on the device, where `drafting` ([`drafts`]); else an empty one (context may be None)."""
        if not drafting:
            return Proposal(empty_block(self.draft, anchor))
        B = anchor.shape[0]
        return self.source.propose(torch.arange(B, device=anchor.device), anchor, anchor_positions, context,
                                   process_logits)

    def plan(self, proposal: Proposal, confidences: list[list[float]] | None, reach: list[int] | None,
             rows: list[int], remaining: list[int]) -> tuple[Proposal, list[int]]:
        """The proposal a round verifies and how many of its block's tokens each of `rows` verifies: the policy's
        per-row, confidence-based trimming, never past a row's length limit (`remaining`) or its block's reach. A
        block that no row could verify anything of (one token left), or one the policy drops now that it has seen
        the round drafted beside it, becomes an empty one, verified by no row."""
        gamma, B = self.draft.config.block_size, proposal.block.tokens.shape[0]
        if all(r <= 1 for r in remaining) or not proposal.drafted or not self.policy.keep_drafted(len(rows)):
            return Proposal(empty_block(self.draft, proposal.block.tokens.new_zeros(B))), [0] * len(rows)
        chosen = checked_lengths(self.policy.plan(None if confidences is None else [confidences[b] for b in rows],
                                                  gamma, len(rows)), gamma, len(rows), self.policy)
        reach = reach or [gamma] * B
        return proposal, [min(n, left - 1, reach[b]) for n, left, b in zip(chosen, remaining, rows)]

    def learn(self, verified: list[int], accepted: list[int], drafted: bool) -> None:
        """The policy's lesson of a round, from the host's copy of it: per row, tokens verified and accepted."""
        self.policy.learn(verified, accepted, drafted)

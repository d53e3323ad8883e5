"""DSpark's drafting step as a transformers `CandidateGenerator`: [`DSparkCandidateGenerator`].

transformers' assisted decoding asks a candidate generator for candidates (`get_candidates`) and tells it how many
matched (`update_candidate_strategy`); a generator that reads the target's hidden states says so
(`requires_model_outputs`) and names what the target's forward must return (`model_kwargs_overrides`), as
transformers' own DFlash and MTP generators do (5.23 to 5.25 alike; 5.25 also asks how many tokens it drafts,
`num_drafting_tokens`). This one keeps that contract: transformers' own assisted loop can run it (batch 1, its own
verification; see [`DSparkCandidateGenerator.assisting`]).

DSpark's own loop (any batch, per-row lengths, one host read a round) drives the same object through the halves of
those two methods, which it calls apart:
- `drafts` (whether the next block is drafted at all, asked before the round's forward, which then leaves the
  draft's context alone when it is not) and `propose` (the block, on the device, while the previous round is still
  computing): the first half of `get_candidates`;
- `plan` (the policy's per-row lengths, once the confidences reach the host with the round's one read): its second
  half;
- `verifying` (held while the target verifies: a block source may work meanwhile), `observe` (the round's outcome
  on the device, for the block source) and `learn` (the policy's lesson, from the host's copy of the round): what
  `update_candidate_strategy` does for transformers' loop.
Each round's block comes from a [`BlockSource`] (the draft's pass, or SSD's speculation cache), the verification
policy trims it per row from the block's confidences, and what was accepted goes back to both.
"""

from __future__ import annotations

from typing import ContextManager

import torch
from transformers.generation.candidate_generator import CandidateGenerator

from ..model.modeling_dspark import DSparkContext, DSparkDraftModel
from ..model.sampling import ProcessLogits, raise_if_not_finite
from ..scheduling.policies import FullBlock, VerificationPolicy, as_policy, checked_lengths
from .block_sources import BlockSource, Drafter, Outcome, Proposal, empty_block


class DSparkCandidateGenerator(CandidateGenerator):
    """Proposes each round's block from `source` and trims it per row by `policy` (see the module).

    max_length: the longest sequence (prompt included) transformers' loop may reach, which no candidate passes;
    process_logits: transformers' logits processors, `(input_ids (B, S), logits (B, V)) -> logits`, applied to the
    draft's logits as they are drawn (for `get_candidates`; DSpark's loop passes its own to `propose`)."""

    requires_model_outputs = True  # transformers' loop hands over the target's outputs: the draft reads its features

    def __init__(self, draft: DSparkDraftModel, source: BlockSource, policy: VerificationPolicy, *,
                 max_length: int | None = None, process_logits=None):
        self.draft, self.source, self.policy = draft, source, policy
        self.max_length, self.process_logits = max_length, process_logits
        # the target returns only the layers the draft reads (transformers merges this into its forward's inputs)
        self.model_kwargs_overrides = {"output_hidden_states": draft.hidden_states_request}
        self.verify_lengths: list[int] | None = None  # per row, of the last get_candidates
        self._context: DSparkContext | None = None  # of the tokens committed so far, for get_candidates
        self._proposal: Proposal | None = None  # the last get_candidates'

    @classmethod
    def assisting(cls, target, draft: DSparkDraftModel, generation_config, logits_processor=None,
                  policy=None) -> "DSparkCandidateGenerator":
        """The generator for transformers' own assisted loop (`_assisted_decoding`, batch 1), as its
        `_get_candidate_generator` builds its own: drafts in time (no SSD), trims by `policy` (default
        `FullBlock()`: a policy that prices rounds needs DSpark's loop to time them), processes the draft's logits
        with `logits_processor` as transformers' DFlash generator does."""
        if not draft.is_bound_to(target):
            draft.bind_target(target)
        do_sample = bool(generation_config.do_sample)
        policy = as_policy(FullBlock() if policy is None else policy)
        policy.prepare(target, draft, 1, do_sample)
        return cls(draft, Drafter(draft, do_sample), policy, max_length=generation_config.max_length,
                   process_logits=logits_processor if logits_processor else None)

    # -- transformers' interface -------------------------------------------------------------------------------------
    @property
    def num_drafting_tokens(self) -> int:
        """The most candidates one `get_candidates` returns (the draft's block): transformers 5.25's loop asks, to
        keep that many steps of a recurrent cache's states for rolling back."""
        return self.draft.config.block_size

    def get_candidates(self, input_ids: torch.LongTensor, model_kwargs: dict | None = None, model_outputs=None,
                       is_first_iteration: bool = False, n_last_matches: int = 0,
                       **kwargs) -> tuple[torch.LongTensor, torch.Tensor | None]:
        """input_ids (B, S) -> (input_ids and the candidates (B, S + L), the draft's logits of them (B, L, V)), L the
        longest row's verified length (each row's own in `verify_lengths`: positions past it are not verified), or
        (input_ids, None) where nothing is drafted.

        model_outputs: the target's last forward, with the hidden states `model_kwargs_overrides` asks for: over the
        prompt but its last token (`is_first_iteration`: nothing to draft from yet, so transformers' loop prefills
        first), then over the last anchor and the candidates, of which the first `n_last_matches` + 1 were
        committed; model_kwargs["attention_mask"] (B, S), if any, marks padding. The generator keeps the draft's
        context of every committed token from one call to the next."""
        if is_first_iteration:  # transformers' loop prefills the prompt: a new context from the next call on
            self._context = self._proposal = self.verify_lengths = None
            return input_ids, None
        if model_outputs is None or getattr(model_outputs, "hidden_states", None) is None:
            raise ValueError("DSparkCandidateGenerator.get_candidates needs model_outputs with the target's hidden "
                             "states: run the target's forward with model_kwargs_overrides (requires_model_outputs).")
        B, S = input_ids.shape
        mask = (model_kwargs or {}).get("attention_mask")
        real = torch.ones_like(input_ids, dtype=torch.bool) if mask is None else mask[:, :S].bool()
        positions = (real.long().cumsum(1) - 1).clamp(min=0)
        fresh = S - 1 if self._context is None else n_last_matches + 1  # committed tokens the draft has not seen
        features = self.draft.target_features(model_outputs.hidden_states)[:, :fresh]
        span = slice(S - 1 - fresh, S - 1)
        context = self.draft.encode_context(features, positions[:, span], real[:, span])
        self._context = context if self._context is None else self._context.cat(context)

        left = [self.max_length - S if self.max_length is not None else self.draft.config.block_size + 1] * B
        rows = list(range(B))
        process = None if self.process_logits is None else (
            lambda prefix, logits: self.process_logits(torch.cat([input_ids, prefix], 1), logits.float()))
        proposal = self.propose(input_ids[:, -1], positions[:, -1], self._context, process, self.drafts(rows, left))
        block = proposal.block
        if proposal.drafted and block.finite is not None:  # drawn unchecked: checked here, as the loop's read does
            raise_if_not_finite(block.finite.tolist())
        confidences = block.confidences.tolist() if proposal.drafted and block.confidences is not None else None
        reach = proposal.reach.tolist() if proposal.reach is not None else None
        self._proposal, self.verify_lengths = self.plan(proposal, confidences, reach, rows, left)
        L = max(self.verify_lengths, default=0)
        if L == 0:
            return input_ids, None
        block = self._proposal.block
        # transformers takes logits and softmaxes them: the log of the probabilities drawn from gives them back
        return torch.cat([input_ids, block.tokens[:, :L]], 1), block.probs[:, :L].log()

    def update_candidate_strategy(self, input_ids: torch.LongTensor, scores: torch.Tensor, num_matches: int) -> None:
        """transformers' loop tells how many of the last candidates matched (batch 1): the block source and the
        policy learn the round, as DSpark's loop teaches them (`observe`, `learn`); nothing after the prefill."""
        if self._proposal is None:
            return
        verified, proposal = self.verify_lengths[0], self._proposal
        n = torch.tensor([int(num_matches)], device=input_ids.device)
        self.observe(Outcome(proposal, torch.tensor([verified], device=n.device), n, input_ids[:, -1], n + 1), [0])
        self.learn([verified], [int(num_matches)], drafted=proposal.drafted)

    # -- the halves DSpark's loop calls apart ------------------------------------------------------------------------
    def drafts(self, rows: list[int], remaining: list[int]) -> bool:
        """Whether the next block is drafted: not where the policy pauses drafting (decided from past rounds only,
        so it cannot depend on the block: lossless), nor where no row of `rows` can have more than one token left
        (`remaining`: each one's most tokens left; nothing could be verified). Asked once per block."""
        return not all(r <= 1 for r in remaining) and self.policy.draft_this_round(len(rows))

    def propose(self, anchor: torch.Tensor, anchor_positions: torch.Tensor, context: DSparkContext | None,
                process_logits: ProcessLogits | None, drafting: bool) -> Proposal:
        """The next block, on the device, where `drafting` ([`drafts`]); else an empty one (context may be None).
        anchor, anchor_positions (B,): each row's last token and its position; context: the draft's view of the
        rows' committed tokens."""
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

    def verifying(self, proposal: Proposal, verify_len: torch.Tensor, anchor: torch.Tensor,
                  anchor_positions: torch.Tensor, context: DSparkContext | None) -> ContextManager[None]:
        """Held while the target verifies the first verify_len (B,) tokens of `proposal`'s block (SSD's source
        prepares the next blocks meanwhile)."""
        return self.source.verifying(proposal, verify_len, anchor, anchor_positions, context)

    def observe(self, outcome: Outcome, rows: list[int]) -> None:
        """The round's outcome (B,), on the device (no host read), for the block source, before the next block is
        proposed; `rows`: those that decoded in the round."""
        self.source.learn(outcome, rows)

    def learn(self, verified: list[int], accepted: list[int], drafted: bool) -> None:
        """The policy's lesson of a round, from the host's copy of it: per row, tokens verified and accepted."""
        self.policy.learn(verified, accepted, drafted)

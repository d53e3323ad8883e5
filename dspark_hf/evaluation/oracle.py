"""An oracle draft: proposes the target's own greedy continuation (optionally corrupted).

It runs the real draft forward (so a round costs what it would with a trained draft) and then replaces the drafted
tokens with the reference continuation recorded from plain greedy `generate()`. With corruption 0 every verified
token is accepted: the ceiling our decoding loop allows. For greedy decoding only (its probabilities are one-hot).
"""

from __future__ import annotations

from dataclasses import replace

import torch

from ..model.sampling import DraftBlock, sample_block
from ..model.modeling_dspark import DSparkDraftModel


class OracleDraft(DSparkDraftModel):
    """A DSpark draft whose tokens come from reference greedy sequences (a `BlockProposer`).

    A row is matched to the reference row holding its anchor at its position; when several do, to the one whose
    context (the draft's layer-0 key of the token before the anchor) is nearest, which tells prefixes apart. The
    matching runs on the device, so the oracle reads nothing back from it (the loop's one read a round stands).
    """

    @classmethod
    def from_draft(cls, draft: DSparkDraftModel) -> "OracleDraft":
        oracle = cls(draft.config).to(device=draft.device, dtype=draft.dtype)
        oracle.load_state_dict(draft.state_dict())
        if draft.binding is not None:
            oracle.binding = replace(draft.binding, lm_weight=None)
        return oracle

    @torch.no_grad()
    def set_references(self, target, sequences: torch.Tensor, prompt_mask: torch.Tensor, corruption: float = 0.0,
                       seed: int = 0) -> "OracleDraft":
        """sequences (B, P + G): `target`'s plain greedy outputs for left-padded prompts with mask (B, P). Each
        reference token is proposed as a random one instead with probability `corruption` (drawn once, seeded)."""
        mask = torch.cat([prompt_mask, prompt_mask.new_ones(sequences.shape[0], sequences.shape[1] -
                                                            prompt_mask.shape[1])], 1)
        positions = (mask.cumsum(1) - 1).clamp_min(0)
        hidden = target(input_ids=sequences, attention_mask=mask, position_ids=positions,
                        output_hidden_states=self.hidden_states_request).hidden_states
        keys = self.encode_context(self.target_features(hidden), positions, mask.bool()).keys[0]  # (B, H, T, hd)
        # each reference by position: its tokens (-1 past its end) and the layer-0 key of each
        B, T = sequences.shape
        lengths = mask.sum(1)
        by_position = positions.masked_fill(mask == 0, T)  # padding goes to a column past the end, dropped
        tokens = sequences.new_full((B, T + 1), -1).scatter_(1, by_position, sequences)[:, :T]
        flat = keys.transpose(1, 2).flatten(2)  # (B, T, H * hd)
        ref_keys = flat.new_zeros(B, T + 1, flat.shape[-1]).scatter_(
            1, by_position[..., None].expand_as(flat), flat)[:, :T]
        # which reference tokens a block proposes corrupted, and as what: drawn once, here
        g = torch.Generator().manual_seed(seed)
        corrupt = (torch.rand(B, T, generator=g) < corruption).to(tokens.device)
        noise = torch.randint(self.config.target_vocab_size, (B, T), generator=g).to(tokens.device)
        self.__dict__.update(_tokens=torch.where(corrupt & (tokens >= 0), noise, tokens), _true_tokens=tokens,
                             _lengths=lengths, _keys=ref_keys)
        return self

    @torch.no_grad()
    def propose_block(self, anchor_ids, anchor_positions, context, do_sample=False, process_logits=None,
                      generator=None, check=True) -> DraftBlock:
        """The draft's own block (its forward runs, so a round costs what it would), its tokens then replaced by the
        continuation of the reference row that holds each anchor at its position, all on the device."""
        block = sample_block(self, anchor_ids, anchor_positions, context, do_sample, process_logits, generator, check)
        refs, lengths, gamma = self._tokens, self._lengths, self.config.block_size
        pos = anchor_positions
        T = refs.shape[1]
        # the reference rows holding the anchor at its position, the nearest in context first
        at_anchor = self._true_tokens.gather(1, pos.clamp(max=T - 1)[None].expand(refs.shape[0], -1)).T  # (N, B_ref)
        holds = (at_anchor == anchor_ids[:, None]) & (pos[:, None] < lengths[None])
        before = (context.positions == (pos - 1)[:, None]) & context.valid  # the token before the anchor
        key = context.keys[0].transpose(1, 2).flatten(2).gather(
            1, before.long().argmax(1)[:, None, None].expand(-1, 1, self._keys.shape[-1])).squeeze(1)  # (N, D)
        ref_key = self._keys.gather(1, (pos - 1).clamp(0, T - 1)[None, :, None].expand(
            self._keys.shape[0], -1, self._keys.shape[-1]))  # (B_ref, N, D)
        distance = torch.where(pos[:, None] > 0, (ref_key.transpose(0, 1) - key[:, None]).norm(dim=-1), 0.0)
        choice = torch.where(holds, distance, float("inf")).argmin(1)  # (N,)
        # its continuation, as far as it goes
        at = pos[:, None] + 1 + torch.arange(gamma, device=pos.device)  # (N, gamma)
        continuation = refs[choice[:, None], at.clamp(max=T - 1)]
        use = holds.any(1)[:, None] & (at < lengths[choice][:, None])
        tokens = torch.where(use, continuation, block.tokens)
        # one-hot by a scatter: `one_hot` checks its ids' range, which reads them back
        probs = torch.zeros_like(block.probs).scatter_(-1, tokens[..., None], 1.0)
        return DraftBlock(tokens, probs, block.confidences, finite=block.finite)

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
    context (the draft's layer-0 key of the token before the anchor) is nearest, which tells prefixes apart.
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
        drafted token is replaced by a random one with probability `corruption` (seeded)."""
        mask = torch.cat([prompt_mask, prompt_mask.new_ones(sequences.shape[0], sequences.shape[1] -
                                                            prompt_mask.shape[1])], 1)
        positions = (mask.cumsum(1) - 1).clamp_min(0)
        hidden = target(input_ids=sequences, attention_mask=mask, position_ids=positions,
                        output_hidden_states=self.hidden_states_request).hidden_states
        keys = self.encode_context(self.target_features(hidden), positions, mask.bool()).keys[0]
        refs = []
        for b in range(sequences.shape[0]):
            real = mask[b].bool()
            refs.append((sequences[b, real].tolist(), keys[b][:, real].transpose(0, 1).flatten(1)))
        self.__dict__.update(_refs=refs, _corruption=corruption, _rng=torch.Generator().manual_seed(seed))
        return self

    def _continuation(self, pos: int, anchor: int, key: torch.Tensor) -> list[int]:
        candidates = [(tokens, keys) for tokens, keys in self._refs if pos < len(tokens) and tokens[pos] == anchor]
        if not candidates:
            return []
        tokens, _ = min(candidates, key=lambda c: float((c[1][pos - 1] - key).norm()) if pos > 0 else 0.0)
        return tokens[pos + 1: pos + 1 + self.config.block_size]

    @torch.no_grad()
    def propose_block(self, anchor_ids, anchor_positions, context, do_sample=False, process_logits=None,
                      generator=None) -> DraftBlock:
        block = sample_block(self, anchor_ids, anchor_positions, context, do_sample, process_logits, generator)
        tokens = block.tokens.clone()
        V = block.probs.shape[-1]
        last_keys = context.keys[0][:, :, -1].flatten(1)  # the token before each anchor (rows are flush right)
        for r, (pos, a) in enumerate(zip(anchor_positions.tolist(), anchor_ids.tolist())):
            for k, t in enumerate(self._continuation(pos, a, last_keys[r])):
                if torch.rand(1, generator=self._rng).item() < self._corruption:
                    t = int(torch.randint(V, (1,), generator=self._rng))
                tokens[r, k] = t
        probs = torch.nn.functional.one_hot(tokens, V).to(block.probs.dtype)
        return DraftBlock(tokens, probs, block.confidences)

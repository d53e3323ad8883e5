"""An oracle draft: proposes the target's own greedy continuation (optionally corrupted).

It runs the real draft forward (so a round costs what it would with a trained draft) and then replaces the drafted
tokens with the reference continuation recorded from plain greedy `generate()`. With corruption 0 every verified
token is accepted: the ceiling our decoding loop allows. For greedy decoding only (its probabilities are one-hot).
"""

from __future__ import annotations

import torch

from ..model.modeling_dspark import DraftBlock, DSparkDraftModel


class OracleDraft(DSparkDraftModel):
    """A DSpark draft whose tokens come from reference greedy sequences, looked up by (anchor position, anchor)."""

    @classmethod
    def from_draft(cls, draft: DSparkDraftModel) -> "OracleDraft":
        oracle = cls(draft.config).to(device=draft.device, dtype=draft.dtype)
        oracle.load_state_dict(draft.state_dict())
        oracle.__dict__.update({k: draft.__dict__.get(k) for k in ("_target_embed", "_target_lm_head", "_bound_to")})
        oracle.__dict__["_lm_weight"] = None
        oracle.__dict__["_table"] = {}
        return oracle

    def set_references(self, sequences: torch.Tensor, prompt_mask: torch.Tensor, corruption: float = 0.0,
                       seed: int = 0) -> "OracleDraft":
        """sequences (B, P + G): plain greedy outputs for left-padded prompts with mask (B, P). Each drafted token is
        replaced by a random one with probability `corruption` (seeded), to exercise partial acceptance."""
        P, gamma = prompt_mask.shape[1], self.config.block_size
        table, clash = {}, set()
        for row, mask in zip(sequences.tolist(), prompt_mask.tolist()):
            start = P - sum(mask)
            tokens = row[start:]
            for i in range(len(tokens) - 1):
                key = (i, tokens[i])
                value = tokens[i + 1: i + 1 + gamma]
                if key in table and table[key] != value:
                    clash.add(key)
                table[key] = value
        for key in clash:
            del table[key]
        self.__dict__["_table"] = table
        self.__dict__["_corruption"] = corruption
        self.__dict__["_rng"] = torch.Generator().manual_seed(seed)
        return self

    @torch.no_grad()
    def draft_block(self, anchor_ids, anchor_positions, context, do_sample=False, process_logits=None,
                    generator=None) -> DraftBlock:
        block = super().draft_block(anchor_ids, anchor_positions, context, do_sample, process_logits, generator)
        tokens = block.tokens.clone()
        V = block.probs.shape[-1]
        for r, (pos, a) in enumerate(zip(anchor_positions.tolist(), anchor_ids.tolist())):
            ref = self._table.get((pos, a), [])
            for k, t in enumerate(ref):
                if torch.rand(1, generator=self._rng).item() < self._corruption:
                    t = int(torch.randint(V, (1,), generator=self._rng))
                tokens[r, k] = t
        probs = torch.nn.functional.one_hot(tokens, V).to(block.probs.dtype)
        return DraftBlock(tokens, probs, block.confidences)

"""Right-aligned ragged rows.

Every per-row buffer of a batched decode (attention mask, target KV cache, draft context) keeps each row's tokens
contiguous and flush right, with padding on the left, exactly like a left-padded batch in plain ``generate()``.
Rows accept different numbers of tokens per round; committing shifts each row right by how much less it accepted
than the best row, so no holes ever open inside a row (sliding-window attention counts cache slots, so a hole
would change what a window sees).
"""

from __future__ import annotations

import torch


class Commit:
    """One round's commit: every buffer ends with `appended` new entries per row along its sequence dim; keep the
    first keep[b] of them in row b and re-align rows flush right (row b moves right by keep.max() - keep[b]).

    Built once per round and applied to every buffer (mask, each cache layer, the draft context), so the rows to
    move are found once, with one device sync, not once per tensor.
    """

    def __init__(self, appended: int, keep: torch.Tensor):
        keep_max = int(keep.max())
        self.surplus = appended - keep_max  # entries no row keeps, cut from the right end
        shifts = keep_max - keep
        self.moves = [(s, (shifts == s).nonzero().squeeze(1)) for s in shifts.unique().tolist() if s != 0]

    @property
    def keeps_all(self) -> bool:
        """Every row kept all it appended (a round without a draft, or a block accepted whole by every row): applying
        the commit would change nothing."""
        return self.surplus == 0 and not self.moves

    def __call__(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        x = x.narrow(dim, 0, x.shape[dim] - self.surplus)
        if not self.moves:  # every row kept as much as the best one (always at batch size 1): nothing to copy
            return x
        out = x.clone()
        for s, rows in self.moves:
            moved = x.index_select(0, rows)
            moved = torch.cat([torch.zeros_like(moved.narrow(dim, 0, s)), moved.narrow(dim, 0, x.shape[dim] - s)],
                              dim)
            out.index_copy_(0, rows, moved)
        return out


def leading_padding(mask: torch.Tensor) -> int:
    """How many leading columns are padding in every row (safe to drop from all buffers)."""
    real = mask.bool().any(0)
    return int(real.float().argmax()) if real.any() else mask.shape[1]

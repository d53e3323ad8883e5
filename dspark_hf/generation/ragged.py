"""Right-aligned ragged rows.

Every per-row buffer of a batched decode (attention mask, target KV cache, draft context) keeps each row's tokens
contiguous and flush right, with padding on the left, exactly like a left-padded batch in plain ``generate()``.
Rows accept different numbers of tokens per round; committing shifts each row right by how much less it accepted
than the best row, so no holes ever open inside a row (sliding-window attention counts cache slots, so a hole
would change what a window sees).
"""

from __future__ import annotations

import torch


def shift_right(x: torch.Tensor, shifts: torch.Tensor, dim: int) -> torch.Tensor:
    """Shift row b of `x` (batch on dim 0) right by shifts[b] along `dim`, zero-filling on the left and dropping
    what falls off the right end."""
    moves = [s for s in shifts.unique().tolist() if s != 0]
    if not moves:  # every row accepted as much as the best one (always at batch size 1): nothing to copy
        return x
    out = x.clone()
    for s in moves:
        rows = (shifts == s).nonzero().squeeze(1)
        moved = x.index_select(0, rows)
        moved = torch.cat([torch.zeros_like(moved.narrow(dim, 0, s)), moved.narrow(dim, 0, x.shape[dim] - s)], dim)
        out.index_copy_(0, rows, moved)
    return out


def commit(x: torch.Tensor, dim: int, appended: int, keep: torch.Tensor, keep_max: int) -> torch.Tensor:
    """`x` ends with `appended` new entries per row along `dim`; keep the first keep[b] of them in row b and
    re-align rows flush right. keep_max = keep.max() (passed in to avoid a device sync per tensor)."""
    x = x.narrow(dim, 0, x.shape[dim] - (appended - keep_max))
    return shift_right(x, keep_max - keep, dim)


def leading_padding(mask: torch.Tensor) -> int:
    """How many leading columns are padding in every row (safe to drop from all buffers)."""
    real = mask.bool().any(0)
    return int(real.float().argmax()) if real.any() else mask.shape[1]

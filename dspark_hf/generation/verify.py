"""Verification: which drafted tokens the target keeps, and which token it adds (Leviathan et al. 2023; Chen et al.
2023). Lossless: greedy keeps the target's argmax path; sampling keeps the target's distribution exactly.

Shapes: p (B, L + 1, V) target probabilities at the anchor and the L drafted positions; q (B, L, V) the draft
distributions the tokens were drawn from; x (B, L) drafted tokens; verify_len (B,) how many of them each row
verifies (the scheduler may verify fewer than L).
"""

from __future__ import annotations

import torch


def residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """norm(max(p - q, 0)): what the target still owes after a rejection. Falls back to p where p == q."""
    r = (p - q).clamp_min(0)
    mass = r.sum(-1, keepdim=True)
    return torch.where(mass > 0, r / mass.clamp_min(1e-30), p)


def accepted_prefix(accept: torch.Tensor, verify_len: torch.Tensor) -> torch.Tensor:
    """accept (B, L) per-position verdicts -> n (B,), the length of the accepted prefix within verify_len."""
    in_range = torch.arange(accept.shape[1], device=accept.device) < verify_len[:, None]
    return (accept & in_range).long().cumprod(1).sum(1)


def verify_greedy(target_logits: torch.Tensor, x: torch.Tensor, verify_len: torch.Tensor):
    """Keep drafts while they equal the target's argmax. Returns (n accepted (B,), next token (B,))."""
    best = target_logits.argmax(-1)
    n = accepted_prefix(x == best[:, :-1], verify_len)
    return n, best.gather(1, n[:, None]).squeeze(1)


def verify_sampling(p, q, x, verify_len, generator=None):
    """Speculative sampling: accept x_k with probability min(1, p_k(x_k) / q_k(x_k)); at the first rejection draw
    from the residual; if every verified draft survives, draw the bonus token from p.
    Returns (n accepted (B,), next token (B,))."""
    B, L = x.shape
    p_x = p[:, :L].gather(-1, x[..., None]).squeeze(-1)
    q_x = q.gather(-1, x[..., None]).squeeze(-1)
    u = torch.rand(B, L, device=p.device, generator=generator)
    n = accepted_prefix(u * q_x < p_x, verify_len)  # strict: u can be 0, and a token with p = 0 is never accepted

    rows = torch.arange(B, device=p.device)
    p_n = p[rows, n]
    q_n = torch.cat([q, q.new_zeros(B, 1, q.shape[-1])], 1)[rows, n]
    rejected = (n < verify_len)[:, None]
    dist = torch.where(rejected, residual(p_n, q_n), p_n)
    return n, torch.multinomial(dist, 1, generator=generator).squeeze(1)


def next_token(scores: torch.Tensor, do_sample: bool) -> torch.Tensor:
    """The target's own next token (B,) from its processed scores (B, V): drawn from their softmax, or their argmax
    (as plain generate() picks it)."""
    return torch.multinomial(torch.softmax(scores, -1), 1).squeeze(1) if do_sample else scores.argmax(-1)


def verify_block(scores: torch.Tensor, q: torch.Tensor, x: torch.Tensor, verify_len: torch.Tensor, do_sample: bool):
    """A round's verdict from the target's processed scores (B, L + 1, V) over drafted tokens x (B, L), drawn from q
    (B, >= L, V): greedy or by speculative sampling. A round that drafted nothing (L = 0) is plain generate()'s step.
    Returns (n accepted (B,), next token (B,))."""
    if x.shape[1] == 0:
        return torch.zeros_like(verify_len), next_token(scores[:, 0], do_sample)
    if do_sample:
        return verify_sampling(torch.softmax(scores, -1), q[:, :x.shape[1]], x, verify_len)
    return verify_greedy(scores, x, verify_len)

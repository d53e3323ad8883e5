"""Engine profiles: steps per second of the target's verification forward by batch size in tokens, SPS(B), and
the seconds one draft pass costs by number of requests.

Measured on the actual target, device, dtype and thread count, over a realistic cached context; saved as JSON and
loaded by [`Scheduled.from_profile`]. A verification batch of B tokens is measured as R requests x n tokens for
every R in `rows` and n = 1..max_tokens_per_row (the median over the shapes that give the same B is SPS(B)), so the
table covers the loads a server sees. Real curves are jagged (kernel tiles, thread splits): the loaded profile
interpolates between measured points without smoothing them away.
"""

from __future__ import annotations

import json
import statistics
from collections import defaultdict
from pathlib import Path
from typing import Callable, Sequence

import torch
from transformers import DynamicCache

from ..devices import clock
from ..evaluation.machine import machine_info


def _seconds(fn, device, warmup: int, repeats: int, after=None) -> float:
    times = []
    for i in range(warmup + repeats):
        start = clock(device)
        fn()
        if i >= warmup:
            times.append(clock(device) - start)
        if after is not None:
            after()
    return statistics.median(times)


@torch.no_grad()
def profile_sps(target, rows: int | Sequence[int] = 1, max_tokens_per_row: int = 8, context: int = 256,
                repeats: int = 7, warmup: int = 2, draft=None, progress: bool = True) -> dict:
    """Median seconds of verification forwards of R x n tokens after `context` cached tokens, for R in `rows` and
    n = 1..max_tokens_per_row, as SPS(B = R n); with a `draft`, also the seconds of one draft pass per R."""
    from tqdm.auto import tqdm

    rows = [rows] if isinstance(rows, int) else list(rows)
    bar = tqdm(total=len(rows) * (max_tokens_per_row + (draft is not None)), desc="profile", disable=not progress)
    device = target.device
    vocab = target.get_output_embeddings().weight.shape[0]
    g = torch.Generator().manual_seed(0)
    grid, draft_seconds = {}, {}
    for R in rows:
        prompt = torch.randint(0, vocab, (R, context), generator=g).to(device)
        cache = DynamicCache()
        out = target(input_ids=prompt, past_key_values=cache, use_cache=True, logits_to_keep=1,
                     output_hidden_states=draft.hidden_states_request if draft is not None else None)
        grid[R] = {}
        for n in range(1, max_tokens_per_row + 1):
            new = torch.randint(0, vocab, (R, n), generator=g).to(device)
            mask = torch.ones(R, context + n, dtype=torch.long, device=device)
            positions = torch.arange(context, context + n, device=device).expand(R, -1)
            grid[R][n] = 1.0 / _seconds(
                lambda: target(input_ids=new, attention_mask=mask, position_ids=positions, past_key_values=cache,
                               use_cache=True, logits_to_keep=0),
                device, warmup, repeats, after=lambda: cache.crop(-n))
            bar.update(1)
        if draft is not None:
            positions = torch.arange(context, device=device).expand(R, -1)
            ctx = draft.encode_context(draft.target_features(out.hidden_states), positions,
                                       torch.ones_like(positions, dtype=torch.bool))
            anchor, anchor_pos = prompt[:, -1], torch.full((R,), context, device=device)
            draft_seconds[R] = _seconds(lambda: draft.draft_block(anchor, anchor_pos, ctx), device, warmup, repeats)
            bar.update(1)
    bar.close()
    by_tokens = defaultdict(list)
    for R, row in grid.items():
        for n, v in row.items():
            by_tokens[R * n].append(v)
    return {"target": getattr(target.config, "_name_or_path", ""), "rows": sorted(grid), "context": context,
            "repeats": repeats, "machine": machine_info(target, draft),
            "sps": {b: statistics.median(v) for b, v in sorted(by_tokens.items())},
            "grid": grid, "draft_seconds": draft_seconds or None}


def save_profile(profile: dict, path: str | Path) -> None:
    def keys_to_str(d):
        return {str(k): keys_to_str(v) if isinstance(v, dict) else v for k, v in d.items()}

    Path(path).write_text(json.dumps({k: keys_to_str(v) if isinstance(v, dict) and k != "machine" else v
                                      for k, v in profile.items()}, indent=2))


def _interpolate(table: dict[int, float], beyond: Callable[[int, float, int], float]) -> Callable[[int], float]:
    points = sorted(table)

    def f(x: int) -> float:
        if x in table:
            return table[x]
        if x > points[-1]:
            return beyond(points[-1], table[points[-1]], x)
        if x < points[0]:
            return table[points[0]]
        hi = next(p for p in points if p > x)
        lo = max(p for p in points if p < x)
        return table[lo] + (table[hi] - table[lo]) * (x - lo) / (hi - lo)

    return f


def load_profile(path: str | Path) -> Callable[[int], float]:
    """A callable B -> SPS(B): measured values, linear between them; beyond the largest measured B, throughput
    in tokens is held constant (SPS falls as 1/B), a conservative extrapolation."""
    table = {int(k): float(v) for k, v in json.loads(Path(path).read_text())["sps"].items()}
    return _interpolate(table, lambda b, v, x: v * b / x)


def load_draft_cost(path: str | Path) -> Callable[[int], float] | None:
    """A callable R -> seconds of one draft pass for R requests, or None if the profile was made without a draft.
    Linear between measured R; beyond the largest, proportional to R."""
    measured = json.loads(Path(path).read_text()).get("draft_seconds")
    if not measured:
        return None
    return _interpolate({int(k): float(v) for k, v in measured.items()}, lambda r, v, x: v * x / r)

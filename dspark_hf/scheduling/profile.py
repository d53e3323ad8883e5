"""Engine profiles: steps per second of the target's verification forward by batch size in tokens, SPS(B).

Measured on the actual target, device, dtype and thread count, over a realistic cached context; saved as JSON and
loaded as a callable for [`Scheduled`]. Real curves are jagged (kernel tiles, thread splits), so the loaded
profile interpolates between measured points without smoothing them away.
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

import torch
from transformers import DynamicCache

from ..evaluation.machine import machine_info


@torch.no_grad()
def profile_sps(target, rows: int = 1, max_tokens_per_row: int = 8, context: int = 256, repeats: int = 7,
                warmup: int = 2) -> dict:
    """SPS for verification batches of rows x n tokens, n = 1..max_tokens_per_row, after `context` cached tokens."""
    device = target.device
    vocab = target.get_output_embeddings().weight.shape[0]
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, vocab, (rows, context), generator=g).to(device)
    cache = DynamicCache()
    target(input_ids=prompt, past_key_values=cache, use_cache=True, logits_to_keep=1)
    sps = {}
    for n in range(1, max_tokens_per_row + 1):
        new = torch.randint(0, vocab, (rows, n), generator=g).to(device)
        mask = torch.ones(rows, context + n, dtype=torch.long, device=device)
        positions = torch.arange(context, context + n, device=device).expand(rows, -1)
        times = []
        for i in range(warmup + repeats):
            if device.type == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
            target(input_ids=new, attention_mask=mask, position_ids=positions, past_key_values=cache, use_cache=True,
                   logits_to_keep=0)
            if device.type == "cuda":
                torch.cuda.synchronize()
            cache.crop(-n)
            if i >= warmup:
                times.append(time.perf_counter() - start)
        sps[rows * n] = 1.0 / statistics.median(times)
    return {"target": getattr(target.config, "_name_or_path", ""), "rows": rows, "context": context,
            "repeats": repeats, "machine": machine_info(target), "sps": sps}


def save_profile(profile: dict, path: str | Path) -> None:
    Path(path).write_text(json.dumps({**profile, "sps": {str(k): v for k, v in profile["sps"].items()}}, indent=2))


def load_profile(path: str | Path):
    """A callable B -> SPS(B): measured values, linear between them; beyond the largest measured B, throughput
    in tokens is held constant (SPS falls as 1/B), a conservative extrapolation."""
    table = {int(k): float(v) for k, v in json.loads(Path(path).read_text())["sps"].items()}
    points = sorted(table)

    def sps(b: int) -> float:
        if b in table:
            return table[b]
        if b > points[-1]:
            return table[points[-1]] * points[-1] / b
        if b < points[0]:
            return table[points[0]]
        hi = next(p for p in points if p > b)
        lo = max(p for p in points if p < b)
        return table[lo] + (table[hi] - table[lo]) * (b - lo) / (hi - lo)

    return sps

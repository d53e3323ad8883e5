"""Measuring the engine: steps per second of the target's verification forward by batch size in tokens, SPS(B), and
the seconds one draft pass costs by number of requests; and what such measurements are keyed on (the target, the
draft's shape, the machine), so that costs measured for one engine are never used for another.

Measured on the actual target, device, dtype and thread count, over a realistic cached context. A verification batch
of B tokens is measured as R requests x n tokens for every R in `rows` and n = 1..max_tokens_per_row (the median over
the shapes that give the same B is SPS(B)), so the table covers the loads a server sees; beyond 16 tokens a row, at
widths about 1.5x apart (`measured_widths`), interpolated between. The files such measurements
are kept in, and the cost model read from them, are `costs`'s.
"""

from __future__ import annotations

import hashlib
import json
import statistics
from collections import defaultdict
from dataclasses import dataclass
from typing import Sequence

import torch
import transformers
from transformers import DynamicCache

from ..devices import clock, cpu_model
from ..internals import with_cache
from ..model.sampling import drafter
from ..options import POSITIVE, option, repeats_option
from ..version import __version__

# how the default policy's costs are measured (`costs.cached_costs`): cached tokens under the measured forwards, as in
# `dspark profile` and a chat prompt: a verification's cost grows with the context it attends to, and a plan that
# underrates it drafts where it loses (SmolLM2-135M at batch 8 on 2 CPU cores, 256 cached tokens: 6 tokens per row
# cost 1.98x one, experiments/default-policy/results/cost_cache.json)
AUTO_CONTEXT = 256
AUTO_REPEATS = 3  # the fastest of three: a cost measured once is kept, so a load spike must not make it
# part of the cache key: costs measured otherwise are re-measured
AUTO_METHOD = f"fastest of {AUTO_REPEATS}, shapes interleaved, context {AUTO_CONTEXT}, monotone in tokens"


@dataclass
class ProfileOptions:
    """What `dspark profile` measures ([`profile_sps`]) and where it writes the profile."""

    no_draft: bool = option(False, "skip the draft cost (the scheduler then ignores it)")
    rows: list[int] = option([1, 2, 4, 8, 16, 32], "requests per verification batch (each is measured)", type=POSITIVE)
    max_tokens: int = option(8, "verified tokens per row, 1..this", type=POSITIVE)
    context: int = option(256, "cached context length", type=POSITIVE)
    repeats: int = repeats_option(7)
    output: str = option("profile.json", "profile JSON to write (the scheduler and --profile read it)")


def interleaved_seconds(runs: dict, device, warmup: int, repeats: int, statistic=statistics.median,
                         on_repeat=lambda: None) -> dict:
    """Seconds of each of `runs` (key -> (fn, after or None)), all measured in every repeat in a rotating order: a
    machine whose speed drifts during the measurement (other work starting, clocks changing) slows every run alike,
    so the ratios between them, which are what a plan reads, stay right. Returns key -> `statistic` of its repeats
    after `warmup`."""
    keys, times = list(runs), defaultdict(list)
    for i in range(warmup + repeats):
        for key in keys[i % len(keys):] + keys[: i % len(keys)]:
            fn, after = runs[key]
            start = clock(device)
            fn()
            if i >= warmup:
                times[key].append(clock(device) - start)
            if after is not None:
                after()
        on_repeat()
    return {key: statistic(t) for key, t in times.items()}


@torch.no_grad()
def profile_sps(target, rows: int | Sequence[int] = 1, max_tokens_per_row: int = 8, context: int = 256,
                repeats: int = 7, warmup: int = 2, draft=None, progress: bool | str = True,
                verify: bool = True, statistic=statistics.median) -> dict:
    """Median seconds of verification forwards of R x n tokens after `context` cached tokens, for R in `rows` and
    n = 1..max_tokens_per_row, as SPS(B = R n); with a `draft`, also the seconds of one draft pass per R (verify=False:
    only those). Per R every shape is measured in every repeat, interleaved. progress: show a bar (a string: its
    label). statistic: of the repeats (`min` ignores load spikes when few repeats are affordable). What the
    measurement ran on is recorded as the cost cache keys it ([`profile_keys`]); the caller adds anything else (the
    CLI adds `evaluation.machine.machine_info`)."""
    from tqdm.auto import tqdm  # imported when a bar is shown, not with the package

    rows = [rows] if isinstance(rows, int) else list(rows)
    steps = max_tokens_per_row if verify else 0
    bar = tqdm(total=len(rows) * (warmup + repeats), desc=progress if isinstance(progress, str) else "profile",
               disable=not progress)
    device = target.device
    vocab = target.get_output_embeddings().weight.shape[0]
    g = torch.Generator(device="cpu").manual_seed(0)
    grid, draft_seconds = {}, {}
    for R in rows:
        prompt = torch.randint(0, vocab, (R, context), generator=g, device="cpu").to(device)
        cache = DynamicCache()
        out = target(input_ids=prompt, **with_cache(cache), use_cache=True, logits_to_keep=1,
                     output_hidden_states=draft.hidden_states_request if draft is not None else None)
        runs = {n: _verification(target, cache, context, n, torch.randint(0, vocab, (R, n), generator=g,
                                                                          device="cpu").to(device))
                for n in measured_widths(steps)}
        if draft is not None:
            positions = torch.arange(context, device=device).expand(R, -1)
            ctx = draft.encode_context(draft.target_features(out.hidden_states), positions,
                                       torch.ones_like(positions, dtype=torch.bool))
            anchor, anchor_pos, draft_block = prompt[:, -1], torch.full((R,), context, device=device), drafter(draft)
            runs["draft"] = (lambda: draft_block(anchor, anchor_pos, ctx), None)
        seconds = interleaved_seconds(runs, device, warmup, repeats, statistic, on_repeat=lambda: bar.update(1))
        if steps:
            grid[R] = {n: 1.0 / seconds[n] for n in measured_widths(steps)}
        if draft is not None:
            draft_seconds[R] = seconds["draft"]
    bar.close()
    by_tokens = defaultdict(list)
    for R, row in grid.items():
        for n, v in row.items():
            by_tokens[R * n].append(v)
    return {"target": getattr(target.config, "_name_or_path", ""), "rows": sorted(grid), "context": context,
            "repeats": repeats, **profile_keys(target, draft),
            "sps": {b: statistics.median(v) for b, v in sorted(by_tokens.items())},
            "grid": grid, "draft_seconds": draft_seconds or None}


def measured_widths(max_tokens: int, every_up_to: int = 16) -> list[int]:
    """The tokens per row a profile measures, up to max_tokens: each one up to `every_up_to` (the blocks drafts are
    trained with), then about 1.5 times the last, and max_tokens; the costs between are interpolated. A draft whose
    block_size was set to 100 is measured at 21 widths, not 101 (minutes, not most of an hour, on a CPU)."""
    widths = list(range(1, min(max_tokens, every_up_to) + 1))
    while widths and widths[-1] < max_tokens:
        widths.append(min(max_tokens, max(widths[-1] + 1, round(widths[-1] * 1.5))))
    return widths


def _verification(target, cache, context: int, n: int, tokens: torch.Tensor):
    """(run, undo) for one verification forward of (R, n) `tokens` after `context` cached ones."""
    R, device = tokens.shape[0], tokens.device
    mask = torch.ones(R, context + n, dtype=torch.long, device=device)
    positions = torch.arange(context, context + n, device=device).expand(R, -1)
    return (lambda: target(input_ids=tokens, attention_mask=mask, position_ids=positions, **with_cache(cache),
                           use_cache=True, logits_to_keep=0),
            lambda: cache.crop(-n))


def auto_context(target, tokens: int) -> int:
    """AUTO_CONTEXT cached tokens, fewer where the target's positions end sooner (learned position embeddings)."""
    limit = getattr(target.config.get_text_config(), "max_position_embeddings", None)
    return AUTO_CONTEXT if not limit else max(1, min(AUTO_CONTEXT, limit - tokens))


def _machine_key(target) -> dict:
    device = target.device
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
    else:  # mps, xpu, ...: never the CPU's costs under the CPU's name
        name = f"cpu: {cpu_model()}" if device.type == "cpu" else device.type
    # generate() runs inside a caller's autocast, which changes the kernels measured as much as the dtype does
    autocast = str(torch.get_autocast_dtype(device.type)) if torch.is_autocast_enabled(device.type) else None
    return {"device": name, "threads": torch.get_num_threads(), "dtype": str(target.dtype), "autocast": autocast,
            "attention": target.config._attn_implementation, "torch": torch.__version__,
            "transformers": transformers.__version__, "dspark_hf": __version__, "method": AUTO_METHOD}


def target_key(target) -> dict:
    """The target (its class and text config) and the machine it runs on, as costs measured for it are kept under."""
    config = {k: v for k, v in target.config.get_text_config().to_dict().items() if not k.startswith("_") and k not in (
        "transformers_version", "dtype", "torch_dtype")}
    return {"model": type(target).__name__, "config": config, **_machine_key(target)}


def draft_key(draft) -> str:
    """A draft's class, shape and dtype, hashed: what its draft pass costs depends on them only."""
    c = draft.config
    # the class too: a subclass proposing blocks its own way (the oracle's Python loop) costs what it costs
    shape = (type(draft).__qualname__, c.hidden_size, c.intermediate_size, c.num_hidden_layers,
             c.num_attention_heads, c.num_key_value_heads, c.block_size, c.head_type, c.markov_rank,
             c.draft_vocab_size, c.confidence_head, str(draft.dtype))
    return hashlib.sha1(json.dumps(shape, default=str).encode()).hexdigest()[:16]


def cache_key(target, draft) -> tuple[str, str]:
    """(the cost cache file's name, the draft's key in it): what costs measured for `target` and `draft` are kept
    under."""
    key = json.dumps(target_key(target), sort_keys=True, default=str)
    return hashlib.sha1(key.encode()).hexdigest()[:20], draft_key(draft)


def profile_keys(target, draft) -> dict:
    """What the cost cache keys costs on, as a profile records it (as JSON reads it back, to compare)."""
    target = {k: v for k, v in target_key(target).items() if k != "method"}
    draft = None if draft is None else draft_key(draft)
    return json.loads(json.dumps({"target_key": target, "draft_key": draft}, default=str))

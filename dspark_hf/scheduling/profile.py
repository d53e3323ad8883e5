"""Engine profiles: steps per second of the target's verification forward by batch size in tokens, SPS(B), and
the seconds one draft pass costs by number of requests.

Measured on the actual target, device, dtype and thread count, over a realistic cached context; saved as JSON and
loaded by [`Scheduled.from_profile`]. A verification batch of B tokens is measured as R requests x n tokens for
every R in `rows` and n = 1..max_tokens_per_row (the median over the shapes that give the same B is SPS(B)), so the
table covers the loads a server sees. Real curves are jagged (kernel tiles, thread splits): the loaded profile
interpolates between measured points without smoothing them away.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import statistics
import threading
import warnings
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import torch
import transformers
from transformers import DynamicCache

from ..devices import clock
from ..internals import with_cache
from ..evaluation.machine import machine_info
from ..files import write_atomic


def _interleaved_seconds(runs: dict, device, warmup: int, repeats: int, statistic=statistics.median,
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
    label). statistic: of the repeats (`min` ignores load spikes when few repeats are affordable)."""
    from tqdm.auto import tqdm

    from ..generation.drafting import drafter  # generation imports scheduling: import it when called

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
                for n in range(1, steps + 1)}
        if draft is not None:
            positions = torch.arange(context, device=device).expand(R, -1)
            ctx = draft.encode_context(draft.target_features(out.hidden_states), positions,
                                       torch.ones_like(positions, dtype=torch.bool))
            anchor, anchor_pos, draft_block = prompt[:, -1], torch.full((R,), context, device=device), drafter(draft)
            runs["draft"] = (lambda: draft_block(anchor, anchor_pos, ctx), None)
        seconds = _interleaved_seconds(runs, device, warmup, repeats, statistic, on_repeat=lambda: bar.update(1))
        if steps:
            grid[R] = {n: 1.0 / seconds[n] for n in range(1, steps + 1)}
        if draft is not None:
            draft_seconds[R] = seconds["draft"]
    bar.close()
    by_tokens = defaultdict(list)
    for R, row in grid.items():
        for n, v in row.items():
            by_tokens[R * n].append(v)
    return {"target": getattr(target.config, "_name_or_path", ""), "rows": sorted(grid), "context": context,
            "repeats": repeats, "machine": machine_info(target, draft), **_profile_keys(target, draft),
            "sps": {b: statistics.median(v) for b, v in sorted(by_tokens.items())},
            "grid": grid, "draft_seconds": draft_seconds or None}


def _verification(target, cache, context: int, n: int, tokens: torch.Tensor):
    """(run, undo) for one verification forward of (R, n) `tokens` after `context` cached ones."""
    R, device = tokens.shape[0], tokens.device
    mask = torch.ones(R, context + n, dtype=torch.long, device=device)
    positions = torch.arange(context, context + n, device=device).expand(R, -1)
    return (lambda: target(input_ids=tokens, attention_mask=mask, position_ids=positions, **with_cache(cache),
                           use_cache=True, logits_to_keep=0),
            lambda: cache.crop(-n))


def save_profile(profile: dict, path: str | Path) -> None:
    def keys_to_str(d):
        return {str(k): keys_to_str(v) if isinstance(v, dict) else v for k, v in d.items()}

    write_atomic(path, json.dumps({k: keys_to_str(v) if isinstance(v, dict) and k != "machine" else v
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


def measured_table(value, what: str) -> dict[int, float]:
    """JSON's {"count": number} as {count: number}, counts >= 1 and numbers positive and finite, or a ValueError
    saying what in `what` is wrong."""
    if not isinstance(value, dict) or not value:
        raise ValueError(f"{what} must be a non-empty table of counts to measured numbers, got {value!r:.60}")
    table = {}
    for k, v in value.items():
        try:
            n, x = int(k), float(v)
        except (TypeError, ValueError):
            raise ValueError(f"{what} holds {k!r}: {v!r:.60}, not a count and a number") from None
        if n < 1 or not math.isfinite(x) or x <= 0:
            raise ValueError(f"{what} holds {k!r}: {v!r}; counts are >= 1, measurements positive and finite")
        table[n] = x
    return table


def read_profile(path: str | Path) -> dict:
    """The JSON `dspark profile` wrote, its tables checked, or a ValueError naming the file."""
    try:
        profile = json.loads(Path(path).read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ValueError(f"{path} is not a `dspark profile` JSON file ({error}).") from error
    if not isinstance(profile, dict) or not profile.get("sps"):
        raise ValueError(f"{path} holds no SPS measurements: make it with `dspark profile`.")
    try:
        measured_table(profile["sps"], "sps")
        if profile.get("grid"):
            measured_grid(profile["grid"], "grid")
        if profile.get("draft_seconds"):
            measured_table(profile["draft_seconds"], "draft_seconds")
    except ValueError as error:
        raise ValueError(f"{path}: {error}; make it again with `dspark profile`.") from None
    return profile


def measured_grid(value, what: str) -> dict[int, dict[int, float]]:
    """JSON's {"rows": {"tokens": number}} as {rows: {tokens: number}}, checked as by [`measured_table`]."""
    if not isinstance(value, dict):
        raise ValueError(f"{what} must be a table of row counts to tables, got {type(value).__name__}")
    rows = measured_table({R: 1 for R in value}, what) if value else {}
    return {R: measured_table(row, f"{what}[{R}]") for R, row in zip(rows, value.values())}


class ProfileMismatchWarning(UserWarning):
    """A `dspark profile` file planned against for other models or another machine than it measured, or for longer
    verifications than it measured."""


# recorded, not compared: the measuring code's version and method do not change the engine's speed
_UNCOMPARED = ("dspark_hf", "method")
_WARNED: set[str] = set()  # each mismatch is said once per process, not once per generate() call


def _profile_keys(target, draft) -> dict:
    """What the cost cache keys costs on, as a profile records it (as JSON reads it back, to compare)."""
    target_key = {k: v for k, v in _target_key(target).items() if k != "method"}
    draft_key = None if draft is None else _draft_key(draft)
    return json.loads(json.dumps({"target_key": target_key, "draft_key": draft_key}, default=str))


def check_profile(path: str | Path, target, draft) -> None:
    """Warn once (ProfileMismatchWarning) where the profile at `path` was measured for another target, draft or
    machine than `target` and `draft` (as the cost cache keys them: model, config, device, dtype, autocast, threads,
    attention, versions), or for fewer tokens per row than the draft's block_size + 1 (longer ones are then
    extrapolated). A profile from before these keys were recorded is checked for the last only."""
    profile, (now, problems) = read_profile(path), (_profile_keys(target, draft), [])
    if profile.get("target_key") is not None:
        recorded = profile["target_key"]
        differs = [k for k in sorted(set(recorded) | set(now["target_key"]))
                   if k not in _UNCOMPARED and recorded.get(k) != now["target_key"].get(k)]
        if differs:
            problems.append(f"another target or machine (differing in {', '.join(differs)})")
    if profile.get("draft_key") and now["draft_key"] and profile["draft_key"] != now["draft_key"]:
        problems.append("another draft (differing in class, shape or dtype)")
    tokens = draft.config.block_size + 1 if draft is not None else 1
    if profile.get("grid"):
        measured = min(max(row) for row in measured_grid(profile["grid"], "grid").values())
        if measured < tokens:
            problems.append(f"up to {measured} tokens per row, this draft verifies up to {tokens}")
    message = (f"{path} was measured for {'; and '.join(problems)}: plans against it may be wrong; re-run `dspark "
               f"profile --max-tokens {tokens}` with these models on this machine.")
    if problems and message not in _WARNED:
        _WARNED.add(message)
        warnings.warn(message, ProfileMismatchWarning, stacklevel=3)


def load_profile(path: str | Path) -> Callable[[int], float]:
    """A callable B -> SPS(B) from a `dspark profile` file, as by [`sps_curve`]."""
    return sps_curve(read_profile(path)["sps"])


def sps_curve(table) -> Callable[[int], float]:
    """A {B: SPS(B)} table (keys may be JSON's strings) as a callable B -> SPS(B): measured values, linear between
    them; beyond the largest measured B, throughput in tokens is held constant (SPS falls as 1/B), a conservative
    extrapolation."""
    return _interpolate(measured_table(table, "sps"), lambda b, v, x: v * b / x)


def load_draft_cost(path: str | Path) -> Callable[[int], float] | None:
    """A callable R -> seconds of one draft pass for R requests, or None if the profile was made without a draft.
    Linear between measured R; beyond the largest, proportional to R."""
    measured = read_profile(path).get("draft_seconds")
    if not measured:
        return None
    return _interpolate(measured_table(measured, "draft_seconds"), lambda r, v, x: v * x / r)


# -- the cost model the default policy plans against, measured once per machine and cached on disk ----------------
# cached tokens under the measured forwards, as in `dspark profile` and a chat prompt: a verification's cost grows
# with the context it attends to, and a plan that underrates it drafts where it loses (SmolLM2-135M at batch 8 on
# 2 CPU cores, 256 cached tokens: 6 tokens per row cost 1.98x one, experiments/default-policy/results/cost_cache.json)
AUTO_CONTEXT = 256
AUTO_REPEATS = 3  # the fastest of three: a cost measured once is kept, so a load spike must not make it
# larger batches are priced in proportion to this many rows (EngineCosts extrapolates so): measuring them would hold
# rows x AUTO_CONTEXT cached tokens (40,000 rows of a tiny test model took 16 GB)
AUTO_MAX_ROWS = 64
# part of the cache key: costs measured otherwise are re-measured
AUTO_METHOD = f"fastest of {AUTO_REPEATS}, shapes interleaved, context {AUTO_CONTEXT}, monotone in tokens"


@dataclass
class EngineCosts:
    """Seconds of the target's verification forward by rows R and tokens per row n, and of one draft pass by R.
    Linear in R between measured rows, proportional to R beyond the largest (and flat below the smallest)."""

    verify_seconds: dict[int, dict[int, float]]
    draft_seconds: dict[int, float]

    def __post_init__(self):
        self.verify_seconds = {R: _monotone(row) for R, row in self.verify_seconds.items()}

    def verify(self, rows: int, tokens: int) -> float:
        def at(row):  # beyond the longest measured verification, proportional to the tokens
            return row[tokens] if tokens in row else row[max(row)] * tokens / max(row)

        return _interpolate({R: at(row) for R, row in self.verify_seconds.items()}, lambda r, v, x: v * x / r)(rows)

    def draft(self, rows: int) -> float:
        return _interpolate(self.draft_seconds, lambda r, v, x: v * x / r)(rows)

    @classmethod
    def from_profile(cls, path: str | Path) -> "EngineCosts":
        """The costs in a `dspark profile` JSON (its grid of SPS by rows and tokens, and its draft pass)."""
        profile = read_profile(path)
        if not profile.get("grid") or not profile.get("draft_seconds"):
            raise ValueError(f"{path}: the default policy needs the verification grid and the draft's cost; make the "
                             "profile with `dspark profile` without --no-draft.")
        grid = measured_grid(profile["grid"], "grid")
        return cls({R: {n: 1.0 / sps for n, sps in row.items()} for R, row in grid.items()},
                   measured_table(profile["draft_seconds"], "draft_seconds"))


def profile_cache_dir() -> Path:
    """Where measured costs are kept: ``$DSPARK_HF_PROFILE_CACHE``, else ``profiles/`` in the dspark-hf cache."""
    from ..defaults import cache_dir

    return Path(os.environ.get("DSPARK_HF_PROFILE_CACHE") or cache_dir() / "profiles").expanduser()


def _machine_key(target) -> dict:
    from .. import __version__
    from ..evaluation.machine import cpu_model

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


def _target_key(target) -> dict:
    config = {k: v for k, v in target.config.get_text_config().to_dict().items() if not k.startswith("_") and k not in (
        "transformers_version", "dtype", "torch_dtype")}
    return {"model": type(target).__name__, "config": config, **_machine_key(target)}


def _draft_key(draft) -> str:
    c = draft.config
    # the class too: a subclass proposing blocks its own way (the oracle's Python loop) costs what it costs
    shape = (type(draft).__qualname__, c.hidden_size, c.intermediate_size, c.num_hidden_layers,
             c.num_attention_heads, c.num_key_value_heads, c.block_size, c.head_type, c.markov_rank, c.draft_vocab_size, c.confidence_head, str(draft.dtype))
    return hashlib.sha1(json.dumps(shape, default=str).encode()).hexdigest()[:16]


def cached_costs(target, draft, rows: Sequence[int], progress: bool = True) -> EngineCosts:
    """The costs of `target` on its device, dtype (under the caller's autocast, if any) and thread count (and of
    `draft`'s pass) for `rows`: read from the profile cache, and what is missing measured now (a few seconds per row
    count, shown as a bar) and added to it.

    Measured after AUTO_CONTEXT cached tokens, up to block_size + 1 verified tokens per row, at AUTO_MAX_ROWS rows at
    most."""
    rows = sorted({min(R, AUTO_MAX_ROWS) for R in rows})
    key = _target_key(target)
    path = profile_cache_dir() / (cache_key(target, draft)[0] + ".json")
    stored = _read_cache(path, key)
    verify = measured_grid(stored["verify"], "verify")
    draft_key = _draft_key(draft)
    drafts = measured_table(stored["drafts"][draft_key], "drafts") if draft_key in stored["drafts"] else {}
    tokens = draft.config.block_size + 1
    needs_verify = sorted({R for R in rows if R not in verify or max(verify[R]) < tokens})
    needs_draft = sorted({R for R in rows if R not in drafts} - set(needs_verify))
    label = "profiling this machine (once)"
    for missing, with_verify in ((needs_verify, True), (needs_draft, False)):
        if not missing:
            continue
        measured = profile_sps(target, missing, tokens, _auto_context(target, tokens), AUTO_REPEATS, warmup=1,
                               draft=draft, progress=label if progress else False, verify=with_verify, statistic=min)
        verify.update({R: {n: 1.0 / sps for n, sps in row.items()} for R, row in measured["grid"].items()})
        drafts.update(measured["draft_seconds"])
    if needs_verify or needs_draft:
        _merge_into(path, key, verify, draft_key, drafts)
    # the rows asked for only: other row counts in the file are what earlier calls happened to measure, and a plan
    # interpolating between them would change a seeded sample with the history of this machine
    return EngineCosts({R: verify[R] for R in rows}, {R: drafts[R] for R in rows})


def cache_key(target, draft) -> tuple[str, str]:
    """(the cost cache file's name, the draft's key in it): what costs measured for `target` and `draft` are kept
    under."""
    key = json.dumps(_target_key(target), sort_keys=True, default=str)
    return hashlib.sha1(key.encode()).hexdigest()[:20], _draft_key(draft)


def _auto_context(target, tokens: int) -> int:
    """AUTO_CONTEXT cached tokens, fewer where the target's positions end sooner (learned position embeddings)."""
    limit = getattr(target.config.get_text_config(), "max_position_embeddings", None)
    return AUTO_CONTEXT if not limit else max(1, min(AUTO_CONTEXT, limit - tokens))


def _monotone(seconds: dict[int, float]) -> dict[int, float]:
    """Seconds by tokens, never less for more tokens: a forward of n + 1 tokens does all the work of n, so a
    measurement saying otherwise is noise, and a plan trusting it would verify more for free."""
    out, slowest = {}, 0.0
    for n in sorted(seconds):
        slowest = out[n] = max(slowest, seconds[n])
    return out


_CACHE_LOCK = threading.Lock()  # threads of one process merge into the cache one at a time
_UNSAVED: dict[Path, dict] = {}  # cache files this process could not write, and what it would have written


def _read_cache(path: Path, key: dict, warn: bool = True) -> dict:
    """The cost cache at `path` as stored (or as this process could not store it), or a fresh one; a file that
    cannot be read is named in a warning, and what it lacks is measured again and written over it."""
    if path in _UNSAVED:
        return _UNSAVED[path]
    fresh = {"key": key, "verify": {}, "drafts": {}}
    if not path.exists():
        return fresh
    try:
        stored = json.loads(path.read_text())
        measured_grid(stored["verify"], "verify")
        if not isinstance(stored["drafts"], dict):
            raise ValueError(f"drafts must be a table, got {type(stored['drafts']).__name__}")
        for draft, row in stored["drafts"].items():
            measured_table(row, f"drafts[{draft}]")
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError, ValueError) as error:
        if warn:
            warnings.warn(f"{path}: the default policy's cost cache cannot be read ({type(error).__name__}: "
                          f"{error}); measuring again and writing it anew.", stacklevel=3)
        return fresh
    return stored


def _merge_into(path: Path, key: dict, verify: dict, draft_key: str, drafts: dict) -> None:
    """Add what was measured to the cache file: re-read first (another thread or process may have added to it) and
    replaced atomically, under a lock. Where the file cannot be written (a read-only home), say so once and keep
    the costs for the rest of this process."""
    with _CACHE_LOCK, _file_lock(path):
        current = _read_cache(path, key, warn=False)
        current["verify"].update({str(R): {str(n): v for n, v in row.items()} for R, row in verify.items()})
        current["drafts"].setdefault(draft_key, {}).update({str(R): v for R, v in drafts.items()})
        try:
            write_atomic(path, json.dumps(current, indent=1, default=str))
        except OSError as error:
            if path not in _UNSAVED:
                warnings.warn(f"cannot save the default policy's measured costs to {path} ({error}); they are kept "
                              "for this process only. Set DSPARK_HF_PROFILE_CACHE to a writable folder to keep them.",
                              stacklevel=3)
            _UNSAVED[path] = current


@contextlib.contextmanager
def _file_lock(path: Path):
    """An exclusive lock on a file beside `path` while held, so processes measuring at once lose none of each
    other's costs (where the system has flock and the folder is writable; else the atomic replace alone)."""
    handle = None
    try:
        import fcntl

        path.parent.mkdir(parents=True, exist_ok=True)
        handle = open(path.with_suffix(".lock"), "a")
        fcntl.flock(handle, fcntl.LOCK_EX)
    except (ImportError, OSError):
        pass
    try:
        yield
    finally:
        if handle is not None:
            handle.close()  # closing releases the lock

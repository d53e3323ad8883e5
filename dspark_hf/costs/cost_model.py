"""Engine costs: the cost model a plan prices its rounds with, the `dspark profile` files it reads them from, and the
on-disk cache of the costs measured on this machine: the default policy's, of a call's own rounds on the path it runs
([`path_costs`], timed with the decoding loop's [`RoundClock`]), and SSD's of plain forwards ([`cached_costs`],
measured by `profile`).

A profile is saved as JSON and loaded by [`Scheduled.from_profile`] or [`EngineCosts.from_profile`]. Real curves are
jagged (kernel tiles, thread splits): a loaded profile interpolates between measured points without smoothing them
away. The cache keeps one file per target and machine ([`profile.cache_key`]); processes and threads measuring at
once add to it under a lock.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import threading
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Protocol, Sequence, runtime_checkable

import torch

from ..files import cache_dir, write_atomic
from .profile import AUTO_REPEATS, auto_context, cache_key, draft_key, interleaved_seconds, profile_keys, \
    profile_sps, target_key


# -- `dspark profile` files -------------------------------------------------------------------------------------------
def save_profile(profile: dict, path: str | Path) -> None:
    """Write a measured profile ([`profile.profile_sps`]) to `path` as JSON, whole or not at all."""
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


def check_profile(path: str | Path, target, draft) -> None:
    """Warn once (ProfileMismatchWarning) where the profile at `path` was measured for another target, draft or
    machine than `target` and `draft` (as the cost cache keys them: model, config, device, dtype, autocast, threads,
    attention, versions), or for fewer tokens per row than the draft's block_size + 1 (longer ones are then
    extrapolated). A profile from before these keys were recorded is checked for the last only."""
    profile, (now, problems) = read_profile(path), (profile_keys(target, draft), [])
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


# -- the cost model the default policy plans against, measured once per machine and cached on disk -----------------
# larger batches are priced in proportion to this many rows (EngineCosts extrapolates so): measuring them would hold
# rows x AUTO_CONTEXT cached tokens (40,000 rows of a tiny test model took 16 GB)
AUTO_MAX_ROWS = 64


@dataclass
class EngineCosts:
    """Seconds of the target's verification forward by rows R and tokens per row n, of one draft pass by R, of a
    round that drafts nothing by R (its forward projects nothing into the draft's context; default: verifying one
    token), and of projecting what such rounds left into the draft's context when drafting resumes, by R (default:
    nothing; a `dspark profile` file does not time it). Linear in R between measured rows and in tokens between
    measured widths, proportional beyond the largest (and flat below the smallest)."""

    verify_seconds: dict[int, dict[int, float]]
    draft_seconds: dict[int, float]
    plain_seconds: dict[int, float] | None = None
    catch_up_seconds: dict[int, float] | None = None

    def __post_init__(self):
        self.verify_seconds = {R: _monotone(row) for R, row in self.verify_seconds.items()}

    def plain(self, rows: int) -> float:
        """Seconds of a round that drafts nothing: plain generate()'s step, as the decoding loop runs it."""
        if self.plain_seconds is None:
            return self.verify(rows, 1)
        return _interpolate(self.plain_seconds, lambda r, v, x: v * x / r)(rows)

    def verify(self, rows: int, tokens: int) -> float:
        def at(row):  # between measured widths interpolated; beyond the longest, proportional to the tokens
            return _interpolate(row, lambda n, v, x: v * x / n)(tokens)

        return _interpolate({R: at(row) for R, row in self.verify_seconds.items()}, lambda r, v, x: v * x / r)(rows)

    def draft(self, rows: int) -> float:
        return _interpolate(self.draft_seconds, lambda r, v, x: v * x / r)(rows)

    def catch_up(self, rows: int) -> float:
        """Seconds of projecting a pause's slots into the draft's context before its probe drafts (a few dozen
        slots cost about what a few cost: the call's overhead, not its arithmetic, on a CPU)."""
        if self.catch_up_seconds is None:
            return 0.0
        return _interpolate(self.catch_up_seconds, lambda r, v, x: v * x / r)(rows)

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


# -- the costs of a call's own rounds, measured on the path it runs ----------------------------------------------------
# part of what path costs are kept under: costs measured otherwise are measured again
PATH_METHOD = f"the call's own steps on its own state, a pause's catch-up too, fastest of {AUTO_REPEATS}, interleaved"


@runtime_checkable
class RoundClock(Protocol):
    """A call's own rounds, ready to be timed on the path it runs (eager, or compiled and how) at its batch size:
    the decoding loop provides one (`dspark_hf.generation.pricing`), the default policy measures with it
    ([`path_costs`])."""

    target: object
    draft: object
    rows: int  # the rows every round runs, finished ones included
    key: dict  # the path and what else its costs depend on, beside the target's, the machine's and the draft's keys

    def runs(self) -> dict:
        """What to time, each a callable: ("verify", w) a drafting round's verification w tokens wide (its forward,
        processing and acceptance), "plain" a round that drafts nothing, "draft" the draft's block, "catch_up" the
        draft's context projected over the slots a pause leaves (`state.DecodingState.catch_up`)."""

    def verify_table(self, seconds: dict[int, float]) -> dict[int, float]:
        """Seconds by width measured -> seconds by tokens verified per row, 1 to block_size + 1."""


def path_costs(clock: RoundClock, progress: bool = True) -> EngineCosts:
    """The costs of a call's own rounds on its path, at its batch size: read from the profile cache, or timed now
    with `clock` (a few seconds, shown as a bar) and added to it."""
    target, draft = clock.target, clock.draft
    path = profile_cache_dir() / (cache_key(target, draft)[0] + ".json")
    entry = json.dumps({"draft": draft_key(draft), "method": PATH_METHOD, **clock.key}, sort_keys=True, default=str)
    stored = _read_cache(path, target_key(target))
    if entry not in stored["rounds"]:
        from tqdm.auto import tqdm  # imported when measuring, not with the package

        runs = {name: (fn, None) for name, fn in clock.runs().items()}
        bar = tqdm(total=1 + AUTO_REPEATS, desc="profiling this machine (once)", disable=not progress)
        # a sampled call's rounds draw random numbers: timed on a fork of the generator, so that a seed gives the
        # caller the same sample whether or not its call measured
        with torch.random.fork_rng(devices=[target.device] if target.device.type == "cuda" else []):
            seconds = interleaved_seconds(runs, target.device, 1, AUTO_REPEATS, min, on_repeat=lambda: bar.update(1))
        bar.close()
        widths = {name[1]: v for name, v in seconds.items() if isinstance(name, tuple)}
        measured = {"verify": {str(n): v for n, v in clock.verify_table(widths).items()},
                    **{name: seconds[name] for name in ("plain", "draft", "catch_up")}}
        _merge_into(path, target_key(target), {}, None, {}, rounds={entry: measured})
        stored = _read_cache(path, target_key(target), warn=False)
    measured, R = stored["rounds"][entry], clock.rows
    return EngineCosts({R: measured_table(measured["verify"], "verify")}, {R: measured["draft"]},
                       {R: measured["plain"]}, {R: measured["catch_up"]})


def profile_cache_dir() -> Path:
    """Where measured costs are kept: ``$DSPARK_HF_PROFILE_CACHE``, else ``profiles/`` in the dspark-hf cache."""
    return Path(os.environ.get("DSPARK_HF_PROFILE_CACHE") or cache_dir() / "profiles").expanduser()


def cached_costs(target, draft, rows: Sequence[int], progress: bool = True) -> EngineCosts:
    """The costs of `target` on its device, dtype (under the caller's autocast, if any) and thread count (and of
    `draft`'s pass) for `rows`: read from the profile cache, and what is missing measured now (a few seconds per row
    count, shown as a bar) and added to it.

    Measured after AUTO_CONTEXT cached tokens, up to block_size + 1 verified tokens per row, at AUTO_MAX_ROWS rows at
    most."""
    rows = sorted({min(R, AUTO_MAX_ROWS) for R in rows})
    key = target_key(target)
    path = profile_cache_dir() / (cache_key(target, draft)[0] + ".json")
    stored = _read_cache(path, key)
    verify = measured_grid(stored["verify"], "verify")
    drafted_as = draft_key(draft)
    drafts = measured_table(stored["drafts"][drafted_as], "drafts") if drafted_as in stored["drafts"] else {}
    tokens = draft.config.block_size + 1
    needs_verify = sorted({R for R in rows if R not in verify or max(verify[R]) < tokens})
    needs_draft = sorted({R for R in rows if R not in drafts} - set(needs_verify))
    label = "profiling this machine (once)"
    for missing, with_verify in ((needs_verify, True), (needs_draft, False)):
        if not missing:
            continue
        measured = profile_sps(target, missing, tokens, auto_context(target, tokens), AUTO_REPEATS, warmup=1,
                               draft=draft, progress=label if progress else False, verify=with_verify, statistic=min)
        verify.update({R: {n: 1.0 / sps for n, sps in row.items()} for R, row in measured["grid"].items()})
        drafts.update(measured["draft_seconds"])
    if needs_verify or needs_draft:
        _merge_into(path, key, verify, drafted_as, drafts)
    # the rows asked for only: other row counts in the file are what earlier calls happened to measure, and a plan
    # interpolating between them would change a seeded sample with the history of this machine
    return EngineCosts({R: verify[R] for R in rows}, {R: drafts[R] for R in rows})


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
    fresh = {"key": key, "verify": {}, "drafts": {}, "rounds": {}}
    if not path.exists():
        return fresh
    try:
        stored = json.loads(path.read_text())
        measured_grid(stored["verify"], "verify")
        if not isinstance(stored["drafts"], dict):
            raise ValueError(f"drafts must be a table, got {type(stored['drafts']).__name__}")
        for draft, row in stored["drafts"].items():
            measured_table(row, f"drafts[{draft}]")
        stored.setdefault("rounds", {})
        for entry, measured in stored["rounds"].items():
            measured_table(measured["verify"], f"rounds[{entry}]")
            # the method is part of every entry: those of earlier methods, never read again, timed no catch-up
            timed = ("plain", "draft", "catch_up") if json.dumps(PATH_METHOD) in entry else ("plain", "draft")
            measured_table({i: measured[name] for i, name in enumerate(timed, 1)}, f"rounds[{entry}]")
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError, ValueError) as error:
        if warn:
            warnings.warn(f"{path}: the default policy's cost cache cannot be read ({type(error).__name__}: "
                          f"{error}); measuring again and writing it anew.", stacklevel=3)
        return fresh
    return stored


def _merge_into(path: Path, key: dict, verify: dict, drafted_as: str | None, drafts: dict,
                rounds: dict | None = None) -> None:
    """Add what was measured to the cache file: re-read first (another thread or process may have added to it) and
    replaced atomically, under a lock. Where the file cannot be written (a read-only home), say so once and keep
    the costs for the rest of this process."""
    with _CACHE_LOCK, _file_lock(path):
        current = _read_cache(path, key, warn=False)
        current["verify"].update({str(R): {str(n): v for n, v in row.items()} for R, row in verify.items()})
        if drafts:
            current["drafts"].setdefault(drafted_as, {}).update({str(R): v for R, v in drafts.items()})
        current["rounds"].update(rounds or {})
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

"""The decoding state: what a DSpark decode keeps on the device between rounds, preallocated for the call.

Row b keeps its padded sequence in slots: its prompt with the prompt's left padding, then every token it commits.
Slot j holds the same token in the target's KV cache (`cache`) and in the draft's context (the keys and values each
draft layer projects from the target's features of it, eq. 2-3), with its position (`positions`) and whether it is
a token at all (`real`: False at padding). A forward writes its tokens from each row's end (`end`) on; a row keeps
what it accepted by moving its end past it, and the next forward writes over the rest. Nothing is copied.

A round after which nothing is drafted (the policy pauses drafting) costs what plain generate()'s step costs: its
forward keeps the target's features of its tokens (`features`) without projecting them into the draft's context,
and the first time the draft reads its context again, every slot left so is projected at once (`catch_up`).

Two ways to offset the rows:
- each row at its own end (the default): no slot is wasted, and every query gets a mask of its own
  (`internals.prepared_masks`), which models built on transformers' masking utilities take as it is;
- all rows at one shared end, for models that build something else from a 2D mask (ALiBi biases) or whose attention
  reads no prepared mask: every forward takes as many slots in every row, and those a row did not keep become holes
  (not real: the 2D mask hides them, and positions count only real tokens). Sliding windows count slots, so a model
  with them never decodes this way.

Sizes: compiled steps get buffers for the prompt and every new token (or for `max_cache_len` tokens, where the
call gives it; a forward's writes past them fall on the last slot, see `cache.row_slots`), and, as transformers'
static cache, keep the largest a call needed so far, so that later calls that fit reuse the steps (and, on a GPU,
their CUDA graphs) and attention reads no more slots than plain generate()'s static cache does; eager calls start
smaller and double the buffers as the rows grow (`make_room`), as plain generate()'s dynamic cache grows.
"""

from __future__ import annotations

import threading
import weakref
from dataclasses import dataclass, field

import torch

from .. import internals
from ..model.modeling_dspark import DSparkContext, DSparkDraftModel
from .cache import DecodingCache, grown, row_slots, write_rows
from .host import HostRead


def attention_masks(target, real: torch.Tensor, slots: torch.Tensor, window: int | None):
    """What `target`'s attention reads for queries at `slots` (B, Q) over keys [0, W): the real ones (`real` (B, W))
    at or before each query's slot, and in sliding-window layers the last `window` of them
    (`internals.prepared_masks`)."""
    keys = torch.arange(real.shape[1], device=slots.device)
    allowed = real[:, None, :] & (keys <= slots[..., None])  # (B, Q, W)
    windowed = None if window is None else allowed & (keys > slots[..., None] - window)
    return internals.prepared_masks(target, allowed, windowed)


@dataclass
class DecodingState:
    """The device side of a decode of B rows in S slots (see the module's docstring).

    cache: the target's keys and values; context_keys / context_values: per draft layer (B, H_kv, S, head_dim);
    positions (B, S), real (B, S) bool; end (B,): slots a row has filled; count (B,): tokens it has committed, its
    prompt's included (the anchor's position); anchor (B,): its last committed token, not yet in any slot. shared:
    the rows share one end (see the module). window: the target's sliding window, or None. host_ends: the ends as
    the host last read them (`mirror`), so that eager forwards read no slot past the last one.
    features (B, S, m * d_t): the target's features of every slot written, kept for the slots whose context a
    forward did not encode; stale_from: the first slot whose context may lack them in a row still decoding (host),
    None when every slot's is there. unpadded: no row has a slot without a token (its prompt had no padding, and
    its end is its own), as the host learned at the prefill.
    """

    cache: DecodingCache
    context_keys: list[torch.Tensor]
    context_values: list[torch.Tensor]
    positions: torch.Tensor
    real: torch.Tensor
    end: torch.Tensor
    count: torch.Tensor
    anchor: torch.Tensor
    shared: bool
    window: int | None
    features: torch.Tensor
    host_ends: list[int] | None = None
    stale_from: int | None = None
    unpadded: bool = False
    warmed: set = field(default_factory=set)  # what compiled steps have run on this state (`Steps.warm`)

    @classmethod
    def allocate(cls, target, draft: DSparkDraftModel, batch_size: int, slots: int, shared: bool,
                 compiled: bool) -> "DecodingState":
        """Zeroed buffers for `batch_size` rows of `slots` slots, for `target` and `draft` on the target's device, for
        forwards that run compiled or not."""
        device, B = target.device, batch_size
        cache = DecodingCache(slots, compiled)  # its layers take their shapes from the prompt's forward
        c, dtype = draft.config, draft.fc.weight.dtype
        context = [torch.zeros(B, c.num_key_value_heads, slots, c.head_dim, dtype=dtype, device=device)
                   for _ in range(2 * c.num_hidden_layers)]
        zeros = torch.zeros(B, dtype=torch.long, device=device)
        return cls(cache, context[::2], context[1::2], torch.zeros(B, slots, dtype=torch.long, device=device),
                   torch.zeros(B, slots, dtype=torch.bool, device=device), zeros, zeros.clone(), zeros.clone(),
                   shared, None if shared else internals.sliding_window(target),
                   torch.zeros(B, slots, draft.fc.in_features, dtype=dtype, device=device))

    @property
    def slots(self) -> int:
        return self.real.shape[1]

    # -- one forward of the target ---------------------------------------------------------------------------------
    def forward(self, target, draft: DSparkDraftModel, tokens: torch.Tensor, width: int, positions=None, real=None,
                logits_to_keep: int = 0, encode: bool = True, masked: bool = True,
                at: int | None = None) -> torch.Tensor:
        """Run the target over tokens (B, Q), written from each row's end on, its queries reading slots [0, width);
        keep their target features at the same slots and, with `encode`, project them into the draft's context
        there (without it, the caller marks them `stale_from`). positions (B, Q): default, each row's next ones;
        real (B, Q): default, all of them. masked=False: the model's own causal mask is right (`causal_only`). at:
        the slot every row's end is at, where the host knows it (`one_end`; their writes are then plain copies).
        Returns the logits of the last `logits_to_keep` positions (0: all). The caller moves the ends afterwards
        ([`keep`])."""
        B, Q = tokens.shape
        index = row_slots(self.end, Q, self.slots) if at is None else slice(at, at + Q)
        if positions is None:
            positions = self.count[:, None] + torch.arange(Q, device=tokens.device)
        write_rows(self.positions, index, positions, 1)
        write_rows(self.real, index, torch.ones_like(tokens, dtype=torch.bool) if real is None else real, 1)
        self.cache.frame(index, Q, width)
        mask = self._masks(target, self.end[:, None] + torch.arange(Q, device=tokens.device), width) \
            if masked else None
        out = target(input_ids=tokens, attention_mask=mask, position_ids=positions,
                     **internals.with_cache(self.cache), use_cache=True,
                     output_hidden_states=draft.hidden_states_request, logits_to_keep=logits_to_keep)
        features = draft.target_features(out.hidden_states)
        write_rows(self.features, index, features, 1)
        if encode:
            context = draft.encode_context(features, positions, torch.ones_like(tokens, dtype=torch.bool))
            for buffer, new in zip(self.context_keys + self.context_values, context.keys + context.values):
                write_rows(buffer, index, new, 2)
        return out.logits

    def _masks(self, target, slots: torch.Tensor, width: int):
        """What the target's attention reads: with a shared end, the 2D mask of real slots (the model builds the
        rest, its queries being the frame's last ones); else which slot each query (B, Q) may see, per row."""
        if self.shared:
            return self.real[:, :width].long()
        return attention_masks(target, self.real[:, :width], slots, self.window)

    def one_end(self) -> int | None:
        """The slot every row ends at, where they end at one as the host knows them (at batch 1, always), else
        None."""
        first = self.host_ends[0]
        return first if all(end == first for end in self.host_ends) else None

    def causal_only(self, width: int, queries: int) -> bool:
        """Whether a forward of `queries` tokens reading slots [0, width) needs no mask of ours: every row's slots
        are tokens, the rows end at one slot, as the host knows them, and its queries come right after it (plain
        generate()'s own case at batch 1, eager). The model's causal mask is then the right one, and on a CPU a
        mask-free attention costs what plain's does (SDPA skips the mask for one query)."""
        return (self.unpadded and self.window is None and self.one_end() is not None
                and width == self.host_end + queries)

    def prefill(self, target, draft: DSparkDraftModel, prompt: torch.Tensor, prompt_mask: torch.Tensor) -> torch.Tensor:
        """The prompt (B, P) into slots [0, P) of every row, positions counting its real tokens (as plain
        generate() numbers them); returns the last position's logits (B, 1, V)."""
        P = prompt.shape[1]
        self.end = torch.zeros_like(self.end)  # a state from the pool still ends where its last call did
        self.stale_from = None  # the prompt's forward projects every slot it writes
        positions = (prompt_mask.cumsum(1) - 1).clamp_min(0)
        logits = self.forward(target, draft, prompt, P, positions, prompt_mask.bool(), logits_to_keep=1)
        self.end = torch.full_like(self.end, P)
        self.count = prompt_mask.sum(1)
        self.host_ends = [P] * prompt.shape[0]
        self.unpadded = not self.shared and bool(prompt_mask.all())  # a state's one read at the prefill
        return logits

    # -- rows that change hands (`serving`) -------------------------------------------------------------------------
    def admit(self, row: int, other: "DecodingState", i: int, anchor: int) -> None:
        """Row `row` takes over row `i` of `other` (a state of the same target and draft, just past its prefill):
        a request joining a running batch, its first token `anchor`. Its slots past the prompt hold nothing."""
        span = slice(0, other.host_ends[i])
        self.real[row] = False
        self.cache.take_row(row, other.cache, i, span, self.real.shape[0])
        for mine, theirs in zip(self.context_keys + self.context_values, other.context_keys + other.context_values):
            mine[row, :, span] = theirs[i, :, span]
        for mine, theirs in ((self.positions, other.positions), (self.real, other.real),
                             (self.features, other.features)):
            mine[row, span] = theirs[i, span]
        self._set(row, end=span.stop, count=int(other.count[i]), anchor=anchor)

    def vacate(self, row: int) -> None:
        """Row `row` holds no request: no slot of it is a token, and it ends at the first (its forwards, which the
        batch keeps running, write there and are never read)."""
        self.real[row] = False
        self._set(row, end=0, count=0, anchor=0)

    def _set(self, row: int, end: int, count: int, anchor: int) -> None:
        # new tensors, not changed in place (as `keep`)
        for name, value in (("end", end), ("count", count), ("anchor", anchor)):
            t = getattr(self, name).clone()
            t[row] = value
            setattr(self, name, t)
        self.host_ends[row] = end

    # -- after the forward -----------------------------------------------------------------------------------------
    def keep(self, kept: torch.Tensor, anchor: torch.Tensor, queries: int) -> None:
        """Each row keeps the first kept[b] of the `queries` entries the last forward wrote (0 for a row that has
        finished: it stays where it is, unless it moves on with the others); `anchor` (B,) is its next token."""
        if self.shared:  # every row moves past every slot the forward took; the rest of them become holes
            kept_slots = torch.arange(queries, device=kept.device) < kept[:, None]
            write_rows(self.real, row_slots(self.end, queries, self.slots), kept_slots, 1)
            self.end = self.end + queries
        else:
            self.end = self.end + kept
        # new tensors, not changed in place: a draft may keep what it was given (`anchor_positions` is `count`)
        self.count = self.count + kept
        self.anchor = anchor

    @property
    def host_end(self) -> int:
        """The last slot any row has filled, as the host knows it."""
        return max(self.host_ends)

    # -- the host's copy (`host.Mirrored`) --------------------------------------------------------------------------
    def ask(self, read: HostRead) -> HostRead:
        """Add what the host keeps a copy of to the round's read: each row's end."""
        return read.add("state.end", self.end)

    def mirror(self, values: dict) -> None:
        """The host's copy of the ends, as the round's read found them (`ask`)."""
        self.host_ends = values["state.end"]

    def make_room(self, queries: int) -> None:
        """Grow the buffers, doubling, so that a forward of `queries` fits after the last end: an eager call sizes
        them for what it generates, not for its length limit (which may be far beyond: "until EOS")."""
        if self.host_end + queries <= self.slots:
            return
        slots = max(2 * self.slots, self.host_end + queries)
        self.cache.grow(slots)
        self.context_keys = [grown(t, slots, 2) for t in self.context_keys]
        self.context_values = [grown(t, slots, 2) for t in self.context_values]
        self.positions, self.real = grown(self.positions, slots, 1), grown(self.real, slots, 1)
        self.features = grown(self.features, slots, 1)

    # -- what the draft reads --------------------------------------------------------------------------------------
    def unencoded(self, rows: list[int]) -> None:
        """After a forward without `encode`: the context of `rows` (those still decoding) lacks the slots it wrote
        from their ends on, as the host knew them before it."""
        first = min(self.host_ends[b] for b in rows)
        self.stale_from = first if self.stale_from is None else min(self.stale_from, first)

    def catch_up(self, draft: DSparkDraftModel, upto: int) -> None:
        """Project the kept features of slots [stale_from, upto) into the draft's context, every row at once (what
        a row has not written there is past its end, where the context is never read), before the draft reads it."""
        start, self.stale_from = self.stale_from, None
        if start is None or start >= upto:
            return
        span = slice(start, upto)
        context = draft.encode_context(self.features[:, span], self.positions[:, span], self.real[:, span])
        for buffer, new in zip(self.context_keys + self.context_values, context.keys + context.values):
            buffer[:, :, span] = new.to(buffer.dtype)

    def context(self, width: int) -> DSparkContext:
        """The draft's view of slots [0, width): valid where a row has committed a real token."""
        keys = torch.arange(width, device=self.end.device)
        valid = self.real[:, :width] & (keys < self.end[:, None])
        return DSparkContext([k[:, :, :width] for k in self.context_keys],
                             [v[:, :, :width] for v in self.context_values], self.positions[:, :width], valid)


class StatePool:
    """Decoding states kept for reuse by later calls with the same target, draft and batch size (compiled steps only:
    their graphs are specialised on the buffers' sizes, and on CUDA their graphs read and write the buffers where
    they were recorded). As transformers' static cache, a state only grows: a call that fits in the pooled state
    decodes in it (nothing recompiles), a longer one allocates a state of its own size, which replaces the pooled one
    when it is given back. A call that finds the state taken (a concurrent call) allocates its own. Gone with the
    models."""

    def __init__(self):
        self._lock = threading.Lock()
        self._free: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # target -> draft -> key -> state

    def _shelf(self, target, draft) -> dict:
        return self._free.setdefault(target, weakref.WeakKeyDictionary()).setdefault(draft, {})

    def take(self, target, draft, batch_size: int, slots: int) -> DecodingState:
        """A state of at least `slots` slots."""
        with self._lock:
            shelf, key = self._shelf(target, draft), _key(target, draft, batch_size)
            if key in shelf and shelf[key].slots >= slots:
                return shelf.pop(key)
        return DecodingState.allocate(target, draft, batch_size, slots, shared=False, compiled=True)

    def give(self, target, draft, state: DecodingState) -> None:
        with self._lock:
            shelf, key = self._shelf(target, draft), _key(target, draft, state.real.shape[0])
            if key not in shelf or shelf[key].slots < state.slots:
                shelf[key] = state


def _key(target, draft, batch_size: int) -> tuple:
    """What a pooled state must match: its rows, and the dtypes and device its buffers were made in (and may be made
    again)."""
    return batch_size, target.dtype, draft.fc.weight.dtype, target.device

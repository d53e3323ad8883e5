"""The target's KV cache while DSpark decodes: preallocated for the call, and written by each row at its own offset.

transformers' caches keep one length for the whole batch: `DynamicCache` grows by concatenation and `StaticLayer`
keeps one `cumulative_length`. The rows of a DSpark batch commit different numbers of tokens every round, so this
cache writes each row's new keys and values at that row's own next slot (`row_slots`). What a round rejects
stays past the row's end and the next round writes over it: nothing is ever copied, cloned or shifted. Which slots a
query may read is the attention mask's business, built per row from the same offsets (`state.DecodingState`).

The models see it as any transformers `Cache`: their attention calls `update`, which writes the new entries and
returns the first `width` slots of every row; `get_seq_length` and `get_mask_sizes` describe that frame to a model
that builds its own mask from a 2D one (its queries are the frame's last ones).
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, CacheLayerMixin


class _Slots(CacheLayerMixin):
    """One layer's keys and values (B, H_kv, S, head_dim), allocated at their first write (whatever heads and head
    size the layer has) and written by `DecodingCache.update`."""

    is_sliding = False  # sliding windows are the mask's business: every layer keeps every slot

    def __init__(self, slots: int, compiled: bool):
        super().__init__()
        self.slots, self.keys, self.values = slots, None, None
        # transformers' masking reads it: a compileable cache gets a mask for one query too (a compiled graph cannot
        # skip it); eagerly, a forward that needs no mask of ours then runs without any, as plain generate()'s step
        # over its dynamic cache does (a boolean mask costs SDPA a conversion in every layer: 1% of a round on a CPU)
        self.is_compileable = compiled

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        B, H = key_states.shape[:2]
        self.keys = key_states.new_zeros(B, H, self.slots, key_states.shape[-1])
        self.values = value_states.new_zeros(B, value_states.shape[1], self.slots, value_states.shape[-1])
        self.is_initialized = True

    def update(self, key_states, value_states, *args, **kwargs):
        raise NotImplementedError("DecodingCache.update writes its layers")

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.slots, 0

    def get_seq_length(self) -> int:
        return self.slots

    def get_max_length(self) -> int:
        return self.slots


def row_slots(start: torch.Tensor, queries: int, limit: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The index of `queries` consecutive slots from each row's start (B,) on, in buffers of `limit` slots: (rows,
    slots), each (B, Q). Slots past the buffers' end (a compiled forward's padding to its width, the forward of a
    row that has finished) fall on the last slot, which no row ever keeps a token in: the buffers need no room
    beyond the call's tokens. A forward computes it once and every write of its tokens uses it (the target's layers,
    the draft's context, the positions): built per write, it cost a sixth of a one-token round's extra time on a
    CPU."""
    slots = (start[:, None] + torch.arange(queries, device=start.device)).clamp_max(limit - 1)
    return torch.arange(slots.shape[0], device=start.device)[:, None].expand_as(slots), slots


Slots = "tuple[torch.Tensor, torch.Tensor] | slice"  # row_slots' index, or one span of slots every row writes


def write_rows(buffer: torch.Tensor, index: Slots, values: torch.Tensor, dim: int) -> None:
    """Write values (B, ..., Q, ...) into buffer (B, ..., S, ...) along `dim`, at the slots `index` names
    ([`row_slots`], or a slice where every row writes the same slots and the host knows which).

    An indexed assignment (index_put_), not a scatter: compiled, inductor writes it into the buffer in place, where a
    scatter into a graph input made it copy every layer's whole cache back each step (at batch 8 on a CPU, 60% more
    time a round). A slice is a plain copy, the cheapest write eagerly."""
    if isinstance(index, slice):
        buffer[(slice(None),) * dim + (index,)] = values.to(buffer.dtype)
        return
    rows, slots = index
    # the two index tensors come first in the indexed view: (B, Q, the other dims in order)
    buffer[(rows, *[slice(None)] * (dim - 1), slots)] = values.movedim(dim, 1).to(buffer.dtype)  # (autocast too)


class DecodingCache(Cache):
    """KV cache whose rows write at their own offsets. `frame(index, queries, width)` before each forward: each row
    writes its `queries` new entries at the slots `index` names ([`write_rows`]), and attention reads slots
    [0, width). compiled: whether its forwards run compiled (transformers sees it as compileable then)."""

    def __init__(self, slots: int, compiled: bool = False):
        super().__init__(layers=[])
        self.slots, self.compiled = slots, compiled
        self.index: Slots | None = None
        self.queries = 0
        self.width = 0

    def frame(self, index: Slots, queries: int, width: int) -> None:
        self.index, self.queries, self.width = index, queries, width

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        while len(self.layers) <= layer_idx:  # the first forward (the prompt's) meets every layer in turn
            self.layers.append(_Slots(self.slots, self.compiled))
        layer = self.layers[layer_idx]
        if not layer.is_initialized:
            layer.lazy_initialization(key_states, value_states)
        write_rows(layer.keys, self.index, key_states, 2)
        write_rows(layer.values, self.index, value_states, 2)
        return layer.keys[:, :, :self.width], layer.values[:, :, :self.width]

    def take_row(self, row: int, other: "DecodingCache", i: int, span: slice, batch_size: int) -> None:
        """Copy row `i` of `other`'s layers at `span` into row `row` of these (of `batch_size` rows; layers this
        cache has not met yet are allocated as `other`'s)."""
        for index, theirs in enumerate(other.layers):
            if len(self.layers) <= index:
                self.layers.append(_Slots(self.slots, self.compiled))
            layer = self.layers[index]
            if not layer.is_initialized:
                layer.lazy_initialization(theirs.keys[:1].expand(batch_size, -1, -1, -1),
                                          theirs.values[:1].expand(batch_size, -1, -1, -1))
            layer.keys[row, :, span] = theirs.keys[i, :, span]
            layer.values[row, :, span] = theirs.values[i, :, span]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """The slots before this forward's queries in the frame it reads."""
        return self.width - self.queries

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        return self.width, 0

    def grow(self, slots: int) -> None:
        """Room for `slots` slots in every layer (the new ones zero)."""
        self.slots = slots
        for layer in self.layers:
            layer.slots = slots
            layer.keys, layer.values = (grown(t, slots, 2) for t in (layer.keys, layer.values))


def grown(t: torch.Tensor, slots: int, dim: int) -> torch.Tensor:
    """t with `slots` entries along `dim`, the new ones zero."""
    shape = list(t.shape)
    shape[dim] = slots - t.shape[dim]
    return torch.cat([t, t.new_zeros(shape)], dim)

"""A round's two forwards, eager or compiled as plain generate() compiles its decoding step.

With ``cache_implementation="static"``, where transformers would compile its own step (a CUDA device, or a
`CompileConfig` with ``_compile_all_devices``; never with ``disable_compile``), DSpark compiles, with the call's
`CompileConfig`, the target's verification forward (specialised on each verification width, taken from a few
buckets: 1, 2, 4, ... and the block's gamma + 1) and the draft's block. On CUDA the default mode, "reduce-overhead",
replays them as CUDA graphs. Their buffers come from a pool of decoding states that, as transformers' static cache,
only grow (sized by the call, or by its ``max_cache_len``): later calls that fit reuse the graphs and the memory
alike. The prompt's forward runs eagerly, as plain generate()'s.

A call that asks for compiled steps where they cannot be built is refused in one line naming why; the same call
without them (no ``cache_implementation="static"``) decodes eagerly, on the same state.
"""

from __future__ import annotations

import contextlib
import functools
import threading

import torch

from .. import internals
from ..model.modeling_dspark import DSparkDraftModel
from ..model.sampling import drafter
from .state import DecodingState, StatePool

# compiled functions are kept per compile config, for all targets and drafts: a target of the same architecture and
# shapes reuses the graphs another one compiled (the modules' weights are inputs to them)
_COMPILED: dict[str, object] = {}
_COMPILED_LOCK = threading.Lock()
_POOL = StatePool()
# graphs per compiled function: widths x batch sizes x sizes x drafting modes (dynamo's default is 8)
_RECOMPILE_LIMIT = 64
# the new tokens an eager call's buffers first make room for; they double from there as rows grow
_FIRST_ROOM = 256


def _verify(state: DecodingState, target, draft, tokens: torch.Tensor, width: int, encode: bool,
            masked: bool, at: int | None) -> torch.Tensor:
    return state.forward(target, draft, tokens, width, encode=encode, masked=masked, at=at)


def _draft(draft: DSparkDraftModel, anchor, anchor_positions, context, do_sample, process_logits):
    return drafter(draft)(anchor, anchor_positions, context, do_sample, process_logits=process_logits, check=False)


def verification_widths(block_size: int) -> list[int]:
    """The forward widths a compiled verification is specialised on: 1, 2, 4, ... below gamma + 1, and gamma + 1."""
    widths, w = [], 1
    while w < block_size + 1:
        widths.append(w)
        w *= 2
    return widths + [block_size + 1]


class Steps:
    """How one call runs its forwards: eagerly, or compiled with `compile_config` (see the module)."""

    def __init__(self, target, draft: DSparkDraftModel, compile_config=None, max_cache_len: int | None = None):
        self.target, self.draft, self.compile_config, self.max_cache_len = target, draft, compile_config, max_cache_len
        self.shared = internals.row_masks_refused(target) is not None
        self._widths = verification_widths(draft.config.block_size)
        compiled = (lambda fn: fn) if compile_config is None else functools.partial(_compiled, config=compile_config)
        self._verify = compiled(_verify)
        self._draft_block = functools.partial(compiled(_draft), draft)

    @classmethod
    def for_call(cls, target, draft: DSparkDraftModel, generation_config, ssd=None) -> "Steps":
        """The steps of a call: compiled where plain generate() would compile (`internals.compile_config`), or one
        line saying why they cannot be."""
        config = internals.compile_config(target, generation_config)
        if config is None:
            return cls(target, draft)
        refused = internals.row_masks_refused(target)
        why = (f"{type(target).__name__} cannot keep its rows at their own offsets ({refused})" if refused else
               "ssd= speculates in a thread of its own, which compiled steps do not serve" if ssd is not None else
               "the target's quantization cannot be compiled"
               if getattr(getattr(target, "hf_quantizer", None), "is_compileable", True) is False else None)
        if why:
            raise ValueError(f"cache_implementation='static' compiles DSpark's steps, but {why}: decode without "
                             "cache_implementation='static' (or with disable_compile=True).")
        return cls(target, draft, config, generation_config.max_cache_len)

    @property
    def compiled(self) -> bool:
        return self.compile_config is not None

    @property
    def path(self) -> str:
        """How this call runs its forwards, as what they cost depends on it: eager, or compiled with what config."""
        return "eager" if not self.compiled else f"compiled {_config_key(self.compile_config)}"

    # -- the call's state --------------------------------------------------------------------------------------------
    def state(self, batch_size: int, prompt_length: int, max_new: int) -> DecodingState:
        """A state for this call: compiled, its slots hold the prompt and every new token (or max_cache_len tokens,
        if more), as many as plain generate()'s static cache holds, in a pooled state that may be larger; eager,
        room to start with (it grows)."""
        if not self.compiled:
            slots = prompt_length + min(max(max_new, 1), _FIRST_ROOM) + self._widths[-1]
            return DecodingState.allocate(self.target, self.draft, batch_size, slots, self.shared, compiled=False)
        slots = max(prompt_length + max(max_new, 1), self.max_cache_len or 0)
        try:
            return _POOL.take(self.target, self.draft, batch_size, slots)
        except (RuntimeError, MemoryError) as error:  # torch.OutOfMemoryError is a RuntimeError
            raise MemoryError(f"cache_implementation='static' preallocates the decoding state for the prompt and every "
                              f"new token ({batch_size} rows x {slots} slots, max_new_tokens={max_new}), which does "
                              "not fit here: lower max_new_tokens, or decode without cache_implementation='static' "
                              "(the eager buffers grow with the rows).") from error

    def release(self, state: DecodingState) -> None:
        if self.compiled:
            _POOL.give(self.target, self.draft, state)

    def prepared(self, state: DecodingState) -> None:
        """After the prompt's forward (which allocates the cache's layers): on CUDA, the state's buffers keep their
        addresses for the CUDA graphs that read and write them."""
        if self.compiled and state.real.device.type == "cuda":
            for t in [state.positions, state.real, state.features, *state.context_keys, *state.context_values,
                      *(t for layer in state.cache.layers for t in (layer.keys, layer.values))]:
                torch._dynamo.mark_static_address(t)

    def warm(self, state: DecodingState, do_sample: bool, process_logits) -> None:
        """Compiled, the first call on a state: every verification width and the draft's block, once, so that a
        policy that verifies another number of tokens later compiles nothing then (nor, on CUDA, records a graph in
        the middle of a decode); and the one-token forward of a round after which nothing is drafted, which leaves
        the draft's context alone. The forwards write past each row's end only, where the round's first forward
        writes over them before any query could read them (a query reads its row's slots up to its own)."""
        if not self.compiled or ("warm", do_sample) in state.warmed:
            return
        B = state.anchor.shape[0]
        for width, encode in [(w, True) for w in self._widths] + [(1, False)]:
            self.verify(state, state.anchor.new_zeros(B, width), encode)
        self.draft_block(state.anchor, state.count, state.context(state.slots), do_sample, process_logits)
        state.warmed.add(("warm", do_sample))

    # -- the forwards ----------------------------------------------------------------------------------------------
    def width(self, queries: int) -> int:
        """The forward width that runs `queries` tokens: itself eagerly, else the bucket it falls in."""
        return queries if not self.compiled else next(w for w in self._widths if w >= queries)

    def verify(self, state: DecodingState, tokens: torch.Tensor, encode: bool = True) -> torch.Tensor:
        """The target over tokens (B, Q) after each row's end, their features projected into the draft's context
        only with `encode` (see `DecodingState.forward`); logits (B, Q, V)."""
        Q = tokens.shape[1]
        if self.compiled:  # one graph for every round: nothing read off the host's copy of the ends
            width, masked, at = state.slots, True, None
        else:
            state.make_room(Q)
            width = state.host_end + Q
            masked, at = not state.causal_only(width, Q), state.one_end()
        with self._compiling("the target's verification forward"):
            return self._verify(state, self.target, self.draft, tokens, width, encode, masked, at)

    def draft_block(self, anchor, anchor_positions, context, do_sample, process_logits=None, check=False):
        """The draft's block at each row's anchor (a `Drafter`'s drafting step)."""
        with self._compiling("the draft's block"):
            return self._draft_block(anchor, anchor_positions, context, do_sample, process_logits)

    @contextlib.contextmanager
    def _compiling(self, what: str):
        """Around a compiled step: room for the graphs a decode needs (more than dynamo's default 8 per function), an
        error rather than a silent fall back to eager code beyond that, and one line for a step that does not
        compile."""
        if not self.compiled:
            yield
            return
        try:
            with torch._dynamo.config.patch(recompile_limit=_RECOMPILE_LIMIT, fail_on_recompile_limit_hit=True):
                yield
        except (torch._dynamo.exc.TorchDynamoException, torch._dynamo.exc.FailOnRecompileLimitHit) as error:
            cause = getattr(error, "inner_exception", None) or error
            said = " ".join(str(cause).split())[:200]
            raise RuntimeError(f"torch.compile could not compile {what} for {type(self.target).__name__} "
                               f"({type(cause).__name__}{': ' + said if said else ''}): decode without "
                               "cache_implementation='static' (or with disable_compile=True).") from error

    def context_width(self, state: DecodingState, bound: int) -> int:
        """How many slots the draft reads: all of them when compiled, else up to `bound`."""
        return state.slots if self.compiled else min(state.slots, bound)


def _config_key(config) -> str:
    return repr(sorted(config.to_dict().items(), key=str))


def _compiled(fn, config):
    key = f"{fn.__qualname__}:{_config_key(config)}"
    with _COMPILED_LOCK:
        if key not in _COMPILED:
            _COMPILED[key] = torch.compile(fn, **config.to_dict())
        return _COMPILED[key]

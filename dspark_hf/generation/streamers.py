"""Streaming DSpark decoding round by round, across threads.

transformers' streamers receive token ids only. DSpark decoding also offers each round's record to a
[`RoundStreamer`]: ``put_round(round)`` is called once per round, right after the round is recorded and before its
committed tokens reach ``put``. [`DSparkRoundStreamer`] pairs the two, so a consumer sees what the
draft proposed, what the target kept and what the scheduler never sent, as it happens.
"""

from __future__ import annotations

from dataclasses import dataclass
from queue import Queue
from typing import Protocol, runtime_checkable

import torch
from transformers.generation.streamers import BaseStreamer

from .records import DSparkRound


@dataclass(frozen=True)
class DSparkStep:
    """What one step of decoding added to the output.

    Attributes:
        tokens: the token ids the step committed, in order.
        round: the draft-verify round that committed them, or None for a step without one: the first new token
            (the target's prefill samples it before any round), and every token when the streamer was given to
            plain `generate()`.
    """

    tokens: list[int]
    round: DSparkRound | None


@runtime_checkable
class RoundStreamer(Protocol):
    """A transformers streamer that also receives each DSpark round's record (batch size 1)."""

    def put(self, value: torch.Tensor) -> None: ...

    def end(self) -> None: ...

    def put_round(self, round: DSparkRound) -> None:
        """The record of the round whose tokens the next `put` carries."""


_END = object()


class DSparkRoundStreamer(BaseStreamer):
    """Yields a [`DSparkStep`] per decoding step while `generate()` runs in another thread.

    ```python
    streamer = DSparkRoundStreamer()
    thread = Thread(target=target.generate, kwargs=dict(**inputs, assistant_model=draft, streamer=streamer))
    thread.start()
    for step in streamer:          # step.tokens: list[int]; step.round: DSparkRound | None
        ...
    thread.join()
    ```

    Batch size 1, as every transformers streamer. The prompt, which `generate()` passes first, is not yielded; it
    is kept in `prompt` (list of ids). `timeout`: seconds to wait for the next step before `queue.Empty` is raised
    (None waits forever); set it when `generate()` may fail in its thread, since a failed call never ends the
    stream.
    """

    def __init__(self, timeout: float | None = None):
        self.timeout = timeout
        self.prompt: list[int] | None = None
        self._steps: Queue = Queue()
        self._round: DSparkRound | None = None
        self._next_is_prompt = True  # again after each end(): a streamer may serve one generate() call after another

    def put_round(self, round: DSparkRound) -> None:
        """The record of the round whose tokens the next `put` carries (called by DSpark decoding)."""
        self._round = round

    def put(self, value: torch.Tensor) -> None:
        """The prompt ids (1, P) first, then each step's new ids (n,) or (1, n)."""
        if value.dim() > 1 and value.shape[0] > 1:
            raise ValueError(f"DSparkRoundStreamer supports batch size 1, got ids of shape {tuple(value.shape)}.")
        ids = value.reshape(-1).tolist()
        if self._next_is_prompt:
            self.prompt, self._next_is_prompt = ids, False
            return
        self._steps.put(DSparkStep(ids, self._round))
        self._round = None

    def end(self) -> None:
        self._next_is_prompt, self._round = True, None
        self._steps.put(_END)

    def __iter__(self):
        return self

    def __next__(self) -> DSparkStep:
        step = self._steps.get(timeout=self.timeout)
        if step is _END:
            raise StopIteration
        return step

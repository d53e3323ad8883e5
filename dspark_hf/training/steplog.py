"""What a run reads of its steps, and when: [`StepLog`].

A step's losses and acceptance stay on the device where they were computed: reading one (`float(loss)`) makes the
host wait for the device, once a step, and on a GPU the next step's work then queues only after it. The log adds
each step's figures up there, and the host reads the sums in one transfer every few steps (the progress bar's
figures, and the check that the loss is finite), before each checkpoint and at the end of the loop.
"""

from __future__ import annotations

import math

import torch

from ..generation.host import HostRead

TERMS = ("total", "ce", "l1", "kl", "confidence")  # the loss terms a step may return, in the order shown


class StepLog:
    """The losses and per-position acceptance of the steps since the last read, summed on the device (`add`), read
    every `every` steps (`due`, `read`)."""

    def __init__(self, every: int):
        self.every = every
        self._sums: dict[str, torch.Tensor] = {}
        self._steps = 0
        self.shown: dict | None = None  # the means of the last read

    def due(self, step: int) -> bool:
        """Whether the step numbered `step` (1-based) ends with a read: the first one and every `every`-th."""
        return step == 1 or step % self.every == 0

    def add(self, losses: dict, valid: torch.Tensor) -> None:
        """One step's losses (the trainer's dict of scalars, "acceptance" (N, gamma)) and the block positions they
        count, valid (N, gamma); nothing is read."""
        figures = {k: losses[k].detach().float() for k in TERMS if k in losses}
        figures["acceptance"] = (losses["acceptance"].detach() * valid).sum(0)
        figures["positions"] = valid.sum(0).float()
        for k, v in figures.items():
            self._sums[k] = v if k not in self._sums else self._sums[k] + v
        self._steps += 1

    def read(self, step: int) -> dict | None:
        """The means since the last read (terms, and "acc": acceptance per position), in one transfer; None when no
        step was added. A loss that is not finite stops the run here, in one line naming `step`."""
        if self._steps == 0:
            return self.shown
        read = HostRead()
        for k, v in self._sums.items():
            read.add(k, v)
        values = read.read()
        steps, self._sums, self._steps = self._steps, {}, 0
        total = values["total"] / steps
        if not math.isfinite(total):  # every weight the step after it touched is NaN: nothing to go on with
            raise ValueError(f"step {step}: the training loss is {total} (read every {self.every} steps), so training "
                             "stops: lower --lr, train with --mixed-precision bf16 or no instead of fp16, or without "
                             "--feature-cache.")
        self.shown = {k: values[k] / steps for k in TERMS if k in values}
        self.shown["acc"] = [a / max(n, 1.0) for a, n in zip(values["acceptance"], values["positions"])]
        return self.shown

    @staticmethod
    def postfix(shown: dict) -> str:
        terms = " ".join(f"{k}={shown[k]:.3f}" for k in TERMS if k in shown)
        return f"{terms} acc/pos=[{' '.join(f'{a:.2f}' for a in shown['acc'])}]"

"""The harness every bench command times with (`bench speed`, `bench serve`, `bench oracle`, `bench ssd`'s speed).

Each repeat runs every unit of work (a batch of prompts) under every arm back to back, in an order rotated by repeat
and unit, so that the machine's drift over minutes falls on all arms alike and no arm always follows the same one;
the caller warms every arm up first (costs measured, steps compiled). An arm's figure for a repeat is its work over
its seconds summed over the units; ratios between arms are paired: the median over repeats of the ratio within each
repeat, in which drift between repeats cancels.
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Callable

from ..devices import clock


@dataclass
class Runs:
    """What `interleaved` measured: per arm and repeat, the seconds over all units, and what each call returned (in
    the units' order)."""

    seconds: dict[str, list[float]] = field(default_factory=lambda: defaultdict(list))
    results: dict[str, list[list]] = field(default_factory=lambda: defaultdict(list))

    def rates(self, name: str, work: Callable[[Any], float]) -> list[float]:
        """Per repeat, the arm's work per second: `work(result)` summed over its calls, over its seconds."""
        return [sum(map(work, calls)) / s for calls, s in zip(self.results[name], self.seconds[name])]

    def paired(self, name: str, reference: str, work: Callable[[Any], float] = lambda _: 1.0) -> float:
        """The median over repeats of the arm's rate over the reference's in the same repeat (default work: one per
        call, i.e. the ratio of seconds the other way round)."""
        return statistics.median(a / b for a, b in zip(self.rates(name, work), self.rates(reference, work)))


def interleaved(arms: dict[str, Callable[[Any], Any]], units: list, repeats: int, device,
                on_call: Callable[[str], None] | None = None, on_repeat: Callable[[int, "Runs"], None] | None = None
                ) -> Runs:
    """Time `arms[name](unit)` for every unit, arm and repeat, in the rotated order (see the module); on_call(name)
    after each call (a progress bar), on_repeat(repeat, runs) after each repeat (checks of its outputs)."""
    names, runs = list(arms), Runs()
    for repeat in range(repeats):
        spent, returned = defaultdict(float), defaultdict(list)
        for b, unit in enumerate(units):
            shift = (repeat + b) % len(names)
            for name in names[shift:] + names[:shift]:
                start = clock(device)
                returned[name].append(arms[name](unit))
                spent[name] += clock(device) - start
                if on_call is not None:
                    on_call(name)
        for name in names:
            runs.seconds[name].append(spent[name])
            runs.results[name].append(returned[name])
        if on_repeat is not None:
            on_repeat(repeat, runs)
    return runs

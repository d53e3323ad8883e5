"""What a call's rounds cost on the path it runs: [`StepClock`], the call's own steps ready to be timed.

The default policy drafts only where drafting pays, which it judges by what a drafting round and a round that drafts
nothing cost (`costs.cost_model.path_costs` times them once per path and keeps them on disk). Those costs are the
call's own: its forwards as its steps run them (compiled graphs compiled, eager code eager, at the call's batch
size, over the slots the call's state reads), with the round's own work on their results (the target's features
projected into the draft's context, the scores processed and checked), the draft's block as the call drafts it, and
the projection into the draft's context of what rounds without a draft kept (a probe after a pause pays for it).
They run on the call's state after its prefill, writing past each row's end only, where the first round writes over
them before any query reads them (as the compiled steps' warm-up does).
"""

from __future__ import annotations

import torch

from ..costs.profile import measured_widths
from . import verify
from .state import DecodingState
from .steps import Steps
from .transcript import Transcript


PAUSE_SLOTS = 64  # slots a timed catch-up projects: about the default policy's shortest pause on a CPU


class StepClock:
    """A `costs.cost_model.RoundClock` over one call's steps and state, after its prefill."""

    def __init__(self, steps: Steps, state: DecodingState, out: Transcript, do_sample: bool):
        self.target, self.draft = steps.target, steps.draft
        self.rows = state.anchor.shape[0]
        self._steps, self._state, self._out, self._do_sample = steps, state, out, do_sample
        self._tokens = self.draft.config.block_size + 1  # the most a round verifies, with the anchor
        read = state.slots if steps.compiled else state.host_end  # the slots a round's attention reads, about
        self.key = {"path": steps.path, "rows": self.rows, "sampling": do_sample,
                    "slots": 1 << (max(read, 1) - 1).bit_length()}  # by powers of two: costs change slowly with it

    def _widths(self) -> list[int]:
        """The verification widths worth timing: a compiled call's buckets; eagerly every width up to 16 tokens, and
        about 1.5 times apart beyond (`profile.measured_widths`)."""
        if self._steps.compiled:
            return sorted({self._steps.width(n) for n in range(1, self._tokens + 1)})
        return measured_widths(self._tokens)

    def runs(self) -> dict:
        state = self._state
        runs = {("verify", w): self._round(w, encode=True) for w in self._widths()}
        runs["plain"] = self._round(1, encode=False)
        context = state.context(self._steps.context_width(state, state.host_end + self._tokens))
        runs["draft"] = lambda: self._steps.draft_block(state.anchor, state.count, context, self._do_sample,
                                                        self._out.process)
        runs["catch_up"] = self._catch_up
        return runs

    def _catch_up(self):
        """The draft's context projected over the slots a pause leaves, as a probe's draft pass first does: up to
        `PAUSE_SLOTS` past every row's end (a pause is longer, but the projection costs about the same)."""
        state = self._state
        state.stale_from = state.host_end
        state.catch_up(self.draft, min(state.slots, state.host_end + PAUSE_SLOTS))

    def _round(self, width: int, encode: bool):
        """One verification `width` tokens wide, as a round runs it: the forward, the scores processed, the verdict
        (a drafting round's projects the target's features into the draft's context; one that drafts nothing,
        `encode=False`, keeps them)."""
        state, B = self._state, self.rows
        tokens = state.anchor.new_zeros(B, width)
        x = tokens[:, 1:]
        V = self.target.get_output_embeddings().weight.shape[0]
        q = torch.full((B, width - 1, V), 1.0 / V, device=tokens.device)  # the draft's distributions, for sampling
        verify_len = torch.full((B,), width - 1, dtype=torch.long, device=tokens.device)

        def run():
            logits = self._steps.verify(state, tokens, encode)
            verify.verify_block(self._out.process_block(x, logits), q, x, verify_len, self._do_sample)

        return run

    def verify_table(self, seconds: dict[int, float]) -> dict[int, float]:
        """Compiled, a round verifying n tokens runs its bucket's width; eagerly, widths not timed are interpolated
        (`EngineCosts`)."""
        if self._steps.compiled:
            return {n: seconds[self._steps.width(n)] for n in range(1, self._tokens + 1)}
        return dict(seconds)

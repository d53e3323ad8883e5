"""The host's copies of the decoding state are the device's, after the prefill and after every round.

The host decides on its own copies (which rows still decode, how many tokens each may still take, which slots an
eager forward reads), and the device is the truth: each round's one read brings back the state the copies mirror
(`DecodingState.ask`/`mirror`: each row's end; `Transcript.ask`/`mirror`: each row's length and where it stopped),
so there is no second formula to drift from the device's. Checked under random rounds: random verify lengths and
pauses, sampled and greedy accepts, EOS stops in a block, finished rows beside live ones, a row's last token.
"""

import random

import pytest
import torch

from conftest import left_padded_prompts, tiny_draft, tiny_target
from dspark_hf import Policy
from dspark_hf.generation import decoding


class RandomRounds(Policy):
    """Verifies a random prefix of each row's block, and pauses drafting now and then (decided before the block is
    drawn, as every policy must)."""

    def __init__(self, seed: int):
        self.rng = random.Random(seed)

    def draft_this_round(self, num_rows: int) -> bool:
        return self.rng.random() < 0.75

    def plan(self, confidences, gamma: int, num_rows: int) -> list[int]:
        return [self.rng.randint(0, gamma) for _ in range(num_rows)]


def mirrored(state, out) -> bool:
    return (state.host_ends == state.end.tolist() and out.n_host == out.n_gen.tolist()
            and out.stopped_host == out.stopped_at.tolist())


@pytest.mark.parametrize("batch", [1, 4])
@pytest.mark.parametrize("seed", range(4))
def test_the_host_s_copies_are_the_device_state_after_every_round(batch, seed, monkeypatch):
    rng = random.Random(seed)
    target = tiny_target("llama")
    draft = tiny_draft(target)
    ids, mask = left_padded_prompts(batch, seed=seed)
    seen = {"rounds": 0, "finished beside live": 0, "last token": 0}
    prefill, round_ = decoding._prefill, decoding._round

    def checked_prefill(s, candidates, state):
        plan = prefill(s, candidates, state)
        assert mirrored(state, s.out)
        return plan

    def checked_round(s, candidates, state, plan):
        upcoming = round_(s, candidates, state, plan)
        assert mirrored(state, s.out), (state.host_ends, state.end, s.out.n_host, s.out.n_gen)
        seen["rounds"] += 1
        seen["finished beside live"] += 0 < len(plan.rows) < batch
        seen["last token"] += plan.one_token_left
        return upcoming

    monkeypatch.setattr(decoding, "_prefill", checked_prefill)
    monkeypatch.setattr(decoding, "_round", checked_round)
    for call in range(3):
        sampling = dict(do_sample=True, top_k=0) if (seed + call) % 2 else dict(do_sample=False)
        torch.manual_seed(seed * 10 + call)
        target.generate(input_ids=ids, attention_mask=mask, max_new_tokens=rng.randint(1, 40),
                        eos_token_id=rng.sample(range(3, 96), 3), pad_token_id=0, assistant_model=draft,
                        verification_policy=RandomRounds(seed * 10 + call), **sampling)
    assert seen["rounds"] > 0 and seen["last token"] > 0
    assert batch == 1 or seen["finished beside live"] > 0, seen

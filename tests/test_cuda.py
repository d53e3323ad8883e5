"""DSpark at accelerator speed, checked on a GPU: the fast path (static cache, compiled steps, CUDA graphs) returns
plain generate()'s tokens, and a drafted round synchronizes with the device once (`torch.cuda.set_sync_debug_mode`
warns at every synchronizing call). Skipped without CUDA; the GPU campaign's first call runs this module
(`examples/gpu_campaign.sh smoke`).
"""

import warnings

import pytest
import torch

from conftest import calibrated_tiny_draft, left_padded_prompts, tiny_target
from dspark_hf import AutoScheduled, FullBlock
from dspark_hf.evaluation import OracleDraft
from dspark_hf.generation import decoding
from dspark_hf.costs.cost_model import EngineCosts

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (the GPU campaign runs it)")

PATHS = pytest.mark.parametrize("static", [False, True], ids=["eager", "compiled"])


def on_gpu(batch: int, max_new_tokens: int = 24):
    target = tiny_target("llama").cuda()
    ids, mask = (t.cuda() for t in left_padded_prompts(batch))
    reference = target.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=max_new_tokens)
    # calibrated as the shipped draft is: its temperatures must not cost a copy to the GPU a round either
    oracle = OracleDraft.from_draft(calibrated_tiny_draft(target).cuda()).set_references(target, reference, mask)
    return target, ids, mask, reference, oracle


def paying_policy() -> AutoScheduled:
    """The default policy with costs by which an oracle draft pays every round (as in tests/test_host_reads.py)."""
    policy = AutoScheduled(progress=False)
    policy.costs = EngineCosts({R: {n: R * (0.05 + 0.001 * n) for n in range(1, 9)} for R in (1, 8)},
                               {1: 0.001, 8: 0.008})
    return policy


@PATHS
@pytest.mark.parametrize("batch", [1, 8])
def test_greedy_output_on_the_gpu_is_plain_generate_s(batch, static):
    target, ids, mask, reference, oracle = on_gpu(batch)
    kw = dict(cache_implementation="static") if static else {}  # on CUDA, a static cache compiles as in plain
    for _ in range(2):  # the second call replays what the first compiled
        out = target.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=24,
                              assistant_model=oracle, verification_policy=FullBlock(), **kw)
        assert torch.equal(out, reference)


@PATHS
@pytest.mark.parametrize("batch", [1, 8])
def test_a_drafted_round_synchronizes_with_the_gpu_once(batch, static, monkeypatch):
    target, ids, mask, reference, oracle = on_gpu(batch)
    kw = dict(assistant_model=oracle, do_sample=False, max_new_tokens=24, return_dict_in_generate=True,
              **(dict(cache_implementation="static") if static else {}))
    target.generate(input_ids=ids, attention_mask=mask, verification_policy=paying_policy(), **kw)  # compiles
    syncs, round_ = [], decoding._round

    def counting(*args, **kwargs):
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                return round_(*args, **kwargs)
            finally:
                torch.cuda.set_sync_debug_mode("default")
                syncs.append(sum("synchronizing" in str(w.message) for w in seen))

    monkeypatch.setattr(decoding, "_round", counting)
    out = target.generate(input_ids=ids, attention_mask=mask, verification_policy=paying_policy(), **kw)
    assert torch.equal(out.sequences, reference)
    drafted = [any(len(rows[i].drafted) > 0 for rows in out.rounds if len(rows) > i) for i in range(len(syncs))]
    per_round = [n for n, d in zip(syncs, drafted) if d]
    assert len(per_round) >= 3 and max(per_round) <= 1, syncs

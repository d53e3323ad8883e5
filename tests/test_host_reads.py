"""A drafted round reads the device once: everything the host needs comes back in one transfer.

On a GPU each read of a device value stalls the whole queue, so the round may read once. On this CPU the reads are
counted where they would happen: the ops that hand a tensor's value to Python (`_local_scalar_dense`: `.item()`,
`int(t)`, `bool(t)`; `equal`, `is_nonzero`) or size a result by its values (`nonzero`, `masked_select`, boolean
indexing), seen by a `TorchDispatchMode`, plus the Python-level `tolist`, `numpy`, `cpu` and `.to("cpu")`, which do
not dispatch on a CPU tensor (`.to` where it names the host: "cpu").
"""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from conftest import left_padded_prompts, tiny_draft, tiny_target
from dspark_hf import AutoScheduled
from dspark_hf.evaluation import OracleDraft
from dspark_hf.generation import decoding
from dspark_hf.scheduling.costs import EngineCosts

aten = torch.ops.aten
READING_OPS = {aten._local_scalar_dense.default, aten.equal.default, aten.is_nonzero.default, aten.nonzero.default,
               aten.masked_select.default}


class HostReads(TorchDispatchMode):
    """Counts reads of tensor values by the host while active (see the module)."""

    def __init__(self):
        super().__init__()
        self.count = 0
        self._saved = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in READING_OPS or (func in (aten.index.Tensor, aten.index_put_.default, aten.index_put.default)
                                   and any(isinstance(i, torch.Tensor) and i.dtype == torch.bool
                                           for i in args[1] if i is not None)):
            self.count += 1
        return func(*args, **kwargs)

    def __enter__(self):
        for name in ("tolist", "numpy", "cpu", "to"):
            self._saved[name] = getattr(torch.Tensor, name)
            setattr(torch.Tensor, name, self._counting(name, self._saved[name]))
        return super().__enter__()

    def __exit__(self, *exc):
        for name, method in self._saved.items():
            setattr(torch.Tensor, name, method)
        return super().__exit__(*exc)

    def _counting(self, name, method):
        def counted(tensor, *args, **kwargs):
            if name != "to" or _to_cpu(args, kwargs):
                self.count += 1
            return method(tensor, *args, **kwargs)
        return counted


def _to_cpu(args, kwargs) -> bool:
    """`.to("cpu")`: a move to the host named as such. (On this CPU a model's `.to(x.device)` names the same device,
    but it moves nothing to the host on a GPU either.)"""
    device = kwargs.get("device", args[0] if args else None)
    return isinstance(device, str) and torch.device(device).type == "cpu"


@pytest.fixture
def counted_rounds(monkeypatch):
    """The reads of every `_round` of the decodes that follow, in order."""
    counts, round_ = [], decoding._round

    def counting(*args, **kwargs):
        with HostReads() as reads:
            try:
                return round_(*args, **kwargs)
            finally:
                counts.append(reads.count)

    monkeypatch.setattr(decoding, "_round", counting)
    return counts


@pytest.mark.parametrize("batch", [1, 8])
def test_a_drafted_round_reads_the_device_at_most_once_with_the_default_policy(batch, counted_rounds):
    target = tiny_target("llama")
    ids, mask = left_padded_prompts(batch)
    reference = target.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=24)
    # an oracle draft, and costs by which drafting pays (a tiny draft costs as much as its tiny target on this CPU):
    # the default policy drafts every round, planning on the host as it always does
    oracle = OracleDraft.from_draft(tiny_draft(target)).set_references(target, reference, mask)
    policy = AutoScheduled(progress=False)
    policy.costs = EngineCosts({R: {n: R * (0.05 + 0.001 * n) for n in range(1, 9)} for R in (1, 8)},
                               {1: 0.001, 8: 0.008})
    out = target.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=24,
                          assistant_model=oracle, return_dict_in_generate=True, verification_policy=policy)
    assert torch.equal(out.sequences, reference)
    drafted = [any(len(rows[i].drafted) > 0 for rows in out.rounds if len(rows) > i)
               for i in range(len(counted_rounds))]
    reads = [n for n, d in zip(counted_rounds, drafted) if d]
    assert len(reads) >= 3 and max(reads) <= 1, counted_rounds


def test_the_count_sees_a_read():
    """Guards the test above: each kind of read it claims to count is counted."""
    x = torch.arange(6.0)
    for read in (lambda: x[0].item(), lambda: bool(x.sum()), lambda: x[x > 2], lambda: x.nonzero(),
                 lambda: torch.equal(x, x), lambda: x.tolist(), lambda: x.cpu(), lambda: x.to("cpu"),
                 lambda: x.numpy()):
        with HostReads() as reads:
            read()
        assert reads.count >= 1, read
    with HostReads() as reads:
        (x + 1).to(torch.float64)
    assert reads.count == 0

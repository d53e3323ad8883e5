"""A drafted round reads the device once: everything the host needs comes back in one transfer.

On a GPU each read of a device value stalls the whole queue, so the round may read once. On this CPU the reads are
counted where they would happen: the ops that hand a tensor's value to Python (`_local_scalar_dense`: `.item()`,
`int(t)`, `bool(t)`; `equal`, `is_nonzero`) or size a result by its values (`nonzero`, `masked_select`, boolean
indexing), seen by a `TorchDispatchMode`, plus the Python-level `tolist`, `numpy`, `cpu` and `.to("cpu")`, which do
not dispatch on a CPU tensor (`.to` where it names the host: "cpu").

Values go the other way too: every tensor made from host values (`torch.tensor`, `new_tensor`, `as_tensor`: the op
`lift_fresh`) is a copy to the device on a GPU. A round makes only the plan's (`host.to_device`: each row's verify
length and whether it is still decoding), with a calibrated draft too.
"""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from conftest import calibrated_tiny_draft, left_padded_prompts, tiny_target
from dspark_hf import AutoScheduled
from dspark_hf.evaluation import OracleDraft
from dspark_hf.generation import decoding, host
from dspark_hf.costs.cost_model import EngineCosts

aten = torch.ops.aten
READING_OPS = {aten._local_scalar_dense.default, aten.equal.default, aten.is_nonzero.default, aten.nonzero.default,
               aten.masked_select.default}


class HostReads(TorchDispatchMode):
    """Counts reads of tensor values by the host while active (see the module)."""

    def __init__(self):
        super().__init__()
        self.count = 0
        self.copies = 0  # tensors made from host values
        self._saved = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is aten.lift_fresh.default:
            self.copies += 1
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


class Rounds(list):
    """Per `_round`, in order: its reads, its copies of host values, and how many of those the plan made."""

    @property
    def reads(self) -> list[int]:
        return [r for r, _, _ in self]


@pytest.fixture
def counted_rounds(monkeypatch):
    """The reads and copies of every `_round` of the decodes that follow."""
    rounds, round_, to_device, planned = Rounds(), decoding._round, host.to_device, [0]

    def counting(*args, **kwargs):
        planned[0] = 0
        with HostReads() as reads:
            try:
                return round_(*args, **kwargs)
            finally:
                rounds.append((reads.count, reads.copies, planned[0]))

    def plan_copy(*args, **kwargs):
        planned[0] += 1
        return to_device(*args, **kwargs)

    monkeypatch.setattr(decoding, "_round", counting)
    monkeypatch.setattr(decoding, "to_device", plan_copy)
    return rounds


@pytest.mark.parametrize("batch", [1, 8])
def test_a_drafted_round_reads_the_device_at_most_once_and_copies_only_its_plan_to_it(batch, counted_rounds):
    target = tiny_target("llama")
    ids, mask = left_padded_prompts(batch)
    reference = target.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=24)
    # an oracle draft, and costs by which drafting pays (a tiny draft costs as much as its tiny target on this CPU):
    # the default policy drafts every round, planning on the host as it always does
    oracle = OracleDraft.from_draft(calibrated_tiny_draft(target)).set_references(target, reference, mask)
    policy = AutoScheduled(progress=False)
    policy.costs = EngineCosts({R: {n: R * (0.05 + 0.001 * n) for n in range(1, 9)} for R in (1, 8)},
                               {1: 0.001, 8: 0.008})
    out = target.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=24,
                          assistant_model=oracle, return_dict_in_generate=True, verification_policy=policy)
    assert torch.equal(out.sequences, reference)
    drafted = [any(len(rows[i].drafted) > 0 for rows in out.rounds if len(rows) > i)
               for i in range(len(counted_rounds))]
    reads = [n for n, d in zip(counted_rounds.reads, drafted) if d]
    assert len(reads) >= 3 and max(reads) <= 1, counted_rounds
    assert all(copies == planned <= 2 for _, copies, planned in counted_rounds), counted_rounds


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
    for copy in (lambda: torch.tensor([1, 2]), lambda: x.new_tensor([1.0]), lambda: torch.as_tensor([3]),
                 lambda: host.to_device([1, 2], torch.long, x.device)):
        with HostReads() as reads:
            copy()
        assert reads.copies == 1, copy
    with HostReads() as reads:
        x / 2.0, torch.full((2,), 3), torch.arange(4)
    assert reads.copies == 0

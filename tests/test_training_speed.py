"""A training step at accelerator speed: it reads nothing from the device (the losses are read every log_every steps),
its batches hold answers of similar length, and the run says how fast it trained and what share of the device's
peak that is."""

import json
import math
import random

import pytest
import torch

from conftest import tiny_target
from dspark_hf.training import trainer
from dspark_hf.training.config import TrainConfig
from dspark_hf.training.steplog import StepLog
from dspark_hf.training.throughput import Shapes, StepFlops
from dspark_hf.training.trainer import grouped_by_length, train
from test_host_reads import HostReads
from test_training import tiny_dataset

aten = torch.ops.aten
UNIQUE_OPS = {aten._unique2.default, aten.unique_dim.default, aten.unique_consecutive.default}


class ReadsAndUniques(HostReads):
    """HostReads, counting torch.unique too: a result sized by the values, as nonzero's is."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in UNIQUE_OPS:
            self.count += 1
        return super().__torch_dispatch__(func, types, args, kwargs)


def tiny_run(tmp_path, target, **settings):
    data = tiny_dataset(tmp_path, target, n=24)
    fields = dict(dataset=str(data), output_dir=str(tmp_path / "run"), batch_size=4, anchors_per_sequence=4,
                  heldout_fraction=0.0, max_steps=6, draft=dict(num_hidden_layers=1, markov_rank=4, block_size=3))
    return TrainConfig(**{**fields, **settings})


def test_a_training_step_reads_nothing_from_the_device_and_the_log_reads_every_n_steps(tmp_path, monkeypatch):
    """On a GPU each read makes the host wait for the device: the steps between the log's reads queue their work and
    go on. The log reads at the first step, then every log_every-th, and at the end."""
    target = tiny_target("llama")
    reads_per_step, log_reads, real_step, real_read = [], [], trainer._step, StepLog.read

    def counted_step(*args, **kwargs):
        with ReadsAndUniques() as reads:
            out = real_step(*args, **kwargs)
        reads_per_step.append(reads.count)
        return out

    def counted_read(log, step):
        log_reads.append(step)
        return real_read(log, step)

    monkeypatch.setattr(trainer, "_step", counted_step)
    monkeypatch.setattr(StepLog, "read", counted_read)
    train(tiny_run(tmp_path, target, max_steps=7, log_every=3), target=target, progress=False)
    assert reads_per_step == [0] * 7
    assert log_reads == [1, 3, 6, 7]


def test_a_compiled_step_compiles_once_in_its_first_step_and_never_again_whatever_the_batch_s_length(tmp_path,
                                                                                                    monkeypatch):
    """With --compile the draft's forward and backward are one graph of dynamic shape: the first step compiles it,
    and the steps after it, on batches of other lengths, run it without a recompile. (aot_eager traces forward and
    backward as inductor does, without generating kernels.)"""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    target = tiny_target("llama")
    lengths, graphs, real_step = [], [], trainer._step

    def counted_step(run, core, batch, *args, **kwargs):
        out = real_step(run, core, batch, *args, **kwargs)
        lengths.append(max(len(e.input_ids) for e in batch))
        graphs.append((counters["stats"]["unique_graphs"], counters["aot_autograd"]["ok"]))
        return out

    # a draft vocabulary: the LM-head rows the draft proposes are sliced from the target's (a cache in eager passes)
    shape = dict(num_hidden_layers=1, markov_rank=4, block_size=3, draft_vocab_size=48)
    monkeypatch.setattr(trainer, "_step", counted_step)
    compiled = train(tiny_run(tmp_path, target, compile="aot_eager", draft=shape, max_steps=4), target=target,
                     progress=False)
    monkeypatch.setattr(trainer, "_step", real_step)
    eager = train(tiny_run(tmp_path, target, output_dir=str(tmp_path / "eager"), draft=shape, max_steps=4),
                  target=target, progress=False)
    assert len(set(lengths)) >= 3  # the batches had several lengths
    assert graphs == [(1, 1)] * 4  # one graph (forward and backward), compiled in the first step
    for (name, a), b in zip(eager.state_dict().items(), compiled.state_dict().values()):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4, msg=f"{name} trained otherwise when compiled")


def test_the_log_says_the_mean_of_the_steps_since_its_last_read_and_stops_at_a_loss_that_is_not_finite():
    log = StepLog(every=2)
    valid = torch.tensor([[True, True], [True, False]])
    for total in (1.0, 3.0):
        log.add({"total": torch.tensor(total), "ce": torch.tensor(0.5),
                 "acceptance": torch.tensor([[1.0, 0.5], [0.0, 0.9]])}, valid)
    shown = log.read(2)
    assert shown["total"] == 2.0 and shown["ce"] == 0.5 and shown["acc"] == [0.5, 0.5]
    assert log.read(3) is shown  # nothing since: the last figures
    log.add({"total": torch.tensor(math.inf), "acceptance": torch.zeros(2, 2)}, valid)
    with pytest.raises(ValueError, match=r"step 4: the training loss is inf \(read every 2 steps\), so training stops"):
        log.read(4)


def test_batches_grouped_by_length_hold_similar_lengths_and_keep_every_example_once():
    rng = random.Random(0)
    lengths = [rng.randrange(20, 400) for _ in range(1000)]
    order = list(range(1000))
    random.Random(1).shuffle(order)
    grouped = grouped_by_length(order, lengths, batch=8, rng=random.Random(2))
    assert sorted(grouped) == list(range(1000))

    def padded_share(o):
        batches = [o[i: i + 8] for i in range(0, len(o), 8)]
        return 1 - sum(lengths[i] for i in o) / sum(len(b) * max(lengths[i] for i in b) for b in batches)

    assert padded_share(order) > 0.4 and padded_share(grouped) < 0.02
    for start in range(0, 1000, 8 * 64):  # each stretch keeps its own examples
        assert set(grouped[start: start + 8 * 64]) == set(order[start: start + 8 * 64])


def test_a_run_reports_its_answers_and_tokens_a_second_its_flops_and_mfu(tmp_path, capsys):
    target = tiny_target("llama")
    train(tiny_run(tmp_path, target), target=target, progress=False)
    throughput = json.loads((tmp_path / "run" / "heldout.json").read_text())["training"]["throughput"]
    assert throughput["answers_per_second"] > 0 and throughput["tokens_per_second"] > throughput["answers_per_second"]
    assert 0 < throughput["mfu"] < 1 and throughput["peak_source"].startswith("this CPU")
    assert set(throughput["tflop_per_step"]) == {"target_forward", "teacher", "draft"}
    assert 0 <= throughput["padded_share"] < 1
    out = capsys.readouterr().out
    assert "throughput: " in out and "answers/s" in out and "tokens/s" in out and "TFLOP/s peak" in out


def test_a_step_s_flops_are_counted_from_its_shapes():
    """The target's forward is 2 x its decoder's weights per token plus causal attention; the draft's forward and
    backward three times its forward, its frozen LM head twice."""
    target = tiny_target("llama")
    from conftest import tiny_draft

    draft = tiny_draft(target, draft_vocab=list(range(40)))
    flops = StepFlops(target, draft)
    one, two = flops(Shapes(1, 10, 12, 8)), flops(Shapes(2, 10, 12, 16))
    assert all(two[k] == 2 * one[k] for k in one)  # per sequence (the teacher's positions: all rows together)
    decoder = sum(m.weight.numel() for m in target.get_decoder().modules() if isinstance(m, torch.nn.Linear))
    config = target.config
    assert one["target_forward"] == 2 * decoder * 10 + 2 * config.num_hidden_layers * config.hidden_size * 100
    assert one["teacher"] == 2 * config.hidden_size * config.vocab_size * 8
    longer = flops(Shapes(1, 10, 24, 8))["draft"] - one["draft"]
    assert longer > 2 * 2 * config.hidden_size * 40 * 12  # more block rows: more of every draft matmul


def test_a_cpu_that_multiplies_bfloat16_far_faster_is_told_the_flags_that_use_it(monkeypatch):
    from dspark_hf.training import throughput

    cpu = torch.device("cpu")
    monkeypatch.setattr(throughput, "measured_cpu_peak", lambda dtype=torch.float32: 5e11)
    assert "--mixed-precision bf16 --target-dtype bfloat16" in throughput.bfloat16_hint(cpu, torch.float32, 1e11)
    assert "5.0x as fast" in throughput.bfloat16_hint(cpu, torch.float32, 1e11)
    assert throughput.bfloat16_hint(cpu, torch.float32, 3e11) is None  # under twice: float32 it stays
    assert throughput.bfloat16_hint(cpu, torch.bfloat16, 1e11) is None  # already in bfloat16
    assert throughput.bfloat16_hint(torch.device("cuda"), torch.float32, 1e11) is None

"""Where a training run's time goes, and the CUDA-only calls of `dspark train` that a CPU can still check: the time
budget's accounting (steps as a share of it, the bounded held-out report, saves that do not stall steps), the GPU
monitor, and the memory fraction on a GPU that accelerate names without an index."""

import json
import threading

import pytest
import torch

from conftest import tiny_draft, tiny_target
from dspark_hf.training.config import TrainConfig
from dspark_hf.training.trainer import train
from test_training import FakeClock, tiny_dataset


def test_the_gpu_memory_fraction_is_set_on_the_current_gpu_when_accelerate_names_it_without_an_index(tmp_path,
                                                                                                    monkeypatch):
    # the first GPU run (2026-11-26): `dspark train --gpu-memory-fraction 0.45` failed on CUDA with "Expected a
    # torch.device with a specified index or an integer, but got:cuda": accelerate reports a single GPU as "cuda"
    import accelerate
    from torch.cuda._utils import _get_device_index

    class Reached(Exception):
        pass

    set_to = []

    def set_fraction(fraction, device=None):
        set_to.append((fraction, torch.device("cuda", _get_device_index(device))))  # torch's own check of the device
        raise Reached  # nothing past this point can run without a GPU

    class OneGpu:  # what accelerate gives a single process on a GPU machine
        device = torch.device("cuda")

        def __init__(self, **kwargs):
            pass

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *args, **kwargs: True)
    monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction", set_fraction)
    monkeypatch.setattr(accelerate, "Accelerator", OneGpu)
    tf32 = torch.backends.cuda.matmul.allow_tf32  # a setting train() makes on a GPU (not an attribute to patch)
    try:
        with pytest.raises(Reached):
            train(TrainConfig(dataset=str(tmp_path / "data.jsonl"), output_dir=str(tmp_path / "run"),
                              gpu_memory_fraction=0.45), target=tiny_target("llama"), progress=False)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32
    assert set_to == [(0.45, torch.device("cuda", 0))]


def test_the_gpu_monitor_reads_utilisation_at_most_once_a_period_and_the_peak_memory(monkeypatch):
    from types import SimpleNamespace

    from dspark_hf.devices import GpuMonitor

    busy = iter([40.0, 80.0, 60.0])
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda device: None)
    monkeypatch.setattr(torch.cuda, "utilization", lambda device: next(busy))
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device: 3 * 2 ** 30)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: SimpleNamespace(total_memory=80 * 2 ** 30))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device: "a GPU")
    now = [0.0]
    monitor = GpuMonitor(torch.device("cuda", 0), every=1.0, now=lambda: now[0])
    for t in (0.0, 0.4, 0.9, 1.2, 1.5, 2.3):  # readings at 0, 1.2 and 2.3 s
        now[0] = t
        monitor.sample()
    report = monitor.report()
    assert report["utilisation_readings"] == 3 and report["utilisation_mean"] == 60.0
    assert report["peak_memory_gib"] == 3.0 and report["memory_gib"] == 80.0
    assert monitor.line() == "GPU a GPU: utilisation 60% on average over 3 readings, peak memory 3.0 of 80.0 GiB"

    def no_nvml(device):
        raise ModuleNotFoundError("pynvml")

    monkeypatch.setattr(torch.cuda, "utilization", no_nvml)
    unread = GpuMonitor(torch.device("cuda", 0), now=lambda: 0.0)
    unread.sample()
    assert unread.report()["utilisation_mean"] is None and "pynvml" in unread.line()
    assert GpuMonitor(torch.device("cpu")).report() is None  # off CUDA it reads nothing


def test_the_run_records_where_its_budget_went_and_keeps_most_of_it_for_steps(tmp_path, monkeypatch, capsys):
    import dspark_hf.training.heldout as heldout

    target = tiny_target("llama")
    data = tiny_dataset(tmp_path, target, n=40)
    clock = FakeClock(monkeypatch, step_seconds=1.0)  # every forward pass, the report's too, takes a second
    real_forward = heldout.train_step

    def report_forward(*args, **kwargs):
        clock.now += 1.0
        return real_forward(*args, **kwargs)

    monkeypatch.setattr(heldout, "train_step", report_forward)
    train(TrainConfig(dataset=str(data), output_dir=str(tmp_path / "run"), time_budget=2.0, batch_size=2,
                      anchors_per_sequence=4, heldout_fraction=0.3, save_every=1000,
                      draft=dict(num_hidden_layers=1, markov_rank=4, block_size=3)), target=target, progress=False)
    report = json.loads((tmp_path / "run" / "heldout.json").read_text())
    time = report["training"]["time"]
    assert time["budget_seconds"] == 120 and time["step_seconds"] == report["training"]["steps"]
    assert time["steps_share"] == pytest.approx(time["step_seconds"] / 120, abs=1e-4)
    # the report is bounded to its share of the budget (4% of 120 s: 4 forward passes of a second, of the 5 batches
    # held out), so the steps keep the rest but the fixed reserve for saving
    assert 0 < time["report_seconds"] <= 0.04 * 120 and report["sequences"] < report["heldout_sequences"]
    assert time["steps_share"] >= 0.9
    assert f"time: {report['training']['steps']} steps in" in capsys.readouterr().out
    assert report["training"]["gpu"] is None  # a CPU run has no GPU figures


def test_periodic_checkpoints_are_written_beside_the_steps_and_resume_as_the_foreground_ones_do(tmp_path,
                                                                                               monkeypatch):
    import dspark_hf.training.checkpoints as checkpoints

    target = tiny_target("llama")
    data = tiny_dataset(tmp_path, target, n=12)
    kw = dict(dataset=str(data), batch_size=4, anchors_per_sequence=4, heldout_fraction=0.0, max_steps=4,
              save_every=2, draft=dict(num_hidden_layers=1, markov_rank=4, block_size=3))
    writers, real_save = [], checkpoints.save_checkpoint

    def recorded(*args, **kwargs):
        writers.append(threading.current_thread().name)
        return real_save(*args, **kwargs)

    monkeypatch.setattr(checkpoints, "save_checkpoint", recorded)
    straight = train(TrainConfig(output_dir=str(tmp_path / "straight"), **kw), target=target, progress=False)
    assert writers[:2] == ["checkpoint-2", "checkpoint-4"]  # steps 2 and 4, each written by its own thread
    state = torch.load(tmp_path / "straight" / "checkpoint-2" / "trainer_state.pt", weights_only=False)
    assert state["step"] == 2 and state["batch_size"] == 4

    # a run stopped after step 2 and resumed from that checkpoint ends where the straight run did
    import shutil

    shutil.copytree(tmp_path / "straight", tmp_path / "resumed", ignore=shutil.ignore_patterns("checkpoint-4"))
    (tmp_path / "resumed" / "heldout.json").unlink()
    resumed = train(TrainConfig(output_dir=str(tmp_path / "resumed"), **kw), target=target, progress=False)
    for (name, a), b in zip(straight.state_dict().items(), resumed.state_dict().values()):
        assert torch.equal(a, b), name


def test_a_draft_started_from_another_is_measured_beside_it_on_the_same_held_out_batches(tmp_path):
    target = tiny_target("llama")
    data = tiny_dataset(tmp_path, target, n=16)
    tiny_draft(target, num_hidden_layers=1, markov_rank=4, block_size=3).save_pretrained(tmp_path / "start")
    train(TrainConfig(dataset=str(data), output_dir=str(tmp_path / "run"), init_from=str(tmp_path / "start"),
                      max_steps=2, batch_size=4, anchors_per_sequence=4, heldout_fraction=0.3), target=target,
          progress=False)
    report = json.loads((tmp_path / "run" / "heldout.json").read_text())
    start = report["init_from"]
    assert start["path"] == str(tmp_path / "start") and start["sequences"] == report["sequences"] > 0
    assert start["expected_greedy_tau"] >= 1 and start["acceptance_per_position"] != report["acceptance_per_position"]

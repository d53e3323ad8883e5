"""`dspark train` on two processes that really start (torchrun, gloo, on the CPU): every process records its rank,
the world size and its process id, and each test fails unless two processes joined one group.

(`accelerate launch --num_processes 2 --cpu` starts one process on a CPU without MPI; torchrun starts two.)"""

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import tiny_target
from test_training import tiny_dataset

pytestmark = pytest.mark.slow  # every test launches processes of its own (torchrun, gloo)

RANK = Path(__file__).parent / "multiprocess" / "train_rank.py"
seen_stdout: list[str] = []  # what each run printed, newest last


def two_processes(tmp_path, flags: list[str], timeout: float = 240, killed: bool = False, **env) -> list[dict]:
    """Run `dspark train FLAGS` on two processes; the records of both (see multiprocess/train_rank.py). killed: the
    run is expected to die (a rank kills itself), and records nothing."""
    records = tmp_path / "records"
    shutil.rmtree(records, ignore_errors=True)
    records.mkdir()
    with socket.socket() as s:  # a free port for the group's rendezvous
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
                          str(port), str(RANK), str(records), *flags], capture_output=True, text=True,
                         timeout=timeout, env={**os.environ, "OMP_NUM_THREADS": "1", **env})
    if killed:
        assert run.returncode != 0 and "SIGKILL" in run.stderr, run.stderr[-4000:]
        return []
    assert run.returncode == 0, run.stderr[-4000:]
    assert run.stdout.count("draft saved to") == 1, run.stdout  # said once, by the process that saved it
    seen_stdout.append(run.stdout)
    seen = [json.loads((records / f"rank-{r}.json").read_text()) for r in range(2)]
    assert [s["rank"] for s in seen] == [0, 1] and {s["world_size"] for s in seen} == {2}
    assert all(s["world_size_seen"] == 2 for s in seen), "accelerate saw one process: no group was formed"
    assert seen[0]["pid"] != seen[1]["pid"]
    return seen


def tiny_run(tmp_path, n: int = 16) -> list[str]:
    """Flags of a small run of a tiny Llama target and draft, whose output goes to tmp_path/run."""
    target = tiny_target("llama")
    target.save_pretrained(tmp_path / "target")
    data = tiny_dataset(tmp_path, target, n=n)
    return ["--target", str(tmp_path / "target"), "--dataset", str(data), "--output-dir", str(tmp_path / "run"),
            "--layers", "1", "--markov-rank", "4", "--block-size", "3"]


def test_a_step_budgeted_run_keeps_identical_replicas_lowers_the_loss_and_saves_a_lossless_draft(tmp_path):
    from conftest import left_padded_prompts
    from transformers import AutoModelForCausalLM

    from dspark_hf import DSparkDraftModel, FullBlock

    seen = two_processes(tmp_path, tiny_run(tmp_path) + ["--max-steps", "24", "--save-every", "8", "--batch-size",
                                                         "2", "--lr", "3e-3", "--heldout-fraction", "0"],
                         SAVE_EVERY="8")
    assert "a global batch of 4 a step" in seen_stdout[-1]
    assert seen[0]["weights"] == seen[1]["weights"] and list(seen[0]["weights"]) == ["8", "16", "24"]
    for losses in (s["losses"] for s in seen):
        assert sum(losses[-4:]) < 0.95 * sum(losses[:4]), losses
    target = AutoModelForCausalLM.from_pretrained(tmp_path / "target")
    draft = DSparkDraftModel.from_pretrained(tmp_path / "run")
    ids, mask = left_padded_prompts(3)
    plain = target.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=12)
    assert torch.equal(target.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=12,
                                       assistant_model=draft, verification_policy=FullBlock()), plain)


def test_a_run_whose_rank_was_killed_resumes_from_its_last_whole_checkpoint_on_two_processes(tmp_path):
    flags = tiny_run(tmp_path) + ["--max-steps", "8", "--save-every", "2", "--batch-size", "2"]
    two_processes(tmp_path, flags, killed=True, KILL_RANK="1", KILL_AT_STEP="5")
    whole = [int(p.name.split("-")[1]) for p in (tmp_path / "run").glob("checkpoint-*")
             if (p / "trainer_state.pt").is_file()]
    assert max(whole) in (2, 4)  # step 4's checkpoint is whole unless the kill came while rank 0 wrote it
    seen = two_processes(tmp_path, flags)
    assert f"at step {max(whole)} of 8" in seen_stdout[-1]
    assert [len(s["learning_rates"]) for s in seen] == [8 - max(whole)] * 2
    assert (tmp_path / "run" / "heldout.json").is_file()


def test_under_a_time_budget_a_slower_rank_stops_at_the_same_step_with_the_same_learning_rates(tmp_path):
    """Rank 0's clock decides when the run ends and what each step's learning rate is: a rank that decided alone would
    stop first and leave the other waiting in the gradient all-reduce (the test's timeout), or drift apart."""
    target = tiny_target("llama")
    target.save_pretrained(tmp_path / "target")
    data = tiny_dataset(tmp_path, target, n=16)
    seen = two_processes(tmp_path, ["--target", str(tmp_path / "target"), "--dataset", str(data), "--output-dir",
                                    str(tmp_path / "run"), "--time-budget", "0.4", "--batch-size", "2",
                                    "--layers", "1", "--markov-rank", "4", "--block-size", "3"],
                         SLOW_RANK="1", SLOW_SECONDS="0.3")
    steps = [len(s["learning_rates"]) for s in seen]
    assert steps[0] == steps[1] > 3
    assert seen[0]["learning_rates"] == seen[1]["learning_rates"]
    assert (tmp_path / "run" / "heldout.json").is_file()


def test_the_batch_size_probe_agrees_on_the_smallest_any_process_found(tmp_path):
    """Each device may fit another batch; every process steps with the smallest found (the probe runs on CUDA only, so
    here it is faked: rank r finds --batch-size minus r)."""
    target = tiny_target("llama")
    target.save_pretrained(tmp_path / "target")
    data = tiny_dataset(tmp_path, target, n=16)
    seen = two_processes(tmp_path, ["--target", str(tmp_path / "target"), "--dataset", str(data), "--output-dir",
                                    str(tmp_path / "run"), "--max-steps", "4", "--batch-size", "4",
                                    "--auto-find-batch-size", "--layers", "1", "--markov-rank", "4",
                                    "--block-size", "3"], FAKE_PROBE="1")
    # an epoch's last batch may hold fewer (every rank takes the same steps): the full ones hold 3 on both
    assert seen[0]["batch_sizes"] == seen[1]["batch_sizes"] and max(seen[0]["batch_sizes"]) == 3


def test_the_feature_cache_is_written_once_in_shares_and_read_whole_by_both(tmp_path):
    target = tiny_target("llama")
    target.save_pretrained(tmp_path / "target")
    data = tiny_dataset(tmp_path, target, n=16)
    cache = tmp_path / "features"
    two_processes(tmp_path, ["--target", str(tmp_path / "target"), "--dataset", str(data), "--output-dir",
                             str(tmp_path / "run"), "--max-steps", "4", "--batch-size", "2", "--feature-cache",
                             str(cache), "--layers", "1", "--markov-rank", "4", "--block-size", "3"])
    assert len(list(cache.glob("*.safetensors"))) == 16 and not list(cache.glob("*.partial"))
    assert (tmp_path / "run" / "heldout.json").is_file()


# -- what one process can check of a run meant for several ---------------------------------------------------------
def test_gradient_accumulation_steps_once_per_accumulated_batches_and_an_epoch_sees_every_example_once(tmp_path,
                                                                                                     monkeypatch):
    """--gradient-accumulation-steps 3 at --batch-size 2: each optimizer step learns from three forward passes of two
    sequences, and one epoch of 12 examples is two steps that see each of them once."""
    import dspark_hf.training.trainer as trainer
    from dspark_hf.training.config import TrainConfig
    from dspark_hf.training.trainer import train

    target = tiny_target("llama")
    data = tiny_dataset(tmp_path, target, n=12)
    passes, steps, real_train_step, real_step = [], [], trainer.train_step, trainer._step

    def counted_pass(core, target, batch, *args, **kwargs):
        passes.append([ex.id for ex in batch])
        return real_train_step(core, target, batch, *args, **kwargs)

    def counted_step(run, *args, **kwargs):
        steps.append(len(passes))
        return real_step(run, *args, **kwargs)

    monkeypatch.setattr(trainer, "train_step", counted_pass)
    monkeypatch.setattr(trainer, "_step", counted_step)
    train(TrainConfig(dataset=str(data), output_dir=str(tmp_path / "run"), epochs=1, batch_size=2,
                      gradient_accumulation_steps=3, anchors_per_sequence=4, heldout_fraction=0.0,
                      draft=dict(num_hidden_layers=1, markov_rank=4, block_size=3)), target=target, progress=False)
    assert steps == [0, 3] and [len(p) for p in passes] == [2] * 6
    assert sorted(i for p in passes for i in p) == sorted({i for p in passes for i in p}) and len(passes) * 2 == 12
    report = json.loads((tmp_path / "run" / "heldout.json").read_text())["training"]
    assert (report["steps"], report["global_batch"], report["processes"]) == (2, 6, 1)


def test_a_run_resumes_only_on_as_many_processes_as_it_was_trained_on(tmp_path, capsys):
    """The data's shards and the global batch depend on the number of processes: a checkpoint saved by two processes
    is refused by one, in one line naming both counts."""
    import torch
    from dspark_hf.training.config import TrainConfig
    from dspark_hf.training.trainer import train

    target = tiny_target("llama")
    data = tiny_dataset(tmp_path, target, n=8)
    kw = dict(dataset=str(data), output_dir=str(tmp_path / "run"), batch_size=2, anchors_per_sequence=4,
              heldout_fraction=0.0, save_every=1, draft=dict(num_hidden_layers=1, markov_rank=4, block_size=3))
    train(TrainConfig(max_steps=1, **kw), target=target, progress=False)
    state_file = tmp_path / "run" / "checkpoint-1" / "trainer_state.pt"
    state = torch.load(state_file, weights_only=False)
    assert state["processes"] == 1
    torch.save({**state, "processes": 2}, state_file)
    with pytest.raises(ValueError, match=r"trained on 2 process\(es\) and this run has 1: resume it on 2"):
        train(TrainConfig(max_steps=2, **kw), target=target, progress=False)


def test_checkpoints_and_the_final_draft_save_the_weights_accelerate_gathers(tmp_path, monkeypatch):
    """Under FSDP or DeepSpeed ZeRO-3 each process holds a shard of every weight, and only
    `accelerator.get_state_dict` (a collective) returns them whole. Faked here: the draft's own state_dict returns
    empty shards, as ZeRO-3 leaves them; what is saved must still be the whole, loadable draft."""
    import torch
    from accelerate import Accelerator

    from dspark_hf import DSparkDraftModel
    from dspark_hf.training.config import TrainConfig
    from dspark_hf.training.trainer import train

    target = tiny_target("llama")
    data = tiny_dataset(tmp_path, target, n=8)
    gathered = []

    def gather(self, model, unwrap=True):
        model = self.unwrap_model(model)
        whole = {k: v.detach().clone() for k, v in torch.nn.Module.state_dict(model).items()}
        gathered.append(len(whole))
        return whole

    real_prepare = Accelerator.prepare

    def prepare(self, *args, **kwargs):
        prepared = real_prepare(self, *args, **kwargs)
        model = self.unwrap_model(prepared[0])
        model.state_dict = lambda *a, **k: {name: torch.empty(0) for name in torch.nn.Module.state_dict(model)}
        return prepared

    monkeypatch.setattr(Accelerator, "get_state_dict", gather)
    monkeypatch.setattr(Accelerator, "prepare", prepare)
    draft = train(TrainConfig(dataset=str(data), output_dir=str(tmp_path / "run"), max_steps=2, save_every=1,
                              batch_size=2, anchors_per_sequence=4, heldout_fraction=0.0,
                              draft=dict(num_hidden_layers=1, markov_rank=4, block_size=3)), target=target,
                  progress=False)
    assert len(gathered) == 3  # two checkpoints and the final draft
    trained = torch.nn.Module.state_dict(draft)
    for folder in (tmp_path / "run", tmp_path / "run" / "checkpoint-2"):
        saved = DSparkDraftModel.from_pretrained(folder).state_dict()
        for name, weight in saved.items():
            if folder.name == "run":
                assert torch.equal(weight, trained[name]), name
            assert weight.numel() > 0, name


@pytest.mark.parametrize("environ, processes, said", [
    ({}, 1, None),
    ({"WORLD_SIZE": "2", "RANK": "0", "MASTER_ADDR": "127.0.0.1"}, 2, None),  # torchrun, two joined
    ({"WORLD_SIZE": "2", "RANK": "0", "MASTER_ADDR": "127.0.0.1"}, 1, "WORLD_SIZE=2, but 1 process"),
    ({"ACCELERATE_USE_CPU": "True", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}, 1, "--num_processes N --cpu"),
    ({"ACCELERATE_USE_CPU": "True"}, 1, None),  # accelerate launch of one process: what it asked for
])
def test_a_launch_that_starts_fewer_processes_than_it_asked_for_is_named(environ, processes, said):
    from dspark_hf.training.trainer import fewer_processes_than_asked

    found = fewer_processes_than_asked(environ, processes)
    assert (found is None) if said is None else (said in found)

"""`dspark train` on two processes that really start (torchrun, gloo, on the CPU): every process records its rank,
the world size and its process id, and each test fails unless two processes joined one group.

(`accelerate launch --num_processes 2 --cpu` starts one process on a CPU without MPI; torchrun starts two.)"""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import tiny_target
from test_training import tiny_dataset

RANK = Path(__file__).parent / "multiprocess" / "train_rank.py"


def two_processes(tmp_path, flags: list[str], timeout: float = 240, **env) -> list[dict]:
    """Run `dspark train FLAGS` on two processes; the records of both (see multiprocess/train_rank.py)."""
    records = tmp_path / "records"
    records.mkdir()
    with socket.socket() as s:  # a free port for the group's rendezvous
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
                          str(port), str(RANK), str(records), *flags], capture_output=True, text=True,
                         timeout=timeout, env={**os.environ, "OMP_NUM_THREADS": "1", **env})
    assert run.returncode == 0, run.stderr[-4000:]
    assert run.stdout.count("draft saved to") == 1, run.stdout  # said once, by the process that saved it
    seen = [json.loads((records / f"rank-{r}.json").read_text()) for r in range(2)]
    assert [s["rank"] for s in seen] == [0, 1] and {s["world_size"] for s in seen} == {2}
    assert all(s["world_size_seen"] == 2 for s in seen), "accelerate saw one process: no group was formed"
    assert seen[0]["pid"] != seen[1]["pid"]
    return seen


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

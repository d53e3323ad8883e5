"""One process of a `dspark train` run started by torchrun (tests/test_multiprocess.py): it writes what it saw of
the run to RECORD_DIR/rank-N.json (its rank, the world size, its process id, the learning rate and loss of every step
it took, and a digest of its weights after every SAVE_EVERY-th step) and, for the rank named in SLOW_RANK, makes every
step take SLOW_SECONDS longer, as a slower device would; the rank named in KILL_RANK kills itself (SIGKILL) before
its step KILL_AT_STEP + 1.

usage: torchrun --nproc_per_node 2 train_rank.py RECORD_DIR [dspark train flags...]
"""

import hashlib
import json
import os
import signal
import sys
import time
from pathlib import Path


def main(record_dir: str, *train_flags: str) -> int:
    import dspark_hf.training.trainer as trainer
    from dspark_hf.cli import main as dspark

    rank = int(os.environ["RANK"])
    slow = rank == int(os.environ.get("SLOW_RANK", "-1"))
    seen = {"rank": rank, "world_size": int(os.environ["WORLD_SIZE"]), "pid": os.getpid(), "learning_rates": []}
    real_step = trainer._step
    save_every = int(os.environ.get("SAVE_EVERY", "0"))
    kill_at = int(os.environ.get("KILL_AT_STEP", "-1")) if rank == int(os.environ.get("KILL_RANK", "-1")) else -1

    def recorded_step(run, *args, **kwargs):
        if len(seen["learning_rates"]) == kill_at:
            os.kill(os.getpid(), signal.SIGKILL)
        seen["world_size_seen"] = run.accelerator.num_processes
        seen["learning_rates"].append(run.optimizer.param_groups[0]["lr"])  # the previous step's, then this one's
        seen.setdefault("batch_sizes", []).append(len(args[1]))  # _step(run, core, batch, ...)
        if slow:
            time.sleep(float(os.environ.get("SLOW_SECONDS", "0.3")))
        out = real_step(run, *args, **kwargs)
        seen["learning_rates"][-1] = run.optimizer.param_groups[0]["lr"]
        seen.setdefault("losses", []).append(float(out[0]["total"]))
        step = args[2]  # _step(run, core, batch, step, ...): the steps taken before this one
        if save_every and (step + 1) % save_every == 0:
            weights = b"".join(p.detach().cpu().numpy().tobytes() for p in run.draft.parameters())
            seen.setdefault("weights", {})[step + 1] = hashlib.sha256(weights).hexdigest()
        return out

    trainer._step = recorded_step
    if os.environ.get("FAKE_PROBE") == "1":  # as if each device fit another batch: rank r finds batch_size - r
        trainer.find_batch_size = lambda *args: args[4].batch_size - rank
    code = dspark(["train", *train_flags])
    Path(record_dir, f"rank-{rank}.json").write_text(json.dumps(seen))
    return code


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))

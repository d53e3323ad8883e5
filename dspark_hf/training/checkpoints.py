"""Resumable checkpoints: checkpoint-<step> folders with the model and the trainer state, the last two kept."""

from __future__ import annotations

import os
import pickle
import shutil
import warnings
import zipfile
from pathlib import Path

import torch

STATE_FILE = "trainer_state.pt"


def checkpoint_folders(out_dir: Path) -> list[Path]:
    """checkpoint-<step> folders, oldest first."""
    return sorted(out_dir.glob("checkpoint-*"), key=lambda p: int(p.name.split("-")[1]))


def latest_checkpoint(out_dir: Path) -> tuple[Path, dict] | None:
    """The newest checkpoint whose trainer state loads, and that state (None: no checkpoint). A newer one whose state
    is torn (by a run killed while an earlier version wrote it in place) is passed over with a warning; ValueError if
    none loads, or if a whole one fails to load."""
    found = [p for p in checkpoint_folders(out_dir) if (p / STATE_FILE).exists()]
    torn = []
    for path in reversed(found):
        try:
            # on the CPU: a state saved on a GPU resumes anywhere (--device may change), and the optimizer's
            # load_state_dict moves each tensor to its parameter's device
            state = torch.load(path / STATE_FILE, map_location="cpu", weights_only=False)
        except Exception as error:
            if not _torn(path / STATE_FILE, error):
                raise ValueError(f"{path / STATE_FILE} is whole but does not load ({type(error).__name__}: "
                                 f"{' '.join(str(error).split())[:300]}): fix that, or remove {path} to resume from "
                                 "the checkpoint before.") from error
            torn.append(f"{path.name} ({' '.join(str(error).split())[:100]})")
            continue
        if torn:
            warnings.warn(f"{out_dir}: the trainer state of {', '.join(torn)} does not load (a run killed while "
                          f"saving it): resuming from {path.name}.", stacklevel=2)
        return path, state
    if found:
        raise ValueError(f"no checkpoint of {out_dir} has a trainer state that loads: remove its checkpoint-* "
                         "folders to train afresh, or give a new output_dir.")
    return None


def _torn(state_file: Path, error: Exception) -> bool:
    """Whether a state that failed to load was cut short by a killed save (torch.save writes a zip archive, so one
    not whole, or a pickle that runs out, is torn), rather than failing for a reason to report."""
    if isinstance(error, (EOFError, pickle.UnpicklingError)):
        return True
    try:
        with zipfile.ZipFile(state_file) as archive:
            return archive.testzip() is not None
    except (zipfile.BadZipFile, EOFError, OSError):
        return True


def trainer_state(optimizer, step: int, clock, generator: torch.Generator, batch_size: int, processes: int) -> dict:
    """What a checkpoint keeps beside the weights: the optimizer, the step, the run clock's state, the anchor
    generator's (a resumed epoch draws the anchors it would have drawn), the batch size (which auto_find_batch_size may
    have chosen: a resumed run keeps it) and the processes the run steps on (a resume needs as many)."""
    return {"optimizer": optimizer.state_dict(), "step": step, "clock": clock.state(),
            "generator": generator.get_state(), "batch_size": batch_size, "processes": processes}


def save_checkpoint(model, weights: dict, state: dict, out_dir: Path) -> None:
    """Save `model` (a draft or a peft adapter) with `weights`, its whole state dict (which a sharded run gathers
    first: `accelerator.get_state_dict`), and the trainer `state`, as checkpoint-<state["step"]>; then drop all but the
    two newest. The state file, which marks the checkpoint complete, is written last and whole (through a temporary
    file), so a run killed while saving leaves the previous checkpoint to resume from."""
    path = out_dir / f"checkpoint-{state['step']}"
    (path / STATE_FILE).unlink(missing_ok=True)  # a folder saved over (after a resume) is incomplete until the end
    model.save_pretrained(path, state_dict=weights)
    partial = path / f"{STATE_FILE}.partial"
    torch.save(state, partial)
    os.replace(partial, path / STATE_FILE)
    for old in checkpoint_folders(out_dir)[:-2]:
        shutil.rmtree(old, ignore_errors=True)


class CheckpointWriter:
    """Periodic checkpoints that do not stall training: the weights and the trainer state are copied to the CPU (a
    snapshot of this step), and a thread writes them while the next steps run. One write at a time; `wait` joins it
    and raises what it raised. A peft model (its adapter) is saved in the foreground."""

    def __init__(self):
        self._thread = None
        self._error = None

    def save(self, model, weights: dict, state: dict, out_dir: Path) -> None:
        """`save_checkpoint(model, weights, state, out_dir)`, written by a thread from a copy taken now."""
        import threading

        self.wait()
        if hasattr(model, "peft_config"):
            save_checkpoint(model, weights, state, out_dir)
            return
        weights, state = _on_cpu(weights), _on_cpu(state)

        def write():
            try:
                save_checkpoint(model, weights, state, out_dir)
            except BaseException as error:  # raised in the training thread by wait()
                self._error = error

        self._thread = threading.Thread(target=write, name=f"checkpoint-{state['step']}", daemon=True)
        self._thread.start()

    def wait(self) -> None:
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            error, self._error = self._error, None
            raise error


def _on_cpu(value):
    """A copy of a (nested) state dict with every tensor on the CPU: what the optimizer holds now, not later."""
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", copy=True)
    if isinstance(value, dict):
        return {k: _on_cpu(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_on_cpu(v) for v in value)
    return value

"""Resumable checkpoints: checkpoint-<step> folders with the model and the trainer state, the last two kept."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

STATE_FILE = "trainer_state.pt"


def checkpoint_folders(out_dir: Path) -> list[Path]:
    """checkpoint-<step> folders, oldest first."""
    return sorted(out_dir.glob("checkpoint-*"), key=lambda p: int(p.name.split("-")[1]))


def latest_checkpoint(out_dir: Path) -> Path | None:
    found = [p for p in checkpoint_folders(out_dir) if (p / STATE_FILE).exists()]
    return found[-1] if found else None


def save_checkpoint(model, optimizer, step: int, clock, out_dir: Path, generator: torch.Generator):
    """Save `model` (a draft or a peft adapter), the optimizer, the step, the run clock's state and the anchor
    generator's (a resumed epoch draws the anchors it would have drawn), then drop all but the two newest."""
    path = out_dir / f"checkpoint-{step}"
    model.save_pretrained(path)
    torch.save({"optimizer": optimizer.state_dict(), "step": step, "clock": clock.state(),
                "generator": generator.get_state()}, path / STATE_FILE)
    for old in checkpoint_folders(out_dir)[:-2]:
        shutil.rmtree(old, ignore_errors=True)

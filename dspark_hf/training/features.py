"""Target features for training: computed online from the frozen target (default), or read from a small on-disk
cache for setups where one target pass over the data is cheaper than one per epoch.

A provider turns a batch of token sequences into what the draft trains on:
features (B, L, m * d) from ``target_layer_ids``, and the target's last hidden state (B, L, d) after its final
norm, from which the frozen LM head gives the target distribution at any position.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file


def pad_batch(sequences: list[list[int]], pad_id: int = 0):
    """Right-pad token lists: ids (B, L), attention mask (B, L), lengths (B,)."""
    lengths = torch.tensor([len(s) for s in sequences])
    ids = torch.full((len(sequences), int(lengths.max())), pad_id, dtype=torch.long)
    for i, s in enumerate(sequences):
        ids[i, : len(s)] = torch.tensor(s)
    mask = (torch.arange(ids.shape[1]) < lengths[:, None]).long()
    return ids, mask, lengths


class OnlineFeatures:
    """Runs the frozen target on each batch (no gradients)."""

    def __init__(self, target, target_layer_ids: list[int]):
        self.target = target
        self.request = [i + 1 for i in target_layer_ids] + [target.config.get_text_config().num_hidden_layers]

    @torch.no_grad()
    def __call__(self, examples) -> tuple[torch.Tensor, torch.Tensor]:
        ids, mask, _ = pad_batch([e.input_ids for e in examples])
        device = self.target.device
        hidden = self.target.base_model(input_ids=ids.to(device), attention_mask=mask.to(device),
                                   output_hidden_states=self.request).hidden_states
        features = torch.cat([hidden[i] for i in self.request[:-1]], dim=-1)
        return features, hidden[self.request[-1]]


class CachedFeatures:
    """Features written once to `directory` (fp16 safetensors per example), then read back every epoch."""

    def __init__(self, directory: str | Path, target, target_layer_ids: list[int], examples, progress=True):
        from tqdm.auto import tqdm

        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        index = self.directory / "index.json"
        meta = {"target": getattr(target.config, "_name_or_path", ""), "target_layer_ids": list(target_layer_ids)}
        if index.exists():
            found = json.loads(index.read_text())
            if found != meta:
                raise ValueError(f"The feature cache in {self.directory} was built for {found}, not {meta}: remove "
                                 "it or choose another --feature-cache directory.")
        index.write_text(json.dumps(meta))
        online = OnlineFeatures(target, target_layer_ids)
        missing = [e for e in examples if not self._path(e).exists()]
        for i in tqdm(range(0, len(missing), 8), desc="caching target features", disable=not progress):
            chunk = missing[i: i + 8]
            features, last = online(chunk)
            for j, e in enumerate(chunk):
                n = len(e.input_ids)
                # written aside, then renamed: a run killed mid-write must not leave a file that looks cached
                partial = self._path(e).with_suffix(".partial")
                save_file({"features": features[j, :n].half().contiguous().cpu(),
                           "last": last[j, :n].half().contiguous().cpu()}, partial)
                os.replace(partial, self._path(e))

    def _path(self, example) -> Path:
        # keyed by the tokens as well as the id: answers regenerated for the same prompts (another seed, temperature
        # or target) must not read features of the old answers
        safe = "".join(c if c.isalnum() or c in "-_" else "_" for c in example.id)
        tokens = hashlib.sha1(",".join(map(str, example.input_ids)).encode()).hexdigest()[:16]
        return self.directory / f"{safe}-{tokens}.safetensors"

    def __call__(self, examples) -> tuple[torch.Tensor, torch.Tensor]:
        parts = [load_file(self._path(e)) for e in examples]
        L = max(p["features"].shape[0] for p in parts)

        def stack(key):
            out = torch.zeros(len(parts), L, parts[0][key].shape[-1])
            for i, p in enumerate(parts):
                out[i, : p[key].shape[0]] = p[key].float()
            return out

        return stack("features"), stack("last")

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

from .. import internals
from ..files import write_atomic
from ..generation.state import attention_masks
from ..model.configuration_dspark import unreadable_layers


def pad_batch(sequences: list[list[int]], pad_id: int = 0):
    """Right-pad token lists: ids (B, L), attention mask (B, L), lengths (B,), on the CPU (one copy to a device),
    built from the lists alone (no tensor is read back)."""
    longest = max(len(s) for s in sequences)
    ids = torch.tensor([list(s) + [pad_id] * (longest - len(s)) for s in sequences], dtype=torch.long, device="cpu")
    lengths = torch.tensor([len(s) for s in sequences], device="cpu")
    mask = (torch.arange(longest, device="cpu") < lengths[:, None]).long()
    return ids, mask, lengths


def to_device(tensor: torch.Tensor, device) -> torch.Tensor:
    """A host tensor of a batch on `device` without the host waiting: on a GPU copied from pinned memory,
    asynchronously (a pageable copy makes the host wait for it). The steps read nothing between logging steps, so the
    host prepares the next batch while the device still computes this one: that is how batches are ready ahead."""
    device = torch.device(device)
    if device.type == "cuda" and tensor.device.type == "cpu":
        tensor = tensor.pin_memory()
    return tensor.to(device, non_blocking=True)


def in_own_dtype(target):
    """A context in which `target` computes in its own dtype, whatever autocast the draft trains under: the teacher is
    the target as inference runs it (a float32 target stays float32 under bf16 mixed precision)."""
    return torch.autocast(target.device.type, enabled=False)


def causal_padding_mask(target, lengths: list[int], device):
    """The attention mask of right-padded sequences of `lengths` for `target`'s forward: None when no row is padded
    (the model's causal mask is the right one), else each token reading the real ones up to it
    (`generation.state.attention_masks`), built from the host's lengths. Given the 2D mask, transformers reads its
    values to decide whether it may skip it: a wait for the device in every training step."""
    L = max(lengths)
    if min(lengths) == L:
        return None
    real = torch.arange(L, device="cpu") < torch.tensor(lengths, device="cpu")[:, None]  # (B, L)
    slots = torch.arange(L, device=device).expand(len(lengths), -1)
    return attention_masks(target, to_device(real, device), slots, internals.sliding_window(target))


class OnlineFeatures:
    """Runs the frozen target on each batch (no gradients), in its own dtype."""

    def __init__(self, target, target_layer_ids: list[int]):
        self.target = target
        self.request = [i + 1 for i in target_layer_ids] + [target.config.get_text_config().num_hidden_layers]

    @torch.no_grad()
    def __call__(self, examples) -> tuple[torch.Tensor, torch.Tensor]:
        ids, _, _ = pad_batch([e.input_ids for e in examples])
        device = self.target.device
        mask = causal_padding_mask(self.target, [len(e.input_ids) for e in examples], device)
        with in_own_dtype(self.target):
            hidden = self.target.base_model(input_ids=to_device(ids, device), attention_mask=mask,
                                            output_hidden_states=self.request).hidden_states
        features = torch.cat([hidden[i] for i in self.request[:-1]], dim=-1)
        return features, hidden[self.request[-1]]


@torch.no_grad()
def feature_probe(target, tokens: int = 16) -> list[float]:
    """Eight numbers of the target's last hidden state on fixed tokens: weights that differ give other numbers,
    where a name or a dtype may not."""
    vocab = target.get_output_embeddings().weight.shape[0]
    ids = (torch.arange(tokens, device=target.device) * 7919 % vocab)[None]
    last = target.base_model(input_ids=ids).last_hidden_state[0].float().cpu()  # (tokens, d)
    direction = torch.randn(last.shape[1], 8, generator=torch.Generator().manual_seed(0))
    return [round(x, 4) for x in (last.mean(0) @ direction).tolist()]


def check_layer_ids(target, layer_ids: list[int]) -> None:
    """Raise a ValueError unless every id names a layer of `target` that a draft can read features from: 0 to the
    second-to-last (HF returns the last one after the final norm), as DSparkConfig requires."""
    n = target.config.get_text_config().num_hidden_layers
    bad = unreadable_layers(layer_ids, n)
    if bad:
        raise ValueError(f"target layer ids {bad} are out of range for a target with {n} layers: use ids in "
                         f"[0, {n - 2}].")


def _refuse_what_fp16_cannot_hold(features: torch.Tensor, last: torch.Tensor, layer_ids: list[int],
                                   example_id: str) -> None:
    """Refuse features that are not finite, or that fp16 cannot hold (hidden states past its 65504, as some LLMs'
    massive activations are): cached as inf, they would make every loss that reads them NaN."""
    d = last.shape[-1]
    for name, values in (*((f"layer {layer}", features[:, k * d: (k + 1) * d]) for k, layer in enumerate(layer_ids)),
                         ("last hidden state", last)):
        largest = values.float().abs().max().item()
        if not largest <= torch.finfo(torch.float16).max:
            raise ValueError(f"The target's {name} reaches {largest:g} on example {example_id}, which the feature "
                             "cache's fp16 cannot hold: train without --feature-cache (features computed online, in "
                             "the target's dtype).")


class CachedFeatures:
    """Features written once to `directory` (fp16 safetensors per example), then read back every epoch.

    A cache holds the layers it was first built with (`cache_layer_ids`, default `target_layer_ids`) and serves any
    subset of them, so drafts reading different target layers can share one target pass.
    """

    def __init__(self, directory: str | Path, target, target_layer_ids: list[int], examples, progress=True,
                 cache_layer_ids: list[int] | None = None, shard: tuple[int, int] = (0, 1)):
        from tqdm.auto import tqdm

        check_layer_ids(target, [*target_layer_ids, *(cache_layer_ids or [])])  # before anything is written
        self.directory = Path(directory)
        if self.directory.exists() and not self.directory.is_dir():
            raise ValueError(f"feature_cache (--feature-cache) {directory} is a file: give a folder for the cache "
                             "(made if missing).")
        self.directory.mkdir(parents=True, exist_ok=True)
        index = self.directory / "index.json"
        meta = {"target": getattr(target.config, "_name_or_path", ""), "dtype": str(target.dtype),
                "target_layer_ids": list(cache_layer_ids or target_layer_ids)}
        probe = feature_probe(target)
        if index.exists():
            found = json.loads(index.read_text())
            same = {k: v for k, v in found.items() if k not in ("target_layer_ids", "probe")} == {
                k: v for k, v in meta.items() if k != "target_layer_ids"}
            # the probe tells other weights under the same name apart (a cache from before it had none)
            same_weights = "probe" not in found or torch.allclose(torch.tensor(found["probe"]), torch.tensor(probe),
                                                                  rtol=1e-3, atol=1e-3)
            if not (same and same_weights) or not set(target_layer_ids) <= set(found["target_layer_ids"]):
                raise ValueError(f"The feature cache in {self.directory} was built for layers "
                                 f"{found['target_layer_ids']} of {found['target']} in {found['dtype']}"
                                 f"{'' if same_weights else ' with other weights'}, not for layers "
                                 f"{list(target_layer_ids)} of {meta['target']} in {meta['dtype']}: remove it or "
                                 "choose another --feature-cache directory.")
            meta = {k: v for k, v in found.items() if k != "probe"}
        if shard[0] == 0:  # one process writes the index, whole (the others may be reading it)
            write_atomic(index, json.dumps({**meta, "probe": probe}))
        d = target.config.get_text_config().hidden_size
        cached = meta["target_layer_ids"]
        self.columns = torch.cat([torch.arange(cached.index(i) * d, (cached.index(i) + 1) * d, device="cpu")
                                  for i in target_layer_ids])
        online = OnlineFeatures(target, cached)
        # each of several processes computes its share (`shard`: its index, how many), and reads all once every
        # process has written its own (the caller waits for them). The shares are cut from the examples before
        # looking at what exists: cut from what is missing, they would change as another process writes, and an
        # example could fall in nobody's share
        missing = [e for e in examples[shard[0]::shard[1]] if not self._path(e).exists()]
        for i in tqdm(range(0, len(missing), 8), desc="caching target features", disable=not progress):
            chunk = missing[i: i + 8]
            features, last = online(chunk)
            for j, e in enumerate(chunk):
                n = len(e.input_ids)
                _refuse_what_fp16_cannot_hold(features[j, :n], last[j, :n], cached, e.id)
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

        def stack(key, columns=None):
            rows = [p[key] if columns is None else p[key][:, columns] for p in parts]
            out = torch.zeros(len(rows), L, rows[0].shape[-1], device="cpu")
            for i, x in enumerate(rows):
                out[i, : x.shape[0]] = x.float()
            return out

        return stack("features", self.columns), stack("last")

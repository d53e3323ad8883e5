"""Devices: choosing one, and every tensor the decoding loop and the training step make following the models.

No GPU runs these tests, so placement is checked with torch's default device set to "meta": a tensor created
without naming its device lands on "meta", and the first operation that meets one of the models' CPU tensors
raises. On a GPU the same code would have mixed a CPU tensor into CUDA work (an error, or a silent copy per step).
"""

from contextlib import contextmanager

import pytest
import torch

from conftest import left_padded_prompts, tiny_draft, tiny_target
from dspark_hf import AsyncScheduled, FixedLength, FullBlock, Scheduled, ThresholdPolicy
from dspark_hf.defaults import default_draft
from dspark_hf.devices import resolve_device
from dspark_hf.training.data import load_dataset
from dspark_hf.training.features import CachedFeatures, OnlineFeatures
from dspark_hf.training.losses import LossWeights
from dspark_hf.training.heldout import evaluate_heldout
from dspark_hf.training.objective import train_step
from test_training import tiny_dataset


@contextmanager
def unplaced_tensors_fail():
    torch.set_default_device("meta")
    try:
        yield
    finally:
        torch.set_default_device(None)


def test_auto_takes_the_gpu_only_when_there_is_one():
    assert resolve_device("auto").type == ("cuda" if torch.cuda.is_available() else "cpu")
    assert resolve_device(None) == resolve_device("auto") and resolve_device("cpu") == torch.device("cpu")


def test_devices_torch_cannot_use_are_refused_with_what_to_pass_instead():
    with pytest.raises(ValueError, match="'gpu0' is not a device: use 'auto', 'cpu', 'cuda' or 'cuda:N'"):
        resolve_device("gpu0")
    for other in ("mps", "meta", "xpu"):  # torch devices, but none that dspark-hf is built and tested for
        with pytest.raises(ValueError, match=f"'{other}' is not supported: use 'auto', 'cpu', 'cuda' or 'cuda:N'"):
            resolve_device(other)
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="torch sees no CUDA GPU here.*use 'cpu', or 'auto'"):
            resolve_device("cuda")


def test_default_draft_refuses_a_device_other_than_its_targets(monkeypatch):
    import dspark_hf.defaults

    target = tiny_target("llama")  # on the CPU; a machine with a second device is not needed to ask for one
    monkeypatch.setattr(dspark_hf.defaults, "resolve_device", lambda device: torch.device("cuda", 1))
    with pytest.raises(ValueError, match="a draft runs on its target's device"):
        default_draft(target, device="cuda:1")


POLICIES = {
    "default": lambda: None,
    "full block": FullBlock,
    "fixed": lambda: FixedLength(2),
    "threshold": lambda: ThresholdPolicy(0.5),
    "scheduled": lambda: Scheduled([0.0] + [100.0 / (1 + 0.1 * b) for b in range(1, 64)],
                                   draft_seconds=lambda r: 0.001),
    "async": lambda: AsyncScheduled([0.0] + [100.0 / (1 + 0.1 * b) for b in range(1, 64)]),
}


@pytest.mark.parametrize("policy", list(POLICIES))
@pytest.mark.parametrize("do_sample", [False, True])
def test_the_decoding_loop_makes_every_tensor_on_the_models_device(policy, do_sample):
    target = tiny_target("qwen3")
    draft = tiny_draft(target, draft_vocab=torch.arange(40))
    ids, mask = left_padded_prompts(3)
    with unplaced_tensors_fail():
        out = target.generate(input_ids=ids, attention_mask=mask, max_new_tokens=10, do_sample=do_sample,
                              assistant_model=draft, verification_policy=POLICIES[policy](),
                              return_dict_in_generate=True)
    assert out.sequences.device.type == "cpu" and out.sequences.shape[1] == ids.shape[1] + 10


@pytest.mark.parametrize("cached", [False, True])
def test_the_training_step_and_the_heldout_report_make_every_tensor_on_the_models_device(tmp_path, cached):
    target = tiny_target("llama")
    draft = tiny_draft(target, draft_vocab=torch.arange(40))
    examples = load_dataset(tiny_dataset(tmp_path, target, n=8))
    layers = draft.config.target_layer_ids
    features = (CachedFeatures(tmp_path / "cache", target, layers, examples, progress=False) if cached
                else OnlineFeatures(target, layers))
    with unplaced_tensors_fail():
        losses, _ = train_step(draft, target, examples[:4], features, 8, LossWeights(kl=1.0),
                               torch.Generator().manual_seed(0))
        losses["total"].backward()
        report = evaluate_heldout(draft, target, examples, features, 8, LossWeights())
    assert losses["total"].device.type == "cpu" and 1 <= report["expected_greedy_tau"] <= 1 + draft.config.block_size

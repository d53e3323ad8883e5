"""PEFT: LoRA domain adaptation of a trained draft, adapters saved and loaded with peft's own API, and peft-wrapped
drafts and targets inside generate(), lossless."""

import copy
import json
from types import SimpleNamespace

import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model

from conftest import cut_in_half, left_padded_prompts, tiny_draft, tiny_target
from dspark_hf import DSparkDraftModel, FullBlock, dspark_generate
from dspark_hf.evaluation import OracleDraft
from dspark_hf.training import load_dataset
from dspark_hf.training.features import OnlineFeatures
from dspark_hf.training.losses import LossWeights
from dspark_hf.training.config import TrainConfig
from dspark_hf.training.objective import train_step
from dspark_hf.training.trainer import train
from dspark_hf.generation.block_sources import sample_block
from test_training import tiny_dataset


@pytest.fixture(scope="module")
def target():
    return tiny_target("llama")


@pytest.fixture
def base_dir(tmp_path, target):
    """A saved draft for `target`: the base that LoRA adapts."""
    path = tmp_path / "base"
    tiny_draft(target).save_pretrained(path)
    return path


def lora_config(tmp_path, data, base_dir, heads="confidence", **kw):
    fields = dict(dataset=str(data), output_dir=str(tmp_path / "lora"), epochs=1, batch_size=8,
                  anchors_per_sequence=8, learning_rate=1e-2, heldout_fraction=0.0, save_every=100,
                  init_from=str(base_dir), lora=True, lora_rank=4, lora_alpha=8, lora_heads=heads)
    fields.update(kw)
    return TrainConfig(**fields)


def loss_of(draft, target, examples) -> float:
    """Total training loss of a fixed batch with fixed anchors."""
    with torch.no_grad():
        losses, _ = train_step(draft, target, examples, OnlineFeatures(target, draft.config.target_layer_ids), 8,
                               LossWeights(), torch.Generator().manual_seed(0))
    return float(losses["total"])


def context_and_anchors(draft, target):
    """A batch's draft context and anchors, as generate() would build them after a prompt."""
    ids, mask = left_padded_prompts(3)
    positions = (mask.cumsum(1) - 1).clamp_min(0)
    with torch.no_grad():
        hidden = target(input_ids=ids[:, :-1], attention_mask=mask[:, :-1], position_ids=positions[:, :-1],
                        output_hidden_states=draft.hidden_states_request).hidden_states
        context = draft.encode_context(draft.target_features(hidden), positions[:, :-1], mask[:, :-1].bool())
    return context, ids[:, -1], positions[:, -1]


def generate(target, ids, mask, **kw):
    return target.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=16, **kw)


# -- training ------------------------------------------------------------------------------------------------------
EXPECTED_TRAINABLE = {"none": set(), "confidence": {"confidence"}, "all": {"w1", "w2", "confidence"}}


@pytest.mark.parametrize("heads", ["none", "confidence", "all"])
def test_lora_training_lowers_the_loss_and_changes_only_adapters_and_chosen_heads(tmp_path, target, base_dir, heads):
    data = tiny_dataset(tmp_path, target, n=16)
    examples = load_dataset(data)
    base = DSparkDraftModel.from_pretrained(base_dir).bind_target(target)
    before = {k: v.clone() for k, v in base.state_dict().items()}

    trained = train(lora_config(tmp_path, data, base_dir, heads), target=target, progress=False)  # 2 steps
    assert isinstance(trained, PeftModel)
    assert loss_of(trained.get_base_model(), target, examples) < loss_of(base, target, examples)

    params = dict(trained.named_parameters())
    trainable = {n for n, p in params.items() if p.requires_grad}
    adapters = {n for n in trainable if ".lora_" in n}
    assert len(adapters) == 2 * 7 * base.config.num_hidden_layers, "an (A, B) pair on every attention/MLP linear"
    assert {base_key(n).split(".")[0] for n in trainable - adapters} == EXPECTED_TRAINABLE[heads]
    for name, p in params.items():
        if name not in trainable:
            assert torch.equal(p, before[base_key(name)]), f"base weight {name} changed"
        elif ".lora_B." in name:
            assert p.abs().sum() > 0, f"{name} is still at its zero initialisation"
        elif name not in adapters:
            assert not torch.equal(p, before[base_key(name)]), f"trained head {name} did not move"


def base_key(peft_name: str) -> str:
    """The base draft's state-dict key of a weight inside the peft wrapper (frozen original or trained copy)."""
    key = peft_name.removeprefix("base_model.model.")
    for wrapper in (".base_layer", ".original_module", ".modules_to_save.default"):
        key = key.replace(wrapper, "")
    return key


def test_lora_training_resumes_from_its_adapter_checkpoint(tmp_path, target, base_dir):
    data = tiny_dataset(tmp_path, target, n=8)
    train(lora_config(tmp_path, data, base_dir, epochs=2, save_every=1), target=target, progress=False)
    checkpoint = tmp_path / "lora" / "checkpoint-2"
    assert (checkpoint / "adapter_model.safetensors").exists() and (checkpoint / "trainer_state.pt").exists()
    resumed = train(lora_config(tmp_path, data, base_dir, epochs=3, save_every=1), target=target, progress=False)
    assert (tmp_path / "lora" / "checkpoint-3").exists() and isinstance(resumed, PeftModel)


def test_a_seed_gives_the_same_lora_run(tmp_path, target, base_dir):
    data = tiny_dataset(tmp_path, target, n=8)
    torch.manual_seed(1)  # whatever the global generator holds, the run's seed decides
    first = train(lora_config(tmp_path, data, base_dir, output_dir=str(tmp_path / "a")), target=target, progress=False)
    torch.manual_seed(2)
    second = train(lora_config(tmp_path, data, base_dir, output_dir=str(tmp_path / "b")), target=target, progress=False)
    for (name, a), b in zip(first.state_dict().items(), second.state_dict().values()):
        assert torch.equal(a, b), name


def test_lora_needs_a_base_draft_for_a_target_of_its_own(tmp_path, target, base_dir):
    data = tiny_dataset(tmp_path, target, n=4)
    with pytest.raises(ValueError, match="init_from"):
        train(lora_config(tmp_path, data, base_dir, init_from=None), target=target, progress=False)
    with pytest.raises(ValueError, match="lora_heads"):
        train(lora_config(tmp_path, data, base_dir, heads="markov"), target=target, progress=False)


# -- saving and loading ----------------------------------------------------------------------------------------------
def test_an_adapter_that_names_no_base_draft_says_how_to_load_it(tmp_path, target):
    from dspark_hf import load_draft

    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
    get_peft_model(tiny_draft(target), lora).save_pretrained(tmp_path)  # a draft never saved: no base path
    with pytest.raises(ValueError, match=r"does not name its base draft.*PeftModel.from_pretrained\(draft"):
        load_draft(str(tmp_path), target, torch.float32)


def test_an_adapter_whose_weights_are_cut_short_is_refused_as_damaged(tmp_path, target, base_dir):
    from dspark_hf import load_draft

    base = DSparkDraftModel.from_pretrained(base_dir)
    get_peft_model(base, LoraConfig(r=2, target_modules=["q_proj"])).save_pretrained(tmp_path / "adapter")
    cut_in_half(tmp_path / "adapter" / "adapter_model.safetensors")
    with pytest.raises(OSError, match=r"adapter are damaged or cut short.*download them again"):
        load_draft(str(tmp_path / "adapter"), target, torch.float32)


def test_the_saved_adapter_loads_onto_its_base_with_peft_and_drafts_the_same_blocks(tmp_path, target, base_dir):
    data = tiny_dataset(tmp_path, target, n=8)
    trained = train(lora_config(tmp_path, data, base_dir, heads="all"), target=target, progress=False)
    out = tmp_path / "lora"
    assert (out / "adapter_model.safetensors").exists() and not (out / "model.safetensors").exists()
    adapter_config = json.loads((out / "adapter_config.json").read_text())
    assert adapter_config["base_model_name_or_path"] == str(base_dir)

    loaded = PeftModel.from_pretrained(DSparkDraftModel.from_pretrained(adapter_config["base_model_name_or_path"]),
                                       out).eval()
    loaded.bind_target(target)  # reaches the draft through peft's attribute forwarding
    base = DSparkDraftModel.from_pretrained(base_dir).bind_target(target).eval()
    context, anchors, positions = context_and_anchors(base, target)
    blocks = [sample_block(m, anchors, positions, context) for m in (trained.eval(), loaded, base)]
    torch.testing.assert_close(blocks[1].probs, blocks[0].probs)
    torch.testing.assert_close(blocks[1].confidences, blocks[0].confidences)
    assert torch.equal(blocks[1].tokens, blocks[0].tokens)
    assert not torch.allclose(blocks[1].probs, blocks[2].probs), "the adapter must change the draft"


def test_the_cli_trains_an_adapter_and_loads_it_merged_as_a_draft(tmp_path, target, base_dir, monkeypatch):
    from argparse import Namespace

    from dspark_hf.cli import _load, main

    tokenizer = SimpleNamespace(pad_token="<pad>")  # tiny target: none of its own; load_target reads pad_token
    monkeypatch.setattr("transformers.AutoTokenizer.from_pretrained", lambda *a, **k: tokenizer)
    target.save_pretrained(tmp_path / "target")
    data = tiny_dataset(tmp_path, target, n=8)
    out = tmp_path / "adapter"
    assert main(["train", "--lora", "--target", str(tmp_path / "target"), "--init-from", str(base_dir),
                 "--dataset", str(data), "--output-dir", str(out), "--epochs", "1", "--batch-size", "8",
                 "--heldout-fraction", "0", "--lora-rank", "2", "--lora-heads", "confidence"]) == 0
    adapter_config = json.loads((out / "adapter_config.json").read_text())
    assert adapter_config["r"] == 2 and adapter_config["modules_to_save"] == ["confidence"]

    loaded_target, _, draft = _load(Namespace(target=str(tmp_path / "target"), draft=str(out), draft_dtype="float32"))
    assert type(draft) is DSparkDraftModel, "the CLI merges the adapter into its base draft"
    wrapped = PeftModel.from_pretrained(DSparkDraftModel.from_pretrained(base_dir), out).eval()
    wrapped.bind_target(loaded_target)
    context, anchors, positions = context_and_anchors(draft, loaded_target)
    torch.testing.assert_close(sample_block(draft, anchors, positions, context).probs,
                               sample_block(wrapped, anchors, positions, context).probs)


def test_an_adapter_records_its_base_folder_absolute_and_loads_from_any_directory(tmp_path, target, base_dir,
                                                                                  monkeypatch):
    from dspark_hf import load_draft

    data = tiny_dataset(tmp_path, target, n=4)
    monkeypatch.chdir(tmp_path)
    train(lora_config(tmp_path, data, "base", output_dir="adapter"), target=target, progress=False)
    assert json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())["base_model_name_or_path"] \
        == str(base_dir)
    monkeypatch.chdir(tmp_path.parent)
    assert type(load_draft(str(tmp_path / "adapter"), target, torch.float32)) is DSparkDraftModel


def test_an_adapter_naming_its_base_relative_to_elsewhere_says_so_in_one_line(tmp_path, target, monkeypatch):
    from dspark_hf import load_draft
    from hub_stub import go_offline

    get_peft_model(tiny_draft(target), LoraConfig(r=2, target_modules=["q_proj"])).save_pretrained(tmp_path / "adapter")
    adapter_config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    adapter_config["base_model_name_or_path"] = "../lora-base"
    (tmp_path / "adapter" / "adapter_config.json").write_text(json.dumps(adapter_config))
    go_offline(monkeypatch)  # nothing is asked of the Hub
    monkeypatch.chdir(tmp_path.parent)
    with pytest.raises(ValueError, match=r"^The adapter's base draft \.\./lora-base \(base_model_name_or_path in "
                                         rf"{tmp_path / 'adapter'}/adapter_config.json\) is not a folder here, nor a "
                                         r"draft loadable from the Hub \(.*\): set it to the base draft's folder"):
        load_draft(str(tmp_path / "adapter"), target, torch.float32)
    # a relative base is also looked for from the adapter's folder
    tiny_draft(target).save_pretrained(tmp_path / "lora-base")
    assert type(load_draft(str(tmp_path / "adapter"), target, torch.float32)) is DSparkDraftModel


def test_an_adapter_on_the_hub_loads_merged_into_its_base(tmp_path, target, monkeypatch):
    import huggingface_hub.constants as constants
    import huggingface_hub.hf_api
    from huggingface_hub import HfApi

    from dspark_hf import load_draft
    from hub_stub import HubStub, use_hub

    with HubStub({"hf_alice": "alice"}) as hub:
        use_hub(monkeypatch, hub.url)
        # peft calls huggingface_hub's module-level file_exists, whose HfApi took its endpoint at import
        monkeypatch.setattr(huggingface_hub.hf_api.api, "endpoint", hub.url)
        monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "cache"))
        tiny_draft(target, target_name_or_path="org/tiny-target").push_to_hub("alice/base", token="hf_alice")
        torch.manual_seed(0)
        wrapped = get_peft_model(DSparkDraftModel.from_pretrained("alice/base"),  # the base peft records
                                 LoraConfig(r=2, target_modules=["q_proj"], init_lora_weights=False))
        wrapped.save_pretrained(tmp_path / "adapter")
        HfApi().create_repo("alice/adapter", token="hf_alice")
        HfApi().upload_folder(folder_path=tmp_path / "adapter", repo_id="alice/adapter", token="hf_alice")
        draft = load_draft("alice/adapter", target, torch.float32)
    assert type(draft) is DSparkDraftModel
    merged = copy.deepcopy(wrapped).merge_and_unload().state_dict()
    assert draft.state_dict().keys() == merged.keys()
    assert all(torch.equal(v, merged[k]) for k, v in draft.state_dict().items())


# -- generation --------------------------------------------------------------------------------------------------------
def lora_draft(target) -> PeftModel:
    """A draft wrapped with a random, non-zero LoRA adapter (peft's init_lora_weights=False)."""
    config = LoraConfig(r=4, lora_alpha=16, target_modules=["q_proj", "v_proj", "up_proj", "down_proj"],
                        init_lora_weights=False, modules_to_save=["w2"])
    torch.manual_seed(3)
    return get_peft_model(tiny_draft(target), config).eval()


def drafted(out) -> list:
    return [r.drafted for rows in out.rounds for r in rows]


def test_a_peft_wrapped_draft_generates_losslessly_with_its_adapter_active(target):
    ids, mask = left_padded_prompts(3)
    wrapped = lora_draft(target)
    out = generate(target, ids, mask, assistant_model=wrapped, return_dict_in_generate=True)
    assert torch.equal(out.sequences, generate(target, ids, mask))

    merged = generate(target, ids, mask, assistant_model=copy.deepcopy(wrapped).merge_and_unload(),
                      return_dict_in_generate=True)
    with wrapped.disable_adapter():
        base = generate(target, ids, mask, assistant_model=wrapped, return_dict_in_generate=True)
    assert drafted(out) == drafted(merged), "the wrapped draft proposes what its merged twin proposes"
    assert drafted(out) != drafted(base), "and something else than the draft without its adapter"

    # the custom_generate route takes the wrapper too
    custom = target.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=16,
                             custom_generate=dspark_generate, draft_model=wrapped)
    assert torch.equal(custom, out.sequences)


def test_prompt_learning_adapters_are_refused_for_a_draft(target):
    from peft import PromptTuningConfig

    wrapped = PeftModel(tiny_draft(target), PromptTuningConfig(num_virtual_tokens=2, token_dim=32,
                                                               num_transformer_submodules=1, num_attention_heads=4,
                                                               num_layers=2))
    ids, mask = left_padded_prompts(1)
    with pytest.raises(ValueError, match="prompt learning"):
        generate(target, ids, mask, assistant_model=wrapped)


@pytest.mark.parametrize("corruption", [0.0, 0.3])
def test_a_peft_wrapped_target_is_lossless_with_a_draft(corruption):
    config = LoraConfig(task_type="CAUSAL_LM", r=4, lora_alpha=16, target_modules=["q_proj", "v_proj", "down_proj"],
                        init_lora_weights=False)
    torch.manual_seed(5)
    peft_target = get_peft_model(tiny_target("llama"), config).eval()
    ids, mask = left_padded_prompts(4)
    reference = generate(peft_target, ids, mask)
    with peft_target.disable_adapter():
        assert not torch.equal(generate(peft_target, ids, mask), reference), "the adapter must change the target"

    draft = tiny_draft(peft_target)  # from_target reads a peft-wrapped target too
    oracle = OracleDraft.from_draft(draft).set_references(peft_target, reference, mask, corruption=corruption)
    out = generate(peft_target, ids, mask, assistant_model=oracle, return_dict_in_generate=True,
                   verification_policy=FullBlock())
    assert torch.equal(out.sequences, reference)
    accepted = [r.accepted for rows in out.rounds for r in rows]
    assert max(accepted) == draft.config.block_size, "the oracle's blocks are accepted whole: same target"
    assert torch.equal(generate(peft_target, ids, mask, assistant_model=draft), reference)


def test_a_peft_adapter_folder_given_as_the_target_loads_as_transformers_loads_it(tmp_path, target):
    from dspark_hf.loading import load_target
    from conftest import tiny_tokenizer

    target.save_pretrained(tmp_path / "base")
    adapter = get_peft_model(copy.deepcopy(target), LoraConfig(r=2, target_modules=["q_proj", "v_proj"]))
    adapter.save_pretrained(tmp_path / "adapter")
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    config["base_model_name_or_path"] = str(tmp_path / "base")
    (tmp_path / "adapter" / "adapter_config.json").write_text(json.dumps(config))
    tiny_tokenizer().save_pretrained(tmp_path / "adapter")
    model, tokenizer = load_target(str(tmp_path / "adapter"))
    assert type(model).__name__ == type(target).__name__ and tokenizer.pad_token is not None
    assert any("lora" in name for name, _ in model.named_modules()), "the adapter is applied, as transformers does"

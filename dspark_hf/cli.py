"""The `dspark` command line (also `python -m dspark_hf`)."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch


def _load(args):
    from .defaults import default_draft, default_target

    if args.target:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        target = AutoModelForCausalLM.from_pretrained(args.target, dtype=torch.float32).eval()
        tokenizer = AutoTokenizer.from_pretrained(args.target, padding_side="left")
    else:
        target, tokenizer = default_target()
    if args.draft:
        from .model import DSparkDraftModel

        draft = DSparkDraftModel.from_pretrained(args.draft).to(target.device).bind_target(target).eval()
    else:
        draft = default_draft(target)
    return target, tokenizer, draft


def cmd_generate(args) -> int:
    """The main job: answer prompts with DSpark, check the output against plain generate(), report speed."""
    from .evaluation.bench_oracle import DEFAULT_PROMPTS, chat_inputs

    target, tokenizer, draft = _load(args)
    prompts = args.prompt or DEFAULT_PROMPTS[:3]
    inputs = chat_inputs(tokenizer, prompts)
    kw = dict(max_new_tokens=args.max_new_tokens, do_sample=args.temperature > 0)
    if args.temperature > 0:
        kw.update(temperature=args.temperature)
    target.generate(**inputs, max_new_tokens=4)  # warm-up

    start = time.perf_counter()
    out = target.generate(**inputs, **kw, assistant_model=draft, return_dict_in_generate=True)
    dspark_s = time.perf_counter() - start
    start = time.perf_counter()
    plain = target.generate(**inputs, **kw)
    plain_s = time.perf_counter() - start

    P = inputs["input_ids"].shape[1]
    for prompt, row in zip(prompts, out.sequences):
        print(f"\n>>> {prompt}\n{tokenizer.decode(row[P:], skip_special_tokens=True).strip()}")
    rounds = [r for rows in out.rounds for r in rows]
    tau = sum(r.tau for r in rounds) / max(len(rounds), 1)
    print("\n" + "-" * 72)
    if not kw["do_sample"]:
        same = torch.equal(out.sequences, plain)
        print(f"identical to plain generate(): {'yes' if same else 'NO'}")
    print(f"rounds: {len(rounds)}   mean acceptance length tau (bonus included): {tau:.2f}")
    print(f"time: DSpark {dspark_s:.2f} s, plain generate() {plain_s:.2f} s -> speedup {plain_s / dspark_s:.2f}x "
          f"(batch {len(prompts)}, {args.max_new_tokens} new tokens, one run each; `dspark bench` measures properly)")
    return 0 if kw["do_sample"] or same else 1


def cmd_bench_oracle(args) -> int:
    from tqdm.auto import tqdm

    from .evaluation.bench_oracle import bench_oracle, format_oracle_table
    from .evaluation.machine import describe

    target, tokenizer, draft = _load(args)
    with tqdm(total=len(args.batch_sizes) * args.repeats, desc="oracle bench") as bar:
        report = bench_oracle(target, tokenizer, draft, tuple(args.batch_sizes), args.max_new_tokens, args.repeats,
                              progress=bar)
    Path(args.output).write_text(json.dumps(report, indent=2))
    print(f"\n{describe(report['machine'])}; max_new_tokens={args.max_new_tokens}, median of {args.repeats}")
    print(format_oracle_table(report))
    print(f"\nwritten to {args.output}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dspark", description="DSpark speculative decoding for transformers.")
    sub = parser.add_subparsers(dest="command", required=True)

    def models(p):
        p.add_argument("--target", help="target model path or hub id (default: embedded SmolLM2-135M-Instruct)")
        p.add_argument("--draft", help="DSpark draft path or hub id (default: the draft shipped for the target)")

    p = sub.add_parser("generate", help="answer prompts with DSpark and compare with plain generate()")
    models(p)
    p.add_argument("--prompt", action="append", help="a user message (repeat for a batch)")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.set_defaults(func=cmd_generate)

    bench = sub.add_parser("bench", help="benchmarks").add_subparsers(dest="bench", required=True)
    p = bench.add_parser("oracle", help="plain vs DSpark with an oracle draft: the ceiling of our loop")
    models(p)
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8])
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--output", default="bench_oracle.json")
    p.set_defaults(func=cmd_bench_oracle)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())

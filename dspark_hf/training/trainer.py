"""Train a DSpark draft for a frozen target (paper sec. 3.3).

Runs plainly on CPU or under ``accelerate launch`` on one or many GPUs (data parallel); by default in bf16 where
the device has bf16 matrix units (a GPU; a CPU with AVX512-BF16 or AMX), else in fp32. The target, its embedding
and its LM head stay frozen; only the draft's backbone, sequential head and confidence head learn.
With ``lora=True`` a trained draft is adapted to a domain instead: its weights stay frozen and peft LoRA adapters on
the backbone's linear layers learn (plus, optionally, the heads in full); the run saves a peft adapter.
"""

from __future__ import annotations

import contextlib
import functools
import json
import math
import os
import random
import time
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..devices import GpuMonitor, clock, computes_bfloat16_natively, indexed, resolve_device
from ..files import write_atomic
from ..generation.request import unwrap_draft
from .checkpoints import (STATE_FILE, CheckpointWriter, checkpoint_folders, latest_checkpoint, save_checkpoint,
                          trainer_state)
from .config import RESUMABLE_CHANGES, TrainConfig
from .data import load_dataset, split_heldout
from .drafts import initial_draft
from .features import CachedFeatures, OnlineFeatures
from .heldout import evaluate_heldout
from .losses import LossWeights
from .objective import train_step
from .steplog import StepLog
from .throughput import Shapes, StepFlops, Throughput, bfloat16_hint, peak_flops



def train(config: TrainConfig, target=None, progress: bool = True, started: float | None = None):
    """Train (or resume) a draft as `config` says; returns the final draft, also saved to config.output_dir
    (with ``config.lora``: the peft ``PeftModel``, saved as an adapter), in eval mode. With ``config.stop_after``, an
    invocation that runs out of time saves a checkpoint to resume from and returns the unfinished draft, still in
    training mode (``.training`` is True). started: the time.perf_counter() reading at which the invocation began
    (`dspark train` passes its own start, so that loading the target counts in the time budget); default: now.
    Where the time went (setup, steps, held-out report, saves; steps as a share of the budget) is printed at the end
    and recorded in heldout.json under training.time, with the GPU's utilisation and peak memory.

    Resuming (config.output_dir holds train_config.json and a checkpoint) needs the settings the run was started
    with; only those of RESUMABLE_CHANGES may differ. Raises ValueError naming the others that do."""
    timer = RunClock(config, started)
    out_dir = Path(config.output_dir)
    _refuse_a_changed_run(config, out_dir)  # before anything is loaded or written
    if config.init_from:
        from ..loading import _check_name

        _check_name(config.init_from, "init_from (--init-from)")
    accelerator, device = _accelerator(config)
    fewer = fewer_processes_than_asked(os.environ, accelerator.num_processes)
    if fewer:
        warnings.warn(f"training on {accelerator.num_processes} process(es): {fewer}. To start N processes, run "
                      "`torchrun --nproc_per_node N -m dspark_hf train ...` (docs/training.md, \"Several processes\").",
                      stacklevel=2)
    monitor = GpuMonitor(device)
    default_target_used = target is None
    target = _frozen_target(target, config, device)
    made_for = _target_record(target)
    _refuse_another_target(made_for, out_dir)
    train_set, heldout = _examples(config, target)

    found = latest_checkpoint(out_dir)
    resume, state = found if found is not None else (None, None)
    _refuse_other_processes(state, accelerator, out_dir)
    draft = initial_draft(config, target, resume, default_target_used, train_set)
    drafted = unwrap_draft(draft).config
    _refuse_a_block_past_every_answer(drafted.block_size, train_set, config)
    drafted.trained_block_size = drafted.block_size  # saved with each checkpoint
    out_dir.mkdir(parents=True, exist_ok=True)
    write_atomic(out_dir / CONFIG_FILE, json.dumps({**asdict(config), **made_for}, indent=2))
    draft.to(device).train()
    features = _features(config, target, draft, train_set + heldout, progress and accelerator.is_main_process,
                         accelerator)
    weights = LossWeights(config.loss_ce, config.loss_l1, config.loss_confidence, config.position_decay,
                          config.loss_kl)
    config.batch_size = _batch_size(config, state, draft, target, train_set, features, weights, accelerator)
    draft, optimizer = accelerator.prepare(draft, _optimizer(draft, config, device))
    run = _Run(config, accelerator, device, timer, monitor, target, train_set, heldout, draft, optimizer, features,
               weights, compiled(draft, config.compile))
    first_step, generator_state = _resume(run, resume, state)
    _say_the_batches(run)

    step, generator = _take_steps(run, first_step, generator_state, progress)
    draft = _finish(run, first_step, step, generator)
    # Leave the process group before the interpreter exits: gloo's worker threads outliving it abort the process
    # (SIGABRT, "terminate called without an active exception") after a run that went well.
    accelerator.wait_for_everyone()
    accelerator.end_training()
    return draft


# -- setting a run up ------------------------------------------------------------------------------------------------
def _accelerator(config: TrainConfig):
    """The Accelerator the run computes under and its device, set up for it: the GPU config.device names made the
    current one, TF32 matmuls, and config.gpu_memory_fraction."""
    from accelerate import Accelerator

    device = resolve_device(config.device)
    if device.type == "cuda" and device.index is not None:
        torch.cuda.set_device(device)  # accelerate places a single process on the current GPU
    accelerator = Accelerator(mixed_precision=_mixed_precision(config.mixed_precision, device),
                              cpu=device.type == "cpu")
    device = indexed(accelerator.device)  # accelerate names a single GPU "cuda"; the memory fraction needs its index
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True  # fp32 matmuls outside autocast (the target in float32)
        if config.gpu_memory_fraction is not None:
            torch.cuda.set_per_process_memory_fraction(config.gpu_memory_fraction, device)
    return accelerator, device


def compiled(draft, backend: str):
    """The forward the steps call: the prepared `draft` itself (backend "no"), or torch.compile'd with `backend`,
    which compiles its backward too (AOTAutograd). Every dimension is dynamic: a step's batch length follows its
    answers, and one graph serves all of them, compiled in the first step; static shapes would compile a graph per
    length (or per bucket of lengths) through the run, up to dynamo's limit of 8, past which it runs eagerly."""
    return draft if backend == "no" else torch.compile(draft, backend=backend, dynamic=True)


def fewer_processes_than_asked(environ, processes: int) -> str | None:
    """Why this launch runs fewer processes than it asked for (None: it runs what it asked). `accelerate launch
    --num_processes N --cpu` starts one process where no MPI host file is given (it sets only the rendezvous address);
    a launcher that set WORLD_SIZE above the processes that joined formed no group."""
    asked = int(environ.get("WORLD_SIZE", "0") or 0)
    if asked > processes:
        return f"the launcher set WORLD_SIZE={asked}, but {processes} process(es) joined the group"
    if processes == 1 and "WORLD_SIZE" not in environ and "MASTER_ADDR" in environ \
            and environ.get("ACCELERATE_USE_CPU", "").lower() in ("true", "1"):
        return "`accelerate launch --num_processes N --cpu` starts one process on a CPU without an MPI host file"
    return None


def _frozen_target(target, config: TrainConfig, device: torch.device):
    """`target` (None: the embedded SmolLM2-135M-Instruct) on the run's device in config.target_dtype, frozen."""
    dtype = _target_dtype(config.target_dtype, device)
    if target is None:
        from ..defaults import default_target

        target, _ = default_target(dtype=dtype, device=device)
    target = target.to(device=device, dtype=dtype)
    target.requires_grad_(False).eval()
    return target


def _examples(config: TrainConfig, target) -> tuple[list, list]:
    """The dataset's training and held-out examples, cut to config.max_length; training keeps those with an answer
    of two tokens or more (an anchor and a token after it)."""
    vocab_size = target.get_output_embeddings().weight.shape[0]
    train_set, heldout = split_heldout(load_dataset(config.dataset, vocab_size), config.heldout_fraction)
    for ex in train_set + heldout:
        ex.input_ids = ex.input_ids[: config.max_length]
    train_set = [e for e in train_set if e.answer_start < len(e.input_ids) - 1]
    if not train_set:
        raise ValueError(f"{config.dataset}: no training example has an answer of two tokens or more after the "
                         f"held-out split (heldout_fraction={config.heldout_fraction}, "
                         f"max_length={config.max_length}).")
    return train_set, heldout


def _features(config: TrainConfig, target, draft, examples: list, show_progress: bool, accelerator):
    """Where the steps get the target's features: an on-disk cache of every example's (config.feature_cache; each of
    several processes writes its share, and all read it once every share is written), else the target itself, step
    by step."""
    layer_ids = unwrap_draft(draft).config.target_layer_ids
    if config.feature_cache:
        cache = CachedFeatures(config.feature_cache, target, layer_ids, examples, progress=show_progress,
                               shard=(accelerator.process_index, accelerator.num_processes))
        accelerator.wait_for_everyone()
        return cache
    return OnlineFeatures(target, layer_ids)


def _batch_size(config: TrainConfig, state: dict | None, draft, target, train_set, features, weights,
                accelerator) -> int:
    """The batch the run steps with: a resumed run's the one it started with, found or given (the steps and their
    data depend on it, whatever memory a resume sees); else, with auto_find_batch_size, the largest that fits."""
    if state is not None and "batch_size" in state:
        return state["batch_size"]
    if config.auto_find_batch_size:
        return _smallest_of_all(accelerator, find_batch_size(draft, target, train_set, features, config, weights,
                                                             accelerator))
    return config.batch_size


def _smallest_of_all(accelerator, size: int) -> int:
    """The smallest batch size any process found: all step with one batch size (the data shards and the steps an
    epoch depend on it), and the smallest fits on every device."""
    if accelerator.num_processes == 1:
        return size
    found = accelerator.gather(torch.tensor([size], device=accelerator.device)).tolist()
    if accelerator.is_main_process and len(set(found)) > 1:
        print(f"batch size: {min(found)} on every process (the processes found {found})")
    return min(found)


def _refuse_other_processes(state: dict | None, accelerator, out_dir: Path) -> None:
    """A run resumes on as many processes as it was trained on: the data's shards, the steps an epoch takes and the
    global batch all depend on it. (Checkpoints that do not say were saved by one process.)"""
    if state is None:
        return
    before, now = state.get("processes", 1), accelerator.num_processes
    if before != now:
        raise ValueError(f"{out_dir} was trained on {before} process(es) and this run has {now}: resume it on {before} "
                         f"(torchrun --nproc_per_node {before} -m dspark_hf train ...), or give a new output_dir.")


def _say_the_batches(run: _Run) -> None:
    """The batches a step learns from, and what an epoch repeats to even the processes' shares, said once."""
    c, processes = run.config, run.accelerator.num_processes
    if not run.accelerator.is_main_process or (processes == 1 and c.gradient_accumulation_steps == 1):
        return
    accumulated = f" x {c.gradient_accumulation_steps} accumulated" if c.gradient_accumulation_steps > 1 else ""
    print(f"batches: {c.batch_size} sequences a pass{accumulated} on each of {processes} process(es) = a global "
          f"batch of {run.global_batch} a step; an epoch is {run.steps_per_epoch} steps over {len(run.train_set)} "
          f"examples, {run.repeated_per_epoch} of them taken twice so that every process takes as many steps")


def _optimizer(draft, config: TrainConfig, device: torch.device) -> torch.optim.Optimizer:
    """AdamW over the weights the draft trains (with LoRA: the adapters, and the heads trained in full)."""
    params = [p for p in draft.parameters() if p.requires_grad]
    return torch.optim.AdamW(params, lr=config.learning_rate, weight_decay=config.weight_decay,
                             # fused, on a GPU or a CPU: one kernel a step, its step count kept on the device (the
                             # unfused loop reads it on the host, once per weight)
                             fused=device.type in ("cuda", "cpu") or None)


@dataclass
class _Run:
    """A run set up to take its steps: what the steps and the end of the run share. `draft` is the draft as accelerate
    prepared it, what trains and is saved; `target` is frozen."""

    config: TrainConfig
    accelerator: Any
    device: torch.device
    timer: RunClock
    monitor: GpuMonitor
    target: Any
    train_set: list
    heldout: list
    draft: Any
    optimizer: torch.optim.Optimizer
    features: Any
    weights: LossWeights
    forward: Any  # what a step calls: `draft`, or with config.compile its compiled forward (`compiled`)
    throughput: Throughput = field(default_factory=Throughput)

    @functools.cached_property
    def flops(self) -> StepFlops:
        return StepFlops(self.target, unwrap_draft(self.accelerator.unwrap_model(self.draft)))

    @property
    def out_dir(self) -> Path:
        return Path(self.config.output_dir)

    @property
    def per_step(self) -> int:
        """Sequences each process learns from in a step: its batches that accumulate."""
        return self.config.batch_size * self.config.gradient_accumulation_steps

    @property
    def global_batch(self) -> int:
        return self.per_step * self.accelerator.num_processes

    @property
    def steps_per_epoch(self) -> int:
        return math.ceil(len(self.train_set) / self.global_batch)

    @property
    def repeated_per_epoch(self) -> int:
        """Examples an epoch takes twice so that every process takes as many steps (`_epoch_shard`)."""
        return max(0, self.accelerator.num_processes * ((self.steps_per_epoch - 1) * self.per_step + 1)
                   - len(self.train_set))

    @property
    def total_steps(self) -> int | None:
        """Steps the run takes: max_steps, else its epochs'; None under a time budget, which ends it instead."""
        c = self.config
        return None if c.time_budget else c.max_steps or max(1, int(c.epochs * self.steps_per_epoch))

    @property
    def baseline(self) -> str | None:
        """The draft a fine-tuning run started from, measured beside it on the same held-out batches: the run says
        whether it gained."""
        return self.config.init_from if self.config.init_from and not self.config.lora else None

    @functools.cached_property
    def heldout_batches(self) -> list[list]:
        return _domain_batches(self.heldout, self.config.batch_size)


def _resume(run: _Run, resume: Path | None, state: dict | None) -> tuple[int, dict | None]:
    """The step the run goes on from (0 when it starts) and the state of its random generator, with the optimizer
    and the clock of the checkpoint `resume` restored (`state`: its training state)."""
    if state is None:
        return 0, None
    run.optimizer.load_state_dict(state["optimizer"])
    run.timer.restore(state.get("clock", {}))
    if run.accelerator.is_main_process:
        print(f"resuming {run.out_dir} from {resume.name} at step {state['step']}"
              f"{'' if run.total_steps is None else f' of {run.total_steps}'}")
    return state["step"], state.get("generator")  # absent in checkpoints of older runs: the epoch reseeds


# -- the steps -------------------------------------------------------------------------------------------------------
def _take_steps(run: _Run, step: int, generator_state: dict | None, progress: bool) -> tuple[int, torch.Generator]:
    """Steps from `step` until the run's steps or its time budget are spent or this invocation must stop, with a
    checkpoint every config.save_every steps (written once this returns); returns the step reached and the
    generator the anchors are drawn with, which a checkpoint saves."""
    config, timer = run.config, run.timer
    model = run.accelerator.unwrap_model(run.draft)  # what is saved: the draft, or its peft wrapper (an adapter)
    core = unwrap_draft(model)  # the DSparkDraftModel; with LoRA its layers hold the adapters
    timer.start_loop(heldout_batches=len(run.heldout_batches), reports=2 if run.baseline else 1)
    writer = CheckpointWriter()
    bar = _progress_bar(run, step, progress)
    log, stopped, first = StepLog(config.log_every), False, step
    while not stopped:
        epoch, offset = divmod(step, run.steps_per_epoch)
        shard = _epoch_shard(run, epoch)
        generator = torch.Generator().manual_seed(config.seed * 100_003 + step)
        if generator_state is not None and offset > 0:  # resumed inside an epoch: draw on where the run stopped
            generator.set_state(generator_state)
        generator_state = None
        for i in range(offset, run.steps_per_epoch):
            batch = [run.train_set[j] for j in shard[i * run.per_step: (i + 1) * run.per_step]]
            done = step >= run.total_steps if run.total_steps is not None else timer.budget_spent()
            # whether to step and at what learning rate: rank 0's clock decides for every rank, or a rank that stopped
            # first would leave the others waiting in the gradient all-reduce, and replicas would drift apart
            stop, *span = _decided_by_rank_0(run, done or timer.must_stop(), *_lr_span(run, step))
            if stop:
                stopped = True
                break
            # the host reads the device only at the steps that end with a read of the log (the first of this call,
            # every log_every-th, and each one a checkpoint follows): the others queue their work and go on
            saving = (step + 1) % config.save_every == 0
            reading = log.due(step + 1 - first) or saving
            losses, valid = _step(run, core, batch, step, generator, span, measure=reading)
            log.add(losses, valid)
            step += 1
            timer.step_done(run.device, synced=reading)
            run.monitor.sample()
            bar.update(1 if run.total_steps is not None else min(round(timer.loop_spent), bar.total) - bar.n)
            if reading:
                bar.set_postfix_str(f"step={step} {StepLog.postfix(log.read(step))}")
            if saving:
                with timer.saving():
                    _checkpoint(run, model, step, generator, writer)
    log.read(step)  # the last steps' losses: checked before the draft they made is reported on or saved
    bar.close()
    with timer.saving():
        writer.wait()
    return step, generator


def _checkpoint(run: _Run, model, step: int, generator: torch.Generator, writer=None) -> None:
    """A checkpoint of `model` (the draft, or its peft wrapper) at `step`, written by the main process (by `writer`'s
    thread if given). Every process calls it: a sharded run (FSDP, DeepSpeed ZeRO-3) gathers the whole weights here."""
    weights = _whole_weights(run)
    if run.accelerator.is_main_process:
        state = trainer_state(run.optimizer, step, run.timer, generator, run.config.batch_size,
                              run.accelerator.num_processes)
        (writer.save if writer else save_checkpoint)(model, weights, state, run.out_dir)


def _whole_weights(run: _Run) -> dict:
    """The draft's whole state dict, as accelerate gathers it (every process must call this: under FSDP or ZeRO-3 each
    holds a shard of the weights, and the main process receives them all)."""
    return run.accelerator.get_state_dict(run.draft)


def _progress_bar(run: _Run, step: int, progress: bool):
    """The steps' progress bar: in steps, or under a time budget in seconds of the loop time it allows."""
    from tqdm.auto import tqdm

    hidden = not (progress and run.accelerator.is_main_process)
    if run.total_steps is not None:
        return tqdm(total=run.total_steps, initial=step, desc="training", disable=hidden)
    return tqdm(total=round(run.timer.loop_total()), initial=round(run.timer.loop_spent), unit="s",
                desc=f"training ({run.config.time_budget:g} min)", disable=hidden)


def _epoch_shard(run: _Run, epoch: int) -> list[int]:
    """This process's share of the epoch's shuffled order of the training examples (with config.group_by_length, each
    step's examples of similar length: `grouped_by_length`)."""
    config, accelerator = run.config, run.accelerator
    order = list(range(len(run.train_set)))
    random.Random(config.seed + epoch).shuffle(order)
    # every rank takes steps_per_epoch steps (one that ran out of examples would wait for ever while the others
    # wait for it in the gradient all-reduce): the order wraps around until each rank's last step holds one
    order += [order[i % len(order)] for i in range(run.repeated_per_epoch)]
    if config.group_by_length:
        order = grouped_by_length(order, [len(e.input_ids) for e in run.train_set], run.global_batch,
                                  random.Random(config.seed + epoch))
    # a step's global batch is `global_batch` consecutive examples of the order: each rank takes every n-th of them
    return order[accelerator.process_index:: accelerator.num_processes]


def grouped_by_length(order: list[int], lengths: list[int], batch: int, rng: random.Random,
                      stretch: int = 64) -> list[int]:
    """`order` (indices into `lengths`) rearranged so that each `batch` consecutive indices have similar lengths: each
    stretch of `stretch` batches is sorted by length and cut into batches, whose order `rng` shuffles. Every index
    stays in its stretch, so the epoch's shuffle still spreads them; a last batch shorter than `batch` stays last."""
    grouped = []
    for start in range(0, len(order), batch * stretch):
        part = sorted(order[start: start + batch * stretch], key=lambda i: lengths[i])
        batches = [part[i: i + batch] for i in range(0, len(part), batch)]
        short = batches.pop() if len(batches[-1]) < batch else None
        rng.shuffle(batches)
        grouped += [i for b in batches + ([short] if short else []) for i in b]
    return grouped


def _lr_span(run: _Run, step: int) -> tuple[float, float]:
    """The span of the run (in [0, 1]) the step from `step` covers: of its steps, or of its time budget's loop time."""
    total_steps, timer = run.total_steps, run.timer
    if total_steps is not None:
        return step / total_steps, (step + 1) / total_steps
    return timer.progress(), timer.progress_after_step()


def _decided_by_rank_0(run: _Run, *values: float) -> list[float]:
    """`values` as process 0 has them, on every process (one small broadcast): what ends or shapes a step is decided
    once, from one clock."""
    if run.accelerator.num_processes == 1:
        return [float(v) for v in values]
    from accelerate.utils import broadcast

    shared = torch.tensor([float(v) for v in values], dtype=torch.float64, device=run.accelerator.device)
    return broadcast(shared, from_process=0).tolist()


def _step(run: _Run, core, batch: list, step: int, generator: torch.Generator, span: list[float],
          measure: bool = False):
    """One optimizer step on `batch`, this process's share of the step (config.gradient_accumulation_steps batches of
    config.batch_size at most), at the learning rate of its `span` of the run (`_lr_span`); returns the losses of its
    last batch and the mask of the block positions they count, unread. `core`: the DSparkDraftModel inside the
    prepared draft. measure: time its first batch's forward (which waits for the device; what sizes the held-out
    report)."""
    config, timer, accelerator = run.config, run.timer, run.accelerator
    for group in run.optimizer.param_groups:
        group["lr"] = config.learning_rate * lr_factor(*span, config.warmup_ratio)
    parts = [batch[i: i + config.batch_size] for i in range(0, len(batch), config.batch_size)]
    for k, part in enumerate(parts):
        last = k == len(parts) - 1
        # the gradients of the step's batches add up here and are averaged across processes once, with the last one
        with contextlib.nullcontext() if last else accelerator.no_sync(run.draft):
            with accelerator.autocast():
                losses, valid = train_step(core, run.target, part, run.features, config.anchors_per_sequence,
                                           run.weights, generator, forward=run.forward, feature_lag=config.feature_lag,
                                           lag_weights=config.feature_lag_weights)
            if k == 0 and measure:
                timer.forward_done(run.device)  # one batch's forward: what sizes the held-out report
            run.throughput.add(part, run.flops(_shapes(part, core.config, config)), max(len(e.input_ids) for e in part))
            # each batch weighs its share of the step's sequences: the step learns as from one batch of all of them
            accelerator.backward(losses["total"] * (len(part) / len(batch)))
    accelerator.clip_grad_norm_(run.draft.parameters(), 1.0)
    run.optimizer.step()
    run.optimizer.zero_grad(set_to_none=True)
    run.throughput.steps += 1
    return losses, valid


def _shapes(part: list, c, config: TrainConfig) -> Shapes:
    """What one batch of the run computes on (`throughput.StepFlops`): its padded length, the draft's block rows
    (each block: the anchor and the mask rows, a DFlash-layout draft one more, plus the feature lag's token rows)
    and the teacher's positions (every answer's tokens)."""
    rows = c.block_size + (0 if c.anchor_predicts else 1) + config.feature_lag
    return Shapes(len(part), max(len(e.input_ids) for e in part), config.anchors_per_sequence * rows,
                  sum(len(e.input_ids) - e.answer_start for e in part))


# -- the end of an invocation ----------------------------------------------------------------------------------------
def _finish(run: _Run, first_step: int, step: int, generator: torch.Generator):
    """What this invocation returns: once the run is finished and its held-out report fits, the final draft, reported
    on and saved, in eval mode; else the unfinished draft, in training mode, with a checkpoint to resume from."""
    config, timer, accelerator = run.config, run.timer, run.accelerator
    finished = timer.budget_spent() if run.total_steps is None else step >= run.total_steps
    # under stop_after the held-out report and the final save start from a checkpoint of the last step, so that a call
    # killed during them resumes there; when they would not fit in this call, the next one (which takes no step) makes
    # them; rank 0's clock decides for all
    report_now = finished and (step == first_step or timer.report_fits())
    finished, report_now = (bool(v) for v in _decided_by_rank_0(run, finished, report_now))
    saved = step > first_step and step % config.save_every == 0
    if (not report_now or (timer.limit is not None and step > first_step)) and not saved:
        with timer.saving():
            _checkpoint(run, accelerator.unwrap_model(run.draft), step, generator)
    if not report_now:
        if step == 0:
            warnings.warn(f"{config.output_dir}: stop_after={config.stop_after:g} min ran out before the first "
                          "training step (loading and setup took it); the checkpoint holds an untrained draft. Give a "
                          "larger stop_after.", stacklevel=3)
        if accelerator.is_main_process:
            print(f"stopped after {config.stop_after:g} min at step {step}"
                  f"{', before the held-out report and the final save' if finished else ''}: run the same command "
                  f"again to resume from {run.out_dir}")
        return accelerator.unwrap_model(run.draft, keep_fp32_wrapper=False)  # still in training mode: unfinished
    if step == 0:
        warnings.warn(f"{config.output_dir}: the time budget ran out before the first training step; the saved "
                      "draft is untrained. Give a larger time_budget.", stacklevel=3)
    # drop accelerate's autocast wrapper of forward: held-out figures and the returned draft run in the draft's dtype
    model = accelerator.unwrap_model(run.draft, keep_fp32_wrapper=False)
    model.eval()
    weights = _whole_weights(run)
    if accelerator.is_main_process:
        _report_and_save(run, model, weights, first_step, step)
    return model


def _report_and_save(run: _Run, model, weights: dict, first_step: int, step: int) -> None:
    """The held-out report (beside the draft the run started from, if any), the final save of `model` with its whole
    `weights`, and heldout.json with the report and where the run's time went."""
    config, timer = run.config, run.timer
    throughput, hint = _throughput(run)
    with timer.reporting():
        measured = [ex for batch in run.heldout_batches[: timer.report_batches()] for ex in batch]
        report = evaluate_heldout(unwrap_draft(model), run.target, measured, run.features, config.anchors_per_sequence,
                                  run.weights, batch_size=config.batch_size)
        if run.baseline and measured:
            report["init_from"] = _baseline_report(run.baseline, run.target, measured, run.features, config,
                                                   run.weights)
    report["heldout_sequences"] = len(run.heldout)  # "sequences" were measured; fewer under a tight time budget
    with timer.saving():
        model.save_pretrained(run.out_dir, state_dict=weights)
    report["training"] = {"steps": step, "minutes": round(timer.total_spent() / 60, 2),
                          "device": str(run.device), "target_dtype": str(run.target.dtype).replace("torch.", ""),
                          "batch_size": config.batch_size,
                          "gradient_accumulation_steps": config.gradient_accumulation_steps,
                          "processes": run.accelerator.num_processes, "global_batch": run.global_batch,
                          "train_examples": len(run.train_set),
                          "time": timer.summary(step - first_step), "gpu": run.monitor.report(),
                          "throughput": throughput}
    # last, and whole: heldout.json tells a finished run (the GPU campaign reads it so) from one killed while saving
    write_atomic(run.out_dir / "heldout.json", json.dumps(report, indent=2))
    print(timer.line(step))
    for line in (throughput and Throughput.line(throughput), hint):
        if line:
            print(line)
    if run.monitor.line():
        print(run.monitor.line())


def _throughput(run: _Run) -> tuple[dict | None, str | None]:
    """This invocation's steps as answers/s, tokens/s and MFU (None when it took none): the counts over its seconds
    of steps, against the device's peak in the dtype the draft trains in (mixed precision's, else float32); and the
    line that names the bfloat16 flags where that dtype is float32 on a CPU much faster in bfloat16 (else None)."""
    if run.throughput.steps == 0:
        return None, None
    seconds = run.timer.loop_spent - run.timer.loop_spent_before
    dtype = _training_dtype(run)
    peak, source = peak_flops(run.device, dtype)
    return run.throughput.report(seconds, peak, source), bfloat16_hint(run.device, dtype, peak)


def _training_dtype(run: _Run) -> torch.dtype:
    """The dtype the draft's matmuls run in: mixed precision's, else float32."""
    return {"bf16": torch.bfloat16, "fp16": torch.float16}.get(run.accelerator.mixed_precision, torch.float32)


def _baseline_report(init_from: str, target, measured: list, features, config: TrainConfig, weights) -> dict:
    """The held-out report of the draft a run started from, on the batches the trained draft was measured on (the
    report draws the same anchors for both), so that the two compare."""
    from ..loading import load_draft

    start = load_draft(init_from, target, torch.float32).to(target.device).eval()
    report = evaluate_heldout(start, target, measured, features, config.anchors_per_sequence, weights,
                              batch_size=config.batch_size)
    return {"path": init_from, **report}



CONFIG_FILE = "train_config.json"


# what a run saved before a field existed did, where it is not the field's default
_RUNS_BEFORE_THE_FIELD = {"group_by_length": False}


def _refuse_a_changed_run(config: TrainConfig, out_dir: Path) -> None:
    """A run resumed with settings that define it (the draft, the data and its split, the objective, the optimizer)
    other than those it was started with would continue the old draft under a train_config.json that describes
    another: refuse it. How long and where it runs (RESUMABLE_CHANGES) may change."""
    from dataclasses import MISSING, fields

    saved = _saved_run(out_dir)
    if saved is None:
        return  # nothing to resume: the run starts afresh
    now = json.loads(json.dumps(asdict(config)))  # as saved: tuples become lists
    changed = []
    for f in fields(TrainConfig):
        if f.name in RESUMABLE_CHANGES:
            continue
        default = _RUNS_BEFORE_THE_FIELD.get(f.name, f.default_factory() if f.default_factory is not MISSING
                                             else f.default)
        # a field newer than the run: the run had its default, or what runs did before the field
        before = saved.get(f.name) if f.name in saved or default is MISSING else json.loads(json.dumps(default))
        same_path = (f.name in ("dataset", "init_from") and isinstance(before, str) and isinstance(now[f.name], str)
                     and Path(before).resolve() == Path(now[f.name]).resolve())
        if before != now[f.name] and not same_path:
            changed.append(f"{f.name} {before!r} -> {now[f.name]!r}")
    if changed:
        raise ValueError(f"{out_dir} holds a run started with other settings ({'; '.join(changed)}): resume it with "
                         f"the settings of its {CONFIG_FILE}, or train into a new output_dir (only "
                         f"{', '.join(sorted(RESUMABLE_CHANGES - {'output_dir'}))} may change on resuming).")


def _saved_run(out_dir: Path) -> dict | None:
    """The train_config.json of the run `out_dir` holds, if there is one to resume (a checkpoint with its state)."""
    saved_file = out_dir / CONFIG_FILE
    if not saved_file.is_file() or not any((p / STATE_FILE).exists() for p in checkpoint_folders(out_dir)):
        return None
    try:
        return json.loads(saved_file.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ValueError(f"{saved_file} does not read as the settings of a run ({error}): resume with a readable "
                         "train_config.json, or train into a new output_dir.") from error


def _target_record(target) -> dict:
    """What train_config.json records of the target, beside the settings: its name and weights' fingerprint."""
    from ..model.binding import target_fingerprint

    return {"target": getattr(target.config, "_name_or_path", ""), "target_fingerprint": target_fingerprint(target)}


def _refuse_another_target(made_for: dict, out_dir: Path) -> None:
    """A run resumed with another target would go on distilling another teacher into the same draft. Runs recorded
    before train_config.json named the target resume unchecked."""
    from ..model.binding import same_fingerprint

    saved = _saved_run(out_dir)
    if saved is None or "target_fingerprint" not in saved:
        return
    if not same_fingerprint(saved["target_fingerprint"], made_for["target_fingerprint"]):
        raise ValueError(f"{out_dir} holds a run trained for the target {saved.get('target') or '(unnamed)'}, and the "
                         f"target given now ({made_for['target'] or 'unnamed'}) has other weights: resume it with "
                         "its target (--target), or train into a new output_dir.")


def _refuse_a_block_past_every_answer(block_size: int, train_set: list, config: TrainConfig) -> None:
    """Block position k learns from an answer of more than k + 1 tokens (its anchor, then the token it predicts):
    positions past the longest answer would get no gradient, and the draft would propose untrained tokens there."""
    longest = max(len(e.input_ids) - e.answer_start for e in train_set)
    if block_size > longest - 1:
        raise ValueError(f"block_size {block_size} is more than the longest training answer of {config.dataset} "
                         f"({longest} tokens after max_length={config.max_length}) less one: its last positions "
                         f"would never be trained. Give a block size of at most {longest - 1}, or longer answers.")


def lr_factor(start: float, end: float, warmup: float) -> float:
    """Learning-rate multiplier of a step spanning [start, end] of the run (steps, or time of a time budget): linear
    warm-up over the first `warmup` of it, then cosine decay to 0. Warm-up reads the step's end and decay its start,
    so that neither the first nor the last step of a run is wasted at rate 0 (a one-step run trains at full rate)."""
    if end < warmup:
        return end / warmup
    return 0.5 * (1 + math.cos(math.pi * min(1.0, max(0.0, start - warmup) / max(1e-9, 1 - warmup))))



def _domain_batches(examples: list, batch_size: int) -> list[list]:
    """The held-out report's forward passes: each domain's examples in batches (the report batches domains
    apart), the domains taken in turn, so that any prefix of the batches mixes them and costs one pass a batch."""
    by_domain: dict = {}
    for ex in examples:
        by_domain.setdefault(ex.domain, []).append(ex)
    queues = [[q[i: i + batch_size] for i in range(0, len(q), batch_size)] for q in by_domain.values()]
    return [q[i] for i in range(max(map(len, queues), default=0)) for q in queues if i < len(q)]



class RunClock:
    """Where a run stands against its time budget (`config.time_budget`) and this invocation's limit
    (`config.stop_after`), resumed invocations included.

    The training loop gets what the budget leaves once this invocation's setup (loading, features) is done, minus
    a reserve for the held-out report and the final save; the learning-rate schedule runs over that loop time. The
    report costs one measured forward pass per held-out batch (per draft measured: two when the run started from a
    draft); under a budget it measures at most the batches that fit in REPORT_SHARE of it (at least one), so that
    steps keep the rest. Time spent saving checkpoints inside the loop is counted as saving, not as steps.
    """

    SAVE_SECONDS = 2.0  # the final save of a draft: well under a second, measured on this CPU and in the first GPU run
    REPORT_SHARE = 0.04

    def __init__(self, config: TrainConfig, started: float | None = None):
        self.budget = None if config.time_budget is None else 60 * config.time_budget
        self.limit = None if config.stop_after is None else 60 * config.stop_after
        self.entry = time.perf_counter() if started is None else started
        self.spent_before = 0.0  # wall time of earlier invocations
        self.loop_spent = 0.0  # training-loop time, all invocations
        self.loop_spent_before = 0.0  # of the invocations before this one
        self.step_seconds = 0.0  # of the last step
        self.forward_seconds = 0.0  # of the last step's forward pass (features, draft, losses)
        self.heldout_batches = 0
        self.reports = 1  # drafts the held-out report measures
        self.setup_seconds = 0.0  # this invocation's, before its first step
        self.save_seconds = 0.0  # this invocation's
        self.report_seconds = 0.0

    def restore(self, state: dict) -> None:
        self.spent_before = state.get("spent", 0.0)
        self.loop_spent = self.loop_spent_before = state.get("loop_spent", 0.0)
        # a call resumed after the last step sizes the held-out report by the steps it did not take itself
        self.forward_seconds = state.get("forward_seconds", 0.0)

    def state(self) -> dict:
        return {"spent": self.total_spent(), "loop_spent": self.loop_spent, "forward_seconds": self.forward_seconds}

    def start_loop(self, heldout_batches: int, reports: int = 1) -> None:
        self.heldout_batches, self.reports = heldout_batches, reports
        self.last = time.perf_counter()
        self.setup_seconds = self.last - self.entry

    def saving(self):
        """A context that times a save: counted as saving, and kept out of the next step's time."""
        return self._counting("save_seconds")

    def reporting(self):
        """A context that times the held-out report."""
        return self._counting("report_seconds")

    @contextlib.contextmanager
    def _counting(self, total: str):
        began = time.perf_counter()
        try:
            yield
        finally:
            setattr(self, total, getattr(self, total) + time.perf_counter() - began)
            self.last = time.perf_counter()  # the next step's time starts now

    def summary(self, steps: int) -> dict:
        """Where this run's time went, all invocations for the budget and steps, this one for the rest: steps_share
        is the time in steps over the budget (over the time spent without one)."""
        spent = self.total_spent()
        base = self.budget if self.budget is not None else spent
        return {"budget_seconds": self.budget, "seconds": round(spent, 2), "step_seconds": round(self.loop_spent, 2),
                "steps_share": round(self.loop_spent / base, 4) if base else None,
                "setup_seconds": round(self.setup_seconds, 2), "report_seconds": round(self.report_seconds, 2),
                "save_seconds": round(self.save_seconds, 2), "steps_this_call": steps}

    def line(self, steps: int) -> str:
        """The summary as the log's line."""
        t = self.summary(steps)
        of = f"the {t['budget_seconds']:.0f} s budget" if self.budget is not None else f"the {t['seconds']:.0f} s run"
        share = f"{t['steps_share']:.1%}" if t["steps_share"] is not None else "n/a"
        return (f"time: {steps} steps in {t['step_seconds']:.1f} s, {share} of {of} (setup {t['setup_seconds']:.1f} "
                f"s, held-out report {t['report_seconds']:.1f} s, saving {t['save_seconds']:.1f} s; "
                f"{t['seconds']:.1f} s in all)")

    def total_spent(self) -> float:
        return self.spent_before + time.perf_counter() - self.entry

    def report_batches(self) -> int:
        """Held-out batches the report measures: all of them, or under a budget what fits in its share."""
        if self.budget is None or self.forward_seconds == 0:
            return self.heldout_batches
        return min(self.heldout_batches,
                   max(1, int(self.REPORT_SHARE * self.budget / (self.forward_seconds * self.reports))))

    def reserve(self) -> float:
        """Seconds kept for the held-out report (one forward pass per batch and draft) and saving."""
        return self.SAVE_SECONDS + self.forward_seconds * self.report_batches() * self.reports

    def loop_total(self) -> float:
        """Seconds of training loop the budget allows, all invocations."""
        left = self.budget - self.total_spent() - self.reserve()
        return max(self.loop_spent + left, 1e-9)

    def progress(self) -> float:
        return min(1.0, self.loop_spent / self.loop_total())

    def progress_after_step(self) -> float:
        return min(1.0, (self.loop_spent + self.step_seconds) / self.loop_total())

    def budget_spent(self) -> bool:
        """No time left for another step before the reserve."""
        return self.total_spent() + self.step_seconds + self.reserve() > self.budget

    def must_stop(self) -> bool:
        """This invocation's limit is near: save and return before it."""
        if self.limit is None:
            return False
        return time.perf_counter() - self.entry + self.step_seconds + self.SAVE_SECONDS > self.limit

    def report_fits(self) -> bool:
        """Whether this invocation's limit leaves the time the held-out report and the final save take."""
        return self.limit is None or time.perf_counter() - self.entry + self.reserve() <= self.limit

    def forward_done(self, device) -> None:
        self.forward_seconds = clock(device) - self.last

    def step_done(self, device, synced: bool = True) -> float:
        """A step ended: its seconds added to the loop's. synced: once the device has done its work (a wait); else
        as the host queued it, which on a GPU may run a step or two ahead (the sum evens out at the next wait)."""
        now = clock(device) if synced else time.perf_counter()
        self.step_seconds = now - self.last
        self.loop_spent += self.step_seconds
        self.last = now
        return self.step_seconds



def find_batch_size(draft, target, train_set, features, config: TrainConfig, weights, accelerator) -> int:
    """The largest batch size, halving from config.batch_size, at which one training step on the longest training
    sequences, every block with the longest feature lag (the most rows a block gets), fits in GPU memory (a CPU never
    runs out: it returns config.batch_size)."""
    longest = sorted(train_set, key=lambda e: len(e.input_ids), reverse=True)
    size = config.batch_size
    while accelerator.device.type == "cuda":
        try:
            with accelerator.autocast():
                losses, _ = train_step(unwrap_draft(draft), target, longest[:size], features,
                                       config.anchors_per_sequence, weights, torch.Generator().manual_seed(0),
                                       feature_lag=config.feature_lag, exact_lag=True)
            losses["total"].backward()
            break
        except torch.OutOfMemoryError:
            if size == 1:
                raise
            size //= 2
        finally:
            draft.zero_grad(set_to_none=True)
            torch.cuda.empty_cache()
    print(f"batch size: {size} sequences x {config.anchors_per_sequence} anchors")
    return size



def _mixed_precision(choice: str, device: torch.device) -> str:
    if choice not in ("auto", "bf16", "fp16", "no"):
        raise ValueError(f"mixed_precision={choice!r}: choose 'auto', 'bf16', 'fp16' or 'no'.")
    if choice == "auto":  # as a GPU trains: in bfloat16 where the device has its matrix units
        return "bf16" if computes_bfloat16_natively(device) else "no"
    if choice == "fp16" and device.type != "cuda":  # accelerate would silently train in fp32
        raise ValueError("mixed_precision='fp16' needs a GPU; on CPU use 'bf16' (CPUs with bf16 units) or 'no'.")
    return choice



def _target_dtype(choice: str, device: torch.device) -> torch.dtype:
    if choice == "auto":
        return torch.bfloat16 if computes_bfloat16_natively(device) else torch.float32
    return getattr(torch, choice)



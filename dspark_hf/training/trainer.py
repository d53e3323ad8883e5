"""Train a DSpark draft for a frozen target (paper sec. 3.3).

Runs plainly on CPU (fp32, or bf16 autocast where the CPU has bf16 matrix units) or under ``accelerate launch`` on
one or many GPUs (data parallel, bf16). The target, its embedding and its LM head stay frozen; only the draft's
backbone, sequential head and confidence head learn.
With ``lora=True`` a trained draft is adapted to a domain instead: its weights stay frozen and peft LoRA adapters on
the backbone's linear layers learn (plus, optionally, the heads in full); the run saves a peft adapter.
"""

from __future__ import annotations

import json
import math
import random
import shutil
import time
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from ..devices import clock, resolve_device
from ..generation.decoding import unwrap_draft
from ..model.modeling_dspark import DSparkDraftModel
from .data import Example, load_dataset, split_heldout, token_frequencies
from .features import CachedFeatures, OnlineFeatures, pad_batch
from .losses import LossWeights, losses_against, sample_anchors, target_distribution_on

_STATE = "trainer_state.pt"
# the backbone's linear layers (attention and MLP of every draft layer); `fc` (the context projection) may be added
LORA_TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# heads trained in full next to the adapters (peft `modules_to_save`: copies stored in the adapter file)
LORA_HEADS = {"none": (), "confidence": ("confidence",), "all": ("w1", "w2", "rnn_proj", "confidence")}


@dataclass
class TrainConfig:
    """Everything a training run depends on (saved next to the checkpoints as train_config.json)."""

    dataset: str = field(metadata={"help": "JSONL written by `dspark prepare-data`."})
    output_dir: str = field(metadata={"help": "Where checkpoints and the final draft are saved."})
    epochs: float = field(default=4.0, metadata={"help": "Passes over the training split (fresh anchors each)."})
    max_steps: int | None = field(default=None, metadata={"help": "Optimizer steps to take, overriding epochs (a "
                                  "fixed budget across datasets of different sizes)."})
    batch_size: int = field(default=4, metadata={"help": "Sequences per optimizer step (per process)."})
    anchors_per_sequence: int = field(default=48, metadata={"help": "Random blocks per sequence (reference: 512)."})
    learning_rate: float = field(default=1e-3, metadata={"help": "AdamW peak learning rate."})
    weight_decay: float = field(default=0.0, metadata={"help": "AdamW weight decay."})
    warmup_ratio: float = field(default=0.04, metadata={"help": "Linear warm-up share of the run (its steps, or its "
                                                               "time under a time budget), then cosine decay."})
    max_length: int = field(default=640, metadata={"help": "Sequences are cut to this many tokens."})
    heldout_fraction: float = field(default=0.05, metadata={"help": "Share of examples kept for validation and "
                                                                    "calibration (by hashed id)."})
    loss_ce: float = field(default=0.1, metadata={"help": "alpha_ce (eq. 12)."})
    loss_l1: float = field(default=0.9, metadata={"help": "alpha_tv (eq. 12); the term is the full L1 norm."})
    loss_confidence: float = field(default=1.0, metadata={"help": "alpha_conf (eq. 12)."})
    loss_kl: float = field(default=0.0, metadata={"help": "Weight of the forward KL(p_t || p_d) to the target's "
                           "distribution over the draft vocabulary (0: off; not in the paper)."})
    position_decay: float = field(default=4.0, metadata={"help": "w_k = exp(-k / position_decay)."})
    feature_cache: str | None = field(default=None, metadata={"help": "Directory for an on-disk cache of target "
                                                                        "features; None computes them online."})
    mixed_precision: str = field(default="auto", metadata={"choices": ("auto", "bf16", "fp16", "no"), "help":
                                 "'auto': bf16 on GPU, fp32 on CPU; 'bf16' also "
                                 "on a CPU with bf16 matrix units (AVX512-BF16, AMX: several times the fp32 "
                                 "throughput); 'fp16': GPU only; 'no': fp32. Autocast: weights and optimizer "
                                 "state stay fp32. accelerate keeps one setting per process."})
    time_budget: float | None = field(default=None, metadata={"help": "Minutes for the whole run (features, training, "
                                      "held-out report, saving; resumed invocations count together): the "
                                      "learning-rate schedule follows the time spent instead of the steps, and "
                                      "epochs and max_steps are ignored."})
    stop_after: float | None = field(default=None, metadata={"help": "Minutes after which this invocation saves a "
                                     "checkpoint and returns unfinished; run it again to resume (for machines that "
                                     "limit a command's wall time)."})
    device: str = field(default="auto", metadata={"help": "'auto' (the CUDA GPU when torch sees one, else the CPU), "
                        "'cpu', 'cuda' or 'cuda:N'; under `accelerate launch` each process takes its own GPU."})
    target_dtype: str = field(default="auto", metadata={"choices": ("auto", "float32", "bfloat16"), "help":
                              "dtype of the frozen target that gives features and "
                              "the target distribution: 'auto' (bfloat16 on a GPU, float32 on a CPU), 'float32' or "
                              "'bfloat16'; a target passed to train() is converted too."})
    auto_find_batch_size: bool = field(default=False, metadata={"help": "Halve batch_size until one step on the "
                                       "longest sequences fits in GPU memory (says which size it took)."})
    gpu_memory_fraction: float | None = field(default=None, metadata={"help": "Share of the GPU's memory this process "
                                              "may take (e.g. 0.45 each for two trainings on one GPU); "
                                              "auto_find_batch_size then fits the batch inside it."})
    save_every: int = field(default=200, metadata={"help": "Checkpoint every this many steps (resumable)."})
    seed: int = field(default=0, metadata={"help": "Seeds initialisation, shuffling and anchors."})
    draft: dict = field(default_factory=dict, metadata={"help": "DSparkDraftModel.from_target overrides of a fresh "
                        "draft's shape (default: DSparkConfig's), e.g. {'num_hidden_layers': 3, 'head_type': 'rnn'}; "
                        "draft_vocab_size (default 8192, 0: the full vocabulary) picks the most frequent answer "
                        "tokens. Refused with init_from / lora, which keep the saved draft's shape."})
    copy_target_layers: bool = field(default=False, metadata={"help": "Start a fresh draft from the target's last "
                                     "decoder layers instead of random weights (see copy_target_layers); needs "
                                     "draft layers with the target's shapes and parameter names (Llama, Qwen3)."})
    init_from: str | None = field(default=None, metadata={"help": "Start from this saved draft instead of a fresh "
                                                                    "one (fine-tuning); the base draft with lora."})
    lora: bool = field(default=False, metadata={"help": "Adapt init_from (default: the shipped draft, for the "
                       "default target) with LoRA: its weights stay frozen and the run saves a peft adapter."})
    lora_rank: int = field(default=16, metadata={"help": "LoRA rank r."})
    lora_alpha: float = field(default=32.0, metadata={"help": "LoRA scaling numerator (updates scale by alpha / r)."})
    lora_dropout: float = field(default=0.0, metadata={"help": "Dropout on the LoRA branch's input."})
    lora_target_modules: list[str] = field(default_factory=lambda: list(LORA_TARGET_MODULES), metadata={
        "help": "Names of the draft's linear layers that get adapters (default: attention and MLP of every layer)."})
    lora_heads: str = field(default="all", metadata={"choices": tuple(LORA_HEADS), "help":
                            "Heads trained in full and saved in the adapter: "
                            "'all' (default: the Markov/RNN head, where a domain's token transitions live, and "
                            "the confidence head; ~2M weights for the shipped draft, and on code the whole of the "
                            "measured gain); 'confidence' (a few hundred weights); 'none'."})

    def __post_init__(self):
        # checked before train() touches output_dir, so a refused command leaves an existing run as it was
        for name in ("time_budget", "stop_after"):
            if getattr(self, name) is not None and getattr(self, name) <= 0:
                raise ValueError(f"{name}={getattr(self, name)}: give a positive number of minutes, or leave it unset.")
        if self.gpu_memory_fraction is not None and not 0 < self.gpu_memory_fraction <= 1:
            raise ValueError(f"gpu_memory_fraction={self.gpu_memory_fraction}: give a share in (0, 1].")
        if self.target_dtype not in ("auto", "float32", "bfloat16"):
            raise ValueError(f"target_dtype={self.target_dtype!r}: choose 'auto', 'float32' or 'bfloat16'.")
        if self.copy_target_layers and (self.lora or self.init_from):
            raise ValueError("copy_target_layers initialises a fresh draft: drop it, or drop init_from / lora.")
        if self.draft and (self.lora or self.init_from):
            raise ValueError(f"The draft shape {self.draft} (--layers, --head-type, ...) applies to a fresh draft; "
                             "fine-tuning (init_from / lora) keeps the saved draft's shape. Drop those settings, or "
                             "train a fresh draft without init_from.")


def target_logits(target, hidden: torch.Tensor) -> torch.Tensor:
    """The target's logits from its last hidden state (final-logit soft cap included)."""
    logits = target.get_output_embeddings()(hidden)
    cap = getattr(target.config.get_text_config(), "final_logit_softcapping", None)
    return logits if cap is None else torch.tanh(logits / cap) * cap


def block_positions(anchors: torch.Tensor, gamma: int, length: int) -> torch.Tensor:
    """anchors (B, A) -> positions anchor + k (B, A, gamma), clamped to length - 1 (mask the overflow)."""
    return (anchors[..., None] + torch.arange(gamma, device=anchors.device)).clamp_max(length - 1)


def gather_blocks(x: torch.Tensor, anchors: torch.Tensor, gamma: int) -> torch.Tensor:
    """x (B, L, ...) -> (B, A, gamma, ...) at positions anchor + k (clamped to L - 1; mask the overflow)."""
    B, L = x.shape[:2]
    idx = block_positions(anchors, gamma, L)
    flat = idx.reshape(B, -1)
    out = x.gather(1, flat.view(B, -1, *([1] * (x.dim() - 2))).expand(-1, -1, *x.shape[2:]))
    return out.view(B, *idx.shape[1:], *x.shape[2:])


@torch.no_grad()
def target_distribution_at(target, last: torch.Tensor, anchors: torch.Tensor, gamma: int, draft_vocab=None):
    """The target's distribution at positions anchor + k over the draft vocabulary, p_t (B, A, gamma, K), its
    mass outside that vocabulary (B, A, gamma), and its argmax in draft ids, -1 outside (B, A, gamma). last (B, L, d):
    the target's last hidden state. Overlapping blocks share positions, so each distinct position goes through the
    LM head and the softmax once."""
    B, L = last.shape[:2]
    idx = block_positions(anchors, gamma, L)
    flat = idx + L * torch.arange(B, device=anchors.device)[:, None, None]
    rows, where = flat.flatten().unique(return_inverse=True)
    p_t, outside, top = target_distribution_on(draft_vocab, target_logits(target, last.flatten(0, 1)[rows].to(
        target.dtype)))
    return p_t[where].view(*idx.shape, -1), outside[where].view(idx.shape), top[where].view(idx.shape)


DEFAULT_DRAFT_VOCAB_SIZE = 8192  # a fresh draft proposes this many of the most frequent answer tokens


def make_draft(target, config: TrainConfig, train: list[Example]) -> DSparkDraftModel:
    """A fresh draft for `target`: DSparkConfig's default shape with `config.draft`'s overrides, proposing the
    DEFAULT_DRAFT_VOCAB_SIZE most frequent answer tokens of `train` unless draft_vocab_size says otherwise (0 or
    None: the full vocabulary)."""
    overrides = dict(config.draft)
    vocab = overrides.pop("draft_vocab_size", DEFAULT_DRAFT_VOCAB_SIZE)
    target_vocab = target.get_output_embeddings().weight.shape[0]
    if vocab and vocab < target_vocab:  # as many tokens as the target has is the full vocabulary
        freq = token_frequencies(train, target_vocab)
        overrides["draft_vocab"] = freq.argsort(descending=True)[:vocab].sort().values
    torch.manual_seed(config.seed)
    draft = DSparkDraftModel.from_target(target, **overrides)
    return copy_target_layers(draft, target) if config.copy_target_layers else draft


@torch.no_grad()
def copy_target_layers(draft: DSparkDraftModel, target) -> DSparkDraftModel:
    """Initialise a fresh draft's n decoder layers from the target's last n, so training starts from attention and
    MLP weights that already read the target's hidden states; the context projection starts as the identity on
    the deepest feature layer (the hidden state those layers read in the target), the context norm as the first
    copied layer's input norm, and the final norm as the target's. Raises ValueError where the target's decoder
    layers do not have the draft's parameter names and shapes (e.g. Gemma's extra norms)."""
    decoder = target.get_decoder()
    layers = list(getattr(decoder, "layers", []))
    n, d = len(draft.layers), draft.config.hidden_size
    if len(layers) < n:
        raise ValueError(f"copy_target_layers needs at least {n} target decoder layers, found {len(layers)}.")
    for own, theirs in zip(draft.layers, layers[-n:]):
        mine, source = own.state_dict(), theirs.state_dict()
        wrong = sorted(set(mine) ^ set(source)) + [k for k in mine if k in source and mine[k].shape != source[k].shape]
        if wrong:
            raise ValueError(f"copy_target_layers: the target's decoder layers ({type(theirs).__name__}) do not "
                             f"match the draft's ({', '.join(wrong[:6])}{' ...' if len(wrong) > 6 else ''}); "
                             "train without --copy-target-layers, or keep the draft's sizes equal to the target's.")
        own.load_state_dict(source)
    draft.fc.weight.zero_()
    draft.fc.weight[:, -d:] = torch.eye(d, dtype=draft.fc.weight.dtype)
    draft.context_norm.weight.copy_(draft.layers[0].input_layernorm.weight)
    if getattr(decoder, "norm", None) is not None:
        draft.norm.weight.copy_(decoder.norm.weight)
    return draft


def add_lora(draft: DSparkDraftModel, config: TrainConfig, base_name_or_path: str | None = None):
    """Freeze `draft` and wrap it in a peft ``PeftModel`` with trainable LoRA adapters on
    ``config.lora_target_modules``; the heads ``config.lora_heads`` names are trained in full and saved with the
    adapter. The adapter records `base_name_or_path` (default: where `draft` was loaded from) as its base."""
    from peft import LoraConfig, get_peft_model

    if config.lora_heads not in LORA_HEADS:
        raise ValueError(f"lora_heads={config.lora_heads!r}: choose one of {sorted(LORA_HEADS)}.")
    heads = [name for name in LORA_HEADS[config.lora_heads] if getattr(draft, name, None) is not None]
    lora = LoraConfig(r=config.lora_rank, lora_alpha=config.lora_alpha, lora_dropout=config.lora_dropout,
                      target_modules=list(config.lora_target_modules), modules_to_save=heads or None,
                      base_model_name_or_path=base_name_or_path or draft.name_or_path or None)
    return get_peft_model(draft, lora)


def _lora_base(config: TrainConfig, default_target: bool) -> str:
    """The draft a LoRA run adapts: init_from, or the shipped draft when training for the default target."""
    if config.init_from:
        return config.init_from
    if not default_target:
        raise ValueError("LoRA adapts an existing draft: pass init_from (--init-from DIR) with a draft trained for "
                         "this target.")
    from ..defaults import SHIPPED_DRAFT_DIR

    return str(SHIPPED_DRAFT_DIR)


def _load_draft(config: TrainConfig, target, resume: Path | None, default_target: bool, train_set):
    """The model to train: resumed, fine-tuned from init_from, LoRA-wrapped, or fresh (bound to `target`)."""
    if config.lora:
        from peft import PeftModel

        base_path = _lora_base(config, default_target)
        base = DSparkDraftModel.from_pretrained(base_path, dtype=target.dtype).bind_target(target)
        if resume is not None:
            return PeftModel.from_pretrained(base, resume, is_trainable=True)
        return add_lora(base, config, base_path)
    if resume is not None or config.init_from:
        # fp32 master weights whatever the checkpoint's dtype (the shipped and exported drafts are bf16)
        return DSparkDraftModel.from_pretrained(resume or config.init_from, dtype=torch.float32).bind_target(target)
    return make_draft(target, config, train_set)


def train_step(draft, target, examples, features, anchors_per_sequence, weights, generator, forward=None):
    """Losses of one batch (no backward). `forward` is the (possibly data-parallel wrapped) draft to call."""
    forward = forward or draft
    gamma = draft.config.block_size
    feats, last = features(examples)
    device = draft.device
    feats, last = feats.to(device, non_blocking=True), last.to(device, non_blocking=True)
    ids, context_valid, lengths = pad_batch([e.input_ids for e in examples])  # on the CPU, moved once below
    anchors, valid = sample_anchors(torch.tensor([e.answer_start for e in examples], device="cpu"), lengths,
                                    anchors_per_sequence, generator)
    ids, anchors, valid, context_valid, lengths = (t.to(device, non_blocking=True) for t in (
        ids, anchors, valid, context_valid.bool(), lengths))
    positions = torch.arange(ids.shape[1], device=device).expand(len(examples), -1)

    labels = gather_blocks(ids, anchors + 1, gamma)  # position k predicts anchor + k + 1
    block_valid = valid[..., None] & ((anchors[..., None] + 1 + torch.arange(gamma, device=device))
                                      < lengths[:, None, None])
    out = forward(ids.gather(1, anchors), anchors, block_tokens=labels, context_features=feats,
                  context_positions=positions, context_valid=context_valid)
    vocab = draft.draft_vocab if draft.config.draft_vocab_size is not None else None
    p_t, outside, top = target_distribution_at(target, last, anchors, gamma, vocab)
    to_draft = draft.target_to_draft if vocab is not None else None
    return losses_against(out.logits.flatten(0, 1), p_t.flatten(0, 1), outside.flatten(0, 1), labels.flatten(0, 1),
                          block_valid.flatten(0, 1),
                          out.confidence_logits.flatten(0, 1) if out.confidence_logits is not None else None,
                          to_draft, weights, target_top=top.flatten(0, 1)), block_valid.flatten(0, 1)


def train(config: TrainConfig, target=None, progress: bool = True):
    """Train (or resume) a draft as `config` says; returns the final draft, also saved to config.output_dir
    (with ``config.lora``: the peft ``PeftModel``, saved as an adapter). With ``config.stop_after``, an invocation that
    runs out of time returns the unfinished draft after saving a checkpoint to resume from."""
    from accelerate import Accelerator
    from tqdm.auto import tqdm

    timer = RunClock(config)
    device = resolve_device(config.device)
    if device.type == "cuda" and device.index is not None:
        torch.cuda.set_device(device)  # accelerate places a single process on the current GPU
    accelerator = Accelerator(mixed_precision=_mixed_precision(config.mixed_precision, device),
                              cpu=device.type == "cpu")
    device = accelerator.device
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True  # fp32 matmuls outside autocast (the target in float32)
        if config.gpu_memory_fraction is not None:
            torch.cuda.set_per_process_memory_fraction(config.gpu_memory_fraction, device)
    default_target_used = target is None
    if target is None:
        from ..defaults import default_target

        target, _ = default_target(dtype=_target_dtype(config.target_dtype, device), device=device)
    target = target.to(device=device, dtype=_target_dtype(config.target_dtype, device))
    target.requires_grad_(False).eval()
    vocab_size = target.get_output_embeddings().weight.shape[0]
    train_set, heldout = split_heldout(load_dataset(config.dataset, vocab_size), config.heldout_fraction)
    for ex in train_set + heldout:
        ex.input_ids = ex.input_ids[: config.max_length]
    train_set = [e for e in train_set if e.answer_start < len(e.input_ids) - 1]
    if not train_set:
        raise ValueError(f"{config.dataset}: no training example has an answer of two tokens or more after the "
                         f"held-out split (heldout_fraction={config.heldout_fraction}, "
                         f"max_length={config.max_length}).")

    out_dir = Path(config.output_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "train_config.json").write_text(json.dumps(asdict(config), indent=2))
    resume = _latest_checkpoint(out_dir)
    draft = _load_draft(config, target, resume, default_target_used, train_set)
    draft.to(device).train()
    layer_ids = unwrap_draft(draft).config.target_layer_ids

    features = (CachedFeatures(config.feature_cache, target, layer_ids, train_set + heldout,
                               progress=progress and accelerator.is_main_process)
                if config.feature_cache else OnlineFeatures(target, layer_ids))
    weights = LossWeights(config.loss_ce, config.loss_l1, config.loss_confidence, config.position_decay,
                          config.loss_kl)
    if config.auto_find_batch_size:
        config.batch_size = find_batch_size(draft, target, train_set, features, config, weights, accelerator)
    steps_per_epoch = math.ceil(len(train_set) / (config.batch_size * accelerator.num_processes))
    total_steps = None if config.time_budget else config.max_steps or max(1, int(config.epochs * steps_per_epoch))
    params = [p for p in draft.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=config.learning_rate, weight_decay=config.weight_decay,
                                  fused=device.type == "cuda" or None)
    draft, optimizer = accelerator.prepare(draft, optimizer)
    step = 0
    if resume is not None:
        state = torch.load(resume / _STATE, weights_only=False)
        optimizer.load_state_dict(state["optimizer"])
        step = state["step"]
        timer.restore(state.get("clock", {}))
    model = accelerator.unwrap_model(draft)  # what is saved: the draft, or its peft wrapper (an adapter)
    core = unwrap_draft(model)  # the DSparkDraftModel; with LoRA its layers hold the adapters
    timer.start_loop(heldout_batches=math.ceil(len(heldout) / config.batch_size))

    if total_steps is not None:
        bar = tqdm(total=total_steps, initial=step, desc="training", disable=not (progress and
                                                                                  accelerator.is_main_process))
    else:
        bar = tqdm(total=round(timer.loop_total()), initial=round(timer.loop_spent), unit="s",
                   desc=f"training ({config.time_budget:g} min)",
                   disable=not (progress and accelerator.is_main_process))
    running, stopped = None, False
    while not stopped:
        epoch, offset = divmod(step, steps_per_epoch)
        order = list(range(len(train_set)))
        random.Random(config.seed + epoch).shuffle(order)
        shard = order[accelerator.process_index:: accelerator.num_processes]
        generator = torch.Generator().manual_seed(config.seed * 100_003 + step)
        for i in range(offset, steps_per_epoch):
            batch = [train_set[j] for j in shard[i * config.batch_size: (i + 1) * config.batch_size]]
            done = step >= total_steps if total_steps is not None else timer.budget_spent()
            if done or timer.must_stop():
                stopped = True
                break
            if not batch:
                break
            span = ((step / total_steps, (step + 1) / total_steps) if total_steps is not None
                    else (timer.progress(), timer.progress_after_step()))
            for group in optimizer.param_groups:
                group["lr"] = config.learning_rate * lr_factor(*span, config.warmup_ratio)
            with accelerator.autocast():
                losses, valid = train_step(core, target, batch, features, config.anchors_per_sequence, weights,
                                           generator, forward=draft)
            timer.forward_done(device)
            accelerator.backward(losses["total"])
            accelerator.clip_grad_norm_(draft.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1
            timer.step_done(device)
            running = _running(running, losses, valid)
            bar.update(1 if total_steps is not None else min(round(timer.loop_spent), bar.total) - bar.n)
            bar.set_postfix_str(f"step={step} {_postfix(running)}")
            if step % config.save_every == 0 and accelerator.is_main_process:
                _save_checkpoint(model, optimizer, step, timer, out_dir)
    bar.close()
    if step == 0:
        warnings.warn(f"{config.output_dir}: the time budget ran out before the first training step; the saved "
                      "draft is untrained. Give a larger time_budget.", stacklevel=2)
    if timer.must_stop() and not (timer.budget_spent() if total_steps is None else step >= total_steps):
        if accelerator.is_main_process:
            _save_checkpoint(model, optimizer, step, timer, out_dir)
            print(f"stopped after {config.stop_after:g} min at step {step}: run the same command again to resume "
                  f"from {out_dir}")
        return accelerator.unwrap_model(draft, keep_fp32_wrapper=False)
    # drop accelerate's autocast wrapper of forward: held-out figures and the returned draft run in the draft's dtype
    model = accelerator.unwrap_model(draft, keep_fp32_wrapper=False)
    core = unwrap_draft(model)
    model.eval()
    if accelerator.is_main_process:
        measured = _interleave_domains(heldout)[: timer.report_batches() * config.batch_size]
        report = evaluate_heldout(core, target, measured, features, config.anchors_per_sequence, weights,
                                  batch_size=config.batch_size)
        report["heldout_sequences"] = len(heldout)  # "sequences" were measured; fewer under a tight time budget
        report["training"] = {"steps": step, "minutes": round(timer.total_spent() / 60, 2),
                              "device": str(device), "target_dtype": str(target.dtype).replace("torch.", ""),
                              "batch_size": config.batch_size, "train_examples": len(train_set)}
        (out_dir / "heldout.json").write_text(json.dumps(report, indent=2))
        model.save_pretrained(out_dir)
    return model


def lr_factor(start: float, end: float, warmup: float) -> float:
    """Learning-rate multiplier of a step spanning [start, end] of the run (steps, or time of a time budget): linear
    warm-up over the first `warmup` of it, then cosine decay to 0. Warm-up reads the step's end and decay its start,
    so that neither the first nor the last step of a run is wasted at rate 0 (a one-step run trains at full rate)."""
    if end < warmup:
        return end / warmup
    return 0.5 * (1 + math.cos(math.pi * min(1.0, max(0.0, start - warmup) / max(1e-9, 1 - warmup))))


def _interleave_domains(examples: list) -> list:
    """Examples in round-robin order of their domains, so that any prefix mixes them."""
    by_domain: dict = {}
    for ex in examples:
        by_domain.setdefault(ex.domain, []).append(ex)
    queues = list(by_domain.values())
    return [q[i] for i in range(max(map(len, queues), default=0)) for q in queues if i < len(q)]


class RunClock:
    """Where a run stands against its time budget (`config.time_budget`) and this invocation's limit
    (`config.stop_after`), resumed invocations included.

    The training loop gets what the budget leaves once this invocation's setup (loading, features) is done, minus
    a reserve for the held-out report and the final save; the learning-rate schedule runs over that loop time. The
    report costs one measured forward pass per held-out batch; under a budget it measures at most the batches that
    fit in REPORT_SHARE of it (at least one).
    """

    SAVE_SECONDS = 5.0
    REPORT_SHARE = 0.2

    def __init__(self, config: TrainConfig):
        self.budget = None if config.time_budget is None else 60 * config.time_budget
        self.limit = None if config.stop_after is None else 60 * config.stop_after
        self.entry = time.perf_counter()
        self.spent_before = 0.0  # wall time of earlier invocations
        self.loop_spent = 0.0  # training-loop time, all invocations
        self.step_seconds = 0.0  # of the last step
        self.forward_seconds = 0.0  # of the last step's forward pass (features, draft, losses)
        self.heldout_batches = 0

    def restore(self, state: dict) -> None:
        self.spent_before = state.get("spent", 0.0)
        self.loop_spent = state.get("loop_spent", 0.0)

    def state(self) -> dict:
        return {"spent": self.total_spent(), "loop_spent": self.loop_spent}

    def start_loop(self, heldout_batches: int) -> None:
        self.heldout_batches = heldout_batches
        self.last = time.perf_counter()

    def total_spent(self) -> float:
        return self.spent_before + time.perf_counter() - self.entry

    def report_batches(self) -> int:
        """Held-out batches the report measures: all of them, or under a budget what fits in its share."""
        if self.budget is None or self.forward_seconds == 0:
            return self.heldout_batches
        return min(self.heldout_batches, max(1, int(self.REPORT_SHARE * self.budget / self.forward_seconds)))

    def reserve(self) -> float:
        """Seconds kept for the held-out report (one forward pass per batch) and saving."""
        return self.SAVE_SECONDS + self.forward_seconds * self.report_batches()

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

    def forward_done(self, device) -> None:
        self.forward_seconds = clock(device) - self.last

    def step_done(self, device) -> float:
        now = clock(device)
        self.step_seconds = now - self.last
        self.loop_spent += self.step_seconds
        self.last = now
        return self.step_seconds


def find_batch_size(draft, target, train_set, features, config: TrainConfig, weights, accelerator) -> int:
    """The largest batch size, halving from config.batch_size, at which one training step on the longest training
    sequences fits in GPU memory (a CPU never runs out: it returns config.batch_size)."""
    longest = sorted(train_set, key=lambda e: len(e.input_ids), reverse=True)
    size = config.batch_size
    while accelerator.device.type == "cuda":
        try:
            with accelerator.autocast():
                losses, _ = train_step(unwrap_draft(draft), target, longest[:size], features,
                                       config.anchors_per_sequence, weights, torch.Generator().manual_seed(0))
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
    if choice == "auto":
        return "bf16" if device.type == "cuda" else "no"
    if choice == "fp16" and device.type != "cuda":  # accelerate would silently train in fp32
        raise ValueError("mixed_precision='fp16' needs a GPU; on CPU use 'bf16' (CPUs with bf16 units) or 'no'.")
    return choice


def _target_dtype(choice: str, device: torch.device) -> torch.dtype:
    if choice == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return getattr(torch, choice)


def _running(running, losses, valid, beta=0.95):
    """Exponential moving averages of the loss terms and of the analytic acceptance per position."""
    current = {k: float(v.detach()) for k, v in losses.items() if k not in ("acceptance", "agreement")}
    acc = (losses["acceptance"] * valid).sum(0) / valid.sum(0).clamp_min(1)
    current["acc"] = acc.tolist()
    if running is None:
        return current
    return {k: ([beta * a + (1 - beta) * b for a, b in zip(running[k], v)] if isinstance(v, list)
                else beta * running[k] + (1 - beta) * v) for k, v in current.items()}


def _postfix(running) -> str:
    terms = " ".join(f"{k}={running[k]:.3f}" for k in ("total", "ce", "l1", "kl", "confidence") if k in running)
    return f"{terms} acc/pos=[{' '.join(f'{a:.2f}' for a in running['acc'])}]"


@torch.no_grad()
def evaluate_heldout(draft, target, heldout, features, anchors_per_sequence, weights, batch_size=4) -> dict:
    """Teacher-forced acceptance per position on held-out sequences (the target's own tokens), and the expected
    acceptance length each implies: 1 - TV for sampling, and whether the draft's argmax is the target's for greedy
    decoding. Where the examples name their domain, the same figures per domain under "domains", and the macro
    expected greedy tau over them."""
    if not heldout:
        return {}
    generator = torch.Generator().manual_seed(1234)
    by_domain: dict[str | None, list] = {}
    for ex in heldout:
        by_domain.setdefault(ex.domain, []).append(ex)
    sums = {}
    for domain, examples in sorted(by_domain.items(), key=lambda kv: str(kv[0])):
        acc = sums.setdefault(domain, {"acceptance": 0, "agreement": 0, "count": 0})
        for i in range(0, len(examples), batch_size):
            losses, valid = train_step(draft, target, examples[i: i + batch_size], features, anchors_per_sequence,
                                       weights, generator)
            for k in ("acceptance", "agreement"):
                acc[k] = acc[k] + (losses[k] * valid).sum(0)
            acc["count"] = acc["count"] + valid.sum(0)

    def figures(acc, sequences) -> dict:
        acceptance, agreement = ((acc[k] / acc["count"].clamp_min(1)).tolist() for k in ("acceptance", "agreement"))
        return {"sequences": sequences, "acceptance_per_position": acceptance,
                "expected_tau_from_acceptance": _expected_tau(acceptance),
                "greedy_agreement_per_position": agreement, "expected_greedy_tau": _expected_tau(agreement)}

    total = {k: sum(acc[k] for acc in sums.values()) for k in ("acceptance", "agreement", "count")}
    report = figures(total, len(heldout))
    if any(domain is not None for domain in sums):
        report["domains"] = {str(d): figures(acc, len(by_domain[d])) for d, acc in sums.items()}
        report["macro_expected_greedy_tau"] = sum(r["expected_greedy_tau"] for r in report["domains"].values()) / len(
            report["domains"])
    return report


def _expected_tau(acceptance: list[float]) -> float:
    """1 + sum_k prod_{j<=k} a_j: the expected acceptance length (bonus token included) for per-position rates."""
    return 1 + sum(math.prod(acceptance[: k + 1]) for k in range(len(acceptance)))


def _checkpoints(out_dir: Path) -> list[Path]:
    """checkpoint-<step> folders, oldest first."""
    return sorted(out_dir.glob("checkpoint-*"), key=lambda p: int(p.name.split("-")[1]))


def _latest_checkpoint(out_dir: Path) -> Path | None:
    found = [p for p in _checkpoints(out_dir) if (p / _STATE).exists()]
    return found[-1] if found else None


def _save_checkpoint(model, optimizer, step: int, clock: RunClock, out_dir: Path):
    path = out_dir / f"checkpoint-{step}"
    model.save_pretrained(path)
    torch.save({"optimizer": optimizer.state_dict(), "step": step, "clock": clock.state()}, path / _STATE)
    for old in _checkpoints(out_dir)[:-2]:
        shutil.rmtree(old, ignore_errors=True)

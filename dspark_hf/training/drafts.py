"""The draft a run trains: fresh (DSparkConfig's default shape, optionally started from the target's last layers),
fine-tuned from a saved one, LoRA-adapted, or resumed."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from ..model.configuration_dspark import HEAD_TYPES, DSparkConfig
from ..model.modeling_dspark import DSparkDraftModel
from ..options import COUNT, POSITIVE, option
from .config import LORA_HEADS, TrainConfig
from .data import Example, token_frequencies

DEFAULT_DRAFT_VOCAB_SIZE = 8192  # a fresh draft proposes this many of the most frequent answer tokens
_DEFAULT = DSparkConfig()  # the shape a fresh draft has where DraftShape leaves it


@dataclass
class DraftShape:
    """A fresh draft's shape as `dspark train`'s flags give it: TrainConfig.draft's overrides, None keeping the
    default (refused with --init-from / --lora, which keep the saved draft's)."""

    head_type: str | None = option(None, f"default: {_DEFAULT.head_type}", choices=list(HEAD_TYPES))
    num_hidden_layers: int | None = option(None, f"draft decoder layers (default: {_DEFAULT.num_hidden_layers})",
                                           type=POSITIVE, flag="--layers", metavar="LAYERS")
    intermediate_size: int | None = option(None, "draft MLP width (default: the target's)", type=POSITIVE)
    markov_rank: int | None = option(None, f"default: {_DEFAULT.markov_rank}", type=POSITIVE)
    block_size: int | None = option(None, f"default: {_DEFAULT.block_size}", type=POSITIVE)
    draft_vocab_size: int | None = option(None, "0 = the full target vocabulary (default: "
                                          f"{DEFAULT_DRAFT_VOCAB_SIZE})", type=COUNT)
    target_layer_ids: list[int] | None = option(None, "default: the reference rule")


def make_draft(target, config: TrainConfig, train: list[Example]) -> DSparkDraftModel:
    """A fresh float32 draft for `target`: DSparkConfig's default shape with `config.draft`'s overrides, proposing the
    DEFAULT_DRAFT_VOCAB_SIZE most frequent answer tokens of `train` unless draft_vocab_size says otherwise (0 or
    None: the full vocabulary)."""
    overrides = dict(config.draft)
    vocab = overrides.pop("draft_vocab_size", DEFAULT_DRAFT_VOCAB_SIZE)
    target_vocab = target.get_output_embeddings().weight.shape[0]
    if vocab and vocab < target_vocab:  # as many tokens as the target has is the full vocabulary
        freq = token_frequencies(train, target_vocab)
        overrides["draft_vocab"] = freq.argsort(descending=True)[:vocab].sort().values
    torch.manual_seed(config.seed)
    # float32 master weights whatever the target's dtype, as a resumed run loads them: Adam's updates of a bf16 draft
    # round away near 1 (norm gains, the identity in fc) at the learning rates used
    draft = DSparkDraftModel.from_target(target, **overrides).float()
    return copy_target_layers(draft, target) if config.copy_target_layers else draft


_QK_NORMS = ("self_attn.q_norm.weight", "self_attn.k_norm.weight")


@torch.no_grad()
def copy_target_layers(draft: DSparkDraftModel, target) -> DSparkDraftModel:
    """Initialise a fresh draft's n decoder layers from the target's last n, so training starts from attention and
    MLP weights that already read the target's hidden states; the context projection starts as the identity on
    the deepest feature layer (the hidden state those layers read in the target), the context norm as the first
    copied layer's input norm, and the final norm as the target's; per-head q/k norms the target's layers lack keep
    their initial ones. Raises ValueError where the target's decoder layers do not have the draft's parameter names
    and shapes (e.g. Gemma's extra norms)."""
    decoder = target.get_decoder()
    layers = list(getattr(decoder, "layers", []))
    n, d = len(draft.layers), draft.config.hidden_size
    if len(layers) < n:
        raise ValueError(f"copy_target_layers needs at least {n} target decoder layers, found {len(layers)}.")
    for own, theirs in zip(draft.layers, layers[-n:]):
        mine, source = own.state_dict(), theirs.state_dict()
        # per-head q/k norms the target's layers lack (Llama's)
        unnormed = {k for k in set(mine) - set(source) if k.endswith(_QK_NORMS)}
        wrong = sorted((set(mine) - unnormed) ^ set(source)) + [
            k for k in mine if k in source and mine[k].shape != source[k].shape]
        if wrong:
            raise ValueError(f"copy_target_layers: the target's decoder layers ({type(theirs).__name__}) do not "
                             f"match the draft's ({', '.join(wrong[:6])}{' ...' if len(wrong) > 6 else ''}); "
                             "train without --copy-target-layers, or keep the draft's sizes equal to the target's.")
        own.load_state_dict(source, strict=False)  # all but `unnormed`, which keep a fresh draft's ones
    draft.fc.weight.zero_()
    draft.fc.weight[:, -d:] = torch.eye(d, dtype=draft.fc.weight.dtype)
    draft.context_norm.weight.copy_(draft.layers[0].input_layernorm.weight)
    if getattr(decoder, "norm", None) is not None:
        draft.norm.weight.copy_(decoder.norm.weight)
    return draft


@torch.no_grad()
def with_qk_norms(draft: DSparkDraftModel, target) -> DSparkDraftModel:
    """`draft` with per-head q/k RMS norms added to its layers (weights at one), bound to `target`: the layer shape
    the engines serve, every other weight carried over. The norms rescale queries and keys, so the draft drafts
    differently until trained with them. Raises ValueError for a draft that has them."""
    if draft.config.qk_norm:
        raise ValueError("This draft's layers norm queries and keys already (qk_norm=True): drop --add-qk-norm.")
    config = DSparkConfig.from_dict({**draft.config.to_dict(), "qk_norm": True})
    normed = DSparkDraftModel(config).to(device=draft.device, dtype=draft.dtype)
    missing, unexpected = normed.load_state_dict(draft.state_dict(), strict=False)
    if unexpected or not all(k.endswith(_QK_NORMS) for k in missing):  # a model change, not a user's mistake
        raise RuntimeError(f"with_qk_norms: unexpected {unexpected}, missing {missing}")
    return normed.bind_target(target)


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
    torch.manual_seed(config.seed)  # the adapters' initial weights: a seed gives the same run
    return get_peft_model(draft, lora)


def _lora_base(config: TrainConfig, default_target: bool) -> str:
    """The draft a LoRA run adapts: init_from (a folder as its absolute path, which the adapter records as its base),
    or the shipped draft when training for the default target."""
    if config.init_from:
        from ..loading import refuse_adapter

        # the new adapter names its base, which must load as a draft on its own
        refuse_adapter(config.init_from, "--lora --init-from (the base draft the new adapter names)")
        folder = Path(config.init_from).expanduser()
        # a relative path recorded in adapter_config.json would only load from the directory training ran in
        return str(folder.resolve()) if folder.is_dir() else config.init_from
    if not default_target:
        raise ValueError("LoRA adapts an existing draft: pass init_from (--init-from DIR) with a draft trained for "
                         "this target.")
    from ..defaults import SHIPPED_DRAFT_DIR

    return str(SHIPPED_DRAFT_DIR)


def _from_checkpoint(resume: Path, load):
    """`load()` of the checkpoint `resume`, whose weights a damaged disk or a copy cut short may have broken after its
    trainer state was written: say which checkpoint, and that the one before can take over."""
    from safetensors import SafetensorError

    try:
        return load()
    except (OSError, SafetensorError) as error:
        reason = " ".join(str(error.__cause__ or error).split())[:200]  # safetensors' own words, if it failed
        raise ValueError(f"the weights of {resume} do not load ({reason}): remove {resume} to resume from the "
                         "checkpoint before it.") from error


def initial_draft(config: TrainConfig, target, resume: Path | None, default_target: bool, train_set):
    """The model to train: resumed, fine-tuned from init_from, LoRA-wrapped, or fresh (bound to `target`)."""
    if config.lora:
        from peft import PeftModel

        base_path = _lora_base(config, default_target)
        # float32 whatever the target's dtype, as fine-tuning loads it: the heads trained in full are copies of the
        # base's (peft modules_to_save), and Adam's updates of bf16 weights round away
        base = DSparkDraftModel.from_pretrained(base_path, dtype=torch.float32).bind_target(target)
        if resume is not None:
            return _from_checkpoint(resume, lambda: PeftModel.from_pretrained(base, resume, is_trainable=True))
        return add_lora(base, config, base_path)
    # fp32 master weights whatever the checkpoint's dtype (the shipped and exported drafts are bf16)
    if resume is not None:
        return _from_checkpoint(resume, lambda: DSparkDraftModel.from_pretrained(resume, dtype=torch.float32)
                                .bind_target(target))
    if config.init_from:
        from ..loading import load_draft

        # as --draft reads it: a LoRA adapter folder is merged into its base (which peft leaves frozen), and
        # fine-tuning trains all of the result
        draft = load_draft(config.init_from, target, torch.float32)
        return (with_qk_norms(draft, target) if config.add_qk_norm else draft).requires_grad_(True)
    return make_draft(target, config, train_set)

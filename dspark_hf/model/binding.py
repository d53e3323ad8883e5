"""What a DSpark draft takes from outside itself: its target, and dspark-hf's sharing.

- Binding: a draft borrows its target's frozen input embedding and LM head ([`TargetBinding`]), is sized from the
  target's config ([`fields_from_target`]), and refuses a target it was not built for ([`check_target`]), telling
  one of the same shape but other weights by a fingerprint ([`target_fingerprint`]).
- Sharing: `save_pretrained`, `push_to_hub` and `from_pretrained` hand over to `dspark_hf.hub` (a model card on every
  save, a clear error for an offline miss) where dspark-hf is loaded ([`sharing`]). Nothing sets that hand-over:
  the draft looks for the module by name when it saves, loads or pushes.

Like the modeling file, this file imports nothing of dspark_hf but the configuration: saved beside a draft's
weights, the two load with ``trust_remote_code=True`` where dspark-hf is not installed (then there is no sharing,
and saving is transformers' plain save).
"""

from __future__ import annotations

import math
import sys
import warnings
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from transformers import PreTrainedModel

from .configuration_dspark import DSparkConfig, unreadable_layers

# the module the draft hands saving, pushing and offline-load errors over to, where it is loaded
SHARING_MODULE = "dspark_hf.hub"


# -- binding ------------------------------------------------------------------------------------------------------
@dataclass
class TargetBinding:
    """What a draft borrows from its target: the frozen input embedding and LM head (never saved with the draft),
    and `lm_weight`, the LM-head rows the draft proposes in its compute dtype, converted once and kept."""

    embed: nn.Module
    lm_head: nn.Module
    lm_weight: torch.Tensor | None = None

    @classmethod
    def of(cls, target: PreTrainedModel) -> "TargetBinding":
        return cls(target.get_input_embeddings(), target.get_output_embeddings())

    def serves(self, target: PreTrainedModel) -> bool:
        """Whether these are `target`'s own modules (identity, not equality: a target is bound, not its copy)."""
        return self.embed is target.get_input_embeddings() and self.lm_head is target.get_output_embeddings()

    def __deepcopy__(self, memo) -> "TargetBinding":
        return self  # a copy of the draft borrows the same target modules; copying them would copy the target's

    def __reduce__(self):
        return _unbound, ()  # pickling a draft (torch.save) keeps its own weights only: it loads unbound


def _unbound() -> None:
    return None


class BlockSizeWarning(UserWarning):
    """A draft loaded with a block_size other than the one it was trained with (`DSparkConfig.trained_block_size`)."""


class OtherTargetWarning(UserWarning):
    """A draft bound to a target of its shape whose embedding and LM head are not the ones it was built for."""


def target_fingerprint(target: PreTrainedModel, rows: int = 8) -> list[float]:
    """2 x `rows` numbers identifying a target's embedding and LM head: fixed random projections of evenly spaced
    rows. They survive a change of dtype or light quantisation (compared by correlation, [`same_fingerprint`]),
    and cost one small matmul, unlike a hash of 100+ MB of weights."""
    numbers = []
    for module in (target.get_input_embeddings(), target.get_output_embeddings()):
        weight = module.weight.detach()
        picked = torch.linspace(0, weight.shape[0] - 1, rows, device=weight.device).long()
        direction = torch.randn(weight.shape[1], generator=torch.Generator().manual_seed(0))
        numbers += (weight[picked].float().cpu() @ direction / math.sqrt(weight.shape[1])).tolist()
    return [round(x, 5) for x in numbers]


def same_fingerprint(a: list[float], b: list[float]) -> bool:
    """Whether two fingerprints come from the same weights, up to dtype rounding and quantisation noise."""
    x, y = torch.tensor(a, dtype=torch.float64), torch.tensor(b, dtype=torch.float64)
    if x.shape != y.shape:
        return False
    x, y = x - x.mean(), y - y.mean()
    return float((x * y).sum()) >= 0.9 * float(x.norm() * y.norm())


def attention_heads(t) -> tuple[int, int]:
    """A target's text config -> (key/value heads, head size) of its attention: the heads themselves where the config
    names no GQA, hidden_size / heads where it names no head size."""
    return (getattr(t, "num_key_value_heads", None) or t.num_attention_heads,
            getattr(t, "head_dim", None) or t.hidden_size // t.num_attention_heads)


def fields_from_target(target: PreTrainedModel, num_hidden_layers: int) -> dict[str, Any]:
    """The DSparkConfig fields that size a draft of `num_hidden_layers` layers for `target` (see
    `DSparkDraftModel.from_target`): its geometry, feature layers, mask token, RoPE, vocabulary and fingerprint."""
    refuse_a_model_without_an_lm_head(target)
    t = target.config.get_text_config()
    refuse_unreadable_target(t)
    lo = min(1, t.num_hidden_layers - 2)
    hi = max(lo, t.num_hidden_layers - 3)
    layer_ids = sorted({round(lo + i * (hi - lo) / max(num_hidden_layers - 1, 1)) for i in range(num_hidden_layers)})
    vocab = target.get_output_embeddings().weight.shape[0]
    specials = {i for i in _as_list(t.eos_token_id) + _as_list(getattr(t, "bos_token_id", None))}
    pad = getattr(t, "pad_token_id", None)
    mask_token_id = pad if pad is not None and pad not in specials and pad < vocab else vocab - 1
    rope = getattr(t, "rope_parameters", None) or {}
    if "full_attention" in rope:  # per-layer-type rope parameters (Gemma3)
        rope = rope["full_attention"]
    kv_heads, head_dim = attention_heads(t)
    return dict(
        mask_token_id=mask_token_id,
        target_layer_ids=layer_ids,
        hidden_size=t.hidden_size,
        intermediate_size=next((v for v in (getattr(t, name, None) for name in _INTERMEDIATE_NAMES)
                                if v is not None), 4 * t.hidden_size),
        num_hidden_layers=num_hidden_layers,
        num_attention_heads=t.num_attention_heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        hidden_act=getattr(t, "hidden_activation", None) or getattr(t, "hidden_act", "silu"),
        rms_norm_eps=getattr(t, "rms_norm_eps", 1e-6),
        rope_theta=rope.get("rope_theta", getattr(t, "rope_theta", 10000.0)),
        max_position_embeddings=getattr(t, "max_position_embeddings", 8192),
        qk_norm=True,  # whatever the target's family: the draft layers vLLM, SGLang and llama.cpp serve norm q and k
        target_model_type=t.model_type,
        target_name_or_path=getattr(target.config, "_name_or_path", None) or None,
        target_vocab_size=vocab,
        target_hidden_size=t.hidden_size,
        target_num_hidden_layers=t.num_hidden_layers,
        target_fingerprint=target_fingerprint(target),
        final_logit_softcapping=getattr(t, "final_logit_softcapping", None),
        **special_tokens(target),
    )


SPECIAL_TOKENS = ("bos_token_id", "eos_token_id", "pad_token_id")


def special_tokens(target: PreTrainedModel) -> dict[str, Any]:
    """The target's BOS, EOS and pad ids, as its text config holds them: what transformers' pipeline compares
    between a model and its assistant (`load_assistant_model`), so a draft carries its target's."""
    t = target.config.get_text_config()
    return {name: getattr(t, name, None) for name in SPECIAL_TOKENS}


def check_target(c: DSparkConfig, target: PreTrainedModel) -> None:
    """Raise a ValueError that says what differs if a draft of config `c` was not built for `target`; warn when the
    target has its shape but another model type or other weights."""
    refuse_a_model_without_an_lm_head(target)
    t = target.config.get_text_config()
    refuse_unreadable_target(t)
    out = target.get_output_embeddings()
    problems = []
    if out.weight.shape[0] != c.target_vocab_size:
        problems.append(f"vocabulary size {out.weight.shape[0]} != {c.target_vocab_size} the draft was built for")
    if t.hidden_size != c.hidden_size:
        problems.append(f"hidden size {t.hidden_size} != {c.hidden_size}")
    bad = unreadable_layers(c.target_layer_ids, t.num_hidden_layers)
    if bad:
        problems.append(f"target_layer_ids {bad} do not exist below the last of its {t.num_hidden_layers} "
                        "layers")
    if c.mask_token_id is None or not 0 <= c.mask_token_id < c.target_vocab_size:
        problems.append(f"mask_token_id {c.mask_token_id} is not a token of the target vocabulary")
    if problems:
        raise ValueError(
            f"This DSpark draft was built for {c.target_name_or_path or c.target_model_type or 'another target'}"
            f" and does not fit {getattr(target.config, '_name_or_path', '') or t.model_type}: "
            + "; ".join(problems)
            + ". Use a draft trained for this target, or make one with DSparkDraftModel.from_target(target).")
    # stacklevel 4: the caller of bind_target (or of check_target), past the draft's method and this function
    if c.target_model_type is not None and c.target_model_type != t.model_type:
        warnings.warn(f"Draft built for a {c.target_model_type!r} target is bound to a {t.model_type!r} target "
                      "with the same geometry; acceptance will likely be poor.", stacklevel=4)
    elif c.target_fingerprint and not same_fingerprint(c.target_fingerprint, target_fingerprint(target)):
        warnings.warn(OtherTargetWarning(
            f"This DSpark draft was built for {c.target_name_or_path or 'another target'}, and "
            f"{getattr(target.config, '_name_or_path', '') or 'this target'} has the same shape but other "
            "embedding and LM head weights: output stays lossless, but the draft will be accepted rarely. Use "
            "a draft trained for this target."), stacklevel=4)


# where target configs keep their MLP width (GPT-2 and GPT-J: n_inner, None meaning 4 x hidden; Falcon: ffn_hidden_size)
_INTERMEDIATE_NAMES = ("intermediate_size", "n_inner", "ffn_hidden_size", "ffn_dim")
# layers whose recurrent or convolutional state cannot be cut back to the accepted prefix of a verified block
_STATEFUL_LAYER_TYPES = {"linear_attention", "conv", "hybrid", "hybrid_sliding", "mamba"}
# targets whose decoder layers pass more than one hidden stream between them, so no single layer output is the
# "hidden state" a draft reads (Gemma3n's AltUp predicts and corrects several streams, plus per-layer inputs)
_MULTI_STREAM_MODEL_TYPES = {"gemma3n_text": "AltUp layers that carry several hidden streams and per-layer inputs"}


def refuse_a_model_without_an_lm_head(target) -> None:
    """A draft borrows its target's LM head: a model without one (a DSpark draft, a base model) is no target."""
    if isinstance(getattr(target, "config", None), DSparkConfig):
        raise ValueError("This model is a DSpark draft, not a target: pass the causal LM it drafts for, e.g. "
                         "AutoModelForCausalLM.from_pretrained(...), as the target.")
    if target.get_output_embeddings() is None:
        raise ValueError(f"A {type(target).__name__} has no LM head (get_output_embeddings() is None), so it cannot "
                         "be a DSpark target: load the causal LM with its head, e.g. with "
                         "AutoModelForCausalLM.from_pretrained (not AutoModel).")


def refuse_unreadable_target(t) -> None:
    """A target text config `t` whose layers a draft cannot read, or whose state cannot be cut back, is refused."""
    stateful = sorted(set(getattr(t, "layer_types", None) or ()) & _STATEFUL_LAYER_TYPES)
    if stateful:
        raise ValueError(f"A {t.model_type} target has {', '.join(stateful)} layers, whose recurrent or convolutional "
                         "state cannot be cut back to the accepted part of a verified block: DSpark needs a target "
                         "whose layers are all attention.")
    if t.model_type in _MULTI_STREAM_MODEL_TYPES:
        raise ValueError(f"A {t.model_type} target has {_MULTI_STREAM_MODEL_TYPES[t.model_type]}, which a DSpark "
                         "draft cannot read as one hidden state per layer: DSpark needs a target whose layers each "
                         "pass one hidden state on (Llama, Qwen, Gemma 1-3, Mistral, ...).")


def _as_list(x) -> list:
    if x is None:
        return []
    return list(x) if isinstance(x, (list, tuple)) else [x]


# -- sharing ------------------------------------------------------------------------------------------------------
def sharing():
    """What saving, pushing and an offline load miss hand over to: `dspark_hf.hub` where dspark-hf is loaded (it
    always is where this file runs as part of the package: ``import dspark_hf`` loads it), else None (this file as
    remote code in a process without dspark-hf). Looked up when needed, never imported from here: the model sits
    below the Hub code, which imports it."""
    return sys.modules.get(SHARING_MODULE)


def refuse_card_data(card_data) -> None:
    """A card needs dspark-hf to render it: without it, passing `card_data` is refused rather than ignored."""
    if card_data is not None:
        raise ImportError("card_data needs dspark-hf to render the model card: pip install dspark-hf")

"""Configuration of a DSpark draft model (DSpark, DeepSeek 2026, sec. 2.2 and 3.1-3.2.1)."""

import math
import numbers
from dataclasses import field

from transformers import PreTrainedConfig
from transformers.activations import ACT2FN

HEAD_TYPES = ("markov", "rnn", "none")
_SIZES = ("block_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
          "num_key_value_heads", "max_position_embeddings")


def unreadable_layers(layer_ids, num_target_layers: int) -> list[int]:
    """The ids in `layer_ids` a draft cannot read features from: a target layer is readable from 0 to the
    second-to-last (HF returns the last layer's output after the final norm)."""
    return [i for i in layer_ids if not 0 <= i < num_target_layers - 1]


class DSparkConfig(PreTrainedConfig):
    r"""
    Configuration of a [`DSparkDraftModel`]: a parallel draft backbone that reads a target model's hidden states
    (context injection), plus a light sequential head (Markov or RNN) and a confidence head.

    The draft shares the target's frozen embedding table and LM head, so its hidden size equals the target's. The
    target geometry fields record which target the draft was built for, so that binding it to another one fails
    with a clear error instead of drafting garbage.

    Use [`DSparkDraftModel.from_target`] to size a fresh draft for a target; pass any field as an override.
    """

    model_type = "dspark"

    # --- drafting -------------------------------------------------------------------------------------------
    block_size: int = field(
        default=7,
        metadata={"help": "Inputs per drafted block, anchor included (anchor + block_size - 1 mask tokens). "
                  "The draft proposes block_size tokens per round; up to block_size + 1 are committed."},
    )
    trained_block_size: int | None = field(
        default=None,
        metadata={"help": "The block_size the draft's weights were trained with (written by `dspark train` and the "
                  "converters; None: never trained). A draft loaded with another block_size warns: its block "
                  "positions were learned for blocks of this size."},
    )
    anchor_predicts: bool = field(
        default=True,
        metadata={"help": "True (DSpark): the anchor row's output predicts the first draft token. False (DFlash "
                  "checkpoints): the block gets one more mask row and each mask row predicts its own position; "
                  "the anchor row only conditions the others. Either way block_size tokens are drafted."},
    )
    mask_token_id: int | None = field(
        default=None,
        metadata={"help": "Target-vocabulary id whose (frozen) embedding fills the non-anchor block positions. "
                  "Pick a reserved or unused token."},
    )
    target_layer_ids: list[int] | None = field(
        default=None,
        metadata={"help": "Target decoder layers whose outputs feed the draft (HF hidden_states[i + 1]). "
                  "Never the last layer: HF returns it after the final norm."},
    )
    head_type: str = field(
        default="markov",
        metadata={"help": "Sequential head: 'markov' (eq. 5, low-rank first-order transition bias), 'rnn' "
                  "(eq. 6, gated recurrent state over the block) or 'none' (DFlash-style parallel ablation)."},
    )
    markov_rank: int = field(
        default=128,
        metadata={"help": "Rank r of the transition factorisation B = W1 W2 (and RNN state size)."},
    )
    confidence_head: bool = field(
        default=True,
        metadata={"help": "Whether to predict c_k, the probability that draft position k survives verification "
                  "given that positions 1..k-1 did (eq. 7)."},
    )
    confidence_temperatures: list[float] | None = field(
        default=None,
        metadata={"help": "Per-position temperatures from Sequential Temperature Scaling (sec. 3.2.1); "
                  "c_k = sigmoid(logit_k / T_k). None means uncalibrated (all 1)."},
    )
    draft_vocab_size: int | None = field(
        default=None,
        metadata={"help": "If set, the draft proposes only this many target tokens (ids kept in the "
                  "`draft_vocab` buffer), which shrinks the draft-side LM head and sequential head. None: the "
                  "full target vocabulary. Losslessness does not depend on it."},
    )
    # --- the draft's own transformer --------------------------------------------------------------------------
    hidden_size: int = field(default=576, metadata={"help": "Must equal the target's hidden size."})
    intermediate_size: int = field(default=1536, metadata={"help": "MLP width of each draft layer."})
    num_hidden_layers: int = field(default=2, metadata={"help": "Draft decoder layers."})
    num_attention_heads: int = field(default=9, metadata={"help": "Query heads per draft layer."})
    num_key_value_heads: int = field(default=3, metadata={"help": "Key/value heads per draft layer (GQA)."})
    head_dim: int | None = field(default=None, metadata={"help": "Per-head size; default hidden/heads."})
    hidden_act: str = field(default="silu", metadata={"help": "MLP activation (gated)."})
    rms_norm_eps: float = field(default=1e-5, metadata={"help": "RMSNorm epsilon."})
    rope_theta: float = field(default=10000.0, metadata={"help": "RoPE base for the draft's own attention."})
    max_position_embeddings: int = field(default=8192, metadata={"help": "Longest context the draft expects."})
    attention_bias: bool = field(default=False, metadata={"help": "Bias on q/k/v/o projections."})
    qk_norm: bool = field(
        default=False, metadata={"help": "Per-head RMSNorm on queries and keys (as Qwen3 / Gemma3 targets do)."}
    )
    initializer_range: float = field(default=0.02, metadata={"help": "Std of the normal weight init."})
    # --- the target it was built for ----------------------------------------------------------------------------
    target_model_type: str | None = field(default=None, metadata={"help": "config.model_type of the target."})
    target_name_or_path: str | None = field(default=None, metadata={"help": "Hub id or path of the target."})
    target_vocab_size: int | None = field(default=None, metadata={"help": "Target vocabulary size."})
    target_hidden_size: int | None = field(default=None, metadata={"help": "Target hidden size."})
    target_num_hidden_layers: int | None = field(default=None, metadata={"help": "Target decoder layers."})
    target_fingerprint: list[float] | None = field(
        default=None,
        metadata={"help": "Projections of sampled rows of the target's embedding and LM head, recorded when the draft "
                  "is built; binding to a target whose projections do not match warns (see `target_fingerprint`)."},
    )
    bos_token_id: int | None = field(
        default=None,
        metadata={"help": "The target's BOS id, taken from it when the draft is built or bound: transformers' "
                  "pipeline(assistant_model=draft) compares a draft's special tokens with its target's."},
    )
    eos_token_id: int | list[int] | None = field(
        default=None, metadata={"help": "The target's EOS id(s), taken from it (see bos_token_id)."}
    )
    pad_token_id: int | None = field(
        default=None, metadata={"help": "The target's pad id, taken from it (see bos_token_id)."}
    )
    final_logit_softcapping: float | None = field(
        default=None,
        metadata={"help": "The target's final-logit soft cap (Gemma), applied to the draft's base logits "
                  "before the transition bias."},
    )
    tie_word_embeddings: bool = field(
        default=False, metadata={"help": "Unused: the draft owns no embedding or LM head."}
    )

    def __post_init__(self, **kwargs):
        self._check_sizes()
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.confidence_temperatures is not None:
            self.confidence_temperatures = [float(t) for t in self.confidence_temperatures]
        super().__post_init__(**kwargs)
        self.validate_dspark()

    @classmethod
    def from_dict(cls, config_dict: dict, **kwargs):
        """As transformers' `from_dict`, refusing another model's config, and checking the keyword overrides that
        transformers sets after construction."""
        model_type = config_dict.get("model_type", cls.model_type)
        if model_type != cls.model_type:
            raise ValueError(f"This is the config of a {model_type!r} model, not of a DSpark draft: load a folder or "
                             "Hub repo written by DSparkDraftModel.save_pretrained (`dspark convert` turns DeepSpec, "
                             "SpecForge and DFlash drafts into one).")
        loaded = super().from_dict(config_dict, **kwargs)
        (loaded[0] if isinstance(loaded, tuple) else loaded).validate_dspark()
        return loaded

    @property
    def vocab_size(self) -> int | None:
        return self.target_vocab_size

    @vocab_size.setter
    def vocab_size(self, value):
        raise ValueError(f"A DSpark draft has no vocabulary of its own (vocab_size={value}): it proposes its target's "
                         "tokens (target_vocab_size), or a subset of them (draft_vocab_size).")

    def block_size_note(self) -> str | None:
        """Why a block_size other than the trained one costs acceptance, or None when they agree (or it is unknown)."""
        trained, size = self.trained_block_size, self.block_size
        if trained is None or trained == size:
            return None
        return (f"This DSpark draft was trained with block_size {trained} but its config says {size}: its block "
                f"positions were learned for blocks of {trained}, so its drafts will be accepted less (output stays "
                f"lossless){', and positions past ' + str(trained) + ' were never trained' if size > trained else ''}."
                f" Set block_size back to {trained}, or train it at {size} (`dspark train --block-size {size}`).")

    def _check_sizes(self):
        named = _SIZES + tuple(name for name in ("head_dim", "draft_vocab_size", "markov_rank")
                               if getattr(self, name) is not None)
        for name in named:
            value, low = getattr(self, name), 0 if name == "markov_rank" else 1  # rank 0: no head (head_type='none')
            if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < low:
                raise ValueError(f"{name} must be an int >= {low}, got {value!r}.")

    def validate_dspark(self):
        """Raise a ValueError naming the field and the fix for settings that cannot work."""
        self._check_sizes()
        if self.head_type not in HEAD_TYPES:
            raise ValueError(f"head_type={self.head_type!r} is not one of {HEAD_TYPES}.")
        if self.head_type != "none" and self.markov_rank < 1:
            raise ValueError(f"markov_rank must be >= 1 for head_type={self.head_type!r}; use head_type='none' "
                             "for a head-less draft.")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                             f"num_key_value_heads ({self.num_key_value_heads}).")
        if self.target_layer_ids is not None:
            if len(self.target_layer_ids) == 0:
                raise ValueError("target_layer_ids must name at least one target layer.")
            if self.target_num_hidden_layers is not None:
                bad = unreadable_layers(self.target_layer_ids, self.target_num_hidden_layers)
                if bad:
                    raise ValueError(
                        f"target_layer_ids {bad} are out of range for a target with {self.target_num_hidden_layers} "
                        f"layers: use ids in [0, {self.target_num_hidden_layers - 2}] (never the last layer, which "
                        "HF returns after the final norm).")
        if self.confidence_temperatures is not None:
            if len(self.confidence_temperatures) != self.block_size:
                n = len(self.confidence_temperatures)
                raise ValueError(f"block_size is {self.block_size} but confidence_temperatures has {n} entries, one "
                                 f"per block position of the block size they were calibrated for: set block_size back "
                                 f"to {n}, or set confidence_temperatures to null and calibrate the draft for "
                                 f"block_size {self.block_size} (`dspark calibrate`).")
            if not all(math.isfinite(t) and t > 0 for t in self.confidence_temperatures):
                raise ValueError(f"confidence_temperatures must be finite and > 0, got {self.confidence_temperatures} "
                                 "(None: uncalibrated).")
        if self.hidden_act not in ACT2FN:
            raise ValueError(f"hidden_act={self.hidden_act!r} is not an activation transformers knows (e.g. 'silu', "
                             "'gelu_pytorch_tanh').")
        if not self.rms_norm_eps > 0:
            raise ValueError(f"rms_norm_eps must be > 0, got {self.rms_norm_eps}.")
        vocab, draft_vocab = self.target_vocab_size, self.draft_vocab_size
        if vocab is not None and draft_vocab is not None and draft_vocab > vocab:
            raise ValueError(f"draft_vocab_size ({self.draft_vocab_size}) cannot exceed the target's vocabulary "
                             f"({self.target_vocab_size}).")
        if self.target_hidden_size is not None and self.target_hidden_size != self.hidden_size:
            raise ValueError(f"hidden_size ({self.hidden_size}) must equal target_hidden_size "
                             f"({self.target_hidden_size}): the draft shares the target's embedding and LM head.")


__all__ = ["DSparkConfig"]

"""DSpark draft model: a parallel backbone with target-context injection, a sequential head and a confidence head.

Notation follows the DSpark paper (DeepSeek, 2026):

- the *anchor* x_0 is the last committed token; a block feeds [x_0, m, ..., m] (``block_size`` = gamma inputs, m the
  mask token) through the backbone and gets gamma hidden states h_1..h_gamma; position k predicts the token at
  anchor + k (eq. 4 with the anchor-first layout of sec. 3.1); converted DFlash drafts (``anchor_predicts=False``)
  feed gamma + 1 inputs and read h_1..h_gamma from the mask rows, the anchor row's output unused;
- the backbone reads the target's hidden states of the committed context: concat of ``target_layer_ids`` features
  -> fc -> RMSNorm (eq. 2), projected by each layer's own k/v weights (eq. 3). Context rows are never queries;
  block rows attend to the context before the anchor and bidirectionally to each other;
- U_k are base logits from the target's frozen LM head, B_k a transition bias from the sequential head (eq. 5, 6),
  p_k = softmax(U_k + B_k) and c_k the confidence (eq. 7).

What the draft takes from outside itself (its target's embedding and LM head, the checks that a target fits, and
dspark-hf's Hub code for saving) is `binding.py`'s. This file imports nothing from dspark_hf but its configuration
and that module, which are saved beside it, so a saved draft loads with ``trust_remote_code=True`` where dspark_hf
is not installed.
"""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass
from dataclasses import fields as dataclass_fields
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F
from safetensors import SafetensorError
from torch import nn
from transformers import PreTrainedModel
from transformers.activations import ACT2FN
from transformers.utils import ModelOutput

from .binding import BlockSizeWarning, TargetBinding, check_target, fields_from_target, refuse_card_data, sharing, \
    special_tokens
from .configuration_dspark import DSparkConfig


# ---------------------------------------------------------------------------------------------------------------
# building blocks
# ---------------------------------------------------------------------------------------------------------------
class DSparkRMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class DSparkRotaryEmbedding(nn.Module):
    def __init__(self, config: DSparkConfig):
        super().__init__()
        self.dim, self.theta = config.head_dim, config.rope_theta

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions (N, T) -> cos, sin (N, 1, T, head_dim)."""
        # computed here rather than kept as a non-persistent buffer: from_pretrained materialises models from
        # the meta device and leaves such buffers uninitialised
        exponent = torch.arange(0, self.dim, 2, dtype=torch.float, device=positions.device) / self.dim
        inv_freq = 1.0 / (self.theta ** exponent)
        freqs = positions.float()[..., None] * inv_freq
        emb = torch.cat([freqs, freqs], dim=-1)[:, None]
        return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


class DSparkAttention(nn.Module):
    """Block queries over keys/values = cat(context, block) (eq. 3)."""

    def __init__(self, config: DSparkConfig):
        super().__init__()
        d, hd = config.hidden_size, config.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_attention_heads, config.num_key_value_heads, hd
        self.q_proj = nn.Linear(d, self.num_heads * hd, bias=config.attention_bias)
        self.k_proj = nn.Linear(d, self.num_kv_heads * hd, bias=config.attention_bias)
        self.v_proj = nn.Linear(d, self.num_kv_heads * hd, bias=config.attention_bias)
        self.o_proj = nn.Linear(self.num_heads * hd, d, bias=config.attention_bias)
        self.q_norm = DSparkRMSNorm(hd, config.rms_norm_eps) if config.qk_norm else nn.Identity()
        self.k_norm = DSparkRMSNorm(hd, config.rms_norm_eps) if config.qk_norm else nn.Identity()

    def _heads(self, x: torch.Tensor, n: int) -> torch.Tensor:
        return x.view(*x.shape[:2], n, self.head_dim).transpose(1, 2)

    def key_value(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x (N, T, d) -> k, v (N, H_kv, T, head_dim), RoPE applied to k."""
        k = self.k_norm(self._heads(self.k_proj(x), self.num_kv_heads))
        v = self._heads(self.v_proj(x), self.num_kv_heads)
        return apply_rope(k, cos, sin), v

    def forward(self, x, cos, sin, context_k, context_v, mask) -> torch.Tensor:
        """x (N, Q, d) block rows; context_k/v (N, H_kv, C, hd); mask (N, Q, C + Q) bool, True = may attend."""
        q = apply_rope(self.q_norm(self._heads(self.q_proj(x), self.num_heads)), cos, sin)
        k, v = self.key_value(x, cos, sin)
        k, v = torch.cat([context_k, k], dim=2), torch.cat([context_v, v], dim=2)
        # keys/values repeated per query head rather than enable_gqa=True: with a mask, CUDA's memory-efficient kernel
        # takes no grouped heads and SDPA would fall back to its math backend, which holds all Q x K scores
        groups = self.num_heads // self.num_kv_heads
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None])
        return self.o_proj(out.transpose(1, 2).reshape(*x.shape[:2], -1))


class DSparkMLP(nn.Module):
    def __init__(self, config: DSparkConfig):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)
        self.act = ACT2FN[config.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class DSparkDecoderLayer(nn.Module):
    def __init__(self, config: DSparkConfig):
        super().__init__()
        self.input_layernorm = DSparkRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = DSparkAttention(config)
        self.post_attention_layernorm = DSparkRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = DSparkMLP(config)

    def forward(self, x, cos, sin, context_k, context_v, mask) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, context_k, context_v, mask)
        return x + self.mlp(self.post_attention_layernorm(x))


# ---------------------------------------------------------------------------------------------------------------
# context and outputs
# ---------------------------------------------------------------------------------------------------------------
@dataclass
class DSparkContext:
    """The injected target context, already projected into every draft layer's keys and values.

    keys/values: one (N, H_kv, C, head_dim) tensor per draft layer; positions (N, C) absolute token positions;
    valid (N, C) bool, False for padding. Entries may be in any order: RoPE is baked into the keys, and a block
    attends to the valid entries whose position is before its anchor.
    """

    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    positions: torch.Tensor
    valid: torch.Tensor

    @property
    def length(self) -> int:
        return self.positions.shape[1]

    def map(self, fn: Callable[[torch.Tensor, int], torch.Tensor]) -> "DSparkContext":
        """Apply fn(tensor, seq_dim) to every tensor, e.g. to crop, shift or select rows consistently."""
        return DSparkContext(
            keys=[fn(k, 2) for k in self.keys],
            values=[fn(v, 2) for v in self.values],
            positions=fn(self.positions, 1),
            valid=fn(self.valid, 1),
        )

    def cat(self, other: "DSparkContext") -> "DSparkContext":
        return DSparkContext(
            keys=[torch.cat(p, 2) for p in zip(self.keys, other.keys)],
            values=[torch.cat(p, 2) for p in zip(self.values, other.values)],
            positions=torch.cat([self.positions, other.positions], 1),
            valid=torch.cat([self.valid, other.valid], 1),
        )


@dataclass
class DSparkOutput(ModelOutput):
    """Teacher-forced outputs over blocks: logits (N, A, gamma, V_draft) = U + B; confidence_logits (N, A, gamma)
    (pre-sigmoid, uncalibrated); hidden_states (N, A, gamma, d) after the final norm."""

    logits: torch.Tensor | None = None
    confidence_logits: torch.Tensor | None = None
    hidden_states: torch.Tensor | None = None


# ---------------------------------------------------------------------------------------------------------------
# the model
# ---------------------------------------------------------------------------------------------------------------
class DSparkPreTrainedModel(PreTrainedModel):
    config_class = DSparkConfig
    config: DSparkConfig
    base_model_prefix = "dspark"
    _no_split_modules = ["DSparkDecoderLayer"]
    _supports_sdpa = True
    # weights start as transformers' _init_weights starts them: normal linear and embedding weights, and norms
    # (DSparkRMSNorm, found by its name) at 1


class DSparkDraftModel(DSparkPreTrainedModel):
    """DSpark draft model. Owns the backbone, the sequential head and the confidence head; borrows the target's
    frozen input embedding and LM head through [`bind_target`] (they are never saved with the draft)."""

    def __init__(self, config: DSparkConfig):
        super().__init__(config)
        if config.target_layer_ids is None or config.target_vocab_size is None:
            raise ValueError("DSparkConfig needs target_layer_ids and target_vocab_size: build the draft with "
                             "DSparkDraftModel.from_target(target) or load a saved one with from_pretrained.")
        if note := config.block_size_note():
            warnings.warn(BlockSizeWarning(note), stacklevel=3)
        self.binding: TargetBinding | None = None  # set by bind_target
        d, r = config.hidden_size, config.markov_rank
        feature_size = len(config.target_layer_ids) * (config.target_hidden_size or d)
        self.fc = nn.Linear(feature_size, d, bias=False)
        self.context_norm = DSparkRMSNorm(d, config.rms_norm_eps)
        self.layers = nn.ModuleList(DSparkDecoderLayer(config) for _ in range(config.num_hidden_layers))
        self.norm = DSparkRMSNorm(d, config.rms_norm_eps)
        self.rotary_emb = DSparkRotaryEmbedding(config)

        vocab = config.draft_vocab_size or config.target_vocab_size
        if config.draft_vocab_size is not None:
            # target id -> draft index; ids outside the draft vocabulary share one extra row of W1
            self.register_buffer("draft_vocab", torch.arange(vocab), persistent=True)
            self.register_buffer("target_to_draft", torch.full((config.target_vocab_size,), vocab), persistent=True)
            self.target_to_draft[self.draft_vocab] = torch.arange(vocab)
        uses_prev_token = config.head_type != "none"
        self.w1 = nn.Embedding(vocab + (config.draft_vocab_size is not None), r) if uses_prev_token else None
        self.w2 = nn.Linear(r, vocab, bias=False) if uses_prev_token else None
        self.rnn_proj = nn.Linear(2 * r + d, 3 * r) if config.head_type == "rnn" else None
        self.confidence = nn.Linear(d + (r if uses_prev_token else 0), 1) if config.confidence_head else None
        self.set_confidence_temperatures(config.confidence_temperatures)
        self.post_init()

    # -- target binding ------------------------------------------------------------------------------------------
    @classmethod
    def from_target(cls, target: PreTrainedModel, **overrides) -> "DSparkDraftModel":
        """A fresh, untrained draft sized for `target` (any HF decoder-only causal LM), already bound to it.

        Feature layers follow the reference rule (one per draft layer, spread uniformly over [1, L - 3]); the mask
        token is the target's pad token when it is not also EOS/BOS, else the last vocabulary id. The shape is
        DSparkConfig's defaults (the one default shape: 2 layers, a Markov head of rank 128, blocks of 7); every
        config field can be overridden, e.g. ``from_target(target, num_hidden_layers=1, markov_rank=16)``.
        """
        fields = fields_from_target(target, overrides.get("num_hidden_layers", DSparkConfig.num_hidden_layers))
        unknown = sorted(set(overrides) - {f.name for f in dataclass_fields(DSparkConfig)} - {"draft_vocab"})
        if unknown:
            # a TypeError as for any unexpected keyword (this file ships beside drafts for trust_remote_code, so it
            # imports nothing of the package outside the model folder, dspark_hf.errors included)
            raise TypeError(f"from_target() got fields that DSparkConfig does not have: {unknown}.")
        fields.update(overrides)
        draft_vocab = fields.pop("draft_vocab", None)
        if draft_vocab is not None:
            fields["draft_vocab_size"] = len(draft_vocab)
        draft = cls(DSparkConfig(**fields)).to(device=target.device, dtype=target.dtype)
        if draft_vocab is not None:
            draft.set_draft_vocab(torch.as_tensor(draft_vocab))
        return draft.bind_target(target)

    def set_draft_vocab(self, ids: torch.Tensor) -> None:
        """Set the target ids the draft may propose (requires ``draft_vocab_size == len(ids)``)."""
        ids = ids.to(self.draft_vocab.device, torch.long)
        if ids.shape != self.draft_vocab.shape:
            raise ValueError(f"the draft vocabulary holds {self.draft_vocab.numel()} ids (draft_vocab_size), got "
                             f"{ids.numel()}.")
        if ids.unique().numel() != ids.numel():
            raise ValueError(f"the draft vocabulary's ids must be distinct; {ids.numel() - ids.unique().numel()} "
                             "are repeated.")
        V = self.config.target_vocab_size
        if bool(((ids < 0) | (ids >= V)).any()):
            raise ValueError(f"the draft vocabulary's ids must be target ids in [0, {V}), got "
                             f"{ids[(ids < 0) | (ids >= V)].tolist()[:5]}.")
        self.draft_vocab.copy_(ids)
        self.target_to_draft.fill_(ids.numel())
        self.target_to_draft[ids] = torch.arange(ids.numel(), device=ids.device)
        if self.binding is not None:
            self.binding.lm_weight = None

    def check_target(self, target: PreTrainedModel) -> None:
        """Raise a ValueError that says what differs if this draft was not built for `target` (and warn when it has
        the draft's shape but another model type or other weights: [`OtherTargetWarning`])."""
        check_target(self.config, target)

    def bind_target(self, target: PreTrainedModel) -> "DSparkDraftModel":
        """Borrow the target's frozen input embedding and LM head (not registered as submodules, never saved), and
        take its special token ids where the config has none (drafts saved before the config carried them)."""
        self.check_target(target)
        self.binding = TargetBinding.of(target)
        for name, value in special_tokens(target).items():
            if getattr(self.config, name) is None:
                setattr(self.config, name, value)
        return self

    def is_bound_to(self, target: PreTrainedModel) -> bool:
        return self.binding is not None and self.binding.serves(target)

    def _require_target(self):
        if self.binding is None:
            raise RuntimeError("This draft is not bound to a target: call draft.bind_target(target) first (generate() "
                               "does it for you).")

    # -- saving and sharing --------------------------------------------------------------------------------------
    # What dspark_hf adds to plain transformers here (a model card written beside the weights, a clearer error when
    # an offline load misses the cache) lives in dspark_hf.hub, which the draft hands over to (`binding.sharing`).
    # This file also runs alone, as remote code where dspark_hf is absent: then there is none and saving is plain.

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *args, output_loading_info: bool = False, **kwargs):
        """transformers' `from_pretrained` (hub ids, revisions, cache, tokens); under ``HF_HUB_OFFLINE=1`` a draft
        missing from the cache raises an error that says so (`dspark_hf.hub.offline_load_error`). A checkpoint that
        lacks any of the draft's tensors is refused: a draft has no optional weights, and transformers would start
        the missing ones random (or, for the draft-vocabulary buffers, uninitialised). So is one with tensors its
        config has no place for, or of other shapes (even with ``ignore_mismatched_sizes=True``)."""
        given = pretrained_model_name_or_path
        # a path is looked up on the Hub when it does not exist: a minute of retries offline, then a network error
        if (isinstance(given, os.PathLike) or str(given).startswith(("/", ".", "~"))) \
                and not Path(given).expanduser().exists():
            raise OSError(f"{given}: no such folder: give the folder a draft was saved to (save_pretrained), or a "
                          "Hub id.")
        folder = Path(given, kwargs.get("subfolder") or "").expanduser() if isinstance(given, (str, os.PathLike)) \
            else None
        if folder is not None and folder.is_dir() and not (folder / "config.json").exists() \
                and kwargs.get("config") is None:
            # transformers would build a default DSparkConfig and fail on its missing target fields
            raise OSError(f"{given} holds no config.json, so it is not a saved DSpark draft: give the folder "
                          "save_pretrained wrote (config.json and model.safetensors), or build a new draft with "
                          "DSparkDraftModel.from_target(target).")
        try:
            model, info = super().from_pretrained(pretrained_model_name_or_path, *args, output_loading_info=True,
                                                  **kwargs)
        except SafetensorError as error:
            raise damaged_weights_error(pretrained_model_name_or_path, error) from error
        except OSError as error:
            hub = sharing()
            clearer = None if hub is None else hub.offline_load_error(pretrained_model_name_or_path, kwargs)
            if clearer is None:
                raise
            raise clearer from error
        name = pretrained_model_name_or_path
        missing = sorted(info["missing_keys"])
        if missing:
            raise ValueError(f"{name} is not a complete DSpark draft: its weights lack {_first_five(missing)}, which "
                             "would load random. Load the folder or revision that holds all of them, or re-save the "
                             "draft with save_pretrained.")
        # weights the config has no place for, or of another shape, mean the config describes another draft (an
        # edited head_type, say): transformers drops the ones and, with ignore_mismatched_sizes, starts the others
        # random, and the draft then drafts something else without a word
        unexpected = sorted(info["unexpected_keys"])
        if unexpected:
            raise ValueError(f"{name} does not match its config: its weights hold {_first_five(unexpected)}, which a "
                             "draft with this config does not have and would drop. Load it with the config it was "
                             "saved with.")
        mismatched = sorted(info["mismatched_keys"])
        if mismatched:
            key, stored, expected = mismatched[0]
            more = f" (and {len(mismatched) - 1} more)" if len(mismatched) > 1 else ""
            raise ValueError(f"{name} does not match its config: its {key} is {tuple(stored)}, the config makes it "
                             f"{tuple(expected)}{more}, which ignore_mismatched_sizes would start random. Load it with "
                             "the config it was saved with.")
        # from the meta device transformers materialises non-persistent buffers uninitialised: set them again
        model.set_confidence_temperatures(model.config.confidence_temperatures)
        return (model, info) if output_loading_info else model

    def save_pretrained(self, save_directory, *args, model_card: bool = True, card_data=None, **kwargs):
        """transformers' `save_pretrained`, plus a README.md model card (`dspark_hf.hub.save_pretrained`): written
        unless the folder holds a README.md that dspark-hf did not generate, or ``model_card=False``. `card_data`
        (a `dspark_hf.cards.CardData` or dict: base_model, repo_id, eval_results, calibration, recipe, ...) feeds
        it. Without dspark_hf installed (remote code), no card is written. A config changed after the draft was
        built is checked first: from_pretrained would refuse it."""
        self.check_config()
        hub = sharing()
        if hub is None:
            refuse_card_data(card_data)
            return super().save_pretrained(save_directory, *args, **kwargs)
        return hub.save_pretrained(self, super().save_pretrained, save_directory, *args, model_card=model_card,
                                   card_data=card_data, **kwargs)

    def push_to_hub(self, repo_id: str, *, model_card: bool = True, card_data=None, **kwargs):
        """transformers' `push_to_hub` (same arguments), with the card of [`save_pretrained`] as README.md
        (`dspark_hf.hub.push_to_hub`; ``model_card=False`` leaves the Hub's README.md alone)."""
        self.check_config()
        hub = sharing()
        if hub is None:
            refuse_card_data(card_data)
            return super().push_to_hub(repo_id, **kwargs)
        return hub.push_to_hub(self, repo_id, model_card=model_card, card_data=card_data, **kwargs)

    @property
    def generation_config(self):
        """A draft does not generate on its own. transformers' assisted decoding reads this first: without dspark_hf
        (this file as remote code) that says what DSpark decoding needs, not that the attribute is missing."""
        if "_generation_config" in self.__dict__:
            return self.__dict__["_generation_config"]
        if sharing() is None:
            raise ImportError("Decoding with a DSpark draft needs dspark-hf: pip install dspark-hf, import dspark_hf, "
                              "then load the draft (DSparkDraftModel.from_pretrained or AutoModel) and pass it as "
                              "assistant_model.")
        raise AttributeError("generation_config")  # as for any model that cannot generate

    @generation_config.setter
    def generation_config(self, value) -> None:
        self.__dict__["_generation_config"] = value

    def __getattr__(self, name: str):
        # refused here rather than by a generate() method: transformers adds generation machinery to a remote-code
        # class that has one, and hasattr(draft, "generate") stays False as for any model that cannot generate
        if name == "generate":
            raise AttributeError("A DSpark draft does not generate on its own: it drafts for its target. Call "
                                 "target.generate(**inputs, assistant_model=draft) after import dspark_hf.")
        return super().__getattr__(name)

    def check_config(self) -> None:
        """Raise a ValueError naming the field and the fix where the config was changed since the draft was built
        into one from_pretrained would refuse (fields set after construction, ``draft.config.block_size = 4``, were
        never validated), or where its confidence_temperatures were assigned rather than set (the draft would
        calibrate with the old ones). generate() calls it as it starts, and save_pretrained and push_to_hub before
        they write."""
        try:
            self.config.validate_dspark()
        except ValueError as error:
            raise ValueError(f"The draft's config was changed into one from_pretrained would refuse: {error}") \
                from error
        temps = self.config.confidence_temperatures
        if (None if temps is None else tuple(temps)) != self._temperatures_set:
            raise ValueError("draft.config.confidence_temperatures was assigned, so the draft still calibrates with "
                             f"{None if self._temperatures_set is None else list(self._temperatures_set)}: set them "
                             "with draft.set_confidence_temperatures(temperatures).")

    # -- pieces of the forward pass ----------------------------------------------------------------------------
    @property
    def hidden_states_request(self) -> list[int]:
        """What to pass as the target's ``output_hidden_states`` so it returns only the layers the draft reads."""
        return [i + 1 for i in self.config.target_layer_ids]

    def target_features(self, hidden_states: tuple[torch.Tensor | None, ...]) -> torch.Tensor:
        """The target's ``hidden_states`` output -> features (N, T, m * d_t) in ``target_layer_ids`` order."""
        return torch.cat([hidden_states[i] for i in self.hidden_states_request], dim=-1)

    def encode_context(self, features: torch.Tensor, positions: torch.Tensor, valid: torch.Tensor) -> DSparkContext:
        """Target features (N, C, m * d_t) of committed tokens -> per-layer keys/values (eq. 2-3)."""
        h = self.context_norm(self.fc(features.to(self.fc.weight.dtype)))
        cos, sin = self.rotary_emb(positions, h.dtype)
        kv = [layer.self_attn.key_value(h, cos, sin) for layer in self.layers]
        return DSparkContext([k for k, _ in kv], [v for _, v in kv], positions, valid.bool())

    def empty_context(self, batch_size: int) -> DSparkContext:
        c, p = self.config, self.fc.weight
        empty = p.new_zeros(batch_size, c.num_key_value_heads, 0, c.head_dim)
        return DSparkContext([empty] * len(self.layers), [empty] * len(self.layers),
                             torch.zeros(batch_size, 0, dtype=torch.long, device=p.device),
                             torch.zeros(batch_size, 0, dtype=torch.bool, device=p.device))

    def backbone(self, anchor_ids: torch.Tensor, anchor_positions: torch.Tensor, context: DSparkContext,
                 known: torch.Tensor | None = None):
        """anchor_ids, anchor_positions (N, A) -> h (N, A, gamma, d): one block per anchor, all in one pass.

        known (N, A, lag), optional: committed tokens right before each anchor whose target features are not in
        the context (a *lagged* context, as when a block is prepared while the target still verifies them),
        right-aligned, -1 where a block has fewer. They enter the block as token rows ahead of the anchor, and the
        block sees only the context before the first of them."""
        self._require_target()
        N, A = anchor_ids.shape
        gamma = self.config.block_size
        lag = 0 if known is None else known.shape[-1]
        rows = gamma if self.config.anchor_predicts else gamma + 1  # DFlash layout: one more row, anchor output unused
        rows += lag
        block_ids = anchor_ids.new_full((N, A, rows), self.config.mask_token_id)
        block_ids[..., lag] = anchor_ids
        row_valid = torch.ones(N, A, rows, dtype=torch.bool, device=anchor_ids.device)
        if lag:
            block_ids[..., :lag] = known.clamp_min(0)
            row_valid[..., :lag] = known >= 0
        x = self.binding.embed(block_ids.view(N, A * rows)).to(self.fc.weight.dtype)
        offsets = torch.arange(-lag, rows - lag, device=anchor_ids.device)
        positions = (anchor_positions[..., None] + offsets).clamp_min(0).view(N, A * rows)
        cos, sin = self.rotary_emb(positions, x.dtype)

        first_known = anchor_positions - (row_valid[..., :lag].sum(-1) if lag else 0)  # (N, A)
        sees_before = first_known.repeat_interleave(rows, dim=1)  # (N, A * rows)
        sees_context = context.valid[:, None, :] & (context.positions[:, None, :] < sees_before[..., None])
        block_of_row = torch.arange(A, device=x.device).repeat_interleave(rows)
        sees_block = (block_of_row[:, None] == block_of_row[None, :]) & row_valid.view(N, 1, A * rows)
        mask = torch.cat([sees_context, sees_block], dim=-1)

        for layer, k, v in zip(self.layers, context.keys, context.values):
            x = layer(x, cos, sin, k, v, mask)
        return self.norm(x).view(N, A, rows, -1)[:, :, rows - gamma:]

    def base_logits(self, h: torch.Tensor) -> torch.Tensor:
        """U_k over the draft vocabulary, soft-capped like the target's final logits."""
        lm_head = self.binding.lm_head
        if self.config.draft_vocab_size is None and h.dtype == lm_head.weight.dtype:
            logits = lm_head(h)
        else:
            # the LM-head rows the draft proposes, in the draft's compute dtype (a bf16 draft may serve a fp32
            # target): sliced and converted once, not every pass. A compiled training step slices them in its graph
            # instead: filling the cache from inside it would fail the graph's guard on the cache, a recompile
            in_training_graph = torch.compiler.is_compiling() and torch.is_grad_enabled()
            w = None if in_training_graph else self.binding.lm_weight
            if w is None or w.device != h.device or w.dtype != h.dtype:
                w = lm_head.weight
                w = (w if self.config.draft_vocab_size is None else w[self.draft_vocab]).detach().to(h.dtype)
                if not in_training_graph:
                    self.binding.lm_weight = w
            logits = F.linear(h, w)
        cap = self.config.final_logit_softcapping
        return logits if cap is None else torch.tanh(logits / cap) * cap

    def prev_embedding(self, prev_ids: torch.Tensor) -> torch.Tensor:
        """W1[x_{k-1}] for target ids."""
        if self.config.draft_vocab_size is not None:
            prev_ids = self.target_to_draft[prev_ids]
        return self.w1(prev_ids)

    def transition(self, prev_emb, h, state):
        """Sequential head step: (bias B_k over the draft vocab, new state). prev_emb (.., r), h (.., d)."""
        if self.config.head_type == "markov":
            return self.w2(prev_emb), state
        z = torch.cat([state, prev_emb, h], dim=-1)
        gate, cand, out = self.rnn_proj(z).chunk(3, dim=-1)
        gate = torch.sigmoid(gate)
        state = gate * state + (1 - gate) * torch.tanh(cand)
        return self.w2(torch.tanh(out)), state

    def confidence_logit(self, h, prev_emb) -> torch.Tensor:
        feats = h if prev_emb is None else torch.cat([h, prev_emb.to(h.dtype)], dim=-1)
        return self.confidence(feats).squeeze(-1)

    def set_confidence_temperatures(self, temperatures: list[float] | None) -> None:
        """Calibrate the confidences with these STS temperatures (gamma,) from now on, or with none (raw ones): in
        the config (config.json, which the engines read too) and in a buffer on the draft's device, so that a round
        copies nothing to the device for them. The one way to change them (an assignment to the config field leaves
        the buffer behind; generate() and save_pretrained refuse such a draft, naming this setter)."""
        previous = self.config.confidence_temperatures
        self.config.confidence_temperatures = None if temperatures is None else [float(t) for t in temperatures]
        try:
            self.config.validate_dspark()
        except ValueError:
            self.config.confidence_temperatures = previous
            raise
        self._temperatures_set = None if temperatures is None else tuple(self.config.confidence_temperatures)
        bits = None
        if temperatures is not None:  # float32 bits as int32: `model.to(torch.bfloat16)` casts float buffers only
            device = self.fc.weight.device if self.fc.weight.device.type != "meta" else "cpu"
            bits = torch.tensor(self._temperatures_set, dtype=torch.float32, device=device).view(torch.int32)
        self.register_buffer("sts_temperatures", bits, persistent=False)

    def calibrated(self, confidence_logits: torch.Tensor) -> torch.Tensor:
        """c_k = sigmoid(logit_k / T_k) with the STS temperatures (sec. 3.2.1); gamma is the last dim."""
        if self.sts_temperatures is not None:
            temps = self.sts_temperatures.view(torch.float32)[: confidence_logits.shape[-1]]
            confidence_logits = confidence_logits / temps.to(confidence_logits.dtype)
        return torch.sigmoid(confidence_logits)

    def to_target_vocab(self, logits: torch.Tensor) -> torch.Tensor:
        """Draft-vocab logits (.., V_draft) -> target-vocab logits (.., V), -inf for tokens the draft never proposes."""
        if self.config.draft_vocab_size is None:
            return logits
        full = logits.new_full((*logits.shape[:-1], self.config.target_vocab_size), float("-inf"))
        return full.index_copy_(-1, self.draft_vocab, logits)

    # -- teacher-forced forward (training, analysis) --------------------------------------------------------------
    def forward(
        self,
        anchor_ids: torch.Tensor,
        anchor_positions: torch.Tensor,
        context: DSparkContext | None = None,
        block_tokens: torch.Tensor | None = None,
        context_features: torch.Tensor | None = None,
        context_positions: torch.Tensor | None = None,
        context_valid: torch.Tensor | None = None,
        known: torch.Tensor | None = None,
    ) -> DSparkOutput:
        """Blocks at anchors (N, A) over `context` (or over raw target features (N, C, m * d_t) with their
        positions and validity (N, C), encoded here, as training does), with the sequential and confidence heads
        teacher-forced on `block_tokens` (N, A, gamma): position k conditions on block_tokens[..., k - 1] (the
        anchor for k = 1). known (N, A, lag): tokens before each anchor seen without their features (see
        [`backbone`]). Returns draft-vocabulary logits; use [`to_target_vocab`] for target-vocabulary ones."""
        if context is None:
            if context_features is None or context_positions is None or context_valid is None:
                raise ValueError("A draft's forward reads its target's context: pass context= (from encode_context), "
                                 "or context_features, context_positions and context_valid.")
            context = self.encode_context(context_features, context_positions, context_valid)
        h = self.backbone(anchor_ids, anchor_positions, context, known)
        logits = self.base_logits(h)
        if self.w1 is None:
            conf = self.confidence_logit(h, None) if self.confidence is not None else None
            return DSparkOutput(logits=logits, confidence_logits=conf, hidden_states=h)
        if block_tokens is None:
            raise ValueError("A draft with a sequential head needs block_tokens for a teacher-forced forward; "
                             "use dspark_hf.model.sampling.sample_block() to draft a block instead.")
        prev = torch.cat([anchor_ids[..., None], block_tokens[..., :-1]], dim=-1).clamp_min(0)
        prev_emb = self.prev_embedding(prev)
        if self.config.head_type == "markov":
            bias, _ = self.transition(prev_emb, h, None)
        else:
            state = h.new_zeros(*h.shape[:-2], self.config.markov_rank)
            steps = []
            for k in range(h.shape[-2]):
                b, state = self.transition(prev_emb[..., k, :], h[..., k, :], state)
                steps.append(b)
            bias = torch.stack(steps, dim=-2)
        conf = self.confidence_logit(h, prev_emb) if self.confidence is not None else None
        return DSparkOutput(logits=logits + bias, confidence_logits=conf, hidden_states=h)


def damaged_weights_error(name_or_path, error: Exception) -> OSError:
    """The error for a model whose safetensors weights do not read (`error`, safetensors' own): a file cut short by
    an interrupted download, copy or save, or overwritten."""
    return OSError(f"The weights of {name_or_path} are damaged or cut short ({' '.join(str(error).split())}), as an "
                   "interrupted download, copy or save leaves them: download them again (for a Hub id, "
                   "from_pretrained(..., force_download=True)) or save the model again with save_pretrained.")


def _first_five(names: list[str]) -> str:
    return ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")


__all__ = ["DSparkDraftModel", "DSparkPreTrainedModel", "DSparkContext", "DSparkOutput"]

"""Convert public DSpark / DFlash draft checkpoints into a [`DSparkDraftModel`] (``dspark convert``), and a
DSparkDraftModel back into DeepSpec's layout (``dspark export --format deepspec``), which serving engines load.

The layouts, as read from the public code (all three use a Qwen3-style backbone: fc -> ``hidden_norm`` on the
concatenated target features, layers whose k/v projections (+ k_norm, RoPE) also run on the context, final norm):

- ``deepspec``: ``Qwen3DSparkModel`` of deepseek-ai/DeepSpec (deepspec/modeling/dspark/qwen3/{config,modeling}.py,
  markov_head.py, common.py at commit afdfa7c). Flat config (a copy of the target's Qwen3 config) with
  ``block_size``, ``mask_token_id``, ``target_layer_ids``, ``markov_rank``, ``markov_head_type``,
  ``enable_confidence_head``, ``confidence_head_with_markov``; the state dict duplicates the target's
  ``embed_tokens`` and ``lm_head``. Row k of the block [x_0, m, ...] predicts the token at anchor + k + 1, as ours.
- ``specforge``: ``DSparkDraftModel`` of sgl-project/SpecForge (specforge/modeling/draft/{dspark,dflash}.py,
  specforge/algorithms/common/dflash_family_model.py at commit a6b6b02). Same heads and key names, settings under
  ``dflash_config`` (``projector_type="dspark"``), no embedding or LM head. Trained with labels anchor + 1 ..
  anchor + block_size (``OnlineDSparkModel``), as ours. (SpecForge's own ``spec_generate`` samples from rows 1..
  block_size - 1 instead; we follow the training labels the weights were fit to.) SpecForge's first DSpark trainer
  (commit 9facb330, same labels and heads) kept the head settings at the top level, as DeepSpec does, and may save
  model_type "dspark"; its checkpoints convert the same way.
- ``dflash``: ``DFlashDraftModel`` of z-lab/dflash (dflash/model.py at commit 44947fb; SpecForge's DFlash is the
  same layout). Backbone only, ``dflash_config`` with ``mask_token_id`` and ``target_layer_ids``. A block of
  ``block_size`` rows drafts ``block_size - 1`` tokens, each mask row predicting its own position, so it becomes
  ``head_type="none"`` with ``anchor_predicts=False`` and our ``block_size`` one less. Newer z-lab code (dflash/model.py
  after 44947fb) also reads ``final_logit_softcapping`` (carried over), ``input_embedding_scale``,
  ``output_multiplier`` and ``is_causal`` (refused unless they leave the computation unchanged).

The target's embedding and LM head are never stored in our checkpoint: source copies are dropped only after they
are checked equal to the target's.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from transformers import PreTrainedModel

from ..errors import UnsupportedError
from ..files import check_output_folder, written_by_dspark
from .configuration_dspark import DSparkConfig
from .engines import format_blockers, public_name, rename, serving_card
from .modeling_dspark import DSparkDraftModel, damaged_weights_error

SOURCES = ("deepspec", "specforge", "dflash")

# source key prefix -> our parameter prefix; keys under no prefix here keep their name (layers.*, norm, fc)
# copies of the target's frozen weights: source key -> how to fetch the target's tensor
_TARGET_COPIES = {
    "embed_tokens.weight": lambda target: target.get_input_embeddings().weight,
    "lm_head.weight": lambda target: target.get_output_embeddings().weight,
}
_ARCHITECTURES = {"deepspec": "Qwen3DSparkModel", "specforge": "DSparkDraftModel", "dflash": "DFlashDraftModel"}
_SOURCE_NAMES = {"deepspec": "DeepSpec", "specforge": "SpecForge DSpark", "dflash": "DFlash"}


# ---------------------------------------------------------------------------------------------------------------
# config
# ---------------------------------------------------------------------------------------------------------------
def backbone_fields(raw: dict, source: str) -> dict:
    """The Qwen3 backbone fields shared by all three layouts -> DSparkConfig fields."""
    architectures = raw.get("architectures") or []
    if raw.get("model_type") == "dspark" and "dflash_config" not in raw:
        raise ValueError("this is a dspark-hf draft already: load it with DSparkDraftModel.from_pretrained (or pass it "
                         "as --draft); there is nothing to convert.")
    # SpecForge's first DSpark trainer saved a Qwen3Config subclass whose model_type is "dspark"
    qwen3 = raw.get("model_type") == "qwen3" or (source == "specforge" and raw.get("model_type") == "dspark")
    if architectures != [_ARCHITECTURES[source]] or not qwen3:
        hint = {"DFlashDraftModel": " (a DFlash draft: use --from dflash)",
                "DSparkDraftModel": " (a SpecForge DSpark draft: use --from specforge)",
                "Qwen3DSparkModel": " (a DeepSpec draft: use --from deepspec)"}.get(next(iter(architectures), ""), "")
        raise UnsupportedError(
            f"--from {source} expects architectures [{_ARCHITECTURES[source]!r}] with model_type 'qwen3'; this "
            f"checkpoint has {architectures} / {raw.get('model_type')!r}{hint}. Other backbones (e.g. DeepSpec's "
            "Gemma4DSparkModel: unscaled attention, v_norm, extra feed-forward norms, a layer scalar) are not mapped.")
    missing = [k for k in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                           "num_key_value_heads", "rms_norm_eps", "vocab_size", "num_target_layers") if k not in raw]
    if missing:
        raise ValueError(f"config.json lacks {missing}, which a {source} checkpoint carries (num_target_layers is "
                         "taken from the target when one is passed).")
    rope = raw.get("rope_parameters") or {**(raw.get("rope_scaling") or {}), "rope_theta": raw.get("rope_theta")}
    if rope.get("rope_type", rope.get("type", "default")) != "default" or rope.get("rope_theta") is None:
        raise UnsupportedError(f"RoPE settings {rope} are not supported: the draft uses plain RoPE with a "
                                  "rope_theta and no scaling.")
    sliding = [i for i, kind in enumerate(_layer_types(raw)) if kind != "full_attention"]
    if sliding:
        raise UnsupportedError(f"Draft layers {sliding} use sliding-window attention (causal within the block); "
                                  "DSparkDraftModel layers are full attention, bidirectional within the block.")
    return dict(
        hidden_size=raw["hidden_size"], intermediate_size=raw["intermediate_size"],
        num_hidden_layers=raw["num_hidden_layers"], num_attention_heads=raw["num_attention_heads"],
        num_key_value_heads=raw["num_key_value_heads"],
        head_dim=raw.get("head_dim") or raw["hidden_size"] // raw["num_attention_heads"],
        hidden_act=raw.get("hidden_act", "silu"), rms_norm_eps=raw["rms_norm_eps"],
        rope_theta=float(rope["rope_theta"]), max_position_embeddings=raw.get("max_position_embeddings", 8192),
        attention_bias=raw.get("attention_bias", False), qk_norm=True,  # Qwen3 layers always norm q and k per head
        target_vocab_size=raw["vocab_size"], target_hidden_size=raw["hidden_size"],
        target_num_hidden_layers=raw["num_target_layers"],
    )


def _layer_types(raw: dict) -> list[str]:
    if raw.get("layer_types"):
        return list(raw["layer_types"])
    # Qwen3Config's rule (and defaults) when layer_types is absent: sliding from max_window_layers on, if enabled
    windowed = raw.get("use_sliding_window", False) and raw.get("sliding_window", 4096)
    first = raw.get("max_window_layers", 28)
    return ["sliding_attention" if windowed and i >= first else "full_attention"
            for i in range(raw["num_hidden_layers"])]


def _default_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """The z-lab / SpecForge fallback when dflash_config has no target_layer_ids (their build_target_layer_ids)."""
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    span = num_target_layers - 4  # from layer 1 to layer L - 3
    return [int(round(1 + i * span / (num_draft_layers - 1))) for i in range(num_draft_layers)]


def _layer_ids(ids: list[int]) -> list[int]:
    if any(i == -1 for i in ids):
        raise UnsupportedError("target_layer_ids contains -1 (DeepSpec's code for the embedding output); "
                                  "DSparkDraftModel reads decoder-layer outputs only.")
    return [int(i) for i in ids]


def head_fields(markov_rank: int, markov_head_type: str | None, confidence: bool, with_markov: bool) -> dict:
    """DeepSpec / SpecForge head settings -> DSparkConfig head fields."""
    kind = str(markov_head_type).lower() if markov_rank else "none"
    head_type = {"none": "none", "vanilla": "markov", "rnn": "rnn"}.get(kind)
    if head_type is None:
        raise UnsupportedError(f"markov_head_type={markov_head_type!r} has no counterpart here (we have "
                                  "'vanilla' -> 'markov' and 'rnn'; the gated head scales W1[x] by a sigmoid gate).")
    if confidence and markov_rank and not with_markov:
        raise UnsupportedError("confidence_head_with_markov=False with a Markov head: the source confidence head "
                                  "reads h_k only, ours reads [h_k ; W1[x_{k-1}]] whenever a sequential head exists.")
    return dict(head_type=head_type, markov_rank=markov_rank, confidence_head=confidence)


def deepspec_config(raw: dict) -> dict:
    """DeepSpec ``Qwen3DSparkModel`` config.json -> DSparkConfig fields."""
    fields = backbone_fields(raw, "deepspec")
    missing = [k for k in ("block_size", "mask_token_id", "target_layer_ids", "markov_rank") if k not in raw]
    if missing:
        raise ValueError(f"config.json lacks {missing}, which a DeepSpec Qwen3DSparkModel config carries.")
    rank = int(raw["markov_rank"])
    return dict(fields, block_size=raw["block_size"], mask_token_id=raw["mask_token_id"],
                target_layer_ids=_layer_ids(raw["target_layer_ids"]),
                **head_fields(rank, raw.get("markov_head_type"), bool(raw.get("enable_confidence_head", False)),
                              bool(raw.get("confidence_head_with_markov", False))))


_HEAD_SETTINGS = {"markov_rank", "markov_head_type", "enable_confidence_head", "confidence_head_with_markov"}


def specforge_config(raw: dict) -> dict:
    """SpecForge ``DSparkDraftModel`` config.json (settings under dflash_config) -> DSparkConfig fields."""
    fields, dc = backbone_fields(raw, "specforge"), raw.get("dflash_config") or {}
    if "block_size" not in raw:
        raise ValueError("config.json lacks block_size, which a SpecForge DSparkDraftModel config carries.")
    if dc.get("projector_type", "dspark") != "dspark" or dc.get("pure_draft_prefix_len", 0):
        raise UnsupportedError(f"dflash_config {dc} asks for a projector or draft prefix other than plain DSpark.")
    if not dc.keys() & _HEAD_SETTINGS and raw.keys() & _HEAD_SETTINGS:
        # SpecForge's first DSpark trainer (commit 9facb330) kept them at the top level, with its own defaults
        heads = head_fields(int(raw.get("markov_rank", 0) or 0), raw.get("markov_head_type", "vanilla"),
                            bool(raw.get("enable_confidence_head", False)),
                            bool(raw.get("confidence_head_with_markov", True)))
    else:
        # SpecForge's own defaults: vanilla head, confidence head iff confidence_head_alpha > 0, confidence on h only
        heads = head_fields(int(dc.get("markov_rank", 0) or 0), dc.get("markov_head_type", "vanilla"),
                            bool(dc.get("enable_confidence_head", float(dc.get("confidence_head_alpha", 0) or 0) > 0)),
                            bool(dc.get("confidence_head_with_markov", False)))
    return dict(fields, block_size=raw["block_size"], mask_token_id=dc.get("mask_token_id"),
                target_layer_ids=_layer_ids(dc.get("target_layer_ids") or _default_layer_ids(
                    raw["num_target_layers"], raw["num_hidden_layers"])), **heads)


# Settings that z-lab's newer dflash/model.py (after 44947fb) reads from dflash_config or else the top level, and
# that change what the draft computes: name -> (the value that changes nothing, what it does). Soft-capping, the one
# more, is mapped onto our final_logit_softcapping.
_DFLASH_UNSUPPORTED = {
    "input_embedding_scale": (1.0, "scales the block's input embeddings"),
    "output_multiplier": (1.0, "scales the draft's logits"),
    "is_causal": (False, "makes attention causal within the block"),
}


def dflash_config(raw: dict) -> dict:
    """z-lab DFlash ``DFlashDraftModel`` config.json -> DSparkConfig fields (a head-less draft)."""
    fields, dc = backbone_fields(raw, "dflash"), raw.get("dflash_config") or {}
    sizes = {raw.get("block_size"), dc.get("block_size")} - {None}  # top level in older drafts, dflash_config later
    if len(sizes) != 1:
        raise ValueError(f"config.json needs one block_size (top level or in dflash_config), found {sorted(sizes)}.")
    for name, (neutral, effect) in _DFLASH_UNSUPPORTED.items():
        value = dc.get(name, raw.get(name))
        if value is not None and value != neutral:
            raise UnsupportedError(f"{name}={value!r} {effect} in this DFlash draft; dspark-hf does not reproduce "
                                      "it, so the checkpoint cannot be converted faithfully.")
    cap = dc.get("final_logit_softcapping", raw.get("final_logit_softcapping"))
    return dict(fields, block_size=sizes.pop() - 1, anchor_predicts=False, mask_token_id=dc.get("mask_token_id"),
                target_layer_ids=_layer_ids(dc.get("target_layer_ids") or _default_layer_ids(
                    raw["num_target_layers"], raw["num_hidden_layers"])),
                head_type="none", markov_rank=0, confidence_head=False,
                # z-lab caps the draft's LM-head logits as our base_logits does; a cap of 0 or less means none
                final_logit_softcapping=float(cap) if cap is not None and float(cap) > 0 else None)


CONFIG_READERS = {"deepspec": deepspec_config, "specforge": specforge_config, "dflash": dflash_config}


# ---------------------------------------------------------------------------------------------------------------
# weights
# ---------------------------------------------------------------------------------------------------------------
def load_safetensors(src: Path) -> dict[str, torch.Tensor]:
    """All tensors of a checkpoint folder: model.safetensors, or the shards named by model.safetensors.index.json."""
    index = src / "model.safetensors.index.json"
    files = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.exists() else \
        ["model.safetensors"] if (src / "model.safetensors").exists() else []
    if not files:
        raise FileNotFoundError(f"{src} has no model.safetensors or model.safetensors.index.json; re-save the source "
                                "with save_pretrained(..., safe_serialization=True).")
    tensors: dict[str, torch.Tensor] = {}
    for name in files:
        try:
            shard = load_file(src / name)
        except SafetensorError as error:
            raise damaged_weights_error(src / name, error) from error
        if tensors.keys() & shard.keys():
            raise ValueError(f"{name} repeats keys of an earlier shard: {sorted(tensors.keys() & shard.keys())[:5]}")
        # fresh storage: load_file's tensors can sit at unaligned offsets, which changes CPU matmul rounding
        tensors.update({k: v.clone() for k, v in shard.items()})
    return tensors


def _one_dtype(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The tensors in one float dtype, as a model runs: float32 (float64 if present) where the checkpoint mixes
    them, which holds each value exactly."""
    dtypes = {v.dtype for v in tensors.values() if v.is_floating_point()}
    if len(dtypes) <= 1:
        return tensors
    wide = torch.float64 if torch.float64 in dtypes else torch.float32
    return {k: v.to(wide) if v.is_floating_point() else v for k, v in tensors.items()}


def drop_target_copies(tensors: dict[str, torch.Tensor], target: PreTrainedModel | None) -> dict[str, torch.Tensor]:
    """Remove the source's copies of the target embedding / LM head after checking they equal the target's."""
    copies = sorted(k for k in tensors if k in _TARGET_COPIES)
    if copies and target is None:
        raise ValueError(f"The checkpoint stores copies of the target's {copies}; pass the target (--target) so "
                         "they can be checked equal to it before they are dropped.")
    for key in copies:
        mine, theirs = tensors[key], _TARGET_COPIES[key](target).detach().cpu()
        if mine.shape != theirs.shape or not torch.equal(mine, theirs.to(mine.dtype)):
            raise ValueError(f"The checkpoint's {key} {tuple(mine.shape)} differs from the target's "
                             f"{tuple(theirs.shape)}: this draft was trained for another target.")
    return {k: v for k, v in tensors.items() if k not in _TARGET_COPIES}


def map_state_dict(tensors: dict[str, torch.Tensor], draft: DSparkDraftModel, source: str) -> dict[str, torch.Tensor]:
    """Rename source tensors onto `draft`'s parameters; every unknown, missing or mis-shaped key in one ValueError."""
    renamed = {rename(k): (k, v) for k, v in tensors.items()}
    if len(renamed) < len(tensors):
        raise ValueError(f"Several keys of the {source} checkpoint map onto one parameter: "
                         f"{sorted(k for k in tensors if renamed[rename(k)][0] != k)}.")
    expected = draft.state_dict()
    unknown = sorted(src for ours, (src, _) in renamed.items() if ours not in expected)
    missing = sorted(k for k in expected if k not in renamed)
    shapes = [f"{src} {tuple(v.shape)} -> {ours} {tuple(expected[ours].shape)}"
              for ours, (src, v) in sorted(renamed.items()) if ours in expected and v.shape != expected[ours].shape]
    problems = [f"{what}: {', '.join(keys)}" for what, keys in
                (("unknown keys", unknown), ("missing keys", missing), ("shape mismatches", shapes)) if keys]
    if problems:
        raise ValueError(f"Cannot map this {source} checkpoint onto DSparkDraftModel ({draft.config.head_type} head, "
                         f"{draft.config.num_hidden_layers} layers):\n  " + "\n  ".join(problems))
    return {ours: v for ours, (_, v) in renamed.items()}


# ---------------------------------------------------------------------------------------------------------------
def check_conversion_folder(src: str | Path, dst: str | Path) -> None:
    """Refuse a `src` without a config.json, and a `dst` that is `src` or that holds anything but an earlier
    conversion (a dspark-hf draft): saving there would replace the checkpoint being converted, or a downloaded one."""
    if not (Path(src) / "config.json").is_file():
        missing = "no config.json in it" if Path(src).is_dir() else "no such folder"
        raise FileNotFoundError(f"{src}: {missing}: give the folder of the checkpoint to convert (its config.json and "
                                "*.safetensors, as downloaded).")
    if Path(dst).resolve() == Path(src).resolve():
        raise ValueError(f"{dst} is the checkpoint being converted: write the conversion to another folder.")
    check_output_folder(dst, "conversion", ours=("draft",))


def convert_checkpoint(src: str | Path, dst: str | Path, source: str,
                       target: PreTrainedModel | None = None) -> DSparkDraftModel:
    """Convert the checkpoint folder `src` (config.json + safetensors) of layout `source` ("deepspec", "specforge"
    or "dflash") into a DSparkDraftModel saved to `dst`. Weights keep their values exactly.

    `target` (the model the draft was trained for) is needed when the source stores copies of its embedding / LM
    head; when given, the draft records the target's identity and is returned bound to it. A checkpoint that mixes
    float dtypes (a bf16 backbone beside float32 heads) becomes float32 throughout, which holds every value exactly.
    """
    if source not in SOURCES:
        raise ValueError(f"source must be one of {SOURCES}, got {source!r}.")
    check_conversion_folder(src, dst)
    src = Path(src)
    try:
        raw = json.loads((src / "config.json").read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ValueError(f"{src}/config.json does not read as JSON ({error}): download the checkpoint again.") \
            from error
    if target is not None:
        t = target.config.get_text_config()
        raw.setdefault("num_target_layers", t.num_hidden_layers)
        if raw["num_target_layers"] != t.num_hidden_layers:
            raise ValueError(f"The checkpoint was trained for a target with {raw['num_target_layers']} layers; the "
                             f"given target has {t.num_hidden_layers}.")
    fields = CONFIG_READERS[source](raw)
    if fields["mask_token_id"] is None:
        raise ValueError(f"{src}/config.json has no mask_token_id.")
    if target is not None:
        fields.update(target_model_type=t.model_type,
                      target_name_or_path=getattr(target.config, "_name_or_path", None) or None)
    # only DFlash configs set a soft cap: DeepSpec and SpecForge take draft logits straight from the LM head
    config = DSparkConfig(**fields, trained_block_size=fields["block_size"])  # a published draft is a trained one
    tensors = _one_dtype(drop_target_copies(load_safetensors(src), target))
    with torch.device("meta"):  # no random init: every parameter is assigned from the checkpoint
        draft = DSparkDraftModel(config)
    draft.load_state_dict(map_state_dict(tensors, draft, source), strict=True, assign=True)
    if target is not None:
        draft.bind_target(target)  # checks vocabulary, hidden size, layer ids and mask token before anything is written
    origin = f"a {_SOURCE_NAMES[source]} checkpoint ({_checkpoint_name(src)})"
    draft.eval().save_pretrained(dst, card_data={"converted_from": origin, "recipe": (
        f"Not trained with dspark-hf: converted by `dspark convert` from {origin}, its weights unchanged. How it was "
        "trained is for the source checkpoint to document.")})
    return draft


def _checkpoint_name(src: Path) -> str:
    """How a card names the checkpoint at `src`: by Hub id and revision when it is a snapshot in the Hugging Face
    cache, else by folder name (a card names no path of the machine it was written on)."""
    parts = src.resolve().parts
    for i in range(len(parts) - 2):
        if parts[i].startswith("models--") and parts[i + 1] == "snapshots":
            # the cache's folder name for a repo id: "models--" + the id with "/" written "--" (ids never hold "--")
            return f"`{parts[i].removeprefix('models--').replace('--', '/')}` at revision {parts[i + 2][:12]}"
    return f"a local folder named `{src.resolve().name}`"

# ---------------------------------------------------------------------------------------------------------------
# export: the reverse of --from deepspec
# ---------------------------------------------------------------------------------------------------------------
def deepspec_blockers(draft: DSparkDraftModel, target: PreTrainedModel | None = None) -> list[str]:
    """What keeps this draft beside `target` out of DeepSpec's Qwen3DSparkModel layout, or from every engine that
    reads it (empty when it can be exported; see `engines.format_blockers`)."""
    return format_blockers(draft, target, "deepspec")


# DeepSpec's model asserts num_anchors (blocks sampled per training sequence) though only its training reads it: we
# write DeepSpec's default. The dspark_hf_export field marks the folder as ours, so a later export may replace it.
EXPORTED_ANCHORS = 512


def check_export_folder(dst: str | Path) -> None:
    """Refuse a `dst` that holds anything but an earlier DeepSpec-layout export: a downloaded DeepSpec checkpoint
    looks the same but for our marker, and a dspark-hf draft (perhaps the one being exported) would be replaced."""
    check_output_folder(dst, "DeepSpec export", ours=("deepspec",))


def export_deepspec(draft: DSparkDraftModel, target: PreTrainedModel, dst: str | Path) -> Path:
    """Write `draft` in DeepSpec's ``Qwen3DSparkModel`` layout at `dst`: its config (a copy of the target's with the
    draft's fields, as DeepSpec's build_draft_config writes it) and weights under DeepSpec's names, with the copies
    of the target's embedding and LM head it stores. [`convert_checkpoint`] with ``source="deepspec"`` reads it back
    to the same weights. `dst` must be a new or empty folder, or an earlier export (see [`check_export_folder`])."""
    check_export_folder(dst)
    blockers = deepspec_blockers(draft, target)
    if blockers:
        raise ValueError("This draft cannot be written in DeepSpec's layout: " + "; ".join(blockers) + ".")
    draft.check_target(target)
    c, dst = draft.config, Path(dst)
    raw = target.config.get_text_config().to_dict()
    raw.update(architectures=[_ARCHITECTURES["deepspec"]], model_type="qwen3",
               num_target_layers=raw["num_hidden_layers"], num_hidden_layers=c.num_hidden_layers,
               hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
               num_attention_heads=c.num_attention_heads, num_key_value_heads=c.num_key_value_heads,
               head_dim=c.head_dim, hidden_act=c.hidden_act, rms_norm_eps=c.rms_norm_eps,
               max_position_embeddings=c.max_position_embeddings, attention_bias=c.attention_bias,
               rope_parameters={"rope_theta": c.rope_theta, "rope_type": "default"}, rope_scaling=None,
               rope_theta=c.rope_theta, layer_types=["full_attention"] * c.num_hidden_layers,
               use_sliding_window=False, tie_word_embeddings=False, block_size=c.block_size,
               mask_token_id=c.mask_token_id, target_layer_ids=list(c.target_layer_ids),
               markov_rank=c.markov_rank if c.head_type != "none" else 0,
               enable_confidence_head=c.confidence_head, confidence_head_with_markov=c.head_type != "none",
               sample_from_anchor=True,  # DeepSpec's behaviour, written out: readers' defaults differ
               num_anchors=EXPORTED_ANCHORS, dspark_hf_export=True)
    if c.head_type != "none":
        raw["markov_head_type"] = {"markov": "vanilla", "rnn": "rnn"}[c.head_type]
    # the tensors' dtype, not the target's (the CLI loads it in float32): engines serve the draft in this dtype
    raw["dtype"] = str(draft.dtype).removeprefix("torch.")
    if "torch_dtype" in raw:  # the name older transformers versions write
        raw["torch_dtype"] = raw["dtype"]
    tensors = {public_name(k): v for k, v in draft.state_dict().items()}
    for key, of_target in _TARGET_COPIES.items():
        tensors[key] = of_target(target).to(draft.dtype)  # one dtype per checkpoint, as DeepSpec saves
    dst.mkdir(parents=True, exist_ok=True)
    if written_by_dspark(dst) == "deepspec":  # its shards, which a reader would prefer to the new file
        for stale in [*dst.glob("*.safetensors"), *dst.glob("*.safetensors.index.json")]:
            stale.unlink()
    (dst / "config.json").write_text(json.dumps(raw, indent=2, default=str))
    save_file({k: v.detach().cpu().contiguous().clone() for k, v in tensors.items()}, dst / "model.safetensors")
    (dst / "README.md").write_text(serving_card(draft, target, "deepspec", dst))
    return dst


__all__ = ["convert_checkpoint", "export_deepspec", "check_conversion_folder", "check_export_folder",
           "deepspec_blockers", "SOURCES", "deepspec_config", "specforge_config", "dflash_config",
           "load_safetensors", "map_state_dict", "drop_target_copies"]

"""Which serving engines can serve a draft, and its export in the speculators layout (vLLM, llama.cpp).

The engines that implement DSpark read one of two layouts (read from their published sources; the versions are the
ones our checks pin, `tests/engines/`):

- DeepSpec's ``Qwen3DSparkModel`` (`convert.export_deepspec`): vLLM 0.33, SGLang 0.5.23 and llama.cpp's converter
  read it. It has no reduced vocabulary.
- speculators' ``dspark`` (0.9.0; `export_speculators`): vLLM and llama.cpp's converter read it, SGLang does not.
  It carries a reduced vocabulary as ``d2t`` (target id = draft index + d2t[index]) with the draft's LM-head rows.

What each engine computes, beyond either layout: every draft layer norms queries and keys per head (vLLM and SGLang
keep a norm of ones when the tensors are missing, llama.cpp refuses them), vLLM and llama.cpp have only the Markov
(vanilla) head, SGLang needs the Markov head and the confidence head, none soft-caps the draft's logits or reads
per-position confidence temperatures (calibrated drafts are served with their raw confidences).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file
from transformers import PreTrainedModel

from ..files import GENERATED_MARK, check_output_folder, written_by_dspark
from .modeling_dspark import DSparkDraftModel

ENGINES = ("vLLM", "SGLang", "llama.cpp")
# the layouts' tensor names -> ours (DeepSpec's, which speculators and the engines share)
_RENAMES = {
    "hidden_norm.": "context_norm.",
    "markov_head.markov_w1.": "w1.",
    "markov_head.markov_w2.": "w2.",
    "markov_head.joint_proj.": "rnn_proj.",
    "confidence_head.proj.": "confidence.",
}


def rename(key: str) -> str:
    """Source parameter name -> ours (unchanged where the names agree)."""
    key = key.removeprefix("logit_head.")  # early SpecForge DSpark checkpoints nest the heads there
    for old, new in _RENAMES.items():
        if key.startswith(old):
            return new + key[len(old):]
    return key


def public_name(key: str) -> str:
    """Our parameter name -> DeepSpec's (the reverse of [`rename`])."""
    for theirs, ours in _RENAMES.items():
        if key.startswith(ours):
            return theirs + key[len(ours):]
    return key


FORMATS = {"deepspec": ("vLLM", "SGLang", "llama.cpp"), "speculators": ("vLLM", "llama.cpp")}


def engine_gaps(draft: DSparkDraftModel, target: PreTrainedModel | None = None) -> list[tuple[str, tuple[str, ...]]]:
    """(what about `draft` an engine cannot serve, the engines it leaves out), for every such thing; empty when all
    three serve it (in one of the two layouts)."""
    c = draft.config
    embedding = type(target.get_input_embeddings()) if target is not None else torch.nn.Embedding
    gaps = [
        ("its layers do not norm queries and keys per head (qk_norm=False), which every engine's draft layers do: "
         "fine-tune it with them added (dspark train --init-from DRAFT --add-qk-norm), or train a new draft "
         "(dspark train and DSparkDraftModel.from_target make them with q/k norms)",
         ENGINES, not c.qk_norm),
        ("it is a DFlash-style draft (anchor_predicts=False), not a DSpark one", ENGINES, not c.anchor_predicts),
        ("its logits are soft-capped (final_logit_softcapping), which no engine's DSpark draft does", ENGINES,
         c.final_logit_softcapping is not None),
        (f"its target embeds tokens with a {embedding.__name__}, where the engines' DSpark drafts embed the block "
         "with a plain embedding", ENGINES, embedding is not torch.nn.Embedding),
        ("its sequential head is an RNN (vLLM and llama.cpp have only the Markov head)", ("vLLM", "llama.cpp"),
         c.head_type == "rnn"),
        ("it has no Markov head (SGLang needs one)", ("SGLang",), c.head_type == "none"),
        ("it has no confidence head (SGLang needs one)", ("SGLang",), not c.confidence_head),
        (f"it drafts from a reduced vocabulary of {c.draft_vocab_size} tokens (SGLang drafts from the full LM head)",
         ("SGLang",), c.draft_vocab_size is not None),
    ]
    return [(why, engines) for why, engines, blocks in gaps if blocks]


def layout_gaps(target: PreTrainedModel | None, fmt: str) -> list[tuple[str, tuple[str, ...]]]:
    """(what an engine reads wrongly from layout `fmt` beside `target`, the engines it leaves out)."""
    tied = target is None or target.get_output_embeddings().weight is target.get_input_embeddings().weight
    if fmt == "deepspec" and not tied:
        # its converter drops a full-vocabulary lm_head and reads the stored embedding as the head where no other is
        return [("beside a target whose LM head is not its embedding, llama.cpp would read the embedding this layout "
                 "stores as the draft's LM head: export --format speculators for llama.cpp", ("llama.cpp",))]
    return []


def exported_gaps(draft: DSparkDraftModel, target: PreTrainedModel | None, fmt: str) -> list[tuple[str, tuple]]:
    """What leaves an engine out of serving `draft` exported in layout `fmt`: the draft's gaps and the layout's."""
    return engine_gaps(draft, target) + layout_gaps(target, fmt)


def serving_engines(draft: DSparkDraftModel, target: PreTrainedModel | None, fmt: str) -> tuple[str, ...]:
    """The engines that serve `draft` exported in layout `fmt` ("deepspec" or "speculators")."""
    left_out = {engine for _, engines in exported_gaps(draft, target, fmt) for engine in engines}
    return tuple(e for e in FORMATS[fmt] if e not in left_out)


def format_blockers(draft: DSparkDraftModel, target: PreTrainedModel | None, fmt: str) -> list[str]:
    """Why `draft` cannot be written in layout `fmt`, or served from it by any engine (empty: it can)."""
    gaps = engine_gaps(draft, target)
    whys = [why for why, engines in gaps if set(FORMATS[fmt]) <= set(engines)]
    if fmt == "deepspec" and draft.config.draft_vocab_size is not None:
        whys.append(f"it drafts from a reduced vocabulary of {draft.config.draft_vocab_size} tokens, which DeepSpec's "
                    "layout cannot hold: export --format speculators (vLLM, llama.cpp), or train with "
                    "--draft-vocab-size 0 for all three engines")
    return whys


def dropped_by_engines(draft: DSparkDraftModel) -> list[str]:
    """What an export keeps out because no engine reads it (said in the export's output, not refused)."""
    if draft.config.confidence_temperatures is None:
        return []
    return ["its per-position confidence temperatures (dspark calibrate): engines read the raw confidence head, so "
            "an engine's confidence threshold (vLLM's adaptive verification, llama.cpp's --spec-draft-p-min) applies "
            "to uncalibrated confidences"]


SERVE = {
    "vLLM": "vllm serve TARGET --speculative-config '{{\"model\": \"{dst}\", \"method\": \"dspark\", "
            "\"num_speculative_tokens\": {gamma}}}'",
    "SGLang": "python -m sglang.launch_server --model-path TARGET --speculative-algorithm DSPARK "
              "--speculative-draft-model-path {dst} --speculative-dspark-block-size {gamma}",
    "llama.cpp": "python convert_hf_to_gguf.py {dst} --target-model-dir TARGET --outfile draft.gguf; then "
                 "llama-server -m TARGET.gguf -md draft.gguf --spec-type draft-dspark --spec-draft-n-max {gamma}",
}


def serving_card(draft: DSparkDraftModel, target: PreTrainedModel | None, fmt: str, dst: str | Path) -> str:
    """The README.md of an engine export: what it is, which engines serve it and how, and what they drop."""
    engines = serving_engines(draft, target, fmt)
    gamma = draft.config.block_size
    lines = [f"<!-- {GENERATED_MARK} -->", f"# DSpark draft in the {fmt} layout", "",
             f"Exported by dspark-hf from a draft for `{draft.config.target_name_or_path or 'its target'}` "
             f"(block size {gamma}). Served by: {', '.join(engines)}.", ""]
    lines += [f"- {engine}: `{SERVE[engine].format(dst=dst, gamma=gamma)}`" for engine in engines]
    left_out = [(why, [e for e in gap if e in FORMATS[fmt]]) for why, gap in exported_gaps(draft, target, fmt)]
    lines += [f"- not {', '.join(es)}: {why}" for why, es in left_out if es]
    lines += [f"- engines drop {what}" for what in dropped_by_engines(draft)]
    return "\n".join(lines) + "\n"


def check_speculators_folder(dst: str | Path) -> None:
    """Refuse a `dst` that holds anything but an earlier speculators-layout export of ours."""
    check_output_folder(dst, "speculators export", ours=("speculators",))


def speculators_config(draft: DSparkDraftModel, target: PreTrainedModel) -> dict:
    """The config.json of speculators' ``DSparkSpeculatorConfig`` for `draft`: no top-level model_type (vLLM tells the
    layout by ``speculators_config``), the draft layers as a Qwen3 config over the target's vocabulary, the feature
    layers as ``aux_hidden_state_layer_ids`` (HF hidden_states indices: ours + 1), and every field whose default
    differs between readers (``sample_from_anchor``, ``confidence_head_with_markov``) written out."""
    from transformers import Qwen3Config

    c = draft.config
    layers = Qwen3Config(
        vocab_size=c.target_vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
        num_hidden_layers=c.num_hidden_layers, num_attention_heads=c.num_attention_heads,
        num_key_value_heads=c.num_key_value_heads, head_dim=c.head_dim, hidden_act=c.hidden_act,
        rms_norm_eps=c.rms_norm_eps, max_position_embeddings=c.max_position_embeddings,
        attention_bias=c.attention_bias, rope_parameters={"rope_type": "default", "rope_theta": c.rope_theta},
        tie_word_embeddings=False).to_diff_dict()
    layers.pop("transformers_version", None)
    verifier = getattr(target.config, "_name_or_path", None) or c.target_name_or_path
    return {
        "architectures": ["DSparkSpeculator"], "speculators_model_type": "dspark",
        "transformer_layer_config": layers,
        "draft_vocab_size": c.draft_vocab_size or c.target_vocab_size,
        "target_hidden_size": c.target_hidden_size,
        "block_size": c.block_size,
        "aux_hidden_state_layer_ids": [i + 1 for i in c.target_layer_ids],
        "mask_token_id": c.mask_token_id,
        "sliding_window_non_causal": False,
        "sample_from_anchor": True,  # our anchor row predicts the first draft token, as DeepSpec's does
        "markov_rank": c.markov_rank if c.head_type != "none" else 0,
        "markov_head_type": {"markov": "vanilla", "rnn": "rnn", "none": "vanilla"}[c.head_type],
        "enable_confidence_head": c.confidence_head,
        "confidence_head_with_markov": c.confidence_head and c.head_type != "none",
        "speculators_config": {
            "algorithm": "dspark", "default_proposal_method": "greedy",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": c.block_size,
                                  "verifier_accept_k": 1, "accept_tolerance": 0.0}],
            "verifier": {"name_or_path": verifier, "architectures": list(target.config.architectures or [])},
        },
        "dtype": str(draft.dtype).removeprefix("torch."),
        "dspark_hf_export": "speculators",
    }


def speculators_tensors(draft: DSparkDraftModel, target: PreTrainedModel) -> dict[str, torch.Tensor]:
    """`draft`'s weights under speculators' names: the Markov head's W1 keyed by target ids (`[V_target, r]`, the
    out-of-vocabulary row where a target token is no draft token: what our head reads for it), and with a reduced
    vocabulary the draft's LM-head rows and the ``d2t`` / ``t2d`` maps. The target's embedding is never stored."""
    c = draft.config
    state = {k: v for k, v in draft.state_dict().items() if k not in ("draft_vocab", "target_to_draft")}
    if "w1.weight" in state and c.draft_vocab_size is not None:
        state["w1.weight"] = state["w1.weight"][draft.target_to_draft]
    tensors = {public_name(k): v for k, v in state.items()}
    if c.draft_vocab_size is not None:
        ids = draft.draft_vocab
        tensors["lm_head.weight"] = target.get_output_embeddings().weight[ids].to(draft.dtype)
        tensors["d2t"] = ids - torch.arange(len(ids), device=ids.device)
        tensors["t2d"] = torch.zeros(c.target_vocab_size, dtype=torch.bool, device=ids.device).index_fill(0, ids, True)
    return tensors


def export_speculators(draft: DSparkDraftModel, target: PreTrainedModel, dst: str | Path) -> Path:
    """Write `draft` in speculators' ``dspark`` layout at `dst` (config.json and model.safetensors), as vLLM and
    llama.cpp's converter load it; refused in one line where no engine could serve it from there (see
    [`format_blockers`]). `dst` must be a new or empty folder, or an earlier speculators export."""
    check_speculators_folder(dst)
    blockers = format_blockers(draft, target, "speculators")
    if blockers:
        raise ValueError("No engine could serve this draft from the speculators layout: " + "; ".join(blockers)
                         + ".")
    draft.check_target(target)
    dst = Path(dst)
    dst.mkdir(parents=True, exist_ok=True)
    if written_by_dspark(dst) == "speculators":
        for stale in [*dst.glob("*.safetensors"), *dst.glob("*.safetensors.index.json")]:
            stale.unlink()
    (dst / "config.json").write_text(json.dumps(speculators_config(draft, target), indent=2, default=str))
    tensors = speculators_tensors(draft, target)
    save_file({k: v.detach().cpu().contiguous().clone() for k, v in tensors.items()}, dst / "model.safetensors")
    (dst / "README.md").write_text(serving_card(draft, target, "speculators", dst))
    return dst


__all__ = ["ENGINES", "FORMATS", "rename", "public_name", "engine_gaps", "layout_gaps", "exported_gaps",
           "serving_engines", "format_blockers", "dropped_by_engines", "export_speculators", "speculators_config",
           "speculators_tensors", "check_speculators_folder", "serving_card"]

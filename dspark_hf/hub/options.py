"""The flags of the commands that share a draft (`dspark push`, `dspark export`), as option dataclasses the CLI
reads (PEFT style): what [`push_draft`] and [`export_draft`] take."""

from __future__ import annotations

import dataclasses

from ..options import option


def card_results_option():
    """`--eval`: the results the card shows."""
    return option(None, "results.json from `dspark eval`, for the card's results")


def card_license_option():
    """`--license`: the card's licence."""
    return option(None, "the card's Hub licence id, e.g. apache-2.0 (default: none; a draft learns from its target's "
                        "outputs, so check the target's terms)")


def weights_dtype_option(written: str):
    """`--dtype` of the weights a command writes (`written`: "exported", "pushed")."""
    return option("bfloat16", f"dtype of the {written} weights", choices=["bfloat16", "float16", "float32"])


@dataclasses.dataclass
class PushOptions:
    """What `dspark push` sends ([`push_draft`]), and where."""

    base_model: str | None = option(None, "the target's hub id (default: the one the draft records, if a hub id); "
                                    "the pushed config records it as the target")
    dtype: str = weights_dtype_option("pushed")
    eval: str | None = card_results_option()
    calibration: str | None = option(None, "calibration.json from `dspark calibrate` (default: "
                                     "DRAFT/calibration.json)")
    recipe: str | None = option(None, "markdown file with the training recipe (default: from DRAFT/train_config.json)")
    license: str | None = card_license_option()
    private: bool = option(False, "create the repository as private")
    token: str | None = option(None, "Hub token (default: the stored login or HF_TOKEN)")
    revision: str | None = option(None, "branch to push to (created if missing)")
    commit_message: str | None = option(None, "the Hub commit's message (default: one naming the draft)")


@dataclasses.dataclass
class ExportOptions:
    """How `dspark export` saves a draft for sharing, and what its card says."""

    output: str = option(help="folder to write the exported draft to (new or empty, or an earlier export)")
    dtype: str = weights_dtype_option("exported")
    format: str = option("transformers", "transformers: a DSparkDraftModel folder with a model card; deepspec: "
                         "DeepSpec's Qwen3DSparkModel layout (vLLM, SGLang, llama.cpp; full vocabulary only); "
                         "speculators: speculators' dspark layout (vLLM, llama.cpp; a reduced vocabulary too); "
                         "both engine layouts need --target", choices=["transformers", "deepspec", "speculators"])
    target: str | None = option(None, "the target's path or hub id (--format deepspec or speculators)")
    base_model: str | None = option(None, "hub id of the target, for the card (--format transformers)")
    repo_id: str = option("<your-repo/draft>", "where the draft will live, for the card")
    eval: str | None = card_results_option()
    calibration: str | None = option(None, "calibration.json from `dspark calibrate`, for the card (default: "
                                     "DRAFT/calibration.json if present)")
    recipe: str | None = option(None, "a markdown file describing the training recipe, for the card")
    license: str | None = card_license_option()

"""The Auto classes and a DSpark draft: ``AutoConfig`` and ``AutoModel`` load one as a [`DSparkDraftModel`];
``AutoModelForCausalLM``, the habit of anyone loading a model to generate with, refuses it in one line that says how
it loads and runs, where transformers would list every causal-LM config class it knows (3 kB) without a hint."""

from __future__ import annotations

from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

from .configuration_dspark import DSparkConfig
from .modeling_dspark import DSparkDraftModel


class DraftIsNotACausalLMError(ValueError):
    """A DSpark draft loaded as a causal LM."""


class _DraftAsCausalLM:
    """What ``AutoModelForCausalLM`` maps DSparkConfig to: every way it builds a model refuses."""

    config_class = DSparkConfig

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *args, **kwargs):
        raise DraftIsNotACausalLMError(
            f"{pretrained_model_name_or_path} is a DSpark draft, not a causal LM: it drafts for its target and "
            "does not generate on its own. Load it with AutoModel.from_pretrained (or "
            "DSparkDraftModel.from_pretrained) and pass it to its target: target.generate(**inputs, "
            "assistant_model=draft).")

    @classmethod
    def _from_config(cls, config, *args, **kwargs):  # what AutoModelForCausalLM.from_config calls
        raise DraftIsNotACausalLMError(
            "A DSparkConfig describes a draft, not a causal LM: build one with DSparkDraftModel(config) or "
            "DSparkDraftModel.from_target(target), and pass it as assistant_model= to its target's generate().")


def register() -> None:
    """Register the ``dspark`` model type with the Auto classes (idempotent), and the draft's classes for
    ``save_pretrained`` to write their ``auto_map`` (so a draft loads with ``trust_remote_code=True`` where dspark-hf
    is not installed)."""
    AutoConfig.register("dspark", DSparkConfig, exist_ok=True)
    AutoModel.register(DSparkConfig, DSparkDraftModel, exist_ok=True)
    AutoModelForCausalLM.register(DSparkConfig, _DraftAsCausalLM, exist_ok=True)
    DSparkConfig.register_for_auto_class()
    DSparkDraftModel.register_for_auto_class("AutoModel")

"""The DSpark draft as a transformers model (a config class and a modeling file, as in transformers)."""

from .configuration_dspark import DSparkConfig
from .modeling_dspark import DSparkContext, DSparkDraftModel, DSparkOutput

__all__ = ["DSparkConfig", "DSparkDraftModel", "DSparkContext", "DSparkOutput"]

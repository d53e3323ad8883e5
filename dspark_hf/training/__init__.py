"""Training a DSpark draft for a target: data regeneration, losses, the training loop."""

from .data import DataFileError, GenerationSettings, load_dataset, prepare_data, read_prompts, read_sharegpt

__all__ = ["DataFileError", "GenerationSettings", "load_dataset", "prepare_data", "read_prompts", "read_sharegpt"]

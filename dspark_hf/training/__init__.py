"""Training: prompts, regenerated answers, target features, the DSpark objective and the training loop."""

from .data import DataFileError, GenerationSettings, load_dataset, prepare_data
from .prompts import collect_prompts, read_prompts, read_sharegpt, write_prompts

__all__ = ["DataFileError", "GenerationSettings", "collect_prompts", "load_dataset", "prepare_data", "read_prompts",
           "read_sharegpt", "write_prompts"]

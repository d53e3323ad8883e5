"""dspark-hf: DSpark speculative decoding for Hugging Face transformers.

``import dspark_hf`` registers the ``dspark`` model type with the Auto classes and lets
``target.generate(**inputs, assistant_model=draft)`` run DSpark decoding when ``draft`` is a DSpark draft.
"""

from .generation import (DSparkCandidateGenerator, DSparkGenerateOutput, DSparkRound, HalfPrecisionGreedyWarning,
                         SSDConfig, dspark_generate)
from .generation.streamers import DSparkRoundStreamer, DSparkStep, RoundStreamer
from .generation.serving import DSparkServer, ServedRequest
from .generation.integration import install as _install_generate_hook
from . import hub  # noqa: F401  what a draft's save_pretrained and push_to_hub hand over to (model/binding.py)
from .defaults import default_draft, default_target, fast_draft_dtype
from .loading import load_draft, load_models, load_target
from .model.sampling import BlockProposer, DraftBlock
from .model import DSparkConfig, DSparkContext, DSparkDraftModel
from .model.auto import register as _register_auto_classes
from .version import __version__
from .scheduling import (AsyncScheduled, AutoScheduled, FixedLength, FullBlock, Policy, Scheduled, ThresholdPolicy,
                         VerificationPolicy, prefix_schedule)

_register_auto_classes()
_install_generate_hook()

__all__ = [
    "DSparkConfig",
    "DSparkDraftModel",
    "DSparkContext",
    "DraftBlock",
    "SSDConfig",
    "BlockProposer",
    "DSparkGenerateOutput",
    "DSparkRound",
    "DSparkRoundStreamer",
    "DSparkStep",
    "RoundStreamer",
    "dspark_generate",
    "DSparkServer",
    "ServedRequest",
    "DSparkCandidateGenerator",
    "HalfPrecisionGreedyWarning",
    "AutoScheduled",
    "Policy",
    "VerificationPolicy",
    "FullBlock",
    "FixedLength",
    "ThresholdPolicy",
    "Scheduled",
    "AsyncScheduled",
    "prefix_schedule",
    "default_target",
    "default_draft",
    "fast_draft_dtype",
    "load_target",
    "load_draft",
    "load_models",
]

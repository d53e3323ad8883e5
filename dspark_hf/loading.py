"""A target and its draft by name, loaded the way the CLI and the demo both load them (one place, so that a fix to
dtypes, devices or adapters reaches both)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from .defaults import default_draft, default_target, fast_draft_dtype
from .devices import resolve_device
from .options import option


def _check_name(name_or_path: str, what: str) -> None:
    """A local folder that exists, or a Hub id: say which it is not, before transformers reads a path as a repo id."""
    path = Path(name_or_path).expanduser()
    if path.is_file():
        raise ValueError(f"{what} {name_or_path} is a file: give the folder a model was saved to, or a Hub id.")
    looks_local = name_or_path.startswith(("/", ".", "~")) or name_or_path.count("/") > 1 or "\\" in name_or_path
    if looks_local and not path.exists():
        raise ValueError(f"{what} {name_or_path}: no such folder.")
    # 'runs/nope' has a Hub id's shape, but beside a folder runs/ it is a mistyped path: asking the Hub would retry
    # for a minute and then speak of the network, not of the missing folder
    first = path.parts[0]
    if len(path.parts) > 1 and Path(first).is_dir() and not path.exists():
        raise ValueError(f"{what} {name_or_path}: no such folder (./{first} is a local folder, so this is not read as "
                         f"a Hub id). Check the path, or run from a folder without ./{first} to load the Hub id.")


def load_target(name_or_path: str | None = None, dtype: torch.dtype = torch.float32,
                device: str | torch.device = "auto"):
    """(model, tokenizer) of a Hub id or local path, or of the embedded SmolLM2-135M-Instruct when None, in `dtype`
    on `device` ("auto": a CUDA GPU when present, else the CPU). The tokenizer pads on the left, for batches."""
    if name_or_path is None:
        return default_target(dtype=dtype, device=device)
    model = load_target_model(name_or_path, dtype)  # first: it says what else a folder holds (a draft, say)
    tokenizer = _target_tokenizer(name_or_path)
    if tokenizer.pad_token is None:  # Llama-3 style tokenizers: a batch pads with EOS, as plain generate() does
        tokenizer.pad_token = tokenizer.eos_token
    return model.to(resolve_device(device)).eval(), tokenizer


# what a saved tokenizer leaves in its folder, one file or another by its kind
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "vocab.txt",
                    "spiece.model", "tekken.json")


def _target_tokenizer(name_or_path: str):
    """The target's tokenizer; a local folder saved without one says so, not that a converter package is missing."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(name_or_path, padding_side="left")
    except (ValueError, OSError) as error:
        folder = Path(name_or_path).expanduser()
        if not folder.is_dir() or any((folder / name).exists() for name in _TOKENIZER_FILES):
            raise
        raise ValueError(f"the target {name_or_path} has no tokenizer (no tokenizer.json or tokenizer_config.json in "
                         "it): save the target's tokenizer beside it, tokenizer.save_pretrained(folder).") from error


def load_target_model(name_or_path: str, dtype: torch.dtype = torch.float32):
    """The causal LM of a Hub id or local path, in `dtype` on the CPU, without a tokenizer (training needs none). A
    missing folder, damaged weights, or a model that is no causal LM (a DSpark draft passed as the target), is refused
    in one line."""
    from safetensors import SafetensorError
    from transformers import AutoConfig, AutoModelForCausalLM

    from .model.auto import DraftIsNotACausalLMError
    from .model.modeling_dspark import damaged_weights_error

    _check_name(name_or_path, "the target")
    try:
        return AutoModelForCausalLM.from_pretrained(name_or_path, dtype=dtype)
    except SafetensorError as error:
        raise damaged_weights_error(name_or_path, error) from error
    except DraftIsNotACausalLMError as error:
        raise ValueError(f"the target {name_or_path} is a DSpark draft: pass it as the draft (--draft), and the "
                         "model it drafts for as the target.") from error
    except ValueError as error:  # transformers' message lists every causal-LM config class: thousands of characters
        if not str(error).startswith("Unrecognized configuration class"):
            raise
        kind = AutoConfig.from_pretrained(name_or_path).model_type
        raise ValueError(f"the target {name_or_path} is a {kind} model, which AutoModelForCausalLM cannot load: "
                         "give a decoder-only causal LM.") from error


def load_draft(name_or_path: str | None, target, dtype: torch.dtype | str = "auto"):
    """A draft bound to `target`, on its device: a saved draft (Hub id or path), a LoRA adapter (`dspark train
    --lora`; a folder or Hub id) merged into its base, or the draft shipped for SmolLM2 when None. dtype "auto":
    [`fast_draft_dtype`]; a draft's dtype changes speed only, never what generate() returns."""
    from safetensors import SafetensorError

    from .model import DSparkDraftModel
    from .model.modeling_dspark import damaged_weights_error

    dtype = fast_draft_dtype(target) if dtype == "auto" else dtype
    if name_or_path is None:
        return default_draft(target, dtype)
    _check_name(name_or_path, "the draft")
    if _is_adapter(name_or_path):
        from peft import PeftConfig, PeftModel

        base = PeftConfig.from_pretrained(name_or_path).base_model_name_or_path
        if base is None:
            raise ValueError(f"The adapter in {name_or_path} does not name its base draft (base_model_name_or_path "
                             "in adapter_config.json): set it to the draft's folder or Hub id, or load the draft and "
                             "apply the adapter with peft.PeftModel.from_pretrained(draft, adapter_folder).")
        draft = _adapter_base(name_or_path, base, dtype).to(target.device)
        # merged, every caller sees a plain draft (calibrate and export save a full one); same function
        try:
            draft = PeftModel.from_pretrained(draft, name_or_path).merge_and_unload()
        except SafetensorError as error:
            raise damaged_weights_error(name_or_path, error) from error
    else:
        draft = DSparkDraftModel.from_pretrained(name_or_path, dtype=dtype).to(target.device)
    return draft.bind_target(target).eval()


def refuse_adapter(name_or_path: str, command: str) -> None:
    """Refuse, in one line, a LoRA adapter where `command` needs a whole draft (it would publish or export the adapter
    under a full draft's card): say how to merge it first."""
    if _is_adapter(name_or_path):
        raise ValueError(f"{name_or_path} is a LoRA adapter (dspark train --lora), not a draft, which {command} needs: "
                         f"merge it into its base first with `dspark calibrate --draft {name_or_path} --output DIR ...` "
                         "(which saves the merged, calibrated draft), then pass DIR.")


def _is_adapter(name_or_path: str) -> bool:
    """Whether a folder or Hub repo holds a peft adapter (adapter_config.json) rather than a draft."""
    if Path(name_or_path).expanduser().is_dir():
        return (Path(name_or_path).expanduser() / "adapter_config.json").is_file()
    from transformers.utils import find_adapter_config_file

    return find_adapter_config_file(name_or_path) is not None  # the Hub, or its cache offline


def _adapter_base(adapter: str, base: str, dtype):
    """The base draft an adapter names: a folder (absolute, or relative to the working directory or to the adapter's
    folder), else a Hub id. Adapters trained before dspark-hf recorded absolute paths name their base relative to
    the directory training ran in, which is no Hub id: that says so in one line."""
    from .model import DSparkDraftModel

    folder = next((p for p in (Path(base).expanduser(), Path(adapter) / base) if p.is_dir()), None)
    if folder is not None:
        return DSparkDraftModel.from_pretrained(folder, dtype=dtype)
    try:
        return DSparkDraftModel.from_pretrained(base, dtype=dtype)
    except OSError as error:
        reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise ValueError(f"The adapter's base draft {base} (base_model_name_or_path in {adapter}/adapter_config.json) "
                         f"is not a folder here, nor a draft loadable from the Hub ({reason}): set it to the base "
                         "draft's folder or Hub id.") from error


def load_models(target: str | None = None, draft: str | None = None, dtype: torch.dtype = torch.float32,
                draft_dtype: torch.dtype | str = "auto", device: str | torch.device = "auto"):
    """(target, tokenizer, draft): [`load_target`] then [`load_draft`]; None names the embedded defaults."""
    model, tokenizer = load_target(target, dtype, device)
    return model, tokenizer, load_draft(draft, model, draft_dtype)


@dataclass
class ModelOptions:
    """The models a command runs, as its `--target`, `--draft`, `--dtype`, `--draft-dtype` and `--device` say."""

    target: str | None = option(None, "target model path or hub id (default: embedded SmolLM2-135M-Instruct)")
    draft: str | None = option(None, "DSpark draft path or hub id, or a LoRA adapter folder from `dspark train "
                               "--lora` (merged into its base draft) (default: the draft shipped for the target)")
    dtype: str = option("float32", "dtype of the target. float32 (default): greedy DSpark output token-identical to "
                        "plain generate(). bfloat16: faster on CPUs with bf16 units (AVX512-BF16, AMX); greedy "
                        "output identical up to rounding (see HalfPrecisionGreedyWarning)",
                        choices=["float32", "bfloat16"])
    draft_dtype: str = option("auto", "dtype of the draft; never changes the output, only speed. auto (default): "
                              "bfloat16 where the device computes it natively (CUDA, AVX512-BF16, AMX), else the "
                              "target's dtype", choices=["auto", "float32", "bfloat16"])
    device: str = option("auto", "where the models run: auto (default: the CUDA GPU when torch sees one, else the "
                         "CPU), cpu, cuda or cuda:N")

    def load(self, draft: bool = True):
        """(target, tokenizer, draft), or (target, tokenizer, None) without the draft."""
        dtype = getattr(torch, self.dtype)
        if not draft:
            return (*load_target(self.target, dtype, self.device), None)
        draft_dtype = self.draft_dtype if self.draft_dtype == "auto" else getattr(torch, self.draft_dtype)
        return load_models(self.target, self.draft, dtype, draft_dtype, self.device)

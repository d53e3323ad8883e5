"""The one module that touches transformers internals, for every release from the oldest we declare to the newest.

What it knows:
- the name under which the installed release passes the KV cache to `prepare_inputs_for_generation` and to the
  models' `forward`, and hands a prepared cache to a `custom_generate` callable: `past_key_values` up to 5.23,
  `cache` from 5.24 (where `past_key_values` and `cache_params` became deprecated aliases). It is read off the
  installed `prepare_inputs_for_generation`, not off a version number, so the package calls each release by its
  own name and raises none of its deprecation warnings;
- `GenerationMixin.generate`, which `import dspark_hf` wraps once (`install_generate_hook`) so that
  `generate(assistant_model=<DSpark draft>)` reaches DSpark decoding;
- the pad token a generation config decodes with (a private field of `GenerationConfig`);
- which attention masks a model takes for rows that keep their own offsets in DSpark's cache (a prepared 4D mask,
  or a dict of them by layer type, which masking_utils passes through as they are), and in what format;
- when plain generate() compiles its decoding step (`compile_config`: a static cache, a device it compiles on, or
  `CompileConfig._compile_all_devices`), so that DSpark compiles exactly when it would.
"""

from __future__ import annotations

import inspect

import torch
from transformers import CompileConfig
from transformers.generation.utils import GenerationMixin

_prepare_parameters = inspect.signature(GenerationMixin.prepare_inputs_for_generation).parameters
# the installed release's name for the KV cache in forward(), prepare_inputs_for_generation() and generate()'s
# model_kwargs
CACHE_ARG: str = "cache" if "cache" in _prepare_parameters else "past_key_values"
# every name under which a caller of generate() can hand over a cache, on any supported release
CACHE_NAMES: tuple[str, ...] = ("past_key_values", "cache", "cache_params")

original_generate = GenerationMixin.generate
generate_signature = inspect.signature(original_generate)


def with_cache(cache) -> dict:
    """Keyword arguments that pass `cache` to a model's forward under the installed release's name."""
    return {CACHE_ARG: cache}


def cache_given(kwargs: dict) -> tuple[str, object] | None:
    """(name, cache) of a cache a caller passed among generate()'s keyword arguments, under any of its names."""
    for name in CACHE_NAMES:
        if kwargs.get(name) is not None:
            return name, kwargs[name]
    return None


def pad_token_id(generation_config) -> int | None:
    """The pad token id generate() pads finished rows with (set by generate() from the config and the model)."""
    pad = generation_config._pad_token_tensor
    return int(pad) if pad is not None else None


def install_generate_hook(wrapper) -> None:
    """Make `wrapper` (a function of generate()'s own signature) `GenerationMixin.generate`; idempotent."""
    if GenerationMixin.generate is not wrapper:
        GenerationMixin.generate = wrapper


# -- what a model's attention reads, for rows that keep their own offsets (generation/cache.py) --------------------
# Every family built on transformers' masking_utils returns a prepared 4D mask as it is (`_preprocess_mask_arguments`
# exits early on one), and those with several layer types (sliding windows) take a dict of them by type. A few build
# something else from the 2D mask too: ALiBi's position biases (Bloom, MPT, Falcon with alibi), which need a 2D mask.
_ALIBI_MODEL_TYPES = ("bloom", "mpt")
_ROW_MASK_LAYER_TYPES = ("full_attention", "sliding_attention")
# attention implementations and the mask each reads: SDPA a boolean one (True: may attend), eager one to add
_ROW_MASK_FORMATS = ("sdpa", "eager")


def row_masks_refused(model) -> str | None:
    """Why `model` cannot take a prepared mask per row, in a phrase, or None when it can."""
    config = model.config.get_text_config()
    if config.model_type in _ALIBI_MODEL_TYPES or getattr(config, "alibi", False):
        return f"{config.model_type} builds ALiBi position biases from a 2D attention mask"
    implementation = model.config._attn_implementation
    if implementation not in _ROW_MASK_FORMATS:
        return f"its attention implementation {implementation!r} reads no prepared 4D mask (use 'sdpa' or 'eager')"
    other = sorted(set(getattr(config, "layer_types", None) or ()) - set(_ROW_MASK_LAYER_TYPES))
    if other:
        return f"its layer types {other} need masks of their own"
    return None


def sliding_window(model) -> int | None:
    """The window of the model's sliding-window layers, or None when it has none."""
    config = model.config.get_text_config()
    types = getattr(config, "layer_types", None)
    if types is not None and "sliding_attention" not in types:
        return None
    return getattr(config, "sliding_window", None)


def prepared_masks(model, allowed: torch.Tensor, windowed: torch.Tensor | None):
    """The attention mask(s) `model` takes for queries that may attend where `allowed` (B, Q, W) is True (and, in its
    sliding-window layers, where `windowed` is): one 4D mask (B, 1, Q, W), or a dict of them by layer type, each in
    the format its attention implementation reads."""
    def formatted(mask: torch.Tensor) -> torch.Tensor:
        mask = mask[:, None]
        if model.config._attn_implementation == "eager":  # added to the scores
            dtype = model.dtype
            return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(~mask,
                                                                                         torch.finfo(dtype).min)
        return mask

    types = getattr(model.config.get_text_config(), "layer_types", None)
    if types is None:
        return formatted(allowed if windowed is None else windowed)
    masks = {"full_attention": formatted(allowed)}
    if "sliding_attention" in types:
        masks["sliding_attention"] = formatted(windowed)
    return masks


# -- compiling, as plain generate() decides it ---------------------------------------------------------------------
def compile_config(model, generation_config):
    """The `CompileConfig` plain generate() would compile its decoding step with for this call, or None: asked for
    with ``cache_implementation="static"`` (a compilable cache), on a CUDA (or XPU...) device, or on any device where
    the config's private `_compile_all_devices` says so; never with ``disable_compile``."""
    if generation_config.disable_compile or generation_config.cache_implementation != "static":
        return None
    config = generation_config.compile_config
    on_all_devices = bool(config is not None and config._compile_all_devices)
    if model.device.type not in ("cuda", "xpu", "neuron", "tpu") and not on_all_devices:
        return None
    return config if config is not None else CompileConfig()


def compile_config_anywhere() -> CompileConfig:
    """transformers' default `CompileConfig`, told to compile on any device (a CPU included): what the benchmarks
    run plain generate() and DSpark's fast path with, so that their compiled arms compile wherever they run."""
    config = CompileConfig()
    config._compile_all_devices = True
    return config

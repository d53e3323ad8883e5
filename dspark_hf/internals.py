"""The one module that touches transformers internals, for every release from the oldest we declare to the newest.

What it knows:
- the name under which the installed release passes the KV cache to `prepare_inputs_for_generation` and to the
  models' `forward`, and hands a prepared cache to a `custom_generate` callable: `past_key_values` up to 5.23,
  `cache` from 5.24 (where `past_key_values` and `cache_params` became deprecated aliases). It is read off the
  installed `prepare_inputs_for_generation`, not off a version number, so the package calls each release by its
  own name and raises none of its deprecation warnings;
- `GenerationMixin.generate`, which `import dspark_hf` wraps once (`install_generate_hook`) so that
  `generate(assistant_model=<DSpark draft>)` reaches DSpark decoding;
- the pad token a generation config decodes with (a private field of `GenerationConfig`).
"""

from __future__ import annotations

import inspect

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

"""Route ``generate(assistant_model=<DSparkDraftModel>)`` to DSpark decoding.

transformers chooses candidate generators from a hard-coded chain and its assisted loop refuses batch size > 1,
so DSpark runs as a ``custom_generate`` callable (the public extension point). ``import dspark_hf`` has
`dspark_hf.internals` wrap ``GenerationMixin.generate`` with `_generate` once: when ``assistant_model`` is a DSpark
draft (or a peft wrapper of one) the call is forwarded with ``custom_generate=dspark_generate``; a call that names
``custom_generate=dspark_generate`` itself gets the same refusals, its stop strings turned into a criterion and its
streamer passed on; every other call goes to the original method untouched.
The wrapper keeps no state and patches no model instance, so concurrent generate() calls are independent.
"""

from __future__ import annotations

import functools

import torch
from transformers import PreTrainedConfig, StoppingCriteriaList, StopStringCriteria

from .. import internals
from ..model.configuration_dspark import DSparkConfig
from ..model.modeling_dspark import DSparkDraftModel
from .decoding import dspark_generate, unwrap_draft

_original_generate = internals.original_generate
_signature = internals.generate_signature


@functools.wraps(_original_generate)
def _generate(self, *args, **kwargs):
    bound = _signature.bind_partial(self, *args, **kwargs).arguments
    draft = unwrap_draft(bound.get("assistant_model"))  # a DSpark draft, possibly with peft adapters
    if bound.get("custom_generate") is dspark_generate:
        return _dspark_generate_route(self, bound)
    if not isinstance(draft, DSparkDraftModel):
        _refuse_a_draft_of_another_class(draft)
        _refuse_dspark_options_without_a_draft(bound)
        return _original_generate(self, *args, **kwargs)
    if bound.get("custom_generate") is not None:
        raise ValueError("Pass either assistant_model=<DSpark draft> or custom_generate, not both.")
    extra = bound.pop("kwargs", {})
    bound.pop("self")
    bound.pop("assistant_model")
    streamer = bound.pop("streamer", None)
    policy, ssd = extra.pop("verification_policy", None), extra.pop("ssd", None)
    prompt_device = _prepare_for_dspark(self, bound, extra)
    out = _original_generate(self, **bound, **extra, custom_generate=dspark_generate, draft_model=draft,
                             token_streamer=streamer, verification_policy=policy, ssd=ssd)
    return _on_the_prompt_s_device(out, prompt_device)


def _dspark_generate_route(model, bound: dict):
    """The documented extension point, generate(custom_generate=dspark_generate, draft_model=draft), checked as the
    assistant_model route is. generate() hands a custom_generate callable none of its own parameters, `streamer`
    included (it would get the prompt and nothing after it), so the streamer goes by the name dspark_generate
    reads."""
    if bound.get("assistant_model") is not None:
        raise ValueError("Pass either assistant_model=<DSpark draft> or custom_generate, not both.")
    extra = bound.pop("kwargs", {})
    bound.pop("self")
    prompt_device = _prepare_for_dspark(model, bound, extra)
    streamer = bound.pop("streamer", None)
    if streamer is not None:
        if extra.get("token_streamer") is not None:
            raise ValueError("Pass the streamer once: streamer= or token_streamer=, not both.")
        extra["token_streamer"] = streamer
    return _on_the_prompt_s_device(_original_generate(model, **bound, **extra), prompt_device)


def _prepare_for_dspark(model, bound: dict, extra: dict) -> torch.device | None:
    """What both routes need before generate() hands the call to dspark_generate, which gets none of generate()'s own
    parameters (`tokenizer` included). Returns the device the prompt came on."""
    _refuse_a_cache(extra)
    _refuse_token_healing(model, bound, extra)
    _stop_strings_as_criteria(model, bound, extra)
    return _prompt_on_the_target_s_device(model, bound, extra)


def _prompt_on_the_target_s_device(model, bound: dict, extra: dict) -> torch.device | None:
    """Plain generate() takes a prompt on another device than the model: it moves each forward's inputs there and
    decodes beside the prompt. DSpark decodes beside the target, so the prompt moves there first: generate() builds
    its processors and criteria (EOS ids, suppressed tokens...) on the prompt's device, and DSpark calls them with
    the target's scores."""
    prompt = bound.get("inputs") if bound.get("inputs") is not None else extra.get("input_ids")
    if not isinstance(prompt, torch.Tensor):
        return None
    for given, name in ((bound, "inputs"), (extra, "input_ids"), (extra, "attention_mask"), (extra, "position_ids")):
        if isinstance(given.get(name), torch.Tensor):
            given[name] = given[name].to(model.device)
    return prompt.device


def _on_the_prompt_s_device(out, device: torch.device | None):
    """The output where plain generate() leaves it: beside the prompt."""
    if device is None:
        return out
    if isinstance(out, torch.Tensor):
        return out.to(device)
    out.sequences = out.sequences.to(device)
    return out


def _refuse_a_cache(extra: dict) -> None:
    """Plain generate() fills a caller's cache for reuse; DSpark keeps its own. Refused under every name a
    transformers release accepts, so the message is the same on all of them."""
    given = internals.cache_given(extra)
    if given is not None:
        name = given[0]
        raise ValueError(f"{name} is not supported with a DSpark draft: it keeps its own cache, re-aligned every "
                         f"round, so a cache passed in would not be filled for reuse. Drop {name}.")


def _refuse_a_draft_of_another_class(model) -> None:
    """A DSpark draft loaded as remote code (trust_remote_code=True) before `import dspark_hf` is another class
    object than this package's, and transformers' assisted decoding cannot use it."""
    config = getattr(model, "config", None)
    if isinstance(config, PreTrainedConfig) and config.model_type == DSparkConfig.model_type:
        raise ValueError(f"This DSpark draft is a {type(model).__module__}.{type(model).__name__}, loaded as remote "
                         "code before dspark_hf was imported: load it with dspark_hf.DSparkDraftModel.from_pretrained "
                         "(or import dspark_hf before AutoModel.from_pretrained).")


def _refuse_dspark_options_without_a_draft(bound: dict) -> None:
    """ssd= and verification_policy= mean nothing to plain or assisted generate(), whose own error would only call
    them unused model_kwargs."""
    if bound.get("custom_generate") is not None:  # someone else's decoding loop: its arguments are its own
        return
    for name in ("ssd", "verification_policy"):
        if bound.get("kwargs", {}).get(name) is not None:
            got = type(bound.get("assistant_model")).__name__
            raise ValueError(f"{name}= applies to DSpark decoding: pass assistant_model=<a DSparkDraftModel> as well "
                             f"(got assistant_model of type {got}).")


def _refuse_token_healing(model, bound: dict, extra: dict) -> None:
    """generate() heals tokens with the tokenizer, which it drops on the custom_generate route."""
    if _effective(model, bound, extra, "token_healing"):
        raise ValueError("token_healing=True is not supported with a DSpark draft: heal the prompt first, "
                         "input_ids = target.heal_tokens(input_ids, tokenizer), and generate without token_healing.")


def _stop_strings_as_criteria(model, bound: dict, extra: dict) -> None:
    """generate() drops `tokenizer` on the custom_generate route, so stop strings become a criterion here."""
    stop_strings = _effective(model, bound, extra, "stop_strings")
    if not stop_strings:
        return
    tokenizer = extra.pop("tokenizer", None)
    if tokenizer is None:
        raise ValueError("stop_strings need the tokenizer: pass tokenizer=<the target's tokenizer> to generate().")
    criteria = StoppingCriteriaList(bound.get("stopping_criteria") or [])
    criteria.append(StopStringCriteria(tokenizer, stop_strings))
    bound["stopping_criteria"] = criteria
    extra["stop_strings"] = None  # a keyword argument outranks the passed and the model's generation config


def _effective(model, bound: dict, extra: dict, option: str):
    """The value of a generation option that generate() decodes with, merged as its _prepare_generation_config
    merges them: a keyword argument, else the passed generation_config's value, else the model's default."""
    if option in extra:
        return extra[option]
    passed = getattr(bound.get("generation_config"), option, None)
    return passed if passed is not None else getattr(model.generation_config, option, None)


def install() -> None:
    """Install the routing wrapper (idempotent)."""
    internals.install_generate_hook(_generate)

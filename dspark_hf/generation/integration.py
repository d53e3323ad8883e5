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
from transformers import StoppingCriteriaList, StopStringCriteria

from .. import internals
from ..model.modeling_dspark import DSparkDraftModel
from .decoding import dspark_generate
from .request import effective_option, refuse_for_plain_generate, refuse_on_the_way_in, unwrap_draft

_original_generate = internals.original_generate
_signature = internals.generate_signature


@functools.wraps(_original_generate)
def _generate(self, *args, **kwargs):
    bound = _signature.bind_partial(self, *args, **kwargs).arguments
    if bound.get("custom_generate") is dspark_generate:
        return _dspark_generate_route(self, bound)
    draft = unwrap_draft(bound.get("assistant_model"))  # a DSpark draft, possibly with peft adapters: once per call
    if not isinstance(draft, DSparkDraftModel):
        refuse_for_plain_generate(draft, bound)
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
    assistant_model route is, its draft unwrapped as there. generate() hands a custom_generate callable none of its
    own parameters, `streamer` included (it would get the prompt and nothing after it), so the streamer goes by the
    name dspark_generate reads."""
    if bound.get("assistant_model") is not None:
        raise ValueError("Pass either assistant_model=<DSpark draft> or custom_generate, not both.")
    extra = bound.pop("kwargs", {})
    bound.pop("self")
    if "draft_model" in extra:
        extra["draft_model"] = unwrap_draft(extra["draft_model"])
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
    refuse_on_the_way_in(model, bound, extra)
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


def _stop_strings_as_criteria(model, bound: dict, extra: dict) -> None:
    """generate() drops `tokenizer` on the custom_generate route, so stop strings become a criterion here."""
    stop_strings = effective_option(model, bound, extra, "stop_strings")
    if not stop_strings:
        return
    tokenizer = extra.pop("tokenizer", None)
    if tokenizer is None:
        raise ValueError("stop_strings need the tokenizer: pass tokenizer=<the target's tokenizer> to generate().")
    criteria = StoppingCriteriaList(bound.get("stopping_criteria") or [])
    criteria.append(StopStringCriteria(tokenizer, stop_strings))
    bound["stopping_criteria"] = criteria
    extra["stop_strings"] = None  # a keyword argument outranks the passed and the model's generation config


def install() -> None:
    """Install the routing wrapper (idempotent)."""
    internals.install_generate_hook(_generate)

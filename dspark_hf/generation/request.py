"""Checking a request: every generate() call that DSpark decoding cannot serve exactly is refused here, each with
one line that says what to do instead.

Some refusals must come before generate() prepares the call, on the way in ([`refuse_on_the_way_in`],
[`refuse_for_plain_generate`]): generate() would fill a cache the caller passed, heal tokens with a
tokenizer it then drops, or call DSpark's options unused model_kwargs. The rest read what generate() prepared
([`check_request`]). A draft wrapped by peft is unwrapped once per call, on the way in ([`unwrap_draft`]).
"""

from __future__ import annotations

import sys
import warnings

import torch
from transformers import PreTrainedConfig
from transformers.generation import logits_process as lp
from transformers.generation.configuration_utils import GenerationMode

from .. import internals
from ..errors import WrongTypeError
from ..model.configuration_dspark import DSparkConfig
from ..model.modeling_dspark import DSparkDraftModel
from .ssd import SSDConfig
from .transcript import IDS_FREE_PROCESSORS

_UNSUPPORTED_OUTPUTS = ("output_scores", "output_logits", "output_attentions", "output_hidden_states")
# processors that count their calls (one per generated token in plain generate())
_STATEFUL_PROCESSORS = (lp.SynthIDTextWatermarkLogitsProcessor,)
_KNOWN_MODEL_KWARGS = {"attention_mask", "position_ids", internals.CACHE_ARG, "use_cache", "logits_to_keep"}
# generation-config options that choose a decoding mode other than greedy search or sampling
_MODE_OPTIONS = ("num_beams", "num_beam_groups", "penalty_alpha", "dola_layers", "prompt_lookup_num_tokens",
                 "constraints", "force_words_ids")


def unwrap_draft(model):
    """The model inside a peft ``PeftModel`` (e.g. a DSpark draft with LoRA adapters), else `model` itself.

    The unwrapped draft still runs its adapters: peft's LoRA layers replace the draft's own linear layers and
    follow the wrapper's active adapter (``set_adapter``, ``disable_adapter()``).
    """
    peft = sys.modules.get("peft")  # nothing can be a PeftModel unless peft was imported
    if peft is None or not isinstance(model, peft.PeftModel):
        return model
    base = model.get_base_model()
    if isinstance(base, DSparkDraftModel) and model.active_peft_config.is_prompt_learning:
        raise ValueError(f"A {model.active_peft_config.peft_type} adapter (prompt learning) cannot adapt a DSpark "
                         "draft, which reads no prompt of its own: use an adapter that changes its layers (LoRA).")
    return base


# -- on the way in: before generate() prepares the call --------------------------------------------------------------
def refuse_on_the_way_in(model, bound: dict, extra: dict) -> None:
    """What generate() would act on before handing the call to DSpark decoding: a cache passed in (plain generate()
    fills a caller's cache for reuse; DSpark keeps its own), and token healing (done with the tokenizer, which
    generate() drops on the custom_generate route). `bound`: generate()'s bound arguments; `extra`: its kwargs."""
    given = internals.cache_given(extra)
    if given is not None:  # under every name a transformers release accepts, so the message is the same on all
        name = given[0]
        raise ValueError(f"{name} is not supported with a DSpark draft: it keeps its own cache (each row at its "
                         f"own offset), so a cache passed in would not be filled for reuse. Drop {name}.")
    if effective_option(model, bound, extra, "token_healing"):
        raise ValueError("token_healing=True is not supported with a DSpark draft: heal the prompt first, "
                         "input_ids = target.heal_tokens(input_ids, tokenizer), and generate without token_healing.")


def refuse_for_plain_generate(assistant, bound: dict) -> None:
    """A call on its way to plain or assisted generate(): a DSpark draft loaded as remote code before `import
    dspark_hf` (another class object than this package's, which transformers' assisted decoding cannot use), and
    ssd= or verification_policy=, which mean nothing there (generate()'s own error would only call them unused
    model_kwargs)."""
    config = getattr(assistant, "config", None)
    if isinstance(config, PreTrainedConfig) and config.model_type == DSparkConfig.model_type:
        raise ValueError(f"This DSpark draft is a {type(assistant).__module__}.{type(assistant).__name__}, loaded as "
                         "remote code before dspark_hf was imported: load it with dspark_hf.DSparkDraftModel"
                         ".from_pretrained (or import dspark_hf before AutoModel.from_pretrained).")
    if bound.get("custom_generate") is not None:  # someone else's decoding loop: its arguments are its own
        return
    for name in ("ssd", "verification_policy"):
        if bound.get("kwargs", {}).get(name) is not None:
            got = type(bound.get("assistant_model")).__name__
            raise ValueError(f"{name}= applies to DSpark decoding: pass assistant_model=<a DSparkDraftModel> as well "
                             f"(got assistant_model of type {got}).")


def effective_option(model, bound: dict, extra: dict, option: str):
    """The value of a generation option that generate() decodes with, merged as its _prepare_generation_config
    merges them: a keyword argument, else the passed generation_config's value, else the model's default."""
    if option in extra:
        return extra[option]
    passed = getattr(bound.get("generation_config"), option, None)
    return passed if passed is not None else getattr(model.generation_config, option, None)


# -- what generate() prepared ---------------------------------------------------------------------------------------
def check_request(model, draft, cfg, input_ids: torch.Tensor, model_kwargs: dict, processors, synced_gpus: bool,
                  streamer, ssd) -> None:
    """Raise for a call DSpark decoding cannot serve exactly; warn where greedy identity holds up to rounding only.
    model: the target; draft: the (unwrapped) draft; cfg: the generation config generate() prepared; input_ids and
    model_kwargs (attention_mask 0/1 as long) as generate() hands them over; ssd: an SSDConfig or None."""
    _check_models(model, draft)
    mode = cfg.get_generation_mode()
    _check_generation_config(cfg, mode, synced_gpus)
    _check_model_kwargs(model_kwargs)
    _check_prompt(model, input_ids, model_kwargs.get("attention_mask"), model_kwargs.get("position_ids"))
    if streamer is not None and input_ids.shape[0] > 1:
        raise ValueError("Streamers support batch size 1, as in transformers.")
    _refuse_stateful_processors(processors)
    if ssd is not None:
        _check_ssd(ssd, processors, draft.config.block_size)
    if mode == GenerationMode.GREEDY_SEARCH and model.dtype in (torch.bfloat16, torch.float16):
        warnings.warn(HalfPrecisionGreedyWarning.message(model.dtype), HalfPrecisionGreedyWarning, stacklevel=2)


class HalfPrecisionGreedyWarning(UserWarning):
    """Greedy decoding of a bf16/fp16 target: identity with plain generate() holds up to rounding only."""

    @staticmethod
    def message(dtype) -> str:
        name = str(dtype).replace("torch.", "")
        # Logits of a half-precision target are rounded to a few significant digits, so the top two often tie
        # or differ by one step; the verification forward (many tokens per row) and plain generate()'s one-token
        # forwards run different kernels, whose rounding breaks such near-ties differently.
        return (f"Greedy DSpark decoding of a {name} target: the output follows {name} greedy decoding but can "
                f"differ from plain generate() where the target's top logits tie within {name} rounding (the "
                "block verification forward rounds differently from one-token steps, as in transformers' own prompt "
                "lookup decoding). Load the target in float32 for token-identical output.")


def _check_models(model, draft) -> None:
    if not isinstance(draft, DSparkDraftModel):
        raise WrongTypeError(f"dspark_generate needs draft_model=<DSparkDraftModel>, got {type(draft).__name__}.")
    draft.check_config()  # a field assigned after loading (block_size, say) is checked as from_pretrained checks it
    if model.config.is_encoder_decoder:
        raise ValueError("DSpark decoding supports decoder-only targets.")
    placed = sorted({str(d) for d in (getattr(model, "hf_device_map", None) or {}).values()})
    if len(placed) > 1:  # the draft reads features of several target layers at once, and computes beside them
        raise ValueError(f"The target is spread over several devices ({', '.join(placed)}, from device_map): DSpark "
                         "decoding needs the target on one device. Load it with device_map=None and .to(device), "
                         "or with a single device in device_map.")
    elsewhere = sorted({str(p.device) for p in draft.parameters()} - {str(model.device)})
    if elsewhere:  # the draft reads the target's features and hands its blocks to the target: one device for both
        raise ValueError(f"The draft's weights are on {', '.join(elsewhere)} but the target runs on {model.device}: "
                         "a DSpark draft runs on its target's device. Move it with draft.to(target.device).")


def _check_generation_config(cfg, mode: GenerationMode, synced_gpus: bool) -> None:
    if mode not in (GenerationMode.GREEDY_SEARCH, GenerationMode.SAMPLE):
        chosen_by = ", ".join(f"{name}={getattr(cfg, name)!r}" for name in _MODE_OPTIONS
                              if getattr(cfg, name, None) not in (None, 1, False))
        raise ValueError(f"DSpark decoding supports greedy search and sampling, not {mode.value} (chosen by "
                         f"{chosen_by or 'the generation config'}). Drop those options or the draft.")
    if cfg.guidance_scale is not None and cfg.guidance_scale != 1:
        raise ValueError(f"guidance_scale={cfg.guidance_scale} is not supported with a DSpark draft: classifier-free "
                         "guidance runs the model inside a logits processor once per token. Drop it or the draft.")
    for flag in _UNSUPPORTED_OUTPUTS:
        if getattr(cfg, flag, False):
            raise ValueError(f"{flag}=True is not supported with a DSpark draft yet; use return_dict_in_generate=True "
                             "for the per-round record instead.")
    if synced_gpus:
        raise ValueError("synced_gpus=True is not supported with a DSpark draft.")
    if cfg.use_cache is False:
        raise ValueError("DSpark decoding needs the KV cache; do not pass use_cache=False.")
    if cfg.cache_implementation not in (None, "dynamic", "static"):
        raise ValueError(f"cache_implementation={cfg.cache_implementation!r} is not supported with a DSpark draft: "
                         "it keeps its own cache, preallocated for the call with each row at its own offset; "
                         "'static' also compiles its steps, as plain generate() compiles with a static cache.")


def _check_model_kwargs(model_kwargs: dict) -> None:
    """generate() hands over the empty cache it prepared (a caller's own was refused on the way in), which DSpark
    leaves unused: its own keeps each row at its own offset."""
    if model_kwargs.get("inputs_embeds") is not None:
        raise ValueError("inputs_embeds is not supported with a DSpark draft, which reads token ids: pass input_ids "
                         "instead (or drop the draft).")
    unknown = set(k for k, v in model_kwargs.items() if v is not None) - _KNOWN_MODEL_KWARGS
    if unknown:
        raise ValueError(f"DSpark decoding does not accept these generate() arguments: {sorted(unknown)}.")


def _check_prompt(model, input_ids: torch.Tensor, mask: torch.Tensor | None, positions: torch.Tensor | None) -> None:
    if input_ids.dtype.is_floating_point or input_ids.dtype.is_complex or input_ids.dtype == torch.bool:
        # plain generate() refuses them in the embedding lookup; cast to integers they would decode other tokens
        raise ValueError(f"input_ids are {str(input_ids.dtype).replace('torch.', '')}, but token ids are integers: "
                         "pass the ids the tokenizer returned (torch.long), not a cast or computed tensor.")
    if mask is not None and mask.shape != input_ids.shape:
        raise ValueError(f"attention_mask has shape {tuple(mask.shape)} but input_ids {tuple(input_ids.shape)}: pass "
                         "the mask the tokenizer returned with these ids (one entry per token).")
    vocab = getattr(model.get_input_embeddings(), "num_embeddings", None)
    if vocab is not None and input_ids.numel() and not bool(((input_ids >= 0) & (input_ids < vocab)).all()):
        raise ValueError(f"input_ids hold ids outside the target's vocabulary of {vocab} tokens (min "
                         f"{int(input_ids.min())}, max {int(input_ids.max())}): tokenize with the target's tokenizer.")
    if input_ids.shape[1] == 0 or (mask is not None and not bool(mask.bool().any(1).all())):
        empty = "the prompt is empty" if input_ids.shape[1] == 0 else \
            f"rows {mask.bool().any(1).logical_not().nonzero().flatten().tolist()} of the prompt are all padding"
        raise ValueError(f"DSpark decoding needs at least one prompt token in every row, but {empty}: start each "
                         "prompt with a token (e.g. the BOS token, or apply the chat template).")
    if mask is not None and not bool(mask[:, -1].all()):
        # each round's tokens go after the last column, so a row padded on the right would continue from its padding
        rows = mask[:, -1].logical_not().nonzero().flatten().tolist()
        raise ValueError(f"rows {rows} of the prompt are padded on the right (their attention mask ends in 0): DSpark "
                         "decoding needs left padding. Set tokenizer.padding_side = 'left' and tokenize again.")
    if positions is not None:  # generate() passes the mask's own positions; others change plain generate()'s output
        real = mask.bool() if mask is not None else torch.ones_like(input_ids, dtype=torch.bool)
        if not torch.equal(positions[real], (real.long().cumsum(1) - 1)[real]):
            raise ValueError("Custom position_ids are not supported with a DSpark draft, which numbers tokens by the "
                             "attention mask (0, 1, 2, ... over its real tokens): drop position_ids or the draft.")


def _refuse_stateful_processors(processors) -> None:
    """A processor that keeps state across calls assumes one call per generated token, as plain generate() makes;
    DSpark calls the processors at every drafted and verified position, so that state would run ahead."""
    stateful = [type(p).__name__ for p in processors if isinstance(p, _STATEFUL_PROCESSORS)]
    if stateful:
        raise ValueError(f"{', '.join(stateful)} keeps state across calls (SynthID watermarking: watermarking_config) "
                         "and is not supported with a DSpark draft, which calls logits processors at every drafted "
                         "and verified position: drop it or the draft.")


def _check_ssd(ssd, processors, gamma: int) -> None:
    if not isinstance(ssd, SSDConfig):
        raise WrongTypeError(f"ssd must be a dspark_hf.SSDConfig, got {type(ssd).__name__}.")
    ssd.validate()
    if not isinstance(ssd.fan_out, str):
        if len(ssd.fan_out) not in (gamma, gamma + 1):
            raise ValueError(f"SSDConfig.fan_out has {len(ssd.fan_out)} counts, but this draft's block of {gamma} "
                             f"needs one per number of accepted tokens 0..{gamma - 1} ({gamma} counts).")
        if len(ssd.fan_out) == gamma + 1 and ssd.fan_out[gamma]:
            raise ValueError(f"SSDConfig.fan_out gives {ssd.fan_out[gamma]} blocks to all {gamma} tokens accepted, "
                             "an outcome no cache can hold (the draft has no distribution for the token after its "
                             "block): move them to k < block size.")
    reading_ids = [type(p).__name__ for p in processors if not isinstance(p, IDS_FREE_PROCESSORS)]
    if reading_ids:
        raise ValueError(f"SSD drafts blocks for tokens not yet committed, which logits processors that read the "
                         f"token ids cannot see: drop {', '.join(reading_ids)} (e.g. repetition_penalty, "
                         "min_new_tokens, bad_words_ids) or decode without ssd.")

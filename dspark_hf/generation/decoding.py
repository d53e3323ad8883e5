"""DSpark speculative decoding as a `generate()` decoding method, for any batch size.

Each round: the draft proposes a full block from every row's anchor; a verification policy decides how many of
those tokens each row sends to the target; one target forward scores them all; rejection sampling (or argmax
matching) keeps a prefix and adds the target's own next token. The target's hidden states of the kept tokens
become new draft context. Rows live flush right in every buffer (see `ragged`), finished rows leave the batch.
"""

from __future__ import annotations

import sys
import warnings

import torch
from transformers import DynamicCache, LogitsProcessorList, StoppingCriteriaList
from transformers.generation import logits_process as lp
from transformers.generation.configuration_utils import GenerationMode
from transformers.generation.stopping_criteria import MaxLengthCriteria

from .. import internals
from ..devices import clock
from ..model.modeling_dspark import DSparkDraftModel
from ..scheduling.auto import AutoScheduled
from ..scheduling.policies import FullBlock, as_policy, checked_lengths
from . import verify
from .drafting import VOCAB_FREE_PROCESSORS, drafter, empty_block
from .ssd import SSDConfig, SSDMixin
from .ragged import Commit, leading_padding
from .records import DSparkGenerateOutput, DSparkRound
from .streamers import RoundStreamer

_UNSUPPORTED_OUTPUTS = ("output_scores", "output_logits", "output_attentions", "output_hidden_states")
# processors that read no ids, only the scores: safe to apply to any subset of rows in one call
_IDS_FREE_PROCESSORS = VOCAB_FREE_PROCESSORS + (lp.SuppressTokensLogitsProcessor,)
# processors that count their calls (one per generated token in plain generate())
_STATEFUL_PROCESSORS = (lp.SynthIDTextWatermarkLogitsProcessor,)
_KNOWN_MODEL_KWARGS = {"attention_mask", "position_ids", internals.CACHE_ARG, "use_cache", "logits_to_keep"}
# generation-config options that choose a decoding mode other than greedy search or sampling
_MODE_OPTIONS = ("num_beams", "num_beam_groups", "penalty_alpha", "dola_layers", "prompt_lookup_num_tokens",
                 "constraints", "force_words_ids")


def dspark_generate(
    model,
    input_ids: torch.LongTensor,
    logits_processor: LogitsProcessorList,
    stopping_criteria: StoppingCriteriaList,
    generation_config,
    synced_gpus: bool = False,
    draft_model: DSparkDraftModel | None = None,
    token_streamer=None,
    verification_policy=None,
    ssd: SSDConfig | None = None,
    **model_kwargs,
):
    """Decoding method for ``target.generate(custom_generate=dspark_generate, draft_model=draft, ...)``.

    `target.generate(**inputs, assistant_model=draft)` routes here after ``import dspark_hf``. Extra arguments:
    draft_model (a [`DSparkDraftModel`] built for `model`, or a peft wrapper of one), token_streamer (a
    transformers streamer; batch size 1; one with a `put_round(DSparkRound)` method also gets each round's record,
    see `DSparkRoundStreamer`), verification_policy (a `dspark_hf.scheduling` policy, or a callable(confidences
    (R, gamma) or None, gamma, R) -> verify lengths (R,); default: `AutoScheduled()`, which plans against this
    machine's measured costs and drafts only while drafting pays; with `ssd`, `FullBlock()`), ssd (an
    [`SSDConfig`]: speculative speculative decoding, the next block prepared while the target verifies). Stop
    strings work on both routes (with `tokenizer=`, which generate() drops on this one, so `import dspark_hf` turns
    them into a `StopStringCriteria` first). Returns what `generate()` returns; with ``return_dict_in_generate=True``
    a [`DSparkGenerateOutput`].
    """
    draft_model = unwrap_draft(draft_model)
    input_ids = input_ids.long()  # plain generate() returns int64 ids for any integer prompt
    if model_kwargs.get("attention_mask") is not None:  # a float mask too: positions are sums of it
        model_kwargs["attention_mask"] = model_kwargs["attention_mask"].bool().long()
    _check_request(model, draft_model, generation_config, synced_gpus, model_kwargs, input_ids, token_streamer)
    _refuse_stateful_processors(logits_processor)
    if not draft_model.is_bound_to(model):
        draft_model.bind_target(model)
    args = (model, draft_model, input_ids, model_kwargs.get("attention_mask"), logits_processor, stopping_criteria,
            generation_config)
    if ssd is None:
        policy = AutoScheduled() if verification_policy is None else as_policy(verification_policy)
        return _Decoder(*args, policy, token_streamer).run()
    _check_ssd(ssd, logits_processor, draft_model.config.block_size)
    policy = FullBlock() if verification_policy is None else as_policy(verification_policy)
    return _SSDDecoder(*args, policy, token_streamer, ssd=ssd).run()


def _check_ssd(ssd, processors, gamma: int) -> None:
    if not isinstance(ssd, SSDConfig):
        raise TypeError(f"ssd must be a dspark_hf.SSDConfig, got {type(ssd).__name__}.")
    ssd.validate()
    if not isinstance(ssd.fan_out, str):
        if len(ssd.fan_out) not in (gamma, gamma + 1):
            raise ValueError(f"SSDConfig.fan_out has {len(ssd.fan_out)} counts, but this draft's block of {gamma} "
                             f"needs one per number of accepted tokens 0..{gamma - 1} ({gamma} counts).")
        if len(ssd.fan_out) == gamma + 1 and ssd.fan_out[gamma]:
            raise ValueError(f"SSDConfig.fan_out gives {ssd.fan_out[gamma]} blocks to all {gamma} tokens accepted, "
                             "an outcome no cache can hold (the draft has no distribution for the token after its "
                             "block): move them to k < block size.")
    reading_ids = [type(p).__name__ for p in processors if not isinstance(p, _IDS_FREE_PROCESSORS)]
    if reading_ids:
        raise ValueError(f"SSD drafts blocks for tokens not yet committed, which logits processors that read the "
                         f"token ids cannot see: drop {', '.join(reading_ids)} (e.g. repetition_penalty, "
                         "min_new_tokens, bad_words_ids) or decode without ssd.")


def _refuse_stateful_processors(processors) -> None:
    """A processor that keeps state across calls assumes one call per generated token, as plain generate() makes;
    DSpark calls the processors at every drafted and verified position, so that state would run ahead."""
    stateful = [type(p).__name__ for p in processors if isinstance(p, _STATEFUL_PROCESSORS)]
    if stateful:
        raise ValueError(f"{', '.join(stateful)} keeps state across calls (SynthID watermarking: watermarking_config) "
                         "and is not supported with a DSpark draft, which calls logits processors at every drafted "
                         "and verified position: drop it or the draft.")


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


def _check_request(model, draft, cfg, synced_gpus, model_kwargs, input_ids, streamer):
    if not isinstance(draft, DSparkDraftModel):
        raise TypeError(f"dspark_generate needs draft_model=<DSparkDraftModel>, got {type(draft).__name__}.")
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
    mode = cfg.get_generation_mode()
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
    if cfg.cache_implementation not in (None, "dynamic"):
        raise ValueError(f"cache_implementation={cfg.cache_implementation!r} is not supported with a DSpark draft: "
                         "it keeps its own dynamic cache (rows are re-aligned every round).")
    # generate() hands over the empty cache it prepared; a caller's own was refused by name on the way in
    given = internals.cache_given(model_kwargs)
    if given is not None and (not isinstance(given[1], DynamicCache) or given[1].get_seq_length() > 0):
        raise ValueError(f"Passing {given[0]} is not supported with a DSpark draft: the prompt is prefilled "
                         "inside the DSpark loop.")
    if model_kwargs.get("inputs_embeds") is not None:
        raise ValueError("inputs_embeds is not supported with a DSpark draft, which reads token ids: pass input_ids "
                         "instead (or drop the draft).")
    unknown = set(k for k, v in model_kwargs.items() if v is not None) - _KNOWN_MODEL_KWARGS
    if unknown:
        raise ValueError(f"DSpark decoding does not accept these generate() arguments: {sorted(unknown)}.")
    mask = model_kwargs.get("attention_mask")
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
    positions = model_kwargs.get("position_ids")
    if positions is not None:  # generate() passes the mask's own positions; others change plain generate()'s output
        real = mask.bool() if mask is not None else torch.ones_like(input_ids, dtype=torch.bool)
        if not torch.equal(positions[real], (real.long().cumsum(1) - 1)[real]):
            raise ValueError("Custom position_ids are not supported with a DSpark draft, which numbers tokens by the "
                             "attention mask (0, 1, 2, ... over its real tokens): drop position_ids or the draft.")
    if streamer is not None and input_ids.shape[0] > 1:
        raise ValueError("Streamers support batch size 1, as in transformers.")
    if mode == GenerationMode.GREEDY_SEARCH and model.dtype in (torch.bfloat16, torch.float16):
        warnings.warn(HalfPrecisionGreedyWarning.message(model.dtype), HalfPrecisionGreedyWarning, stacklevel=2)


def _clip_records(rounds: list[list[DSparkRound]], generated: int) -> None:
    """Make each round's `committed` count what reached the output: without an EOS id, a stopping criterion that
    fires in every row ends the output inside the last rounds' chunks (the first token came from the prefill)."""
    for row in rounds:
        left = generated - 1
        for r in row:
            r.committed = max(0, min(r.committed, left))
            left -= r.committed


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


class _Decoder:
    """State of one batched DSpark decode. Active rows are right-aligned in `mask`, `cache` and `context`; `mask`
    covers every committed token (anchor last), the target cache every token but the anchor, and the draft context
    followed by `pending` (target features of tokens committed in rounds without a draft, encoded when drafting
    resumes) every token but the anchor too.
    """

    def __init__(self, target, draft, prompt, prompt_mask, processors, criteria, cfg, policy, streamer):
        self.target, self.draft, self.cfg, self.policy, self.streamer = target, draft, cfg, policy, streamer
        self.draft_block = drafter(draft)
        self.prompt = prompt
        self.prompt_mask = prompt_mask if prompt_mask is not None else torch.ones_like(prompt)
        self.processors = processors
        self.criteria = StoppingCriteriaList(c for c in criteria if not isinstance(c, MaxLengthCriteria))
        self.length_criteria = [c for c in criteria if isinstance(c, MaxLengthCriteria)]
        self.longest = 0  # generated tokens of the longest row so far: plain generate()'s sequence length, less P
        # as in plain generate(): rows stopped by a criterion are padded only when an EOS criterion is present;
        # otherwise they keep generating until every row has stopped, and the output ends where the last one did
        self.pads_finished = any(hasattr(c, "eos_token_id") for c in criteria)
        self.do_sample = cfg.get_generation_mode() == GenerationMode.SAMPLE
        B, P = prompt.shape
        # a MaxLengthCriteria of the caller's replaces the one generate() builds from max_length
        limits = [c.max_length for c in criteria if isinstance(c, MaxLengthCriteria)]
        # (plain generate() decodes one token before it first asks the criteria, however low the limit)
        self.max_new = max(min(limits) - P, 1) if limits else cfg.max_length - P
        pad = internals.pad_token_id(cfg)
        self.pad_id = pad if pad is not None else 0
        self.gen = prompt.new_full((B, 0), self.pad_id)  # grows with the output, never to the limit ahead of it
        self.n_gen = prompt.new_zeros(B)
        self.stopped_at = prompt.new_zeros(B)  # output length at which a criterion first fired, 0 if none yet
        self.rounds: list[list[DSparkRound]] = [[] for _ in range(B)]
        self._one_token_left = False  # this round's: every row has at most one token left, nothing to verify
        self.timings = {"prefill": 0.0, "draft": 0.0, "target": 0.0, "total": 0.0}

    # -- what plain generate() would see ---------------------------------------------------------------------------
    def _plain_batches(self, rows: torch.Tensor, extra: torch.Tensor):
        """Yield (selector into rows, input_ids (B, T)) so that every active row is called with exactly the ids plain
        generate() would pass its logits processors and stopping criteria: padded prompt + generated tokens +
        `extra`. Processors may keep per-row state (e.g. repetition_penalty's prompt lengths), so each call covers
        the whole original batch in order; rows of other lengths show their own ids cut or padded to the length
        (ids plain generate() shows too: earlier steps, or a finished row) and their outputs are unused."""
        lengths = self.n_gen[rows]
        B, P = self.prompt.shape
        if rows.numel() == B and bool((lengths == lengths[0]).all()):  # no row finished, none ahead: nothing to fill
            yield torch.arange(B, device=rows.device), torch.cat([self.prompt, self.gen[:, :int(lengths[0])], extra], 1)
            return
        groups = lengths.unique().tolist()
        history = torch.cat([self.prompt, self._generated(max(groups) + extra.shape[1])], 1)
        for g in groups:
            sel = (lengths == g).nonzero().squeeze(1)
            r = rows[sel]
            ids = history[:, :P + g + extra.shape[1]].clone()
            ids[r] = torch.cat([self.prompt[r], self.gen[r, :g], extra[sel]], dim=1)
            yield sel, ids

    def _generated(self, width: int) -> torch.Tensor:
        """(B, width): each row's first `width` generated tokens, padded where it has fewer."""
        part = self.gen[:, :width]
        missing = width - part.shape[1]
        return torch.cat([part, part.new_full((part.shape[0], missing), self.pad_id)], 1) if missing else part

    def _make_room(self, width: int) -> None:
        """Widen `gen` to at least `width` columns, doubling (up to the length limit) so that a limit far beyond
        the output costs nothing and the copies add up to O(output)."""
        if width > self.gen.shape[1]:
            self.gen = self._generated(max(width, min(2 * self.gen.shape[1], self.max_new)))

    def _full(self, rows, sel, values):
        full = values.new_zeros(self.prompt.shape[0], *values.shape[1:])
        full[rows[sel]] = values[sel]
        return full

    def _process(self, rows, prefix, logits):
        """Logits processors on (R, V) logits whose rows continue generated tokens + prefix (R, k)."""
        logits = logits.float()
        if len(self.processors) == 0:
            return logits
        if all(isinstance(p, _IDS_FREE_PROCESSORS) for p in self.processors):
            return self.processors(prefix, logits)  # they read only the scores, row by row
        out = torch.empty_like(logits)
        for sel, ids in self._plain_batches(rows, prefix):
            out[sel] = self.processors(ids, self._full(rows, sel, logits))[rows[sel]]
        return out

    def _stop_index(self, rows, chunk, counts, scores):
        """1-based position inside each row's chunk where a stopping criterion fires, 0 if none does."""
        stop_at = torch.zeros_like(counts)
        if len(self.criteria) == 0:
            return stop_at
        for k in range(1, int(counts.max()) + 1):
            for sel, ids in self._plain_batches(rows, chunk[:, :k]):
                # criteria read the scores, never write them: a whole batch in order gets them without a copy
                full = scores[:, k - 1] if sel.numel() == ids.shape[0] else self._full(rows, sel, scores[:, k - 1])
                fired = self.criteria(ids, full)[rows[sel]].to(counts.device)
                s = sel[fired & (stop_at[sel] == 0) & (counts[sel] >= k)]
                stop_at[s] = k
        return stop_at

    def _emit(self, rows, chunk, counts, stop_at):
        """Append chunk[:, :counts] to the rows' outputs; return which rows are finished by length."""
        k = torch.arange(chunk.shape[1], device=chunk.device)
        take = k < counts[:, None]
        slots = self.n_gen[rows][:, None] + k
        end = int((self.n_gen[rows] + counts).max())
        self._make_room(end)
        if end > self.longest:
            self._pass_lengths_to_the_length_criteria(self.longest, end)
            self.longest = end
        self.gen[rows[:, None].expand_as(chunk)[take], slots[take]] = chunk[take]
        self.n_gen[rows] += counts
        if self.streamer is not None:  # batch size 1: the output ends where a criterion fired, even without EOS
            self.streamer.put(chunk[0, : int(stop_at[0]) or int(counts[0])].cpu())
        return self.n_gen[rows] >= self.max_new

    def _pass_lengths_to_the_length_criteria(self, before: int, after: int) -> None:
        """Call the length criteria as plain generate() would have between `before` and `after` generated tokens: the
        limit is kept here, but transformers' criterion also warns (once) when a sequence grows past the target's
        max_position_embeddings short of the limit. The longest such length stands for all of them."""
        P = self.prompt.shape[1]
        for criterion in self.length_criteria:
            length = min(P + after, criterion.max_length - 1)
            if length > P + before:
                criterion(self.prompt.new_empty(1, length), None)

    def _forward(self, input_ids, mask, positions, cache, logits_to_keep, timing: str | None = "target"):
        """Target forward returning only the hidden states the draft reads; its time is added to `timing`."""
        start = self._clock()
        out = self.target(input_ids=input_ids, attention_mask=mask, position_ids=positions,
                          **internals.with_cache(cache), use_cache=True,
                          output_hidden_states=self.draft.hidden_states_request, logits_to_keep=logits_to_keep)
        if timing is not None:
            self.timings[timing] += self._clock() - start
        return out

    def _clock(self) -> float:
        """The clock of the decode's timings (`devices.clock` on its device)."""
        return clock(self.prompt.device)

    # -- the decode ------------------------------------------------------------------------------------------------
    def run(self):
        start = self._clock()
        if self.streamer is not None:
            self.streamer.put(self.prompt.cpu())
        if self.max_new > 0:
            self.policy.prepare(self.target, self.draft, self.prompt.shape[0], sampling=self.do_sample)
            self._prefill()
            self.timings["prefill"] = self._clock() - start
            while self.rows.numel() > 0:
                self._round()
        self.timings["total"] = self._clock() - start
        if self.streamer is not None:
            self.streamer.end()
        generated = min(int(self.n_gen.max()), self.max_new)
        sequences = torch.cat([self.prompt, self.gen[:, :generated]], 1)
        if self.cfg.return_dict_in_generate:
            _clip_records(self.rounds, generated)
            return DSparkGenerateOutput(sequences=sequences, rounds=self.rounds, timings=self.timings)
        return sequences

    def _prefill(self):
        """Run the prompt once, sample the first token (it becomes the first anchor), seed the draft context."""
        B = self.prompt.shape[0]
        rows = torch.arange(B, device=self.prompt.device)
        mask = self.prompt_mask
        positions = (mask.long().cumsum(1) - 1).clamp_min(0)
        cache = DynamicCache()
        out = self._forward(self.prompt, mask, positions, cache, logits_to_keep=1, timing=None)  # in "prefill"
        scores = self._process(rows, self.prompt.new_zeros(B, 0), out.logits[:, -1])
        token = self._pick(scores)
        features = self.draft.target_features(out.hidden_states)
        context = self.draft.encode_context(features, positions, mask.bool())

        ones = torch.ones_like(token)
        stop_at = self._stop_index(rows, token[:, None], ones, scores[:, None])
        done = self._finish(rows, token[:, None], ones, stop_at)
        self.rows, self.mask, self.cache, self.context, self.anchor = rows, torch.cat(
            [mask, ones[:, None].to(mask.dtype)], 1), cache, context, token
        self.pending, self.pending_positions = features[:, :0], positions[:, :0]
        self._keep(~done)

    def _finish(self, rows, chunk, counts, stop_at):
        """Commit the chunk; return which rows are done (length limit, or stopped)."""
        first = (stop_at > 0) & (self.stopped_at[rows] == 0)
        self.stopped_at[rows[first]] = self.n_gen[rows[first]] + stop_at[first]
        done = self._emit(rows, chunk, counts, stop_at)
        if self.pads_finished:
            return done | (stop_at > 0)
        if bool((self.stopped_at > 0).all()):
            self.max_new = min(self.max_new, int(self.stopped_at.max()))
        return done | (self.n_gen[rows] >= self.max_new)

    def _pick(self, scores):
        if self.do_sample:
            return torch.multinomial(torch.softmax(scores, -1), 1).squeeze(1)
        return scores.argmax(-1)

    def _round(self):
        rows, mask, anchor = self.rows, self.mask, self.anchor
        R = rows.numel()
        anchor_pos = mask.sum(1) - 1
        # a row with a single token left commits its bonus token only: when every row is so, nothing can be
        # verified, and the round drafts nothing (nor does the policy count it)
        self._one_token_left = bool((self.max_new - self.n_gen[rows] <= 1).all())
        block, verify_len = self._propose(anchor, anchor_pos)
        drafted = block.tokens.shape[1] > 0
        L = int(verify_len.max())
        x = block.tokens[:, :L]

        inputs = torch.cat([anchor[:, None], x], 1)
        positions = anchor_pos[:, None] + torch.arange(L + 1, device=rows.device)
        mask = torch.cat([mask, mask.new_ones(R, L + 1)], 1)  # [cache, anchor, x, next anchor]: committed below
        out = self._verify_forward(inputs, mask[:, :-1], positions, block, verify_len)  # one column per key
        scores = torch.stack([self._process(rows, x[:, :j], out.logits[:, j]) for j in range(L + 1)], 1)

        if self.do_sample:
            n, nxt = verify.verify_sampling(torch.softmax(scores, -1), block.probs[:, :L], x, verify_len)
        else:
            n, nxt = verify.verify_greedy(scores, x, verify_len)

        chunk = torch.cat([x, x.new_zeros(R, 1)], 1).scatter(1, n[:, None], nxt[:, None])
        counts = n + 1
        stop_at = self._stop_index(rows, chunk, counts, scores)
        if self.pads_finished:
            counts = torch.where(stop_at > 0, stop_at, counts)
        self.policy.observe(verify_len, n, drafted=drafted)
        self._outcome(n, nxt)
        self._record(block, verify_len, n, nxt, counts)
        if isinstance(self.streamer, RoundStreamer):  # batch size 1: the record comes before the tokens
            record = self.rounds[0][-1]
            if int(stop_at[0]):  # the output ends where the criterion fired (with or without an EOS id)
                record.committed = min(record.committed, int(stop_at[0]))
            self.streamer.put_round(record)
        done = self._finish(rows, chunk, counts, stop_at)

        # keep the target's and the draft's state of [anchor, accepted drafts]; the next token is the new anchor
        commit = Commit(L + 1, keep=n + 1)
        if not commit.keeps_all:
            for layer in self.cache.layers:
                layer.keys, layer.values = commit(layer.keys, 2), commit(layer.values, 2)
        self.mask = commit(mask, 1)
        features = self.draft.target_features(out.hidden_states)
        if not drafted:  # every row keeps its one token; nothing reads the draft context before the next draft
            self.pending = torch.cat([self.pending, features], 1)
            self.pending_positions = torch.cat([self.pending_positions, positions], 1)
        else:
            new_context = self.draft.encode_context(features, positions, torch.ones_like(positions, dtype=torch.bool))
            self.context = self.context.cat(new_context).map(commit)
        self.anchor = nxt
        self._keep(~done)

    def _propose(self, anchor, anchor_pos):
        """This round's block and how much of it each row verifies: (DraftBlock, verify_len (R,))."""
        rows = self.rows
        # a policy may switch drafting off for a round when, under the current load, plain decoding is faster;
        # it decides before this round's block exists, so the choice cannot depend on it (lossless)
        if self._one_token_left or not self.policy.draft_this_round(rows.numel()):
            return empty_block(self.draft, anchor), torch.zeros_like(rows)  # the round adds the target's own token
        start = self._clock()
        self._encode_pending()
        block = self.draft_block(anchor, anchor_pos, self.context, self.do_sample,
                                 process_logits=lambda prefix, logits: self._process(rows, prefix, logits))
        self.timings["draft"] += self._clock() - start
        return block, self._verify_lengths(block)

    def _verify_lengths(self, block):
        """The policy's choice of how much of `block` each row verifies, never past the length limit."""
        rows = self.rows
        remaining = self.max_new - self.n_gen[rows]
        gamma = self.draft.config.block_size
        chosen = checked_lengths(self.policy(block.confidences, gamma, rows.numel()), gamma, rows.numel(), self.policy)
        return torch.minimum(chosen.to(rows.device), remaining - 1)

    def _verify_forward(self, inputs, mask, positions, block, verify_len):
        """The target's forward over [anchor, verified drafts] (a subclass may work during it)."""
        return self._forward(inputs, mask, positions, self.cache, 0)

    def _outcome(self, accepted, next_token):
        """Each row's verification outcome, (R,) accepted and (R,) next token, before it is committed."""

    def _encode_pending(self):
        """Turn the features kept by rounds without a draft into draft context, all in one pass."""
        if self.pending_positions.shape[1] == 0:
            return
        self.context = self.context.cat(self.draft.encode_context(
            self.pending, self.pending_positions, torch.ones_like(self.pending_positions, dtype=torch.bool)))
        self.pending, self.pending_positions = self.pending[:, :0], self.pending_positions[:, :0]

    def _record(self, block, verify_len, n, nxt, counts):
        tokens = block.tokens.tolist()
        q_x = block.probs.gather(-1, block.tokens[..., None]).squeeze(-1).tolist()
        conf = block.confidences.tolist() if block.confidences is not None else None
        for i, (r, drafted, q, v, a, t, c) in enumerate(zip(
                self.rows.tolist(), tokens, q_x, verify_len.tolist(), n.tolist(), nxt.tolist(), counts.tolist())):
            self.rounds[r].append(DSparkRound(drafted, q, conf[i] if conf else None, v, a, t, c,
                                              one_token_left=self._one_token_left))

    def _keep(self, alive: torch.Tensor):
        """Drop finished rows from every buffer, then drop padding columns no row needs any more."""
        if not bool(alive.all()):
            idx = alive.nonzero().squeeze(1)
            self.rows, self.mask, self.anchor = self.rows[idx], self.mask[idx], self.anchor[idx]
            self.cache.batch_select_indices(idx)
            self.context = self.context.map(lambda t, dim: t[idx])
            self.pending, self.pending_positions = self.pending[idx], self.pending_positions[idx]
        if self.rows.numel() == 0:
            return
        drop = leading_padding(self.mask)
        if drop:
            self.mask = self.mask[:, drop:]
            for layer in self.cache.layers:
                layer.keys, layer.values = layer.keys[:, :, drop:], layer.values[:, :, drop:]
            self.context = self.context.map(lambda t, dim: t.narrow(dim, drop, t.shape[dim] - drop))


class _SSDDecoder(SSDMixin, _Decoder):
    """The DSpark decoder whose blocks come from a speculation cache built during verification ([`SSDMixin`])."""

    def __init__(self, *args, ssd: SSDConfig):
        super().__init__(*args)
        self.setup_ssd(ssd)

    def run(self):
        try:
            out = super().run()
        finally:
            self.close_ssd()
        if isinstance(out, DSparkGenerateOutput):
            out.ssd_stats = self.ssd_stats
        return out

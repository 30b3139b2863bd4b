"""The playground page and the report card in a real browser: headless Chromium via Playwright.

Skips (saying why) without Playwright or a Chromium binary; CI never skips it (.ci/run installs
Debian's chromium when it is missing). To run it on Debian/Ubuntu: ``apt-get install -y
chromium`` and ``pip install playwright`` (no ``playwright install`` needed: the system
Chromium is used). GPT2LAB_CHROMIUM may point at another binary.
"""

from __future__ import annotations

import os
import shutil

import httpx
import pytest
from conftest import running_server, wait_until_idle

CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--no-first-run",
    "--disable-sync",
]


def _chromium() -> str | None:
    path = os.environ.get("GPT2LAB_CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")
    return path if path and os.path.exists(path) else None


@pytest.fixture(scope="module")
def browser():
    sync_api = pytest.importorskip(
        "playwright.sync_api", reason="browser tests need playwright: pip install playwright"
    )
    path = _chromium()
    if path is None:
        pytest.skip("browser tests need Chromium: apt-get install -y chromium (or set GPT2LAB_CHROMIUM)")
    with sync_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=path, args=CHROMIUM_ARGS)
        yield b
        b.close()


def test_playground_streams_each_models_text_into_its_column(browser, gpt2_vocab_export):
    _, d = gpt2_vocab_export
    with running_server([f"tiny={d}", f"twin={d}"]) as url:
        page = browser.new_page()
        page.goto(url + "/")
        page.wait_for_function("document.querySelectorAll('.col').length === 2")
        settings = {
            "prompt": "The playground says",
            "max_tokens": "24",
            "temperature": "0.8",
            "top_k": "50",
            "top_p": "1",
            "seed": "5",
        }
        for field, value in settings.items():
            page.fill(f"#{field}", value)
        # count DOM updates of each output: streamed text arrives in several steps, not at once (how
        # many depends on how the network stack groups the server's events, so only "more than one")
        page.evaluate("""() => { window.updates = {};
            for (const col of document.querySelectorAll('.col')) {
              window.updates[col.dataset.model] = 0;
              new MutationObserver(() => window.updates[col.dataset.model]++).observe(
                col.querySelector('.out'), {subtree: true, childList: true, characterData: true});
            } }""")
        page.click("#go")
        page.wait_for_function(
            "[...document.querySelectorAll('.meta')].every(m => m.textContent.includes('tokens in'))", timeout=60_000
        )
        body = {"prompt": settings["prompt"], "max_tokens": 24, "temperature": 0.8, "top_k": 50, "top_p": 1, "seed": 5}
        for model in ("tiny", "twin"):
            col = page.locator(f".col[data-model='{model}']")
            expected = httpx.post(url + "/v1/completions", json={"model": model, **body}, timeout=60).json()
            assert col.locator(".completion").inner_text() == expected["choices"][0]["text"]
            assert col.locator(".prompt").inner_text() == settings["prompt"]
            assert "24 tokens in" in col.locator(".meta").inner_text()
        updates = page.evaluate("window.updates")
        assert min(updates.values()) >= 2, updates
        page.close()


def test_playground_chat_mode_streams_each_reply_as_a_turn(browser, gpt2_vocab_export):
    """Chat mode: the message and the streamed reply show as turns, the reply is what
    /v1/chat/completions answers with the same settings, and the next message carries the
    conversation so far."""
    _, d = gpt2_vocab_export
    with running_server([f"tiny={d}"]) as url:
        page = browser.new_page()
        page.goto(url + "/")
        page.wait_for_function("document.querySelectorAll('.col').length === 1")
        assert not page.is_visible("#system")
        page.check("#chat_mode")
        assert page.inner_text("#go") == "Send" and page.is_visible("#system")
        settings = {
            "system": "You answer briefly.",
            "max_tokens": "10",
            "temperature": "0.8",
            "top_k": "50",
            "top_p": "1",
            "seed": "9",
        }
        for field, value in settings.items():
            page.fill(f"#{field}", value)
        body = {"model": "tiny", "max_tokens": 10, "temperature": 0.8, "top_k": 50, "top_p": 1, "seed": 9}
        messages = [{"role": "system", "content": settings["system"]}]
        for n, message in enumerate(["Hello there!", "And then?"], start=1):
            page.fill("#prompt", message)
            page.click("#go")
            page.wait_for_function(
                f"document.querySelectorAll('.turn').length === {2 * n} && "
                "document.querySelector('.meta').textContent.includes('tokens in')",
                timeout=60_000,
            )
            assert page.input_value("#prompt") == ""  # sent
            messages.append({"role": "user", "content": message})
            expected = httpx.post(url + "/v1/chat/completions", json={**body, "messages": messages}, timeout=60).json()
            reply = expected["choices"][0]["message"]["content"]
            turns = page.eval_on_selector_all(
                ".turn", "ts => ts.map(t => [t.classList[1], t.querySelector('.content').textContent])"
            )
            assert turns[-2:] == [["user", message], ["assistant", reply]]
            assert f"{expected['usage']['completion_tokens']} tokens in" in page.inner_text(".meta")
            messages.append({"role": "assistant", "content": reply})
        page.close()


def test_playground_shows_a_refused_request_then_streams(browser, tmp_path):
    """A full queue (one row, one waiting request) answers the page's request with 429: the
    column shows the error; once the queue drains, the same button streams a completion."""
    from conftest import tiny_gpt

    from gpt2lab.serve.limits import Limits
    from gpt2lab.weights import export

    d = str(tmp_path / "model")
    export.save_pretrained(tiny_gpt(seed=2, vocab_size=50257, block_size=1024), d)
    with running_server([f"solo={d}"], Limits(max_batch=1, max_queue=1)) as url:
        page = browser.new_page()
        page.goto(url + "/")
        page.wait_for_function("document.querySelectorAll('.col').length === 1")
        page.fill("#max_tokens", "12")
        meta = page.locator(".col .meta")
        # 16 samples of 1000 tokens: the first holds the row however slowly the page answers (one
        # sample alone can end within a second or two, and then the waiting one takes the row)
        long = {"model": "solo", "prompt": "x", "max_tokens": 1000, "n": 16, "stream": True}
        with httpx.Client(timeout=60) as c:
            with c.stream("POST", url + "/v1/completions", json=long) as running:
                lines = running.iter_lines()  # kept: a dropped iterator closes the connection
                next(lines)  # generating: it holds the one row
                with c.stream("POST", url + "/v1/completions", json=long) as waiting:
                    assert waiting.status_code == 200  # accepted: it holds the one queue place
                    page.click("#go")
                    page.wait_for_function(
                        "document.querySelector('.meta').classList.contains('error')", timeout=60_000
                    )
                    assert meta.inner_text().startswith("error 429:") and "--max-queue 1" in meta.inner_text()
        # both clients hung up: once the server has seen it (asynchronously: their connections close
        # beside the page's), the queue place and the row are free, and the page's next request streams
        wait_until_idle(url, "solo")
        page.wait_for_function("!document.querySelector('#go').disabled")
        page.click("#go")
        page.wait_for_function("document.querySelector('.meta').textContent.includes('tokens in')", timeout=60_000)
        assert "12 tokens in" in meta.inner_text() and "error" not in (meta.get_attribute("class") or "")
        expected = httpx.post(
            url + "/v1/completions",
            timeout=60,
            json={
                "model": "solo",
                "prompt": page.input_value("#prompt"),
                "max_tokens": 12,
                "temperature": 1.0,
                "top_k": 50,
                "top_p": 1.0,
                "seed": 42,
            },
        ).json()
        assert page.locator(".col .completion").inner_text() == expected["choices"][0]["text"]
        page.close()


def test_playground_opens_in_chat_mode_when_every_model_is_a_chat_model(browser, gpt2_vocab_export, tmp_path):
    """Served chat models only, the page opens in chat mode (/v1/models gives each one's chat_template);
    with a base model beside them, in completion mode, as before."""
    from conftest import tiny_gpt

    from gpt2lab.weights import export

    _, base = gpt2_vocab_export
    chat = str(tmp_path / "chat")
    export.save_pretrained(tiny_gpt(vocab_size=50304, token_vocab_size=50259, chat_template="chatml"), chat)
    for models, chat_mode in (([f"chat={chat}", f"twin={chat}"], True), ([f"chat={chat}", f"base={base}"], False)):
        with running_server(models) as url:
            page = browser.new_page()
            page.goto(url + "/")
            page.wait_for_function("document.querySelectorAll('.col').length === 2")
            assert page.is_checked("#chat_mode") == chat_mode
            assert page.inner_text("#go") == ("Send" if chat_mode else "Generate")
            assert page.is_visible("#system") == chat_mode
            page.close()


def test_report_card_opens_with_its_plot(browser, finished_run, tmp_path):
    pytest.importorskip("matplotlib")
    from gpt2lab.observe.report import write_report

    out_html, _, rep = write_report(str(finished_run), str(tmp_path / "report.html"))
    page = browser.new_page()
    page.route(
        "**/*",
        lambda route: route.abort() if not route.request.url.startswith(("file:", "data:")) else route.continue_(),
    )  # self-contained: any other fetch fails the checks below
    page.goto(f"file://{out_html}")
    assert page.inner_text("#status") == rep.status and rep.status.startswith("finished")
    size = page.evaluate("() => { const i = document.querySelector('img'); return [i.complete, i.naturalWidth]; }")
    assert size[0] and size[1] > 600  # the embedded PNG decoded (the figure is 14 in wide)
    headers = page.eval_on_selector_all("h2", "els => els.map(e => e.textContent)")
    assert [s.title for s in rep.sections] == headers
    assert page.locator("table").count() >= 6
    page.close()

"""evals/download.py, the one download+cache of the evals' data sets, through GSM8K's test split
against a real HTTP server on localhost: fetched once and then read from the cache, a download cut
short or not GSM8K never left in the cache, offline and unreachable as one line naming the URL and
--data FILE; and `gpt2lab eval gsm8k` without --data on what it downloaded."""

from __future__ import annotations

import http.server
import json
import os
import socket
import threading

import pytest
from conftest import DATA, tiny_gpt

from gpt2lab.cli import main
from gpt2lab.evals import chat as chat_eval
from gpt2lab.evals import download

GSM8K = DATA / "gsm8k_slice.jsonl"  # 40 rows of GSM8K's own file, in its format


class _Handler(http.server.BaseHTTPRequestHandler):
    routes: dict = {}  # path -> (status, body, Content-Length announced)
    hits: list = []

    def do_GET(self):  # noqa: N802 (http.server's name)
        self.hits.append(self.path)
        status, body, length = self.routes.get(self.path, (404, b"not found", None))
        self.send_response(status)
        self.send_header("Content-Length", str(len(body) if length is None else length))
        self.end_headers()
        self.wfile.write(body)
        self.close_connection = True  # a body shorter than announced ends here

    def log_message(self, *args):
        pass


@pytest.fixture
def server(tmp_path, monkeypatch):
    """A real HTTP server in a thread; an empty gpt2lab cache; the hub's copy a failure unless a test
    says otherwise; no offline switch set."""
    _Handler.routes, _Handler.hits = {}, []
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    monkeypatch.setenv("GPT2LAB_CACHE", str(tmp_path / "cache"))
    for var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"):
        monkeypatch.delenv(var, raising=False)

    def no_hub(ds, out):
        raise ConnectionError("the hub is not reachable from the tests")

    monkeypatch.setattr(download, "from_hub", no_hub)
    monkeypatch.setenv("GPT2LAB_PROBE", "0")  # eval's kernels by the device's rule: no timing
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()


def _serve(monkeypatch, base: str, path: str, body: bytes, length=None) -> str:
    _Handler.routes[path] = (200, body, length)
    monkeypatch.setattr(chat_eval, "GSM8K_URL", base + path)
    return base + path


def _cache_files(tmp_path) -> list[str]:
    return sorted(str(p.relative_to(tmp_path / "cache")) for p in (tmp_path / "cache").rglob("*") if p.is_file())


def test_downloaded_once_then_read_from_the_cache(server, tmp_path, monkeypatch):
    _serve(monkeypatch, server, "/grade_school_math/data/test.jsonl", GSM8K.read_bytes())
    path = chat_eval.gsm8k_test_file()
    assert path == str(tmp_path / "cache" / "gsm8k" / "test.jsonl")
    assert open(path, "rb").read() == GSM8K.read_bytes() and _Handler.hits == ["/grade_school_math/data/test.jsonl"]
    assert chat_eval.gsm8k_test_file() == path and len(_Handler.hits) == 1  # a cache hit: no request
    assert _cache_files(tmp_path) == ["gsm8k/test.jsonl"]  # no temporary beside it
    problems = chat_eval.read_conversations(path, gsm8k=True)
    rows = [json.loads(line) for line in GSM8K.read_text().splitlines()]
    assert problems == [[("user", r["question"]), ("assistant", r["answer"])] for r in rows]


def test_a_download_cut_short_is_not_cached(server, tmp_path, monkeypatch):
    body = GSM8K.read_bytes()
    cut = body[: body.index(b"\n", len(body) // 2) + 1]  # whole lines: only the length tells it is cut
    url = _serve(monkeypatch, server, "/test.jsonl", cut, length=len(body))
    with pytest.raises(RuntimeError) as e:
        chat_eval.gsm8k_test_file()
    msg = str(e.value)
    assert "\n" not in msg and url in msg and "pass --data FILE" in msg
    assert f"the download ended after {len(cut):,} of {len(body):,} bytes" in msg
    assert _cache_files(tmp_path) == [] and len(_Handler.hits) == 1  # nothing kept; no second source tried


def test_a_file_that_is_not_gsm8k_is_not_cached(server, tmp_path, monkeypatch):
    bad = GSM8K.read_bytes() + b'{"question": "2+2?", "answer": "four"}\n'  # line 41 has no '#### N'
    url = _serve(monkeypatch, server, "/test.jsonl", bad)
    with pytest.raises(RuntimeError) as e:
        chat_eval.gsm8k_test_file()
    msg = str(e.value)
    assert "not GSM8K's test split: the download, line 41: answer: GSM8K's answer must end with '#### <number>'" in msg
    assert "openai/gsm8k: ConnectionError" in msg and url in msg  # then the hub's copy was tried
    assert _cache_files(tmp_path) == []


def test_a_missing_file_takes_the_hubs_copy(server, tmp_path, monkeypatch):
    monkeypatch.setattr(chat_eval, "GSM8K_URL", server + "/gone.jsonl")  # 404
    monkeypatch.setattr(download, "from_hub", lambda ds, out: out.write(GSM8K.read_bytes()))
    path = chat_eval.gsm8k_test_file()
    assert open(path, "rb").read() == GSM8K.read_bytes() and _Handler.hits == ["/gone.jsonl"]


def test_offline_and_unreachable_are_one_line_naming_the_url_and_the_flag(server, tmp_path, monkeypatch):
    url = _serve(monkeypatch, server, "/test.jsonl", GSM8K.read_bytes())
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(RuntimeError) as e:
        chat_eval.gsm8k_test_file()
    assert str(e.value) == (
        f"GSM8K's test split is not in the cache and could not be downloaded from {url} (HF_HUB_OFFLINE set); "
        'pass --data FILE (JSON lines of GSM8K\'s {"question", "answer"} rows), or download that file to '
        f"{tmp_path / 'cache' / 'gsm8k' / 'test.jsonl'}"
    )
    assert _Handler.hits == []  # offline: nothing tried
    monkeypatch.delenv("HF_HUB_OFFLINE")
    with socket.socket() as s:  # a port nobody listens on: the connection is refused at once
        s.bind(("127.0.0.1", 0))
        closed = f"http://127.0.0.1:{s.getsockname()[1]}/test.jsonl"
    monkeypatch.setattr(chat_eval, "GSM8K_URL", closed)
    with pytest.raises(RuntimeError, match="Connection refused") as e:
        chat_eval.gsm8k_test_file()
    assert closed in str(e.value) and "pass --data FILE" in str(e.value) and _cache_files(tmp_path) == []


def test_eval_gsm8k_without_data_scores_the_downloaded_split(server, tmp_path, monkeypatch, capsys):
    import gpt2lab

    _serve(monkeypatch, server, "/test.jsonl", GSM8K.read_bytes())
    model = str(tmp_path / "model")  # a base model whose padded vocabulary has rows for the turn tokens
    gpt2lab.save_pretrained(tiny_gpt(seed=1, vocab_size=50304, block_size=256), model)
    argv = ["eval", "gsm8k", "--model", model, "--limit", "2", "--max-tokens", "2", "--device", "cpu"]
    samples = tmp_path / "replies.jsonl"
    for _ in range(2):  # the second run replaces the file the first wrote (its first line marks it gpt2lab's)
        assert main([*argv, "--dtype", "float32", "--samples", str(samples)]) == 0
        result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
        head, *rows = [json.loads(line) for line in samples.read_text().splitlines()]
        assert head == {"format": "gpt2lab-gsm8k-samples", **result} and len(rows) == result["n"] == 2
    assert result["data"] == str(tmp_path / "cache" / "gsm8k" / "test.jsonl")
    assert len(_Handler.hits) == 1
    monkeypatch.setenv("GPT2LAB_CACHE", str(tmp_path / "empty"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    from gpt2lab.weights import load

    monkeypatch.setattr(load, "load_model", lambda *a, **k: pytest.fail("the model was loaded"))
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert str(e.value.code).startswith("gpt2lab eval gsm8k: GSM8K's test split is not in the cache")
    assert not os.path.exists(tmp_path / "empty")  # offline: not even the cache directory is made


def test_eval_gsm8k_refuses_in_one_line_a_model_without_turn_token_rows(gpt2_vocab_export, monkeypatch):
    monkeypatch.setenv("GPT2LAB_PROBE", "0")
    _, model = gpt2_vocab_export  # GPT-2's own 50257 rows: <|im_start|> is 50257
    argv = ["eval", "gsm8k", "--model", model, "--data", str(GSM8K), "--limit", "1", "--device", "cpu"]
    with pytest.raises(SystemExit) as e:
        main([*argv, "--max-tokens", "2", "--dtype", "float32"])
    assert str(e.value.code) == (
        f"gpt2lab eval gsm8k: --model {model}: the model's 50257 embedding rows hold no chat turn tokens "
        "(<|im_end|> is id 50258); evaluate a chat model, or a base model gpt2lab trained (its vocabulary "
        "is padded past them)"
    )

"""The batching worker (serve/batch.py): 8 requests in one batch draw the tokens `gpt2lab sample`'s code
draws for each alone; a row's logits in the batch equal the one-row model's, as rows join and leave,
with GPT-2's block and the modern one, plain and packed linears; a sampling error ends its request
with a 500 instead of leaving it to time out."""

from __future__ import annotations

import threading

import pytest
import torch
from conftest import openai_client, post_completion, running_server, tiny_gpt

from gpt2lab.weights import export

openai = pytest.importorskip("openai", reason="the serve tests use the official openai client (test extra)")
httpx = pytest.importorskip("httpx")


@pytest.fixture(scope="module")
def confident_server(tmp_path_factory):
    """A tiny real-vocabulary model whose next-token distributions are peaked, served; (url, model).

    A draw is one uniform number placed in the cumulative distribution; a batch's matmuls round
    differently from one row's (~1e-7), which moves every boundary of that distribution a little.
    Over 50,257 near-equal tokens (a random model's logits are all ~0) the boundaries lie ~2e-5
    apart, so now and then a draw sits within rounding of one and the batch picks the neighbour.
    With the embedding (tied to the head) 60 times larger, a few tokens hold the mass and a draw's
    distance to the nearest boundary is 1e-4 or more for these cases: only a real difference between
    the batch and one row can change a token."""
    model = tiny_gpt(seed=3, vocab_size=50257, block_size=128)
    with torch.no_grad():
        model.transformer.wte.weight.mul_(60.0)
    d = str(tmp_path_factory.mktemp("confident") / "model")
    export.save_pretrained(model, d)
    with running_server([f"tiny={d}"]) as url:
        yield url, model


def test_batched_requests_draw_the_tokens_sample_draws(confident_server):
    """8 prompts x seeds in flight together (one batch) give the text that
    completion.stream_tokens (gpt2lab sample's code) gives each alone."""
    from gpt2lab.inference.completion import Sampling, prompt_ids, seeded_generator

    url, model = confident_server
    cases = [(f"Prompt {i}: " + "word " * (3 * i), 10 + i, [0.7, 1.0, 1.3][i % 3], [0, 40][i % 2]) for i in range(8)]
    expected = []
    for prompt, seed, temperature, top_k in cases:
        s = Sampling(max_new_tokens=20, temperature=temperature, top_k=top_k)
        expected.append(_alone(model, prompt_ids(prompt, model), s, seeded_generator(torch.device("cpu"), seed)))
    got: dict[int, str] = {}
    barrier = threading.Barrier(len(cases))

    def run(i: int) -> None:
        prompt, seed, temperature, top_k = cases[i]
        barrier.wait()
        r = openai_client(url).completions.create(
            model="tiny", prompt=prompt, max_tokens=20, seed=seed, temperature=temperature, extra_body={"top_k": top_k}
        )
        got[i] = r.choices[0].text

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(cases))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert [got.get(i) for i in range(len(cases))] == expected
    assert len(set(expected)) == len(cases)


MODERN = dict(pos_emb="rotary", norm="rmsnorm", qk_norm=True, mlp_act="relu2", tie_embeddings=False, logit_softcap=15.0)


def _one_step_as_alone(model, reference, cache, seqs: list[list[int]], g: torch.Generator) -> None:
    """One new random token a row through ``cache`` (a RowsCache holding ``seqs``), each row's logits against
    ``reference``'s one-row forward of the row's whole sequence without a cache; ``seqs`` grow by the token."""
    new = torch.randint(0, 97, (len(seqs), 1), generator=g)
    batched, _ = model(new, kv_cache=cache.view(torch.device("cpu")), last_only=True)
    for i, seq in enumerate(seqs):
        seq.append(int(new[i]))
        alone, _ = reference(torch.tensor([seq]), last_only=True)
        torch.testing.assert_close(batched[i, -1], alone[0, -1], rtol=1e-5, atol=1e-5)


def _alone(model, ids: list[int], sampling, generator) -> str:
    """The text of the tokens completion.stream_tokens (gpt2lab sample's code) draws for ``ids`` alone, up to
    the end token, decoded whole by the tokenizer."""
    from gpt2lab.data.tokenizer import for_model
    from gpt2lab.inference.completion import end_token, stream_tokens

    tokens = [t for t, _ in stream_tokens(model, ids, sampling, generator)]
    return for_model(model).decode(tokens[:-1] if tokens and tokens[-1] == end_token(model) else tokens)


class _Loop:
    """An event loop's thread-safe call, recorded (``calls``) to run later, or run at once (``now``)."""

    def __init__(self, now: bool = False) -> None:
        self.now, self.calls = now, []

    def call_soon_threadsafe(self, fn, *args):
        if self.now:
            fn(*args)
        else:
            self.calls.append((fn, args))


@pytest.mark.parametrize("block", [{}, MODERN], ids=["gpt2", "modern"])
def test_prompts_run_together_right_padded_give_each_row_its_own_logits(block):
    """Three prompts of 3, 9 and 16 tokens in one forward, right-padded to 16: the logits at each row's
    own last position, and every decode step after the rows join the batch from that cache, equal the
    one-row forward of the row's whole sequence without a cache."""
    import copy

    from gpt2lab.serve.rows import RowsCache

    model = tiny_gpt(seed=6, vocab_size=97, block_size=48, **block)
    reference = copy.deepcopy(model)
    g = torch.Generator().manual_seed(1)
    seqs = [torch.randint(0, 97, (n,), generator=g).tolist() for n in (3, 9, 16)]
    T = max(map(len, seqs))
    with torch.inference_mode():
        together = model.new_kv_cache(T)
        idx = torch.tensor([s + [5] * (T - len(s)) for s in seqs])
        last = torch.tensor([b * T + len(s) - 1 for b, s in enumerate(seqs)])
        first, _ = model(idx, kv_cache=together, positions=last)
        cache = RowsCache(model.config.n_layer, model.config.block_size)
        for b, seq in enumerate(seqs):
            alone, _ = reference(torch.tensor([seq]), last_only=True)
            torch.testing.assert_close(first[b], alone[0, -1], rtol=1e-5, atol=1e-5)
            cache.put(b, together, 4, b, len(seq))
        assert cache.lengths == [3, 9, 16]
        for _ in range(4):
            _one_step_as_alone(model, reference, cache, seqs, g)


def _submit_as_sample(worker, model, prompt: str, seed: int, temperature: float, tokens: int, n: int):
    """Submit a seeded request of ``n`` samples (top-k 40) to ``worker``; (its job, the texts
    completion.stream_tokens (gpt2lab sample's code) gives each sample alone on ``model``)."""
    from gpt2lab.inference.completion import Sampling, prompt_ids, seeded_generator
    from gpt2lab.serve import jobs

    s = Sampling(max_new_tokens=tokens, temperature=temperature, top_k=40)
    ids = prompt_ids(prompt, model)
    gen = seeded_generator(torch.device("cpu"), seed)
    expected = [_alone(model, ids, s, gen) for _ in range(n)]
    job = jobs.Job([ids], s, n=n, seeds=[seed])
    worker.submit(job, _Loop(now=True))
    return job, expected


def _finish_and_check_texts(worker, steps, jobs, expected) -> None:
    """Step ``worker`` (its ``steps``) until every job has ended; each ended without a failure and its
    samples' texts are ``expected``'s."""
    from gpt2lab.serve.jobs import Text

    with torch.inference_mode():
        for _ in range(200):
            busy = next(steps)
            worker.deliver()  # as the engine does when a step ends
            if not busy and all(job not in worker._open for job in jobs):
                break
    for job, want in zip(jobs, expected):
        events = [job.out.get_nowait() for _ in range(job.out.qsize())]
        assert events[-1] is None and not any(isinstance(e, BaseException) for e in events)
        got = ["".join(e.text for e in events if isinstance(e, Text) and e.index == i) for i in range(len(want))]
        assert got == want


def test_a_burst_of_prompts_is_prefilled_in_one_forward_and_each_gets_the_text_it_gets_alone(
    confident_server, monkeypatch
):
    """Five requests arriving before a step (prompts of 2 to 30 tokens, seeded, one of them two samples,
    one greedy, one stopping after its first token): their prompts run in one padded forward (a
    sixth, too long for the chunk with them, alone), and each gets the text completion.stream_tokens
    (gpt2lab sample's code) gives it alone."""
    from gpt2lab.serve import batch
    from gpt2lab.serve.limits import Limits

    _, model = confident_server

    worker = batch.Worker("tiny", model, torch.device("cpu"), Limits(prefill_chunk=160))
    groups = []
    prefill = batch.Worker._prefill
    monkeypatch.setattr(batch.Worker, "_prefill", lambda w, rows: groups.append(len(rows)) or prefill(w, rows))
    cases = [("A " * 1, 1, 0.8, 12, 1), ("B b " * 7, 2, 0.0, 12, 1), ("C " * 29, 3, 1.0, 12, 2), ("D d", 4, 1.2, 1, 1),
             ("E " * 12, 5, 0.7, 12, 1), ("F " * 100, 6, 1.0, 6, 1)]  # fmt: skip
    jobs, expected = zip(*(_submit_as_sample(worker, model, *case) for case in cases))
    _finish_and_check_texts(worker, worker._steps(), jobs, expected)
    assert groups[0] == 5 and set(groups[1:]) == {
        1
    }  # the five that fit one chunk (30 x 5 = 150 <= 160); the sixth alone


def test_prompts_join_the_fused_step_of_running_rows_each_getting_its_text_alone(confident_server, monkeypatch):
    """With the fused step (a model held with the compiled kernel), a running request and then a burst of
    five (prompts of 1 to 30 tokens, seeded, one of them two samples, one greedy, one ending after its
    first token): every prompt joins a decode step as rows of its own slot (the mixed step), none runs a
    prefill of its own, the burst's first four in one step beside the running row (their 24 tokens fit the
    chunk of 40, the fifth's 30 do not), and each request gets the text completion.stream_tokens (gpt2lab
    sample's code) gives it alone on the same held model. In every step, each row's logits are those of its
    whole sequence run alone (its prompt's keys and values in its own slot)."""
    from gpt2lab.inference.choice import Candidate
    from gpt2lab.inference.form import hold
    from gpt2lab.inference.kernels import gemv_error
    from gpt2lab.serve import batch
    from gpt2lab.serve.limits import Limits

    if gemv_error(torch.device("cpu")) is not None:
        pytest.skip(str(gemv_error(torch.device("cpu"))))
    _, plain = confident_server
    model = hold(plain, Candidate("bfloat16", "gemv"), rows=8)
    assert model.fused
    worker = batch.Worker("tiny", model, torch.device("cpu"), Limits(prefill_chunk=40))
    mixed, alone = [], []
    step = batch.Worker._decode
    monkeypatch.setattr(
        batch.Worker,
        "_decode",
        lambda w, rows: (rows and mixed.append((len(w.decoding), len(rows)))) or step(w, rows),
    )
    monkeypatch.setattr(batch.Worker, "_prefill", lambda w, rows: alone.append(rows))
    drawn, checked = {}, []  # (row, sample) -> its tokens so far; each step's rows against their sequences

    def draw(w, rows, logits, draw=batch.Worker._draw):
        for i, row in enumerate(rows):
            seq = row.ids + drawn.get((id(row), row.sample), [])
            alone, _ = w.model(torch.tensor([seq]))
            torch.testing.assert_close(logits[i], alone[0, -1], rtol=1e-4, atol=1e-4)
            checked.append(len(seq))
        return draw(w, rows, logits)

    def sampled(w, row, t, lp=None, sampled=batch.Worker._sampled):
        drawn.setdefault((id(row), row.sample), []).append(t)
        return sampled(w, row, t, lp)

    monkeypatch.setattr(batch.Worker, "_draw", draw)
    monkeypatch.setattr(batch.Worker, "_sampled", sampled)
    cases = [("R r " * 3, 9, 0.9, 16, 1), ("A", 1, 0.8, 12, 1), ("B b " * 4, 2, 0.0, 12, 1), ("C " * 12, 3, 1.0, 12, 2),
             ("D d", 4, 1.2, 1, 1), ("E " * 30, 5, 0.7, 12, 1)]  # fmt: skip
    jobs, expected = [], []
    steps = worker._steps()
    with torch.inference_mode():
        for i, case in enumerate(cases):
            job, want = _submit_as_sample(worker, model, *case)
            jobs.append(job)
            expected.append(want)
            if i == 0:  # the running request's prompt, then two of its tokens, before the burst
                for _ in range(3):
                    next(steps)
    _finish_and_check_texts(worker, steps, jobs, expected)
    assert alone == [] and len(checked) > 50  # rows checked, step by step
    assert mixed[:3] == [(0, 1), (1, 4), (4, 1)]  # the running row; the burst's four beside it; the fifth


def test_a_row_major_bf16_hold_mixes_only_the_prompts_its_tiles_run(confident_server, monkeypatch):
    """Held row-major (bf16 weights, fp32 inputs: a CPU without native bf16), the fused step multiplies a
    prompt by its tiles, which the probe measured faster than the forward's matmul only up to tile_rows (4
    here): a 2-token prompt joins the decode step, an 11-token one runs through the model's forward."""
    from gpt2lab.inference.choice import Candidate
    from gpt2lab.inference.completion import Sampling, prompt_ids
    from gpt2lab.inference.form import hold
    from gpt2lab.inference.kernels import gemv_error, set_tile_rows
    from gpt2lab.serve import batch, jobs
    from gpt2lab.serve.limits import Limits

    if gemv_error(torch.device("cpu")) is not None:
        pytest.skip(str(gemv_error(torch.device("cpu"))))
    _, plain = confident_server
    model = hold(plain, Candidate("bfloat16", "gemv"), rows=8, bf16_inputs=False)
    set_tile_rows(model, 4)
    worker = batch.Worker("tiny", model, torch.device("cpu"), Limits(prefill_chunk=40))
    ran = []  # (the way, its prompts' lengths)

    def recorded(name):
        way = getattr(batch.Worker, name)

        def run(w, rows):
            ran.append((name, [len(r.ids) for r in rows]))
            return way(w, rows)

        return run

    for name in ("_decode", "_prefill"):
        monkeypatch.setattr(batch.Worker, name, recorded(name))
    steps = worker._steps()
    with torch.inference_mode():
        for prompt in ("A b", "C " * 10):
            ids = prompt_ids(prompt, model)
            worker.submit(jobs.Job([ids], Sampling(max_new_tokens=2), seeds=[1]), _Loop(now=True))
            next(steps)
    assert ran == [("_decode", [2]), ("_prefill", [11]), ("_decode", [])]  # the first prompt's row, then its token


@pytest.mark.parametrize("linear", ["plain", "packed"])
@pytest.mark.parametrize("block", [{}, MODERN], ids=["gpt2", "modern"])
def test_batched_rows_give_the_unbatched_models_logits(block, linear):
    """RowsCache: rows of different lengths joining and leaving; every row's logits equal the
    one-row forward of its whole sequence without a cache (with rotary, each row is turned by
    its own positions), also with the server's packed linears against the plain model."""
    import copy

    from gpt2lab.inference.choice import Candidate
    from gpt2lab.inference.form import hold as apply
    from gpt2lab.inference.kernels import cannot_run
    from gpt2lab.serve.rows import RowsCache

    model = tiny_gpt(seed=5, vocab_size=97, block_size=48, **block)
    reference = copy.deepcopy(model)
    if linear == "packed":
        if cannot_run("packed"):
            pytest.skip("this torch build has no oneDNN packed linear")
        model = apply(model, Candidate("float32", "packed"), rows=4)
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(0, 97, (n,), generator=g).tolist() for n in (3, 9, 16)]
    cache = RowsCache(model.config.n_layer, model.config.block_size)

    def join(seq: list[int]) -> None:
        one = model.new_kv_cache(40)
        model(torch.tensor([seq]), kv_cache=one)
        cache.put(len(cache.lengths), one, 4, 0, len(seq))

    with torch.inference_mode():
        for seq in seqs:
            join(seq)
        for step in range(8):
            if step == 3:  # the first row leaves (the last moves into its slot) and a new one joins
                cache.remove(0)
                seqs[0] = seqs.pop()
                seqs.append(torch.randint(0, 97, (5,), generator=g).tolist())
                join(seqs[-1])
            _one_step_as_alone(model, reference, cache, seqs, g)
            assert cache.lengths == [len(s) for s in seqs]
        cache.remove(1), cache.remove(1), cache.remove(0)
    assert cache.k[0] is None  # idle: the buffers are given back


def test_batched_worker_fails_a_request_whose_first_sample_raises(gpt2_vocab_export, monkeypatch):
    """A sampling error at the end of a prompt's prefill is answered (500), not left to time out."""
    from gpt2lab.serve import batch
    from gpt2lab.serve.limits import Limits

    def broken(*a, **k):
        raise RuntimeError("sampling broke")

    monkeypatch.setattr(batch, "sample_next", broken)
    _, d = gpt2_vocab_export
    with running_server([f"tiny={d}"], limits=Limits(timeout_s=20)) as url:
        r = post_completion(url, {"model": "tiny", "prompt": "x", "max_tokens": 2})
    assert r.status_code == 500 and "sampling broke" in r.json()["error"]["message"]


def test_shutting_down_after_a_step_cut_short_delivers_its_events_then_the_errors():
    """A Ctrl-C raised in the engine's thread after a step's events were sent but before its delivery:
    shut_down hands the step's events over first, then ends each open job with the error, at once (the
    error was held for a delivery that never came, and uvicorn closed the connections unanswered)."""
    from gpt2lab.inference.completion import Sampling
    from gpt2lab.serve.batch import Worker
    from gpt2lab.serve.jobs import Job, ShuttingDown

    loop, error = _Loop(), ShuttingDown("server shutting down")
    worker = Worker("tiny", tiny_gpt(seed=1), torch.device("cpu"))
    job = Job([[1]], Sampling())
    job.worker, job.loop = worker, loop
    worker._open.add(job)
    job.send("token")  # the step's event, never delivered
    assert worker.shut_down(error) == 1 and not worker.outbox
    for fn, args in loop.calls:
        fn(*args)
    got = [job.out.get_nowait() for _ in range(job.out.qsize())]
    assert got == ["token", error, None]


def test_a_steps_events_reach_each_loop_in_one_call_in_the_order_sent():
    """Events wait in their worker's outbox until ``deliver`` (the end of the engine's step), which hands each
    loop the step's events in one call, every job's in the order sent."""
    from gpt2lab.inference.completion import Sampling
    from gpt2lab.serve.batch import Worker
    from gpt2lab.serve.jobs import Job

    a, b = _Loop(), _Loop()
    worker = Worker("tiny", tiny_gpt(seed=1), torch.device("cpu"))
    one, two, three = (Job([[1]], Sampling()) for _ in range(3))
    one.loop, two.loop, three.loop = a, b, a
    for job, event in [(one, "x1"), (two, "y1"), (three, "z1"), (one, "x2"), (two, "y2"), (one, None)]:
        job.worker = worker
        job.send(event)
    assert a.calls == [] and b.calls == []
    worker.deliver()
    assert len(a.calls) == 1 and len(b.calls) == 1 and not worker.outbox
    worker.deliver()  # nothing more sent: no call
    assert len(a.calls) == 1 and len(b.calls) == 1
    for loop in (a, b):
        fn, args = loop.calls[0]
        fn(*args)

    def drained(job):
        return [job.out.get_nowait() for _ in range(job.out.qsize())]

    assert drained(one) == ["x1", "x2", None] and drained(two) == ["y1", "y2"] and drained(three) == ["z1"]

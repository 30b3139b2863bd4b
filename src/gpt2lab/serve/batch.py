"""The worker of one model: its queue, admission, deadlines and cancellation, and continuous batching, every
active request a row of one batched decode step (or, with ``gpt2lab serve --deterministic``, rows in turns).
The jobs it runs, the events it sends their handlers and the engine thread that steps it: serve/jobs.py.

The worker bounds the rows in flight (``max_batch``) and the requests waiting (``max_queue``: past it
``submit`` raises QueueFull; a request whose client left gives its place back at once, Job.cancel), and ends
a request that outlives ``timeout_s``; ``shut_down`` ends every open request when the server stops.

A row is one prompt of one request; it runs the request's ``n`` samples one after another
on the prompt's own seeded generator, as ``gpt2lab sample --num-samples n`` does. Between
steps the worker lets rows join and leave:

* a new row's prompt runs alone, ``prefill_chunk`` tokens per step, into a one-row
  ``KVCache`` (so a long prompt delays the running streams by one chunk per step, not by the
  whole prompt); its last logits give its first token, and its keys and values move into a
  free slot of the shared ``RowsCache``. New rows waiting together whose whole prompts fit in
  one chunk (rows x the longest, right-padded) run in one forward instead, each row's first
  token drawn from the logits at its own last position: the weights are read once for all of
  them (the requests of a burst no longer wait for one prefill after another);
* each step then runs one forward of (rows, 1) tokens over ``RowsCache``: row i at its own
  position, attending to its own keys only (a per-row mask over the padded length);
* where the model has gpt2lab's fused step (``HeldGPT.step_rows``: a GPT-2 held with the
  compiled kernel on a CPU), new rows' whole prompts instead join that step as rows of their own
  cache slots, as many as fit in one ``prefill_chunk`` (the mixed step): the weights are read once
  for the running rows' next tokens and the prompts together, and the running streams do not stop
  for a prefill of their own (a prompt longer than a chunk, or one whose tokens are scored, runs as
  in the first point);
* a row that finishes, is cancelled (its client went away) or times out leaves at once: the
  last row moves into its slot, so the rows of a step are always slots 0..rows-1 and the
  cache is read as one slice, never gathered.

Sampling is per row with completion.py's functions: its own generator, temperature, top-k,
top-p, stop strings and token counts. A request that echoes its prompt with ``logprobs``
runs its prefill chunks with every position's logits (not the last only) and scores the
prompt's tokens from them, so scoring (``max_tokens`` 0) costs the prompt's one forward,
batched between decode steps like any prefill. A row's logits are those of the unbatched model up to
float rounding (tests/unit/test_serve_batch.py checks them against the one-row forward): a batched
matmul may round differently, so a seeded request can in rare cases draw another token than
``gpt2lab sample``; ``--deterministic`` (the worker's turns) keeps exact equality.
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import threading
import time
from typing import Callable, Iterator, Optional

import torch

from gpt2lab.inference.choice import Decision
from gpt2lab.inference.completion import (
    SampleText,
    TokenLogprob,
    score_prompt,
    seeded_generator,
    stream_tokens,
    token_logprobs,
)
from gpt2lab.inference.fused import prompt_rows
from gpt2lab.model.gpt import GPT, KVCache
from gpt2lab.model.sampling import sample_next, top_k_rows
from gpt2lab.serve.jobs import Finish, Job, QueueFull, ShuttingDown, Text, TimedOut
from gpt2lab.serve.limits import Limits
from gpt2lab.serve.metrics import ServeMetrics
from gpt2lab.serve.rows import RowsCache


class Row:
    """One prompt of one request: its ``n`` samples in turn on one seeded generator."""

    def __init__(self, job: Job, p: int, generator: torch.Generator, model) -> None:
        self.job, self.p, self.generator, self.model = job, p, generator, model
        self.ids = job.prompts[p]
        self.sample = -1
        self.next_sample()

    def next_sample(self) -> None:
        job = self.job
        self.sample += 1
        self.index = self.p * job.n + self.sample
        self.out = SampleText(self.model, job.sampling, job.stops)  # its text, and where it ends
        self.cache: Optional[KVCache] = None  # the prompt's, while it is being run
        self.tokens: Optional[Iterator] = None  # in turns: its stream_tokens, as gpt2lab sample runs it
        self.last: Optional[int] = None  # the token to feed next
        self.scored: list[TokenLogprob] = [TokenLogprob(self.ids[0], None)]  # the prompt's, with scores_prompt
        if job.echo and not job.scores_prompt:  # else once its prefill has scored the prompt
            job.send(Text(self.index, job.echo[self.p]))


class Worker:
    """Owns one model (see the module's docstring); the engine's thread (run_engine) is the one that ever
    runs it, one step per ``next`` of ``_steps``. With ``turns`` (``gpt2lab serve --deterministic``) the rows
    instead take turns, one token each, every sample run by completion.stream_tokens with its own KV cache exactly
    as ``gpt2lab sample`` runs it: a seeded request gives sample's text whatever else is served, and 8 streams
    share one stream's tokens/s."""

    def __init__(
        self,
        name: str,
        model: GPT,
        device: torch.device,
        limits: Optional[Limits] = None,
        decision: Optional[Decision] = None,
        turns: bool = False,
    ) -> None:
        self.name, self.model, self.device = name, model, device  # a model held by serve/models.py (or as given)
        self.block_size = model.config.block_size
        self.turns = turns
        self.decision = decision  # how it is held and why (inference/choice.py), where serve/models.py decided
        self.limits = limits or Limits()
        self.metrics = ServeMetrics()  # the app's own once it watches the worker (ServeMetrics.watch)
        self._new: collections.deque[Job] = collections.deque()  # submitted since the last step
        self._closed = False  # close: the engine stops running it
        self._lock = threading.Lock()
        self._waiting = 0  # submitted, not yet given a row (or a turn)
        self._open: set[Job] = set()  # submitted, not yet complete: what shut_down ends
        self._stopping: Optional[ShuttingDown] = None  # set by shut_down: new requests are refused
        self._wake = threading.Event()  # the engine's: set when there is something to do
        self.outbox: collections.deque = collections.deque()  # (job, event) sent since the last delivery
        self.cache = RowsCache(model.config.n_layer, self.block_size)
        self.waiting: collections.deque[Job] = collections.deque()  # not yet started
        self.prefill: collections.deque[Row] = collections.deque()  # prompt not yet run (in turns: every row)
        self.decoding: list[Row] = []  # row i is slot i of self.cache
        # the fused step: prompts join the decode step, as many tokens as it runs as fast as the model's forward
        self._mix_tokens = min(self.limits.prefill_chunk, prompt_rows(model))

    def submit(self, job: Job, loop) -> None:
        """Queue ``job`` (its events go to ``loop``), or raise QueueFull at once when ``max_queue`` requests are
        waiting already."""
        with self._lock:
            if self._stopping is not None:
                raise self._stopping
            if self._waiting >= self.limits.max_queue:
                raise QueueFull(
                    f"the server is busy: {self._waiting} requests are waiting for model "
                    f"'{self.name}' (--max-queue {self.limits.max_queue}); retry later"
                )
            self._waiting += 1
            job.worker, job.queued, job.loop = self, True, loop
            job.arrived = time.monotonic()
            job.deadline = job.arrived + self.limits.timeout_s
            self._open.add(job)
        self._new.append(job)
        self._wake.set()

    def queue_depth(self) -> int:
        return self._waiting

    def active_rows(self) -> int:
        return len(self.decoding) + len(self.prefill)

    def shut_down(self, error: ShuttingDown) -> int:
        """End every open request with ``error`` now and refuse new ones; call it once the engine has
        stopped stepping this worker (Ctrl-C under ``gpt2lab serve``: server.serve_here). Returns
        how many ended whose client was still there."""
        with self._lock:
            self._stopping = error
            jobs, self._open = list(self._open), set()
        ended = sum(not job.cancelled for job in jobs)  # before failing them: a handler cancels its job as it ends
        for job in jobs:
            self._started(job)  # its queue place, if it held one
            job.fail(error)
        self.deliver()  # after what a step a Ctrl-C cut short sent
        return ended

    def deliver(self) -> None:
        """Hand the events sent since the last delivery to their jobs' queues, in the order sent: one call an
        event loop, a wake-up of its thread a step, not one a token of every row. The engine calls it when a
        step ends; the worker, after a prompt's first token, so that the token does not wait for the decode
        step that follows in the same step. Taken one by one from the outbox, so that no event sent meanwhile
        (from another thread: shut_down) is lost."""
        by_loop: dict = {}
        with contextlib.suppress(IndexError):  # the outbox is empty
            while True:
                job, event = self.outbox.popleft()
                by_loop.setdefault(job.loop, []).append((job.out, event))
        for loop, items in by_loop.items():
            loop.call_soon_threadsafe(_put_each, items)

    def close(self) -> None:
        """Ask the engine to stop running this worker (after the step it is in)."""
        self._closed = True
        self._wake.set()

    def _started(self, job: Job) -> None:
        """Give back ``job``'s queue place: when the worker starts or drops it, or its client leaves
        (Job.cancel), whichever comes first; the others find it given back already."""
        with self._lock:
            if job.queued:
                job.queued = False
                self._waiting -= 1

    def _token(self, job: Job, index: int) -> None:
        """Count a sampled token of choice ``index``; observe first-token or per-token latency."""
        now = time.monotonic()
        if not job.last_token:  # the request's first
            self.metrics.first_token.labels(self.name).observe(now - job.arrived)
        last = job.last_token.get(index)
        if last is not None:
            self.metrics.per_token.labels(self.name).observe(now - last)
        job.last_token[index] = now
        self.metrics.tokens.labels(self.name).inc()

    def _steps(self) -> Iterator[bool]:
        """One step of work per ``next``: whether there was any (False: idle until a request arrives); ends once
        the worker is closed."""
        while not self._closed:
            while self._new:  # new requests join between steps
                self.waiting.append(self._new.popleft())
            if not (self.waiting or self.prefill or self.decoding):
                yield False
                continue
            self._drop_ended(time.monotonic())
            self._admit()
            try:
                if self.turns:
                    self._turn()
                else:
                    self._step()
            except Exception as e:  # a failed forward: its rows' requests get the error, the worker goes on
                for job in {id(r.job): r.job for r in [*self.prefill, *self.decoding]}.values():
                    self._end(job, e)
            yield True

    def _admit(self) -> None:
        """Start waiting requests while the batch has a free row; their rows queue for prefill."""
        while self.waiting and len(self.decoding) + len(self.prefill) < self.limits.max_batch:
            job = self.waiting.popleft()
            self._started(job)
            if job.sampling.max_new_tokens == 0 and not job.scores_prompt:  # nothing to run: each choice ends now
                for i in range(len(job.prompts) * job.n):
                    if job.echo:
                        job.send(Text(i, job.echo[i // job.n]))
                    job.send(Finish(i, "length", 0))
                job.send(None)
                continue
            job.rows_left = len(job.prompts)
            # each prompt gets a generator seeded with its seed, as gpt2lab sample seeds its own
            self.prefill.extend(
                Row(job, p, seeded_generator(self.device, job.seeds[p]), self.model) for p in range(len(job.prompts))
            )

    def _drop_ended(self, now: float) -> None:
        """Requests whose client went away or whose time is up leave before the next step."""
        jobs = [*self.waiting, *(r.job for r in [*self.prefill, *self.decoding])]
        for job in {id(j): j for j in jobs if j.cancelled or now > j.deadline}.values():
            why = "(--timeout); ask for fewer tokens or retry when the server is less busy"
            late = TimedOut(f"the request took longer than the server's {self.limits.timeout_s:g} s timeout {why}")
            self._end(job, None if job.cancelled else late)

    def _end(self, job: Job, error: Optional[BaseException]) -> None:
        """``job`` leaves before its rows are done, failing with ``error`` (None: its client left, nobody reads)."""
        self.waiting = collections.deque(j for j in self.waiting if j is not job)
        self._started(job)
        self.prefill = collections.deque(r for r in self.prefill if r.job is not job)
        for slot in reversed(range(len(self.decoding))):
            if self.decoding[slot].job is job:
                self._leave(slot)
        job.fail(error)

    def _leave(self, slot: int) -> None:
        self.cache.remove(slot)
        self.decoding[slot] = self.decoding[-1]
        self.decoding.pop()

    def _turn(self) -> None:
        """In turns: the front row's next token as gpt2lab sample draws it (an echoed prompt scored by one
        forward of its own first), then the row goes to the back; an error fails its request only."""
        row = self.prefill.popleft()
        r = row.job
        self.metrics.batch_size.labels(self.name).observe(1)
        try:
            if row.tokens is None:
                if r.scores_prompt:
                    scored = score_prompt(self.model, row.ids, r.logprobs)
                    row.job.send(Text(row.index, r.echo[row.p], logprobs=scored))
                row.tokens = stream_tokens(self.model, row.ids, r.sampling, row.generator, r.logprobs)
            t, lp = next(row.tokens, (None, None))  # None: max_tokens 0, the prompt scored only
        except Exception as e:
            return self._end(row.job, e)
        if self._sampled(row, t, lp):
            self.prefill.append(row)

    def _step(self) -> None:
        """One step of the batch: the prompts at the front of the queue that fit join the running rows' step
        (``_decode``), else the front's next chunk runs first (``_prefill``: as many whole prompts as fit one
        ``prefill_chunk`` padded to the longest, else the front row alone), then the running rows' step."""
        if self.prefill and len(self.decoding) < self.limits.max_batch:
            mix = self._front(lambda g: sum(len(r.ids) for r in g) <= self._mix_tokens) if self._mix_tokens else []
            if mix and self._decode(mix):
                return
            chunk = self.limits.prefill_chunk
            self._prefill(self._front(lambda g: len(g) * max(len(r.ids) for r in g) <= chunk) or [self.prefill[0]])
            self.deliver()  # a first token goes out now, not after the decode step
        if self.decoding:
            self._decode([])

    def _front(self, fits: Callable[[list[Row]], bool]) -> list[Row]:
        """The rows at the front of the prefill queue that run their whole prompts with others, while the group
        ``fits``: not started (no part of the prompt run yet), not scoring it (a row asking for no tokens does:
        _admit ends the others); as many as the batch has free rows."""
        group: list[Row] = []
        for row in itertools.islice(self.prefill, self.limits.max_batch - len(self.decoding)):
            if row.cache is not None or row.job.scores_prompt or not fits([*group, row]):
                break
            group.append(row)
        return group

    def _prefill(self, rows: list[Row]) -> None:
        """The next chunk of ``rows``' prompts (the front of the prefill queue) in one forward: several whole
        prompts right-padded to the longest (a padded position follows every real one, so no real position
        sees it, and it is never copied into the batch's cache), or one prompt ``prefill_chunk`` tokens a step
        (its tokens scored where the request echoes it with logprobs). At the prompts' end each row draws its
        first token from the logits at its own last position and joins the batch."""
        head, r, T = rows[0], rows[0].job, max(len(row.ids) for row in rows)
        head.cache = head.cache or self.model.new_kv_cache(T)
        start = head.cache.pos
        end = min(T, start + self.limits.prefill_chunk)
        idx = torch.tensor([(row.ids + [0] * (T - len(row.ids)))[start:end] for row in rows], device=self.device)
        last = [b * (end - start) + min(len(row.ids), end) - start - 1 for b, row in enumerate(rows)]
        at = None if r.scores_prompt else torch.tensor(last, dtype=torch.long, device=self.device)
        logits, _ = self.model(idx, kv_cache=head.cache, positions=at)  # a failure fails them all
        if r.scores_prompt:  # one row; position i predicts prompt token i + 1, which may lie in the next chunk
            targets = torch.tensor(head.ids[start + 1 : end + 1], dtype=torch.long)
            head.scored += token_logprobs(
                logits[0, : len(targets)], targets, self.model.config.real_vocab_size, r.logprobs
            )
            logits = logits[0, -1:]
        if end < T:
            return  # more of the prompt next step
        drawn = self._draw(rows, logits) if r.sampling.max_new_tokens else []  # in the queue: an error fails them
        for _ in rows:
            self.prefill.popleft()
        for b, row in enumerate(rows):
            if r.scores_prompt:
                row.job.send(Text(row.index, r.echo[row.p], logprobs=row.scored))
            if not drawn:  # scored only
                row.job.send(Finish(row.index, "length", 0))
                self._sample_done(row)
            elif self._sampled(row, *drawn[b]):
                self.cache.put(len(self.decoding), head.cache, self.limits.max_batch, b, len(row.ids))
                self.decoding.append(row)
        head.cache = None

    def _decode(self, joining: list[Row]) -> bool:
        """One step over the running rows' next tokens and, where the model has the fused step
        (``HeldGPT.step_rows``), ``joining``'s whole prompts (the front of the prefill queue), each in the next
        free slot, its first token drawn from the logits at its last position; without it the model's forward
        over ``RowsCache``. False, having run and drawn nothing, where ``joining`` cannot join (the fused step
        does not apply: the worker then stops mixing)."""
        rows, cache, n = self.decoding, self.cache, len(self.decoding)
        logits = None
        if self._mix_tokens:
            ids, slots, positions, wanted = [r.last for r in rows], list(range(n)), list(cache.lengths), list(range(n))
            for j, row in enumerate(joining):
                ids += row.ids
                slots += [n + j] * len(row.ids)
                positions += range(len(row.ids))
                wanted.append(len(ids) - 1)
            c = self.model.config
            cache.reserve(self.limits.max_batch, max(positions) + 1, c.n_head, c.n_embd // c.n_head)  # as put's
            as_tensor = lambda v: torch.tensor(v, dtype=torch.int64)  # noqa: E731
            logits = self.model.step_rows(*map(as_tensor, (ids, slots, positions, wanted)), cache)
            if logits is None:
                self._mix_tokens = 0
                if joining:
                    return False
        if logits is None:
            idx = torch.tensor([[r.last] for r in rows], dtype=torch.long, device=self.device)
            logits = self.model(idx, kv_cache=cache.view(self.device), last_only=True)[0][:, -1]
        else:
            cache.lengths = [length + 1 for length in cache.lengths] + [len(row.ids) for row in joining]
            for row in joining:
                self.prefill.popleft()
                rows.append(row)  # slot n + j, as the kernel wrote it
        self.metrics.batch_size.labels(self.name).observe(len(rows))  # rows, a prompt one of them
        going = [self._sampled(row, *drawn) for row, drawn in zip(rows, self._draw(rows, logits))]
        for slot in reversed(range(len(rows))):
            if not going[slot]:
                self._leave(slot)  # its sample ended
        return True

    def _draw(self, rows: list[Row], logits: torch.Tensor) -> list[tuple[int, Optional[TokenLogprob]]]:
        """Each row's next token from its row of ``logits`` (rows, vocab), as generate_stream draws it, and its
        log-probability where its request asks for logprobs. Rows that draw alike (temperature, top-k, top-p)
        draw in one ``sample_next`` call, each on its own generator: the same token each would draw alone."""
        vocab = self.model.config.real_vocab_size
        logits = logits[:, :vocab]  # padded vocabulary rows are never sampled
        settings = [r.job.sampling for r in rows]
        tops = top_k_rows(logits, [(s.temperature, s.filters()["top_k"]) for s in settings])
        drawn: list = [None] * len(rows)
        alike: dict[tuple, list[int]] = {}
        for i, s in enumerate(settings):
            alike.setdefault((s.temperature, *s.filters().values()), []).append(i)
        for group in alike.values():
            s, every = settings[group[0]], len(group) == len(rows)
            narrowed = None if tops[group[0]] is None else tuple(torch.cat(t) for t in zip(*(tops[i] for i in group)))
            picked = sample_next(
                logits if every else logits[group], s.temperature, **s.filters(),
                generator=[rows[i].generator for i in group], narrowed=narrowed,
            )  # fmt: skip
            for j, i in enumerate(group):
                top = rows[i].job.logprobs
                lp = None if top is None else token_logprobs(logits[i : i + 1], picked[j : j + 1], vocab, top)[0]
                drawn[i] = (int(picked[j]), lp)
        return drawn

    def _sampled(self, row: Row, t: int, lp: Optional[TokenLogprob] = None) -> bool:
        """Send what token ``t`` (log-probability ``lp``) adds to ``row``'s text; False once this
        sample ended (the row then leaves the batch: for good, or to run its prompt again for its
        next sample)."""
        piece, tail = row.out.feed(t)
        if piece is not None:
            self._token(row.job, row.index)
            row.job.send(Text(row.index, piece, None if lp is None else [lp]))
        for text in tail:
            row.job.send(Text(row.index, text))
        if row.out.reason is None:
            row.last = t
            return True
        row.job.send(Finish(row.index, row.out.reason, row.out.tokens))
        self._sample_done(row)
        return False

    def _sample_done(self, row: Row) -> None:
        job = row.job
        if row.sample + 1 < job.n:
            row.next_sample()
            self.prefill.appendleft(row)  # its next sample runs the prompt again, before newcomers
            return
        job.rows_left -= 1
        if job.rows_left == 0:
            job.send(None)


def _put_each(items: list) -> None:
    for out, event in items:
        out.put_nowait(event)

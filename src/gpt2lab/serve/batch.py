"""Continuous batching: every active request is a row of one batched decode step.

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
import itertools
import time
from typing import Callable, Iterator, Optional

import torch

from gpt2lab.inference.completion import (
    SampleText,
    TokenLogprob,
    score_prompt,
    seeded_generator,
    stream_tokens,
    token_logprobs,
)
from gpt2lab.inference.fused import prompt_rows
from gpt2lab.model.gpt import KVCache
from gpt2lab.model.sampling import sample_next, top_k_rows
from gpt2lab.serve.engine import Finish, Job, Text, Worker


class RowsCache:
    """Keys and values of the rows of a batch, each row at its own length.

    Buffers are (slots, heads, positions, head size) per layer, grown on demand (positions
    doubling up to the model's block) and freed when no row is left. Between ``view(rows)``
    and the forward's ``advance``, the model sees slots 0..rows-1 through the KVCache
    interface: ``pos`` is the longest row (for the block check), ``positions`` and ``mask``
    are per row.
    """

    def __init__(self, n_layer: int, max_len: int) -> None:
        self.n_layer, self.max_len = n_layer, max_len
        self.k: list[Optional[torch.Tensor]] = [None] * n_layer
        self.v: list[Optional[torch.Tensor]] = [None] * n_layer
        self.lengths: list[int] = []  # positions filled, per slot in use
        self.rows = 0
        self.pos = 0
        self._lengths: Optional[torch.Tensor] = None  # lengths of the viewed rows, on the device

    def reserve(self, slots: int, positions: int, heads: int, head_size: int) -> None:
        """Make the buffers hold at least ``slots`` rows of ``positions`` each (fp32 on the CPU where none
        exist yet: the fused step's cache)."""
        self._room(slots, positions, self.k[0] if self.k[0] is not None else torch.empty(0, heads, 0, head_size))

    def _room(self, slots: int, positions: int, like: torch.Tensor) -> None:
        """Make the buffers hold at least ``slots`` rows of ``positions`` each."""
        have = self.k[0]
        if have is not None and have.shape[0] >= slots and have.shape[2] >= positions:
            return
        S = max(slots, have.shape[0] if have is not None else 0)
        L = min(self.max_len, max(positions, 2 * (have.shape[2] if have is not None else 32)))
        for bufs in (self.k, self.v):
            for layer, old in enumerate(bufs):
                new = like.new_zeros(S, like.shape[1], L, like.shape[3])
                if old is not None:
                    new[: old.shape[0], :, : old.shape[2]] = old
                bufs[layer] = new

    def put(self, slot: int, cache: KVCache, capacity: int, row: int = 0, length: Optional[int] = None) -> None:
        """Copy row ``row`` of ``cache`` (its first ``length`` positions, by default all it holds) into
        ``slot`` (the next free one), with room for ``capacity`` slots."""
        assert slot == len(self.lengths), "rows join at the end"
        n = cache.pos if length is None else length
        self._room(capacity, n + 1, cache.k[0])
        for mine, theirs in ((self.k, cache.k), (self.v, cache.v)):
            for layer in range(self.n_layer):
                mine[layer][slot, :, :n] = theirs[layer][row, :, :n]
        self.lengths.append(n)

    def remove(self, slot: int) -> None:
        """Free ``slot``: the last row moves into it."""
        last = len(self.lengths) - 1
        if slot != last:
            n = self.lengths[last]
            for bufs in (self.k, self.v):
                for buf in bufs:
                    buf[slot, :, :n] = buf[last, :, :n]
            self.lengths[slot] = n
        self.lengths.pop()
        if not self.lengths:  # idle: give the memory back
            self.k, self.v = [None] * self.n_layer, [None] * self.n_layer

    def view(self, device: torch.device) -> "RowsCache":
        """Ready a forward over every row in use (one new token each)."""
        self.rows, self.pos = len(self.lengths), max(self.lengths)
        self._room(self.rows, self.pos + 1, self.k[0])
        self._lengths = torch.tensor(self.lengths, dtype=torch.long, device=device)
        return self

    # The KVCache interface the model calls (one token per row).
    def positions(self, T: int, device: torch.device) -> torch.Tensor:
        assert T == 1, "rows decode one token per step"
        return self._lengths[:, None]  # (rows, 1)

    def mask(self, T: int, device: torch.device) -> Optional[torch.Tensor]:
        """(rows, 1, 1, longest + 1): row i sees its own positions 0..lengths[i] only (None when
        every row has the same length: then every key is its own)."""
        if min(self.lengths) == self.pos:
            return None
        keys = torch.arange(self.pos + 1, device=device)
        return (keys[None, :] <= self._lengths[:, None])[:, None, None, :]

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        rows = torch.arange(self.rows, device=k.device)
        self.k[layer][rows, :, self._lengths] = k[:, :, 0]  # (rows, heads, head size) at each row's position
        self.v[layer][rows, :, self._lengths] = v[:, :, 0]
        return self.k[layer][: self.rows, :, : self.pos + 1], self.v[layer][: self.rows, :, : self.pos + 1]

    def advance(self, T: int) -> None:
        self.lengths = [n + T for n in self.lengths]


class Row:
    """One prompt of one request: its ``n`` samples in turn on one seeded generator."""

    def __init__(self, job: Job, p: int, generator: torch.Generator, model) -> None:
        self.job, self.p, self.generator, self.model = job, p, generator, model
        self.ids = job.request.prompts[p]
        self.sample = -1
        self.next_sample()

    def next_sample(self) -> None:
        r = self.job.request
        self.sample += 1
        self.index = self.p * r.n + self.sample
        self.out = SampleText(self.model, r.sampling, r.stops)  # its text, and where it ends
        self.cache: Optional[KVCache] = None  # the prompt's, while it is being run
        self.tokens: Optional[Iterator] = None  # in turns: its stream_tokens, as gpt2lab sample runs it
        self.last: Optional[int] = None  # the token to feed next
        self.scored: list[TokenLogprob] = [TokenLogprob(self.ids[0], None)]  # the prompt's, with scores_prompt
        if r.echo and not r.scores_prompt:  # else once its prefill has scored the prompt
            self.job.send(Text(self.index, r.echo[self.p]))


class BatchWorker(Worker):
    """Continuous batching (see the module's docstring); with ``turns`` (``gpt2lab serve --deterministic``)
    the rows instead take turns, one token each, every sample run by completion.stream_tokens with its own KV
    cache exactly as ``gpt2lab sample`` runs it: a seeded request gives sample's text whatever else is
    served, and 8 streams share one stream's tokens/s."""

    def _steps(self) -> Iterator[bool]:
        self.cache = RowsCache(self.model.config.n_layer, self.block_size)
        self.waiting: collections.deque[Job] = collections.deque()  # not yet started
        self.prefill: collections.deque[Row] = collections.deque()  # prompt not yet run (in turns: every row)
        self.decoding: list[Row] = []  # row i is slot i of self.cache
        self.rows_left: dict[int, int] = {}  # id(job) -> rows not finished
        # the fused step: prompts join the decode step, as many tokens as it runs as fast as the model's forward
        self._mix_tokens = min(self.limits.prefill_chunk, prompt_rows(self.model))
        while self._arrived(self.waiting):  # new requests join between steps
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
                    self._end_job(job, e)
            self._rows = len(self.decoding) + len(self.prefill)
            yield True

    def _admit(self) -> None:
        """Start waiting requests while the batch has a free row; their rows queue for prefill."""
        while self.waiting and len(self.decoding) + len(self.prefill) < self.limits.max_batch:
            job = self.waiting.popleft()
            self._started(job)
            r = job.request
            if r.sampling.max_new_tokens == 0 and not r.scores_prompt:  # nothing to run: each choice ends at once
                for i in range(len(r.prompts) * r.n):
                    if r.echo:
                        job.send(Text(i, r.echo[i // r.n]))
                    job.send(Finish(i, "length", 0))
                job.send(None)
                continue
            self.rows_left[id(job)] = len(r.prompts)
            # each prompt gets a generator seeded with its seed, as gpt2lab sample seeds its own
            self.prefill.extend(
                Row(job, p, seeded_generator(self.device, r.seeds[p]), self.model) for p in range(len(r.prompts))
            )

    def _drop_ended(self, now: float) -> None:
        """Requests whose client went away or whose time is up leave before the next step."""
        for job in [j for j in self.waiting if j.ended(now)]:
            self.waiting.remove(job)
            self._started(job)
            self._end_early(job)
        ended = {id(r.job): r.job for r in [*self.prefill, *self.decoding] if r.job.ended(now)}
        for job in ended.values():
            self._remove_rows(job)
            self.rows_left.pop(id(job), None)
            self._end_early(job)

    def _end_job(self, job: Job, error: BaseException) -> None:
        self._remove_rows(job)
        if self.rows_left.pop(id(job), None) is not None:
            job.fail(error)

    def _remove_rows(self, job: Job) -> None:
        self.prefill = collections.deque(r for r in self.prefill if r.job is not job)
        for slot in reversed(range(len(self.decoding))):
            if self.decoding[slot].job is job:
                self._leave(slot)

    def _leave(self, slot: int) -> None:
        self.cache.remove(slot)
        self.decoding[slot] = self.decoding[-1]
        self.decoding.pop()

    def _turn(self) -> None:
        """In turns: the front row's next token as gpt2lab sample draws it (an echoed prompt scored by one
        forward of its own first), then the row goes to the back; an error fails its request only."""
        row = self.prefill.popleft()
        r = row.job.request
        self.metrics.batch_size.labels(self.name).observe(1)
        try:
            if row.tokens is None:
                if r.scores_prompt:
                    scored = score_prompt(self.model, row.ids, r.logprobs)
                    row.job.send(Text(row.index, r.echo[row.p], logprobs=scored))
                row.tokens = stream_tokens(self.model, row.ids, r.sampling, row.generator, r.logprobs)
            t, lp = next(row.tokens, (None, None))  # None: max_tokens 0, the prompt scored only
        except Exception as e:
            return self._end_job(row.job, e)
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
        ``fits``: not started (no part of the prompt run yet), not scoring it, asking for tokens; as many as
        the batch has free rows."""
        group: list[Row] = []
        for row in itertools.islice(self.prefill, self.limits.max_batch - len(self.decoding)):
            r = row.job.request
            if row.cache is not None or r.scores_prompt or r.sampling.max_new_tokens == 0 or not fits([*group, row]):
                break
            group.append(row)
        return group

    def _prefill(self, rows: list[Row]) -> None:
        """The next chunk of ``rows``' prompts (the front of the prefill queue) in one forward: several whole
        prompts right-padded to the longest (a padded position follows every real one, so no real position
        sees it, and it is never copied into the batch's cache), or one prompt ``prefill_chunk`` tokens a step
        (its tokens scored where the request echoes it with logprobs). At the prompts' end each row draws its
        first token from the logits at its own last position and joins the batch."""
        head, r, T = rows[0], rows[0].job.request, max(len(row.ids) for row in rows)
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
                self.cache.put(len(self.decoding), head.cache, self.limits.max_batch, row=b, length=len(row.ids))
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
        settings = [r.job.request.sampling for r in rows]
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
                top = rows[i].job.request.logprobs
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
        if row.sample + 1 < job.request.n:
            row.next_sample()
            self.prefill.appendleft(row)  # its next sample runs the prompt again, before newcomers
            return
        self.rows_left[id(job)] -= 1
        if self.rows_left[id(job)] == 0:
            del self.rows_left[id(job)]
            job.send(None)

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
``gpt2lab sample``; ``--deterministic`` (engine.TurnsWorker) keeps exact equality.
"""

from __future__ import annotations

import collections
import itertools
import time
from typing import Iterator, Optional

import torch

from gpt2lab.inference.completion import SampleText, TokenLogprob, seeded_generator, token_logprobs
from gpt2lab.inference.fused import prompt_rows
from gpt2lab.model.gpt import KVCache
from gpt2lab.model.sampling import sample_next, top_k_rows
from gpt2lab.serve.engine import Finish, Job, Text, Worker, deliver


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
        self.last: Optional[int] = None  # the token to feed next
        self.scored: list[TokenLogprob] = [TokenLogprob(self.ids[0], None)]  # the prompt's, with scores_prompt
        if r.echo and not r.scores_prompt:  # else once its prefill has scored the prompt
            self.job.send(Text(self.index, r.echo[self.p]))


class BatchWorker(Worker):
    """The default worker: continuous batching (see the module's docstring)."""

    def _steps(self) -> Iterator[bool]:
        self.cache = RowsCache(self.model.config.n_layer, self.block_size)
        self.waiting: collections.deque[Job] = collections.deque()  # not yet started
        self.prefill: collections.deque[Row] = collections.deque()  # prompt not yet run
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
                mixed = False
                if self.prefill and len(self.decoding) < self.limits.max_batch:
                    joining = self._mixed_group() if self._mix_tokens else []
                    mixed = bool(joining) and self._mixed_step(joining)
                    if not mixed:
                        together = self._prefill_group()
                        if len(together) > 1:
                            self._prefill_together(together)
                        else:
                            self._prefill_step(self.prefill[0])
                        deliver()  # a first token goes out now, not after the decode step
                if self.decoding and not mixed:
                    self._decode_step()
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
            # each prompt gets a generator seeded with its seed, as in completion_events
            self.prefill.extend(
                Row(job, p, seeded_generator(self.device, r.seeds[p]), self.model) for p in range(len(r.prompts))
            )

    def _drop_ended(self, now: float) -> None:
        """Requests whose client went away or whose time is up leave before the next step."""
        for job in [j for j in self.waiting if j.cancelled or j.expired(now)]:
            self.waiting.remove(job)
            self._started(job)
            self._end_early(job)
        ended = {id(r.job): r.job for r in [*self.prefill, *self.decoding] if r.job.cancelled or r.job.expired(now)}
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

    def _prefill_step(self, row: Row) -> None:
        """Run the next chunk of ``row``'s prompt; at its end, sample the first token and join the batch."""
        if row.cache is None:
            row.cache = self.model.new_kv_cache(
                min(self.block_size, len(row.ids) + row.job.request.sampling.max_new_tokens)
            )
        start = row.cache.pos
        chunk = row.ids[start : start + self.limits.prefill_chunk]
        idx = torch.tensor([chunk], dtype=torch.long, device=self.device)
        r = row.job.request
        logits, _ = self.model(idx, kv_cache=row.cache, last_only=not r.scores_prompt)
        if r.scores_prompt:  # position i predicts prompt token i + 1, which may lie in the next chunk
            targets = torch.tensor(row.ids[start + 1 : start + len(chunk) + 1], dtype=torch.long)
            row.scored += token_logprobs(
                logits[0, : len(targets)], targets, self.model.config.real_vocab_size, r.logprobs
            )
        if row.cache.pos < len(row.ids):
            return  # more of the prompt next step
        if r.scores_prompt:
            row.job.send(Text(row.index, r.echo[row.p], logprobs=row.scored))
        if r.sampling.max_new_tokens == 0:  # scored only
            self.prefill.popleft()
            row.cache = None
            row.job.send(Finish(row.index, "length", 0))
            self._sample_done(row)
            return
        t, lp = self._sample(row, logits[:, -1])  # while the row is in prefill, so that an error fails its request
        self.prefill.popleft()
        if self._sampled(row, t, lp):
            self.cache.put(len(self.decoding), row.cache, self.limits.max_batch)
            self.decoding.append(row)
        row.cache = None

    def _front_rows(self) -> Iterator[Row]:
        """The rows at the front of the prefill queue that may run their prompts with others: not started
        (no part of the prompt run yet), with a prompt, not scoring it, asking for tokens; as many as the
        batch has free rows."""
        for row in itertools.islice(self.prefill, self.limits.max_batch - len(self.decoding)):
            r = row.job.request
            if row.cache is not None or not row.ids or r.scores_prompt or r.sampling.max_new_tokens == 0:
                return
            yield row

    def _prefill_group(self) -> list[Row]:
        """The front rows (``_front_rows``) that run their prompts in one forward: while the rows times the
        longest prompt (the padded forward) fit in one ``prefill_chunk``."""
        group, longest = [], 0
        for row in self._front_rows():
            padded = max(longest, len(row.ids))
            if padded * (len(group) + 1) > self.limits.prefill_chunk:
                break
            longest = padded
            group.append(row)
        return group

    def _prefill_together(self, rows: list[Row]) -> None:
        """``rows`` (the front of the prefill queue) in one forward, each prompt right-padded to the longest
        (a padded position follows every real one, so no real position sees it, and it is never copied
        into the batch's cache); each row's first token from the logits at its own last position, then
        each joins the batch as ``_prefill_step`` would have it join."""
        T = max(len(r.ids) for r in rows)
        idx = torch.tensor([r.ids + [0] * (T - len(r.ids)) for r in rows], dtype=torch.long, device=self.device)
        last = torch.tensor([b * T + len(r.ids) - 1 for b, r in enumerate(rows)], dtype=torch.long, device=self.device)
        cache = self.model.new_kv_cache(T)
        logits, _ = self.model(idx, kv_cache=cache, positions=last)  # (rows, vocab): a failure fails them all
        for _ in rows:
            self.prefill.popleft()
        for b, row in enumerate(rows):
            try:
                t, lp = self._sample(row, logits[b : b + 1])
            except Exception:
                self.prefill.extendleft(reversed(rows[b:]))  # not started yet: the error fails their requests
                raise
            if self._sampled(row, t, lp):
                self.cache.put(len(self.decoding), cache, self.limits.max_batch, row=b, length=len(row.ids))
                self.decoding.append(row)

    def _mixed_group(self) -> list[Row]:
        """The front rows (``_front_rows``) whose whole prompts join the next decode step: while their prompts'
        tokens together fit in one ``prefill_chunk`` and in what the fused step runs as fast as the model's
        forward (``fused.prompt_rows``: a row-major bf16 hold's ``tile_rows``)."""
        group, tokens = [], 0
        for row in self._front_rows():
            if tokens + len(row.ids) > self._mix_tokens:
                break
            tokens += len(row.ids)
            group.append(row)
        return group

    def _mixed_step(self, joining: list[Row]) -> bool:
        """One fused step over the running rows' next tokens and ``joining``'s whole prompts (the front of the
        prefill queue), each prompt in the next free slot, its first token drawn from the logits at its last
        position; False, having run and drawn nothing, where the fused step does not apply (the worker then
        stops mixing)."""
        rows, cache, n = self.decoding, self.cache, len(self.decoding)
        ids, slots, positions, wanted = [r.last for r in rows], list(range(n)), list(cache.lengths), list(range(n))
        for j, row in enumerate(joining):
            ids += row.ids
            slots += [n + j] * len(row.ids)
            positions += range(len(row.ids))
            wanted.append(len(ids) - 1)
        c = self.model.config
        cache.reserve(self.limits.max_batch, max(positions) + 1, c.n_head, c.n_embd // c.n_head)  # as put's
        as_tensor = lambda v: torch.tensor(v, dtype=torch.int64)  # noqa: E731
        logits = self.model.step_rows(as_tensor(ids), as_tensor(slots), as_tensor(positions), as_tensor(wanted), cache)
        if logits is None:
            self._mix_tokens = 0
            return False
        self.metrics.batch_size.labels(self.name).observe(n + len(joining))  # rows, a prompt one of them
        cache.lengths = [length + 1 for length in cache.lengths] + [len(row.ids) for row in joining]
        for row in joining:
            self.prefill.popleft()
            rows.append(row)  # slot n + j, as the kernel wrote it
        self._draw(logits)
        return True

    def _decode_step(self) -> None:
        rows = self.decoding
        self.metrics.batch_size.labels(self.name).observe(len(rows))
        idx = torch.tensor([[r.last] for r in rows], dtype=torch.long, device=self.device)
        logits, _ = self.model(idx, kv_cache=self.cache.view(self.device), last_only=True)
        self._draw(logits[:, -1])

    def _draw(self, logits: torch.Tensor) -> None:
        """Each row's next token from its row of ``logits`` (rows, vocab); the rows whose sample ended leave.
        Rows that draw alike (temperature, top-k, top-p; no logprobs) draw in one ``sample_next`` call, each
        on its own generator: the same token each would draw alone."""
        rows = self.decoding
        logits = logits[:, : self.model.config.real_vocab_size]
        settings = [r.job.request.sampling for r in rows]
        tops = top_k_rows(logits, [(s.temperature, s.filters()["top_k"]) for s in settings])
        drawn: list = [None] * len(rows)
        alike: dict[tuple, list[int]] = {}
        for i, (row, s) in enumerate(zip(rows, settings)):
            if row.job.request.logprobs is None:
                alike.setdefault((s.temperature, *s.filters().values()), []).append(i)
            else:
                drawn[i] = self._sample(row, logits[i : i + 1], tops[i])
        for group in alike.values():
            s, every = settings[group[0]], len(group) == len(rows)
            narrowed = None if tops[group[0]] is None else tuple(torch.cat(t) for t in zip(*(tops[i] for i in group)))
            picked = sample_next(
                logits if every else logits[group], s.temperature, **s.filters(),
                generator=[rows[i].generator for i in group], narrowed=narrowed,
            )  # fmt: skip
            for i, t in zip(group, picked.tolist()):
                drawn[i] = (t, None)
        going = [self._sampled(r, *d) for r, d in zip(rows, drawn)]
        for slot in reversed(range(len(rows))):
            if not going[slot]:
                self._leave(slot)

    def _sample(self, row: Row, logits: torch.Tensor, narrowed=None) -> tuple[int, Optional[TokenLogprob]]:
        """The next token of ``row`` from its logits (1, vocab), as generate_stream draws it (``narrowed``:
        their top-k, from the batch's ``top_k_rows``), and its log-probability when the request asks for logprobs."""
        r = row.job.request
        logits = logits[:, : self.model.config.real_vocab_size]  # padded vocabulary rows are never sampled
        t = sample_next(
            logits, r.sampling.temperature, **r.sampling.filters(), generator=row.generator, narrowed=narrowed
        )
        lp = None if r.logprobs is None else token_logprobs(logits, t, logits.size(-1), r.logprobs)[0]
        return int(t), lp

    def _sampled(self, row: Row, t: int, lp: Optional[TokenLogprob] = None) -> bool:
        """Send what token ``t`` (log-probability ``lp``) adds to ``row``'s text; False once this
        sample ended (the row then leaves the batch: for good, or to run its prompt again for its
        next sample)."""
        piece, tail = row.out.feed(t)
        if piece is not None:
            self._token(row.job, row.index)
            row.job.send(Text(row.index, piece, True, None if lp is None else [lp]))
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

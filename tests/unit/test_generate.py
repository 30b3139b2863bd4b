"""Sampling: KV cache vs none vs transformers, past the block, top-k/top-p/temperature, EOT."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import tiny_gpt

from gpt2lab.model.sampling import generate, generate_stream, sample_next, top_k_rows
from gpt2lab.weights import export


@torch.no_grad()
def _plain_greedy(model, idx: torch.Tensor, n: int) -> torch.Tensor:
    """The textbook loop: re-run the last block_size tokens, take the argmax."""
    for _ in range(n):
        logits, _ = model(idx[:, -model.config.block_size :])
        idx = torch.cat([idx, logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    return idx


def test_greedy_cache_equals_no_cache_equals_transformers(tmp_path):
    import transformers

    model = tiny_gpt(seed=11, n_layer=3, n_head=4, n_embd=48, block_size=96, vocab_size=211)
    idx = torch.randint(0, 211, (2, 9), generator=torch.Generator().manual_seed(0))
    cached = generate(model, idx, 60, temperature=0.0, use_cache=True)
    uncached = generate(model, idx, 60, temperature=0.0, use_cache=False)
    assert torch.equal(cached, uncached)
    assert torch.equal(cached, _plain_greedy(model, idx, 60))
    export.save_pretrained(model, str(tmp_path))
    theirs_model = transformers.GPT2LMHeadModel.from_pretrained(str(tmp_path)).eval()
    with torch.no_grad():
        theirs = theirs_model.generate(
            idx,
            attention_mask=torch.ones_like(idx),
            max_new_tokens=60,
            min_new_tokens=60,
            do_sample=False,
            use_cache=True,
        )
    assert torch.equal(cached, theirs)


def test_generation_past_block_size_slides_the_window():
    model = tiny_gpt(seed=2, block_size=16)
    idx = torch.randint(0, 128, (2, 5), generator=torch.Generator().manual_seed(1))
    cached = generate(model, idx, 30, temperature=0.0, use_cache=True)  # ends at 35 > 16
    assert cached.shape == (2, 35)
    assert torch.equal(cached, generate(model, idx, 30, temperature=0.0, use_cache=False))
    assert torch.equal(cached, _plain_greedy(model, idx, 30))
    long_prompt = torch.randint(0, 128, (1, 20))  # a prompt already longer than the block
    assert torch.equal(generate(model, long_prompt, 4, temperature=0.0), _plain_greedy(model, long_prompt, 4))


def test_padded_vocab_rows_are_never_sampled():
    model = tiny_gpt(seed=4, vocab_size=64, token_vocab_size=50)
    with torch.no_grad():  # make every padded row win the argmax by far
        model.transformer.ln_f.weight.zero_()
        model.transformer.ln_f.bias.fill_(1.0)
        model.transformer.wte.weight[50:] = 10.0
    idx = torch.randint(0, 50, (3, 4))
    assert model(idx)[0][:, -1].argmax(-1).min() >= 50  # untrimmed, padding would win
    out = generate(model, idx, 8, temperature=1.0, generator=torch.Generator().manual_seed(0))
    assert out.max() < 50


def test_stop_token_finishes_each_row_separately():
    model = tiny_gpt(seed=7)
    idx = torch.randint(0, 128, (2, 4), generator=torch.Generator().manual_seed(3))
    free = generate(model, idx, 20, temperature=0.0)[:, 4:]
    stop = int(free[0, 2])  # row 0 meets this token at step 2 or earlier
    first = [(row == stop).nonzero()[0].item() if (row == stop).any() else None for row in free]
    out = generate(model, idx, 20, temperature=0.0, stop_token=stop)[:, 4:]
    for r in range(2):
        if first[r] is None:
            assert torch.equal(out[r], free[r, : out.size(1)])
        else:
            assert torch.equal(out[r, : first[r] + 1], free[r, : first[r] + 1])
            assert (out[r, first[r] :] == stop).all()  # finished rows repeat the stop token
    if all(f is not None for f in first):
        assert out.size(1) == max(first) + 1  # the stream ends once every row is done
    flags = torch.stack([f.clone() for _, f in generate_stream(model, idx, 20, temperature=0.0, stop_token=stop)])
    for r in range(2):  # (steps, B): a row is finished from its stop token on, not before
        if first[r] is not None:
            assert not flags[: first[r], r].any() and flags[first[r] :, r].all()


def _frequencies(logits: torch.Tensor, n: int = 4000, **kw) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    picks = sample_next(logits.expand(n, -1), generator=g, **kw)
    return torch.bincount(picks, minlength=logits.size(-1)).float() / n


def test_top_k_top_p_temperature_distributions():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    assert torch.equal(
        sample_next(logits.expand(50, -1), top_k=1, generator=torch.Generator().manual_seed(1)),
        torch.zeros(50, dtype=torch.long),
    )  # top_k=1 is greedy
    f = _frequencies(logits, top_k=2)
    assert f[2:].sum() == 0 and f[0].item() == pytest.approx(0.5 / 0.8, abs=0.03)
    # top_p=0.7: 0.5 alone is short of 0.7, 0.5+0.3 reaches it; the rest is cut.
    f = _frequencies(logits, top_p=0.7)
    assert f[2:].sum() == 0 and f[0].item() == pytest.approx(0.625, abs=0.03)
    f = _frequencies(logits, top_p=0.5)  # the top token alone already holds 0.5
    assert f[0] == 1.0
    f = _frequencies(logits, top_p=1.0)
    assert f[3].item() == pytest.approx(0.05, abs=0.015)
    f = _frequencies(logits, temperature=2.0)
    assert torch.allclose(f, F.softmax(logits[0] / 2.0, -1), atol=0.03)
    f = _frequencies(logits, temperature=2.0, top_k=2)  # the two best, at temperature 2
    assert f[2:].sum() == 0 and torch.allclose(f[:2], F.softmax(logits[0, :2] / 2.0, -1), atol=0.03)
    assert torch.equal(sample_next(logits, temperature=0.0), torch.tensor([0]))


def test_bad_sampling_arguments():
    logits = torch.zeros(1, 4)
    for kw, msg in [(dict(temperature=-1), "temperature"), (dict(top_k=-1), "top_k"), (dict(top_p=0.0), "top_p")]:
        with pytest.raises(ValueError, match=msg):
            sample_next(logits, **kw)
    with pytest.raises(ValueError, match="idx"):
        generate(tiny_gpt(), torch.zeros(2, 0, dtype=torch.long), 3)
    model, idx = tiny_gpt(vocab_size=97), torch.zeros(1, 2, dtype=torch.long)
    for t in (float("nan"), -0.5):  # refused as the CLI and the server refuse them
        with pytest.raises(ValueError, match=f"temperature must be a number >= 0, got {t}"):
            generate(model, idx, 3, temperature=t)
        with pytest.raises(ValueError, match="temperature"):
            sample_next(logits, temperature=t)
    for bad in (97, -1):  # one clear line, not the embedding's bare IndexError
        with pytest.raises(ValueError, match=rf"token id {bad} is outside the model's vocabulary \(0 to 96\)"):
            generate(model, torch.tensor([[1, bad, 2]]), 3)


def test_seeded_sampling_is_reproducible():
    model = tiny_gpt(seed=9)
    idx = torch.randint(0, 128, (2, 5))

    def run():
        return generate(
            model,
            idx,
            12,
            temperature=0.9,
            top_k=20,
            top_p=0.95,
            generator=torch.Generator().manual_seed(123),
        )

    a, b = run(), run()
    assert torch.equal(a, b)
    c = generate(model, idx, 12, temperature=0.9, top_k=20, top_p=0.95, generator=torch.Generator().manual_seed(124))
    assert not torch.equal(a, c)


def test_generates_preparation_leaves_the_model_as_it_was(tmp_path):
    from safetensors.torch import load_file

    model = tiny_gpt(seed=12, vocab_size=300)
    idx = torch.randint(0, 300, (2, 6))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    want = generate(model, idx, 20, temperature=0.0)
    assert torch.equal(generate(model, idx, 20, temperature=0.0), want)  # the prepared copy: the same tokens
    assert model.lm_head.weight is model.transformer.wte.weight
    assert isinstance(model.transformer.h[0].attn.c_attn, torch.nn.Linear)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    export.save_pretrained(model, str(tmp_path))
    saved = load_file(str(tmp_path / "model.safetensors"))
    assert torch.equal(saved["transformer.h.0.attn.c_attn.weight"], before["transformer.h.0.attn.c_attn.weight"].t())


def test_model_generate_returns_what_generate_returns():
    """model.generate(idx, max_new_tokens=..., **kw), the nanoGPT/transformers habit, is generate(model, ...)."""
    model = tiny_gpt(seed=6, n_layer=2, n_head=2, n_embd=32, block_size=32, vocab_size=128)
    idx = torch.randint(0, 128, (2, 5), generator=torch.Generator().manual_seed(2))
    greedy = model.generate(idx, max_new_tokens=40, temperature=0.0)  # past the block: the window slides
    assert torch.equal(greedy, _plain_greedy(model, idx, 40))  # the textbook loop, not generate's code
    kw = dict(temperature=0.9, top_k=40, top_p=0.95)
    mine = model.generate(idx, 20, generator=torch.Generator().manual_seed(7), **kw)
    theirs = generate(model, idx, 20, generator=torch.Generator().manual_seed(7), **kw)
    assert torch.equal(mine, theirs) and not torch.equal(mine, greedy[:, :25])  # a real draw, the same one
    torch.manual_seed(3)  # the global generator, as nanoGPT's users seed it
    mine = model.generate(idx, 20, use_cache=False, **kw)
    torch.manual_seed(3)
    assert torch.equal(mine, generate(model, idx, 20, use_cache=False, **kw))
    with pytest.raises(TypeError, match="no_such_option"):  # keywords reach generate unchanged
        model.generate(idx, 2, no_such_option=1)


# -- one set of sampling defaults: sample's flags, the API's absent fields, generate() ---------------
def test_sample_the_api_and_generate_share_one_set_of_sampling_defaults():
    import inspect

    from gpt2lab import cli
    from gpt2lab.inference.completion import Sampling
    from gpt2lab.model.sampling_defaults import SAMPLING
    from gpt2lab.serve.schemas import ChatRequest, CompletionRequest

    assert (SAMPLING.temperature, SAMPLING.top_k, SAMPLING.top_p) == (1.0, 50, 1.0)  # GPT-2's recipe: top-k 50
    args = cli.build_parser().parse_args(["sample"])
    want = {"temperature": SAMPLING.temperature, "top_k": SAMPLING.top_k, "top_p": SAMPLING.top_p}
    assert {k: getattr(args, k) for k in want} == want
    for schema in (CompletionRequest, ChatRequest):  # a request that leaves them out
        absent = schema(model="m", **({"messages": []} if schema is ChatRequest else {}))
        assert {k: getattr(absent, k) for k in want} == want
    for fn in (generate_stream, sample_next):  # generate() passes its keywords to generate_stream
        params = inspect.signature(fn).parameters
        assert {k: params[k].default for k in want} == want
    assert {k: getattr(Sampling(), k) for k in want} == want


def test_generate_samples_from_the_50_most_likely_tokens_by_default_and_0_keeps_every_token():
    """Each drawn token's rank in the logits it was drawn from (an independent count, not sample_next's
    topk): under 50 by default; with top_k=0 the tail of a near-uniform 211-token model is drawn too."""
    model = tiny_gpt(seed=5, vocab_size=211, block_size=96)
    idx = torch.randint(0, 211, (4, 3), generator=torch.Generator().manual_seed(0))

    def ranks(**kw) -> list[int]:
        seen: list[torch.Tensor] = []
        g = torch.Generator().manual_seed(1)
        out = []
        for tok, _ in generate_stream(model, idx, 40, generator=g, on_logits=seen.append, **kw):
            logits = seen.pop()
            picked = logits.gather(-1, tok[:, None])
            out += (logits > picked).sum(-1).tolist()  # how many tokens were more likely than the one drawn
        return out

    assert max(ranks()) < 50
    assert max(ranks(top_k=0)) >= 50
    g1, g2 = torch.Generator().manual_seed(3), torch.Generator().manual_seed(3)
    assert torch.equal(generate(model, idx, 20, generator=g1), generate(model, idx, 20, top_k=50, generator=g2))


def _draws_dividing_the_vocabulary_first(logits, temperature, top_k, top_p, g):
    """The textbook order: every logit over T, then top-k, top-p and one uniform draw a row."""
    v, ids = torch.topk(logits / temperature, top_k, dim=-1)
    probs = F.softmax(v, dim=-1)
    v = v.masked_fill((probs.cumsum(-1) - probs >= top_p) & (torch.arange(top_k) > 0), float("-inf"))
    cdf = F.softmax(v, dim=-1).cumsum(-1)
    u = torch.rand(cdf.size(0), 1, generator=g) * cdf[:, -1:]
    return ids.gather(-1, torch.searchsorted(cdf, u, right=True).clamp_(max=top_k - 1)).squeeze(-1)


@pytest.mark.parametrize("temperature", [0.3, 0.7, 1.0, 1.6])
def test_dividing_after_top_k_draws_the_tokens_dividing_first_draws(temperature):
    logits = torch.randn(16, 5000, generator=torch.Generator().manual_seed(3)) * 4
    for top_k, top_p in ((50, 1.0), (50, 0.8), (5000, 0.9)):
        got = sample_next(logits, temperature, top_k, top_p, torch.Generator().manual_seed(7))
        want = _draws_dividing_the_vocabulary_first(logits, temperature, top_k, top_p, torch.Generator().manual_seed(7))
        assert torch.equal(got, want)


def test_a_batchs_rows_narrowed_together_draw_what_each_draws_alone():
    """top_k_rows: one topk per k over a batch whose rows ask different settings; each row's values and
    tokens equal its own topk's (ties included: logits rounded to bf16 repeat), and sample_next given
    them draws the token it draws alone, under the same seeded generator."""
    torch.manual_seed(0)
    logits = (3 * torch.randn(9, 1000)).bfloat16().float()  # many ties at 1000 values
    logits[4, :60] = 7.0  # a row whose top 50 are all tied
    settings = [(1.0, 50), (0.7, 50), (1.0, None), (0.0, 50), (1.0, 50), (1e-30, 50), (1.3, 5), (1.0, 0), (0.9, 5000)]
    tops = top_k_rows(logits, settings)
    for i, (temperature, k) in enumerate(settings):
        row = logits[i : i + 1]
        narrowed = k and temperature >= 1e-20
        assert (tops[i] is not None) == bool(narrowed)
        if narrowed:
            values, ids = torch.topk(row, min(k, row.size(-1)), dim=-1)
            assert torch.equal(tops[i][0], values) and torch.equal(tops[i][1], ids)
        for seed in range(5):
            alone = sample_next(row, temperature, k, 0.9, torch.Generator().manual_seed(seed))
            together = sample_next(row, temperature, k, 0.9, torch.Generator().manual_seed(seed), narrowed=tops[i])
            assert int(alone) == int(together)


@pytest.mark.parametrize(
    "temperature, top_k, top_p", [(1.0, 50, None), (0.7, 50, 0.9), (1.3, None, None), (0.8, None, 0.5), (0.0, 50, None)]
)
def test_rows_drawn_together_on_their_own_generators_draw_what_each_draws_alone(temperature, top_k, top_p):
    """sample_next over several rows, each on its own seeded generator (the server's rows that draw alike,
    narrowed together by top_k_rows or not narrowed at all): each row's token is the one sample_next draws
    for that row alone under the same generator, on 2 threads as on 1."""
    torch.manual_seed(1)
    logits = (3 * torch.randn(7, 5000)).bfloat16().float()  # ties included
    logits[2, :80] = 6.0  # a row whose top 50 are all tied
    before = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            for seed in range(6):
                narrowed = top_k_rows(logits, [(temperature, top_k)] * 7)
                together_tops = None if narrowed[0] is None else tuple(torch.cat(t) for t in zip(*narrowed))
                gens = [torch.Generator().manual_seed(100 * seed + i) for i in range(7)]
                together = sample_next(logits, temperature, top_k, top_p, gens, narrowed=together_tops)
                alone = [
                    int(
                        sample_next(
                            logits[i : i + 1], temperature, top_k, top_p, torch.Generator().manual_seed(100 * seed + i)
                        )
                    )
                    for i in range(7)
                ]
                assert together.tolist() == alone
    finally:
        torch.set_num_threads(before)

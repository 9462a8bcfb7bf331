"""KV-cache sampling: cached == uncached, decode logits == full forward, filtering, guidance, priming, seeding."""

from __future__ import annotations

import pytest
import torch

from dalle_lightning.models.prior import DallePrior, KVCache
from dalle_lightning.generation.sampling import draw, filter_logits, sample_image_tokens

TINY = dict(text_vocab_size=40, text_len=7, image_vocab_size=24, image_grid=5, n_layer=4, n_head=2, d_head=8)


@pytest.fixture(scope="module")
def model() -> DallePrior:
    torch.manual_seed(0)
    m = DallePrior(**TINY).eval()
    with torch.no_grad():  # sharper than at init, so top-k / top-p actually cut something
        m.image_head.weight.mul_(30.0)
    return m


@pytest.fixture(scope="module")
def text() -> torch.Tensor:
    t = torch.randint(1, 40, (3, 7), generator=torch.Generator().manual_seed(2))
    t[0, 4:] = 0
    return t


def test_decode_logits_equal_full_forward(model, text):
    image = torch.randint(0, 24, (3, 25), generator=torch.Generator().manual_seed(3))
    _, want = model.logits(text, image[:, :-1])
    cache = KVCache()
    with torch.no_grad():
        got = [model.prefill(text, image[:, :6], cache)]
        got += [model.decode(image[:, n], cache) for n in range(6, 24)]
    torch.testing.assert_close(torch.stack(got, dim=1), want[:, 6:], atol=1e-5, rtol=0)


@pytest.mark.parametrize(
    "options",
    [
        dict(),
        dict(temperature=0.7, top_k=5),
        dict(top_p=0.8, cond_scale=3.0),
        dict(top_k=8, top_p=0.9, cond_scale=2.0, prefix_rows=2),
    ],
)
def test_cached_sampling_equals_uncached(model, text, options):
    options = dict(options)
    rows = options.pop("prefix_rows", 0)
    prefix = torch.randint(0, 24, (3, rows * 5), generator=torch.Generator().manual_seed(4)) if rows else None
    runs = [
        sample_image_tokens(
            model, text, image_prefix=prefix, generator=torch.Generator().manual_seed(7), use_cache=cache, **options
        )
        for cache in (True, False)
    ]
    assert runs[0].shape == (3, 25)
    assert runs[0].equal(runs[1])
    if prefix is not None:
        assert runs[0][:, : rows * 5].equal(prefix)


def test_seeded_and_reproducible(model, text):
    a = sample_image_tokens(model, text, generator=torch.Generator().manual_seed(1))
    b = sample_image_tokens(model, text, generator=torch.Generator().manual_seed(1))
    c = sample_image_tokens(model, text, generator=torch.Generator().manual_seed(2))
    assert a.equal(b) and not a.equal(c)
    assert a.min() >= 0 and a.max() < 24


def test_top_k_one_is_greedy(model, text):
    """Reference: a plain greedy loop over full forward passes."""
    greedy = torch.zeros(3, 0, dtype=torch.long)
    with torch.no_grad():
        for _ in range(25):
            greedy = torch.cat([greedy, model.logits(text, greedy)[1][:, -1].argmax(-1, keepdim=True)], dim=1)
    assert sample_image_tokens(model, text, top_k=1, generator=torch.Generator().manual_seed(0)).equal(greedy)


def test_guidance_with_scale_one_is_plain_conditional(model, text):
    g = lambda: torch.Generator().manual_seed(5)  # noqa: E731
    a = sample_image_tokens(model, text, cond_scale=1.0, generator=g())
    b = sample_image_tokens(model, text, generator=g())
    c = sample_image_tokens(model, text, cond_scale=4.0, generator=g())
    assert a.equal(b) and not a.equal(c)


def test_filter_logits_by_hand():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]]).log_softmax(-1)  # probs ~ .64 .24 .09 .03
    inf = float("-inf")
    top2 = filter_logits(logits, top_k=2)[0]
    assert top2[2:].eq(inf).all() and top2[:2].isfinite().all()
    kept = filter_logits(logits, top_p=0.8).isfinite()[0].tolist()
    assert kept == [True, True, False, False]  # .64 < .8, .64 + .24 >= .8
    assert filter_logits(logits, top_p=0.1).isfinite()[0].tolist() == [True, False, False, False]
    with pytest.raises(ValueError, match="top_p=1.5"):
        filter_logits(logits, top_p=1.5)


def test_draw_inverts_the_cdf():
    logits = torch.tensor([0.5, 0.25, 0.25]).log().expand(5, 3)
    u = torch.tensor([0.0, 0.49, 0.51, 0.74, 0.99])
    assert draw(logits, u).tolist() == [0, 0, 1, 1, 2]


def test_bad_arguments_are_named(model, text):
    with pytest.raises(ValueError, match="temperature=0"):
        sample_image_tokens(model, text, temperature=0)
    with pytest.raises(ValueError, match="image_prefix"):
        sample_image_tokens(model, text, image_prefix=torch.zeros(3, 25, dtype=torch.long))

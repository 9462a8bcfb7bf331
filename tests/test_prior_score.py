"""The prior's own reranking score, log p(image | caption) - log p(image | null caption), and the choice between
rerankers (``rerank=clip|prior|both``): each score against an independent computation, each pick the argmax of
its score, and on a prior trained to tie captions to images, the prior's pick is the image its caption names."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from dalle_lightning.generation.generate import Generation, Generator
from dalle_lightning.models.prior import DallePrior
from dalle_lightning.generation.prior_score import image_log_likelihood, prior_score
from dalle_lightning.generation.selection import selection_scores, standardise
from tests.conftest import run_app

TINY = dict(text_vocab_size=40, text_len=7, image_vocab_size=24, image_grid=4, n_layer=3, n_head=2, d_head=8)


@pytest.fixture(scope="module")
def model() -> DallePrior:
    torch.manual_seed(0)
    m = DallePrior(**TINY).eval()
    with torch.no_grad():  # sharper than at init, so the two captions give visibly different likelihoods
        m.image_head.weight.mul_(20.0)
    return m


def stepwise_log_likelihood(model: DallePrior, text: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """One forward pass per image token on its prefix alone (no teacher-forced sequence, no cache): sum of the
    log-softmax at the token drawn."""
    total = torch.zeros(text.shape[0], dtype=torch.float64)
    with torch.no_grad():
        for j in range(tokens.shape[1]):
            logits = model.logits(text, tokens[:, :j])[1][:, -1].double()
            total += logits.log_softmax(-1).gather(1, tokens[:, j : j + 1]).squeeze(1)
    return total


def test_prior_score_equals_stepwise_likelihood_ratio(model: DallePrior) -> None:
    g = torch.Generator().manual_seed(1)
    text = torch.randint(1, 40, (5, 7), generator=g)
    text[1, 3:] = 0
    tokens = torch.randint(0, 24, (5, 16), generator=g)
    want = stepwise_log_likelihood(model, text, tokens) - stepwise_log_likelihood(model, torch.zeros_like(text), tokens)
    got = prior_score(model, text, tokens, batch_size=2)  # batches of 2 + 2 + 1
    torch.testing.assert_close(got.double(), want, atol=1e-3, rtol=1e-5)
    # The likelihood alone agrees with the model's own loss: mean cross-entropy over the image tokens.
    for i in range(2):
        loss = model(text[i : i + 1], tokens[i : i + 1])["image_loss"]
        assert float(image_log_likelihood(model, text[i : i + 1], tokens[i : i + 1])) == pytest.approx(
            -16 * float(loss.detach()), rel=1e-4)
    assert got.abs().max() > 0.5  # the caption matters to this model, so the check has something to compare


def test_both_is_the_sum_of_per_prompt_standardised_scores() -> None:
    g = torch.Generator().manual_seed(2)
    clip, prior = torch.rand(4, 6, generator=g), 50 * torch.randn(4, 6, generator=g)
    z = lambda s: (s.numpy() - s.numpy().mean(1, keepdims=True)) / s.numpy().std(1, keepdims=True)  # noqa: E731
    np.testing.assert_allclose(selection_scores("both", clip, prior).numpy(), z(clip) + z(prior), rtol=1e-5, atol=1e-5)
    assert torch.equal(selection_scores("prior", clip, prior), prior)
    assert torch.equal(standardise(torch.ones(2, 3)), torch.zeros(2, 3))  # equal scores: no preference
    with pytest.raises(ValueError, match="rerank='both' without contrastive scores"):
        selection_scores("both", None, prior)
    with pytest.raises(ValueError, match="rerank='best'; expected one of clip|prior|both"):
        selection_scores("best", clip, prior)


def test_each_reranker_keeps_the_argmax_of_its_score() -> None:
    g = torch.Generator().manual_seed(3)
    p, n = 5, 6
    candidates = torch.rand(p, n, 3, 4, 4, generator=g)
    clip, prior = torch.rand(p, n, generator=g), torch.randn(p, n, generator=g)
    result = Generation(["c"] * p, candidates, clip, candidates[:, 0], prior_scores=prior, rerank="prior")
    for k in (2, 4, 6):
        want = {"clip": clip[:, :k].argmax(1), "prior": prior[:, :k].argmax(1),
                "both": (standardise(clip[:, :k]) + standardise(prior[:, :k])).argmax(1)}
        for rerank, index in want.items():
            assert torch.equal(result.best_index(k, rerank), index)
            assert torch.equal(result.best_of(k, rerank), candidates[torch.arange(p), index])
        assert torch.equal(result.best_index(k), want["prior"])  # the generation's own reranker by default
    assert torch.equal(result.best_index(1, "both"), torch.zeros(p, dtype=torch.long))


@pytest.fixture(scope="module")
def trained_prior() -> DallePrior:
    """A prior that learned caption k -> every image token k - 1 (captions 1..4), with 20% null captions as
    super-conditioning trains it, so some images are likely under any caption and others only under theirs."""
    torch.manual_seed(0)
    model = DallePrior(text_vocab_size=8, text_len=2, image_vocab_size=6, image_grid=3, n_layer=2, n_head=2, d_head=8)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    for _ in range(150):
        k = torch.randint(1, 5, (32,))
        text = torch.stack([k, torch.zeros_like(k)], dim=1)
        text[torch.rand(32) < 0.2] = 0
        image = (k - 1).unsqueeze(1).expand(-1, 9)
        loss = model(text, image)["loss"]
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model.eval()


def test_prior_pick_is_the_image_its_caption_names(trained_prior: DallePrior) -> None:
    model = trained_prior
    for k in range(1, 5):
        text = torch.tensor([[k, 0]]).expand(4, -1)
        candidates = torch.arange(4).unsqueeze(1).expand(-1, 9)  # candidate j: every token j
        scores = prior_score(model, text, candidates)
        assert int(scores.argmax()) == k - 1, scores


class Tok:
    """The smallest tokenizer the Generator needs: caption "k" -> [k, 0]."""

    vocab_size = 8

    def encode_batch(self, prompts: list[str]) -> torch.Tensor:
        return torch.tensor([[int(p), 0] for p in prompts])


class Dvae(torch.nn.Module):
    """Token grid -> an image that shows the tokens (one grey level per code), so candidates can be told apart."""

    grid_size, vocab_size, image_size = 3, 6, 3

    def decode_indices(self, idx: torch.Tensor) -> torch.Tensor:
        return (idx.float() / 5).unsqueeze(1).expand(-1, 3, -1, -1)


def test_generate_with_rerank_prior_keeps_the_best_prior_score(trained_prior: DallePrior) -> None:
    gen = Generator(trained_prior, Dvae(), Tok())
    result = gen.generate(["1", "3"], num_candidates=6, seed=0, rerank="prior", temperature=3.0)
    text = torch.tensor([[1, 0]] * 6 + [[3, 0]] * 6)
    want = prior_score(gen.prior, text, result.tokens.flatten(0, 1)).view(2, 6)
    torch.testing.assert_close(result.prior_scores, want)
    best = want.argmax(1)
    assert torch.equal(result.images, result.candidates[torch.arange(2), best])
    assert result.scores is None  # no CLIP loaded, none needed
    with pytest.raises(ValueError, match="rerank='both' needs the contrastive model"):
        gen.generate(["1"], num_candidates=2, rerank="both")


@pytest.mark.parametrize("rerank", ["prior", "both"])
def test_dalle_generate_runs_with_rerank(rerank: str, tmp_path: Path) -> None:
    from dalle_lightning.cli import generate
    from tests.test_eval_report import tiny_pipeline

    work = tiny_pipeline(tmp_path)
    out = tmp_path / "samples"
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a red square\na blue circle above a white square\n")
    run_app(generate.main, f"paths.work_dir={work}", f"prompts_file={prompts}", f"out_dir={out}", "num_candidates=3",
            "save_candidates=true", f"rerank={rerank}", "batch_size=8", f"hydra.run.dir={tmp_path}/runs")
    assert sorted(p.name for p in out.glob("*.png")) == ["0.png", "1.png", "grid.png"]
    assert sorted(p.name for p in (out / "candidates").glob("*.png")) == [f"{i}_{j}.png" for i in (0, 1) for j in range(3)]
    for i in (0, 1):  # the kept image is one of the candidates
        kept = (out / f"{i}.png").read_bytes()
        assert any(kept == (out / "candidates" / f"{i}_{j}.png").read_bytes() for j in range(3))


def test_dalle_eval_reports_every_reranker(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    from dalle_lightning.cli import evaluate
    from tests.test_eval_report import tiny_pipeline

    work = tiny_pipeline(tmp_path)
    run_app(evaluate.main, f"paths.work_dir={work}", "n_seen=3", "n_zeroshot=2", "candidates=[1,2]", "batch_size=8",
            "rerank=prior", "fid=false", "plot=null", f"hydra.run.dir={tmp_path}/runs")
    report = json.loads((work / "eval.json").read_text())
    assert report["rerank"] == "prior"
    for split in ("seen", "zeroshot"):
        entry = report[split]["2"]
        assert {"accuracy_clip", "accuracy_prior", "accuracy_both"} <= set(entry)
        assert entry["accuracy"] == entry["accuracy_prior"]
    printed = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert set(printed["waterfall"]) == {"seen", "zeroshot"} and "prior pick" in printed["waterfall"]["seen"]
    assert (work / "eval_waterfall.png").is_file()
    from dalle_lightning.demo import waterfall_lines

    assert waterfall_lines(work) == printed["waterfall"]  # the line the demo prints after its eval step

"""The dalle-eval report: FID per N against an independent Frechet distance of the same CLIP features,
contrastive score and accuracy per N, the JSON and PNG outputs of the command, and the PNG chart itself.

The pipeline models are tiny and untrained (quality is the demo's business); what is checked is that each
number is the quantity it claims to be.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from dalle_lightning.artifacts import save_model
from dalle_lightning.evaluation.evaluate import eval_scenes, evaluate, evaluate_split, images_of
from dalle_lightning.generation.generate import Generator
from dalle_lightning.models.clip import SHAPES_CLIP
from dalle_lightning.evaluation.plot import COLOURS, Panel, line_chart, plot_report
from dalle_lightning.world import sample_captions, sample_scenes
from tests.conftest import run_app
from tests.test_fid import frechet

PRIOR = dict(_target_="dalle_lightning.models.prior.DallePrior", text_len=16, n_layer=2, n_head=2, d_head=8,
             image_grid=4, image_vocab_size=16)
DVAE = dict(_target_="dalle_lightning.models.dvae.DiscreteVAE", image_size=32, vocab_size=16, n_hid=8,
            n_blk_per_group=1, group_count=4, codebook_dim=8)
CLIP = dict(_target_="dalle_lightning.models.clip.create", name=SHAPES_CLIP)


def tiny_pipeline(work: Path) -> Path:
    """Artifacts of a tiny untrained pipeline in ``work``, saved as dalle-train saves them."""
    from hydra.utils import instantiate

    from dalle_lightning.data.tokenizer import CaptionTokenizer

    tok = CaptionTokenizer.train(sample_captions(0, "train", 200), vocab_size=300, text_len=PRIOR["text_len"])
    tok.save(work / "tokenizer.json")
    torch.manual_seed(0)
    for name, cfg in (("prior", {**PRIOR, "text_vocab_size": tok.vocab_size}), ("dvae", DVAE), ("clip", CLIP)):
        save_model(work / f"{name}.pt", cfg, instantiate(cfg))
    return work


@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_pipeline(tmp_path_factory.mktemp("eval"))


@pytest.fixture(scope="module")
def gen(work: Path) -> Generator:
    return Generator.from_files(work / "prior.pt", work / "dvae.pt", work / "tokenizer.json", work / "clip.pt")


def test_eval_scenes_are_the_evaluation_captions() -> None:
    assert [s.caption for s in eval_scenes(7, "zeroshot", 12)] == sample_captions(7, "zeroshot", 12)


def test_fid_and_scores_per_n_are_what_they_claim(gen: Generator) -> None:
    scenes = eval_scenes(3, "val", 6)
    captions = [s.caption for s in scenes]
    reference, baseline = images_of(scenes), images_of(sample_scenes(3, "val", 6))
    report = evaluate_split(gen, captions, [1, 2, 4], reference, baseline, seed=5, batch_size=12)
    # The same draws again (generation is seeded), scored independently.
    result = gen.generate(captions, num_candidates=4, seed=5, batch_size=12)
    ref_features = gen.reranker.embed_images(reference).double().numpy()
    for n in (1, 2, 4):
        best = result.best_of(n)
        want = frechet(ref_features, gen.reranker.embed_images(best).double().numpy())
        assert report[str(n)]["fid_clip"] == pytest.approx(want, rel=1e-3, abs=1e-6)
        cos = gen.reranker.score(best, captions)
        assert report[str(n)]["contrastive_clip"] == pytest.approx(float(cos.mean()), abs=1e-5)
        assert 0.0 <= report[str(n)]["accuracy"] <= 1.0
    scores = [report[str(n)]["contrastive_clip"] for n in (1, 2, 4)]
    assert scores == sorted(scores)  # the best of more candidates never scores lower
    # Renders against renders is the floor; an untrained generator is far above it.
    want = frechet(ref_features, gen.reranker.embed_images(baseline).double().numpy())
    assert report["reference_fid_clip"] == pytest.approx(want, rel=1e-3, abs=1e-6)
    assert report["reference_fid_clip"] < report["1"]["fid_clip"]


def test_fid_can_be_turned_off(gen: Generator) -> None:
    report = evaluate(gen, n_seen=2, n_zeroshot=0, candidates=[1, 2], seed=1, fid=False, batch_size=8)
    assert "zeroshot" not in report and "fid_clip" not in report["seen"]["2"]
    assert "reference_fid_clip" not in report["seen"]
    assert "contrastive_clip" in report["seen"]["2"]


def test_dalle_eval_writes_json_and_png(work: Path, capsys: pytest.CaptureFixture) -> None:
    from dalle_lightning.cli import evaluate as cli

    run_app(cli.main, f"paths.work_dir={work}", "n_seen=3", "n_zeroshot=3", "candidates=[1,2]", "batch_size=16",
            f"hydra.run.dir={work}/runs/eval")
    report = json.loads((work / "eval.json").read_text())
    for split in ("seen", "zeroshot"):
        assert set(report[split]) >= {"1", "2", "reference_fid_clip", "reference_renders"}
        assert {"accuracy", "fid_clip", "contrastive_clip"} <= set(report[split]["2"])
    printed = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert printed["fid_clip"]["seen"]["2"] == pytest.approx(report["seen"]["2"]["fid_clip"], abs=1e-3)
    with Image.open(work / "eval.png") as png:  # accuracy, then FID, KID and contrastive score in the clip space
        assert png.format == "PNG" and png.size[0] == 4 * png.size[1] * 360 // 280


def _has_colour(image: np.ndarray, xy: tuple[int, int], colour: tuple[int, int, int], radius: int = 2) -> bool:
    x, y = xy
    patch = image[y - radius : y + radius + 1, x - radius : x + radius + 1].reshape(-1, 3)
    return bool((np.abs(patch.astype(int) - colour).sum(axis=1) < 30).any())


def test_chart_puts_each_point_where_its_axes_say(tmp_path: Path) -> None:
    rising = [(1.0, 0.1), (2.0, 0.4), (4.0, 0.5), (32.0, 0.9)]
    falling = [(1.0, 0.8), (2.0, 0.6), (4.0, 0.3), (32.0, 0.2)]
    (ax,) = line_chart([Panel("t", "y", {"rising": rising, "falling": falling}, ylim=(0.0, 1.0))], tmp_path / "c.png")
    image = np.asarray(Image.open(tmp_path / "c.png").convert("RGB"))
    left, top, right, bottom = ax.box
    assert ax.to_pixel(1.0, 0.0) == (left, bottom) and ax.to_pixel(32.0, 1.0) == (right, top)
    # log2 x axis: N = 4 sits 2/5 of the way from N = 1 to N = 32.
    assert ax.to_pixel(4.0, 0.0)[0] == round(left + 0.4 * (right - left))
    for series, colour in ((rising, COLOURS[0]), (falling, COLOURS[1])):
        for x, y in series:
            assert _has_colour(image, ax.to_pixel(x, y), colour), (x, y)


def test_plot_report_skips_missing_metrics_and_rejects_empty_reports(tmp_path: Path) -> None:
    report = {"seen": {"1": {"accuracy": 0.5}, "2": {"accuracy": 0.7}, "reference_renders": 1.0}}
    plot_report(report, tmp_path / "a.png")
    with Image.open(tmp_path / "a.png") as png:
        assert png.size == (360, 280)  # accuracy only: one panel
    with pytest.raises(ValueError, match="no per-N results"):
        plot_report({"candidates": [1]}, tmp_path / "b.png")


def test_any_of_n_is_the_perfect_reranker_accuracy(gen: Generator, monkeypatch: pytest.MonkeyPatch) -> None:
    from dalle_lightning.generation.generate import Generation

    scenes = eval_scenes(4, "val", 4)
    captions = [s.caption for s in scenes]
    renders = images_of(scenes)
    # Candidate 0 is blank, candidate 1 the caption's own render, candidate 2 another caption's render; the scores
    # prefer candidate 2, so a reranker following them is always wrong while a perfect one finds candidate 1.
    candidates = torch.stack([torch.zeros_like(renders), renders, renders.roll(1, dims=0)], dim=1)
    scores = torch.tensor([[0.0, 0.5, 1.0]]).repeat(4, 1)

    def fake_generate(prompts: list[str], num_candidates: int, **_: object) -> Generation:
        assert num_candidates == 3
        return Generation(prompts, candidates, scores, candidates[:, 2])

    monkeypatch.setattr(gen, "generate", fake_generate)
    report = evaluate_split(gen, captions, [1, 2, 3])
    assert [report[str(n)]["any_of_n"] for n in (1, 2, 3)] == [0.0, 1.0, 1.0]
    assert [report[str(n)]["accuracy"] for n in (1, 2, 3)] == [0.0, 1.0, 0.0]


class MirrorDvae(torch.nn.Module):
    """A stand-in dVAE whose reconstruction mirrors the image left to right (one-object captions and above/below
    survive, left/right relations do not) and whose codes are a coarse quantisation of the red channel."""

    image_size, vocab_size = 64, 16

    def reconstruct(self, x: torch.Tensor) -> torch.Tensor:
        return x.flip(-1)

    def get_codebook_indices(self, x: torch.Tensor) -> torch.Tensor:
        return (x[:, 0, ::8, ::8] * 15).round().long()


def test_waterfall_rows_are_what_they_claim(gen: Generator, monkeypatch: pytest.MonkeyPatch) -> None:
    from collections import Counter

    from dalle_lightning.generation.generate import Generation
    from dalle_lightning.world.detect import match

    scenes = eval_scenes(4, "val", 12)
    captions = [s.caption for s in scenes]
    renders = images_of(scenes)
    p = len(scenes)
    # Candidate 0 blank, 1 the caption's render, 2 another caption's: the contrastive scores prefer 2, the prior's 1;
    # standardised and added, 1 wins (-1.22 + 0, 0 + 1.22, 1.22 - 1.22).
    candidates = torch.stack([torch.zeros_like(renders), renders, renders.roll(1, dims=0)], dim=1)
    clip, prior = torch.tensor([[0.0, 0.5, 1.0]]).repeat(p, 1), torch.tensor([[0.0, 3.0, -3.0]]).repeat(p, 1)

    def fake_generate(prompts: list[str], num_candidates: int, **_: object) -> Generation:
        return Generation(prompts, candidates, clip, candidates[:, 2], prior_scores=prior)

    monkeypatch.setattr(gen, "generate", fake_generate)
    monkeypatch.setattr(gen, "dvae", MirrorDvae())
    waterfall = evaluate_split(gen, captions, [1, 3], renders, fid=False)["waterfall"]
    objects = np.array([len(s.objects) for s in scenes])
    assert set(objects) == {1, 2}  # both groups are exercised
    mirrored = np.array([match(image.flip(-1), c).ok for image, c in zip(renders, captions)])
    assert 0 < mirrored.sum() < p  # some reconstructions fail, so the row measures something
    for group, mask in (("all", objects > 0), ("one_object", objects == 1), ("two_objects", objects == 2)):
        rows = waterfall[group]
        assert rows["captions"] == mask.sum()
        assert rows["reconstructions"] == pytest.approx(mirrored[mask].mean(), abs=1e-4)
        assert (rows["renders"], rows["any_of_n"], rows["pick_clip"], rows["pick_prior"], rows["pick_both"]) == (
            1.0, 1.0, 0.0, 1.0, 1.0)
        assert rows["one_sample"] == pytest.approx(1 / 3, abs=1e-4)
    counts = Counter((renders[:, 0, ::8, ::8] * 15).round().long().flatten().tolist())
    freq = np.array(list(counts.values())) / sum(counts.values())
    assert waterfall["codes"]["codes_in_use"] == len(counts) and waterfall["codes"]["vocab_size"] == 16
    assert waterfall["codes"]["codebook_perplexity"] == pytest.approx(2 ** -(freq * np.log2(freq)).sum(), abs=0.01)
    assert waterfall["n"] == 3


def test_waterfall_plot_draws_each_bar_to_its_height(tmp_path: Path) -> None:
    from dalle_lightning.evaluation.plot_waterfall import bar_box, plot_waterfall
    from dalle_lightning.evaluation.waterfall import GROUPS, ROWS

    values = {g: {r: (i + 1) / 8 + k / 40 for i, r in enumerate(ROWS)} for k, g in enumerate(GROUPS)}
    report = {"seen": {"waterfall": {"n": 16, **values, "codes": {}}}}
    report["seen"]["waterfall"]["all"]["captions"] = 10
    plot_waterfall(report, tmp_path / "w.png")
    image = np.asarray(Image.open(tmp_path / "w.png").convert("RGB"))
    for g, group in enumerate(GROUPS):
        for r, row in enumerate(ROWS):
            x0, y0, x1, y1 = bar_box((0, 0), r, len(ROWS), g, values[group][row])
            assert tuple(image[(y0 + y1) // 2, (x0 + x1) // 2]) == COLOURS[g]  # inside the bar
            assert tuple(image[y0 - 3, (x0 + x1) // 2]) != COLOURS[g]  # just above its top
    with pytest.raises(ValueError, match="no waterfall"):
        plot_waterfall({"seen": {"1": {}}}, tmp_path / "x.png")

"""``dalle-eval`` on captioned data that is not the shapes world: img2dataset-like shards of jpg/png + txt.

The pipeline's models are tiny and untrained (what is checked is that each number is what it claims to be, not
that it is good): FID and KID per N equal torchmetrics' own, computed here from the images through the same
feature network; the references compare the val images with as many train images; the contrastive scores are
the mean cosines; every score is named after its feature space; the shapes judge's parts are left out with one
log line; an open_clip model loads from a local weights file; each bad value is one line naming it.
"""

from __future__ import annotations

import io
import json
import tarfile
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from dalle_lightning.artifacts import save_model
from dalle_lightning.evaluation import feature_distances
from dalle_lightning.generation.generate import Generator
from dalle_lightning.generation.rerank import Reranker
from dalle_lightning.models.clip import SHAPES_CLIP
from tests.conftest import run_app
from tests.test_eval_report import CLIP, DVAE, PRIOR
from tests.test_fid import frechet

SIZE = DVAE["image_size"]  # 32: val images are written at the dVAE's size, so reading them changes no pixel
COLOURS = {"red": (220, 30, 30), "green": (30, 180, 60), "blue": (40, 60, 220), "orange": (250, 150, 20),
           "grey": (128, 128, 128), "purple": (140, 40, 160)}
N_VAL = 12
SEED = 1234  # conf/eval.yaml's seed


def picture(i: int) -> tuple[np.ndarray, str]:
    """A structured image and its caption: stripes of one colour on another, in a direction and number."""
    names = list(COLOURS)
    fg, bg = names[i % len(names)], names[(i // len(names) + 1 + i) % len(names)]
    if fg == bg:
        bg = "grey" if fg != "grey" else "red"
    stripes, vertical = 2 + i % 3, i % 2 == 0
    image = np.empty((SIZE, SIZE, 3), np.uint8)
    image[:] = COLOURS[bg]
    band = SIZE // (2 * stripes)
    for k in range(stripes):
        if vertical:
            image[:, 2 * k * band : (2 * k + 1) * band] = COLOURS[fg]
        else:
            image[2 * k * band : (2 * k + 1) * band] = COLOURS[fg]
    caption = f"{stripes} {'vertical' if vertical else 'horizontal'} {fg} stripes on {bg}, picture {i}"
    return image, caption


def encoded(image: np.ndarray, fmt: str) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(image).save(buf, format=fmt, **({"quality": 95} if fmt == "JPEG" else {}))
    return buf.getvalue()


def write_shard(path: Path, samples: list[tuple[str, dict[str, bytes]]]) -> None:
    """A WebDataset shard as img2dataset writes one: ``<key>.<ext>`` members, a sample's members adjacent."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(path, "w") as tar:
        for key, members in samples:
            for ext, data in members.items():
                info = tarfile.TarInfo(f"{key}.{ext}")
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))


def captioned(first: int, n: int, fmt: str) -> list[tuple[str, dict[str, bytes]]]:
    """Samples ``first`` .. ``first + n``, with img2dataset's per-sample json (which is not a shapes scene)."""
    out = []
    for i in range(first, first + n):
        image, caption = picture(i)
        meta = {"key": f"{i:09d}", "caption": caption, "status": "success", "width": SIZE, "height": SIZE}
        out.append((f"{i:09d}", {"jpg" if fmt == "JPEG" else "png": encoded(image, fmt), "txt": caption.encode(),
                                 "json": json.dumps(meta).encode()}))
    return out


def decoded(first: int, n: int, fmt: str) -> torch.Tensor:
    """The images of ``captioned(first, n, fmt)`` decoded here with PIL alone: ``[n, 3, S, S]`` in [0, 1]."""
    arrays = [np.asarray(Image.open(io.BytesIO(encoded(picture(i)[0], fmt))).convert("RGB"))
              for i in range(first, first + n)]
    return torch.from_numpy(np.stack(arrays)).permute(0, 3, 1, 2).float() / 255


@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A captioned world (train: 2 jpg shards; val: 1 png shard) and a tiny untrained pipeline saved as artifacts,
    with an open_clip checkpoint of random weights beside them."""
    from hydra.utils import instantiate

    from dalle_lightning.data.tokenizer import CaptionTokenizer
    from dalle_lightning.models import clip as clip_models

    work = tmp_path_factory.mktemp("any_data")
    write_shard(work / "world" / "train" / "00000.tar", captioned(100, 16, "JPEG"))
    write_shard(work / "world" / "train" / "00001.tar", captioned(116, 16, "JPEG"))
    write_shard(work / "world" / "val" / "00000.tar", captioned(0, N_VAL, "PNG"))
    tok = CaptionTokenizer.train([picture(i)[1] for i in range(200)], vocab_size=300, text_len=PRIOR["text_len"])
    tok.save(work / "tokenizer.json")
    torch.manual_seed(0)
    prior_cfg = {**PRIOR, "text_vocab_size": tok.vocab_size}
    save_model(work / "prior.pt", prior_cfg, instantiate(prior_cfg), meta={"stage": "prior"})
    save_model(work / "dvae.pt", DVAE, instantiate(DVAE), meta={"stage": "dvae", "image_size": SIZE})
    save_model(work / "clip.pt", CLIP, instantiate(CLIP), meta={"stage": "clip"})
    torch.save(clip_models.create(SHAPES_CLIP).state_dict(), work / "open_clip.pt")  # another random init
    return work


def run_eval(work: Path, *overrides: str) -> dict:
    from dalle_lightning.cli import evaluate

    run_app(evaluate.main, f"paths.work_dir={work}", f"hydra.run.dir={work}/runs/eval", f"n_val={N_VAL}",
            "candidates=[1,2]", "batch_size=24", *overrides)
    return json.loads((work / "eval.json").read_text())


def log_lines(work: Path) -> list[str]:
    return [line for path in (work / "runs" / "eval").glob("*.log") for line in path.read_text().splitlines()]


class InDouble(torch.nn.Module):
    """A feature network's output in float64: KID of near-identical features cancels too much in float32."""

    def __init__(self, net: torch.nn.Module) -> None:
        super().__init__()
        self.net = net

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.net(images).double()


def test_eval_on_captioned_data_gives_named_scores_beside_references(work: Path,
                                                                      capsys: pytest.CaptureFixture) -> None:
    open_clip = f"open_clip={{model: {SHAPES_CLIP}, pretrained: {work / 'open_clip.pt'}}}"
    report = run_eval(work, open_clip)
    printed = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    spaces = ("clip", "openclip_shapes_clip")
    assert report["captions"] == "val" and printed["captions"] == "val" and report["spaces"] == list(spaces)
    assert "seen" not in report and "zeroshot" not in report and "waterfall" not in report["val"]
    names = {f"{score}_{space}" for score in ("fid", "kid", "contrastive") for space in spaces}
    for n in ("1", "2"):
        assert set(report["val"][n]) == names  # no accuracy, no any_of_n: these captions have no judge
    assert {f"reference_{name}" for name in names} | {f"spread_{space}" for space in spaces} <= set(report["val"])
    assert report["val"]["images"] == N_VAL and report["val"]["reference_images"] == N_VAL
    assert printed["fid_clip"]["val"]["2"] == pytest.approx(report["val"]["2"]["fid_clip"], abs=1e-3)
    assert printed["reference"]["val"]["reference_fid_clip"] == pytest.approx(report["val"]["reference_fid_clip"],
                                                                              abs=1e-3)
    left_out = [line for line in log_lines(work) if "left out" in line]
    assert len(left_out) == 1 and "not the shapes world" in left_out[0], left_out
    assert not (work / "eval_waterfall.png").exists()
    with Image.open(work / "eval.png") as png:  # FID, KID and contrastive score in two spaces
        assert png.size == (6 * 360, 280)

    # Independently: the same draws (generation is seeded), and torchmetrics' FID and KID computing the features
    # from the images themselves; the real images decoded here with PIL.
    from torchmetrics.image.kid import KernelInceptionDistance

    from dalle_lightning_callbacks.fid import build_fid, feature_module

    gen = Generator.from_files(work / "prior.pt", work / "dvae.pt", work / "tokenizer.json", work / "clip.pt")
    captions = [picture(i)[1] for i in range(N_VAL)]
    result = gen.generate(captions, num_candidates=2, seed=SEED, batch_size=24, cond_scale=2.5)
    val, train = decoded(0, N_VAL, "PNG"), decoded(100, N_VAL, "JPEG")
    judges = {"clip": gen.reranker, "openclip_shapes_clip": Reranker.from_pretrained(SHAPES_CLIP, work / "open_clip.pt")}
    for space, judge in judges.items():
        for n in (1, 2):
            kept, entry = result.best_of(n), report["val"][str(n)]
            fid = build_fid(judge)
            fid.update(val, real=True)
            fid.update(kept, real=False)
            assert entry[f"fid_{space}"] == pytest.approx(float(fid.compute()), rel=1e-3, abs=1e-9)
            assert entry[f"fid_{space}"] == pytest.approx(
                frechet(judge.embed_images(val).double().numpy(), judge.embed_images(kept).double().numpy()),
                rel=1e-3, abs=1e-9)
            kid = KernelInceptionDistance(feature=InDouble(feature_module(judge)), subsets=1, subset_size=N_VAL,
                                          normalize=True)
            kid.update(val, real=True)
            kid.update(kept, real=False)
            assert entry[f"kid_{space}"] == pytest.approx(float(kid.compute()[0]), rel=1e-3, abs=1e-9)
            assert entry[f"contrastive_{space}"] == pytest.approx(float(judge.score(kept, captions).mean()), abs=1e-5)
        reference = build_fid(judge)
        reference.update(val, real=True)
        reference.update(train, real=False)
        assert report["val"][f"reference_fid_{space}"] == pytest.approx(float(reference.compute()), rel=1e-3, abs=1e-9)
        assert report["val"][f"reference_contrastive_{space}"] == pytest.approx(
            float(judge.score(val, captions).mean()), abs=1e-5)
    # The best of 2 by the project's CLIP never scores lower than one sample under it.
    assert report["val"]["2"]["contrastive_clip"] >= report["val"]["1"]["contrastive_clip"] - 1e-6


def test_distances_of_a_set_to_itself_are_zero_and_match_torchmetrics() -> None:
    from torchmetrics.image.kid import KernelInceptionDistance

    from dalle_lightning_callbacks.fid import Precomputed

    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(40, 8, generator=g), torch.randn(40, 8, generator=g) * 1.5 + 0.5
    assert feature_distances.fid(a, a) == pytest.approx(0.0, abs=1e-6)
    # KID is unbiased: about 0 for two samples of one distribution (either sign), far above it for two distributions.
    same = torch.randn(40, 8, generator=g)
    assert abs(feature_distances.kid(a, same)) < feature_distances.kid(a, b) / 20
    assert feature_distances.fid(a, b) == pytest.approx(frechet(a.double().numpy(), b.double().numpy()), rel=1e-5)
    kid = KernelInceptionDistance(feature=Precomputed(8), subsets=1, subset_size=40)
    kid.update(a, real=True)
    kid.update(b, real=False)
    assert feature_distances.kid(a, b) == pytest.approx(float(kid.compute()[0]), rel=1e-6)
    assert feature_distances.kid(b, a) > 0.01
    # The subset fits the sample: the whole sample when smaller than 1000, else the KID paper's 100 x 1000.
    assert feature_distances.kid_subsets(40, 60) == (40, 1) and feature_distances.kid_subsets(5000, 3000) == (1000, 100)
    unit = torch.nn.functional.normalize(a, dim=1)
    # unit-norm features: the total variance is 1 - |mean|^2 (times n / (n - 1), unbiased)
    assert feature_distances.spread(unit) == pytest.approx((1 - float(unit.mean(0).norm() ** 2)) * 40 / 39, rel=1e-4)


def test_shapes_world_is_recognised_by_its_marker_or_scenes_and_nothing_else(tmp_path: Path) -> None:
    from dalle_lightning.data.splits import Split
    from dalle_lightning.evaluation.captioned_data import shapes_world
    from dalle_lightning.outputs import write_marker
    from dalle_lightning.world import sample_scene
    from dalle_lightning.world.scene import split_rng

    def split(folder: Path) -> Split:
        return Split("data.val_shards", str(folder), sorted(str(p) for p in folder.glob("*.tar")))

    write_shard(tmp_path / "own" / "00000.tar", captioned(0, 2, "JPEG"))
    assert shapes_world(split(tmp_path / "own")) is False  # img2dataset's json is no scene
    scene = sample_scene(split_rng(0, "val", stream=0), "val")
    write_shard(tmp_path / "copy" / "000000.tar", [("000000", {"png": encoded(picture(0)[0], "PNG"),
                                                               "txt": b"x", "json": json.dumps(scene.to_json()).encode()})])
    assert shapes_world(split(tmp_path / "copy")) is True  # shapes shards copied without their marker
    write_shard(tmp_path / "marked" / "00000.tar", captioned(0, 2, "JPEG"))
    write_marker(tmp_path / "marked", "images", split="val", samples=2, seed=0, image_size=64)
    assert shapes_world(split(tmp_path / "marked")) is True


def test_val_held_out_of_a_one_folder_download(work: Path, tmp_path: Path) -> None:
    """No train/ and val/ folders: validation is the slice of the last shard that training holds out (as training
    does), and the references read training's side of it."""
    from dalle_lightning.data.splits import resolve_splits
    from dalle_lightning.evaluation.captioned_data import read_captioned

    world = tmp_path / "download"
    write_shard(world / "00000.tar", captioned(100, 16, "JPEG"))
    write_shard(world / "00001.tar", captioned(200, 40, "PNG"))
    train, val = resolve_splits(str(world), "auto", "auto", 0.3, prefix="data.", announce=False)
    _, held_captions, _ = read_captioned(val, 100, SIZE)
    _, train_captions, _ = read_captioned(train, 100, SIZE)
    assert 2 <= len(held_captions) < 40 and not set(held_captions) & set(train_captions[16:])
    report = run_eval(work, f"paths.world={world}", "data.val_holdout=0.3", "fid=true", "plot=null")
    assert report["captions"] == "val" and report["val"]["images"] == min(N_VAL, len(held_captions))
    assert "auto" in report["data"]["val"] and report["val"]["reference_fid_clip"] >= 0


@pytest.mark.parametrize("override,expected", [
    ("clip={work}/nope.pt", "clip='{work}/nope.pt' does not exist; expected a trained CLIP file: train it "
                            "(dalle-train stage=clip), or set clip=null"),
    ("open_clip={{model: ViT-B-32}}", "open_clip={{'model': 'ViT-B-32'}}; expected null or {{model: ViT-B-32, "
                                      "pretrained: /path/to/weights.pt}}"),
    ("open_clip={{model: no-such-net, pretrained: {work}/open_clip.pt}}", "open_clip.model='no-such-net'; expected "
                                                                          "an open_clip architecture name"),
    ("open_clip={{model: ViT-B-32, pretrained: openai}}", "open_clip.pretrained='openai'; expected an existing local "
                                                          "weights file for ViT-B-32 (pretrained tags"),
    ("open_clip={{model: RN50, pretrained: {work}/open_clip.pt}}", "open_clip.pretrained='{work}/open_clip.pt' could "
                                                                   "not be loaded as RN50 weights"),
    ("data.image_size=48", "data.image_size=48; expected null or the dVAE's image_size 32"),
    ("n_val=1", "n_val=1; expected an integer >= 2"),
    ("captions=everything", "captions='everything'; expected one of auto|shapes|val"),
    ("data.val_shards={work}/missing", "data.val_shards='{work}/missing'"),
    ("clip=null|fid=true", "fid=true with clip=null and open_clip=null; expected a feature space"),
])
def test_bad_values_are_one_line_errors(work: Path, capsys: pytest.CaptureFixture, override: str,
                                        expected: str) -> None:
    with pytest.raises(SystemExit) as exit_info:
        run_eval(work, *override.format(work=work).split("|"), f"out={work}/bad.json")
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert exit_info.value.code == 2 and len(errors) == 1, errors
    assert expected.format(work=work) in errors[0], errors[0]
    assert not (work / "bad.json").exists()


def test_open_clip_weights_load_from_a_local_file(work: Path) -> None:
    from dalle_lightning.evaluation.feature_spaces import feature_spaces, open_clip_space_name
    from dalle_lightning.models import clip as clip_models

    torch.manual_seed(7)
    original = clip_models.create(SHAPES_CLIP)
    torch.save(original.state_dict(), work / "seven.pt")
    spaces = feature_spaces(None, (SHAPES_CLIP, str(work / "seven.pt")))
    assert list(spaces) == ["openclip_shapes_clip"] and open_clip_space_name("ViT-B-32") == "openclip_vit_b_32"
    images = decoded(0, 4, "PNG")
    torch.testing.assert_close(spaces["openclip_shapes_clip"].embed_images(images),
                               Reranker.from_model(original).embed_images(images))

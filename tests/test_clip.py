"""The open_clip reranker: building by name, saving/loading, and a short training run on the shapes world.

References are independent of the code under test: parameter counts published for open_clip's RN50 and
ViT-B-32, open_clip's own ``encode_image``/``encode_text`` for scores, and the world's own scene attributes
for which caption is the true one.
"""

from __future__ import annotations

import dataclasses
import functools
import re

import lightning as L
import numpy as np
import pytest
import torch

from dalle_lightning.lit.clip import ClipModule
from dalle_lightning.models import clip as clip_models
from dalle_lightning.generation.rerank import Reranker
from dalle_lightning.world.render import render
from dalle_lightning_plugins.protocol import find_resblocks
from dalle_lightning.world.scene import COLOURS, SHAPES, ObjectSpec, Scene, sample_scenes

TRAIN_STEPS = 150
BATCH = 64


def images_of(scenes: list[Scene]) -> torch.Tensor:
    return torch.from_numpy(np.stack([render(s) for s in scenes])).permute(0, 3, 1, 2).float() / 255


def collate(items: list[tuple[torch.Tensor, str]]) -> dict:
    return {"image": torch.stack([i for i, _ in items]), "text": [t for _, t in items]}


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> tuple[Reranker, str]:
    """shapes-clip trained for TRAIN_STEPS steps through Lightning, then reloaded from its checkpoint."""
    torch.manual_seed(0)
    scenes = sample_scenes(seed=0, split="train", n=6000)
    images = images_of(scenes)
    data = list(zip(images, [s.caption for s in scenes]))
    loader = torch.utils.data.DataLoader(data, batch_size=BATCH, shuffle=True, drop_last=True, collate_fn=collate)
    module = ClipModule(
        clip_models.create(),
        optimizer=functools.partial(torch.optim.AdamW, lr=2e-3, weight_decay=0.1),
        scheduler=functools.partial(torch.optim.lr_scheduler.OneCycleLR, max_lr=2e-3, total_steps=TRAIN_STEPS, pct_start=0.1),
    )
    trainer = L.Trainer(
        max_steps=TRAIN_STEPS, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False,
    )
    trainer.fit(module, loader)
    path = tmp_path_factory.mktemp("clip") / "clip.ckpt"
    trainer.save_checkpoint(path)
    return Reranker.from_checkpoint(path), str(path)


def core(objects: tuple[ObjectSpec, ...], relation: str | None) -> str:
    """The caption without its template: ``<object>`` or ``<object> <relation> <object>``."""
    return objects[0].phrase() if relation is None else f"{objects[0].phrase()} {relation} {objects[1].phrase()}"


def with_swapped(scene: Scene, attribute: str, vocabulary: list[str], rng: np.random.Generator) -> str:
    """The scene's caption with its first object's ``attribute`` changed to a value the image does not show."""
    absent = [v for v in vocabulary if v not in {getattr(o, attribute) for o in scene.objects}]
    objects = list(scene.objects)
    objects[0] = dataclasses.replace(objects[0], **{attribute: absent[int(rng.integers(len(absent)))]})
    return scene.caption.replace(core(scene.objects, scene.relation), core(tuple(objects), scene.relation))


@pytest.mark.slow
@pytest.mark.parametrize(("attribute", "vocabulary"), [("colour", list(COLOURS)), ("shape", list(SHAPES))])
def test_true_caption_beats_swapped_attribute(trained: tuple[Reranker, str], attribute: str, vocabulary: list[str]) -> None:
    reranker, _ = trained
    scenes = sample_scenes(seed=1, split="val", n=300)  # scenes never seen in training
    rng = np.random.default_rng(0)
    true = reranker.score(images_of(scenes), [s.caption for s in scenes])
    false = reranker.score(images_of(scenes), [with_swapped(s, attribute, vocabulary, rng) for s in scenes])
    assert (true > false).float().mean().item() >= 0.8


@pytest.mark.slow
def test_best_of_finds_the_matching_image_among_distractors(trained: tuple[Reranker, str]) -> None:
    reranker, _ = trained
    rng = np.random.default_rng(1)
    pool = [s for s in sample_scenes(seed=2, split="val", n=400) if len(s.objects) == 1]
    hits = 0
    for trial in range(20):
        target = pool[trial]
        key = (target.objects[0].colour, target.objects[0].shape)
        distractors = [s for s in pool if (s.objects[0].colour, s.objects[0].shape) != key]
        picks = [distractors[i] for i in rng.choice(len(distractors), size=7, replace=False)]
        position = int(rng.integers(8))
        candidates = picks[:position] + [target] + picks[position:]
        index, scores = reranker.best_of(images_of(candidates), target.caption)
        assert scores.shape == (8,)
        hits += index == position
    assert hits >= 17


@pytest.mark.slow
def test_rerank_matches_open_clip_cosine_and_best_of(trained: tuple[Reranker, str]) -> None:
    reranker, _ = trained
    scenes = sample_scenes(seed=3, split="val", n=12)
    candidates = images_of(scenes).view(3, 4, 3, 64, 64)
    captions = [scenes[0].caption, scenes[5].caption, scenes[10].caption]
    best, scores = reranker.rerank(candidates, captions)

    model = reranker.model
    mean = torch.tensor(model.open_clip_spec["preprocess_cfg"]["mean"]).view(1, 3, 1, 1)
    std = torch.tensor(model.open_clip_spec["preprocess_cfg"]["std"]).view(1, 3, 1, 1)
    tokenizer = clip_models.open_clip.get_tokenizer(model.open_clip_spec["name"])
    with torch.no_grad():
        image_features = model.encode_image((candidates.flatten(0, 1) - mean) / std, normalize=True).view(3, 4, -1)
        text_features = model.encode_text(tokenizer(captions), normalize=True)
    expected = torch.einsum("pnd,pd->pn", image_features, text_features)
    torch.testing.assert_close(scores, expected, atol=1e-5, rtol=1e-5)
    for p in range(3):
        index, single = reranker.best_of(candidates[p], captions[p])
        torch.testing.assert_close(single, scores[p], atol=1e-5, rtol=1e-5)
        assert torch.equal(best[p], candidates[p, index])
    # Images at another resolution are resized to the model's 64x64 input: a 2x nearest upsample scores the same.
    big = candidates[0].repeat_interleave(2, dim=-1).repeat_interleave(2, dim=-2)
    torch.testing.assert_close(reranker.score(big, [captions[0]] * 4), scores[0], atol=1e-5, rtol=1e-5)


def test_standard_architectures_build_by_name_on_meta() -> None:
    # Published open_clip parameter counts (model_profile): RN50 102.01M, ViT-B-32 151.28M.
    for name, count in [("RN50", 102_007_137), ("ViT-B-32", 151_277_313)]:
        model = clip_models.create(name, device="meta")
        assert isinstance(model, clip_models.open_clip.model.CLIP)
        assert sum(p.numel() for p in model.parameters()) == count
        assert next(model.parameters()).is_meta


def test_missing_pretrained_file_is_a_clear_error(tmp_path) -> None:
    missing = tmp_path / "nowhere" / "weights.pt"
    with pytest.raises(FileNotFoundError, match=re.escape(str(missing))) as info:
        clip_models.create("RN50", pretrained=missing)
    assert "\n" not in str(info.value)
    with pytest.raises(FileNotFoundError, match="openai"):
        clip_models.create("ViT-B-32", pretrained="openai")  # a tag: never downloaded


def test_default_is_a_real_open_clip_model_saved_and_loaded_by_name(tmp_path) -> None:
    torch.manual_seed(0)
    model = clip_models.create()
    assert isinstance(model, clip_models.open_clip.model.CLIP)
    assert clip_models.SHAPES_CLIP in clip_models.open_clip.list_models()
    assert clip_models.image_size(model) == (64, 64)
    tokens = clip_models.tokenizer_for(model)(["a small red circle above a large blue square"])
    assert tokens.shape == (1, 32) and tokens[0, 0] != 0  # open_clip's bundled BPE, context length 32

    # Weights from a local file, and the local-dir layout open_clip itself reads.
    weights = tmp_path / "w.pt"
    torch.save(model.state_dict(), weights)
    loaded = clip_models.create(clip_models.SHAPES_CLIP, pretrained=weights)
    clip_models.save(model, tmp_path / "dir")
    native = clip_models.open_clip.create_model(f"local-dir:{tmp_path / 'dir'}")
    from_dir = Reranker.from_checkpoint(tmp_path / "dir").model
    for other in (loaded, native, from_dir):
        for (k, v), (k2, v2) in zip(model.state_dict().items(), other.state_dict().items()):
            assert k == k2 and torch.equal(v, v2)


def test_resblocks_and_bad_inputs() -> None:
    reranker = Reranker.from_model(clip_models.create())
    images = torch.rand(2, 3, 64, 64)
    with pytest.raises(ValueError, match="one caption per image"):
        reranker.score(images, ["a red square"])
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        reranker.score(images * 255, ["a red square", "a blue circle"])
    with pytest.raises(ValueError, match=r"\[P prompts, N candidates"):
        reranker.rerank(images, ["a red square"])
    with pytest.raises(ValueError, match="one caption per prompt"):
        reranker.rerank(images[None], ["a red square", "a blue circle"])
    with pytest.raises(FileNotFoundError, match="missing.ckpt"):
        Reranker.from_checkpoint("missing.ckpt")
    module = ClipModule(clip_models.create(), optimizer=torch.optim.AdamW)
    names = [name for name, _ in find_resblocks(module)]
    assert names == [f"model.visual.layer{i}.0" for i in range(1, 5)] + ["model.transformer.resblocks.0", "model.transformer.resblocks.1"]
    with pytest.raises(ValueError, match="open_clip_spec"):
        ClipModule(clip_models.open_clip.model.CLIP(**clip_models.SHAPES_CLIP_CONFIG), optimizer=torch.optim.AdamW)


def test_clip_module_sees_a_share_of_each_batch_as_dvae_reconstructions() -> None:
    from dalle_lightning.models.dvae import DiscreteVAE

    torch.manual_seed(0)
    dvae = DiscreteVAE(image_size=64, vocab_size=16, n_hid=8, n_blk_per_group=1, codebook_dim=8)
    images = images_of(sample_scenes(0, "train", 4))
    module = ClipModule(clip_models.create(), optimizer=torch.optim.AdamW, dvae=dvae, recon_share=0.5)
    mixed = module.with_reconstructions(images)
    # The first half is what the dVAE's argmax codes decode to (the generator's images); the rest is untouched.
    torch.testing.assert_close(mixed[:2], dvae.reconstruct(images[:2]).float().clamp(0, 1))
    torch.testing.assert_close(mixed[2:], images[2:])
    assert not torch.allclose(mixed[:2], images[:2])
    # The frozen dVAE is neither trained nor saved with the CLIP.
    assert not any(name.startswith("_dvae") for name in module.state_dict())
    assert all(p is not q for p in module.parameters() for q in dvae.parameters())
    plain = ClipModule(clip_models.create(), optimizer=torch.optim.AdamW)
    assert plain.with_reconstructions(images) is images
    with pytest.raises(ValueError, match="recon_share=1.5"):
        ClipModule(clip_models.create(), optimizer=torch.optim.AdamW, dvae=dvae, recon_share=1.5)


def test_hard_negative_loss_is_cross_entropy_over_captions_and_their_negatives() -> None:
    torch.manual_seed(0)
    scenes = sample_scenes(0, "train", 6)
    captions = [s.caption for s in scenes]
    negative = {c: f"a white circle to the left of a white {'square' if 'square' not in c else 'triangle'}" for c in captions}
    module = ClipModule(clip_models.create(), optimizer=torch.optim.AdamW, negatives=negative.__getitem__, negative_weight=0.5)
    images = images_of(scenes)
    image_features, text_features, scale = module(images, captions)
    loss, above = module.hard_negative_loss(image_features, text_features, captions, scale)
    # Reference: open_clip's own text tower on the caption list and on the negatives, one logit row per image.
    tok = clip_models.tokenizer_for(module.model)
    texts = module.model.encode_text(tok(captions + [negative[c] for c in captions]), normalize=True)
    full = scale * image_features @ texts.T  # [6, 12]: captions, then negatives
    logits = torch.cat([full[:, :6], full[torch.arange(6), torch.arange(6, 12)][:, None]], dim=1)  # own negative only
    torch.testing.assert_close(loss, torch.nn.functional.cross_entropy(logits, torch.arange(6)))
    expected_above = (full.diagonal() > full[torch.arange(6), torch.arange(6, 12)]).float().mean()
    torch.testing.assert_close(above, expected_above)
    with pytest.raises(ValueError, match="negative_weight=-1"):
        ClipModule(clip_models.create(), optimizer=torch.optim.AdamW, negative_weight=-1)

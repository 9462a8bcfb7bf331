"""A small download in img2dataset's output layout, of real photographs, for the README's own-data test.

    from tests.helpers.img2dataset_download import build_download

    download = build_download(tmp_path / "laion", layout="split")  # train/ and val/ folders
    download = build_download(tmp_path / "laion", layout="flat")   # the shards directly in one folder, no val

What img2dataset writes (``output_format=webdataset``): shards ``00000.tar``, ``00001.tar``, ... whose members are
``<key>.jpg`` (or png, webp), ``<key>.txt`` (the caption) and ``<key>.json`` (the sample's metadata: url, caption,
key, status, width, height, original size, exif, sha256), and beside each shard ``00000_stats.json`` (the shard's
counts) and ``00000.parquet`` (the same metadata as a table; a placeholder file when pyarrow is not installed: a
loader must ignore it either way). Keys are the shard number (5 digits) then the sample's number in its shard
(4 digits): ``000010012`` is sample 12 of shard 1. The split layout is one download whose last shard was moved
into ``val/``, the others into ``train/``, so keys are unique over both.

The pictures are those scikit-image ships inside its wheel (``skimage.data``; none is downloaded), cropped, flipped
and resized to 48-96 pixels a side (square and not), each with captions from a few templates, some of them 40-70
words long (more than 20 tokens for any BPE trained on them). Formats: RGB JPEG, greyscale JPEG, RGBA PNG, LA PNG,
RGB PNG, WebP with and without alpha, one CMYK JPEG, one JPEG stored turned with EXIF orientation 6 (a viewer turns
it 90 degrees clockwise), one JPEG cut to half its bytes and one sample without a caption (no ``.txt``), both of
these in the first shard.
"""

from __future__ import annotations

import hashlib
import io
import json
import random
import tarfile
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from PIL import Image

SHARD_SIZE = 32  # samples per shard (img2dataset's default is 10,000; small here so that there are several)
EXIF_ORIENTATION = 0x0112

# Kinds of sample, by how the image is stored (``Download.counts``).
KINDS = ("jpeg", "grey_jpeg", "png", "rgba_png", "la_png", "webp", "webp_alpha", "cmyk_jpeg", "exif_jpeg",
         "truncated_jpeg")
# The ordinary kinds cycle over the samples; the four specials occur once each.
CYCLE = ("jpeg", "webp", "rgba_png", "jpeg", "webp_alpha", "la_png", "jpeg", "png", "webp", "jpeg")
EXTENSION = {"jpeg": "jpg", "grey_jpeg": "jpg", "png": "png", "rgba_png": "png", "la_png": "png", "webp": "webp",
             "webp_alpha": "webp", "cmyk_jpeg": "jpg", "exif_jpeg": "jpg", "truncated_jpeg": "jpg"}


@dataclass(frozen=True)
class Picture:
    """One ``skimage.data`` picture and what its captions say."""

    name: str       # the skimage.data function
    subject: str    # a short noun phrase: "a ginger tabby cat"
    details: tuple[str, ...]  # clauses that extend it: "lying on a wooden chair"
    long: str       # a description of 40-70 words


PICTURES = (
    Picture("astronaut", "an astronaut in a white spacesuit",
            ("smiling in front of an american flag", "holding a helmet in her arms", "in an official portrait"),
            "An official portrait of a smiling astronaut with short dark hair, wearing a white spacesuit covered in "
            "mission patches, holding a helmet beside her while an american flag and a model of a space shuttle "
            "fill the background, lit evenly like a studio photograph taken for a space agency press release"),
    Picture("camera", "a man with a camera on a tripod",
            ("in a black and white photograph", "standing on a lawn", "looking through the viewfinder"),
            "A classic black and white photograph of a man in a dark coat standing on a grassy field, bending over "
            "an old camera mounted on a tall tripod, with a few low buildings and a pale empty sky behind him, a "
            "picture often used to test image processing programs for many years"),
    Picture("coffee", "a cup of coffee on a saucer",
            ("seen from above", "with a pattern of milk foam", "on a wooden table"),
            "A white porcelain cup filled with coffee and a pattern of milk foam, standing on a matching saucer with "
            "a small spoon beside it, photographed from above on a warm brown table, the kind of cosy picture a "
            "cafe might print on its menu next to the list of hot drinks"),
    Picture("chelsea", "a ginger tabby cat",
            ("looking at the camera", "with green eyes", "resting on a rug"),
            "A close photograph of a ginger tabby cat with striped fur and long white whiskers, its head turned "
            "slightly toward the camera and its eyes half closed, resting calmly on a soft surface in warm indoor "
            "light, with the background out of focus so that the cat's face and ears stand out clearly"),
    Picture("coins", "old coins on a dark cloth",
            ("in rows", "in a greyscale photograph", "from a museum collection"),
            "A greyscale photograph of two dozen small old coins laid out in neat rows on a dark cloth, each coin "
            "showing a worn portrait or symbol stamped into the metal, lit from one side so that the raised edges "
            "shine brightly against the shadows of the background"),
    Picture("horse", "a black silhouette of a horse",
            ("on a white background", "trotting to the left", "cut out like a stencil"),
            "A solid black silhouette of a horse in mid stride, its legs lifted as it trots and its tail flowing "
            "behind it, drawn against a plain white background with no other detail, like a shape cut from black "
            "paper for a children's craft project or a road sign near a riding school"),
    Picture("rocket", "a rocket on its launch pad",
            ("under a clear blue sky", "before lift off", "beside its support tower"),
            "A tall white rocket standing upright on its launch pad beside a steel support tower, photographed on a "
            "bright day under a clear blue sky, with cables and service structures around its base and a few clouds "
            "near the horizon, hours before the engines ignite and carry it into orbit"),
    Picture("page", "a scanned page of printed text",
            ("with uneven lighting", "in greyscale", "from an old book"),
            "A greyscale scan of a page from an old printed book, with several paragraphs of small dark letters in "
            "straight lines, the paper slightly uneven and darker toward one corner where the light fell poorly, the "
            "kind of image a program reading printed characters must clean up first"),
    Picture("text", "printed letters on a pale background",
            ("in several sizes", "in greyscale", "photographed at an angle"),
            "A greyscale photograph of printed letters and words in several sizes on a pale surface, some sharp and "
            "some slightly blurred, with a gentle shadow across part of the picture, used to test how well a program "
            "can separate dark text from a background whose brightness changes from place to place"),
    Picture("moon", "the surface of the moon",
            ("covered in craters", "in greyscale", "seen through a telescope"),
            "A greyscale picture of the surface of the moon seen through a telescope, covered with round craters of "
            "every size, smooth dark plains and bright rough highlands, the contrast low so that the shapes appear "
            "soft and grey, as an astronomer might see them on a hazy night"),
    Picture("immunohistochemistry", "a microscope image of stained tissue",
            ("in brown and blue", "with many small cells", "from a pathology lab"),
            "A microscope image of a thin slice of human tissue stained for a laboratory test, with many small cell "
            "nuclei coloured blue and patches of brown stain marking the protein the doctors were looking for, all "
            "on a pale background, as seen through the eyepiece in a pathology lab"),
    Picture("hubble_deep_field", "galaxies in the dark night sky",
            ("seen by a space telescope", "of many colours", "far away from earth"),
            "A deep field image taken by a space telescope, showing hundreds of distant galaxies scattered across a "
            "black sky, some spiral, some elliptical, in shades of white, orange and blue, each a tiny smudge of "
            "light that left its stars billions of years ago, with a few bright foreground stars among them"),
    Picture("clock", "a clock on a wall",
            ("in greyscale", "with hands near ten past", "seen from the side"),
            "A greyscale photograph of a round clock with black numbers and two hands, hanging on a plain wall and "
            "seen slightly from the side, so that its face appears as an oval, with soft shadows beneath the rim and "
            "a smooth gradient of light across the wall around it"),
    Picture("logo", "the scikit-image logo",
            ("with a snake", "on a transparent background", "in blue and orange"),
            "The logo of the scikit-image software library, a stylised snake curled around colourful shapes and "
            "letters, drawn with clean flat colours on a transparent background, the kind of emblem printed on the "
            "front page of a project's documentation and on stickers handed out at programming conferences"),
    Picture("colorwheel", "a colour wheel",
            ("with every hue of the rainbow", "fading to white in the middle", "on a black background"),
            "A circular colour wheel in which the hues of the rainbow run smoothly around the edge from red to "
            "yellow, green, cyan, blue, magenta and back to red, fading to white toward the centre, drawn on a dark "
            "background and used by designers to pick colours that go well together"),
    Picture("stereo_motorcycle", "a motorcycle in a workshop",
            ("parked on a stand", "beside a toolbox", "with shiny chrome parts"),
            "A red motorcycle parked on its stand in a cluttered workshop, its chrome exhaust and engine gleaming "
            "under the lamps, surrounded by toolboxes, shelves of spare parts and a workbench covered with wrenches, "
            "photographed from the side so that both wheels and the long seat can be seen"),
)

SHORT_TEMPLATES = (
    "{subject}",
    "a photo of {subject}",
    "{subject} {detail}",
    "a small picture of {subject}, {detail}",
    "a close-up crop of {subject}",
    "an image showing {subject} {detail}.",
)
VARIANTS = 8  # samples per picture: 16 pictures -> 128 samples


@dataclass(frozen=True)
class Download:
    """What ``build_download`` wrote."""

    root: Path                          # the download's folder: ``paths.world``
    layout: str                         # "split" (train/ and val/ in root) or "flat" (shards in root)
    shards: dict[str, tuple[Path, ...]]  # "train" and "val" (split), or "" (flat) -> the shards
    captions: dict[str, str]            # key -> caption, every sample that has a .txt (the truncated JPEG's too)
    kinds: dict[str, str]               # key -> its kind (KINDS)
    splits: dict[str, str]              # key -> "train", "val" or "" (flat)
    truncated_key: str                  # the JPEG cut in half
    uncaptioned_key: str                # the sample without a .txt
    cmyk_key: str
    exif_key: str
    counts: dict[str, int] = field(default_factory=dict)  # kind -> samples of that kind

    @property
    def n_samples(self) -> int:
        return len(self.kinds)

    @property
    def usable_keys(self) -> set[str]:
        """Samples a loader must decode and keep: all but the truncated JPEG and the uncaptioned one."""
        return set(self.kinds) - {self.truncated_key, self.uncaptioned_key}

    def urls(self) -> list[Path]:
        return [p for group in self.shards.values() for p in group]


def _load(name: str) -> Image.Image:
    import skimage.data

    arr = getattr(skimage.data, name)()
    if isinstance(arr, tuple):  # stereo_motorcycle: (left, right, disparity)
        arr = arr[0]
    arr = np.asarray(arr)
    if arr.dtype == bool:
        arr = np.where(arr, 0, 255).astype(np.uint8)  # horse: True is the horse, drawn black on white
    elif arr.dtype != np.uint8:
        arr = np.clip(arr * 255.0 if arr.max() <= 1.0 else arr, 0, 255).astype(np.uint8)
    if arr.ndim == 2:
        return Image.fromarray(arr, "L")
    return Image.fromarray(arr, "RGBA" if arr.shape[2] == 4 else "RGB")


def _variant(img: Image.Image, rng: random.Random) -> tuple[Image.Image, bool]:
    """A random crop (40-100% of the short side, aspect 0.6-1.6), maybe mirrored, resized to 48-96 px a side."""
    w, h = img.size
    side = rng.uniform(0.4, 1.0) * min(w, h)
    aspect = rng.choice([1.0, 1.0, rng.uniform(0.6, 1.6)])
    cw, ch = min(w, round(side * aspect ** 0.5)), min(h, round(side / aspect ** 0.5))
    left, top = rng.randint(0, w - cw), rng.randint(0, h - ch)
    img = img.crop((left, top, left + cw, top + ch))
    flipped = rng.random() < 0.3
    if flipped:
        img = img.transpose(Image.FLIP_LEFT_RIGHT)
    longest = rng.randint(48, 96)
    scale = longest / max(cw, ch)
    size = (max(48, min(96, round(cw * scale))), max(48, min(96, round(ch * scale))))
    return img.resize(size, Image.BICUBIC), flipped


def _vignette(size: tuple[int, int]) -> Image.Image:
    """An alpha channel opaque in the middle, fully transparent in the corners."""
    w, h = size
    y, x = np.mgrid[0:h, 0:w]
    r = np.hypot((x - (w - 1) / 2) / (w / 2), (y - (h - 1) / 2) / (h / 2))
    return Image.fromarray(np.clip((1.3 - r) / 0.5 * 255, 0, 255).astype(np.uint8), "L")


def _with_alpha(img: Image.Image, mode: str) -> Image.Image:
    """``img`` in ``mode`` (RGBA or LA); a picture without alpha of its own gets a vignette."""
    if img.mode in ("RGBA", "LA"):
        out = img.convert(mode)
        if out.getextrema()[-1][0] < 255:
            return out
    out = img.convert(mode[:-1])
    out.putalpha(_vignette(img.size))
    return out


def _encode(img: Image.Image, kind: str, grey: bool) -> tuple[bytes, dict[str, str] | None]:
    """The file of one sample, and img2dataset's ``exif`` field where it has one."""
    buf = io.BytesIO()
    exif = None
    if kind in ("jpeg", "grey_jpeg", "truncated_jpeg"):
        img.convert("L" if grey or kind == "grey_jpeg" else "RGB").save(buf, "JPEG", quality=90)
    elif kind == "cmyk_jpeg":
        img.convert("RGB").convert("CMYK").save(buf, "JPEG", quality=90)
    elif kind == "exif_jpeg":
        # Stored turned 90 degrees anticlockwise; orientation 6 tells a viewer to turn it clockwise back upright.
        tags = Image.Exif()
        tags[EXIF_ORIENTATION] = 6
        img.convert("RGB").transpose(Image.ROTATE_90).save(buf, "JPEG", quality=90, exif=tags.tobytes())
        exif = {"Image Orientation": "Rotated 90 CW"}
    elif kind == "png":
        img.convert("L" if grey else "RGB").save(buf, "PNG")
    elif kind == "rgba_png":
        _with_alpha(img, "RGBA").save(buf, "PNG")
    elif kind == "la_png":
        _with_alpha(img, "LA").save(buf, "PNG")
    elif kind == "webp":
        img.convert("RGB").save(buf, "WEBP", quality=85)
    elif kind == "webp_alpha":
        _with_alpha(img, "RGBA").save(buf, "WEBP", quality=85)
    else:
        raise ValueError(f"unknown kind {kind!r}")
    data = buf.getvalue()
    if kind == "truncated_jpeg":
        data = data[: len(data) // 2]  # a download cut short: the header is there, half the scan is not
    return data, exif


def _caption(picture: Picture, variant: int, rng: random.Random, flipped: bool) -> str:
    if variant % 4 == 3:  # every fourth sample: the long description, sometimes with a clause added
        text = picture.long
        return f"{text}, {rng.choice(picture.details)}." if rng.random() < 0.5 else f"{text}."
    text = rng.choice(SHORT_TEMPLATES).format(subject=picture.subject, detail=rng.choice(picture.details))
    if flipped and rng.random() < 0.5:
        text = f"a mirrored picture of {picture.subject}"
    return text[0].upper() + text[1:] if rng.random() < 0.3 else text


def _parquet(path: Path, rows: list[dict]) -> None:
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:  # img2dataset writes one; a loader ignores it, so a placeholder of that name will do
        path.write_text("placeholder for img2dataset's per-shard parquet (pyarrow is not installed)\n")
        return
    columns = ("url", "caption", "key", "status", "error_message", "width", "height", "original_width",
               "original_height", "sha256")
    pq.write_table(pa.table({c: [row.get(c) for row in rows] for c in columns}), path)


def _write_shard(path: Path, samples: list[dict]) -> None:
    """One img2dataset shard: per sample the image, the caption (when there is one) and the metadata json."""
    with tarfile.open(path, "w") as tar:
        for s in samples:
            members = [(f"{s['key']}.{s['ext']}", s["data"])]
            if s["caption"] is not None:
                members.append((f"{s['key']}.txt", s["caption"].encode("utf-8")))
            members.append((f"{s['key']}.json", json.dumps(s["meta"], indent=4).encode("utf-8")))
            for name, data in members:
                info = tarfile.TarInfo(name)
                info.size, info.mtime, info.mode = len(data), 1_700_000_000, 0o644
                tar.addfile(info, io.BytesIO(data))
    n = len(samples)
    ok = sum(s["meta"]["status"] == "success" for s in samples)
    stats = {"count": n, "successes": ok, "failed_to_download": 0, "failed_to_resize": n - ok,
             "duration": 1.5, "start_time": 1_700_000_000.0, "end_time": 1_700_000_001.5,
             "status_dict": {"success": ok}}
    path.with_name(f"{path.stem}_stats.json").write_text(json.dumps(stats, indent=4))
    _parquet(path.with_suffix(".parquet"), [s["meta"] for s in samples])


def build_download(root: Path, layout: str = "split", seed: int = 0, variants: int = VARIANTS) -> Download:
    """Write the download under ``root`` (created) in ``layout`` ("split": train/ and val/, the last shard in val/;
    "flat": every shard in ``root`` itself) and say what it holds."""
    if layout not in ("split", "flat"):
        raise ValueError(f"layout={layout!r}; expected 'split' or 'flat'")
    rng = random.Random(seed)
    drawn = []  # (picture, variant, image, flipped), in a shuffled order
    grey_source = set()  # the greyscale pictures (their plain JPEGs are greyscale JPEGs)
    for picture in PICTURES:
        source = _load(picture.name)
        if source.mode == "L":
            grey_source.add(picture.name)
        for variant in range(variants):
            img, flipped = _variant(source, rng)
            drawn.append((picture, variant, img, flipped))
    rng.shuffle(drawn)
    # The specials sit in the first shard (a colour picture each, for CMYK and EXIF), the others cycle.
    colour = [i for i, (p, *_rest) in enumerate(drawn[:SHARD_SIZE]) if p.name not in grey_source]
    specials = {colour[0]: "cmyk_jpeg", colour[1]: "exif_jpeg", colour[2]: "truncated_jpeg"}
    uncaptioned = colour[3]
    samples = []
    for i, (picture, variant, img, flipped) in enumerate(drawn):
        shard, index = divmod(i, SHARD_SIZE)
        key = f"{shard:05d}{index:04d}"
        grey = picture.name in grey_source
        kind = specials.get(i) or CYCLE[i % len(CYCLE)]
        if kind == "jpeg" and grey:
            kind = "grey_jpeg"
        data, exif = _encode(img, kind, grey)
        caption = None if i == uncaptioned else _caption(picture, variant, rng, flipped)
        w, h = img.size
        meta = {"url": f"https://images.example.org/{picture.name}/{variant}.{EXTENSION[kind]}", "caption": caption,
                "key": key, "status": "success", "error_message": None, "width": w, "height": h,
                "original_width": w * 3, "original_height": h * 3,
                "exif": None if exif is None else json.dumps(exif), "sha256": hashlib.sha256(data).hexdigest()}
        samples.append({"key": key, "ext": EXTENSION[kind], "data": data, "caption": caption, "meta": meta,
                        "kind": kind})
    root.mkdir(parents=True, exist_ok=True)
    n_shards = -(-len(samples) // SHARD_SIZE)
    shards: dict[str, list[Path]] = {}
    splits: dict[str, str] = {}
    for shard in range(n_shards):
        split = "" if layout == "flat" else ("val" if shard == n_shards - 1 else "train")
        folder = root / split if split else root
        folder.mkdir(exist_ok=True)
        path = folder / f"{shard:05d}.tar"
        part = samples[shard * SHARD_SIZE:(shard + 1) * SHARD_SIZE]
        _write_shard(path, part)
        shards.setdefault(split, []).append(path)
        splits.update({s["key"]: split for s in part})
    key_of = {i: samples[i]["key"] for i in range(len(samples))}
    kinds = {s["key"]: s["kind"] for s in samples}
    by_kind = Counter(kinds.values())
    return Download(
        root=root, layout=layout, shards={k: tuple(v) for k, v in shards.items()},
        captions={s["key"]: s["caption"] for s in samples if s["caption"] is not None}, kinds=kinds, splits=splits,
        truncated_key=key_of[next(i for i, k in specials.items() if k == "truncated_jpeg")],
        uncaptioned_key=key_of[uncaptioned],
        cmyk_key=key_of[next(i for i, k in specials.items() if k == "cmyk_jpeg")],
        exif_key=key_of[next(i for i, k in specials.items() if k == "exif_jpeg")],
        counts={kind: by_kind.get(kind, 0) for kind in KINDS} | {"uncaptioned": 1, "total": len(samples)},
    )

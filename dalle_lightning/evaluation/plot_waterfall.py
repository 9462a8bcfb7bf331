"""The waterfall of a ``dalle-eval`` report as a PNG: one panel per split, one group of bars per stage (renders,
dVAE reconstructions, any of N, each reranker's pick, one sample), one bar per caption group (all captions, one
object, two objects). The first tall-to-short step is the stage to fix. Drawn with Pillow, like ``plot``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from PIL import Image, ImageDraw, ImageFont

from dalle_lightning.evaluation.plot import COLOURS, SPLIT_LABELS
from dalle_lightning.evaluation.waterfall import GROUPS, ROWS

WIDTH, HEIGHT = 560, 300
LEFT, RIGHT, TOP, BOTTOM = 46, 12, 30, 52
ROW_LABELS = {"renders": "renders", "reconstructions": "dVAE", "any_of_n": "any of N", "pick_clip": "clip",
              "pick_prior": "prior", "pick_both": "both", "one_sample": "one"}
GROUP_LABELS = {"all": "all captions", "one_object": "one object", "two_objects": "two objects"}


def bar_box(panel: tuple[int, int], row: int, n_rows: int, group: int, value: float) -> tuple[int, int, int, int]:
    """Pixel box (x0, y0, x1, y1) of the bar of ``group`` (of 3) in stage ``row`` (of ``n_rows``) at ``value`` in
    [0, 1], in the panel whose top-left corner is ``panel``."""
    left, top = panel[0] + LEFT, panel[1] + TOP
    right, bottom = panel[0] + WIDTH - RIGHT, panel[1] + HEIGHT - BOTTOM
    slot = (right - left) / n_rows
    bar = slot * 0.8 / len(GROUPS)
    x0 = left + row * slot + slot * 0.1 + group * bar
    return round(x0), round(bottom - value * (bottom - top)), round(x0 + bar) - 1, bottom


def draw_split(image: Image.Image, waterfall: dict[str, Any], title: str, origin: tuple[int, int], font: Any) -> None:
    draw = ImageDraw.Draw(image)
    rows = [r for r in ROWS if r in waterfall["all"]]
    left, top = origin[0] + LEFT, origin[1] + TOP
    right, bottom = origin[0] + WIDTH - RIGHT, origin[1] + HEIGHT - BOTTOM
    for i in range(5):  # accuracy ticks at 0, 25, 50, 75, 100 %
        y = round(bottom - i / 4 * (bottom - top))
        draw.line([(left, y), (right, y)], fill=(225, 225, 225))
        draw.text((left - 4, y), f"{i * 25}%", fill="black", font=font, anchor="rm")
    for r, row in enumerate(rows):
        for g, group in enumerate(GROUPS):
            if group in waterfall and row in waterfall[group]:
                draw.rectangle(bar_box(origin, r, len(rows), g, waterfall[group][row]), fill=COLOURS[g])
        x0, _, _, _ = bar_box(origin, r, len(rows), 0, 0.0)
        _, _, x1, _ = bar_box(origin, r, len(rows), len(GROUPS) - 1, 0.0)
        label = ROW_LABELS[row].replace("N", str(waterfall["n"]))
        draw.text(((x0 + x1) // 2, bottom + 4), label, fill="black", font=font, anchor="ma")
    draw.rectangle([left, top, right, bottom], outline="black")
    draw.text(((left + right) // 2, origin[1] + 8), title, fill="black", font=font, anchor="ma")
    for g, group in enumerate(GROUPS):  # legend under the axis
        x = left + g * 120
        draw.rectangle([x, bottom + 24, x + 12, bottom + 34], fill=COLOURS[g])
        draw.text((x + 16, bottom + 29), GROUP_LABELS[group], fill="black", font=font, anchor="lm")


def plot_waterfall(report: dict[str, Any], path: str | Path) -> Path:
    """The waterfall of every split in ``report`` side by side, as a PNG at ``path``."""
    splits = [(s, report[s]["waterfall"]) for s in SPLIT_LABELS if "waterfall" in report.get(s, {})]
    if not splits:
        raise ValueError("the report has no waterfall to plot; expected 'seen' or 'zeroshot' entries with one")
    image = Image.new("RGB", (WIDTH * len(splits), HEIGHT), "white")
    font = ImageFont.load_default()
    for i, (split, waterfall) in enumerate(splits):
        title = f"{SPLIT_LABELS[split]}: caption accuracy by stage ({waterfall['all']['captions']} captions)"
        draw_split(image, waterfall, title, (i * WIDTH, 0), font)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    image.save(path)
    return path

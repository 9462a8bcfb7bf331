"""PNG line charts drawn with Pillow: the reranking curves of a ``dalle-eval`` report (the paper's Figure 9).

matplotlib is not a dependency of the project, and a few small panels (accuracy on the shapes world; FID, KID and
contrastive score in each feature space, each with its reference, against the number of reranked candidates N,
one line per split) need no more than lines, markers, ticks, axis labels and a legend. The x axis is log2(N), as
N doubles from point to point.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from PIL import Image, ImageDraw, ImageFont

from dalle_lightning_callbacks.image_files import save_image

Point = tuple[float, float]
COLOURS = [(31, 119, 180), (214, 39, 40), (44, 160, 44), (148, 103, 189), (255, 127, 14), (140, 86, 75),
           (227, 119, 194), (127, 127, 127), (23, 190, 207)]
PANEL_W, PANEL_H = 360, 280
LEFT, RIGHT, TOP, BOTTOM = 62, 14, 30, 46


@dataclass
class Panel:
    """One chart: ``series`` maps a legend label to its (N, value) points."""

    title: str
    ylabel: str
    series: dict[str, list[Point]]
    xlabel: str = "N (candidates reranked)"
    ylim: tuple[float, float] | None = None  # fixed y range (e.g. (0, 1) for accuracy); None: fit the data
    xticks: list[float] | None = None  # x values with a grid line and label; None: every x of the data
    hline: float | None = None  # a reference level (a target), drawn as a dashed grey line
    markers: bool = True  # a dot at every point (off for dense curves)
    colour_of: dict[str, int] | None = None  # a series' colour index by label (one colour per label across panels)


@dataclass
class Axes:
    """Maps data (x on a log2 scale, y linear) to pixels of a panel whose top-left corner is ``origin``."""

    origin: tuple[int, int]
    xlim: tuple[float, float]
    ylim: tuple[float, float]
    box: tuple[int, int, int, int] = field(init=False)  # plot area (left, top, right, bottom) in pixels

    def __post_init__(self) -> None:
        ox, oy = self.origin
        self.box = (ox + LEFT, oy + TOP, ox + PANEL_W - RIGHT, oy + PANEL_H - BOTTOM)

    def to_pixel(self, x: float, y: float) -> tuple[int, int]:
        left, top, right, bottom = self.box
        lx0, lx1 = math.log2(self.xlim[0]), math.log2(self.xlim[1])
        fx = 0.5 if lx1 == lx0 else (math.log2(x) - lx0) / (lx1 - lx0)
        fy = 0.5 if self.ylim[1] == self.ylim[0] else (y - self.ylim[0]) / (self.ylim[1] - self.ylim[0])
        return round(left + fx * (right - left)), round(bottom - fy * (bottom - top))


def _ylim(panel: Panel) -> tuple[float, float]:
    if panel.ylim is not None:
        return panel.ylim
    ys = [y for pts in panel.series.values() for _, y in pts]
    lo, hi = min(ys), max(ys)
    pad = (hi - lo) * 0.08 or abs(hi) * 0.05 or 0.5
    return lo - pad, hi + pad


def axes_for(panel: Panel, origin: tuple[int, int]) -> Axes:
    xs = [x for pts in panel.series.values() for x, _ in pts]
    if not xs or min(xs) <= 0:
        raise ValueError(f"panel {panel.title!r} has x values {xs}; expected positive N values")
    return Axes(origin, (min(xs), max(xs)), _ylim(panel))


def _fmt(v: float) -> str:
    return f"{v:.3g}" if abs(v) < 1000 else f"{v:.0f}"


def draw_panel(image: Image.Image, panel: Panel, origin: tuple[int, int], font: Any) -> Axes:
    ax = axes_for(panel, origin)
    draw = ImageDraw.Draw(image)
    left, top, right, bottom = ax.box
    grey, black = (225, 225, 225), (0, 0, 0)
    xs = ([t for t in panel.xticks if ax.xlim[0] <= t <= ax.xlim[1]] if panel.xticks
          else sorted({x for pts in panel.series.values() for x, _ in pts}))
    for x in xs:  # vertical grid line and label at every N (or tick)
        px, _ = ax.to_pixel(x, ax.ylim[0])
        draw.line([(px, top), (px, bottom)], fill=grey)
        draw.text((px, bottom + 4), _fmt(x), fill=black, font=font, anchor="ma")
    for i in range(5):  # five horizontal ticks
        y = ax.ylim[0] + (ax.ylim[1] - ax.ylim[0]) * i / 4
        _, py = ax.to_pixel(xs[0], y)
        draw.line([(left, py), (right, py)], fill=grey)
        draw.text((left - 4, py), _fmt(y), fill=black, font=font, anchor="rm")
    draw.rectangle([left, top, right, bottom], outline=black)
    if panel.hline is not None and ax.ylim[0] <= panel.hline <= ax.ylim[1]:
        _, py = ax.to_pixel(xs[0], panel.hline)
        for x0 in range(left, right, 8):
            draw.line([(x0, py), (min(x0 + 4, right), py)], fill=(90, 90, 90), width=1)
    draw.text(((left + right) // 2, origin[1] + 8), panel.title, fill=black, font=font, anchor="ma")
    draw.text(((left + right) // 2, bottom + 24), panel.xlabel, fill=black, font=font, anchor="ma")
    label = Image.new("RGB", (bottom - top, 14), "white")  # the y label, rotated to run up the axis
    ImageDraw.Draw(label).text(((bottom - top) // 2, 0), panel.ylabel, fill=black, font=font, anchor="ma")
    image.paste(label.rotate(90, expand=True), (origin[0] + 4, top))
    # The legend goes in the right-hand corner (top or bottom) that the data leave emptier.
    points = [ax.to_pixel(x, y) for pts in panel.series.values() for x, y in pts]
    upper = sum(1 for px, py in points if px > (left + right) / 2 and py < (top + bottom) / 2)
    lower = sum(1 for px, py in points if px > (left + right) / 2 and py >= (top + bottom) / 2)
    legend_top = top + 8 if upper <= lower else bottom - 8 - 14 * len(panel.series)
    text_w = max((draw.textlength(name, font=font) for name in panel.series), default=0)
    legend_x = right - 6 - round(text_w) - 22  # the longest name ends inside the box
    for k, (name, pts) in enumerate(panel.series.items()):
        colour = COLOURS[(panel.colour_of or {}).get(name, k) % len(COLOURS)]
        pixels = [ax.to_pixel(x, y) for x, y in sorted(pts) if ax.ylim[0] <= y <= ax.ylim[1]]
        if len(pixels) > 1:
            draw.line(pixels, fill=colour, width=2)
        for px, py in pixels if panel.markers else []:
            draw.ellipse([px - 3, py - 3, px + 3, py + 3], fill=colour)
        ly = legend_top + 14 * k
        draw.line([(legend_x, ly), (legend_x + 18, ly)], fill=colour, width=3)
        draw.text((legend_x + 22, ly), name, fill=black, font=font, anchor="lm")
    return ax


def line_chart(panels: list[Panel], path: str | Path) -> list[Axes]:
    """Draw ``panels`` side by side into a PNG at ``path``; returns each panel's axes (data -> pixel)."""
    if not panels:
        raise ValueError("no panels to plot; expected at least one")
    image = Image.new("RGB", (PANEL_W * len(panels), PANEL_H), "white")
    font = ImageFont.load_default()
    axes = [draw_panel(image, p, (i * PANEL_W, 0), font) for i, p in enumerate(panels)]
    save_image(image, path)
    return axes


SPLIT_LABELS = {"seen": "seen captions", "zeroshot": "zero-shot", "val": "val captions"}
SCORES = [  # (report key prefix, panel title, y label): one panel per feature space, named after it
    ("fid_", "FID ({} features)", "FID (lower is better)"),
    ("kid_", "KID ({} features)", "KID (lower is better)"),
    ("contrastive_", "Contrastive score ({})", "mean cosine"),
]


def _per_n(report: dict[str, Any], split: str) -> dict[str, dict[str, Any]]:
    return {n: v for n, v in report.get(split, {}).items() if n.isdigit()}


def _points(per_n: dict[str, dict[str, Any]], key: str) -> list[Point]:
    return [(float(n), float(v[key])) for n, v in per_n.items() if v.get(key) is not None]


def metric_keys(report: dict[str, Any]) -> list[tuple[str, str, str, tuple[float, float] | None]]:
    """(report key, title, y label, fixed y range) of every metric the report holds: accuracy, then FID, KID and
    the contrastive score in each feature space."""
    keys = {k for split in SPLIT_LABELS for v in _per_n(report, split).values() for k in v}
    metrics: list[tuple[str, str, str, tuple[float, float] | None]] = []
    if "accuracy" in keys:
        metrics.append(("accuracy", "Caption accuracy", "accuracy", (0.0, 1.0)))
    for prefix, title, ylabel in SCORES:
        for key in sorted(k for k in keys if k.startswith(prefix)):
            metrics.append((key, title.format(key[len(prefix):]), ylabel, None))
    return metrics


def report_panels(report: dict[str, Any]) -> list[Panel]:
    """One panel per metric present in a ``dalle-eval`` report, one line per split; beside a score, its reference
    (``reference_<key>``: what real images score) as a flat line over N."""
    panels = []
    for key, title, ylabel, ylim in metric_keys(report):
        series = {}
        for split, label in SPLIT_LABELS.items():
            per_n = _per_n(report, split)
            pts = _points(per_n, key)
            if not pts:
                continue
            series[label] = pts
            if key == "accuracy":  # beside it, what a perfect reranker would reach (any of the N candidates matches)
                if any_pts := _points(per_n, "any_of_n"):
                    series[f"{label}, any of N"] = any_pts
            reference = report[split].get(f"reference_{key}")
            if reference is not None:
                series[f"{label}, real images"] = [(x, float(reference)) for x, _ in pts]
        if series:
            panels.append(Panel(title, ylabel, series, ylim=ylim))
    return panels


def plot_report(report: dict[str, Any], path: str | Path) -> Path:
    """The reranking curves of a ``dalle-eval`` report as a PNG."""
    panels = report_panels(report)
    if not panels:
        raise ValueError("the report has no per-N results to plot; expected 'seen' or 'zeroshot' entries")
    line_chart(panels, path)
    return Path(path)

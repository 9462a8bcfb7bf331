"""Draw a scene: exact palette colours on black, no anti-aliasing, so a program can check every pixel.

A pixel belongs to a shape when its *centre* ``(x + 0.5, y + 0.5)`` lies inside the shape (the usual
rasterisation rule); for a triangle with an even side this leaves the box's top row empty (the apex is a point).
"""

from __future__ import annotations

import numpy as np

from dalle_lightning.world.scene import COLOURS, SHAPES, ObjectSpec, Scene


def shape_mask(shape: str, side: int) -> np.ndarray:
    """Boolean ``side x side`` mask of ``shape`` in its own box."""
    centre = np.arange(side) + 0.5  # pixel centres, in box coordinates
    x, y = centre[None, :], centre[:, None]
    if shape == "square":
        return np.ones((side, side), dtype=bool)
    if shape == "circle":
        return (x - side / 2) ** 2 + (y - side / 2) ** 2 <= (side / 2) ** 2
    if shape == "triangle":
        # Corners (side/2, 0), (0, side), (side, side): at height y the polygon spans side/2 +- y/2.
        return np.abs(x - side / 2) <= y / 2
    raise ValueError(f"shape {shape!r} is not one of {SHAPES}")


def draw(canvas: np.ndarray, obj: ObjectSpec) -> None:
    """Paint ``obj`` into ``canvas`` (H x W x 3 uint8) in place."""
    x0, y0, x1, y1 = obj.box
    side = x1 - x0
    if side != y1 - y0 or x0 < 0 or y0 < 0 or x1 > canvas.shape[1] or y1 > canvas.shape[0]:
        raise ValueError(f"box {obj.box} is not a square inside a {canvas.shape[1]}x{canvas.shape[0]} canvas")
    if obj.colour not in COLOURS:
        raise ValueError(f"colour {obj.colour!r} is not one of {tuple(COLOURS)}")
    canvas[y0:y1, x0:x1][shape_mask(obj.shape, side)] = COLOURS[obj.colour]


def render(scene: Scene, image_size: int = 64) -> np.ndarray:
    """The scene's image as ``image_size x image_size x 3`` uint8 RGB."""
    canvas = np.zeros((image_size, image_size, 3), dtype=np.uint8)
    for obj in scene.objects:
        draw(canvas, obj)
    return canvas

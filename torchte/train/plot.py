"""The loss-curve plot: train and validation loss per recipe against the step, as a PNG.

The loss is the mean cross entropy of the next byte in nats (natural log) per byte: ln 256 =
5.55 for a uniform guess. Both axes get round ticks (multiples of 1, 2, 2.5 or 5 times a power
of ten, from nice_ticks), labels with units and a title.

matplotlib draws it when it imports (Agg backend). Without it a built-in raster writer does:
an axes box with tick labels, light grid lines, one color per recipe (train thin and pale,
validation thick with markers) and a legend, in a tiny built-in font (capitals only: lowercase
is drawn in capitals), encoded as PNG with zlib and struct. Either way the program never fails
for want of a plotting library.
"""

from __future__ import annotations

import itertools
import math
import struct
import zlib
from dataclasses import dataclass
from pathlib import Path

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
COLORS = ((31, 119, 180), (255, 127, 14), (44, 160, 44), (214, 39, 40), (148, 103, 189))
WIDTH, HEIGHT = 800, 480
LEFT, RIGHT, TOP, BOTTOM = 72, 600, 40, 432  # the plot area's box in pixels
SCALE = 2  # font pixels per glyph pixel
CHAR_W, CHAR_H = 4 * SCALE, 5 * SCALE  # a character's advance and height in pixels
X_LABEL, Y_LABEL = "step", "loss (nats/byte)"
NICE_MANTISSAS = (1.0, 2.0, 2.5, 5.0, 10.0)

# A 3x5 font: 15 bits per glyph, row by row from the top, for the characters the plot writes.
_GLYPH_ROWS = {
    "0": "111101101101111", "1": "010110010010111", "2": "111001111100111",
    "3": "111001111001111", "4": "101101111001001", "5": "111100111001111",
    "6": "111100111101111", "7": "111001010010010", "8": "111101111101111",
    "9": "111101111001111", ".": "000000000000010", "-": "000000111000000",
    " ": "000000000000000", "A": "010101111101101", "B": "110101110101110",
    "C": "011100100100011", "D": "110101101101110", "E": "111100110100111",
    "F": "111100110100100", "G": "011100101101011", "H": "101101111101101",
    "I": "111010010010111", "J": "001001001101010", "K": "101101110101101",
    "L": "100100100100111", "M": "101111111101101", "N": "110101101101101",
    "O": "010101101101010", "P": "110101110100100", "Q": "010101101110011",
    "R": "110101110101101", "S": "011100010001110", "T": "111010010010010",
    "U": "101101101101111", "V": "101101101101010", "W": "101101111111101",
    "X": "101101010101101", "Y": "101101010010010", "Z": "111001010100111",
    "(": "010100100100010", ")": "010001001001010", "/": "001001010100100",
    ":": "000010000010000", ",": "000000000010100", "+": "000010111010000",
    "=": "000111000111000", "_": "000000000000111", "%": "101001010100101",
}  # fmt: skip


@dataclass(frozen=True)
class Series:
    """One curve: its legend label, color, (step, loss) points and whether it is validation."""

    label: str
    color: tuple[int, int, int]
    points: list[tuple[float, float]]
    validation: bool


def series_from_rows(rows: list[dict]) -> list[Series]:
    """Train and validation curves of each recipe, in the order the recipes ran."""
    recipes = list(dict.fromkeys(r["recipe"] for r in rows))
    out = []
    for i, name in enumerate(recipes):
        color = COLORS[i % len(COLORS)]
        mine = [r for r in rows if r["recipe"] == name]
        for key, validation in (("train_loss", False), ("val_loss", True)):
            points = [(r["step"], r[key]) for r in mine if r[key] is not None]
            kind = "val" if validation else "train"
            out.append(Series(f"{name} {kind}", color, points, validation))
    return out


def nice_ticks(low: float, high: float, count: int = 5, integer: bool = False) -> list[float]:
    """About `count` round tick values from at or below `low` to at or above `high`: the
    multiples of a step of 1, 2, 2.5 or 5 times a power of ten (at least 1 if `integer`)."""
    if not high > low:
        low, high = low - 0.5, high + 0.5
    raw = (high - low) / max(count - 1, 1)
    power = 10.0 ** math.floor(math.log10(raw))
    step = next(m * power for m in NICE_MANTISSAS if m * power >= raw * (1 - 1e-9))
    if integer:
        step = max(step, 1.0)
    first = math.floor(low / step + 1e-9)
    last = math.ceil(high / step - 1e-9)
    digits = tick_decimals(step)
    return [round(k * step, digits) for k in range(first, last + 1)]


def tick_decimals(step: float) -> int:
    """The decimals that write every multiple of `step` exactly (0.25 -> 2, 0.5 -> 1, 5 -> 0)."""
    return next(d for d in range(12) if abs(round(step, d) - step) <= step * 1e-6)


def tick_labels(ticks: list[float]) -> list[str]:
    """The ticks written with the decimals their spacing needs, all alike."""
    digits = tick_decimals(ticks[1] - ticks[0]) if len(ticks) > 1 else 0
    return [f"{t:.{digits}f}" for t in ticks]


def axis_ticks(series: list[Series]) -> tuple[list[float], list[float]]:
    """(x ticks, y ticks) spanning the finite points of `series`; the axes run from each
    list's first tick to its last."""
    points = [p for s in series for p in s.points if math.isfinite(p[1])]
    xs, ys = [p[0] for p in points] or [0.0, 1.0], [p[1] for p in points] or [0.0, 1.0]
    return nice_ticks(min(xs), max(xs), integer=True), nice_ticks(min(ys), max(ys))


def write_plot(path: Path, rows: list[dict], title: str = "") -> str:
    """Draw the loss curves of `rows` into the PNG `path`, with `title` over them; returns
    the backend used."""
    path.parent.mkdir(parents=True, exist_ok=True)
    series = series_from_rows(rows)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        path.write_bytes(render_png(series, title))
        return "built-in"
    fig, ax = plt.subplots(figsize=(8, 4.8))
    for s in series:
        xs, ys = zip(*s.points, strict=True) if s.points else ((), ())
        color = tuple(c / 255 for c in s.color)
        style = {"marker": "o", "linewidth": 2} if s.validation else {"alpha": 0.5}
        ax.plot(xs, ys, color=color, label=s.label, **style)
    x_ticks, y_ticks = axis_ticks(series)
    ax.set_xticks(x_ticks, tick_labels(x_ticks))
    ax.set_yticks(y_ticks, tick_labels(y_ticks))
    ax.set_xlim(x_ticks[0], x_ticks[-1])
    ax.set_ylim(y_ticks[0], y_ticks[-1])
    ax.set_xlabel(X_LABEL)
    ax.set_ylabel(Y_LABEL)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return "matplotlib"


class Canvas:
    """An RGB raster, white to start, with the few drawing operations the plot needs."""

    def __init__(self, width: int, height: int) -> None:
        self.width, self.height = width, height
        self.pixels = bytearray(b"\xff" * (width * height * 3))

    def dot(self, x: int, y: int, color, size: int = 1) -> None:
        """A size x size square at (x, y) (clipped to the canvas)."""
        for yy in range(y - size // 2, y - size // 2 + size):
            for xx in range(x - size // 2, x - size // 2 + size):
                if 0 <= xx < self.width and 0 <= yy < self.height:
                    i = (yy * self.width + xx) * 3
                    self.pixels[i : i + 3] = bytes(color)

    def line(self, x0: int, y0: int, x1: int, y1: int, color, size: int = 1) -> None:
        """A straight line (Bresenham's algorithm) of dots of `size`."""
        dx, dy = abs(x1 - x0), -abs(y1 - y0)
        sx, sy = (1 if x0 < x1 else -1), (1 if y0 < y1 else -1)
        err = dx + dy
        while True:
            self.dot(x0, y0, color, size)
            if x0 == x1 and y0 == y1:
                return
            e2 = 2 * err
            if e2 >= dy:
                err, x0 = err + dy, x0 + sx
            if e2 <= dx:
                err, y0 = err + dx, y0 + sy

    def text(self, x: int, y: int, text: str, color=(0, 0, 0), upward: bool = False) -> None:
        """`text` (upper-cased; unknown characters as spaces) with its top left at (x, y); or
        with `upward`, turned a quarter left to read from the bottom up, (x, y) its bottom left."""
        for n, char in enumerate(text.upper()):
            bits = _GLYPH_ROWS.get(char, _GLYPH_ROWS[" "])
            for k, bit in enumerate(bits):
                if bit != "1":
                    continue
                along, across = n * CHAR_W + (k % 3) * SCALE, (k // 3) * SCALE
                gx, gy = (x + across, y - along - SCALE) if upward else (x + along, y + across)
                self.dot(gx + SCALE // 2, gy + SCALE // 2, color, SCALE)

    def png(self) -> bytes:
        """The canvas as PNG bytes (8-bit RGB, no filtering)."""
        stride = self.width * 3
        raw = b"".join(
            b"\x00" + bytes(self.pixels[y * stride : (y + 1) * stride]) for y in range(self.height)
        )
        header = struct.pack(">IIBBBBB", self.width, self.height, 8, 2, 0, 0, 0)
        return (
            PNG_SIGNATURE
            + _chunk(b"IHDR", header)
            + _chunk(b"IDAT", zlib.compress(raw, 9))
            + _chunk(b"IEND", b"")
        )


def _chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


def _text_width(text: str) -> int:
    return len(text) * CHAR_W - SCALE


def render_png(series: list[Series], title: str = "") -> bytes:
    """The plot drawn by the built-in writer, as PNG bytes."""
    canvas = Canvas(WIDTH, HEIGHT)
    x_ticks, y_ticks = axis_ticks(series)
    (x_lo, x_hi), (y_lo, y_hi) = (x_ticks[0], x_ticks[-1]), (y_ticks[0], y_ticks[-1])

    def to_px(x: float, y: float) -> tuple[int, int]:
        px = LEFT + (x - x_lo) / (x_hi - x_lo) * (RIGHT - LEFT)
        py = BOTTOM - (y - y_lo) / (y_hi - y_lo) * (BOTTOM - TOP)
        return round(px), round(py)

    _draw_axes(canvas, [to_px(x_lo, y)[1] for y in y_ticks], [to_px(x, y_lo)[0] for x in x_ticks])
    for py, label in zip((to_px(x_lo, y)[1] for y in y_ticks), tick_labels(y_ticks), strict=True):
        canvas.text(LEFT - 6 - _text_width(label), py - CHAR_H // 2, label)
    for px, label in zip((to_px(x, y_lo)[0] for x in x_ticks), tick_labels(x_ticks), strict=True):
        canvas.text(px - _text_width(label) // 2, BOTTOM + 8, label)
    canvas.text((LEFT + RIGHT - _text_width(X_LABEL)) // 2, BOTTOM + 28, X_LABEL)
    canvas.text(8, (TOP + BOTTOM + _text_width(Y_LABEL)) // 2, Y_LABEL, upward=True)
    title = title[: (WIDTH - 16) // CHAR_W]
    canvas.text((WIDTH - _text_width(title)) // 2, (TOP - CHAR_H) // 2, title)
    for n, s in enumerate(series):
        color = s.color if s.validation else tuple((c + 255) // 2 for c in s.color)
        pixels = [to_px(x, y) for x, y in s.points if math.isfinite(y)]
        for (x0, y0), (x1, y1) in itertools.pairwise(pixels):
            canvas.line(x0, y0, x1, y1, color, 3 if s.validation else 2)
        if s.validation:
            for x, y in pixels:
                canvas.dot(x, y, color, 7)
        legend_y = TOP + 8 + n * 20
        canvas.line(RIGHT + 16, legend_y + 4, RIGHT + 40, legend_y + 4, color, 3)
        canvas.text(RIGHT + 48, legend_y, s.label)
    return canvas.png()


def _draw_axes(canvas: Canvas, y_pixels: list[int], x_pixels: list[int]) -> None:
    """Grid lines at the ticks' pixels and the black box around the plot area."""
    grid, black = (225, 225, 225), (0, 0, 0)
    for py in y_pixels:
        canvas.line(LEFT, py, RIGHT, py, grid)
    for px in x_pixels:
        canvas.line(px, TOP, px, BOTTOM, grid)
    for x0, y0, x1, y1 in ((LEFT, TOP, RIGHT, TOP), (LEFT, BOTTOM, RIGHT, BOTTOM)):
        canvas.line(x0, y0, x1, y1, black)
    for x0, y0, x1, y1 in ((LEFT, TOP, LEFT, BOTTOM), (RIGHT, TOP, RIGHT, BOTTOM)):
        canvas.line(x0, y0, x1, y1, black)

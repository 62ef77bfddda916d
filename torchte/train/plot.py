"""The loss-curve plot: how the FP8 run's loss compares with the run without FP8, as a PNG.

Two panels share the step axis. The upper one holds each recipe's train loss (thin, pale) and
validation loss (thick, with markers). The run without FP8 (the baseline, named by its dtype,
"bf16" or "fp32") is drawn solid, wide and underneath; each FP8 run ("FP8 delayed", "MXFP8",
...) dashed, narrower and on top, so that where the curves lie on each other both still show.
When an FP8 run is compared with the baseline, the lower panel holds their validation loss
difference (FP8 minus baseline) at each step both evaluated, around a zero line, on a y axis
fitted to the difference: a final gap of a few thousandths of a nat, invisible on the loss
axis, spans it. The title says what is compared; the caller's title (the model, the device)
stands under it.

The loss is the mean cross entropy of the next byte in nats (natural log) per byte: ln 256 =
5.55 for a uniform guess. The axes get round ticks (multiples of 1, 2, 2.5 or 5 times a power
of ten, from nice_ticks) and labels with units.

matplotlib draws it when it imports (Agg backend; the `plot` extra installs it). Without it a
built-in raster writer draws the same panels: axes boxes with tick labels, light grid lines,
dashes, markers and legends, in a tiny built-in font (3x5 pixels, lowercase included), encoded
as PNG with zlib and struct. Either way the program never fails for want of a plotting library.
"""

from __future__ import annotations

import itertools
import math
import struct
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
RGB = tuple[int, int, int]
COLORS = ((31, 119, 180), (255, 127, 14), (44, 160, 44), (214, 39, 40), (148, 103, 189))
BLACK, WHITE, GRID = (0, 0, 0), (255, 255, 255), (225, 225, 225)
WIDTH, HEIGHT = 800, 640
LEFT, RIGHT = 80, 600  # the panels' left and right edges in pixels
TOP, BOTTOM = 48, 584  # the upper panel's top edge and the lower panel's bottom edge
DIFF_TOP, PANEL_GAP = 400, 24  # the difference panel's top; the loss panel ends PANEL_GAP above
LEGEND_X, LEGEND_ROW = RIGHT + 12, 20  # the legends' left edge and line spacing
DASH = (10, 6)  # an FP8 curve's dashes in the built-in writer: pixels drawn, pixels skipped
SCALE = 2  # font pixels per glyph pixel
CHAR_W, CHAR_H = 4 * SCALE, 5 * SCALE  # a character's advance and height in pixels
X_LABEL, Y_LABEL, DIFF_LABEL = "step", "loss (nats/byte)", "difference (nats/byte)"
NICE_MANTISSAS = (1.0, 2.0, 2.5, 5.0, 10.0)

# The legend's names of the FP8 recipes (the command line's --recipe choices besides bf16).
# Any other name is the run without FP8, which goes by its compute dtype ("bf16" or "fp32").
RECIPE_NAMES = {
    "delayed": "FP8 delayed",
    "current": "FP8 current",
    "block": "FP8 block",
    "mxfp8": "MXFP8",
    "nvfp4": "NVFP4",
}

# A 3x5 font: 15 bits per glyph, row by row from the top, for the characters the plot writes;
# g, j, p, q and y have 21 bits, their last two rows hanging below the line.
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
    "a": "000000011101011", "b": "100100110101110", "c": "000000011100011",
    "d": "001001011101011", "e": "000010111100011", "f": "011010111010010",
    "g": "000000011101011001110", "h": "100100110101101", "i": "010000110010111",
    "j": "001000001001001101010", "k": "100100101110101", "l": "110010010010111",
    "m": "000000111111101", "n": "000000110101101", "o": "000000010101010",
    "p": "000000110101110100100", "q": "000000011101011001001", "r": "000000011100100",
    "s": "000011100001110", "t": "010010111010011", "u": "000000101101011",
    "v": "000000101101010", "w": "000000101111111", "x": "000000101010101",
    "y": "000000101101011001110", "z": "000000110010011",
    "(": "010100100100010", ")": "010001001001010", "/": "001001010100100",
    ":": "000010000010000", ",": "000000000010100", "+": "000010111010000",
    "=": "000111000111000", "_": "000000000000111", "%": "101001010100101",
}  # fmt: skip


# -- what the plot shows --------------------------------------------------------------------------


def display_name(recipe: str) -> str:
    """A run's name in the legend and title: the FP8 recipe's ("FP8 delayed", "MXFP8"), or
    the run without FP8's as it is (its dtype, "bf16")."""
    return RECIPE_NAMES.get(recipe, recipe)


@dataclass(frozen=True)
class Series:
    """One curve: its legend label, color, (step, loss) points, whether it is validation
    (thick, with markers; else thin and pale) and whether it is dashed (an FP8 run's)."""

    label: str
    color: RGB
    points: list[tuple[float, float]]
    validation: bool
    dashed: bool

    @property
    def zorder(self) -> int:
        """Drawing order, lowest first: train under validation, the solid baseline under the
        dashed FP8 curve (2 to 5, over matplotlib's grid)."""
        return 2 + 2 * self.validation + self.dashed


@dataclass(frozen=True)
class LossPlot:
    """What the figure shows, whichever backend draws it."""

    headline: str  # what is compared: "validation loss: FP8 delayed against bf16"
    subtitle: str  # the caller's title (what was trained, where)
    curves: list[Series]  # the loss panel's, in drawing order (bottom first)
    differences: list[Series]  # the difference panel's; empty when nothing is compared


def series_from_rows(rows: list[dict]) -> list[Series]:
    """Train and validation curves of each recipe, in drawing order: every train curve under
    every validation curve, the baseline's under the FP8 run's."""
    recipes = list(dict.fromkeys(r["recipe"] for r in rows))
    out = []
    for name, color in zip(recipes, _recipe_colors(recipes), strict=True):
        mine = [r for r in rows if r["recipe"] == name]
        for key, validation in (("train_loss", False), ("val_loss", True)):
            points = [(r["step"], r[key]) for r in mine if r[key] is not None]
            label = display_name(name) if validation else f"{display_name(name)} train"
            out.append(Series(label, color, points, validation, name in RECIPE_NAMES))
    return sorted(out, key=lambda s: s.zorder)  # stable: recipes keep their order


def difference_series(rows: list[dict], recipe: str, baseline: str, color: RGB) -> Series:
    """`recipe`'s validation loss minus `baseline`'s at each step both evaluated (finite)."""
    base = {r["step"]: r["val_loss"] for r in rows if r["recipe"] == baseline}
    points = [
        (r["step"], r["val_loss"] - base[r["step"]])
        for r in rows
        if r["recipe"] == recipe and r["val_loss"] is not None and base.get(r["step"]) is not None
    ]
    points = [p for p in points if math.isfinite(p[1])]
    return Series(f"{display_name(recipe)} - {baseline}", color, points, True, False)


def headline(recipes: list[str]) -> str:
    """The title: the FP8 runs against the baseline, or the runs' names when nothing is
    compared."""
    fp8 = [display_name(name) for name in recipes if name in RECIPE_NAMES]
    plain = [name for name in recipes if name not in RECIPE_NAMES]
    if fp8 and plain:
        return f"validation loss: {' and '.join(fp8)} against {plain[0]}"
    names = " and ".join(display_name(name) for name in recipes)
    return f"loss: {names}" if names else "loss"


def loss_plot(rows: list[dict], title: str = "") -> LossPlot:
    """The curves of `rows` (the CSV's rows: recipe, step, train_loss, val_loss), and each FP8
    run's difference from the run without FP8 when both ran."""
    recipes = list(dict.fromkeys(r["recipe"] for r in rows))
    curves = series_from_rows(rows)
    baseline = next((name for name in recipes if name not in RECIPE_NAMES), None)
    differences = []
    if baseline is not None:
        for name, color in zip(recipes, _recipe_colors(recipes), strict=True):
            if name in RECIPE_NAMES:
                differences.append(difference_series(rows, name, baseline, color))
    return LossPlot(headline(recipes), title, curves, [d for d in differences if d.points])


def _recipe_colors(recipes: list[str]) -> list[RGB]:
    """One color per recipe, in the order they ran."""
    return [COLORS[i % len(COLORS)] for i in range(len(recipes))]


def final_note(difference: Series) -> str:
    """The difference at the last step both evaluated: "final +0.0070"."""
    return f"final {difference.points[-1][1]:+.4f}"


# -- ticks ----------------------------------------------------------------------------------------


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


def difference_ticks(differences: list[Series]) -> list[float]:
    """The difference panel's y ticks: the differences' range and zero, no more."""
    ys = [y for s in differences for _, y in s.points] + [0.0]
    return nice_ticks(min(ys), max(ys))


# -- matplotlib -----------------------------------------------------------------------------------


def write_plot(path: Path, rows: list[dict], title: str = "") -> str:
    """Draw the loss curves of `rows` into the PNG `path`, titled with what is compared and
    `title` under it; returns the backend used ("matplotlib" or "built-in")."""
    path.parent.mkdir(parents=True, exist_ok=True)
    plot = loss_plot(rows, title)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        path.write_bytes(render_png(plot))
        return "built-in"
    fig = draw_figure(plot, plt)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return "matplotlib"


def draw_figure(plot: LossPlot, plt):
    """The matplotlib figure of `plot` (pyplot passed in): the loss panel, and under it the
    difference panel when there is one."""
    panels = 2 if plot.differences else 1
    fig, axes = plt.subplots(
        panels, 1, sharex=True, squeeze=False, layout="constrained",
        figsize=(8, 6.4 if panels == 2 else 4.8),
        gridspec_kw={"height_ratios": (2.2, 1)[:panels]},
    )  # fmt: skip
    loss_ax = axes[0][0]
    x_ticks, y_ticks = axis_ticks(plot.curves)
    for s in plot.curves:
        loss_ax.plot(*_xy(s), **_line_style(s))
    _set_axes(loss_ax, x_ticks, y_ticks, Y_LABEL)
    fig.suptitle(plot.headline)
    loss_ax.set_title(plot.subtitle, fontsize=9)
    if plot.curves:
        loss_ax.legend(fontsize=8)
    if plot.differences:
        diff_ax = axes[1][0]
        diff_ax.axhline(0.0, color="black", linewidth=0.8, zorder=2)
        for d in plot.differences:
            diff_ax.plot(*_xy(d), **{**_line_style(d), "linewidth": 2.0, "markersize": 5.0})
            color = tuple(c / 255 for c in d.color)
            diff_ax.annotate(
                final_note(d), xy=d.points[-1], xytext=(-8, 8), textcoords="offset points",
                ha="right", fontsize=8, color=color,
            )  # fmt: skip
        _set_axes(diff_ax, x_ticks, difference_ticks(plot.differences), DIFF_LABEL)
        diff_ax.legend(fontsize=8)
    axes[-1][0].set_xlabel(X_LABEL)
    return fig


def _xy(s: Series) -> tuple[tuple, tuple]:
    return tuple(zip(*s.points, strict=True)) if s.points else ((), ())


def _line_style(s: Series) -> dict:
    """matplotlib's keywords for a curve: the baseline solid, wide, round markers; an FP8 run
    dashed, narrower, small square markers, drawn over it; train curves thin and pale."""
    style = {
        "color": tuple(c / 255 for c in s.color),
        "label": s.label,
        "zorder": s.zorder,
        "linestyle": "--" if s.dashed else "-",
    }
    if s.validation:
        style["linewidth"] = 2.0 if s.dashed else 4.0
        style["marker"], style["markersize"] = ("s", 4.0) if s.dashed else ("o", 8.0)
    else:
        style["linewidth"], style["alpha"] = (1.0 if s.dashed else 1.5), 0.5
    return style


def _set_axes(ax, x_ticks: list[float], y_ticks: list[float], y_label: str) -> None:
    """Round ticks, limits at the first and last tick, the y label and a light grid."""
    ax.set_xticks(x_ticks, tick_labels(x_ticks))
    ax.set_yticks(y_ticks, tick_labels(y_ticks))
    ax.set_xlim(x_ticks[0], x_ticks[-1])
    ax.set_ylim(y_ticks[0], y_ticks[-1])
    ax.set_ylabel(y_label)
    ax.grid(alpha=0.3)


# -- the built-in writer --------------------------------------------------------------------------


def _line_pixels(x0: int, y0: int, x1: int, y1: int) -> Iterator[tuple[int, int]]:
    """The pixels of a straight line from (x0, y0) to (x1, y1), both ends included
    (Bresenham's algorithm)."""
    dx, dy = abs(x1 - x0), -abs(y1 - y0)
    sx, sy = (1 if x0 < x1 else -1), (1 if y0 < y1 else -1)
    err = dx + dy
    while True:
        yield x0, y0
        if x0 == x1 and y0 == y1:
            return
        e2 = 2 * err
        if e2 >= dy:
            err, x0 = err + dy, x0 + sx
        if e2 <= dx:
            err, y0 = err + dx, y0 + sy


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
        """A straight line of dots of `size`."""
        for x, y in _line_pixels(x0, y0, x1, y1):
            self.dot(x, y, color, size)

    def polyline(self, points: list[tuple[int, int]], color, size: int = 1, dash=None) -> None:
        """Straight lines through `points`, of dots of `size`; with `dash` (on, off) only the
        first `on` of every on + off pixels along the path are drawn, across its corners."""
        walked = 0
        for n, ((x0, y0), (x1, y1)) in enumerate(itertools.pairwise(points)):
            for k, (x, y) in enumerate(_line_pixels(x0, y0, x1, y1)):
                if n and not k:
                    continue  # the corner, the last pixel of the segment before
                if dash is None or walked % (dash[0] + dash[1]) < dash[0]:
                    self.dot(x, y, color, size)
                walked += 1

    def text(self, x: int, y: int, text: str, color=BLACK, upward: bool = False) -> None:
        """`text` (unknown characters as spaces) with its top left at (x, y); or with
        `upward`, turned a quarter left to read from the bottom up, (x, y) its bottom left."""
        for n, char in enumerate(text):
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


@dataclass(frozen=True)
class Panel:
    """A plot area: its pixel box and the ticks its edges stand for (first and last)."""

    left: int
    top: int
    right: int
    bottom: int
    x_ticks: list[float]
    y_ticks: list[float]

    def to_px(self, x: float, y: float) -> tuple[int, int]:
        """The pixel of the data point (x, y)."""
        (x_lo, x_hi), (y_lo, y_hi) = _ends(self.x_ticks), _ends(self.y_ticks)
        px = self.left + (x - x_lo) / (x_hi - x_lo) * (self.right - self.left)
        py = self.bottom - (y - y_lo) / (y_hi - y_lo) * (self.bottom - self.top)
        return round(px), round(py)


def _ends(ticks: list[float]) -> tuple[float, float]:
    return ticks[0], ticks[-1]


def render_png(plot: LossPlot) -> bytes:
    """The plot drawn by the built-in writer, as PNG bytes."""
    canvas = Canvas(WIDTH, HEIGHT)
    x_ticks, y_ticks = axis_ticks(plot.curves)
    loss_bottom = DIFF_TOP - PANEL_GAP if plot.differences else BOTTOM
    loss = Panel(LEFT, TOP, RIGHT, loss_bottom, x_ticks, y_ticks)
    for n, (line, y) in enumerate(((plot.headline, 6), (plot.subtitle, 26))):
        line = line[: (WIDTH - 16) // CHAR_W]
        canvas.text((WIDTH - _text_width(line)) // 2, y, line, BLACK if n == 0 else (90, 90, 90))
    _draw_frame(canvas, loss, Y_LABEL, x_labels=not plot.differences)
    for s in plot.curves:
        _draw_series(canvas, loss, s)
    _draw_legend(canvas, loss.top + 8, plot.curves)
    if plot.differences:
        diff = Panel(LEFT, DIFF_TOP, RIGHT, BOTTOM, x_ticks, difference_ticks(plot.differences))
        _draw_frame(canvas, diff, DIFF_LABEL, x_labels=True)
        zero = diff.to_px(x_ticks[0], 0.0)[1]
        canvas.line(LEFT, zero, RIGHT, zero, BLACK)
        for d in plot.differences:
            _draw_series(canvas, diff, d, difference=True)
        _draw_legend(canvas, diff.top + 8, plot.differences, differences=True)
    canvas.text((LEFT + RIGHT - _text_width(X_LABEL)) // 2, BOTTOM + 28, X_LABEL)
    return canvas.png()


def _draw_frame(canvas: Canvas, panel: Panel, y_label: str, x_labels: bool) -> None:
    """Grid lines at the ticks, the black box, the y tick labels and y label, and with
    `x_labels` the x tick labels under the box."""
    x_pixels = [panel.to_px(x, panel.y_ticks[0])[0] for x in panel.x_ticks]
    y_pixels = [panel.to_px(panel.x_ticks[0], y)[1] for y in panel.y_ticks]
    for py in y_pixels:
        canvas.line(panel.left, py, panel.right, py, GRID)
    for px in x_pixels:
        canvas.line(px, panel.top, px, panel.bottom, GRID)
    left, top, right, bottom = panel.left, panel.top, panel.right, panel.bottom
    for x0, y0, x1, y1 in ((left, top, right, top), (left, bottom, right, bottom)):
        canvas.line(x0, y0, x1, y1, BLACK)
    for x0, y0, x1, y1 in ((left, top, left, bottom), (right, top, right, bottom)):
        canvas.line(x0, y0, x1, y1, BLACK)
    for py, label in zip(y_pixels, tick_labels(panel.y_ticks), strict=True):
        canvas.text(left - 6 - _text_width(label), py - CHAR_H // 2, label)
    if x_labels:
        for px, label in zip(x_pixels, tick_labels(panel.x_ticks), strict=True):
            canvas.text(px - _text_width(label) // 2, bottom + 8, label)
    canvas.text(8, (top + bottom + _text_width(y_label)) // 2, y_label, upward=True)


def _curve_look(s: Series, difference: bool) -> tuple[RGB, int, tuple[int, int] | None, int]:
    """(color, line width, dash, marker size or 0) of a curve in the built-in writer (a
    `difference` curve: narrower, alone in its panel)."""
    if difference:
        return s.color, 3, None, 7
    if not s.validation:
        return tuple((c + 255) // 2 for c in s.color), 2, DASH if s.dashed else None, 0
    return s.color, (3 if s.dashed else 5), (DASH if s.dashed else None), (5 if s.dashed else 9)


def _draw_series(canvas: Canvas, panel: Panel, s: Series, difference: bool = False) -> None:
    """One curve through its finite points, with markers at them if it is validation."""
    pixels = [panel.to_px(x, y) for x, y in s.points if math.isfinite(y)]
    color, width, dash, marker = _curve_look(s, difference)
    canvas.polyline(pixels, color, width, dash)
    for x, y in pixels if marker else ():
        canvas.dot(x, y, color, marker)


def _draw_legend(canvas: Canvas, top: int, series: list[Series], differences: bool = False) -> None:
    """A legend right of the panels from `top` down: a sample of each curve's line and marker,
    its label, and for `differences` a line under it with the final difference."""
    y = top
    for s in series:
        color, width, dash, marker = _curve_look(s, differences)
        # 32 pixels: two dashes and their gaps, the marker on the second dash
        canvas.polyline([(LEGEND_X, y + 4), (LEGEND_X + 31, y + 4)], color, width, dash)
        if marker:
            canvas.dot(LEGEND_X + 21, y + 4, color, marker)
        canvas.text(LEGEND_X + 38, y, s.label)
        y += LEGEND_ROW
        if differences and s.points:
            canvas.text(LEGEND_X + 38, y, final_note(s))
            y += LEGEND_ROW

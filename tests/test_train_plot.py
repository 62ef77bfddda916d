"""The loss plot of `python -m torchte.train` (torchte/train/plot.py): what it shows (the FP8
run against the run without FP8, both curves visible, their difference), drawn by matplotlib
(tests skipped where it is not installed; the dev extra installs it) and by the built-in PNG
writer (tests that always run, matplotlib hidden)."""

from __future__ import annotations

import itertools
import math
import struct
import sys
import zlib
from pathlib import Path

import pytest

from torchte.train import plot
from torchte.train.config import RECIPES

STEPS = ((0, None, 5.5), (10, 4.0, 3.6), (20, 3.0, 3.1))  # step, train loss, validation loss
GAPS = (0.0, 0.003, 0.007)  # the FP8 run's validation loss over the baseline's, per step


def compare_rows(fp8: str = "delayed", baseline: str = "bf16", gaps=GAPS) -> list[dict]:
    """The rows of a run of `baseline` then `fp8` (loop.py's keys), FP8 `gaps` above it."""
    rows = []
    for recipe in (baseline, fp8):
        for (step, train, val), gap in zip(STEPS, gaps, strict=True):
            gap = gap if recipe == fp8 else 0.0
            train = None if train is None else train + gap
            rows.append(
                {"recipe": recipe, "step": step, "train_loss": train, "val_loss": val + gap}
            )
    return rows


def flat_rows(loss: float = 3.0) -> list[dict]:
    """Both runs with the same validation loss at every step: one curve lies on the other."""
    return [
        {"recipe": recipe, "step": step, "train_loss": None, "val_loss": loss}
        for recipe in ("bf16", "delayed")
        for step in (0, 10, 20)
    ]


# -- what the plot shows --------------------------------------------------------------------------


def test_every_fp8_recipe_of_the_command_line_has_its_legend_name() -> None:
    assert set(plot.RECIPE_NAMES) == set(RECIPES) - {"bf16"}
    names = {recipe: plot.display_name(recipe) for recipe in RECIPES}
    assert names == {
        "bf16": "bf16",
        "delayed": "FP8 delayed",
        "current": "FP8 current",
        "block": "FP8 block",
        "mxfp8": "MXFP8",
        "nvfp4": "NVFP4",
    }
    assert plot.display_name("fp32") == "fp32"  # the run without FP8 in fp32 compute


def test_the_plot_compares_the_fp8_run_with_bf16() -> None:
    shown = plot.loss_plot(compare_rows(), "a GPT on cpu")
    assert shown.headline == "validation loss: FP8 delayed against bf16"
    assert shown.subtitle == "a GPT on cpu"
    labels = [s.label for s in shown.curves]  # drawing order: bottom first
    assert labels == ["bf16 train", "FP8 delayed train", "bf16", "FP8 delayed"]
    assert [s.dashed for s in shown.curves] == [False, True, False, True]
    assert [s.validation for s in shown.curves] == [False, False, True, True]
    zorders = [s.zorder for s in shown.curves]
    assert zorders == sorted(zorders) and len(set(zorders)) == 4
    bf16, fp8 = shown.curves[2:]
    assert bf16.color != fp8.color
    assert fp8.points == [
        (step, val + gap) for (step, _, val), gap in zip(STEPS, GAPS, strict=True)
    ]
    (difference,) = shown.differences
    assert difference.label == "FP8 delayed - bf16" and difference.color == fp8.color
    assert [x for x, _ in difference.points] == [0, 10, 20]
    assert [y for _, y in difference.points] == pytest.approx(GAPS, abs=1e-12)
    assert plot.final_note(difference) == "final +0.0070"


@pytest.mark.parametrize(
    ("fp8", "baseline", "title", "difference"),
    [
        ("current", "bf16", "validation loss: FP8 current against bf16", "FP8 current - bf16"),
        ("block", "fp32", "validation loss: FP8 block against fp32", "FP8 block - fp32"),
        ("mxfp8", "bf16", "validation loss: MXFP8 against bf16", "MXFP8 - bf16"),
        ("nvfp4", "fp32", "validation loss: NVFP4 against fp32", "NVFP4 - fp32"),
    ],
)
def test_each_recipe_is_named_in_the_title_and_difference(
    fp8: str, baseline: str, title: str, difference: str
) -> None:
    shown = plot.loss_plot(compare_rows(fp8, baseline))
    assert shown.headline == title
    assert [d.label for d in shown.differences] == [difference]
    assert [s.label for s in shown.curves if s.validation] == [
        baseline,
        plot.display_name(fp8),
    ]


def test_one_recipe_has_no_difference_panel() -> None:
    for recipe, title in (("delayed", "loss: FP8 delayed"), ("bf16", "loss: bf16")):
        rows = [r for r in compare_rows() if r["recipe"] == "bf16"]
        rows = [{**r, "recipe": recipe} for r in rows]
        shown = plot.loss_plot(rows)
        assert shown.headline == title and shown.differences == []
        assert [s.label for s in shown.curves if s.validation] == [plot.display_name(recipe)]
    assert plot.loss_plot([]).headline == "loss"


def test_the_difference_is_taken_where_both_runs_have_a_finite_validation_loss() -> None:
    rows = compare_rows(gaps=(0.0, 0.01, 0.02))
    rows = [r for r in rows if not (r["recipe"] == "bf16" and r["step"] == 10)]
    rows[-1]["val_loss"] = math.nan  # the FP8 run's last evaluation diverged
    (difference,) = plot.loss_plot(rows).differences
    assert difference.points == [(0, 0.0)]


def test_the_difference_axis_fits_the_difference_and_zero() -> None:
    (difference,) = plot.loss_plot(compare_rows()).differences
    ticks = plot.difference_ticks([difference])
    assert ticks[0] <= 0.0 and ticks[-1] >= 0.007
    assert ticks[-1] - ticks[0] <= 2 * 0.007  # a 0.007 gap spans at least half the axis
    _, loss_ticks = plot.axis_ticks(plot.loss_plot(compare_rows()).curves)
    assert 0.007 / (loss_ticks[-1] - loss_ticks[0]) < 0.01  # on the loss axis: under 1%
    below = plot.difference_ticks(
        [plot.Series("x", (0, 0, 0), [(0, -0.02), (5, -0.05)], True, False)]
    )
    assert below[0] <= -0.05 and below[-1] >= 0.0 and below[-1] - below[0] <= 0.1


# -- ticks ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("low", "high", "integer"),
    [
        (2.07, 5.6, False),
        (1.23, 1.31, False),
        (0.0012, 0.0047, False),
        (-0.004, 0.007, False),
        (3.0, 3.0, False),
        (0, 400, True),
        (0, 6, True),
        (5, 1234, True),
    ],
)
def test_plot_ticks_are_round_and_cover_the_data(low: float, high: float, integer: bool) -> None:
    ticks = plot.nice_ticks(low, high, integer=integer)
    assert 3 <= len(ticks) <= 8 and ticks[0] <= low and ticks[-1] >= high
    step = ticks[1] - ticks[0]
    mantissa = step / 10 ** math.floor(math.log10(step) + 1e-9)
    assert any(math.isclose(mantissa, m) for m in (1, 2, 2.5, 5)), step
    assert all(math.isclose(b - a, step) for a, b in itertools.pairwise(ticks))
    assert all(math.isclose(t / step, round(t / step), abs_tol=1e-9) for t in ticks)
    labels = plot.tick_labels(ticks)
    assert [float(label) for label in labels] == ticks  # each written exactly, and short
    assert max(len(label) for label in labels) <= len(f"{max(map(abs, ticks)):.0f}") + 6
    if integer:
        assert step >= 1 and not any("." in label for label in labels)


def test_plot_ticks_of_a_typical_run() -> None:
    assert plot.tick_labels(plot.nice_ticks(2.07, 5.6)) == ["2", "3", "4", "5", "6"]
    assert plot.tick_labels(plot.nice_ticks(1.23, 1.31))[:2] == ["1.22", "1.24"]
    assert plot.tick_labels(plot.nice_ticks(2.1, 2.9)) == ["2.0", "2.2", "2.4", "2.6", "2.8", "3.0"]
    assert plot.tick_labels(plot.nice_ticks(0.0, 0.007))[-1] == "0.008"


# -- the built-in writer (always: matplotlib hidden where it is installed) -------------------------


def _png_size_and_pixels(png: bytes) -> tuple[int, int, bytes]:
    """(width, height, filtered scanlines) of an 8-bit RGB PNG made of one IDAT chunk."""
    assert png.startswith(plot.PNG_SIGNATURE)
    width, height = struct.unpack(">II", png[16:24])
    idat = png.index(b"IDAT")
    (length,) = struct.unpack(">I", png[idat - 4 : idat])
    return width, height, zlib.decompress(png[idat + 4 : idat + 4 + length])


def _rgb_rows(png: bytes) -> list[list[tuple[int, int, int]]]:
    """The pixels of a PNG written by the built-in writer, row by row."""
    width, height, raw = _png_size_and_pixels(png)
    stride = 1 + 3 * width
    return [
        [tuple(raw[y * stride + 1 + 3 * x : y * stride + 4 + 3 * x]) for x in range(width)]
        for y in range(height)
    ]


def _count(rows, color, ys: range, xs: range) -> int:
    return sum(rows[y][x] == color for y in ys for x in xs)


def _panels(shown: plot.LossPlot) -> tuple[plot.Panel, plot.Panel]:
    """The loss and difference panels as render_png lays them out."""
    x_ticks, y_ticks = plot.axis_ticks(shown.curves)
    loss = plot.Panel(plot.LEFT, plot.TOP, plot.RIGHT, plot.DIFF_TOP - plot.PANEL_GAP,
                      x_ticks, y_ticks)  # fmt: skip
    diff_ticks = plot.difference_ticks(shown.differences)
    return loss, plot.Panel(plot.LEFT, plot.DIFF_TOP, plot.RIGHT, plot.BOTTOM, x_ticks, diff_ticks)


def test_builtin_png_writer_draws_without_matplotlib(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` now fails
    path = tmp_path / "plots" / "losses.png"
    assert plot.write_plot(path, compare_rows()) == "built-in"
    width, height, raw = _png_size_and_pixels(path.read_bytes())
    assert (width, height) == (plot.WIDTH, plot.HEIGHT)
    assert len(raw) == height * (1 + 3 * width)
    pixels = {pixel for row in _rgb_rows(path.read_bytes()) for pixel in row}
    pale = {tuple((c + 255) // 2 for c in color) for color in plot.COLORS[:2]}
    drawn = set(plot.COLORS[:2]) | pale  # val and train, per recipe; the difference
    assert pixels == drawn | {plot.WHITE, plot.BLACK, plot.GRID}


def test_builtin_draws_the_dashed_fp8_curve_over_the_wider_bf16_curve() -> None:
    shown = plot.loss_plot(flat_rows())
    rows = _rgb_rows(plot.render_png(shown))
    loss, _ = _panels(shown)
    (x0, y), (x1, _) = loss.to_px(0, 3.0), loss.to_px(10, 3.0)
    between = range(x0 + 8, x1 - 8)  # clear of the markers
    bf16, fp8 = plot.COLORS[0], plot.COLORS[1]
    runs = [
        (color, len(list(run))) for color, run in itertools.groupby(rows[y][x] for x in between)
    ]
    dash_on, dash_off = plot.DASH  # 3-pixel dots: a dash covers 2 pixels more, a gap 2 less
    assert set(runs[1:-1]) == {(fp8, dash_on + 2), (bf16, dash_off - 2)}  # bf16 in FP8's gaps
    for edge in (y - 2, y + 2):  # beside the 3-pixel FP8 line, within the 5-pixel bf16 one
        assert _count(rows, bf16, range(edge, edge + 1), between) == len(between)
    marker_x, _ = loss.to_px(10, 3.0)
    assert rows[y][marker_x] == fp8 and rows[y - 4][marker_x] == bf16  # its marker, around


def test_builtin_difference_panel_shows_the_gap_around_a_zero_line() -> None:
    gaps = (0.0, -0.002, 0.007)
    shown = plot.loss_plot(compare_rows(gaps=gaps))
    rows = _rgb_rows(plot.render_png(shown))
    _, diff = _panels(shown)
    assert diff.y_ticks == plot.nice_ticks(-0.002, 0.007) == [-0.0025, 0.0, 0.0025, 0.005, 0.0075]
    _, zero = diff.to_px(0, 0.0)
    assert diff.top < zero < diff.bottom
    assert _count(rows, plot.BLACK, range(zero, zero + 1), range(diff.left, diff.right)) > 400
    fp8 = plot.COLORS[1]
    for step, gap in zip((0, 10, 20), gaps, strict=True):
        x, y = diff.to_px(step, gap)
        assert rows[y][x] == fp8
    _, top = diff.to_px(20, 0.007)
    assert zero - top > (diff.bottom - diff.top) // 2  # 0.007 is most of the panel's height


def test_builtin_writes_titles_legends_and_labels(monkeypatch: pytest.MonkeyPatch) -> None:
    written = []
    text = plot.Canvas.text

    def record(canvas, x, y, string, *args, **kwargs):
        written.append(string)
        return text(canvas, x, y, string, *args, **kwargs)

    monkeypatch.setattr(plot.Canvas, "text", record)
    plot.render_png(plot.loss_plot(compare_rows(), "a byte-level GPT on cpu"))
    for string in (
        "validation loss: FP8 delayed against bf16",
        "a byte-level GPT on cpu",
        "bf16",
        "FP8 delayed",
        "bf16 train",
        "FP8 delayed train",
        "FP8 delayed - bf16",
        "final +0.0070",
        plot.X_LABEL,
        plot.Y_LABEL,
        plot.DIFF_LABEL,
        "0.008",  # the difference axis' top tick
    ):
        assert string in written, string
    assert written.count(plot.X_LABEL) == 1  # under the lower panel only
    written.clear()
    plot.render_png(plot.loss_plot([r for r in compare_rows() if r["recipe"] == "bf16"]))
    assert plot.DIFF_LABEL not in written and "loss: bf16" in written


def test_builtin_plot_has_a_title_axis_labels_and_round_ticks() -> None:
    shown = plot.loss_plot(compare_rows(), "loss (nats/byte): 2 layers, x=1/2")
    titled = _rgb_rows(plot.render_png(shown))
    title_band = range(0, plot.TOP - 8)  # above the top tick label
    assert _count(titled, plot.BLACK, title_band, range(plot.WIDTH)) > 100
    y_label = range(plot.TOP, plot.BOTTOM), range(0, 20)  # drawn upward along the left edge
    assert _count(titled, plot.BLACK, *y_label) > 200  # the loss's and the difference's
    x_label = range(plot.BOTTOM + 26, plot.BOTTOM + 40), range(plot.LEFT, plot.RIGHT)
    assert _count(titled, plot.BLACK, *x_label) > 30
    # The loss axis spans whole ticks: grid rows only at the interior ones.
    loss, _ = _panels(shown)
    grid_rows = [
        y for y in range(loss.top + 1, loss.bottom) if titled[y][loss.left + 2] == plot.GRID
    ]
    assert len(grid_rows) == len(plot.nice_ticks(3.0, 5.5)) - 2
    plot_x = range(loss.left + 1, loss.right)
    assert all(sum(titled[y][x] != plot.WHITE for x in plot_x) > 400 for y in grid_rows)


def test_builtin_font_draws_what_the_labels_use_in_lower_case() -> None:
    shown = plot.loss_plot(compare_rows("nvfp4", "fp32"), "loss of a byte-level GPT")
    used = set(shown.headline + shown.subtitle + plot.X_LABEL + plot.Y_LABEL + plot.DIFF_LABEL)
    used |= set("".join(plot.RECIPE_NAMES.values()) + "abcdefghijklmnopqrstuvwxyz()/:,+=_%")
    for char in used:
        assert char in plot._GLYPH_ROWS, char
        canvas = plot.Canvas(8, 16)
        canvas.text(0, 0, char)
        inked = canvas.pixels.count(0) // 3  # black pixels
        assert (inked == 0) == (char == " "), char
    lower, upper = plot.Canvas(40, 16), plot.Canvas(40, 16)
    lower.text(0, 0, "step")
    upper.text(0, 0, "STEP")
    assert lower.pixels != upper.pixels  # lower case is its own, not capitals
    shapes = {plot._GLYPH_ROWS[c] for c in "abcdefghijklmnopqrstuvwxyz"}
    assert len(shapes) == 26
    hanging = plot.Canvas(8, 16)
    hanging.text(0, 0, "y")
    below = hanging.pixels[plot.CHAR_H * 8 * 3 :]  # rows under the capitals' height
    assert below.count(0) > 0


def test_canvas_dashes_run_on_across_corners() -> None:
    canvas = plot.Canvas(40, 12)
    canvas.polyline([(0, 5), (20, 5), (20, 9)], plot.BLACK, 1, (4, 2))
    drawn = [(x, y) for y in range(12) for x in range(40) if canvas.pixels[(y * 40 + x) * 3] == 0]
    path = [(x, 5) for x in range(21)] + [(20, y) for y in range(6, 10)]
    assert drawn == sorted((p for k, p in enumerate(path) if k % 6 < 4), key=lambda p: p[::-1])
    solid = plot.Canvas(40, 12)
    solid.polyline([(0, 5), (20, 5)], plot.BLACK)
    assert solid.pixels.count(0) // 3 == 21


# -- matplotlib ------------------------------------------------------------------------------------


@pytest.fixture
def pyplot():
    """matplotlib's pyplot on the Agg backend (the test is skipped without matplotlib)."""
    matplotlib = pytest.importorskip("matplotlib")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    yield plt
    plt.close("all")


def _lines_by_label(ax) -> dict:
    return {line.get_label(): line for line in ax.get_lines()}


def test_matplotlib_draws_bf16_and_fp8_distinct_and_in_order(pyplot) -> None:
    fig = plot.draw_figure(plot.loss_plot(compare_rows(), "the model"), pyplot)
    loss_ax, diff_ax = fig.axes[:2]
    assert fig.get_suptitle() == "validation loss: FP8 delayed against bf16"
    assert loss_ax.get_title() == "the model"
    lines = _lines_by_label(loss_ax)
    assert list(lines) == ["bf16 train", "FP8 delayed train", "bf16", "FP8 delayed"]
    bf16, fp8 = lines["bf16"], lines["FP8 delayed"]
    assert bf16.get_linestyle() == "-" and fp8.get_linestyle() == "--"
    assert bf16.get_marker() != fp8.get_marker()
    assert bf16.get_color() != fp8.get_color()
    assert bf16.get_linewidth() > fp8.get_linewidth()  # the baseline shows around FP8's
    assert bf16.get_markersize() > fp8.get_markersize()
    assert bf16.get_zorder() < fp8.get_zorder()
    assert lines["bf16 train"].get_zorder() < bf16.get_zorder()
    assert lines["FP8 delayed train"].get_linestyle() == "--"
    assert list(fp8.get_ydata()) == pytest.approx(
        [v + g for (_, _, v), g in zip(STEPS, GAPS, strict=True)]
    )
    legend = [t.get_text() for t in loss_ax.get_legend().get_texts()]
    assert legend == ["bf16 train", "FP8 delayed train", "bf16", "FP8 delayed"]
    y_ticks = plot.nice_ticks(3.0, 5.5)  # the losses' range, train included
    assert loss_ax.get_ylim() == (y_ticks[0], y_ticks[-1])
    assert list(loss_ax.get_yticks()) == y_ticks
    assert [t.get_text() for t in loss_ax.get_yticklabels()] == plot.tick_labels(y_ticks)
    assert loss_ax.get_ylabel() == plot.Y_LABEL and diff_ax.get_xlabel() == plot.X_LABEL
    assert loss_ax.get_xlim() == diff_ax.get_xlim() == (0, 20)


def test_matplotlib_difference_panel_zooms_on_the_gap(pyplot) -> None:
    fig = plot.draw_figure(plot.loss_plot(compare_rows()), pyplot)
    assert len(fig.axes) == 2
    loss_ax, diff_ax = fig.axes
    (zero,) = [line for line in diff_ax.get_lines() if set(line.get_ydata()) == {0.0}]
    assert zero.get_linestyle() == "-"
    difference = _lines_by_label(diff_ax)["FP8 delayed - bf16"]
    assert list(difference.get_xdata()) == [0, 10, 20]
    assert list(difference.get_ydata()) == pytest.approx(GAPS, abs=1e-12)
    assert difference.get_color() == _lines_by_label(loss_ax)["FP8 delayed"].get_color()
    low, high = diff_ax.get_ylim()
    assert low <= 0.0 and high >= 0.007 and high - low <= 2 * 0.007
    assert (low, high) == (0.0, 0.008)
    assert diff_ax.get_ylabel() == plot.DIFF_LABEL
    assert [t.get_text() for t in diff_ax.texts] == ["final +0.0070"]
    assert [t.get_text() for t in diff_ax.get_legend().get_texts()] == ["FP8 delayed - bf16"]
    loss_low, loss_high = loss_ax.get_ylim()
    assert 0.007 / (loss_high - loss_low) < 0.01  # why the panel is there


def test_matplotlib_one_recipe_draws_one_panel(pyplot) -> None:
    rows = [{**r, "recipe": "current"} for r in compare_rows() if r["recipe"] == "bf16"]
    fig = plot.draw_figure(plot.loss_plot(rows, "t"), pyplot)
    (ax,) = fig.axes
    assert fig.get_suptitle() == "loss: FP8 current"
    assert [line.get_label() for line in ax.get_lines()] == ["FP8 current train", "FP8 current"]
    assert ax.get_xlabel() == plot.X_LABEL


def test_write_plot_uses_matplotlib_when_it_imports(pyplot, tmp_path: Path) -> None:
    path = tmp_path / "out" / "losses.png"
    assert plot.write_plot(path, compare_rows(), "the title") == "matplotlib"
    assert path.read_bytes().startswith(plot.PNG_SIGNATURE)
    assert pyplot.get_fignums() == []  # closed once written

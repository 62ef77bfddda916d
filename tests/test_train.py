"""Tests of the README's main job, `python -m torchte.train`, at tiny sizes on the CPU."""

from __future__ import annotations

import csv
import io
import itertools
import math
import re
from pathlib import Path

import pytest
import torch

import torchte._device
from torchte.train import cli, data, loop, model, moe, plot, progress, report
from torchte.train.config import ModelConfig, RunConfig

TEXT = "".join(f"def f{i}(x):\n    return x * {i} + {i % 7}  # line {i}\n" for i in range(400))


def write_corpus(tmp_path: Path) -> Path:
    """A folder of a few UTF-8 text files (about 20 KB) under `tmp_path`."""
    folder = tmp_path / "corpus"
    folder.mkdir()
    for i in range(4):
        (folder / f"part{i}.py").write_text(TEXT[i * 5000 : (i + 1) * 5000])
    return folder


@pytest.fixture
def corpus_dir(tmp_path: Path) -> Path:
    """A folder of a few UTF-8 text files (about 20 KB)."""
    return write_corpus(tmp_path)


def tiny(corpus: Path, out: Path, *extra: str) -> list[str]:
    """Command-line arguments of a run of a few seconds (computing in bf16 unless `extra` says
    otherwise: the same on every CPU, with no timing probe)."""
    return [
        "--device", "cpu", "--size", "tiny", "--steps", "6", "--batch-size", "2",
        "--seq-len", "32", "--log-every", "2", "--eval-every", "3", "--eval-batches", "2",
        "--data", str(corpus), "--out", str(out), "--compute-dtype", "bf16", *extra,
    ]  # fmt: skip


def losses(results: list[loop.RunResult]) -> list[tuple]:
    return [
        (r["recipe"], r["step"], r["train_loss"], r["val_loss"]) for x in results for r in x.rows
    ]


# -- runs ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("compute", ["bf16", "fp32"])
@pytest.mark.parametrize("recipe", ["bf16", "delayed", "current"])
def test_each_recipe_trains_and_writes_its_outputs(
    recipe: str, compute: str, corpus_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    out = tmp_path / "out"
    (result,) = cli.train(tiny(corpus_dir, out, "--recipe", recipe, "--compute-dtype", compute))
    label = compute if recipe == "bf16" else recipe  # the run without FP8 goes by its dtype
    assert result.recipe == label and result.steps == 6
    assert [r["step"] for r in result.rows] == [0, 2, 3, 4, 6]
    assert all(math.isfinite(r["train_loss"]) for r in result.rows[1:])
    vals = [r["val_loss"] for r in result.rows if r["val_loss"] is not None]
    assert len(vals) == 3 and vals[-1] < vals[0] - 0.5  # the loss falls from ln(256) = 5.55
    printed = capsys.readouterr()
    assert re.search(r"model: 2 layers, hidden 128, .*: 0\.4\dM parameters", printed.out)
    assert f"(float32 weights, {compute} compute)" in printed.out
    assert f"compute {compute} (--compute-dtype {compute})" in printed.out  # the run's header
    assert f"[{label}] step 6/6 loss" in printed.err  # plain progress lines off a terminal
    lines = printed.out.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("recipe "))
    kind = compute if recipe == "bf16" else f"fp8+{compute}"
    assert lines[header + 2].split()[:3] == [label, kind, "6"]
    assert "(peak RSS)" in lines[header + 2]
    assert lines[header + 3].startswith(f"compute {compute} (--compute-dtype {compute})")
    with (out / "losses.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert [row["step"] for row in rows] == ["0", "2", "3", "4", "6"]
    assert {row["recipe"] for row in rows} == {label}
    assert rows[0]["train_loss"] == "" and float(rows[-1]["val_loss"]) == vals[-1]
    assert (out / "losses.png").read_bytes().startswith(plot.PNG_SIGNATURE)


@pytest.mark.parametrize("recipe", ["block", "mxfp8", "nvfp4"])
def test_block_recipes_train(recipe: str, corpus_dir: Path, tmp_path: Path) -> None:
    """The block-scaled recipes (emulated on the CPU) learn as the per-tensor ones do; with
    --experts the grouped layers run under them too."""
    args = ("--recipe", recipe, "--compute-dtype", "fp32", "--experts", "2")
    (result,) = cli.train(tiny(corpus_dir, tmp_path / "out", *args))
    assert result.recipe == recipe and result.steps == 6
    vals = [r["val_loss"] for r in result.rows if r["val_loss"] is not None]
    assert all(math.isfinite(v) for v in vals) and vals[-1] < vals[0] - 0.5


def test_experts_compare_bf16_and_fp8(
    corpus_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    results = cli.train(tiny(corpus_dir, tmp_path, "--experts", "4", "--compare"))
    assert [r.recipe for r in results] == ["bf16", "delayed"]
    for result in results:
        vals = [r["val_loss"] for r in result.rows if r["val_loss"] is not None]
        assert vals[-1] < vals[0] - 0.5
    assert "4 experts, top-2" in capsys.readouterr().out


def test_resume_continues_with_bit_identical_losses(corpus_dir: Path, tmp_path: Path) -> None:
    args = tiny(corpus_dir, tmp_path / "out", "--compare", "--steps", "8", "--eval-every", "4")
    whole = cli.train(args)
    ckpt = tmp_path / "ckpt" / "run.pt"
    first = cli.train([*args, "--stop-at", "4", "--save", str(ckpt)])
    assert [r.steps for r in first] == [4, 4]
    assert sorted(p.name for p in ckpt.parent.iterdir()) == ["run-bf16.pt", "run-delayed.pt"]
    resumed = cli.train([*args, "--resume", str(ckpt)])
    assert losses(resumed) == losses(whole)  # exactly, every logged loss of both recipes
    assert losses(first) == [row for row in losses(whole) if row[1] <= 4]


def test_resume_with_another_model_or_recipe_is_refused(
    corpus_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    ckpt = tmp_path / "run.pt"
    args = tiny(corpus_dir, tmp_path, "--steps", "2", "--recipe", "bf16")
    cli.train([*args, "--save", str(ckpt)])
    with pytest.raises(SystemExit, match=r"seq_len 32 \(now 48\).*--seq-len"):
        cli.train([*args, "--seq-len", "48", "--resume", str(ckpt)])
    with pytest.raises(SystemExit, match=r"trained with recipe bf16.*--recipe bf16"):
        cli.train([*tiny(corpus_dir, tmp_path, "--recipe", "current"), "--resume", str(ckpt)])
    with pytest.raises(SystemExit, match=r"rope False \(now True\).*--rope"):
        cli.train([*args, "--rope", "--resume", str(ckpt)])
    with pytest.raises(SystemExit, match="no such checkpoint"):
        cli.train([*args, "--resume", str(tmp_path / "missing.pt")])


# -- FP8 scaling state ---------------------------------------------------------------------------


def _trainer(corpus_dir: Path, tmp_path: Path, recipe: str, *extra: str) -> loop.Trainer:
    model_config, config = cli.parse_args(tiny(corpus_dir, tmp_path, "--recipe", recipe, *extra))
    corpus = data.load_corpus(config.data, config.max_bytes, model_config.seq_len)
    return loop.Trainer(recipe, model_config, config, corpus)


def test_delayed_scaling_state_round_trips_through_state_dict(
    corpus_dir: Path, tmp_path: Path
) -> None:
    trainer = _trainer(corpus_dir, tmp_path, "delayed")
    for _ in range(3):
        trainer.train_step()
    saved = model.scaling_snapshot(trainer.model)
    assert len(saved) == 7  # per block QKV, projection and MLP (2 blocks), and the head
    *blocks, head = saved
    assert head == {}  # the output layer runs outside FP8: it never scaled anything
    assert all(s["fwd_amax_history"].abs().sum() > 0 for s in blocks)
    assert any((s["fwd_scale"] != 1).any() for s in blocks)
    fresh = model.GPT(trainer.model.config, loop.PARAMS_DTYPE, torch.device("cpu"))
    fresh.load_state_dict(trainer.model.state_dict())
    for before, after in zip(saved, model.scaling_snapshot(fresh), strict=True):
        assert before.keys() == after.keys()
        for key in before:
            assert torch.equal(torch.as_tensor(before[key]), torch.as_tensor(after[key])), key


def test_evaluation_leaves_the_scaling_state_as_it_was(corpus_dir: Path, tmp_path: Path) -> None:
    trainer = _trainer(corpus_dir, tmp_path, "delayed")
    trainer.evaluate()  # before any training step: no state, and none afterwards either
    assert all(
        (s["fwd_scale"] == 1).all() and (s["fwd_amax_history"] == 0).all()
        for s in model.scaling_snapshot(trainer.model)
        if s
    )
    trainer.train_step()
    before = model.scaling_snapshot(trainer.model)
    trainer.evaluate()
    after = model.scaling_snapshot(trainer.model)
    assert sum(bool(s) for s in before) == 6  # the head has no scaling state
    assert [bool(s) for s in after] == [bool(s) for s in before]
    for b, a in zip(before, after, strict=True):
        if b:
            assert torch.equal(b["fwd_amax_history"], a["fwd_amax_history"])
            assert torch.equal(b["fwd_scale"], a["fwd_scale"])


# -- the model -----------------------------------------------------------------------------------


@pytest.mark.parametrize(("compute", "dtype"), [("bf16", torch.bfloat16), ("fp32", torch.float32)])
def test_trainer_keeps_fp32_master_weights_and_computes_in_its_dtype(
    compute: str, dtype: torch.dtype, corpus_dir: Path, tmp_path: Path
) -> None:
    trainer = _trainer(corpus_dir, tmp_path, "delayed", "--compute-dtype", compute)
    trainer.train_step()
    params = list(trainer.model.parameters())
    assert all(p.dtype == torch.float32 for p in params)
    states = [trainer.optimizer.state[p] for p in params]
    assert all(s["exp_avg"].dtype == torch.float32 for s in states)
    tokens = trainer.val_batches[0][0]
    seen = []
    mlp = trainer.model.blocks[0].layernorm_mlp  # returns (output, bias)
    hook = mlp.register_forward_hook(lambda m, i, o: seen.append(o[0].dtype))
    with torch.no_grad(), trainer.autocast():
        assert trainer.model(tokens).dtype == dtype
    hook.remove()
    assert seen == [dtype]  # inside the model too, not only at the head


# -- data ----------------------------------------------------------------------------------------


def test_corpus_reads_text_files_in_path_order_and_skips_the_rest(tmp_path: Path) -> None:
    (tmp_path / "b").mkdir()
    (tmp_path / "a").mkdir()
    (tmp_path / "b" / "1.txt").write_bytes(b"B" * 300)
    (tmp_path / "a" / "2.txt").write_text("A\u00e9" * 100)  # UTF-8 text, 300 bytes
    (tmp_path / "a" / "latin1.txt").write_bytes("caf\u00e9".encode("latin-1") * 50)
    (tmp_path / "a" / "nul.bin").write_bytes(b"ab\x00cd" * 50)
    corpus = data.load_corpus(tmp_path, 10**6, seq_len=8)
    assert (corpus.files, corpus.skipped, corpus.capped) == (2, 2, False)
    stream = torch.cat([corpus.train, corpus.val])
    assert bytes(stream.tolist()) == ("A\u00e9" * 100).encode() + b"B" * 300  # a/ before b/
    assert corpus.val.numel() == 30 and corpus.train.numel() == 570  # the last 5%
    again = data.load_corpus(tmp_path, 10**6, seq_len=8)
    assert torch.equal(again.train, corpus.train) and again.fingerprint() == corpus.fingerprint()
    capped = data.load_corpus(tmp_path, 400, seq_len=8)
    assert capped.capped and capped.train.numel() + capped.val.numel() == 400
    raw, kept, _, cut = data.read_text_bytes([tmp_path / "a" / "2.txt"], 5)
    assert (raw, kept, cut) == (b"A\xc3\xa9A", 1, True)  # the cap splits no character
    raw, kept, _, cut = data.read_text_bytes(sorted(tmp_path.rglob("*.txt"))[:2], 300)
    assert (len(raw), kept, cut) == (300, 1, True)  # full after a/2.txt: the rest is not read
    short_seq = data.load_corpus(tmp_path, 10**6, seq_len=100)
    assert short_seq.val.numel() == 101  # at least one sequence to validate on


def test_default_corpus_is_the_standard_library_without_third_party_packages() -> None:
    description, paths = data.default_files()
    assert "standard library" in description and len(paths) > 100
    assert all(p.suffix == ".py" for p in paths)
    assert not any("site-packages" in p.parts or "dist-packages" in p.parts for p in paths)
    root = Path(description[description.index("(") + 1 : -1])
    keys = [p.relative_to(root).as_posix() for p in paths]
    assert keys == sorted(keys)


def test_batches_are_reproducible_and_resumable() -> None:
    stream = torch.arange(1000, dtype=torch.int64) % 256
    a = data.BatchSampler(stream.to(torch.uint8), 4, 16, seed=3)
    b = data.BatchSampler(stream.to(torch.uint8), 4, 16, seed=3)
    x, y = a.next()
    assert x.shape == (4, 16) and torch.equal(y[:, :-1], x[:, 1:])
    assert torch.equal(x, b.next()[0])
    state = a.get_state()
    expected = a.next()[0]
    b.set_state(state)
    assert torch.equal(b.next()[0], expected)
    val = data.validation_batches(stream.to(torch.uint8)[:40], 4, 16, count=3)
    assert len(val) == 3 and all(v[0].shape == (4, 16) for v in val)  # full even when short


# -- the mixture of experts ---------------------------------------------------------------------


def test_moe_with_sizes_on_the_device_equals_sizes_on_the_host(monkeypatch) -> None:
    outputs = []
    x = torch.randn(2, 5, 32, requires_grad=True)
    for on_device in (False, True):
        monkeypatch.setattr(moe, "DEVICE_SPLITS", on_device)
        torch.manual_seed(0)
        layer = moe.MoEMLP(
            32, 48, 4, 2, torch.float32, torch.device("cpu"), model._normal(0.2),
            model._normal(0.2),
        )  # fmt: skip
        assert layer.device_splits is on_device
        x.grad = None
        y = layer(x)
        y.square().sum().backward()
        outputs.append((y.detach(), x.grad.clone()))
    # the same rows through the same experts; the device path's buffer has spare rows
    torch.testing.assert_close(outputs[0][0], outputs[1][0])
    torch.testing.assert_close(outputs[0][1], outputs[1][1])


def test_moe_parameters_keep_their_order() -> None:
    layer = moe.MoEMLP(
        16, 8, 2, 1, torch.float32, torch.device("cpu"), model._normal(0.2), model._normal(0.2)
    )
    names = [n for n, _ in layer.named_parameters()]
    assert names[:3] == ["norm.weight", "norm.bias", "router.weight"]
    # one (E, N, K) weight and one (E, N) bias per expert GEMM (single_grouped_weight)
    assert names[3:] == ["experts.fc1.weight", "experts.fc1.bias", "experts.fc2.weight",
                         "experts.fc2.bias"]  # fmt: skip
    assert layer.experts.fc1.weight.shape == (2, 8, 16)


def test_moe_equals_a_loop_over_tokens_and_their_experts() -> None:
    hidden, ffn, n, k = 32, 48, 4, 2
    layer = moe.MoEMLP(
        hidden,
        ffn,
        n,
        k,
        torch.float32,
        torch.device("cpu"),
        model._normal(0.2),
        model._normal(0.2),
    )
    x = torch.randn(2, 5, hidden)
    y = layer(x)
    z = layer.norm(x.reshape(-1, hidden))
    top, chosen = layer.router(z).topk(k, dim=-1)
    gates = top.softmax(-1)
    p = dict(layer.named_parameters())
    expected = torch.zeros_like(z)
    for t in range(z.shape[0]):
        for j in range(k):
            e = int(chosen[t, j])
            h = z[t] @ p["experts.fc1.weight"][e].T + p["experts.fc1.bias"][e]
            h = torch.nn.functional.gelu(h, approximate="tanh")
            out = h @ p["experts.fc2.weight"][e].T + p["experts.fc2.bias"][e]
            expected[t] += gates[t, j] * out
    torch.testing.assert_close(y.reshape(-1, hidden), expected, rtol=1.3e-6, atol=1e-5)
    y.sum().backward()
    grad = p["experts.fc1.weight"].grad
    assert grad is not None and all(bool(grad[e].any()) for e in set(chosen.flatten().tolist()))


# -- errors --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--steps", "0"], "--steps must be positive, got 0"),
        (["--batch-size", "3", "--seq-len", "5", "--recipe", "delayed"], "multiple of 16: change"),
        (["--batch-size", "3", "--seq-len", "5"], "or use --recipe bf16"),  # the default compare
        (["--experts", "0"], "--experts must be at least 1, got 0"),
        (["--experts", "2", "--top-k", "3"], "--top-k must be between 1 and --experts (2)"),
        (["--compare", "--recipe", "bf16"], "give an FP8 --recipe"),
        (["--lr", "-1"], "--lr must be positive"),
        (["--recipe", "fp4"], "invalid choice: 'fp4'"),
        (["--gqa-groups", "3"], "--gqa-groups must divide the head count 4, got 3"),
        (["--gqa-groups", "-2"], "--gqa-groups must divide the head count 4, got -2"),
        (["--normalization", "BatchNorm"], "invalid choice: 'BatchNorm'"),
        (["--activation", "tanh"], "invalid choice: 'tanh'"),
    ],
)
def test_bad_arguments_exit_with_a_clear_message(
    args: list[str], message: str, capsys: pytest.CaptureFixture
) -> None:
    with pytest.raises(SystemExit) as info:
        cli.parse_args(["--device", "cpu", *args])
    assert info.value.code == 2
    assert message in capsys.readouterr().err


def test_bf16_needs_no_multiple_of_16() -> None:
    model_config, config = cli.parse_args(
        ["--device", "cpu", "--recipe", "bf16", "--batch-size", "3", "--seq-len", "5"]
    )
    assert (config.recipes, config.batch_size, model_config.seq_len) == (("bf16",), 3, 5)


@pytest.mark.parametrize(
    ("files", "message"),
    [
        (None, "no such file or folder; give an existing text file or folder"),
        ({}, "0 bytes of UTF-8 text in 0 file(s) (0 skipped)"),
        ({"img.bin": b"\xff\xd8\xff" * 100}, "0 bytes of UTF-8 text in 0 file(s) (1 skipped)"),
        ({"short.txt": b"x" * 40}, "training needs at least 66 bytes"),
    ],
)
def test_missing_or_small_corpus_exits_with_the_fix(
    files: dict | None, message: str, tmp_path: Path
) -> None:
    folder = tmp_path / "data"
    if files is not None:
        folder.mkdir()
        for name, content in files.items():
            (folder / name).write_bytes(content)
    with pytest.raises(SystemExit) as info:
        cli.train(tiny(folder, tmp_path / "out"))
    assert message in str(info.value.code)


def test_fp8_unsupported_on_the_device_names_what_to_use(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    monkeypatch.setattr(torchte._device, "fp8_support", lambda device: (False, "too old"))
    with pytest.raises(SystemExit) as info:
        cli.parse_args(["--device", "cpu", "--recipe", "delayed"])
    assert "FP8 is not supported on cpu: too old; use --recipe bf16" in str(info.value.code)
    _, config = cli.parse_args(["--device", "cpu"])  # the default comparison falls back
    assert config.recipes == ("bf16",)
    assert "running bf16 only" in capsys.readouterr().out


# -- outputs -------------------------------------------------------------------------------------

ROWS = [
    {"recipe": r, "step": s, "train_loss": t, "val_loss": v, "tokens_per_s": 1e3, "elapsed_s": 1.0}
    for r in ("bf16", "delayed")
    for s, t, v in ((0, None, 5.5), (10, 4.0, None), (20, 3.0, 3.1))
]


# The loss plot's tests are in tests/test_train_plot.py.


def test_csv_holds_every_logged_row(tmp_path: Path) -> None:
    path = tmp_path / "a" / "losses.csv"
    report.write_csv(path, ROWS)
    with path.open() as f:
        rows = list(csv.DictReader(f))
    assert list(rows[0]) == list(report.CSV_FIELDS)
    assert [(r["recipe"], r["step"], r["train_loss"], r["val_loss"]) for r in rows[:3]] == [
        ("bf16", "0", "", "5.5"),
        ("bf16", "10", "4.0", ""),
        ("bf16", "20", "3.0", "3.1"),
    ]


def test_table_shows_losses_speed_and_peak_memory() -> None:
    peak, kind = report.peak_memory(torch.device("cpu"))
    assert kind == "process peak RSS" and peak > 10 * 2**20  # torch alone takes over 10 MiB
    result = loop.RunResult("delayed", ROWS[3:], 20, 12345.6)
    summary = report.summarize(result, (3 * 2**30 // 2, "GPU allocated"), "fp8+fp32")
    assert (summary.first_val_loss, summary.val_loss, summary.train_loss) == (5.5, 3.1, 3.0)
    baseline = report.summarize(loop.RunResult("fp32", ROWS[:3], 20, 1.0), (0, "x"), "fp32")
    note = report.compute_note("fp32", "auto: bf16 is emulated on this CPU, 9x slower than fp32")
    lines = report.format_table([summary, baseline], note).splitlines()
    assert lines[0].split()[:4] == ["recipe", "compute", "steps", "train"]
    assert lines[2].split() == [
        "delayed", "fp8+fp32", "20", "3.0000", "5.5000", "->", "3.1000", "12,346", "1.5", "GiB",
        "(GPU", "allocated)",
    ]  # fmt: skip
    assert lines[3].split()[:2] == ["fp32", "fp32"]  # no FP8: what it computed in, twice
    assert lines[4] == note and note.startswith(
        "compute fp32 (auto: bf16 is emulated on this CPU, 9x slower than fp32); fp8+fp32: "
    )
    assert report.format_bytes(512 * 2**10) == "512 KiB"
    assert report.format_bytes(3 * 2**20) == "3.0 MiB"


# -- progress and schedule ------------------------------------------------------------------------


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_bar_redraws_in_place_at_most_a_few_times_a_second() -> None:
    stream = _Terminal()
    bar = progress.Progress("bf16", 100, 0, stream)
    reads = []
    for step in range(1, 101):
        bar.update(step, lambda: reads.append(1) or 2.5, 1000.0)
    bar.close()
    text = stream.getvalue()
    assert text.count("\r") == len(reads) < 10  # the first step and the last, few between
    assert "100/100 loss 2.5000" in text and "1,000 tok/s ETA 0:00" in text
    assert text.endswith("\n")


def test_progress_off_a_terminal_writes_one_line_per_row() -> None:
    stream = io.StringIO()
    bar = progress.Progress("current", 10, 0, stream)
    bar.update(5, lambda: pytest.fail("the loss is not read off a terminal"), 1.0)
    bar.log({**ROWS[2], "step": 5})
    assert stream.getvalue().startswith("[current] step 5/10 loss 3.0000 val 3.1000 1,000 tok/s")
    assert stream.getvalue().count("\n") == 1
    assert progress.format_duration(3725) == "1:02:05"


def test_learning_rate_warms_up_then_decays_to_a_tenth() -> None:
    config = RunConfig(("bf16",), "cpu", 100, 2, 1.0, 10, 0, 1, 1, 1, None, 1, Path("."))
    lrs = [loop.learning_rate(step, config) for step in range(1, 101)]
    assert lrs[0] == pytest.approx(0.1) and lrs[9] == pytest.approx(1.0)
    assert all(a >= b for a, b in itertools.pairwise(lrs[9:]))
    assert lrs[-1] == pytest.approx(0.1)


def test_model_config_checks_heads() -> None:
    with pytest.raises(ValueError, match="not divisible by heads"):
        ModelConfig(hidden=100, layers=1, heads=3, ffn=16, seq_len=8)

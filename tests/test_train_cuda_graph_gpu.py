"""`python -m torchte.train --cuda-graph on` on a GPU: the blocks replay CUDA graphs, the losses
(training and validation) are the eager run's, a graphed run resumes, and a graphed step issues
far fewer operations and kernel launches from the host than an eager one.

Tolerance of the losses: the bf16 row of the table (rtol 1.6e-2). The model computes in bf16
and the two runs need not round alike: with experts the eager run keeps the experts' row counts
on the host (cuBLAS per expert) and the graphed one on the device (grouped Triton GEMMs over a
buffer with spare rows), and cuBLAS may pick other algorithms inside a capture; each rounding
difference of one bf16 ulp then moves the next steps' weights. A graph replaying stale weights
or scales would be far off (the loss falls by more than 0.5 in these 6 steps, also asserted).
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from test_train import tiny, write_corpus
from tolerances import assert_close

from torchte.train import cli, data, loop

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU"),
]

# what the profiler calls a kernel launch from the host (runtime and driver API; a name may
# carry a suffix such as _v7000 or _ptsz)
LAUNCHES = ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchCooperativeKernel")
GRAPH_LAUNCH = "cudaGraphLaunch"


@pytest.fixture
def corpus_dir(tmp_path: Path) -> Path:
    return write_corpus(tmp_path)


def _args(corpus: Path, out: Path, *extra: str) -> list[str]:
    """The CPU tests' tiny run (6 steps of 2 x 32 tokens), on the GPU."""
    return tiny(corpus, out, "--device", "cuda", *extra)


def _rows(results: list[loop.RunResult]) -> tuple[list, torch.Tensor]:
    """([(step, which)] of every logged loss, the losses) of a run's rows."""
    keys, values = [], []
    for row in results[0].rows:
        for which in ("train_loss", "val_loss"):
            if row[which] is not None:
                keys.append((row["step"], which))
                values.append(row[which])
    return keys, torch.tensor(values, dtype=torch.float64)


@pytest.mark.parametrize("recipe", ["bf16", "current", "delayed"])
@pytest.mark.parametrize("experts", [0, 4])
def test_graphed_losses_equal_eager(
    experts: int, recipe: str, corpus_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    extra = ["--recipe", recipe] + (["--experts", str(experts)] if experts else [])
    eager = cli.train(_args(corpus_dir, tmp_path / "eager", *extra, "--cuda-graph", "off"))
    capsys.readouterr()
    graphed = cli.train(_args(corpus_dir, tmp_path / "graphed", *extra, "--cuda-graph", "on"))
    out = capsys.readouterr().out
    assert "CUDA graphs on (--cuda-graph on)" in out
    note = "each of the 2 blocks captured"
    if experts:
        note += ", the experts' row counts on the device"
    assert note in out
    keys_e, losses_e = _rows(eager)
    keys_g, losses_g = _rows(graphed)
    assert keys_g == keys_e and graphed[0].steps == 6
    assert all(math.isfinite(v) for v in losses_g.tolist())
    assert_close(losses_g, losses_e, torch.bfloat16)
    vals = [r["val_loss"] for r in graphed[0].rows if r["val_loss"] is not None]
    assert vals[-1] < vals[0] - 0.5  # the graphs train the live weights


def test_compare_captures_each_recipe_anew(
    corpus_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """--compare: the bf16 run's graphs are freed when it ends, the FP8 run captures its own
    (under its recipe); both train."""
    args = _args(corpus_dir, tmp_path, "--compare", "--recipe", "current", "--experts", "4")
    results = cli.train([*args, "--cuda-graph", "on"])
    out = capsys.readouterr().out
    assert [r.recipe for r in results] == ["bf16", "current"]
    for result in results:
        assert f"[{result.recipe}] CUDA graphs: each of the 2 blocks captured" in out
        vals = [r["val_loss"] for r in result.rows if r["val_loss"] is not None]
        assert result.steps == 6 and vals[-1] < vals[0] - 0.5


def test_graphed_run_resumes(corpus_dir: Path, tmp_path: Path) -> None:
    """Stopped at step 3 and resumed (the resumed run captures again): the uninterrupted
    graphed run's losses (within the tolerance above: a GPU run's last bits vary)."""
    args = _args(corpus_dir, tmp_path / "out", "--recipe", "delayed", "--cuda-graph", "on")
    whole = cli.train(args)
    ckpt = tmp_path / "run.pt"
    cli.train([*args, "--stop-at", "3", "--save", str(ckpt)])
    resumed = cli.train([*args, "--resume", str(ckpt)])
    keys_w, losses_w = _rows(whole)
    keys_r, losses_r = _rows(resumed)
    assert keys_r == keys_w
    assert_close(losses_r, losses_w, torch.bfloat16)


def _trainer(corpus_dir: Path, out: Path, experts: int, graphs: str) -> loop.Trainer:
    """A Trainer of the small model (4 blocks) under current scaling, 2 x 64 tokens a step."""
    args = ["--size", "small", "--seq-len", "64", "--recipe", "current", "--cuda-graph", graphs]
    args += ["--experts", str(experts)] if experts else []
    model_config, config = cli.parse_args(_args(corpus_dir, out, *args))
    corpus = data.load_corpus(config.data, config.max_bytes, model_config.seq_len)
    return loop.Trainer("current", model_config, config, corpus)


def _profiled_step(trainer: loop.Trainer, monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """Counts of one training step after two others (capture, first replays): graph replays
    (torch.cuda.CUDAGraph.replay calls), operators dispatched from Python ("aten::" events of
    the profiler), kernel launches and graph launches the profiler saw from the host."""
    for _ in range(2):
        trainer.train_step()
    torch.cuda.synchronize()
    replays = []
    original = torch.cuda.CUDAGraph.replay

    def replay(graph: torch.cuda.CUDAGraph) -> None:
        replays.append(graph)
        original(graph)

    monkeypatch.setattr(torch.cuda.CUDAGraph, "replay", replay)
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as prof:
        trainer.train_step()
        torch.cuda.synchronize()
    monkeypatch.setattr(torch.cuda.CUDAGraph, "replay", original)
    names = [e.name for e in prof.events()]
    return {
        "replays": len(replays),
        "aten": sum(name.startswith("aten::") for name in names),
        "launches": sum(name.startswith(LAUNCHES) for name in names),
        "graph_launches": sum(name.startswith(GRAPH_LAUNCH) for name in names),
    }


@pytest.mark.parametrize("experts", [0, 4])
def test_graphed_step_launches_far_fewer_kernels_from_the_host(
    experts: int, corpus_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    eager = _profiled_step(_trainer(corpus_dir, tmp_path, experts, "off"), monkeypatch)
    trainer = _trainer(corpus_dir, tmp_path, experts, "on")
    graphed = _profiled_step(trainer, monkeypatch)
    layers = len(trainer.model.blocks)
    assert layers == 4 and trainer.graphed == tuple(trainer.model.blocks)
    assert eager["replays"] == 0
    assert graphed["replays"] == 2 * layers  # each block: one forward and one backward graph
    # the embeddings, the head, the loss, the clipping and AdamW stay eager; the blocks go
    assert eager["aten"] > 0 and graphed["aten"] * 2 < eager["aten"], (graphed, eager)
    if eager["launches"] == 0:
        pytest.skip("the profiler records no CUDA runtime activity here (operators counted)")
    assert eager["graph_launches"] == 0
    assert graphed["graph_launches"] == 2 * layers
    assert graphed["launches"] * 2 < eager["launches"], (graphed, eager)

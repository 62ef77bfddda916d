"""The training example with `--optimizer fused-adam` (te.optimizers.FusedAdam), its
`--master-weights` and `--adam-moments`, at tiny sizes on the CPU: it trains, its weights and
states have the dtypes asked for, a resumed run continues bit for bit, and the options that do
not go together are refused with the fix."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from test_train import losses, tiny, write_corpus

from torchte.optimizers import FusedAdam
from torchte.train import cli, data, loop
from torchte.train.optimizer import ClippedAdamW

FUSED = ("--optimizer", "fused-adam")


@pytest.fixture
def corpus_dir(tmp_path: Path) -> Path:
    return write_corpus(tmp_path)


@pytest.mark.parametrize(
    "extra, weights, moments",
    [
        ((), torch.float32, torch.float32),
        (("--master-weights",), torch.bfloat16, torch.float32),
        (("--master-weights", "--adam-moments", "bf16"), torch.bfloat16, torch.bfloat16),
    ],
)
def test_fused_adam_trains_with_the_dtypes_asked_for(
    extra,
    weights,
    moments,
    corpus_dir: Path,
    tmp_path: Path,
    capsys,
) -> None:
    (result,) = cli.train(tiny(corpus_dir, tmp_path / "out", "--recipe", "current", *FUSED, *extra))
    vals = [r["val_loss"] for r in result.rows if r["val_loss"] is not None]
    assert vals[-1] < vals[0] - 0.5, vals
    trainer = _built(corpus_dir, tmp_path, *FUSED, *extra)
    assert isinstance(trainer.optimizer, FusedAdam)
    trainer.train_step()
    params = list(trainer.model.parameters())
    assert {p.dtype for p in params} == {weights}
    state = trainer.optimizer.state[params[0]]
    assert state["exp_avg"].dtype == moments == state["exp_avg_sq"].dtype
    assert ("master_param" in state) == (weights == torch.bfloat16)
    if weights == torch.bfloat16:
        assert state["master_param"].dtype == torch.float32
        assert torch.equal(state["master_param"].to(torch.bfloat16), params[0].detach())
        assert "bfloat16 (fp32 masters in the optimizer) weights" in capsys.readouterr().out


def _built(corpus: Path, tmp_path: Path, *extra: str) -> loop.Trainer:
    """A Trainer of the tiny run (recipe current) with `extra` options."""
    model_config, config = cli.parse_args(tiny(corpus, tmp_path, "--recipe", "current", *extra))
    text = data.load_corpus(config.data, config.max_bytes, model_config.seq_len)
    return loop.Trainer("current", model_config, config, text)


def test_the_default_optimizer_is_clipped_adamw(corpus_dir: Path, tmp_path: Path) -> None:
    assert isinstance(_built(corpus_dir, tmp_path).optimizer, ClippedAdamW)


def test_fused_adam_resumes_bit_for_bit(corpus_dir: Path, tmp_path: Path) -> None:
    options = (*FUSED, "--master-weights", "--adam-moments", "bf16")
    base = tiny(corpus_dir, tmp_path / "out", "--recipe", "delayed", "--steps", "8")
    args = [*base, "--eval-every", "4", *options]
    whole = cli.train(args)
    ckpt = tmp_path / "run.pt"
    cli.train([*args, "--stop-at", "4", "--save", str(ckpt)])
    resumed = cli.train([*args, "--resume", str(ckpt)])
    assert losses(resumed) == losses(whole)
    refusal = (
        r"trained with fused-adam \(master weights, bf16 moments\).*"
        r"--optimizer fused-adam --master-weights --adam-moments bf16"
    )
    with pytest.raises(SystemExit, match=refusal):
        cli.train([*base, "--resume", str(ckpt)])


@pytest.mark.parametrize(
    "extra, message",
    [
        (("--master-weights",), "add --optimizer fused-adam"),
        (("--adam-moments", "bf16"), "add --optimizer fused-adam"),
        ((*FUSED, "--master-weights", "--compute-dtype", "fp32"), "add --compute-dtype bf16"),
    ],
)
def test_options_that_do_not_go_together_are_refused(
    extra,
    message,
    corpus_dir: Path,
    tmp_path: Path,
    capsys,
) -> None:
    with pytest.raises(SystemExit):
        cli.parse_args([*tiny(corpus_dir, tmp_path), *extra])
    assert message in capsys.readouterr().err


def test_fused_adam_with_a_parallel_run_is_refused(
    corpus_dir: Path,
    tmp_path: Path,
    capsys,
    monkeypatch,
) -> None:
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(SystemExit):
        cli.parse_args([*tiny(corpus_dir, tmp_path), *FUSED, "--fsdp"])
    assert "--optimizer fused-adam runs in one process; --fsdp" in capsys.readouterr().err

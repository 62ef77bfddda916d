"""The training example's packed batches (--packed): documents back to back in each row, where no
token sees another document and positions restart at each; the per-document bookkeeping of
data.py and packing.py; and a short packed run that learns."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from test_train import tiny
from tolerances import assert_close

from torchte.train import cli, data, model, packing
from torchte.train.config import ModelConfig

SEQ = 16
# Row 0: documents of 5, 6 and 5 tokens; row 1: 9 and 7.
STARTS = [[0, 5, 11], [0, 9]]


def _doc_starts() -> torch.Tensor:
    doc_starts = torch.zeros(len(STARTS), SEQ, dtype=torch.bool)
    for row, starts in enumerate(STARTS):
        doc_starts[row, starts] = True
    return doc_starts


def test_positions_and_cu_seqlens_follow_the_documents() -> None:
    doc_starts = _doc_starts()
    want = [list(range(5)) + list(range(6)) + list(range(5)), list(range(9)) + list(range(7))]
    assert packing.positions(doc_starts).tolist() == want
    cu = packing.cu_seqlens(doc_starts)
    assert cu.dtype == torch.int32 and cu.tolist() == [0, 5, 11, 16, 25, 32]


def test_document_starts_are_file_starts_and_each_row_start() -> None:
    docs = torch.tensor([0, 10, 14])  # files of 10, 4 and more bytes
    got = data.document_starts(torch.tensor([3, 10]), 8, docs)
    want = torch.zeros(2, 8, dtype=torch.bool)
    want[0, [0, 7]] = True  # the window at 3 reaches the file at 10 at its column 7
    want[1, [0, 4]] = True  # the window at 10 starts one file and reaches the next at 14
    assert torch.equal(got, want)


def test_corpus_records_where_its_files_start(tmp_path: Path) -> None:
    for i, size in enumerate((300, 500, 200)):
        (tmp_path / f"{i}.txt").write_bytes(bytes([65 + i]) * size)
    corpus = data.load_corpus(tmp_path, 10**6, seq_len=8)
    assert corpus.train_docs.tolist() == [0, 300, 800] and corpus.val.numel() == 50
    assert corpus.val_docs.tolist() == []  # the last 50 bytes lie inside the third file
    sampler = data.BatchSampler(corpus.train, 4, 8, 0, corpus.train_docs, packed=True)
    inputs, targets, doc_starts = sampler.next()
    assert doc_starts.shape == inputs.shape == targets.shape
    # a document starts where a byte differs from the one before it (each file one letter)
    changes = torch.cat([torch.ones(4, 1, dtype=torch.bool), inputs[:, 1:] != inputs[:, :-1]], 1)
    assert torch.equal(doc_starts, changes)


def _losses_per_token(gpt: model.GPT, tokens, targets, *doc_starts) -> torch.Tensor:
    logits = gpt(tokens, *doc_starts)
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="none")


@pytest.mark.parametrize(
    "options",
    [
        {},
        {"rope": True, "gqa_groups": 2, "normalization": "RMSNorm", "activation": "swiglu"},
        {"rope": True, "experts": 4},
    ],
    ids=["learned-positions", "rope-gqa-rmsnorm-swiglu", "rope-experts"],
)
def test_packed_loss_is_the_sum_over_documents_run_alone(options: dict) -> None:
    """Each token's loss in a packed batch equals its loss with its document run alone (a
    one-row batch of the unpacked model with the same weights), so the batch's summed loss is
    the sum over its documents."""
    shape = {"hidden": 32, "layers": 2, "heads": 4, "ffn": 64, "seq_len": SEQ, **options}
    torch.manual_seed(0)
    packed = model.GPT(ModelConfig(packed=True, **shape), torch.float32, torch.device("cpu"))
    alone = model.GPT(ModelConfig(**shape), torch.float32, torch.device("cpu"))
    alone.load_state_dict(packed.state_dict())
    tokens = torch.randint(0, 256, (len(STARTS), SEQ))
    targets = torch.randint(0, 256, (len(STARTS), SEQ))
    with torch.no_grad():
        got = _losses_per_token(packed, tokens, targets, _doc_starts())
        want = []
        for row, starts in enumerate(STARTS):
            for begin, end in zip(starts, [*starts[1:], SEQ], strict=True):
                piece = slice(begin, end)
                want.append(
                    _losses_per_token(
                        alone, tokens[row : row + 1, piece], targets[row : row + 1, piece]
                    )
                )
        want = torch.cat(want).double()
    assert_close(got, want, torch.float32)
    assert_close(got.sum(), want.sum(), torch.float32)
    # the same rows unpacked see across the boundaries: other losses
    unpacked = _losses_per_token(alone, tokens, targets).detach()
    assert not torch.allclose(unpacked[5:11], got[5:11])


def test_packed_run_learns(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i in range(60):  # files shorter than a sequence: every row holds several documents
        (corpus / f"f{i:02}.py").write_text(f"def f{i}(x):\n    return x * {i}\n")
    args = tiny(corpus, tmp_path / "out", "--recipe", "current", "--packed", "--rope")
    args += ["--activation", "swiglu", "--normalization", "RMSNorm", "--gqa-groups", "2"]
    (result,) = cli.train(args)
    vals = [r["val_loss"] for r in result.rows if r["val_loss"] is not None]
    assert vals[-1] < vals[0] - 0.5
    printed = capsys.readouterr().out
    assert "RMSNorm, swiglu, RoPE, seq 32, packed documents" in printed
    assert "4 heads (2 kv groups)" in printed

"""The byte corpus: which files are read, how they are split, and how batches are drawn.

- Default corpus: the `*.py` files of the running interpreter's standard library
  (sysconfig.get_paths()["stdlib"]), third-party packages (site-packages, dist-packages) left
  out. `--data PATH`: one file, or every file under a folder, recursively.
- Files are read in the order of their relative paths (POSIX form, sorted), and concatenated as
  bytes. A file is kept when it is UTF-8 text: it decodes as UTF-8 and holds no NUL byte;
  other files (images, archives, other encodings) are skipped and counted.
- Reading stops once `max_bytes` are kept (the last file is cut there, and judged by the part
  read), so a huge folder or file costs bounded time and memory.
- Split: the last 5% of the byte stream (at least one sequence) is the validation set.
- Training batches start at offsets drawn by a seeded torch.Generator (saved in checkpoints, so
  a resumed run sees the same batches); validation batches are fixed, evenly spaced windows.
- Documents (for packed batches, --packed): each file kept is one document. A window is cut
  before every byte that starts a file, and its first byte starts a document too (the tail of
  the file it begins in), so a row of S tokens holds one or more documents back to back. The
  targets stay the stream's next bytes: a document's last token predicts the byte that
  follows it in the stream (the next file's first), seeing only its own document.

Legend: B batch size, S sequence length; tokens are bytes as int64 in [0, 256); doc_starts
(B, S) bool, True where a document starts (column 0 always).
"""

from __future__ import annotations

import codecs
import math
import os
import sysconfig
import zlib
from dataclasses import dataclass
from pathlib import Path

import torch

VALIDATION_FRACTION = 0.05
THIRD_PARTY_DIRS = ("site-packages", "dist-packages")


@dataclass(frozen=True)
class Corpus:
    """The byte stream split in two, and where it came from."""

    train: torch.Tensor
    """uint8 (N_train,)."""
    val: torch.Tensor
    """uint8 (N_val,)."""
    source: str
    """What was read, for the log."""
    files: int
    """Files kept."""
    skipped: int
    """Files skipped as not UTF-8 text."""
    capped: bool
    """Whether reading stopped at max_bytes."""
    train_docs: torch.Tensor | None = None
    """int64 (D_train,): offsets in `train` where a file starts (None: no boundaries known)."""
    val_docs: torch.Tensor | None = None
    """int64 (D_val,): offsets in `val` where a file starts."""

    def fingerprint(self) -> str:
        """Sizes and CRC-32 of both parts: a resumed run checks it sees the same data."""
        crc = zlib.crc32(self.val.numpy().tobytes(), zlib.crc32(self.train.numpy().tobytes()))
        return f"{self.train.numel()}+{self.val.numel()}:{crc:08x}"


def default_files() -> tuple[str, list[Path]]:
    """(description, sorted paths) of the standard library's Python sources."""
    root = Path(sysconfig.get_paths()["stdlib"])
    paths = []
    for folder, subfolders, names in os.walk(root):
        subfolders[:] = [d for d in subfolders if d not in THIRD_PARTY_DIRS]
        paths += [Path(folder, n) for n in names if n.endswith(".py")]
    paths = [p for p in paths if p.is_file()]
    return f"the Python standard library ({root})", sorted(paths, key=lambda p: _key(p, root))


def data_files(path: Path) -> tuple[str, list[Path]]:
    """(description, sorted paths) for --data: the file itself, or every file under it."""
    if not path.exists():
        raise SystemExit(
            f"--data {path}: no such file or folder; give an existing text file or folder, "
            "or leave --data out to train on the Python standard library"
        )
    if path.is_file():
        return str(path), [path]
    paths = [p for p in path.rglob("*") if p.is_file()]
    return str(path), sorted(paths, key=lambda p: _key(p, path))


def _key(path: Path, root: Path) -> str:
    return path.relative_to(root).as_posix()


def read_text_bytes(paths: list[Path], max_bytes: int) -> tuple[bytes, int, int, bool]:
    """(the UTF-8 text files' bytes concatenated, files kept, files skipped, capped)."""
    parts, skipped, capped = read_text_parts(paths, max_bytes)
    return b"".join(parts), len(parts), skipped, capped


def read_text_parts(paths: list[Path], max_bytes: int) -> tuple[list[bytes], int, bool]:
    """(each UTF-8 text file's bytes kept, in order; files skipped; capped)."""
    parts: list[bytes] = []
    skipped = total = 0
    for path in paths:
        if total == max_bytes:  # full, with files left
            return parts, skipped, True
        text = _text_prefix(path, max_bytes - total)
        if text is None:
            skipped += 1
            continue
        raw, cut = text
        parts.append(raw)
        total += len(raw)
        if cut:
            return parts, skipped, True
    return parts, skipped, False


def _text_prefix(path: Path, limit: int) -> tuple[bytes, bool] | None:
    """(the file's first `limit` bytes, whether it was cut), or None when those bytes are not
    UTF-8 text or cannot be read. A cut that splits a character drops the partial one."""
    try:
        with path.open("rb") as f:
            raw = f.read(limit + 1)
    except OSError:
        return None
    cut = len(raw) > limit
    raw = raw[:limit]
    if b"\x00" in raw:
        return None
    decoder = codecs.getincrementaldecoder("utf-8")()
    try:
        decoder.decode(raw, final=not cut)  # an unfinished last character is fine at a cut
    except UnicodeDecodeError:
        return None
    pending = len(decoder.getstate()[0])
    return raw[: len(raw) - pending], cut


def load_corpus(data: Path | None, max_bytes: int, seq_len: int) -> Corpus:
    """Read and split the corpus; SystemExit with the fix when it is missing or too short."""
    source, paths = default_files() if data is None else data_files(data)
    parts, skipped, capped = read_text_parts(paths, max_bytes)
    raw, kept = b"".join(parts), len(parts)
    need = 2 * (seq_len + 1)
    if len(raw) < need:
        found = f"{len(raw)} bytes of UTF-8 text in {kept} file(s) ({skipped} skipped)"
        raise SystemExit(
            f"corpus {source}: {found}, but training needs at least {need} bytes "
            f"(a sequence of {seq_len + 1} for training and one for validation); "
            "give --data a larger text file or folder, or lower --seq-len"
        )
    stream = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
    n_val = max(math.ceil(len(raw) * VALIDATION_FRACTION), seq_len + 1)
    n_train = len(raw) - n_val
    lengths = torch.tensor([0] + [len(part) for part in parts], dtype=torch.int64)
    file_starts = lengths.cumsum(0)[:-1]
    train_docs = file_starts[file_starts < n_train]
    val_docs = file_starts[file_starts >= n_train] - n_train
    return Corpus(
        stream[:n_train], stream[n_train:], source, kept, skipped, capped, train_docs, val_docs
    )


def windows(stream: torch.Tensor, starts: torch.Tensor, seq_len: int):
    """(inputs (B, S), targets (B, S)) int64: the windows of `stream` at `starts` (B,)."""
    index = starts[:, None] + torch.arange(seq_len + 1)
    tokens = stream[index].long()
    return tokens[:, :-1], tokens[:, 1:]


def document_starts(starts: torch.Tensor, seq_len: int, docs: torch.Tensor | None) -> torch.Tensor:
    """doc_starts (B, S) bool of the windows at `starts` (B,): True at column 0 and where a
    file starts (`docs`, offsets into the stream; None: at column 0 only)."""
    index = starts[:, None] + torch.arange(seq_len)
    first = torch.zeros_like(index, dtype=torch.bool)
    first[:, 0] = True
    return first if docs is None else first | torch.isin(index, docs)


def batch(stream: torch.Tensor, starts: torch.Tensor, seq_len: int, docs, packed: bool) -> tuple:
    """(inputs, targets) of windows(), and with `packed` their doc_starts (document_starts)."""
    inputs, targets = windows(stream, starts, seq_len)
    if not packed:
        return inputs, targets
    return inputs, targets, document_starts(starts, seq_len, docs)


class BatchSampler:
    """Training batches at random offsets, drawn by its own seeded generator on the CPU.
    With `packed`, each batch also says where its documents start (offsets `docs`)."""

    def __init__(
        self,
        stream: torch.Tensor,
        batch_size: int,
        seq_len: int,
        seed: int,
        docs: torch.Tensor | None = None,
        packed: bool = False,
    ) -> None:
        self.stream, self.batch_size, self.seq_len = stream, batch_size, seq_len
        self.docs, self.packed = docs, packed
        self.generator = torch.Generator().manual_seed(seed)

    def next(self) -> tuple[torch.Tensor, ...]:
        """The next (inputs (B, S), targets (B, S)) int64 on the CPU [, doc_starts (B, S) bool
        with packed]."""
        high = self.stream.numel() - self.seq_len  # the last start leaves room for the target
        starts = torch.randint(0, high, (self.batch_size,), generator=self.generator)
        return batch(self.stream, starts, self.seq_len, self.docs, self.packed)

    def get_state(self) -> torch.Tensor:
        """The generator's state (for a checkpoint)."""
        return self.generator.get_state()

    def set_state(self, state: torch.Tensor) -> None:
        """Continue from a state get_state returned."""
        self.generator.set_state(state)


def validation_batches(
    stream: torch.Tensor,
    batch_size: int,
    seq_len: int,
    count: int,
    docs: torch.Tensor | None = None,
    packed: bool = False,
) -> list[tuple[torch.Tensor, ...]]:
    """`count` fixed batches of evenly spaced windows over the validation stream (windows
    overlap where the stream is short; every batch is full, so FP8 token counts hold), as
    BatchSampler.next makes them."""
    high = stream.numel() - seq_len - 1  # the largest start
    starts = torch.linspace(0, high, count * batch_size, dtype=torch.float64).round().long()
    return [batch(stream, s, seq_len, docs, packed) for s in starts.split(batch_size)]

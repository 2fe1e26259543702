"""Dataset files (parquet, jsonl) read with pyarrow into `Record`s, their fingerprint, and the epoch-ordered stream
that decides which rows batch `l` holds.

The stream: the `n` rows (all files, in order, after the prompt-length filter) are permuted once per epoch with a
generator seeded by `(seed, epoch)` (identity when `shuffle` is off); epoch `e` occupies stream positions
`e*n .. e*n+n-1`, and batch `l` of size `B` is positions `l*B .. l*B+B-1`, running into the next epoch (and its new
permutation) when it passes the end. So batch `l` is a pure function of `(l, B, seed)` and of the rows: a resumed
run regenerates exactly the prompts it would have had, and its checkpoint only needs `l` plus a record (epoch,
index within the epoch, fingerprint) to check that it resumes on the same data.
"""

from __future__ import annotations

import hashlib
import random
from functools import lru_cache
from pathlib import Path
from typing import Any

import pyarrow.json
import pyarrow.parquet

from megarl.data.formats import DataFormatError, Record, to_record

SUFFIXES = (".parquet", ".jsonl")


def read_rows(path: Path) -> list[dict[str, Any]]:
    """The rows of a `.parquet` or `.jsonl` (one JSON object per line) file as dicts; errors name the file."""
    if not path.is_file():
        raise FileNotFoundError(f"dataset file {path} does not exist (data.train_files / data.eval_files): download "
                                "it (docs/data.md, 'Pointing a recipe at the real datasets') or point the field at "
                                "your copy")
    try:
        if path.suffix == ".parquet":
            table = pyarrow.parquet.read_table(path)
        elif path.suffix == ".jsonl":
            table = pyarrow.json.read_json(path)
        else:
            raise DataFormatError(f"dataset file {path}: unknown suffix {path.suffix!r} (expected one of {SUFFIXES})")
    except pyarrow.ArrowException as exc:
        raise DataFormatError(f"dataset file {path} cannot be read as {path.suffix[1:]}: {exc}") from None
    return table.to_pylist()


def load_records(paths: list[Path], fmt: str) -> list[Record]:
    """Every row of `paths` (in order) as a Record of format `fmt`; an empty file list or file is an error."""
    if not paths:
        raise DataFormatError(f"the {fmt!r} task needs at least one dataset file (data.train_files)")
    records = []
    for path in paths:
        rows = read_rows(path)
        if not rows:
            raise DataFormatError(f"dataset file {path} has no rows")
        records += [to_record(row, fmt, str(path), i) for i, row in enumerate(rows)]
    return records


def fingerprint(paths: list[Path]) -> str:
    """sha256 over the files' contents, in order (a copied or moved file keeps it; an edited one does not)."""
    total = hashlib.sha256()
    for path in paths:
        digest = hashlib.sha256()
        with path.open("rb") as f:
            while chunk := f.read(1 << 20):
                digest.update(chunk)
        total.update(digest.digest())
    return total.hexdigest()


@lru_cache(maxsize=4)
def epoch_order(n: int, seed: int, epoch: int, shuffle: bool) -> tuple[int, ...]:
    """The row order of `epoch`: a permutation of range(n) seeded by (seed, epoch), or range(n) unshuffled."""
    order = list(range(n))
    if shuffle:
        random.Random(f"megarl-data:{seed}:{epoch}").shuffle(order)
    return tuple(order)


def stream_rows(start: int, count: int, n: int, seed: int, shuffle: bool) -> list[int]:
    """Row indices at stream positions start .. start+count-1 (see the module docstring)."""
    if n < 1:
        raise ValueError("the data stream needs at least one row")
    return [epoch_order(n, seed, p // n, shuffle)[p % n] for p in range(start, start + count)]

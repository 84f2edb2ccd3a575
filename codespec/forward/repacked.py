"""The q8 tiles' copies of a GGUF's projections, kept on disk between loads.

Repacking a file's blocks for the q8 tiles (block_tiles.Blocks.read, then q8_tiles.packed) is numpy work over every
weight: ~0.7 s of each load of the default model, 14 s of each load of a 1.7B Q4_K_M file. The first load writes the
copies into one file under $CODESPEC_HOME/repacked (one for each GGUF and instruction set; the copies of GGUFs that
are gone are removed when another is written); later loads map it (copy-on-write, so nothing is read until a forward
touches it, and its pages are the page cache's) and read only the embedding and output layer from the GGUF.

A copy is taken only where it was packed from the same file (its path, size and time, and the bytes at its start and
end), for the same instruction set and by the same code (numba's cache folder, named by a digest of every kernel
module, codespec/__init__.py); anything else packs afresh and replaces it. A copy that cannot be written (a read-only
or full disk) is simply not kept."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import mmap
import os
import shutil
import time
from pathlib import Path
from typing import Optional

import numpy as np

from ..config import codespec_home
from .kernels.q8_tiles import Form

VERSION = 2  # of this file's layout (2: K-quant scales factored, q8_tiles.Form.factored)
ALIGN = 64  # each array starts at a multiple of this many bytes (a cache line: the tiles' loads)
SAMPLE = 1 << 16  # bytes read at each end of the GGUF for its stamp
HEADER_MAX = 1 << 24  # a header longer than this is a damaged one (a 7B model's: ~40 KB)


def _place(gguf: Path, isa: str, scale: float) -> tuple[Path, str]:
    """Where the copy of `gguf`'s projections for `isa` is kept, and the stamp that says what it was packed from."""
    gguf = gguf.resolve()
    stat = gguf.stat()
    digest = hashlib.sha256(json.dumps([VERSION, str(gguf), stat.st_size, stat.st_mtime_ns, isa, scale,
                                        os.path.basename(os.environ.get("NUMBA_CACHE_DIR", ""))]).encode())
    with open(gguf, "rb") as file:
        digest.update(file.read(SAMPLE))
        file.seek(max(0, stat.st_size - SAMPLE))
        digest.update(file.read())
    name = hashlib.sha256(str(gguf).encode()).hexdigest()[:16]
    return codespec_home() / "repacked" / f"{name}-{isa}.bin", digest.hexdigest()


def load(gguf: Path, isa: str, scale: float) -> Optional[list[tuple]]:
    """The projections of `gguf` as q8_tiles.packed gave them when they were kept (save), mapped from disk; None
    where no copy of this file, instruction set and code is kept."""
    try:
        path, stamp = _place(gguf, isa, scale)
        with open(path, "rb") as file:
            header, index = _header(file)
            if index.get("stamp") != stamp:
                return None
            mapped = mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_COPY)  # (writable arrays: numba's usual type)
        start = _start(header)
        return [(_array(mapped, start, *entry["q"]), _array(mapped, start, *entry["held"]), Form(**entry["form"]),
                 entry["rows"], entry["chunk_groups"]) for entry in index["weights"]]
    except (OSError, ValueError, KeyError, TypeError):  # none kept, or a damaged copy: packed afresh
        return None


def _header(file) -> tuple[bytes, dict]:
    """A kept copy's header, as bytes and read (ValueError for one that is not: a damaged copy)."""
    length = int.from_bytes(file.read(8), "little")
    if length > HEADER_MAX:
        raise ValueError(f"a header of {length} bytes")
    header = file.read(length)
    return header, json.loads(header)


def _prune(folder: Path) -> None:
    """Remove the copies of GGUFs that are gone (a model deleted or moved: its copy, as large as the model, would
    stay for good) and what writers that were killed left (.partial files over a day old)."""
    for copy in folder.glob("*.bin"):
        try:
            with open(copy, "rb") as file:
                gone = not Path(_header(file)[1]["gguf"]).exists()
        except (OSError, ValueError, KeyError, TypeError):
            gone = True  # (damaged, or of an older layout)
        if gone:
            copy.unlink(missing_ok=True)
    for partial in folder.glob("*.partial"):
        try:
            if time.time() - partial.stat().st_mtime > 86400:
                partial.unlink(missing_ok=True)
        except OSError:
            pass


def _start(header: bytes) -> int:
    """Where the arrays begin: after the header's length and the header, at a multiple of ALIGN."""
    return -(-(8 + len(header)) // ALIGN) * ALIGN


def _array(mapped: mmap.mmap, start: int, offset: int, shape: list[int]) -> np.ndarray:
    return np.frombuffer(mapped, np.uint8, count=int(np.prod(shape)), offset=start + offset).reshape(shape)


def save(gguf: Path, isa: str, scale: float, packed: list[tuple]) -> None:
    """Keep `packed` (q8_tiles.packed's tuples: the projections of `gguf` for `isa`) for the next load: written whole
    under another name, then renamed over the old copy (a load never maps half a file)."""
    entries, size = [], 0
    for q, held, form, rows, chunk_groups in packed:
        entry = {"form": dataclasses.asdict(form), "rows": int(rows), "chunk_groups": int(chunk_groups)}
        for name, array in (("q", q), ("held", held)):
            entry[name] = [size, list(array.shape)]  # (from the start of the arrays)
            size += -(-array.nbytes // ALIGN) * ALIGN
        entries.append(entry)
    partial = None
    try:
        path, stamp = _place(gguf, isa, scale)
        header = json.dumps({"stamp": stamp, "gguf": str(gguf.resolve()), "weights": entries}).encode()
        start = _start(header)
        path.parent.mkdir(parents=True, exist_ok=True)
        _prune(path.parent)
        if start + size > shutil.disk_usage(path.parent).free // 2:
            return  # not worth half of what is left of the disk
        partial = path.with_suffix(f".{os.getpid()}.partial")
        with open(partial, "wb") as file:
            file.write(len(header).to_bytes(8, "little") + header)
            for entry, (q, held, *_) in zip(entries, packed):
                for (offset, _), array in ((entry["q"], q), (entry["held"], held)):
                    file.seek(start + offset)
                    file.write(np.ascontiguousarray(array).data)
            file.truncate(start + size)
        partial.replace(path)
    except OSError:  # a read-only or full disk: nothing kept
        if partial is not None:
            partial.unlink(missing_ok=True)

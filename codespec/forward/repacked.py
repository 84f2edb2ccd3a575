"""The q8 tiles' copies of a GGUF's projections, kept on disk between loads.

Repacking a file's blocks for the q8 tiles (block_tiles.Blocks.read, then q8_tiles.packed) is numpy and numba work
over every weight: ~0.7 s of each load of the default model, 6-7 s of each load of a 1.7B Q4_K_M file. The first
load writes the copies into one file under $CODESPEC_HOME/repacked (one for each GGUF and instruction set; the
copies of GGUFs that are gone are removed when another is written); later loads map it (copy-on-write, so nothing is
read until a forward touches it, and its pages are the page cache's) and read only the embedding and output layer
from the GGUF.

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
import threading
import time
import weakref
from pathlib import Path
from typing import Optional

import numpy as np

from ..config import codespec_home
from .kernels.q8_tiles import Form

VERSION = 4  # of this file's layout (2: K-quant scales factored, q8_tiles.Form.factored; 3: the header last; 4: AVX2
# holds five- and six-bit weights as nibbles and planes)
ALIGN = mmap.ALLOCATIONGRANULARITY  # each array starts at a multiple of this many bytes (where a mapping can)
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
            index = _header(file)
            if index.get("stamp") != stamp:
                return None
            mapped = mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_COPY)  # (writable arrays: numba's usual type)
        return [(_array(mapped, *entry["q"]), _array(mapped, *entry["held"]), Form(**entry["form"]),
                 entry["rows"], entry["chunk_groups"]) for entry in index["weights"]]
    except (OSError, ValueError, KeyError, TypeError):  # none kept, or a damaged copy: packed afresh
        return None


def _header(file) -> dict:
    """A kept copy's header (at its end, then its length), read (ValueError for one that is not: a damaged copy)."""
    size = file.seek(0, os.SEEK_END)
    if size < 8:
        raise ValueError("no header")
    file.seek(size - 8)
    length = int.from_bytes(file.read(8), "little")
    if length > min(HEADER_MAX, size - 8):
        raise ValueError(f"a header of {length} bytes")
    file.seek(size - 8 - length)
    header = json.loads(file.read(length))
    if any(offset + int(np.prod(shape)) > size - 8 - length
           for entry in header["weights"] for offset, shape in (entry["q"], entry["held"])):
        raise ValueError("arrays past the end")
    return header


def _prune(folder: Path) -> None:
    """Remove the copies of GGUFs that are gone (a model deleted or moved: its copy, as large as the model, would
    stay for good) and what writers that were killed left (.partial files over a day old)."""
    for copy in folder.glob("*.bin"):
        try:
            with open(copy, "rb") as file:
                gone = not Path(_header(file)["gguf"]).exists()
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


def _array(mapped: mmap.mmap, offset: int, shape: list[int]) -> np.ndarray:
    return np.frombuffer(mapped, np.uint8, count=int(np.prod(shape)), offset=offset).reshape(shape)


class Keeper:
    """A copy being written as the weights are packed (`add`, from any thread: each weight's arrays go to the file while
    the next ones are packed; written at the end, 1.1 GB took 1-2.7 s of a 1.7B model's first load), then finished
    with its header and renamed over the old copy (`finish`: a load never maps half a file). A weight written is
    given back mapped from the file, as a later load maps it: the packed arrays go, and a first load holds what a
    later one holds (a 1.7B Q4_K_M's first-load peak RSS: 2,151-2,231 -> 1,864-2,041 MB). One that cannot be written
    (a read-only or full disk) keeps nothing, and the load goes on with the arrays it packed; one never finished (a
    load that failed half-way) is removed when the Keeper goes, or at the process's exit, not a day later."""

    def __init__(self, gguf: Path, isa: str, scale: float):
        self.gguf, self.entries, self.end, self.file, self.lock = gguf, {}, 0, None, threading.Lock()
        try:
            self.path, self.stamp = _place(gguf, isa, scale)
            self.path.parent.mkdir(parents=True, exist_ok=True)
            _prune(self.path.parent)
            if gguf.stat().st_size * 2 > shutil.disk_usage(self.path.parent).free // 2:
                return  # (the copy holds at most ~1.5x the file) not worth half of what is left of the disk
            self.partial = self.path.with_suffix(f".{os.getpid()}-{id(self)}.partial")
            self.file = open(self.partial, "w+b")  # noqa: SIM115 (open until finish or abandon)
            self.discard = weakref.finalize(self, _discard, self.file, self.partial)
        except OSError:
            self.file = None

    def add(self, weight: tuple) -> tuple:
        """Write `weight` (q8_tiles.packed's tuple) into the copy; returns it, its arrays mapped from the copy."""
        q, held, form, rows, chunk_groups = weight
        with self.lock:
            if self.file is None or id(q) in self.entries:
                return weight
            entry = {"form": dataclasses.asdict(form), "rows": int(rows), "chunk_groups": int(chunk_groups)}
            try:
                mapped = []
                for name, array in (("q", q), ("held", held)):
                    entry[name] = [self.end, list(array.shape)]
                    self.file.seek(self.end)
                    self.file.write(np.ascontiguousarray(array).data)
                    self.file.flush()
                    mapped.append(np.empty(array.shape, np.uint8) if array.nbytes == 0 else np.frombuffer(
                        mmap.mmap(self.file.fileno(), array.nbytes, access=mmap.ACCESS_COPY, offset=self.end),
                        np.uint8).reshape(array.shape))
                    self.end += -(-array.nbytes // ALIGN) * ALIGN
            except (OSError, ValueError):
                self.abandon()
                return weight
            weight = (mapped[0], mapped[1], form, rows, chunk_groups)
            self.entries[id(mapped[0])] = (entry, mapped[0])  # (the array held: its id stays its own)
        return weight

    def finish(self, packed: list[tuple]) -> list[tuple]:
        """The copy of `packed` (in this order; what `add` has not written is written now), kept for the next load;
        `packed` as `add` gives them back."""
        packed = [self.add(weight) for weight in packed]
        if self.file is None:
            return packed
        try:
            header = json.dumps({"stamp": self.stamp, "gguf": str(self.gguf.resolve()),
                                 "weights": [self.entries[id(weight[0])][0] for weight in packed]}).encode()
            self.file.seek(self.end)
            self.file.write(header + len(header).to_bytes(8, "little"))
            self.file.truncate(self.end + len(header) + 8)
            self.file.close()
            self.partial.replace(self.path)
            self.discard.detach()
            self.file = None
        except OSError:
            self.abandon()
        return packed

    def abandon(self) -> None:
        """Keep nothing (a failed write, or a load that stopped)."""
        if self.file is not None:
            self.file = None
            self.discard()


def _discard(file, partial: Path) -> None:
    """A copy never finished: closed and removed."""
    file.close()
    partial.unlink(missing_ok=True)


def save(gguf: Path, isa: str, scale: float, packed: list[tuple]) -> None:
    """Keep `packed` (q8_tiles.packed's tuples: the projections of `gguf` for `isa`) for the next load (Keeper)."""
    Keeper(gguf, isa, scale).finish(packed)

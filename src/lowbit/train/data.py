"""Training data: byte-level text, cached as uint8 token memmaps, sampled deterministically by step.

The default corpus needs no download: the Python standard library's own ``.py`` files on this
machine (sorted by path, ``site-packages`` excluded). ``--data PATH`` takes a text file or a folder
of text files instead (binary files, detected by a NUL byte, are skipped and counted).

Split (deterministic, independent of sequence length): the concatenated byte stream is cut into
64 KiB chunks and every 20th chunk goes to validation; a corpus of fewer than 20 chunks keeps its
last 10% (at least one byte) for validation. The splits are written once as ``train.bin`` /
``val.bin`` (uint8) plus ``meta.json`` in a cache folder named by a fingerprint of the sources
(paths, sizes, mtimes), atomically, so concurrent ranks and interrupted builds are safe.

Batches are keyed by ``(seed, step)``: the global batch of a step is the same whatever the world
size, gradient accumulation or whether the run was resumed — which makes resume exact and lets a
2-process run reproduce a 1-process run on the same global batch.
"""

from __future__ import annotations

import hashlib
import json
import os
import sysconfig
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ..runtime import env

__all__ = ["Corpus", "load_corpus", "default_cache_dir", "stdlib_files", "check_writable_dir", "CHUNK", "VAL_EVERY"]

CHUNK = 64 * 1024
VAL_EVERY = 20
FORMAT_VERSION = 1


def default_cache_dir() -> Path:
    """Where the tokenized corpus is kept: lowbit's cache directory (:func:`lowbit.runtime.env.cache_root`)."""
    return env.cache_root()


def check_writable_dir(path: str | os.PathLike, name: str) -> Path:
    """Make ``path`` a directory this process can write to (creating it and its parents), or raise a
    ValueError naming the argument ``name``: called before a run does work that would end in a write there."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise ValueError(f"{name}: must be a directory, but {str(path)!r} exists and is not one")
    blocker = next((a for a in path.parents if a.exists()), None)
    if not path.exists() and blocker is not None and not blocker.is_dir():
        raise ValueError(f"{name}: cannot create the directory {str(path)!r}: {str(blocker)!r} is a file, "
                         "not a directory")
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ValueError(f"{name}: cannot create the directory {str(path)!r}: {e.strerror or e}") from None
    try:
        fd, probe = tempfile.mkstemp(prefix=".lowbit-write-probe-", dir=path)
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise ValueError(f"{name}: the directory {str(path)!r} is not writable: {e.strerror or e}") from None
    return path


def stdlib_files() -> list[Path]:
    """Sorted ``.py`` files of this interpreter's standard library (no site-/dist-packages)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = {"site-packages", "dist-packages", "__pycache__"}
    return sorted(p for p in root.rglob("*.py") if p.is_file() and not skip.intersection(p.relative_to(root).parts))


def _data_files(path: Path) -> list[Path]:
    if not path.exists():
        raise ValueError(f"data: path does not exist: {str(path)!r}")
    if path.is_file():
        return [path]
    if path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.is_file() and not any(part.startswith(".")
                                                                             for part in p.relative_to(path).parts))
        if not files:
            raise ValueError(f"data: folder {str(path)!r} contains no files")
        return files
    raise ValueError(f"data: {str(path)!r} is neither a file nor a folder")


def _fingerprint(files: list[Path]) -> str:
    h = hashlib.sha256(f"v{FORMAT_VERSION}:{CHUNK}:{VAL_EVERY}".encode())
    for f in files:
        st = f.stat()
        h.update(f"{f.resolve()}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    return h.hexdigest()[:16]


def _read_all(files: list[Path]) -> tuple[bytes, int, int]:
    """Concatenate the files (each followed by a newline); returns (bytes, n_used, n_skipped_binary)."""
    parts, used, skipped = [], 0, 0
    for f in files:
        try:
            b = f.read_bytes()
        except OSError as e:
            raise ValueError(f"data: cannot read {str(f)!r}: {e.strerror or e}") from None
        if b"\0" in b[:8192]:
            skipped += 1
            continue
        if b:
            parts.append(b if b.endswith(b"\n") else b + b"\n")
            used += 1
    return b"".join(parts), used, skipped


def split_stream(data: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Deterministic train/val split of a uint8 stream (see the module docstring)."""
    n = len(data)
    n_chunks = -(-n // CHUNK)
    if n_chunks >= VAL_EVERY:
        idx = np.arange(n_chunks)
        val_mask = (idx % VAL_EVERY) == VAL_EVERY - 1
        chunks = [data[i * CHUNK:(i + 1) * CHUNK] for i in range(n_chunks)]
        train = np.concatenate([c for c, v in zip(chunks, val_mask) if not v])
        val = np.concatenate([c for c, v in zip(chunks, val_mask) if v])
        return train, val
    n_val = max(1, n // 10)
    return data[: n - n_val], data[n - n_val:]


def _atomic_write(path: Path, payload: bytes) -> None:
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    with open(tmp, "wb") as f:
        f.write(payload)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


@dataclass
class Corpus:
    """Train/val token streams (uint8 memmaps) and where they came from."""

    train: np.ndarray
    val: np.ndarray
    meta: dict
    cache_path: Path

    @property
    def vocab_size(self) -> int:
        return 256

    def check_seq_len(self, seq_len: int) -> None:
        """Raise a clear ValueError when a split is too small for one (seq_len + 1)-token window."""
        need = seq_len + 1
        total = len(self.train) + len(self.val)
        if total < need:
            raise ValueError(f"data: the corpus ({self.meta['source']}) has {total} bytes, fewer than one sequence "
                             f"(seq_len + 1 = {need}); give more text or a smaller --seq-len")
        for name, arr in (("train", self.train), ("val", self.val)):
            if len(arr) < need:
                raise ValueError(f"data: the {name} split of {self.meta['source']} has {len(arr)} bytes, "
                                 "fewer than one "
                                 f"sequence (seq_len + 1 = {need}); the corpus has {total} bytes in all, and "
                                 f"validation takes 1 in {VAL_EVERY} chunks of {CHUNK} bytes (or the last 10% "
                                 "of a smaller "
                                 f"corpus); give more text or a smaller --seq-len")

    # -- batches ---------------------------------------------------------------------------------
    def batch_offsets(self, seed: int, step: int, global_batch: int, seq_len: int) -> np.ndarray:
        """Start offsets of the ``global_batch`` training windows of ``step`` (a pure function of its arguments)."""
        hi = len(self.train) - seq_len - 1
        rng = np.random.Generator(np.random.Philox(key=[seed & 0xFFFFFFFFFFFFFFFF, step]))
        return rng.integers(0, hi + 1, size=global_batch, dtype=np.int64)

    def train_batch(self, seed: int, step: int, rows: slice, global_batch: int, seq_len: int,
                    device) -> tuple[torch.Tensor, torch.Tensor]:
        """(x, y) int64 tensors of the given rows of the step's global batch."""
        off = self.batch_offsets(seed, step, global_batch, seq_len)[rows]
        return self._windows(self.train, off, seq_len, device)

    def val_offsets(self, n_windows: int, seq_len: int) -> np.ndarray:
        """``n_windows`` fixed validation windows spread evenly over the val split (fewer if it is small)."""
        hi = len(self.val) - seq_len - 1
        n = min(n_windows, hi + 1)
        return np.unique(np.linspace(0, hi, num=n).astype(np.int64))

    def windows(self, split: str, offsets: np.ndarray, seq_len: int, device) -> tuple[torch.Tensor, torch.Tensor]:
        return self._windows(self.train if split == "train" else self.val, offsets, seq_len, device)

    @staticmethod
    def _windows(arr, off, seq_len, device):
        idx = off[:, None] + np.arange(seq_len + 1)[None, :]
        w = torch.from_numpy(np.asarray(arr[idx], dtype=np.int64))
        if torch.device(device).type == "cuda":
            w = w.pin_memory().to(device, non_blocking=True)
        else:
            w = w.to(device)
        return w[:, :-1], w[:, 1:]


def load_corpus(data: str | os.PathLike | None = None, cache_dir: str | os.PathLike | None = None, *,
                verbose: bool = True) -> Corpus:
    """Build (once) and open the token cache for ``data`` (None: the standard-library corpus).

    Raises:
        ValueError: the path does not exist, cannot be read, or holds no text.
    """
    if data is None:
        files = stdlib_files()
        source = f"python-stdlib ({len(files)} .py files)"
        if not files:
            raise ValueError("data: no standard-library .py files found on this machine; pass --data PATH")
    else:
        files = _data_files(Path(data))
        source = str(Path(data))
    try:
        fp = _fingerprint(files)
    except OSError as e:
        raise ValueError(f"data: cannot stat the input files under {source}: {e}") from None
    cache = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    folder = cache / "data" / (("stdlib-" if data is None else "text-") + fp)
    meta_path = folder / "meta.json"
    if not meta_path.exists():  # build it: the cache folder must be writable (a complete cache may be read-only)
        check_writable_dir(cache, "cache_dir")
        raw, used, skipped = _read_all(files)
        if not raw:
            raise ValueError(f"data: {source} holds no text ({len(files)} files, {skipped} skipped as binary, "
                             "the rest empty)")
        stream = np.frombuffer(raw, dtype=np.uint8)
        train, val = split_stream(stream)
        meta = {"format_version": FORMAT_VERSION, "source": source, "files": used, "skipped_binary": skipped,
                "bytes": int(len(stream)), "train_bytes": int(len(train)), "val_bytes": int(len(val)),
                "chunk": CHUNK, "val_every": VAL_EVERY, "fingerprint": fp}
        try:
            folder.mkdir(parents=True, exist_ok=True)
            _atomic_write(folder / "train.bin", train.tobytes())
            _atomic_write(folder / "val.bin", val.tobytes())
            _atomic_write(meta_path, json.dumps(meta, indent=1).encode())  # written last: marks the cache complete
        except OSError as e:
            raise ValueError(f"cache_dir: cannot write the token cache {str(folder)!r}: {e.strerror or e}") from None
        if verbose:
            print(f"[lowbit] cached {source}: {len(stream):,} bytes from {used} files ({skipped} binary skipped) "
                  f"-> {folder}", flush=True)
    meta = json.loads(meta_path.read_text())
    train = np.memmap(folder / "train.bin", dtype=np.uint8, mode="r") if meta["train_bytes"] else np.zeros(0, np.uint8)
    val = np.memmap(folder / "val.bin", dtype=np.uint8, mode="r") if meta["val_bytes"] else np.zeros(0, np.uint8)
    return Corpus(train=train, val=val, meta=meta, cache_path=folder)

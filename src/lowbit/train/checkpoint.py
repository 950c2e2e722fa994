"""Checkpoints: full (unsharded) FP32 state, FQN-keyed, atomic, loadable with ``weights_only=True``.

A checkpoint is one ``torch.save`` file holding only tensors and plain Python values::

    {"format": "lowbit-train", "version": 1, "step": int, "model_config": dict, "recipe": str,
     "model": {fqn: tensor}, "optimizer": {"state": {fqn: {...}}, "param_groups": [...]},
     "train": dict (arguments that must match on resume), "history": dict, "events": list}

Model and optimizer state are gathered with ``torch.distributed.checkpoint.state_dict`` as full state
dicts keyed by parameter name, so a checkpoint written by any world size (DDP or FSDP2) loads at any
other. Writes go to a temporary file in the same folder, are fsynced and renamed over the old file:
a run killed while writing leaves the previous checkpoint intact (and a stale temporary file, which the
next successful write of that checkpoint removes).
"""

from __future__ import annotations

import errno
import os
import shutil
import zipfile
from pathlib import Path

import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

__all__ = ["save_checkpoint", "load_checkpoint", "read_checkpoint", "gather_state", "apply_state", "FORMAT"]

FORMAT = "lowbit-train"
VERSION = 1


def gather_state(model, optimizer) -> tuple[dict, dict]:
    """Full CPU state dicts (model, optimizer). Collective under FSDP: every rank must call it.

    A captured optimizer step (``lowbit train``'s update graph) reads its learning rate from a device tensor
    and marks its groups capturable; the checkpoint stores the plain float and ``capturable=False``, so it loads
    into any optimizer the same way."""
    msd, osd = get_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    for g in osd.get("param_groups", []):
        if isinstance(g.get("lr"), torch.Tensor):
            g["lr"] = float(g["lr"])
        if g.get("capturable"):
            g["capturable"] = False
    return msd, osd


def apply_state(model, optimizer, model_sd: dict, optim_sd: dict | None) -> None:
    """Load full state dicts into a (possibly DDP/FSDP-wrapped) model and optimizer on every rank."""
    check_shapes(model_sd, model)
    if optim_sd is None:
        set_state_dict(model, optimizers=(), model_state_dict=model_sd, optim_state_dict={},
                       options=StateDictOptions(full_state_dict=True, strict=True))
        return
    set_state_dict(model, optimizer, model_state_dict=model_sd, optim_state_dict=optim_sd,
                   options=StateDictOptions(full_state_dict=True, strict=True))


def _unwrap(model):
    return getattr(model, "module", model)


def check_shapes(sd: dict, model) -> None:
    """Raise a ValueError listing missing, unexpected and mis-shaped entries of ``sd`` for ``model``."""
    own = {k: tuple(v.shape) for k, v in _unwrap(model).state_dict().items() if isinstance(v, torch.Tensor)}
    # FSDP2 parameters are DTensors: their .shape is the full (global) shape, which is what we compare.
    theirs = {k: tuple(v.shape) for k, v in sd.items() if isinstance(v, torch.Tensor)}
    missing = sorted(set(own) - set(theirs))
    extra = sorted(set(theirs) - set(own))
    bad = [f"{k}: checkpoint {theirs[k]} vs model {own[k]}" for k in sorted(set(own) & set(theirs))
           if own[k] != theirs[k]]
    if missing or extra or bad:
        parts = []
        if bad:
            parts.append("shape mismatches: " + "; ".join(bad[:6]) + (" ..." if len(bad) > 6 else ""))
        if missing:
            parts.append(f"missing from the checkpoint: {missing[:6]}" + (" ..." if len(missing) > 6 else ""))
        if extra:
            parts.append(f"not in the model: {extra[:6]}" + (" ..." if len(extra) > 6 else ""))
        raise ValueError("checkpoint: it was saved for a different model shape — " + " | ".join(parts))


def _tensor_bytes(obj) -> int:
    """Bytes of the tensors in a nested dict / list payload (about a checkpoint's size)."""
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(_tensor_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(_tensor_bytes(v) for v in obj)
    return 0


def _write_error(path: Path, payload: dict, e: RuntimeError) -> OSError:
    """The OSError for a torch.save that failed mid-write: the path, torch's reason, and the free space against the
    checkpoint's size (a full disk is the usual cause; ENOSPC where the space is short)."""
    need = _tensor_bytes(payload)
    try:
        free = shutil.disk_usage(path.parent).free
    except OSError:
        free = None
    short = free is not None and free < need
    size = lambda n: f"{n / 1e9:.2f} GB" if n >= 1e9 else f"{n / 1e6:.1f} MB"  # noqa: E731
    room = "" if free is None else f"; {size(free)} free on its filesystem against ~{size(need)} needed"
    reason = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
    return OSError(errno.ENOSPC if short else errno.EIO,
                   f"writing the checkpoint failed ({reason}){room}; the previous checkpoint, if any, is unchanged",
                   str(path))


def save_checkpoint(path: str | os.PathLike, payload: dict) -> Path:
    """Write ``payload`` atomically (temp file in the same folder, fsync, rename). Rank 0 only. A write that fails
    (a full disk) raises OSError naming ``path`` and the free space, and leaves the previous file as it was."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = {"format": FORMAT, "version": VERSION, **payload}
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            try:
                torch.save(payload, f)
            except RuntimeError as e:  # (torch's zip writer reports a full disk as "unexpected pos ...")
                raise _write_error(path, payload, e) from e
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()
    for stale in path.parent.glob(f".{path.name}.tmp*"):  # left by a process killed while writing
        stale.unlink(missing_ok=True)
    try:  # make the rename durable too
        fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError:
        pass
    return path


def read_checkpoint(path: str | os.PathLike) -> dict:
    """Load a checkpoint file with ``weights_only=True`` and check that it is one of ours."""
    path = Path(path)
    if path.is_dir():
        raise ValueError(f"resume: {str(path)!r} is a folder; pass the checkpoint file (e.g. "
                         f"{str(path / 'checkpoint.pt')!r}) "
                         "or --resume alone for the out-dir's")
    if not path.is_file():
        raise ValueError(f"resume: no checkpoint at {str(path)!r}")
    try:
        with open(path, "rb") as f:
            is_zip = zipfile.is_zipfile(f)
    except OSError as e:
        raise ValueError(f"resume: cannot read checkpoint {str(path)!r}: {e.strerror or e}") from None
    if not is_zip:  # torch.save writes a zip archive; torch.load's own error would be about mmap
        raise ValueError(f"resume: {str(path)!r} is not a torch.save checkpoint (not a zip archive); "
                         "pass a checkpoint.pt written by lowbit train")
    try:
        ck = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as e:  # noqa: BLE001 - any unpickling/IO failure is a bad file for the user
        raise ValueError(f"resume: cannot read checkpoint {str(path)!r}: {type(e).__name__}: {e}") from None
    if not isinstance(ck, dict) or ck.get("format") != FORMAT:
        raise ValueError(f"resume: {str(path)!r} is not a lowbit training checkpoint (format "
                         f"{ck.get('format') if isinstance(ck, dict) else type(ck).__name__!r})")
    if ck.get("version") != VERSION:
        raise ValueError(f"resume: checkpoint {str(path)!r} has version {ck.get('version')!r}; this lowbit reads "
                         f"version {VERSION}")
    return ck


def load_checkpoint(path, model, optimizer=None) -> dict:
    """Read ``path`` and load it into ``model`` (and ``optimizer``); returns the checkpoint dict."""
    ck = read_checkpoint(path)
    apply_state(model, optimizer, ck["model"], ck["optimizer"] if optimizer is not None else None)
    return ck

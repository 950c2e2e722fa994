"""Checkpoints: full (unsharded) FP32 state, FQN-keyed, atomic, loadable with ``weights_only=True``.

A checkpoint is one ``torch.save`` file holding only tensors and plain Python values::

    {"format": "lowbit-train", "version": 1, "step": int, "model_config": dict, "recipe": str,
     "model": {fqn: tensor}, "optimizer": {"state": {fqn: {...}}, "param_groups": [...]},
     "train": dict (arguments that must match on resume), "history": dict, "events": list,
     "digest": {"algorithm": "sha256", "tensors": {key path: hex}, "fields": {top-level key: hex}}}

Model and optimizer state are gathered with ``torch.distributed.checkpoint.state_dict`` as full state
dicts keyed by parameter name, so a checkpoint written by any world size (DDP or FSDP2) loads at any
other. Writes go to a temporary file in the same folder, are fsynced and renamed over the old file:
a run killed while writing leaves the previous checkpoint intact (and a stale temporary file, which the
next successful write removes when the process that left it is dead).

Integrity: ``"digest"`` holds a SHA-256 of every tensor (its dtype, shape and raw bytes), keyed by its key path
(``model/blocks.0.attn.qkv.weight``, ``optimizer/state/<fqn>/exp_avg``), and one of every other top-level field
(its canonical encoding, tensors as placeholders), computed over the payload minus the digest itself at save and
checked at every read: a mismatch is a ValueError naming the file and the tensor or field. A checkpoint without a
digest (written by a lowbit before digests) is accepted with a one-line warning that its integrity is not checked.
Every field is validated before use (types, ranges, required keys; see :func:`validate_fields`). The readers'
errors start with the name of the argument that gave the file (``arg``: ``resume`` for ``lowbit train --resume``,
``checkpoint`` for ``lowbit eval``).

History: ``save_checkpoint(..., keep=N)`` with N > 1 also hard-links each checkpoint as ``checkpoint-step<S>.pt``
and keeps the N newest of those (``checkpoint.pt`` is always the latest); :func:`read_good_checkpoint` falls back
from a bad latest to the newest good previous one (``--resume`` alone). A checkpoint the user names
(``--resume PATH``) is never swapped for another: :func:`read_named_checkpoint` refuses a bad one and names the newest
good older one kept beside it.

One writer per out-dir: :func:`lock_out_dir` takes ``out_dir/.lock`` with ``fcntl.flock`` (released when the process
dies; the file names the holder's PID).
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import shutil
import socket
import warnings
import zipfile
from pathlib import Path

import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

__all__ = ["save_checkpoint", "load_checkpoint", "read_checkpoint", "read_good_checkpoint", "read_named_checkpoint",
           "older_kept", "previous_checkpoints",
           "payload_digest", "validate_fields", "lock_out_dir", "OutDirLock", "gather_state", "apply_state", "FORMAT"]

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


# ------------------------------------------------------------------------------------------------
# digest
# ------------------------------------------------------------------------------------------------
def _tensor_digest(t: torch.Tensor) -> str:
    """SHA-256 of a tensor's dtype, shape and raw bytes (row-major)."""
    h = hashlib.sha256(f"{t.dtype}|{tuple(t.shape)}|".encode())
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    if t.numel():
        t = t.resolve_conj().resolve_neg().contiguous().reshape(-1).view(torch.uint8)
        h.update(memoryview(t.numpy()))
    return h.hexdigest()


def _canon(obj, path: str, tensors: dict) -> str:
    """A canonical text of a payload field (dict keys sorted, types tagged); tensors go to ``tensors`` by key path
    and appear as a placeholder."""
    if isinstance(obj, torch.Tensor):
        tensors[path] = obj
        return "T"
    if isinstance(obj, dict):
        items = sorted(((_canon(k, path, {}), k, v) for k, v in obj.items()), key=lambda kv: kv[0])
        return "{" + ",".join(f"{ck}:{_canon(v, f'{path}/{k}', tensors)}" for ck, k, v in items) + "}"
    if isinstance(obj, (list, tuple)):
        body = ",".join(_canon(v, f"{path}/{i}", tensors) for i, v in enumerate(obj))
        return ("[" + body + "]") if isinstance(obj, list) else ("(" + body + ")")
    if obj is None or isinstance(obj, bool):
        return repr(obj)
    if isinstance(obj, int):
        return f"i{obj}"
    if isinstance(obj, float):
        return f"f{obj.hex()}"
    if isinstance(obj, str):
        return json.dumps(obj)
    return f"{type(obj).__qualname__}:{obj!r}"


def payload_digest(payload: dict) -> dict:
    """The digest of a checkpoint payload minus its ``"digest"`` key (see the module docstring)."""
    fields, tensors = {}, {}
    for k in sorted(payload, key=str):
        if k == "digest":
            continue
        fields[str(k)] = hashlib.sha256(_canon(payload[k], str(k), tensors).encode()).hexdigest()
    return {"algorithm": "sha256", "tensors": {p: _tensor_digest(t) for p, t in tensors.items()}, "fields": fields}


def _check_digest(ck: dict, path: Path, warn, arg: str = "resume") -> None:
    stored = ck.get("digest")
    if stored is None:
        warn(f"[lowbit] warning: checkpoint {str(path)!r} has no digest (written by an older lowbit): its integrity "
             "is not checked")
        return
    where = f"{arg}: checkpoint {str(path)!r}"
    if (not isinstance(stored, dict) or stored.get("algorithm") != "sha256"
            or not isinstance(stored.get("tensors"), dict) or not isinstance(stored.get("fields"), dict)):
        raise ValueError(f"{where}: field 'digest' is malformed (expected a dict with algorithm 'sha256', 'tensors' "
                         f"and 'fields')")
    now = payload_digest(ck)
    for name in sorted(set(stored["fields"]) | set(now["fields"])):
        if name not in now["fields"]:
            raise ValueError(f"{where}: field {name!r} is in the digest but missing from the file (corrupt)")
        if name not in stored["fields"]:
            raise ValueError(f"{where}: field {name!r} is not covered by the digest (the file was altered)")
    for key in sorted(set(stored["tensors"]) | set(now["tensors"])):
        if key not in now["tensors"]:
            raise ValueError(f"{where}: tensor {key} is in the digest but missing from the file (corrupt)")
        if key not in stored["tensors"]:
            raise ValueError(f"{where}: tensor {key} is not covered by the digest (the file was altered)")
        if stored["tensors"][key] != now["tensors"][key]:
            raise ValueError(f"{where}: tensor {key} does not match its SHA-256 digest (the file is corrupt)")
    for name in sorted(now["fields"]):
        if stored["fields"][name] != now["fields"][name]:
            raise ValueError(f"{where}: field {name!r} does not match its SHA-256 digest (the file is corrupt)")


# ------------------------------------------------------------------------------------------------
# field validation
# ------------------------------------------------------------------------------------------------
def validate_fields(ck: dict, path, *, max_step: int | None = None, train_keys=(), arg: str = "resume") -> None:
    """Check every field of a loaded checkpoint before it is used; a ValueError names the field, the rule and the
    value. ``max_step``: the run's ``steps`` (``step`` must not exceed it); ``train_keys``: the arguments that must
    match on resume, which ``train`` must all hold; ``arg``: the argument that named the file (the errors' prefix)."""
    where = f"{arg}: checkpoint {str(path)!r}"

    def bad(field: str, rule: str, value) -> ValueError:
        v = repr(value)
        v = v if len(v) <= 80 else v[:77] + "..."
        return ValueError(f"{where}: field {field!r} must be {rule}, got {v}")

    for key in ("step", "model_config", "model", "optimizer", "train"):
        if key not in ck:
            raise ValueError(f"{where}: required field {key!r} is missing")
    step = ck["step"]
    hi = "" if max_step is None else f" and <= {max_step} (this run's --steps)"
    if not isinstance(step, int) or isinstance(step, bool) or step < 0 or (max_step is not None and step > max_step):
        raise bad("step", f"an integer >= 0{hi}", step)
    for key in ("model_config", "model", "optimizer", "train"):
        if not isinstance(ck[key], dict):
            raise bad(key, "a dict", type(ck[key]).__name__)
    if not ck["model"]:
        raise bad("model", "a non-empty dict of tensors", ck["model"])
    for k, v in ck["model"].items():  # (a module's get_extra_state() may be any plain value)
        if not isinstance(k, str) or not (isinstance(v, torch.Tensor) or str(k).endswith("_extra_state")):
            raise bad(f"model/{k}", "a tensor keyed by its parameter name", type(v).__name__)
    osd = ck["optimizer"]
    for key, typ, rule in (("state", dict, "a dict"), ("param_groups", list, "a list of dicts")):
        if key not in osd:
            raise ValueError(f"{where}: required field 'optimizer/{key}' is missing")
        if not isinstance(osd[key], typ) or (typ is list and not all(isinstance(g, dict) for g in osd[key])):
            raise bad(f"optimizer/{key}", rule, osd[key])
    for k, v in osd["state"].items():
        if not isinstance(v, dict):
            raise bad(f"optimizer/state/{k}", "a dict", v)
    missing = [k for k in train_keys if k not in ck["train"]]
    if missing:
        raise ValueError(f"{where}: field 'train' lacks the arguments {missing} (needed to check that this run "
                         "matches the checkpointed one)")
    if "recipe" in ck and not isinstance(ck["recipe"], str):
        raise bad("recipe", "a string", ck["recipe"])
    ws = ck.get("world_size", 1)
    if not isinstance(ws, int) or isinstance(ws, bool) or ws < 1:
        raise bad("world_size", "an integer >= 1", ws)
    hist = ck.get("history", {})
    if not isinstance(hist, dict):
        raise bad("history", "a dict", hist)
    for name, rows in hist.items():
        if not isinstance(rows, (list, tuple)) or not all(
                isinstance(r, (list, tuple)) and len(r) == 2 and isinstance(r[0], int)
                and isinstance(r[1], (int, float)) for r in rows):
            raise bad(f"history/{name}", "a list of [step, value] pairs", rows)
    events = ck.get("events", [])
    if not isinstance(events, list) or not all(isinstance(e, dict) for e in events):
        raise bad("events", "a list of dicts", events)


# ------------------------------------------------------------------------------------------------
# writing
# ------------------------------------------------------------------------------------------------
_TMP = re.compile(r"\.tmp(\d+)$")


def _pid_alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # (EPERM: alive, another user's)
        return True
    return True


def _remove_stale_temps(folder: Path, prefix: str) -> None:
    """Remove temporary files ``<prefix>*.tmp<pid>`` left by dead processes (never a live process's write)."""
    for stale in folder.glob(f"{prefix}*.tmp*"):
        m = _TMP.search(stale.name)
        if m and not _pid_alive(int(m.group(1))):
            stale.unlink(missing_ok=True)


def _fsync_dir(folder: Path) -> None:
    try:  # make the renames durable too
        fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError:
        pass


def _step_path(path: Path, step: int) -> Path:
    return path.with_name(f"{path.stem}-step{step}{path.suffix}")


def previous_checkpoints(path: str | os.PathLike) -> list[tuple[int, Path]]:
    """The kept ``<stem>-step<S><suffix>`` files beside ``path``, newest (highest step) first."""
    path = Path(path)
    pat = re.compile(rf"^{re.escape(path.stem)}-step(\d+){re.escape(path.suffix)}$")
    found = []
    if path.parent.is_dir():
        for f in path.parent.iterdir():
            m = pat.match(f.name)
            if m:
                found.append((int(m.group(1)), f))
    return sorted(found, key=lambda sf: sf[0], reverse=True)


def _keep_copy(path: Path, step: int) -> None:
    """``<stem>-step<step><suffix>``: a hard link to ``path`` (a copy where links are not supported), atomically."""
    dst = _step_path(path, step)
    tmp = dst.with_name(f".{dst.name}.tmp{os.getpid()}")
    tmp.unlink(missing_ok=True)
    try:
        try:
            os.link(path, tmp)
        except OSError:
            shutil.copyfile(path, tmp)
            with open(tmp, "rb+") as f:
                os.fsync(f.fileno())
        os.replace(tmp, dst)
    finally:
        tmp.unlink(missing_ok=True)


def save_checkpoint(path: str | os.PathLike, payload: dict, keep: int = 1, fresh: bool = False) -> Path:
    """Write ``payload`` (with its digest) atomically (temp file in the same folder, fsync, rename). Rank 0 only. A
    write that fails (a full disk) raises OSError naming ``path`` and the free space, and leaves the previous file as
    it was. ``keep`` > 1: also keep it as ``<stem>-step<step><suffix>`` and remove all but the ``keep`` newest of
    those at or below this step (``fresh``: remove every other one, a new run's first save)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = {"format": FORMAT, "version": VERSION, **{k: v for k, v in payload.items() if k != "digest"}}
    payload["digest"] = payload_digest(payload)
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
    step = payload.get("step")
    keep_steps: set = set()
    if keep > 1 and isinstance(step, int):
        _keep_copy(path, step)
        older = [s for s, _ in previous_checkpoints(path) if s < step]
        keep_steps = {step, *([] if fresh else older[:keep - 1])}
    for s, f in previous_checkpoints(path):  # (above this step: an abandoned trajectory's)
        if s not in keep_steps:
            f.unlink(missing_ok=True)
    _remove_stale_temps(path.parent, f".{path.stem}")  # left by processes killed while writing
    _fsync_dir(path.parent)
    return path


# ------------------------------------------------------------------------------------------------
# reading
# ------------------------------------------------------------------------------------------------
def read_checkpoint(path: str | os.PathLike, *, max_step: int | None = None, train_keys=(), warn=None,
                    arg: str = "resume") -> dict:
    """Load a checkpoint file with ``weights_only=True``, check that it is one of ours, check its digest and validate
    its fields (:func:`validate_fields`). ``warn``: where the one-line warning about a checkpoint without a digest
    goes (default: ``warnings.warn``); ``arg``: the argument that named the file, which starts every error."""
    path = Path(path)
    if path.is_dir():
        raise ValueError(f"{arg}: {str(path)!r} is a folder; pass the checkpoint file (e.g. "
                         f"{str(path / 'checkpoint.pt')!r})"
                         + (" or --resume alone for the out-dir's" if arg == "resume" else ""))
    if not path.is_file():
        raise ValueError(f"{arg}: no checkpoint at {str(path)!r}")
    try:
        with open(path, "rb") as f:
            is_zip = zipfile.is_zipfile(f)
    except OSError as e:
        raise ValueError(f"{arg}: cannot read checkpoint {str(path)!r}: {e.strerror or e}") from None
    if not is_zip:  # torch.save writes a zip archive; torch.load's own error would be about mmap
        raise ValueError(f"{arg}: {str(path)!r} is not a torch.save checkpoint (not a zip archive); "
                         "pass a checkpoint.pt written by lowbit train")
    try:
        ck = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as e:  # noqa: BLE001 - any unpickling/IO failure is a bad file for the user
        raise ValueError(f"{arg}: cannot read checkpoint {str(path)!r}: {type(e).__name__}: {e}") from None
    if not isinstance(ck, dict) or ck.get("format") != FORMAT:
        raise ValueError(f"{arg}: {str(path)!r} is not a lowbit training checkpoint (format "
                         f"{ck.get('format') if isinstance(ck, dict) else type(ck).__name__!r})")
    if ck.get("version") != VERSION:
        raise ValueError(f"{arg}: checkpoint {str(path)!r} has version {ck.get('version')!r}; this lowbit reads "
                         f"version {VERSION}")
    try:
        _check_digest(ck, path, warn or (lambda msg: warnings.warn(msg, stacklevel=3)), arg)
    except (RuntimeError, TypeError) as e:  # (a truncated storage in a mmapped file, say)
        raise ValueError(f"{arg}: cannot read checkpoint {str(path)!r}: {type(e).__name__}: {e}") from None
    validate_fields(ck, path, max_step=max_step, train_keys=train_keys, arg=arg)
    return ck


def read_good_checkpoint(path: str | os.PathLike, **kw) -> tuple[dict, Path, list[str]]:
    """The newest good checkpoint among ``path`` and its kept previous ones (:func:`previous_checkpoints`):
    ``(checkpoint, its file, why each newer one was skipped)``. None good: a ValueError with every reason (or the
    one file's own error where there is nothing to fall back to). ``kw``: :func:`read_checkpoint`'s."""
    path, arg = Path(path), kw.get("arg", "resume")
    candidates = [path] if path.exists() or not previous_checkpoints(path) else []
    for _, f in previous_checkpoints(path):
        if not any(_same(f, c) for c in candidates):
            candidates.append(f)
    skipped = [] if path in candidates else [f"{path.name}: missing"]  # (nothing at all: the one file's own error)
    for f in candidates:
        try:
            return read_checkpoint(f, **kw), f, skipped
        except ValueError as e:
            if len(candidates) == 1 and not skipped:
                raise
            skipped.append(f"{f.name}: {str(e).removeprefix(f'{arg}: ')}")
    raise ValueError(f"{arg}: no good checkpoint in {str(path.parent)!r}: " + "; ".join(skipped))


def older_kept(path: str | os.PathLike) -> list[tuple[int, Path]]:
    """The kept checkpoints older than ``path``, newest first: for ``checkpoint.pt`` every kept
    ``checkpoint-step<S>.pt`` beside it (but its own hard link), for a kept ``checkpoint-step<N>.pt`` those with
    S < N."""
    path = Path(path)
    m = re.match(r"^(.*)-step(\d+)$", path.stem)
    if m:
        base, below = path.with_name(m.group(1) + path.suffix), int(m.group(2))
    else:
        base, below = path, None
    return [(st, f) for st, f in previous_checkpoints(base)
            if (below is None or st < below) and f != path and not _same(f, path)]


def read_named_checkpoint(path: str | os.PathLike, **kw) -> dict:
    """:func:`read_checkpoint` of a checkpoint the user named (``--resume PATH``), which is never swapped for another
    one: a bad file is a ValueError with its reason, naming the newest older checkpoint kept beside it that passes
    every check (``--keep-checkpoints``), or saying that none does / none is kept. ``kw``: :func:`read_checkpoint`'s.
    """
    arg = kw.get("arg", "resume")
    try:
        return read_checkpoint(path, **kw)
    except ValueError as e:
        reason = str(e)
    older = older_kept(path)
    if not older:
        raise ValueError(f"{reason}; no older checkpoint is kept beside it (--keep-checkpoints N keeps the last N)"
                         ) from None
    skipped = []
    for st, f in older:
        try:
            read_checkpoint(f, **{**kw, "warn": lambda msg: None})
        except ValueError as e2:
            skipped.append(f"{f.name}: {str(e2).removeprefix(f'{arg}: ')}")
            continue
        use = f"--resume {f} to continue from there" if arg == "resume" else "that one instead"
        raise ValueError(f"{reason}; the newest good checkpoint kept beside it is {str(f)!r} (step {st}): pass {use}"
                         ) from None
    raise ValueError(f"{reason}; none of the older checkpoints kept beside it passes its checks either: "
                     + "; ".join(skipped)) from None


def _same(a: Path, b: Path) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False


def load_checkpoint(path, model, optimizer=None) -> dict:
    """Read ``path`` and load it into ``model`` (and ``optimizer``); returns the checkpoint dict."""
    ck = read_checkpoint(path)
    apply_state(model, optimizer, ck["model"], ck["optimizer"] if optimizer is not None else None)
    return ck


# ------------------------------------------------------------------------------------------------
# one writer per out-dir
# ------------------------------------------------------------------------------------------------
class OutDirLock:
    """An exclusive ``fcntl.flock`` on ``out_dir/.lock`` (the file holds the holder's PID and host). The kernel
    releases it when the process dies; :meth:`release` also removes the file."""

    def __init__(self, out_dir: str | os.PathLike):
        self.path = Path(out_dir) / ".lock"
        self.fd: int | None = None

    def acquire(self) -> "OutDirLock":
        import fcntl

        for _ in range(100):
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = ""
                try:
                    holder = os.read(fd, 200).decode(errors="replace").strip()
                except OSError:
                    pass
                os.close(fd)
                who = f"process {holder}" if holder else "another process"
                raise ValueError(f"out_dir: {str(self.path.parent)!r} is in use by {who} (lock {str(self.path)!r}); "
                                 "one lowbit train per out-dir: wait for it, stop it, or pass another --out-dir"
                                 ) from None
            except OSError as e:  # (a file system without flock)
                os.close(fd)
                raise OSError(e.errno, f"cannot lock the out-dir: {e.strerror}", str(self.path)) from None
            try:  # the file we locked may have been removed by a holder releasing it meanwhile: lock the new one
                if os.fstat(fd).st_ino != os.stat(self.path).st_ino:
                    os.close(fd)
                    continue
            except FileNotFoundError:
                os.close(fd)
                continue
            os.ftruncate(fd, 0)
            os.write(fd, f"{os.getpid()} on {socket.gethostname()}\n".encode())
            self.fd = fd
            return self
        raise OSError(errno.EAGAIN, "cannot lock the out-dir (its lock file keeps changing)", str(self.path))

    def release(self) -> None:
        if self.fd is None:
            return
        try:
            self.path.unlink(missing_ok=True)  # (while still held: a waiter re-checks the inode)
        finally:
            os.close(self.fd)
            self.fd = None

    def __enter__(self):
        return self.acquire()

    def __exit__(self, *exc):
        self.release()


def lock_out_dir(out_dir: str | os.PathLike) -> OutDirLock:
    """Take the out-dir's writer lock (a context manager); a ValueError names the out-dir and the holder."""
    return OutDirLock(out_dir).acquire()

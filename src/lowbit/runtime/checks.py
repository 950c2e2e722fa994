"""Argument checks the public API shares, each raising an error that names the argument, the rule and the value."""

from __future__ import annotations

import torch

from .device import memory_bytes

__all__ = ["check_bool", "check_positive_int", "check_device", "check_float_dtype", "check_param_memory",
           "PARAM_DTYPES"]

PARAM_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
"""The dtypes a lowbit module's high-precision parameters may have (``dtype=`` of the module constructors)."""


def check_bool(name: str, value) -> None:
    """``value`` must be a bool: 1, "no" or None silently meaning a flag is a TypeError naming ``name``."""
    if not isinstance(value, bool):  # (bool has no subclasses; Dynamo traces isinstance, not __class__)
        raise TypeError(f"{name}: expected a bool (True or False), got {type(value).__name__} {value!r}")


def check_positive_int(name: str, value) -> None:
    """``value`` must be an int >= 1 (not a bool): a TypeError for another type, a ValueError for a smaller int."""
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"{name}: expected a positive int, got {type(value).__name__} {value!r}")
    if value < 1:
        raise ValueError(f"{name}: expected a positive int, got {value!r}")


def check_device(name: str, device) -> torch.device | None:
    """``device``: None, or a ``torch.device``, a device string (``"cpu"``, ``"cuda:1"``) or a CUDA index that names
    a device this process can allocate on; returns it as a ``torch.device`` (None stays None)."""
    if device is None:
        return None
    if not isinstance(device, (torch.device, str, int)) or isinstance(device, bool):
        raise TypeError(f"{name}: expected None, a torch.device, a device string such as 'cpu' or 'cuda:0', or a CUDA "
                        f"device index, got {type(device).__name__} {device!r}")
    try:
        d = torch.device(device)
    except (RuntimeError, ValueError, TypeError) as e:
        raise ValueError(f"{name}: not a device: {device!r} ({_first_line(e)})") from None
    try:
        torch.empty(0, device=d)
    except (RuntimeError, AssertionError, ValueError) as e:  # (no CUDA build / no such GPU / no accelerator)
        raise ValueError(f"{name}: cannot allocate on {device!r} here ({_first_line(e)})") from None
    return d


def check_float_dtype(name: str, dtype) -> None:
    """``dtype``: None or one of :data:`PARAM_DTYPES` (a TypeError for a non-dtype, a ValueError for another
    dtype)."""
    if dtype is None:
        return
    names = ", ".join(str(t) for t in PARAM_DTYPES)
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"{name}: expected None or a torch.dtype ({names}), got {type(dtype).__name__} {dtype!r}")
    if dtype not in PARAM_DTYPES:
        raise ValueError(f"{name}: the high-precision parameters must be one of {names}, got {dtype}")


def check_param_memory(sizes: dict, numel: int, device, dtype) -> None:
    """Raise a ValueError naming ``sizes`` (the arguments that set them, ``{name: value}``) when ``numel`` parameter
    elements of ``dtype`` (None: the default dtype) cannot fit the memory of ``device`` (None: the CPU) at all,
    instead of the allocator failing or the machine swapping while they are initialized."""
    dtype = dtype or torch.get_default_dtype()
    args = ", ".join(f"{k}={v}" for k, v in sizes.items())
    if numel > 2**63 - 1:
        raise ValueError(f"{'/'.join(sizes)}: the parameters must have at most 2**63 - 1 elements (torch's limit); "
                         f"{args} give {numel:,}")
    need = numel * torch.empty(0, dtype=dtype).element_size()
    have = memory_bytes(torch.device("cpu") if device is None else device)
    if have is not None and need > have:
        where = "cpu" if device is None else str(device)
        raise ValueError(f"{'/'.join(sizes)}: the parameters must fit the device's memory; {args} need "
                         f"{need / 2**30:,.1f} GiB ({numel:,} elements of {dtype}) but {where} has "
                         f"{have / 2**30:,.1f} GiB")


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__

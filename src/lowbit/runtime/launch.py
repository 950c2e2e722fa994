"""Launch a Triton kernel specialization again without Triton's per-call argument binding.

``JITFunction.__getitem__(grid)(*args)`` binds and specializes every argument, hashes a cache key and looks up
the compiled kernel on every call: ~20-30 us of host time per launch on a typical host, which an eager
FP8 Linear pays for every quantized operand of every step. :class:`CachedLaunch` does that once per
*specialization key* the caller supplies and afterwards calls the compiled kernel's launcher directly, the way
``JITFunction.run`` itself does (``kernel.run(grid, stream, function, packed_metadata, launch_metadata, hooks,
*all_args)``).

Correctness rests on the caller's key: it must capture the device (a compiled kernel's function handle belongs
to one device's context) and everything Triton specializes on for this kernel's arguments — dtypes, the integer
values (Triton specializes ints on ``== 1`` and ``% 16``), and whether each pointer is 16-byte aligned — which
the quantize plans do by keying on the device, the shape and the input's alignment
(their other buffers are fresh allocations, always aligned). Anything unexpected (another Triton version
without these internals, a launch hook installed by a profiler, the interpreter) falls back to the normal
launch. ``LOWBIT_FAST_LAUNCH=0`` turns the shortcut off.
"""

from __future__ import annotations

from . import env
from .device import INTERPRET

__all__ = ["CachedLaunch", "SpecializedLaunch", "ensure_tma_allocator", "launcher", "remember"]

_ENABLED = not INTERPRET

try:  # Triton internals the shortcut needs; any of them missing -> always the normal launch
    from triton import knobs as _knobs
    from triton.runtime import driver as _driver

    _knobs.runtime.launch_enter_hook  # noqa: B018 - attribute probe
except Exception:  # noqa: BLE001
    _ENABLED = False


def _unhooked(hook) -> bool:
    """No launch hook installed: None (Triton <= 3.5), or an empty ``HookChain`` (Triton 3.6 keeps one always; a
    check for None alone never took the shortcut there)."""
    return hook is None or getattr(hook, "calls", None) == []


def _on() -> bool:
    """The shortcut is usable (this Triton has its internals, not the interpreter) and wanted (LOWBIT_FAST_LAUNCH)."""
    return _ENABLED and env.get("LOWBIT_FAST_LAUNCH")


def _disable() -> None:
    global _ENABLED
    _ENABLED = False


class CachedLaunch:
    """``launch(grid, key, *args, **options)`` = ``fn[grid](*args, **options)``, with the compiled kernel reused for
    calls with the same ``key`` (see the module docstring for what the key must capture).

    ``args``: every parameter of the kernel in signature order, constexprs included (positional).
    ``options``: launch options such as ``num_warps`` (part of the key implicitly: keep them fixed per key).
    """

    __slots__ = ("fn", "compiled")

    def __init__(self, fn):
        self.fn = fn
        self.compiled: dict = {}

    def __call__(self, grid, key, *args, **options):
        ck = self.compiled.get(key) if _on() else None
        rt = _knobs.runtime
        if ck is not None and _unhooked(rt.launch_enter_hook) and _unhooked(rt.launch_exit_hook):
            dev = _driver.active.get_current_device()
            stream = _driver.active.get_current_stream(dev)
            g1 = grid[1] if len(grid) > 1 else 1
            g2 = grid[2] if len(grid) > 2 else 1
            try:
                ck.run(grid[0], g1, g2, stream, ck.function, ck.packed_metadata, None, None, None, *args)
                return ck
            except TypeError:  # another Triton's launcher signature: stop shortcutting, launch normally
                _disable()
        ck = self.fn[grid](*args, **options)
        if _on() and ck is not None and hasattr(ck, "packed_metadata") and hasattr(ck, "function"):
            self.compiled[key] = ck
        return ck


def _spec_key(args, const) -> list:
    """The per-argument part of a :class:`SpecializedLaunch` key: what Triton specializes a launch on, or more (a
    finer key only costs one more first launch). Integers by class, not value, so that sequence lengths changing
    every call (varlen) do not grow the cache. One loop, no call an argument: this runs for every launch."""
    key = []
    for a, c in zip(args, const):
        t = type(a)
        if c:
            key.append(a)
        elif t is int:  # == 1, divisibility by 16, and the integer type it takes (i32 / i64 / u64)
            key.append((a == 1, not a & 15, -2147483648 <= a <= 2147483647, a < 9223372036854775808))
        elif t is float:
            key.append(0.5)
        elif t is bool or a is None:
            key.append(a)
        elif hasattr(a, "data_ptr"):  # a tensor: its dtype and 16-byte alignment
            key.append((a.dtype, not a.data_ptr() & 15))
        else:
            key.append((t, a))
    return key


KEYED_MAX = 4096  # SpecializedLaunch.keyed keys kept per kernel (then dropped all at once; the compiled kernels stay
# in Triton's own cache, so a dropped key costs one bound launch), and entries of the caches kept with remember()


def remember(cache: dict, key, value):
    """``cache[key] = value``, returned; a cache keyed on shapes (a server sees every length) is emptied first once it
    holds KEYED_MAX entries."""
    if len(cache) >= KEYED_MAX:
        cache.clear()
    cache[key] = value
    return value


class SpecializedLaunch(CachedLaunch):
    """``launch[grid](*args, **kwargs)`` = ``fn[grid](*args, **kwargs)`` (a ``JITFunction``, Triton or Gluon), the
    key of :class:`CachedLaunch` made from the arguments themselves: the current device, each constexpr's value,
    each tensor's dtype and 16-byte alignment, each integer's == 1 / % 16 / width, and the launch options. Costs
    ~0.1-0.2 us an argument against Triton's own binding (~20-40 us a launch on a typical host)."""

    __slots__ = ("_names", "_defaults", "_const", "_tails")

    def __init__(self, fn):
        super().__init__(fn)
        self._names = None  # read from fn.params at the first fast launch (an interpreted kernel has none)
        self._tails: dict = {}  # keyed(): caller's key -> (the parameters after the positional ones, launch options)

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.launch(grid, args, kwargs)

    def _params(self):
        if self._names is None:
            params = self.fn.params
            self._defaults = {p.name: p.default for p in params if p.has_default}
            self._const = [p.is_constexpr for p in params]
            self._names = [p.name for p in params]

    def keyed(self, grid, key, args, kwargs):
        """``fn[grid](*args, **kwargs)`` under the caller's ``key`` instead of one built from the arguments (~10-20 us
        of host time a launch less on a typical host). The key (with the current device added here) must
        determine everything the built key would: every value in ``kwargs`` (constexprs and launch options), each
        tensor argument's dtype and 16-byte alignment, each integer's == 1 / % 16 / width (in practice: the shapes,
        strides, dtypes and alignments the arguments are computed from, and the options)."""
        if not _on():
            return self.fn[grid](*args, **kwargs)
        key = ("keyed", _driver.active.get_current_device(), key)  # apart from launch()'s keys in the same cache
        ent = self._tails.get(key)
        if ent is None:
            if len(self._tails) >= KEYED_MAX:  # callers' keys hold shapes: bounded, for servers seeing every length
                for old in self._tails:
                    self.compiled.pop(old, None)
                self._tails.clear()
            self._params()
            names = self._names[len(args):]
            ent = ([kwargs[n] if n in kwargs else self._defaults[n] for n in names],
                   {n: x for n, x in kwargs.items() if n not in names})
            self._tails[key] = ent
        return self(grid, key, *args, *ent[0], **ent[1])

    def launch(self, grid, args, kwargs):
        if not _on():
            return self.fn[grid](*args, **kwargs)
        self._params()
        full = list(args)
        for n in self._names[len(args):]:
            full.append(kwargs.pop(n) if n in kwargs else self._defaults[n])
        dev = _driver.active.get_current_device()
        key = (dev, *_spec_key(full, self._const), *sorted(kwargs.items()))
        try:
            hash(key)
        except TypeError:  # an unhashable constexpr: Triton's own binding, every call
            return self.fn[grid](*full, **kwargs)
        return self(grid, key, *full, **kwargs)


_LAUNCHERS: dict = {}


def launcher(fn) -> SpecializedLaunch:
    """The process's one :class:`SpecializedLaunch` of the JIT kernel ``fn``, made at its first launch:
    ``launcher(kernel)[grid](*args, **kwargs)`` launches as ``kernel[grid](...)`` does, without Triton's per-call
    binding once a specialization has run."""
    s = _LAUNCHERS.get(id(fn))  # (by id: a JITFunction hashes its source; the entry keeps fn, so the id stays its)
    if s is None:
        s = _LAUNCHERS[id(fn)] = SpecializedLaunch(fn)
    return s


def _torch_scratch(size: int, alignment: int, stream):
    import torch

    return torch.empty(size, dtype=torch.int8, device="cuda")


_ALLOC_STATE: list = []  # [(ContextVar holding Triton's allocator, its null-allocator class) or None], resolved once


def ensure_tma_allocator() -> None:
    """Kernels that build TMA tensor descriptors in-kernel (``tl.make_tensor_descriptor``) need a little global
    scratch memory per launch, which Triton asks a host allocator for; install one backed by torch.

    Triton keeps the allocator in a ContextVar, i.e. per thread: the autograd engine runs backward kernels on
    its own threads, so this checks (and, where none is set, installs) the allocator of the calling thread on
    every use rather than once per process. An allocator the user set is kept."""
    if INTERPRET:
        return
    if not _ALLOC_STATE:
        try:
            from triton.runtime._allocation import NullAllocator, _allocator

            _ALLOC_STATE.append((_allocator, NullAllocator))
        except Exception:  # noqa: BLE001 - another Triton layout: always install ours (cheap, idempotent)
            _ALLOC_STATE.append(None)
    state = _ALLOC_STATE[0]
    if state is not None and not isinstance(state[0].get(), state[1]):
        return
    import triton

    triton.set_allocator(_torch_scratch)

"""Modules that are also the function they are named after: ``lowbit.attention(q, k, v)`` is the package
``lowbit.attention`` called, ``lowbit.attention.backward(do, q, ...)`` the module ``lowbit.attention.backward``
called. Importing a submodule binds it to its parent's attribute (``lowbit.attention`` is the package, not the
function, once any of its submodules is imported), so the module itself is made callable instead."""
from __future__ import annotations

import sys
import types


class _CallableModule(types.ModuleType):
    """A module that, called, calls its function named ``__call_name__`` (looked up per call, so a monkeypatched
    function is the one called)."""

    def __call__(self, *args, **kwargs):
        return getattr(self, self.__call_name__)(*args, **kwargs)


def make_callable(module_name: str, func_name: str) -> None:
    """Make the loaded module ``module_name`` callable as its own function ``func_name``."""
    mod = sys.modules[module_name]
    mod.__call_name__ = func_name
    mod.__class__ = _CallableModule

import contextlib
import os
import sys

import pytest
import torch

# Tests run in importlib mode (test files share basenames across folders); put each test folder on
# sys.path so a test can import its folder's helper modules (helper module names must be unique).
_HERE = os.path.dirname(os.path.abspath(__file__))
for _d in [_HERE] + [os.path.join(_HERE, n) for n in sorted(os.listdir(_HERE))]:
    if os.path.isdir(_d) and not os.path.basename(_d).startswith((".", "__")) and _d not in sys.path:
        sys.path.insert(0, _d)

from testenv import interpreter_problem  # noqa: E402


def pytest_collection_modifyitems(config, items):
    """Skip `@pytest.mark.gpu` tests when no CUDA device is present; skip the Triton-interpreter tests (named
    ``*interpret*``: they run kernels on the CPU under ``TRITON_INTERPRET=1``) where the interpreter itself cannot run
    here (:func:`interpreter_problem`; their kernels' GPU tests still run)."""
    interp = [item for item in items if "interpret" in item.name and "gpu" not in item.keywords]
    if interp and interpreter_problem():
        skip = pytest.mark.skip(reason=interpreter_problem())
        for item in interp:
            item.add_marker(skip)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def cuda():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    return torch.device("cuda")


@pytest.fixture
def switches():
    """``switches(LOWBIT_X=value, ...)`` sets lowbit switches for the rest of the test, in this process
    (:func:`lowbit.runtime.env.override`); they are restored at its end."""
    from lowbit.runtime import env

    with contextlib.ExitStack() as stack:
        yield lambda **values: stack.enter_context(env.override(**values))

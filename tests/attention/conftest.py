import importlib
import os

import pytest


def interpreter_mode() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


@pytest.fixture
def tri():
    """lowbit.attention._triton with interpreted kernels.

    triton.jit (and Triton's own library functions such as the reduction combiners) decide
    interpret-vs-compile when triton is first imported, so these tests only run in a process
    started with TRITON_INTERPRET=1; test_triton_interpret.py::test_interpreter_subprocess starts one."""
    if not interpreter_mode():
        pytest.skip("needs TRITON_INTERPRET=1 from process start (run via test_interpreter_subprocess)")
    pytest.importorskip("triton")
    mod = importlib.import_module("lowbit.attention._triton")
    if not mod.INTERPRETED:
        pytest.skip("this Triton build has no interpreter")
    return mod

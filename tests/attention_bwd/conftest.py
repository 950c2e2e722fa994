import pytest
from bwd_common import kernels_device


@pytest.fixture(scope="session")
def kdev():
    """Device the Triton backward kernels run on here ('cuda', or 'cpu' under the interpreter)."""
    d = kernels_device()
    if d is None:
        pytest.skip("Triton kernels: no GPU and Triton not interpreted here; "
                    "test_interpreter_subprocess runs them under TRITON_INTERPRET=1")
    return d

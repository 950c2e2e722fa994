import os
from pathlib import Path

import pytest
import torch


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory):
    """One token cache per test worker (the stdlib corpus is built once)."""
    return str(tmp_path_factory.mktemp("lowbit-cache"))


@pytest.fixture(scope="session")
def small_text(tmp_path_factory):
    """A ~300 KB text file made from a few standard-library modules (quick to cache, enough for seq 64)."""
    import sysconfig

    root = Path(sysconfig.get_paths()["stdlib"])
    parts = [(root / n).read_bytes() for n in ("argparse.py", "dataclasses.py", "enum.py", "typing.py")]
    p = tmp_path_factory.mktemp("text") / "corpus.txt"
    p.write_bytes(b"\n".join(parts))
    return str(p)


@pytest.fixture(autouse=True)
def _threads():
    # the tests are sized for a 2-core CI machine running two workers
    n = torch.get_num_threads()
    torch.set_num_threads(1 if os.environ.get("PYTEST_XDIST_WORKER") else min(2, n))
    yield
    torch.set_num_threads(n)


@pytest.fixture
def targs():
    """Parse ``lowbit train`` arguments with the parser the CLI uses: ``targs("--steps", 3, ...)``."""
    import argparse

    from lowbit.train.cli import add_train_args

    def parse(*argv):
        return add_train_args(argparse.ArgumentParser()).parse_args([str(a) for a in argv])

    return parse

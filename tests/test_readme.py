"""The README's Python examples run (those that need CUDA run only where it is present)."""

import os
import re

import pytest
import torch

README = os.path.join(os.path.dirname(__file__), "..", "README.md")


def _blocks():
    text = open(README, encoding="utf-8").read()
    return re.findall(r"```python\n(.*?)```", text, flags=re.S)


def test_each_example_says_what_it_needs():
    """The paragraph that introduces each Python example names the install it needs (`pip install ...`)."""
    before = open(README, encoding="utf-8").read().split("```python\n")[:-1]
    assert len(before) == len(_blocks())
    for chunk in before:
        intro = chunk.rstrip().rsplit("\n\n", 1)[-1]
        assert "pip install" in intro, intro


@pytest.mark.parametrize("i", range(len(_blocks())))
def test_readme_python_example_runs(i):
    code = _blocks()[i]
    if "cuda" in code and not torch.cuda.is_available():
        pytest.skip("example needs a CUDA GPU")
    if "transformers" in code:
        pytest.importorskip("transformers")
    exec(compile(code, f"README.md[python block {i}]", "exec"), {"__name__": "__readme__"})

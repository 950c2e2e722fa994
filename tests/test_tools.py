"""The maintainer tools in ``tools/``: few, documented, and using only lowbit's public names.

Each Python tool has a module docstring, compiles, answers ``--help`` without a GPU, and imports nothing private
from lowbit (no ``from lowbit.x import _name``, no ``lowbit.x._y`` module, no ``mod._name`` of a lowbit module);
each shell tool opens with a comment block saying what it does. The old ``scripts`` folder is gone for good.
"""

from __future__ import annotations

import ast
import os
import py_compile
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TOOLS = ROOT / "tools"
MAX_TOOLS = 8


def _tools() -> list[Path]:
    return sorted(p for p in TOOLS.iterdir() if p.is_file())


PY_TOOLS = [p for p in _tools() if p.suffix == ".py"]
SH_TOOLS = [p for p in _tools() if p.suffix == ".sh"]


def test_scripts_folder_is_gone():
    assert not (ROOT / "scripts").exists()


def test_few_tools():
    files = _tools()
    assert 0 < len(files) <= MAX_TOOLS, [p.name for p in files]
    assert {p.suffix for p in files} <= {".py", ".sh"}, [p.name for p in files]


@pytest.mark.parametrize("path", SH_TOOLS, ids=lambda p: p.name)
def test_shell_tool_has_header(path):
    lines = path.read_text().splitlines()
    assert lines and lines[0].startswith("#!"), f"{path.name}: no shebang"
    header = []
    for line in lines[1:]:
        if not line.startswith("#"):
            break
        header.append(line.lstrip("#").strip())
    assert sum(bool(h) for h in header) >= 2, f"{path.name}: no header comment after the shebang"


@pytest.mark.parametrize("path", PY_TOOLS, ids=lambda p: p.name)
def test_python_tool_has_docstring_and_compiles(path, tmp_path):
    doc = ast.get_docstring(ast.parse(path.read_text(), filename=str(path)))
    assert doc and len(doc.strip()) > 20, f"{path.name}: no module docstring"
    py_compile.compile(str(path), cfile=str(tmp_path / "tool.pyc"), doraise=True)


def _private_uses(tree: ast.AST) -> list[str]:
    """Private lowbit names a module reaches: imports of ``_name``, ``._module`` paths, ``mod._name`` accesses."""
    bad = []
    aliases = set()  # local names bound to lowbit modules (or anything imported from lowbit)
    roots = set()  # local names bound to the lowbit package by ``import lowbit...``

    def private(part: str) -> bool:
        return part.startswith("_") and not part.startswith("__")

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name == "lowbit" or a.name.startswith("lowbit."):
                    if any(private(p) for p in a.name.split(".")):
                        bad.append(f"line {node.lineno}: import {a.name}")
                    if a.asname:
                        aliases.add(a.asname)
                    else:
                        roots.add("lowbit")
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module and (
                node.module == "lowbit" or node.module.startswith("lowbit.")):
            if any(private(p) for p in node.module.split(".")):
                bad.append(f"line {node.lineno}: from {node.module} import ...")
            for a in node.names:
                if private(a.name):
                    bad.append(f"line {node.lineno}: from {node.module} import {a.name}")
                aliases.add(a.asname or a.name)
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and private(node.attr):
            root = node.value
            while isinstance(root, ast.Attribute):
                root = root.value
            if isinstance(root, ast.Name) and (root.id in aliases or root.id in roots):
                bad.append(f"line {node.lineno}: {ast.unparse(node)}")
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Attribute):
            root = node.value
            while isinstance(root, ast.Attribute):
                root = root.value
            if isinstance(root, ast.Name) and root.id in roots:
                chain = ast.unparse(node).split(".")
                if any(private(p) for p in chain[1:-1]):
                    bad.append(f"line {node.lineno}: {ast.unparse(node)}")
    return sorted(set(bad))


@pytest.mark.parametrize("path", PY_TOOLS, ids=lambda p: p.name)
def test_python_tool_uses_only_public_lowbit(path):
    bad = _private_uses(ast.parse(path.read_text(), filename=str(path)))
    assert not bad, f"{path.name} reaches private lowbit names:\n" + "\n".join(bad)


def test_private_use_detector():
    src = """
import lowbit.gemm.triton_backend as tb
import lowbit.attention._triton
from lowbit.quant.triton_backend import _blockwise_configs, blockwise_configs
from lowbit.attention import _triton as T
from lowbit.gemm import kernels
x = tb._WS_CONFIGS
y = kernels._private
z = lowbit.attention._triton.attn_fwd
ok = tb.WS_CONFIGS, tb.__name__, blockwise_configs
"""
    bad = _private_uses(ast.parse(src))
    assert len(bad) == 7, bad
    assert not any("WS_CONFIGS" in b and "_WS" not in b for b in bad)


@pytest.mark.parametrize("path", PY_TOOLS, ids=lambda p: p.name)
def test_python_tool_help_without_gpu(path):
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", PYTHONPATH=str(ROOT / "src"))
    r = subprocess.run([sys.executable, str(path), "--help"], capture_output=True, text=True, timeout=120, env=env,
                       cwd=ROOT)
    assert r.returncode == 0, r.stderr
    assert "usage:" in r.stdout


def test_compiled_bound_arithmetic():
    """tools/compiled_bound.py: an FP8 variant's bound is its GEMMs, attention and optimizer plus the least "other"
    time of the run; best x torchao is torchao's step over it; the peers it needs are named when missing."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("compiled_bound", TOOLS / "compiled_bound.py")
    cb = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cb)
    assert [cb.classify(n) for n in ("aten::_scaled_mm", "aten::_scaled_mm_v2", "aten::mm", "aten::_fused_adamw_",
                                     "aten::_scaled_dot_product_cudnn_attention", "triton_poi_fused_1")] == [
        "fp8 gemm", "fp8 gemm", "16-bit gemm", "optimizer", "attention", "other"]
    # lowbit's quantizer in a pass of its own (by kernel name; Inductor names the launch after the op) vs fused ones
    assert [cb.classify("blockwise_kernel_0", k) for k in ("blockwise_kernel", "tensorwise_kernel",
                                                           "rowcol_1x128_regs", "triton_per_fused_abs_max_1")] == [
        "quantizer", "quantizer", "other", "other"]

    def row(v, step, fp8, b16, other, quantizer=0.0):
        return {"variant": v, "step_ms": step, "host_ms": 1.0, "gpu_ms": fp8 + b16 + 12 + 5 + other + quantizer,
                "fp8 gemm": fp8, "16-bit gemm": b16, "attention": 12.0, "optimizer": 5.0, "quantizer": quantizer,
                "other": other}

    rows = cb.bounds([row("bf16-compile", 66.0, 0.0, 30.0, 16.0), row("torchao-compile", 60.0, 22.0, 4.0, 11.5),
                      row("fp8-block-compile", 63.0, 19.0, 4.0, 18.5)])
    blk = rows[2]
    assert blk["bound_ms"] == 19.0 + 4.0 + 12.0 + 5.0 + 11.5  # (torchao's "other" is the least)
    assert blk["best_x_torchao"] == 60.0 / blk["bound_ms"] and blk["x_torchao"] == 60.0 / 63.0
    assert "bound_ms" not in rows[0]
    assert "| fp8-block-compile | 63.0 |" in cb.table(rows)
    with pytest.raises(ValueError, match="bf16-compile and torchao-compile"):
        cb.bounds([row("torchao-compile", 60.0, 22.0, 4.0, 11.5)])
    eager = cb.bounds([row("bf16", 90.0, 0.0, 35.0, 30.0), row("fp8-block", 100.0, 19.0, 4.0, 40.0)])[1]
    assert eager["best_x_bf16"] == 90.0 / (19.0 + 4.0 + 12 + 5 + 40.0) and eager["x_bf16"] == 90.0 / 100.0
    assert "bound_ms" not in eager and "| fp8-block | 100.0 |" in cb.table([eager])
    with pytest.raises(ValueError, match="eager variant's bound needs bf16"):
        cb.bounds([row("fp8-block", 100.0, 19.0, 4.0, 40.0)])
    import torch

    # the floors: the quantizer's least traffic added to the bound, only where the quantizer runs on its own
    rows = cb.bounds([row("bf16-compile", 66.0, 0.0, 30.0, 16.0), row("torchao-compile", 60.0, 22.0, 4.0, 11.5),
                      row("fp8-block-compile", 63.0, 19.0, 4.0, 12.0, 6.0)], floors_ms=(3.5, 2.0))
    blk = rows[2]
    assert blk["bound_ms"] == 19.0 + 4.0 + 12.0 + 5.0 + 11.5 and blk["floor_ms"] == blk["bound_ms"] + 3.5
    assert blk["fused_floor_ms"] == blk["bound_ms"] + 2.0 and blk["fused_x_torchao"] == 60.0 / blk["fused_floor_ms"]
    ao_gpu = 22.0 + 4.0 + 12 + 5 + 11.5  # (torchao's GPU time: no host stall in it)
    assert blk["floor_x_torchao_gpu"] == ao_gpu / blk["floor_ms"] < 1.0 < blk["floor_x_torchao"]
    assert blk["fused_x_torchao_gpu"] == ao_gpu / blk["fused_floor_ms"]
    head, sep, *_, line = cb.table(rows).splitlines()
    assert head.count("|") == sep.count("|") == line.count("|") and "floor x torchao GPU" in head
    assert "floor_ms" not in rows[1]  # (torchao's casts are in its "other")
    # the traffic: each distinct operand's two FP8 copies (+ its read unfused) at d_model 2048, 8 layers, 8192 tokens
    from lowbit.bench import model as bm

    m, t = bm.PRESETS[2048], 8192
    h, f = m["hidden"], m["intermediate"]
    writes = 2 * (3 * t * h + t * f + 5 * t * h + 2 * t * f + 4 * h * h + 3 * f * h)  # acts, grads, weights
    reads_fused = 4 * (4 * h * h + 3 * f * h)  # the FP32 weights only
    reads = reads_fused + 4 * 2 * t * h + 2 * (t * h + t * f) + 2 * (5 * t * h + 2 * t * f)
    assert cb.quant_traffic_bytes(m, t, fused=True) == m["layers"] * (writes + reads_fused)
    assert cb.quant_traffic_bytes(m, t, fused=False) == m["layers"] * (writes + reads)
    un, fu = cb.floors(2048, None, None, "NVIDIA H100 80GB HBM3")
    assert un == pytest.approx(cb.quant_traffic_bytes(m, t, False) / 3.35e9, rel=1e-12) and fu < un
    two = cb.quant_traffic_bytes(dict(m, layers=2), t, False)
    assert cb.floors(2048, 2, 1.0, "some GPU")[0] == pytest.approx(two / 1e9, rel=1e-12)
    assert cb.floors(2048, None, None, "some GPU") is None
    if not torch.cuda.is_available():  # (a variant's own process runs this tool, which needs CUDA: status 2)
        with pytest.raises(RuntimeError, match="process of variant 'bf16' exited with status 2"):
            cb.row_in_process(["--size", "2048"], "bf16")
    per_kernel = {("other", "a"): [1.0, 2.0], ("other", "b"): [3.0, 1.0], ("attention", "c"): [9.0, 1.0]}
    assert [r["kernel"] for r in cb.top_kernels(per_kernel, "other", 5)] == ["b", "a"]
    assert cb.top_kernels(per_kernel, "other", 1) == [{"kernel": "b", "ms": 3.0, "launches": 1.0}]

    class Avg:  # (what torch.profiler's key_averages() yields: a name, self CPU us over the run, calls)
        def __init__(self, key, us, count):
            self.key, self.self_cpu_time_total, self.count = key, us, count

    got = cb.host_top([Avg("aten::_scaled_mm", 3000.0, 30), Avg("cuLaunchKernel", 6000.0, 300),
                       Avg("aten::t", 30.0, 60)], steps=3, n=2)
    assert got == [{"name": "cuLaunchKernel", "ms": 2.0, "calls": 100.0},
                   {"name": "aten::_scaled_mm", "ms": 1.0, "calls": 10.0}]


@pytest.mark.parametrize("mode", [[], ["--inference"]], ids=["train", "inference"])
def test_host_profile_runs_on_cpu(mode):
    """tools/host_profile.py on the CPU (the reference path: a smoke test), a stack of two, forward + backward and
    ``--inference`` (the forward alone under inference_mode): it times both sides and prints both profiles."""
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"))
    r = subprocess.run([sys.executable, str(TOOLS / "host_profile.py"), "--device", "cpu", "--shape", "4x128x128",
                        "--recipes", "fp8-block", "--layers", "2", "--calls", "2", "--top", "3", *mode],
                       capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0, r.stderr[-2000:]
    what = "forward (inference_mode)" if mode else "forward + backward"
    assert "host " in r.stdout and f"per {what} (a stack of 2)" in r.stdout, r.stdout[-2000:]
    assert "## fp8-block: host " in r.stdout and "x BF16)" in r.stdout and "### by cumulative" in r.stdout

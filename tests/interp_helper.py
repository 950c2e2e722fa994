"""Run ``<module>.<call>`` of a test module in a child process with Triton's interpreter on from the start (the
interpreter must be chosen before triton is imported, so it cannot be switched on inside the test process)."""
import os
import subprocess
import sys


def run_interpreted(test_file: str, call: str, timeout: int = 900) -> None:
    d, mod = os.path.dirname(os.path.abspath(test_file)), os.path.splitext(os.path.basename(test_file))[0]
    here = os.path.dirname(os.path.abspath(__file__))  # (the test's folder and this one: its helper modules)
    code = "import sys; sys.path[:0] = [%r, %r]; import %s as t; t.%s" % (d, here, mod, call)
    r = subprocess.run([sys.executable, "-c", code], env=dict(os.environ, TRITON_INTERPRET="1"), capture_output=True,
                       text=True, timeout=timeout)
    assert r.returncode == 0 and "ok" in r.stdout, r.stdout[-3000:] + r.stderr[-3000:]

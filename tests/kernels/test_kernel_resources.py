"""benchmarks/kernel_resources.py gives every kernel variant it compiles a value for each constexpr parameter of its
kernel (one left out fails to compile). It refuses to run under the interpreter, so the check runs in a subprocess
with ``TRITON_INTERPRET=0``; it compiles nothing and needs no GPU."""

from __future__ import annotations

import os
import subprocess
import sys

from tests.benchmarks.helpers import BENCHMARKS

CHECK = """
import sys
sys.path.insert(0, sys.argv[1])
import kernel_resources as R
for name, (jit, configs) in R.VARIANTS.items():
    wanted = {p.name for p in R.jit_function(name).params if p.is_constexpr}
    given = set(R.variant_constexprs(name, 2, 64, configs[0]))
    print(name, *sorted(wanted ^ given))
"""


def test_every_variant_sets_every_constexpr() -> None:
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    run = subprocess.run([sys.executable, "-c", CHECK, str(BENCHMARKS)], env=env, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    lines = run.stdout.splitlines()
    assert len(lines) == 9 and all(len(line.split()) == 1 for line in lines), run.stdout  # no name missing or extra

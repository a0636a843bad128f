"""make test-latest: which installed packages differ from the lock, then the fast suite, then what failed.

Run by the environment under test (``.venv-latest/bin/python .ci/lock_drift.py --lock requirements-dev.lock -- <pytest
args>``). Prints one line per package whose installed version differs from the lock, the pytest run as it goes, and a
closing summary: the date, the drifted packages, pytest's last line and the failed tests. Exits with pytest's code.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import re
import subprocess
import sys
import sysconfig
from pathlib import Path

PIN = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==([^\s;#]+)")


def canonical(name: str) -> str:
    """PEP 503 normalised project name."""
    return re.sub(r"[-_.]+", "-", name).lower()


def read_lock(path: Path) -> dict[str, str]:
    """``{name: version}`` of every ``name==version`` line of a pip-compile lock."""
    pins = {}
    for line in path.read_text().splitlines():
        m = PIN.match(line.strip())
        if m:
            pins[canonical(m.group(1))] = m.group(2)
    return pins


def installed() -> dict[str, str]:
    """``{name: version}`` of the distributions installed in this interpreter's environment (its site-packages;
    ckv itself left out). Not ``sys.path`` as a whole: importing setuptools puts its vendored copies
    (``setuptools/_vendor``, e.g. an older packaging) on it, which are no installed distributions."""
    site = sorted({sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]})
    found = {canonical(d.metadata["Name"]): d.version for d in importlib.metadata.distributions(path=site)}
    found.pop("ckv", None)
    return found


def drift(lock: dict[str, str], have: dict[str, str]) -> list[str]:
    """One line per package whose installed version is not the locked one (or that only one side has)."""
    lines = []
    for name in sorted(set(lock) | set(have)):
        old, new = lock.get(name), have.get(name)
        if old != new and name not in {"pip", "setuptools", "wheel"}:
            lines.append(f"{name}: lock {old or '-'} -> installed {new or '-'}")
    return lines


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lock", type=Path, required=True)
    ap.add_argument("pytest_args", nargs=argparse.REMAINDER, help="after --: the arguments for pytest")
    args = ap.parse_args()
    if not args.lock.is_file():
        print(f"ckv: error: no lock file at {args.lock}; run make lock", file=sys.stderr)
        return 2
    changed = drift(read_lock(args.lock), installed())
    print(f"== {len(changed)} packages differ from {args.lock}", flush=True)
    for line in changed:
        print(f"   {line}", flush=True)
    pytest_args = [a for a in args.pytest_args if a != "--"]
    proc = subprocess.Popen(
        [sys.executable, "-m", "pytest", *pytest_args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    out = []
    for line in proc.stdout:
        sys.stdout.write(line)
        out.append(line.rstrip("\n"))
    rc = proc.wait()
    failed = [line for line in out if line.startswith(("FAILED", "ERROR"))]
    last = next((line for line in reversed(out) if line.strip()), "")
    print(f"\n== test-latest {datetime.date.today().isoformat()}: {len(changed)} packages differ from the lock")
    for line in changed:
        print(f"   {line}")
    print(f"== pytest: {last.strip('= ')}")
    for line in failed:
        print(f"   {line}")
    return rc


if __name__ == "__main__":
    sys.exit(main())

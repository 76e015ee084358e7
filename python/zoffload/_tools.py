"""The command-line tools on PATH after ``pip install .``: zoffload-report, zoffload-bench,
zoffload-plan and zoffload-export. The wheel holds the same binaries a CMake build makes, in
zoffload/bin/ beside the package's libzoffload; each console script replaces itself with one.
"""

from __future__ import annotations

import os
import sys

_BIN = os.path.join(os.path.dirname(os.path.abspath(__file__)), "bin")


def _run(name: str) -> None:
    path = os.path.join(_BIN, name)
    if not os.access(path, os.X_OK):
        sys.exit(f"{name}: this installation of zoffload has no {path} (the tools come with "
                 "`pip install .`, or a CMake build: see the README)")
    os.execv(path, [name, *sys.argv[1:]])


def report() -> None:
    _run("zoffload-report")


def bench() -> None:
    _run("zoffload-bench")


def plan() -> None:
    _run("zoffload-plan")


def export() -> None:
    _run("zoffload-export")

"""Imports a script of benchmarks/ for the tests of its pure parts (tests/ is on sys.path)."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

BENCHMARKS = str(Path(__file__).resolve().parents[1] / "benchmarks")


def import_benchmark(name: str):
    """benchmarks/<name>.py as a module, imported with benchmarks/ on the path for its own
    imports (and off it again)."""
    sys.path.insert(0, BENCHMARKS)
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(BENCHMARKS)

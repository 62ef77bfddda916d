"""Argument types of `python -m torchte.train` that refuse values a run cannot use: argparse
calls them on the text typed, and reports what they raise as an error of the option (exit
status 2) before anything is built.
"""

from __future__ import annotations

import argparse
import math

__all__ = ["finite_float"]


def finite_float(text: str) -> float:
    """The number `text` if it is finite; else argparse.ArgumentTypeError saying so ("inf",
    "nan" and "1e400" parse as floats, but a learning rate of them trains to nan). Whether it
    must be positive is RunConfig's check."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be a finite number (such as 1e-3), got {text!r}")
    return value

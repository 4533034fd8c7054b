"""argparse ``type=`` functions the scripts share: counts, sizes and durations that make no sense at 0 or
below are refused by the parser, with the option's name, instead of crashing deep inside torch (or
measuring nothing and exiting 0).

    ap.add_argument("--rounds", type=positive_int, default=7)
"""

from __future__ import annotations

import argparse
from pathlib import Path


def positive_int(text: str) -> int:
    """An integer >= 1 (argparse prefixes the option's name to the message)."""
    return _int_at_least(text, 1)


def non_negative_int(text: str) -> int:
    """An integer >= 0."""
    return _int_at_least(text, 0)


def positive_float(text: str) -> float:
    """A finite number > 0 (seconds, say)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not value > 0 or value == float("inf"):  # `not >` also refuses nan
        raise argparse.ArgumentTypeError(f"must be a number > 0, got {text}")
    return value


def output_file(text: str) -> str:
    """A file the script will write: its folder is made now, so that a long run never ends in a
    traceback for a missing folder (and a path it cannot make is refused before any work)."""
    path = Path(text)
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{text} is a folder, not a file")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise argparse.ArgumentTypeError(f"cannot make the folder of {text}: {exc.strerror}") from None
    return text


def output_dir(text: str) -> Path:
    """A folder the script will write into: made now, so that a path that is a file, or one that
    cannot be made, is refused before any work."""
    path = Path(text)
    if path.exists() and not path.is_dir():
        raise argparse.ArgumentTypeError(f"{text} is a file, not a folder")
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise argparse.ArgumentTypeError(f"cannot make the folder {text}: {exc.strerror}") from None
    return path


def threads(text: str) -> int:
    """A torch thread count between 1 and the CPUs this process may run on: more would time threads
    queueing for cores (the sweep's jobs refuse them too)."""
    from experiments.measure.common import usable_cpus

    value, cpus = _int_at_least(text, 1), usable_cpus()
    if value > cpus:
        raise argparse.ArgumentTypeError(f"{value} threads, but this process may run on {cpus} CPU(s)")
    return value


def _int_at_least(text: str, low: int) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value < low:
        raise argparse.ArgumentTypeError(f"must be an integer >= {low}, got {value}")
    return value

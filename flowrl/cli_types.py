"""Argument types shared by the command line and the commands plug-ins add to it: a bad value is one line."""

from __future__ import annotations

import argparse


def _number(text: str, kind=int):
    try:
        return kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a {'whole number' if kind is int else 'number'}") from None


def positive_int(text: str) -> int:
    value = _number(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} must be at least 1")
    return value


def non_negative_int(text: str) -> int:
    value = _number(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"{value} must be 0 or more")
    return value


def seed(text: str) -> int:
    """A run's seed: a whole number in 0..2^32 - 1 (seeds of later draws are derived from it within 64 bits)."""
    value = _number(text)
    if not 0 <= value <= 2 ** 32 - 1:
        raise argparse.ArgumentTypeError(f"{value} is not a seed: give a whole number in 0..{2 ** 32 - 1}")
    return value


def non_negative_number(text: str) -> float:
    value = _number(text, float)
    if not 0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"{value} must be a finite number, 0 or more")
    return value


def share(text: str) -> float:
    """A share: a number in [0, 1]."""
    value = _number(text, float)
    if not 0 <= value <= 1:
        raise argparse.ArgumentTypeError(f"{value} must lie between 0 and 1")
    return value


def port(text: str) -> int:
    """A TCP port: 0 (any free one) to 65535."""
    value = _number(text)
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"{value} is not a port: give 1..65535, or 0 for any free port")
    return value


def positive_number(text: str) -> float:
    value = _number(text, float)
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"{value} must be a positive number")
    return value


def batch_size(text: str) -> int | str:
    """A positive whole number, or ``auto``."""
    return "auto" if text == "auto" else positive_int(text)


def power_of_two(text: str) -> int:
    value = positive_int(text)
    if value & (value - 1):
        raise argparse.ArgumentTypeError(f"{value} is not a power of 2 (1, 2, 4, 8, 16, ...)")
    return value


def unit_interval(text: str) -> float:
    value = _number(text, float)
    if not 0 < value < 1:
        raise argparse.ArgumentTypeError(f"{value} must lie strictly between 0 and 1")
    return value


class Parser(argparse.ArgumentParser):
    """Bad command-line arguments end in one line, like every other flowrl error."""

    def error(self, message):
        self.exit(2, f"flowrl: error: {self.prog}: {message} (see {self.prog} --help)\n")

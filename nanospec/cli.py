"""Argument checks shared by nanospec's command-line tools (train_assistant, eval_acceptance): every bad value
stops argparse with a message naming the option and its allowed range, before any model or data is loaded."""
from __future__ import annotations

import argparse
import math


class HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """Module docstring kept as written; options with help text show their default (unless unset: None)."""

    def _get_help_string(self, action):
        return action.help if action.default is None else super()._get_help_string(action)


def number_list(ap: argparse.ArgumentParser, option: str, text: str, typ=float, lo: float = 0) -> list:
    """``"0,0.7"`` -> ``[0.0, 0.7]``; ``ap.error`` unless every item parses as ``typ`` and is finite and >= ``lo``."""
    try:
        vals = [typ(x) for x in text.split(",")]
    except ValueError:
        vals = []
    if not vals or not all(math.isfinite(v) and v >= lo for v in vals):
        ap.error(f"{option} must be a comma-separated list of {typ.__name__}s >= {lo:g}, got {text!r}")
    return vals


def check_ranges(ap: argparse.ArgumentParser, args: argparse.Namespace, bounds: dict[str, tuple[float, bool]]):
    """``bounds``: ``{dest: (lo, strict)}``; unset (None) options pass. ``ap.error`` names the first bad option."""
    for dest, (lo, strict) in bounds.items():
        v = getattr(args, dest)
        if v is not None and (not math.isfinite(v) or v < lo or (strict and v == lo)):
            ap.error(f"--{dest.replace('_', '-')} must be {'>' if strict else '>='} {lo:g}, got {v}")

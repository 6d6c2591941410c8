"""Argument checks of nanospec's command-line tools (train_assistant, eval_acceptance): every bad value stops
argparse with a message naming the option and its allowed range, before any model or data is loaded."""
from __future__ import annotations

import argparse
import math
import os
import pathlib


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


def check_out_dir(ap: argparse.ArgumentParser, option: str, path: str) -> None:
    """``ap.error`` unless ``path`` is a directory or could be created as one (its nearest existing ancestor is a
    writable directory); creates nothing, so a command rejected later leaves no trace."""
    p = pathlib.Path(path).expanduser().absolute()
    while not p.exists() and p != p.parent:
        p = p.parent
    if not p.is_dir() or not os.access(p, os.W_OK | os.X_OK):
        ap.error(f"{option} must be a directory that can be created, got {path!r} ({str(p)!r} is not a writable dir)")


def make_out_dir(ap: argparse.ArgumentParser, option: str, path: str) -> None:
    """Create ``path`` (and parents) once every other check passed; ``ap.error`` if that fails."""
    try:
        pathlib.Path(path).mkdir(parents=True, exist_ok=True)
    except OSError as e:
        ap.error(f"{option} must be a directory that can be created, got {path!r}: {e.strerror}")


def load_assistant(ap: argparse.ArgumentParser, option: str, value: str, layers: int | None = None):
    """``--init`` / ``--assistant``: load that assistant checkpoint (CPU, a few MB) while checking arguments, so a
    bad one costs no model or data work; ``ap.error`` if it does not load or (``layers`` given) has another layer
    count. Returns (assistant, dir). 'default' is resolved whatever the target; the caller checks that the target is
    the default one (``loader.is_default_target``)."""
    from .models.gemma4_assistant import Gemma4Assistant
    from .mtp.worker import resolve_assistant
    what = "'default' or an HF gemma4_assistant checkpoint dir"
    if value != "default" and not (value and pathlib.Path(value).is_dir()):
        ap.error(f"{option} must be {what}, got {value!r} (no such dir)")
    try:
        d = resolve_assistant(value, target_is_default=True)
        assistant = Gemma4Assistant.from_pretrained(d)
    except (ValueError, OSError, KeyError, TypeError) as e:
        ap.error(f"{option} must be {what}, got {value!r}: {e}")
    n = assistant.text_config.num_hidden_layers
    if layers not in (None, n):
        ap.error(f"--layers {layers} contradicts {option} {value!r}, which has {n} layer(s)")
    return assistant, d

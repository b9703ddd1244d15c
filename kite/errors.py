"""Errors the CLI turns into one red line and an exit code (1 failure, 2 bad usage or input)."""

from __future__ import annotations


class KiteError(Exception):
    """A failure KITE explains in one line. `exit_code` 1: the work failed."""

    exit_code = 1


class BadInput(KiteError):
    """The user's input (a file, a flag, a config value) is wrong. Exit code 2."""

    exit_code = 2


class FingerprintMismatch(KiteError):
    """A state or adapter was made by another model, tokenizer or adapter."""

    exit_code = 2

"""Directories our commands write into: never a link, never a non-empty one unless told."""

from __future__ import annotations

from pathlib import Path


class OutputDirError(ValueError):
    """The output directory cannot be written safely; the message says what to change."""


def checked_output_dir(path: str | Path, overwrite: bool, flag: str = "--out") -> Path:
    """``path`` as named (not through a symbolic link); refuses a file, and a non-empty
    directory unless ``overwrite``."""
    out = Path(path)
    if out.is_symlink():
        raise OutputDirError(
            f"{out} is a symbolic link (to {out.readlink()}); name the real directory"
        )
    if out.exists() and not out.is_dir():
        raise OutputDirError(f"{out} exists and is not a directory; choose another {flag}")
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        raise OutputDirError(
            f"{out} exists and is not empty; choose an empty or new directory for {flag}, "
            "or pass --overwrite to replace what is there"
        )
    return out

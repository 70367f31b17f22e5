"""Paths a client names, held inside the server's --data-dir."""

from __future__ import annotations

from pathlib import Path

from serve.errors import InvalidArgument, echo


def check_files_inside(directory: Path, root: Path, given: str, field: str) -> None:
    """InvalidArgument(`field`) when an entry of `directory` (an adapter's config, its weights)
    is a symlink that leads out of `root` (--data-dir, resolved): the directory itself being
    inside is not enough, since its files are what the server reads."""
    try:
        escaping = [entry.name for entry in directory.iterdir() if not entry.resolve().is_relative_to(root)]
    except (OSError, RuntimeError, ValueError) as e:  # a loop of symlinks, an unreadable directory, ...
        raise InvalidArgument(f"{echo(given)} cannot be read ({type(e).__name__})", field) from None
    if escaping:
        raise InvalidArgument(f"{echo(given)}: {echo(escaping[0])} leads outside the server's --data-dir", field)

"""Files opfuse writes and later reads back: private folders (`private_dir`) and atomic writes (`write_atomically`).

Generated kernel modules are imported, and a loaded package's binaries are handed to Triton, so the folders that
hold them must be writable by this user alone: `private_dir` creates a folder with mode 0700, and refuses one that
another user owns or that is a symbolic link (a folder of a shared temp dir that someone created first, so that
they could put code in it); one of ours with looser permissions is tightened to 0700.
"""

from __future__ import annotations

import os
import stat
import tempfile
from pathlib import Path


class UnsafeFolder(OSError):
    """A folder opfuse would read code from that another user could write into."""


def private_dir(path: str | os.PathLike[str]) -> Path:
    """`path` as a folder only this user can write into: created with mode 0700 where missing (its parents as
    usual); UnsafeFolder where it is a symbolic link, not a folder, or owned by another user; tightened to 0700
    where ours and group- or world-accessible."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        path.mkdir(mode=0o700)
    except FileExistsError:
        pass
    check_private(path, tighten=True)
    return path


def check_private(path: str | os.PathLike[str], tighten: bool = False) -> None:
    """UnsafeFolder unless `path` is a folder (not a link) of this user's that no one else may write into (with
    `tighten`, one of ours with looser permissions is set to 0700 instead)."""
    info = os.lstat(path)
    if stat.S_ISLNK(info.st_mode) or not stat.S_ISDIR(info.st_mode):
        raise UnsafeFolder(f"{path} is not a folder but {'a symbolic link' if stat.S_ISLNK(info.st_mode) else 'a file'}"
                           ": opfuse keeps generated code only in a private folder")
    if info.st_uid != os.getuid():
        raise UnsafeFolder(f"{path} belongs to user {info.st_uid}, not to this user ({os.getuid()}): another user "
                           "could put code there for opfuse to run; remove it or choose another folder")
    if stat.S_IMODE(info.st_mode) & 0o077:
        if not tighten:
            raise UnsafeFolder(f"{path} is open to other users (mode {stat.S_IMODE(info.st_mode):o}): opfuse keeps "
                               "generated code only in a private folder")
        os.chmod(path, 0o700)


def write_atomically(path: str | os.PathLike[str], data: bytes) -> None:
    """Write `data` to a temp name in `path`'s folder, then rename it over `path`: a reader (another process) sees
    the old file or the whole new one, and an interrupted write leaves no half-written file behind."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name[:40]}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)

"""Opening the files kt reads (manifests, layer files, source checkpoints) safely, and the error
type every file check raises.

Only regular files are opened: a FIFO, a device or a socket put where a file is expected would
block ``open()`` or hand back endless bytes, so the path is opened non-blocking and its type is
checked on the open descriptor before anything is read.
"""
from __future__ import annotations

import os
import stat
from pathlib import Path

__all__ = ["FileFormatError", "open_regular", "read_regular"]


class FileFormatError(ValueError):
    """A file that is missing, damaged, or not what it should be.

    ``FileFormatError(path, expected, found)`` reads "<path>: <found>; expected <expected>" and
    keeps the three parts as ``.path``, ``.expected``, ``.found``. ``FileFormatError(message)``
    takes a finished message that already names the file (``.path`` etc. are then None).
    """

    def __init__(self, path, expected: str | None = None, found: str | None = None,
                 hint: str = ""):
        if expected is None and found is None:
            self.path = self.expected = self.found = None
            super().__init__(str(path))
            return
        self.path, self.expected, self.found = Path(path), expected, found
        msg = f"{path}: {found}; expected {expected}"
        super().__init__(f"{msg}; {hint}" if hint else msg)

    def __reduce__(self):  # picklable across processes with the same parts
        if self.path is None:
            return type(self), (str(self),)
        return type(self), (self.path, self.expected, self.found)


_KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"),
          (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"))


def open_regular(path, error=FileFormatError):
    """``path`` opened for binary reading, if it is a regular file (symlinks followed).

    Missing: FileNotFoundError. Anything else that is not a readable regular file (a FIFO, a
    directory, a symlink loop, no permission): ``error(path, "a regular file", what it is)``.
    """
    path = Path(path)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        raise FileNotFoundError(f"{path}: no such file") from None
    except OSError as exc:
        raise error(path, "a readable regular file", f"cannot open it ({exc.strerror})") from None
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            kind = next((name for test, name in _KINDS if test(mode)), "not a regular file")
            raise error(path, "a regular file", kind)
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def read_regular(path, limit: int, error=FileFormatError) -> bytes:
    """All bytes of the regular file ``path``; more than ``limit`` bytes is an ``error``."""
    with open_regular(path, error) as f:
        data = f.read(limit + 1)
    if len(data) > limit:
        raise error(path, f"at most {limit} bytes", "a larger file")
    return data

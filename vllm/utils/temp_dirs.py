"""Private temporary directories that hold unix sockets."""

from __future__ import annotations

import os
import tempfile


def socket_dir(prefix: str, max_len: int) -> str:
    """A fresh private directory whose path is at most `max_len` bytes where possible: made
    in $TMPDIR, or in /tmp when $TMPDIR is too long for the socket paths inside it (a unix
    socket path is limited to about 107 bytes). The caller removes it."""
    path = tempfile.mkdtemp(prefix=prefix)
    if len(path) > max_len:
        os.rmdir(path)
        path = tempfile.mkdtemp(prefix=prefix, dir="/tmp")
    return path

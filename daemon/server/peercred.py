"""The uid of the process on the other end of a Unix socket.

Linux has SO_PEERCRED; macOS and the BSDs have getpeereid(2) in libc (Python's socket
module does not wrap it, so ctypes calls it).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import socket
import struct
import sys


def peer_uid(sock: socket.socket) -> int | None:
    """The peer's uid, or None where the platform cannot say."""
    if sys.platform.startswith("linux"):
        so_peercred = getattr(socket, "SO_PEERCRED", 17)
        raw = sock.getsockopt(socket.SOL_SOCKET, so_peercred, struct.calcsize("3i"))
        _pid, uid, _gid = struct.unpack("3i", raw)
        return uid
    return _getpeereid(sock.fileno())


def _getpeereid(fd: int) -> int | None:
    path = ctypes.util.find_library("c")
    if path is None:
        return None
    libc = ctypes.CDLL(path, use_errno=True)
    func = getattr(libc, "getpeereid", None)
    if func is None:
        return None
    uid, gid = ctypes.c_uint32(), ctypes.c_uint32()
    if func(fd, ctypes.byref(uid), ctypes.byref(gid)) != 0:
        return None
    return uid.value

"""A control-socket client for a user namespace: connects to the socket, sends `status` and
prints what it saw, as one line: `EACCES` (the connect was refused), or `UID <its uid> REPLY `
followed by the first 2000 bytes the daemon sent before it closed (or went quiet for 10 s).

Usage: hostile_control_ns_client.py SOCKET_PATH
"""

from __future__ import annotations

import os
import socket
import sys


def main(path: str) -> None:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(10)
    try:
        s.connect(path)
    except PermissionError:
        sys.stdout.write("EACCES")
        return
    s.sendall(b'{"id": 1, "method": "status"}\n')
    data = b""
    try:
        while chunk := s.recv(1 << 16):
            data += chunk
    except TimeoutError:  # still open: whatever came is the answer
        pass
    sys.stdout.write(f"UID {os.getuid()} REPLY " + data[:2000].decode(errors="replace"))


if __name__ == "__main__":
    main(sys.argv[1])

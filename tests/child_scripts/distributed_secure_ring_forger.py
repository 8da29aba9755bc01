"""Rank 0 of a two-rank ring (MLX_RANK=0, MLX_HOSTFILE as the parent set them) that forges what
an attacker on the ring could send the worker: a bare pickle gadget (unpickled, it would create
MARKER), messages sealed with another group's secret or id, a flipped bit, a replay, an
authentic pickle, an authentic unknown kind; then an authentic stop. The group key comes on
stdin, as rank 0 gives it to its worker. Prints "forger done" at the end.

Usage: distributed_secure_ring_forger.py MARKER
"""

from __future__ import annotations

import json
import os
import pickle
import sys

import mlx.core as mx
from mlxcel.daemon.distributed.channel import Channel, RankFigures
from mlxcel.daemon.distributed.wire import GroupKey, Sealer, encode


def main(marker: str) -> None:
    key = GroupKey.from_line(sys.stdin.buffer.readline())

    class Gadget:  # unpickling this creates the marker file
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    group = mx.distributed.init(strict=True, backend="ring")
    ch = Channel(group, key)
    figs = RankFigures(0, 0, os.getpid(), 0)
    ping = {"kind": "ping", "commands": [], "seed": 0}
    gadget = pickle.dumps({"kind": "setup", "config": Gadget(), "mode": "tensor"})

    def send(frame: bytes) -> None:
        ch.transfer(frame, figs)

    send(gadget)  # the old wire format: a bare pickle
    send(Sealer(GroupKey.new()).seal(encode(ping)))  # another group's secret
    send(Sealer(GroupKey(os.urandom(16), key.secret)).seal(encode(ping)))  # another group id
    flipped = bytearray(ch.sealer.seal(encode(ping)))
    flipped[-3] ^= 1
    send(bytes(flipped))  # one bit changed on the way
    frame = ch.sealer.seal(encode(ping))
    send(frame)  # authentic (a ping before the setup: ignored)
    send(frame)  # the same frame again: a replay
    send(ch.sealer.seal(gadget))  # authentic, but a pickle: not a message
    send(ch.sealer.seal(json.dumps({"kind": "exec", "argv": ["touch", marker]}).encode()))
    send(gadget + b"x" * 3000)  # the old format again, over the inline room
    ch.exchange({"kind": "stop", "commands": [], "seed": 0}, figs)  # authentic: the worker exits
    print("forger done", flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:])

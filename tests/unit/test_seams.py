"""The typed seams (daemon/server/seams.py) match what implements them: every member of each
protocol exists on each implementation, with the same parameters and the same async-ness, so
the annotations in the HTTP handlers, `DaemonRuntime` and `Daemon` say what really runs."""

from __future__ import annotations

import inspect
from typing import Any

import pytest
from mlxcel.daemon.engine.bridge import EngineBridge
from mlxcel.daemon.hosting.facade import HostBridge
from mlxcel.daemon.server.seams import ControlBridge, RequestBridge

CASES = [(RequestBridge, EngineBridge), (ControlBridge, EngineBridge), (ControlBridge, HostBridge)]


def members(protocol: type) -> dict[str, Any]:
    skip = {"__init__", "__subclasshook__", "__class_getitem__", "__init_subclass__"}
    names = set(protocol.__protocol_attrs__) if hasattr(protocol, "__protocol_attrs__") else set()
    names |= {n for n in vars(protocol) if not n.startswith("_")}
    return {n: inspect.getattr_static(protocol, n) for n in sorted(names - skip)}


@pytest.mark.parametrize(("protocol", "impl"), CASES, ids=lambda c: c.__name__)
def test_the_implementation_has_every_member_with_its_shape(protocol: type, impl: type) -> None:
    for name, want in members(protocol).items():
        assert hasattr(impl, name), f"{impl.__name__} lacks {name}"
        got = inspect.getattr_static(impl, name)
        assert isinstance(got, property) == isinstance(want, property), name
        if isinstance(want, property):
            continue
        assert inspect.iscoroutinefunction(got) == inspect.iscoroutinefunction(want), name
        params = [list(inspect.signature(f).parameters)[1:] for f in (want, got)]
        assert len(params[0]) == len(params[1]), (name, params)

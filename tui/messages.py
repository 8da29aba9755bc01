"""Messages the daemon link and the action workers post to the App: past-tense facts."""

from __future__ import annotations

from typing import Any

from mlxcel.shared.snapshot import ConfigChange, Snapshot
from textual.message import Message


class ConnectionMade(Message):
    """The link connected and the daemon said hello."""

    def __init__(self, hello: dict[str, Any]) -> None:
        super().__init__()
        self.hello = hello


class ConnectionLost(Message):
    """An established connection dropped (daemon stopped, crashed or restarted)."""

    def __init__(self, reason: str) -> None:
        super().__init__()
        self.reason = reason


class ConnectAttemptFailed(Message):
    """No daemon answered this attempt; the link retries."""

    def __init__(self, reason: str, attempt: int) -> None:
        super().__init__()
        self.reason = reason
        self.attempt = attempt


class ProtocolMismatched(Message):
    """The daemon speaks another control-protocol version."""

    def __init__(self, message: str) -> None:
        super().__init__()
        self.message = message


class SnapshotReceived(Message):
    """A new snapshot arrived; a newer one in the queue replaces it (slow terminals)."""

    def __init__(self, snapshot: Snapshot, received_at: float) -> None:
        super().__init__()
        self.snapshot = snapshot
        self.received_at = received_at

    def can_replace(self, message: Message) -> bool:
        return isinstance(message, SnapshotReceived)


class DaemonEventReceived(Message):
    """A discrete daemon event: config_changed, request_rejected, request_finished, ..."""

    def __init__(self, name: str, data: dict[str, Any]) -> None:
        super().__init__()
        self.name = name
        self.data = data


class ConfigAnswered(Message):
    """The daemon answered a `config.set` from this console."""

    def __init__(self, changes: list[ConfigChange], config: dict[str, Any]) -> None:
        super().__init__()
        self.changes = changes
        self.config = config


class CommandFailed(Message):
    """A control call from this console failed (refused, not connected, timed out)."""

    def __init__(self, what: str, message: str, counted: bool = True) -> None:
        super().__init__()
        self.what = what
        self.message = message
        self.counted = counted  # a config.set: it held `parallel`'s pending target


class RequestCancelled(Message):
    """`request.cancel` ended this request."""

    def __init__(self, request_id: str) -> None:
        super().__init__()
        self.request_id = request_id


class LogLinesReceived(Message):
    """Lines of the daemon's log: a (re)subscription's recent ones (`replace`) or a new one."""

    def __init__(self, lines: list[dict[str, Any]], replace: bool = False) -> None:
        super().__init__()
        self.lines = lines
        self.replace = replace


class RequestInfoReceived(Message):
    """`request.info`: the model and sampling parameters of one request."""

    def __init__(self, request_id: str, info: dict[str, Any]) -> None:
        super().__init__()
        self.request_id = request_id
        self.info = info


class HistoryReceived(Message):
    """The daemon's 15-minute history (`history`): one point per `step_s`."""

    def __init__(self, points: list[dict[str, Any]], step_s: float) -> None:
        super().__init__()
        self.points = points
        self.step_s = step_s


class SettingsSaved(Message):
    """`config.save` wrote the daemon's settings to this file."""

    def __init__(self, path: str) -> None:
        super().__init__()
        self.path = path

"""Priority lanes and deadlines (docs/tuning.md, "Priority lanes"): pure functions, no state.

A request's lane is `high`, `normal` or `low`. The waiting queue is ordered by lane rank, then
arrival; a request rises one lane for every `aging_s` seconds it has waited, so under a steady
stream of high requests a low one waits at most about `2 x aging_s` before it is ordered by its
arrival among them (and it arrived earlier than every high request that came after it).
"""

from __future__ import annotations

from collections.abc import Iterable

LANES = ("high", "normal", "low")
LANE_RANK = {lane: rank for rank, lane in enumerate(LANES)}
DEFAULT_LANE = "normal"
DEFAULT_AGING_S = 10.0
MAX_TIMEOUT_S = 86400.0


def parse_lane(value: object) -> str:
    """A lane from `high|normal|low` or vLLM's integer priority (lower is served earlier:
    negative is high, 0 normal, positive low). Raises ValueError with the message a client
    gets."""
    if isinstance(value, bool):
        raise ValueError("priority must be high, normal, low or an integer")
    if isinstance(value, int):
        return "high" if value < 0 else "low" if value > 0 else "normal"
    if isinstance(value, str):
        text = value.strip().lower()
        if text in LANE_RANK:
            return text
        try:
            return parse_lane(int(text))
        except ValueError:
            pass
    raise ValueError(f"priority must be high, normal, low or an integer, got {value!r}")


def parse_timeout(value: object) -> float:
    """Seconds a request may take, a positive number (text from a header, or a number)."""
    if isinstance(value, bool):
        raise ValueError("timeout must be a number of seconds")
    try:
        seconds = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        raise ValueError(f"timeout must be a number of seconds, got {value!r}") from None
    if not 0 < seconds <= MAX_TIMEOUT_S:
        raise ValueError(f"timeout must be in (0, {MAX_TIMEOUT_S:g}] seconds, got {value!r}")
    return seconds


def lane_rank(lane: str) -> int:
    """0 for high, 1 normal, 2 low (an unknown lane ranks as normal)."""
    return LANE_RANK.get(lane, LANE_RANK[DEFAULT_LANE])


def effective_rank(lane: str, waited_s: float, aging_s: float) -> int:
    """The lane's rank (0 is high) less one per `aging_s` seconds waited, at least 0."""
    rank = lane_rank(lane)
    if aging_s > 0:
        rank -= int(max(waited_s, 0.0) // aging_s)
    return max(rank, 0)


def queue_order(entries: Iterable[tuple[str, float]], now: float, aging_s: float) -> list[int]:
    """The order to serve waiting requests given as (lane, arrival): indices, by effective
    rank, then arrival (stable: equal arrivals keep their order)."""
    items = list(entries)
    return sorted(
        range(len(items)),
        key=lambda i: (effective_rank(items[i][0], now - items[i][1], aging_s), items[i][1]),
    )

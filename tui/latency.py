"""TTFT and throughput over the last 60 s: sparklines with their figures."""

from __future__ import annotations

from mlxcel.shared.snapshot import Snapshot
from textual.app import ComposeResult
from textual.containers import Horizontal, Vertical
from textual.reactive import reactive
from textual.widgets import Label, Sparkline, Static

from .format import NA, fmt_pair, fmt_rate, fmt_secs, ttft_split
from .state import Sample, series

# (row id, label, Sample field)
ROWS = (
    ("ttft", "TTFT p50", "ttft_p50_s"),
    ("decode", "decode tok/s", "decode_tps"),
    ("prefill", "prefill tok/s", "prefill_tps"),
)


class LatencyPanel(Vertical):
    """Parent of the sparklines: it sets their data from the samples it is given."""

    BORDER_TITLE = "last 60 s"
    snapshot: reactive[Snapshot | None] = reactive(None)
    samples: reactive[tuple[Sample, ...]] = reactive(tuple)

    def compose(self) -> ComposeResult:
        for row_id, label, _ in ROWS:
            with Horizontal(classes="latency-row"):
                yield Label(label, classes="latency-label")
                yield Sparkline([], id=f"{row_id}-spark", classes="latency-spark")
                yield Static(NA, id=f"{row_id}-figures", classes="latency-figures")
            if row_id == "ttft":
                yield Static("", id="ttft-split", classes="latency-split")

    def watch_samples(self, samples: tuple[Sample, ...]) -> None:
        for row_id, _, name in ROWS:
            self.query_one(f"#{row_id}-spark", Sparkline).data = series(samples, name)
        self._update_figures()

    def watch_snapshot(self) -> None:
        self._update_figures()

    def _update_figures(self) -> None:
        if not self.is_mounted:
            return
        figures = latency_figures(self.snapshot, self.samples)
        # Fixed-size cells (app.tcss): no layout pass, which would repaint the whole screen.
        for row_id, _, _ in ROWS:
            self.query_one(f"#{row_id}-figures", Static).update(figures[row_id], layout=False)
        self.query_one("#ttft-split", Static).update(figures["split"], layout=False)


def latency_figures(snapshot: Snapshot | None, samples: tuple[Sample, ...]) -> dict[str, str]:
    """The text next to each sparkline (also used by `--once`)."""
    if snapshot is None:
        return {"ttft": NA, "decode": NA, "prefill": NA, "split": ""}
    lat = snapshot.engine.latency
    return {
        "ttft": f"p50 {fmt_secs(lat.ttft_p50_s)}  p95 {fmt_secs(lat.ttft_p95_s)}",
        "decode": (
            f"now {fmt_rate(lat.decode_tokens_per_s)}{_peak(samples, 'decode_tps')}"
            f"  ITL {fmt_pair(lat.itl_p50_s, lat.itl_p95_s)}"
        ),
        "prefill": (f"now {fmt_rate(lat.prefill_tokens_per_s)}{_peak(samples, 'prefill_tps')}"),
        "split": ttft_split(lat),
    }


def _peak(samples: tuple[Sample, ...], name: str) -> str:
    """`  peak X` over the history; nothing when there is no history (`--once`)."""
    values = series(samples, name)
    return f"  peak {fmt_rate(max(values))}" if values else ""

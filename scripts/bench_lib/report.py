"""Printing the results: a fixed-width table, side-by-side ratios, a Markdown table."""

from __future__ import annotations

from bench_lib.client import GAP_OVER_MS, GAP_PERCENTILES, LevelResult

COLUMNS = (
    ("server", "server", "{}"),
    ("clients", "clients", "{}"),
    ("ok", "ok", "{}"),
    ("fail", "fail", "{}"),
    ("out_tok/s", "output_tok_s", "{:.2f}"),
    ("ttft_mean_s", "ttft_mean_s", "{:.3f}"),
    ("ttft_p95_s", "ttft_p95_s", "{:.3f}"),
    ("itl_mean_ms", "itl_mean_ms", "{:.1f}"),
    ("itl_p95_ms", "itl_p95_ms", "{:.1f}"),
    ("tok/req", "tokens_per_request", "{:.1f}"),
    ("prompt_tok", "prompt_tokens_mean", "{:.0f}"),
    ("cached_tok", "cached_tokens_mean", "{:.0f}"),
)
RATIOS = (
    ("output tok/s", "output_tok_s"),
    ("TTFT mean", "ttft_mean_s"),
    ("TTFT p95", "ttft_p95_s"),
    ("ITL p95", "itl_p95_ms"),
)


def _cell(fmt: str, value: object) -> str:
    return "n/a" if value is None else fmt.format(value)


def format_table(results: list[LevelResult], header: bool = True) -> str:
    widths = [max(len(title), 8) for title, _, _ in COLUMNS]
    rows = []
    if header:
        rows.append("  ".join(t.rjust(w) for (t, _, _), w in zip(COLUMNS, widths, strict=True)))
    for r in results:
        cells = [_cell(fmt, getattr(r, attr)) for _, attr, fmt in COLUMNS]
        rows.append("  ".join(c.rjust(w) for c, w in zip(cells, widths, strict=True)))
    return "\n".join(rows)


def print_metrics(r: LevelResult) -> None:
    m = r.metrics or {}

    def get(key: str, fmt: str) -> str:
        return _cell(fmt, m.get(key))

    print(
        f"  metrics {r.server} @{r.clients}: slot occupancy {get('slot_occupancy', '{:.2f}')} "
        f"(mean busy {get('slots_busy_mean', '{:.2f}')} of {get('slots_total', '{:.0f}')}), "
        f"prefill padding efficiency {get('prefill_padding_efficiency', '{:.3f}')} "
        f"(computed {get('prompt_computed', '{:.0f}')} / padded {get('prefill_padded', '{:.0f}')}"
        f" tokens), cached prompt tokens {get('prompt_cached', '{:.0f}')}",
        flush=True,
    )


def format_gaps(results: list[LevelResult]) -> str:
    """Each level's inter-token gap distribution: percentiles, max, and how many gaps exceed
    each threshold (ms) out of all."""
    keys = [f"p{q}" for q in GAP_PERCENTILES] + ["max"]
    over = [f"over_{ms}ms" for ms in GAP_OVER_MS]
    head = ["server", "clients", "gaps", *keys, *(f">{ms}ms" for ms in GAP_OVER_MS)]
    rows = [head]
    for r in results:
        g = r.itl_gaps
        if not g:
            continue
        cells = [r.server, str(r.clients), f"{g['n']:.0f}"]
        cells += [f"{g[k]:.0f}" for k in keys]
        cells += [f"{g[k]:.0f} ({100 * g[k] / g['n']:.1f}%)" for k in over]
        rows.append(cells)
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    lines = ("  ".join(c.rjust(w) for c, w in zip(row, widths, strict=True)) for row in rows)
    return "\n".join(lines)


def ratio_rows(ours: list[LevelResult], theirs: list[LevelResult]) -> list[list[str]]:
    """Per level: clients, then ours/theirs for each RATIOS figure."""
    by_clients = {r.clients: r for r in theirs}
    rows = []
    for r in ours:
        other = by_clients.get(r.clients)
        if other is None:
            continue
        cells = [str(r.clients)]
        for _, attr in RATIOS:
            a, b = getattr(r, attr), getattr(other, attr)
            cells.append("n/a" if a is None or not b else f"{a / b:.2f}x")
        rows.append(cells)
    return rows


def format_ratios(by_server: dict[str, list[LevelResult]]) -> str:
    if not {"mlxcel", "mlx_lm"} <= by_server.keys():
        return ""
    lines = ["mlxcel / mlx_lm   clients  " + "  ".join(f"{t:>12}" for t, _ in RATIOS)]
    for cells in ratio_rows(by_server["mlxcel"], by_server["mlx_lm"]):
        lines.append(f"{'ratio':>15}  {cells[0]:>7}  " + "  ".join(f"{c:>12}" for c in cells[1:]))
    return "\n".join(lines)


def format_markdown(by_server: dict[str, list[LevelResult]]) -> str:
    head = (
        "| server | clients | ok / fail | output tok/s | TTFT mean (s) | TTFT p95 (s) "
        "| ITL mean (ms) | ITL p95 (ms) | tokens/request |"
    )
    lines = [head, "|" + "---|" * 9]
    levels = sorted({r.clients for rs in by_server.values() for r in rs})
    for clients in levels:
        for name, results in by_server.items():
            for r in (x for x in results if x.clients == clients):
                lines.append(
                    f"| {name} | {clients} | {r.ok} / {r.fail} | {_cell('{:.2f}', r.output_tok_s)}"
                    f" | {_cell('{:.2f}', r.ttft_mean_s)} | {_cell('{:.2f}', r.ttft_p95_s)}"
                    f" | {_cell('{:.0f}', r.itl_mean_ms)} | {_cell('{:.0f}', r.itl_p95_ms)}"
                    f" | {_cell('{:.1f}', r.tokens_per_request)} |"
                )
    if {"mlxcel", "mlx_lm"} <= by_server.keys():
        lines += [
            "",
            "| clients | " + " | ".join(f"{t} (mlxcel / mlx_lm)" for t, _ in RATIOS) + " |",
        ]
        lines.append("|" + "---|" * (len(RATIOS) + 1))
        for cells in ratio_rows(by_server["mlxcel"], by_server["mlx_lm"]):
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


# ---------------------------------------------------------------- interleaved rounds

VERSUS = (
    ("tok/s", "output_tok_s"),
    ("TTFT mean", "ttft_mean_s"),
    ("TTFT p95", "ttft_p95_s"),
    ("ITL mean", "itl_mean_ms"),
    ("ITL p95", "itl_p95_ms"),
    ("TPOT", "tpot_mean_ms"),
)
VERSUS_COLUMNS = (
    ("workload", "workload", "{}"),
    ("round", "round", "{}"),
    *COLUMNS,
)


def format_rounds_table(results: list[LevelResult], header: bool = True) -> str:
    """format_table with the workload and round first (the server column 14 wide)."""
    widths = [max(len(t), 14 if attr == "server" else 8) for t, attr, _ in VERSUS_COLUMNS]
    rows = []
    if header:
        titles = (t for t, _, _ in VERSUS_COLUMNS)
        rows.append("  ".join(t.rjust(w) for t, w in zip(titles, widths, strict=True)))
    for r in results:
        cells = [_cell(fmt, getattr(r, attr)) for _, attr, fmt in VERSUS_COLUMNS]
        rows.append("  ".join(c.rjust(w) for c, w in zip(cells, widths, strict=True)))
    return "\n".join(rows)


def best_round(results: list[LevelResult]) -> LevelResult:
    """The round with the highest output tok/s (all its figures come from that round)."""
    return max(results, key=lambda r: (r.fail == 0, r.output_tok_s))


def format_versus(
    best: dict[str, dict[str, LevelResult]],
    rounds: dict[str, dict[str, list[LevelResult]]],
    ours: list[str],
    theirs: str,
) -> str:
    """Per workload: each server's best round, every round's tok/s, and each of ours / theirs."""
    lines = [
        f"{'workload':>10}  {'server':>14}  {'tok/s':>8}  {'TTFT mean':>9}  {'TTFT p95':>8}  "
        f"{'ITL mean':>8}  {'ITL p95':>8}  {'TPOT':>8}  rounds' tok/s"
    ]
    for workload, by_server in best.items():
        for name in (*ours, theirs):
            r = by_server.get(name)
            if r is None:
                continue
            each = " / ".join(f"{x.output_tok_s:.1f}" for x in rounds[workload][name])
            lines.append(
                f"{workload:>10}  {name:>14}  {_cell('{:.2f}', r.output_tok_s):>8}  "
                f"{_cell('{:.3f}', r.ttft_mean_s):>9}  {_cell('{:.3f}', r.ttft_p95_s):>8}  "
                f"{_cell('{:.1f}', r.itl_mean_ms):>8}  {_cell('{:.1f}', r.itl_p95_ms):>8}  "
                f"{_cell('{:.1f}', r.tpot_mean_ms):>8}  {each}"
            )
        for mine in ours:
            cells = _ratio_cells(by_server.get(mine), by_server.get(theirs))
            if cells:
                lines.append(
                    f"{workload:>10}  {'ratio':>14}  {cells[0]:>8}  {cells[1]:>9}  {cells[2]:>8}  "
                    f"{cells[3]:>8}  {cells[4]:>8}  {cells[5]:>8}  ({mine} / {theirs})"
                )
    return "\n".join(lines)


def _ratio_cells(a: LevelResult | None, b: LevelResult | None) -> list[str]:
    """a / b for each VERSUS figure ([] when either is missing)."""
    if a is None or b is None:
        return []
    cells = []
    for _, attr in VERSUS:
        x, y = getattr(a, attr), getattr(b, attr)
        cells.append("n/a" if x is None or not y else f"{x / y:.2f}x")
    return cells


def format_versus_markdown(
    best: dict[str, dict[str, LevelResult]], ours: list[str], theirs: str
) -> str:
    lines = [
        "| workload | server | output tok/s | TTFT mean (s) | TTFT p95 (s) | ITL mean (ms) "
        "| ITL p95 (ms) | TPOT (ms) |",
        "|" + "---|" * 8,
    ]
    for workload, by_server in best.items():
        for name in (*ours, theirs):
            r = by_server.get(name)
            if r is not None:
                lines.append(
                    f"| {workload} | {name} | {_cell('{:.2f}', r.output_tok_s)} "
                    f"| {_cell('{:.2f}', r.ttft_mean_s)} | {_cell('{:.2f}', r.ttft_p95_s)} "
                    f"| {_cell('{:.0f}', r.itl_mean_ms)} | {_cell('{:.0f}', r.itl_p95_ms)} "
                    f"| {_cell('{:.1f}', r.tpot_mean_ms)} |"
                )
        for mine in ours:
            cells = _ratio_cells(by_server.get(mine), by_server.get(theirs))
            if cells:
                lines.append(f"| {workload} | {mine} / {theirs} | " + " | ".join(cells) + " |")
    return "\n".join(lines)

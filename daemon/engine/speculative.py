"""Speculative decoding by prompt lookup: drafting and the policy (plain Python: no mlx here).

A decoding row proposes the tokens that followed an earlier occurrence of its latest n-gram in
its own context (prompt and output: llama.cpp's prompt-lookup / `ngram` drafting): the one
that continues the copy its last draft followed, else the last.
`BatchRunner` (runner.py) verifies every drafting row's tokens in one batched forward of the
decode rows, keeps the longest prefix the row's own sampler agrees with, and rolls the KV cache
back past the rest (docs/internals.md "Speculative decoding").

`SpecPolicy` decides each step whether to verify, and how many tokens each row drafts:

- per row, the acceptance probability of a drafted token (`RowDraftState.estimate`: the lower
  of the rate counted over the row's own verifications and a recent one, which falls within
  a few rejected drafts, where a rewrite meets the part it changes, and recovers over the
  plain steps that follow) and a draft length that grows while whole drafts are accepted and
  falls back after a rejection;
- per step, a cost model learned from the engine's own step periods: a plain decode step of
  `rows` rows takes `plain[rows]`, a verification of `rows` x `width` tokens takes
  `plain[rows] + extra * rows * (width - 1)`. A step verifies when the tokens it expects
  (geometric in `alpha`) per second beat the plain step's `rows` per second; the width is the
  one that maximises that rate. Nothing in it is a constant picked for one machine: `extra`
  starts from a fifth of the plain step (a first guess, replaced by the measurement after the
  first verifications) and every figure follows what this machine measures.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Sequence
from dataclasses import dataclass, field

SPECULATIVE_MODES = ("off", "ngram", "draft")  # draft: a draft model (draft_model.py)
NGRAM_MAX = 4  # the longest n-gram looked up; shorter ones down to NGRAM_MIN when it misses
NGRAM_MIN = 2
DRAFT_MAX = 12  # tokens a row drafts at most in one step
DRAFT_START = 4
EMA = 0.2  # weight of a new period in the step-time averages
REPROBE_STEPS = 256
HIT_EMA = 0.25
LOOKUP_EVERY = 16  # steps between lookups while the rows' hit rates say a lookup will not pay
# how much better than the rows whose verifications lost a row count's rows must accept drafts
# to verify at that count before the reprobe
ALPHA_MARGIN = 0.15
FIRST_EXTRA_SHARE = 0.2  # the first guess of a drafted token's cost, as a share of a plain step
RECENT_EMA = 0.3  # weight of a verification's acceptance in a row's recent rate
RECENT_RELAX = 0.1  # share of the way back to the row's overall rate per step not verified
BREAK_EVEN_EVERY = 16  # verification steps between two break-even estimates


class NgramIndex:
    """A row's context with, for n in NGRAM_MIN..NGRAM_MAX, the end of every earlier
    occurrence of every n-gram, in order (updated as tokens are appended: O(1) per token).

    A draft continues the copy the last one followed: of the occurrences of the context's
    longest matching suffix n-gram, the one nearest the position the last draft's source has
    advanced to since (an answer that rewrites its input copies it in order, and a line that
    repeats elsewhere, `return x` or `def __`, would otherwise send the draft to its last
    occurrence); the last occurrence before any draft."""

    def __init__(self) -> None:
        self.tokens: list[int] = []
        self._ends: dict[int, dict[tuple[int, ...], list[int]]] = {
            n: {} for n in range(NGRAM_MIN, NGRAM_MAX + 1)
        }
        self._registered = 0  # n-grams ending before this index are in `_ends`
        # where the last draft was copied from (its first token's index) and the context's
        # length then: a copy in progress is expected at source + (len(tokens) - at)
        self._source: int | None = None
        self._at = 0

    def sync(self, context: Sequence[int]) -> None:
        """Append what `context` (this row's whole context so far, of which `tokens` is a
        prefix) has beyond `tokens`."""
        have = len(self.tokens)
        if len(context) > have:
            self.tokens.extend(context[have:])
        tokens, end = self.tokens, len(self.tokens)
        for e in range(max(self._registered, NGRAM_MIN), end):
            for n, table in self._ends.items():
                if e >= n:
                    gram = tuple(tokens[e - n : e])
                    ends = table.get(gram)
                    if ends is None:
                        table[gram] = [e]
                    else:
                        ends.append(e)
        self._registered = max(self._registered, end)

    def append(self, token: int) -> None:
        self.tokens.append(token)
        self.sync(self.tokens)

    def draft(self, k: int) -> list[int]:
        """Up to `k` tokens that followed an earlier occurrence of the context's longest
        matching suffix n-gram (the one nearest the copy in progress, else the last); []
        when none matches."""
        tokens = self.tokens
        expected = None if self._source is None else self._source + len(tokens) - self._at
        for n in range(NGRAM_MAX, NGRAM_MIN - 1, -1):
            if len(tokens) <= n:
                continue
            ends = self._ends[n].get(tuple(tokens[-n:]))
            if not ends:
                continue
            end = ends[-1] if expected is None else _nearest(ends, expected)
            self._source, self._at = end, len(tokens)
            return tokens[end : end + k]
        return []  # the copy in progress (if any) stays expected: a miss is often one token


def _nearest(ends: list[int], target: int) -> int:
    """The value of the sorted `ends` nearest `target` (the later one on a tie)."""
    i = bisect_left(ends, target)
    if i == len(ends):
        return ends[-1]
    if i and target - ends[i - 1] < ends[i] - target:
        return ends[i - 1]
    return ends[i]


@dataclass
class RowDraftState:
    """One row's drafting: its context index and what its verifications accepted."""

    index: NgramIndex = field(default_factory=NgramIndex)
    k: int = DRAFT_START
    compared: int = 0  # drafted tokens the sampler was compared against
    accepted: int = 0
    hit_rate: float = 0.5  # recent share of lookups that found a draft (EMA)
    recent: float = 0.5  # the acceptance of the row's last verifications (EMA; see `estimate`)
    last_hit: bool = True  # the last lookup found one: look again next step

    def looked_up(self, found: bool) -> None:
        self.hit_rate += HIT_EMA * (float(found) - self.hit_rate)
        self.last_hit = found

    @property
    def alpha(self) -> float:
        """The chance that a drafted token is accepted (Laplace: 1/2 before any evidence)."""
        return (self.accepted + 1) / (self.compared + 2)

    @property
    def estimate(self) -> float:
        """The acceptance the plan counts on: the overall rate, or the recent one where lower
        (drafts that copy a passage the answer has just changed fail together)."""
        return min(self.alpha, self.recent)

    def relax(self) -> None:
        """A step without a verification: the recent rate moves back toward the overall one
        (the answer leaves the changed part; without this a row that stopped verifying
        would never find out)."""
        self.recent += RECENT_RELAX * (self.alpha - self.recent)

    def expected(self, width: int) -> float:
        """Tokens expected to be accepted from a draft of `width - 1` tokens (geometric)."""
        a, n = self.estimate, min(width - 1, self.k)
        if n <= 0:
            return 0.0
        return a * (1 - a**n) / (1 - a) if a < 1.0 else float(n)

    def record(self, drafted: int, accepted: int) -> None:
        compared = accepted + (1 if accepted < drafted else 0)
        first = not self.compared
        self.accepted += accepted
        self.compared += compared
        if first:
            self.recent = self.alpha
        elif compared:
            self.recent += RECENT_EMA * (accepted / compared - self.recent)
        if drafted and accepted == drafted:
            self.k = min(DRAFT_MAX, max(self.k, drafted) * 2)
        elif drafted:
            self.k = max(NGRAM_MIN, accepted + 1)


@dataclass
class SpecCounters:
    steps: int = 0  # verification steps
    rows: int = 0  # rows over those steps
    drafted: int = 0  # drafted tokens verified
    accepted: int = 0  # drafted tokens accepted


class SpecPolicy:
    """Drafting per row and the per-step decision (see the module doc)."""

    def __init__(self, mode: str = "ngram", always: bool = False) -> None:
        """`always`: verify every drafted token whatever the costs (the tests' and the
        benchmark's way to run verifications at a given load; never the daemon's)."""
        if mode not in SPECULATIVE_MODES:
            raise ValueError(f"unknown speculative mode {mode!r}: use one of {SPECULATIVE_MODES}")
        self.mode = mode
        self.always = always
        self.rows: dict[str, RowDraftState] = {}
        self.plain: dict[int, float] = {}  # rows -> seconds per plain decode step
        self.extra: dict[int, float] = {}  # rows -> seconds per drafted token and row
        # rows -> (tokens per second that verification steps of this many rows delivered, the
        # verifying rows' mean acceptance rate then), both EMAs: the check on the model (a
        # count whose verifications measured slower than plain steps stops verifying until
        # the next reprobe, for rows that accept no better than those did)
        self.realized: dict[int, tuple[float, float]] = {}
        self._plan_alpha: float | None = None  # the mean acceptance of the last plan's rows
        self.counters = SpecCounters()
        self._since_verify = 0  # plain steps since the last verification
        # `measured_break_even`'s last estimate and the verification step count it was made
        # at: recomputed every BREAK_EVEN_EVERY verification steps (it costs ~0.2 ms)
        self._break_even: tuple[int | None, int] | None = None
        # rows -> lookups in a row whose drafts the plan found not worth verifying
        self._declined: dict[int, int] = {}

    @property
    def enabled(self) -> bool:
        return self.mode != "off"

    def row(self, uid: str) -> RowDraftState:
        state = self.rows.get(uid)
        if state is None:
            state = self.rows[uid] = RowDraftState()
        return state

    def record(self, uid: str, drafted: int, accepted: int) -> None:
        """A row's verification: `accepted` of its `drafted` tokens."""
        self.row(uid).record(drafted, accepted)
        c = self.counters
        c.rows += 1
        c.drafted += drafted
        c.accepted += accepted
        self._since_verify = 0

    def reset(self) -> None:
        """Forget the rows (after a failed step); the measured costs stay."""
        self.rows.clear()

    def worth_trying(self, uids: Sequence[str]) -> bool:
        """Whether to look for drafts this step (checked before any drafting: no sync, no
        lookup when not). No: before a plain step of this many rows is measured; when this
        many rows' verifications delivered fewer tokens per second than plain steps; when even
        full drafts at the rows' acceptance rates would not pay. Yes when a row found a draft
        at its last lookup, every `LOOKUP_EVERY` steps, or when the rows' recent hit rates
        make a lookup worth it. Every `REPROBE_STEPS` steps without a verification, this many
        rows' measurements are relaxed (cost halved, delivered rate forgotten), so that a
        moment of contention does not switch speculation off for good."""
        if not self.enabled:
            return False
        if self.always:
            return True
        rows = len(uids)
        for uid in uids:
            self.row(uid).relax()  # a verification this step records after this
        if rows not in self.plain:
            return False
        self._since_verify += 1
        if self._since_verify >= REPROBE_STEPS:
            self._since_verify = 0
            if rows in self.extra:
                self.extra[rows] /= 2
            for count in [c for c in self.realized if c <= rows]:
                del self.realized[count]
        states = [self.rows[u] for u in uids]
        if self._measured_slower(rows, _known_alpha(states)):
            return False
        lengths = [s.k for s in states]
        if self._best_width(rows, states, lengths) <= 1:
            return False  # not even full drafts at the rows' acceptance rates would pay
        periodic = self._since_verify % LOOKUP_EVERY == 0
        if self._declined.get(rows, 0) >= 2 and not periodic:
            return False  # the drafts found at this many rows did not pay the last times
        if any(s.last_hit for s in states) or periodic:
            return True  # a row found a draft last time; or now and then, look anyway
        return self._best_width(rows, states, lengths, weigh_hits=True) > 1

    def _measured_slower(self, rows: int, alpha: float) -> bool:
        """Whether verifications of this many rows, or of fewer (a verification is
        compute-bound: more rows never make it pay more), delivered fewer tokens per second
        than plain steps of as many rows, for rows that accepted drafts about as often as
        these (`alpha`: the mean acceptance of the rows that have verified drafts, 1.0 for rows
        that have not) or less: rows that accept clearly more (a rewrite after a chat whose
        drafts failed) are not held back by them."""
        return any(
            count <= rows
            and count in self.plain
            and rate < count / self.plain[count]
            and alpha <= then + ALPHA_MARGIN
            for count, (rate, then) in self.realized.items()
        )

    def keep_only(self, uids: Sequence[str]) -> None:
        """Drop the states of rows that are gone."""
        if len(self.rows) > len(uids):
            live = set(uids)
            for uid in [u for u in self.rows if u not in live]:
                del self.rows[uid]

    def record_period(
        self, rows: int, width: int, seconds: float, tokens: int | None = None
    ) -> None:
        """A measured step period: a plain step (`width` 1) or a verification that emitted
        `tokens` tokens."""
        if rows <= 0 or seconds <= 0:
            return
        alpha, self._plan_alpha = self._plan_alpha, None
        if width > 1 and tokens is not None:
            rate, was = tokens / seconds, self.realized.get(rows)
            alpha = 0.5 if alpha is None else alpha
            self.realized[rows] = (
                (rate, alpha)
                if was is None
                else (was[0] + EMA * (rate - was[0]), was[1] + EMA * (alpha - was[1]))
            )
        if width <= 1:
            old = self.plain.get(rows)
            self.plain[rows] = seconds if old is None else old + EMA * (min(seconds, 3 * old) - old)
            return
        base = self.plain.get(rows)
        if base is None:
            return
        sample = max(seconds - base, 0.0) / (rows * (width - 1))
        old = self.extra.get(rows)
        # the first verification of this many rows replaces the estimate borrowed from other
        # counts; later ones move it by EMA, clipped at 3x, so that one that met a busy moment
        # cannot switch speculation off by itself
        self.extra[rows] = (
            sample if old is None else old + EMA * (min(sample, 3 * old + 1e-4) - old)
        )

    def plain_period(self, rows: int) -> float | None:
        """Seconds per plain step of `rows` rows: measured, else interpolated between the
        nearest measured counts (flat beyond them); None before any."""
        return _interpolate(self.plain, rows)

    def extra_cost(self, rows: int) -> float | None:
        """Seconds a drafted token adds per row to a step of `rows` rows: measured at this
        count, else from the nearest measured counts, else a first guess (a share of a plain
        step)."""
        measured = _interpolate(self.extra, rows)
        if measured is not None:
            return measured
        base = self.plain_period(rows)
        return None if base is None else base * FIRST_EXTRA_SHARE

    def _best_width(
        self,
        rows: int,
        states: Sequence[RowDraftState],
        lengths: Sequence[int],
        weigh_hits: bool = False,
    ) -> int:
        """The width that maximises expected tokens per second for rows drafting `lengths`
        tokens (`weigh_hits`: drafts not looked up yet, each found at the row's hit rate);
        1 when no width beats a plain step."""
        base, extra = self.plain_period(rows), self.extra_cost(rows)
        if base is None or extra is None or not any(lengths):
            return 1
        best_width, best_rate = 1, rows / base
        for width in range(2, max(lengths) + 2):
            gain = sum(
                s.expected(min(width, n + 1)) * (s.hit_rate if weigh_hits else 1.0)
                for s, n in zip(states, lengths, strict=True)
            )
            rate = (rows + gain) / (base + extra * rows * (width - 1))
            if rate > best_rate:
                best_width, best_rate = width, rate
        return best_width

    def width_for(self, uids: Sequence[str], lengths: Sequence[int]) -> int:
        """The verification width that drafts of `lengths` tokens (not drafted yet) would make
        worth it; 1: none. A draft model's drafts are planned with this before they are made,
        since drafting itself costs forwards."""
        if self.always:
            return 1 + max(lengths, default=0)
        return self._best_width(len(uids), [self.row(u) for u in uids], lengths)

    def plan(self, uids: Sequence[str], drafts: Sequence[list[int]]) -> int:
        """The verification width (1 + the drafted tokens each row sends at most) that this
        step's rows and drafts make worth it; 1: decode plainly."""
        if self.always:
            return 1 + max((len(d) for d in drafts), default=0)
        states = [self.row(u) for u in uids]
        width = self._best_width(len(uids), states, [len(d) for d in drafts])
        self._plan_alpha = _mean_alpha(states) if width > 1 else None
        if any(drafts):
            self._declined[len(uids)] = self._declined.get(len(uids), 0) + 1 if width <= 1 else 0
        return width

    def break_even_rows(self, alpha: float, width: int = DRAFT_START + 1) -> int | None:
        """The most rows at which verifying `width - 1` drafted tokens a row, accepted with
        probability `alpha` each, still beats a plain step under the measured costs; None
        before anything is measured."""
        if not self.plain:
            return None
        state = RowDraftState(k=width - 1)
        state.accepted, state.compared = round(alpha * 1000), 1000
        state.recent = state.alpha
        gain = state.expected(width)
        last = 0
        for rows in range(1, 65):
            base, extra = self.plain_period(rows), self.extra_cost(rows)
            assert base is not None and extra is not None
            if rows * (1 + gain) / (base + extra * rows * (width - 1)) > rows / base:
                last = rows
        return last

    def measured_break_even(self) -> int | None:
        """`break_even_rows` at the acceptance this policy measured and its default width:
        the most rows at which verification still pays on this machine (0: at no row count);
        None until both a plain step and a verification were timed. Recomputed once every
        BREAK_EVEN_EVERY verification steps, the last estimate in between."""
        c = self.counters
        if not self.plain or not self.extra or not c.drafted:
            return None
        last = self._break_even
        if last is not None and c.steps - last[1] < BREAK_EVEN_EVERY:
            return last[0]
        rows = self.break_even_rows(c.accepted / c.drafted)
        self._break_even = (rows, c.steps)
        return rows


def _mean_alpha(states: Sequence[RowDraftState]) -> float:
    return sum(s.estimate for s in states) / len(states) if states else 0.5


def _known_alpha(states: Sequence[RowDraftState]) -> float:
    """The mean acceptance of the rows that have verified drafts; 1.0 when none has (rows
    with no evidence yet may probe, once: their first verification tells)."""
    known = [s.estimate for s in states if s.compared]
    return sum(known) / len(known) if known else 1.0


def _interpolate(table: dict[int, float], rows: int) -> float | None:
    """`table[rows]`, else linear between the nearest counts below and above, else the nearest."""
    if rows in table:
        return table[rows]
    if not table:
        return None
    below = [r for r in table if r < rows]
    above = [r for r in table if r > rows]
    if below and above:
        lo, hi = max(below), min(above)
        return table[lo] + (table[hi] - table[lo]) * (rows - lo) / (hi - lo)
    return table[max(below)] if below else table[min(above)]

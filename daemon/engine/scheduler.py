"""Admission and batched-prefill cohort selection (docs/tuning.md): pure functions, no state.

NOTE on the algorithm
    The waiting queue is strictly FIFO: requests are admitted from its head, never reordered,
    and the head is never skipped (no starvation). One prefill cohort runs at a time; while it
    runs (possibly over several chunked steps) nobody new is admitted. When no cohort runs, a
    new one is picked from the head of the queue:
      1. rows are limited by the free slots (`parallel` minus running sequences, those still in
         prefill included) and by `max_batch_prefill`;
      2. the head is always taken; a head whose 2 × length exceeds the padded-token cap is
         prefilled alone (in chunks); otherwise following rows join, in order, while
         rows × longest_row ≤ cap (cap 0 = uncapped). "Length" is what must be computed: the
         prompt minus its cached prefix;
      3. a row flagged `defer` ends the cohort: the engine flags a row whose uncached prompt
         shares at least one block and half its length with a row ahead of it (same chain
         hash); it waits until that row's prefill is done and its prompt KV is in the prompt
         cache, then reuses it instead of computing it again;
      4. a row whose cached prefix is being read from the prompt cache's disk tier
         (`reading`) ends the cohort too, and a reading head admits nobody: the queue stays
         FIFO while the read runs on its own thread, as a prefill chunk would hold it;
      5. the KV budget is checked in the same order: each row reserves blocks for its prompt +
         max_tokens; the first row that does not fit ends the cohort (and, if it is the head,
         nothing is admitted: the request waits, and the engine has already evicted the
         prompt cache before concluding that).
    Every request left waiting gets one reason, judged for its queue position i with everyone
    ahead of it served first: `disk_read` (its read runs), else `slots_full` (i ≥ free
    slots), else `kv_budget` (the blocks of
    entries 0..i exceed the free blocks), else `prefill_cap` (it would fit but is not in this
    cohort: the cohort is full, capped, or another cohort is still prefilling).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

WAIT_SLOTS_FULL = "slots_full"
WAIT_KV_BUDGET = "kv_budget"
WAIT_PREFILL_CAP = "prefill_cap"
WAIT_DISK_READ = "disk_read"


def select_prefill_cohort(waiting_lengths: Sequence[int], max_rows: int, token_cap: int) -> int:
    """How many requests from the head of the queue form the next batched prefill."""
    if not waiting_lengths or max_rows < 1:
        return 0
    head = waiting_lengths[0]
    if token_cap and 2 * head > token_cap:
        return 1
    count, longest = 1, head
    for length in waiting_lengths[1:max_rows]:
        candidate = max(longest, length)
        if token_cap and (count + 1) * candidate > token_cap:
            break
        count, longest = count + 1, candidate
    return count


@dataclass(frozen=True)
class WaitingView:
    """What admission needs to know about one waiting request."""

    compute_tokens: int  # prompt tokens to compute (after the cached prefix)
    kv_blocks: int  # blocks to reserve: ceil((prompt + max_tokens) / block)
    # shares an uncached prefix with a request ahead of it: it waits for that prefill
    defer: bool = False
    # its cached prefix is being read from the disk tier: not admitted until the read is done
    reading: bool = False


@dataclass(frozen=True)
class AdmissionPlan:
    num_admit: int  # admit this many from the head of the queue, as one cohort
    wait_reasons: tuple[str, ...]  # one per request left waiting, in queue order


def plan_admission(
    waiting: Sequence[WaitingView],
    *,
    free_slots: int,
    max_rows: int,
    token_cap: int,
    free_blocks: int | None,
    cohort_busy: bool,
) -> AdmissionPlan:
    """Pick the next cohort and give every request left waiting its reason."""
    num_admit = 0
    if not cohort_busy and free_slots > 0:
        lengths = [w.compute_tokens for w in waiting]
        num_admit = select_prefill_cohort(lengths, min(max_rows, free_slots), token_cap)
        # the cohort ends before a row that waits for a shared prefix (never the head)
        num_admit = next((i for i in range(1, num_admit) if waiting[i].defer), num_admit)
        num_admit = next((i for i in range(num_admit) if waiting[i].reading), num_admit)
        num_admit = min(num_admit, _num_fitting(waiting[:num_admit], free_blocks))
    reasons = []
    blocks_ahead = sum(w.kv_blocks for w in waiting[:num_admit])
    for i in range(num_admit, len(waiting)):
        blocks_ahead += waiting[i].kv_blocks
        if waiting[i].reading:
            reasons.append(WAIT_DISK_READ)
        elif i >= free_slots:
            reasons.append(WAIT_SLOTS_FULL)
        elif free_blocks is not None and blocks_ahead > free_blocks:
            reasons.append(WAIT_KV_BUDGET)
        else:
            reasons.append(WAIT_PREFILL_CAP)
    return AdmissionPlan(num_admit, tuple(reasons))


def _num_fitting(rows: Sequence[WaitingView], free_blocks: int | None) -> int:
    """How many rows, in order, fit in the free blocks together."""
    if free_blocks is None:
        return len(rows)
    used = 0
    for i, row in enumerate(rows):
        used += row.kv_blocks
        if used > free_blocks:
            return i
    return len(rows)

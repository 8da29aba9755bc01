"""The benchmarks' client figures (scripts/bench_lib/client.py): the inter-token latency is per
content chunk; the time per output token divides by the tokens the server reports, so a chunk
carrying several tokens (speculative decoding) counts as what it is."""

from __future__ import annotations

import pytest
from bench_lib.client import RequestResult, summarize


def test_tpot_counts_tokens_and_itl_counts_chunks() -> None:
    # one request: 5 tokens in 3 chunks (1, then 2, then 2), 20 ms apart; one: 3 tokens, 1 each
    several = RequestResult(ok=True, ttft_s=0.1, gaps_s=[0.02, 0.02], output_tokens=5)
    single = RequestResult(ok=True, ttft_s=0.1, gaps_s=[0.01, 0.01], output_tokens=3)
    failed = RequestResult(ok=False, error="HTTP 500")
    level = summarize("s", 2, [several, single, failed], wall_s=1.0, metrics=None)
    assert level.itl_mean_ms == pytest.approx(15.0)  # (20 + 20 + 10 + 10) / 4 gaps
    assert level.tpot_mean_ms == pytest.approx((40 / 4 + 20 / 2) / 2)  # 10 ms each
    assert level.ok == 2 and level.fail == 1


def test_tpot_is_none_without_a_second_token() -> None:
    one = RequestResult(ok=True, ttft_s=0.1, gaps_s=[], output_tokens=1)
    assert summarize("s", 1, [one], wall_s=1.0, metrics=None).tpot_mean_ms is None

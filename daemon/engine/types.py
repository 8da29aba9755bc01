"""Values handed between the HTTP layer and the engine: requests, sampling, token outputs.

The engine works on token ids only; the HTTP layer tokenizes, detokenizes and matches stop strings.
"""

from __future__ import annotations

from dataclasses import dataclass, field

# Finish reasons carried by the last TokenOutput of a request.
FINISH_STOP = "stop"  # a stop token was sampled (token_id is None on that output)
FINISH_LENGTH = "length"  # max_tokens reached
FINISH_ABORT = "abort"  # cancelled by the client (RequestStream.abort) or by shutdown
FINISH_ERROR = "error"  # the engine failed on this request; `error` says why
FINISH_TIMEOUT = "timeout"  # its deadline (`GenerationRequest.timeout_s`) passed; `error` says so

# AdmissionRejected reasons and the HTTP status each maps to.
REJECT_HTTP_STATUS = {
    "queue_full": 503,
    "shutting_down": 503,
    "too_long": 400,
    "kv_never_fits": 400,
    "invalid_request": 400,
}


@dataclass(frozen=True)
class ReasoningSpec:
    """A thinking model's reasoning markup, as token ids, for one row (docs/api.md, "Reasoning").

    The engine follows the row's tokens with it (constraints.ReasoningTracker): the reasoning
    starts with `start_ids` (or at the first token when the prompt already opened it: `open`)
    and ends with `end_ids`. Past `budget` reasoning tokens the row is made to emit
    `close_ids` next; a JSON-schema constraint applies only once the reasoning has ended.
    """

    start_ids: tuple[int, ...]
    end_ids: tuple[int, ...]
    close_ids: tuple[int, ...]  # forced when the budget is spent (ends with `end_ids`)
    open: bool = False  # the prompt ends inside the reasoning (the template opened it)
    budget: int | None = None  # None: the server's default (--reasoning-budget), else unbounded


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling; temperature 0 is greedy. `seed` gives the row its own RNG."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    # draws already taken from the seed's random stream: a preempted row resumes where it was
    # (core.py `_preempt`); 0 for every request a client sends
    seed_draws: int = 0
    logit_bias: dict[int, float] | None = None
    # Penalties (0.0 / 1.0 = off), applied per row before sampling.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    # Log-probabilities: of the sampled token (`logprobs`), and of the `top_logprobs` most
    # likely tokens (0-20). Rows that ask for neither skip the log-softmax.
    logprobs: bool = False
    top_logprobs: int = 0
    # Constrained decoding: the output must match this JSON schema (JSON text). The HTTP layer
    # builds it for response_format json_object / json_schema and forced tool calls. Once the
    # grammar is complete the row finishes with FINISH_STOP.
    json_schema: str | None = None
    # A thinking model's reasoning markup (the HTTP layer sets it for chat requests on a model
    # whose template has one): the budget and the JSON schema above act on it.
    reasoning: ReasoningSpec | None = None
    # Speculative decoding (the server's --speculative) for this request; False opts out
    speculative: bool = True

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0


GREEDY = SamplingParams(temperature=0.0)


@dataclass(frozen=True)
class GenerationRequest:
    request_id: str
    prompt_ids: tuple[int, ...]
    max_tokens: int
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop_token_ids: frozenset[int] = frozenset()
    endpoint: str = ""  # the HTTP path it came in on (request.info shows it); the engine ignores it
    lane: str = "normal"  # high | normal | low: the waiting queue's order (engine/lanes.py)
    timeout_s: float | None = None  # ends with FINISH_TIMEOUT this long after it arrived


@dataclass(frozen=True)
class TokenOutput:
    """One sampled token, or the final output (finish_reason set, with usage).

    completion_tokens counts every sampled token, a stop token included.
    """

    token_id: int | None
    finish_reason: str | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    error: str | None = None
    # With SamplingParams.logprobs / top_logprobs: the sampled token's log-probability and the
    # most likely (token_id, logprob) pairs, most likely first.
    logprob: float | None = None
    top_logprobs: tuple[tuple[int, float], ...] = ()

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class AdmissionRejected(Exception):
    """A request refused before it was queued; `http_status` is what the HTTP layer answers."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason
        self.message = message
        self.http_status = REJECT_HTTP_STATUS.get(reason, 400)

    def __repr__(self) -> str:
        return f"AdmissionRejected({self.reason!r}, {self.message!r})"

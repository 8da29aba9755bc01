"""One generation, from the HTTP layer's side: submit to the engine bridge, turn token
outputs into text pieces (detokenized, stop strings applied), and abort the engine request
when the response ends early (stop string, client gone).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, Collection
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from mlxcel.daemon.engine.types import (
    FINISH_ABORT,
    FINISH_ERROR,
    FINISH_STOP,
    FINISH_TIMEOUT,
    GenerationRequest,
    SamplingParams,
    TokenOutput,
)
from mlxcel.daemon.server.errors import APIError
from mlxcel.daemon.server.openai_schema import GenerationOptions
from mlxcel.daemon.server.textstream import TextAssembler

if TYPE_CHECKING:
    from mlxcel.daemon.server.reasoning import ReasoningPlan
    from mlxcel.daemon.server.seams import RequestBridge

# After a stop-string abort, wait this long for the engine's final output (it has the usage).
FINAL_OUTPUT_WAIT_S = 5.0


@dataclass
class Usage:
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    # Of the completion tokens, those of the model's reasoning (None: a request without
    # reasoning markup; docs/api.md, "Reasoning")
    reasoning_tokens: int | None = None

    def to_dict(self) -> dict[str, Any]:
        usage: dict[str, Any] = {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
        }
        if self.reasoning_tokens is not None:
            usage["completion_tokens_details"] = {"reasoning_tokens": self.reasoning_tokens}
        return usage


@dataclass(frozen=True)
class TokenLogprob:
    """One generated token's log-probability and its most likely alternatives."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


class GenerationFailed(RuntimeError):
    """The engine reported an error for this request (`finish_reason` error, or timeout: its
    deadline passed, docs/api.md "Priority and timeouts")."""

    def __init__(self, message: str, finish_reason: str = FINISH_ERROR) -> None:
        super().__init__(message)
        self.finish_reason = finish_reason

    def api_error(self) -> APIError:
        """The HTTP error a client gets: 504 `timeout` for a deadline, else 500."""
        if self.finish_reason == FINISH_TIMEOUT:
            return APIError(504, str(self), "timeout_error", "timeout")
        return APIError(500, str(self), "server_error", "engine_error")


def sampling_params(options: GenerationOptions) -> SamplingParams:
    s = options.sampling
    return SamplingParams(
        temperature=s.temperature,
        top_p=s.top_p,
        top_k=s.top_k,
        min_p=s.min_p,
        seed=s.seed,
        logit_bias=dict(s.logit_bias) or None,
        presence_penalty=s.presence_penalty,
        frequency_penalty=s.frequency_penalty,
        repetition_penalty=s.repetition_penalty,
        logprobs=options.logprobs or options.top_logprobs > 0,
        top_logprobs=options.top_logprobs,
        json_schema=options.json_schema,
        speculative=options.speculative is not False,
    )


class Generation:
    """Iterate `pieces()` for the text; afterwards `finish_reason` and `usage` are set.

    With a `reasoning` plan (a thinking model's chat request), the reasoning markup's tokens
    are rendered as text even when special (the Turn's ReasoningParser reads them), and
    `usage.reasoning_tokens` counts the reasoning as the engine does."""

    def __init__(
        self,
        bridge: RequestBridge,
        request: GenerationRequest,
        detokenizer: Any,
        stops: tuple[str, ...],
        skip_ids: Collection[int],
        reasoning: ReasoningPlan | None = None,
    ) -> None:
        self._request = request
        self.reasoning = reasoning
        self._tracker = reasoning.tracker() if reasoning is not None else None
        if reasoning is not None:
            skip_ids = frozenset(skip_ids) - reasoning.format.markup_ids
        self._text = TextAssembler(detokenizer, stops, skip_ids)
        self.usage = Usage(prompt_tokens=len(request.prompt_ids))
        if reasoning is not None:
            self.usage.reasoning_tokens = 0
        self.finish_reason: str | None = None
        self._skip_ids = skip_ids
        self._logprobs: list[TokenLogprob] = []
        self._interval = getattr(bridge, "stream_interval", 1)  # tokens per piece, at most
        # Raises AdmissionRejected synchronously: nothing to clean up yet.
        self._stream = bridge.submit(request)

    @property
    def wants_logprobs(self) -> bool:
        """The request asked for log-probabilities (the engine reports them only then)."""
        sampling = self._request.sampling
        return sampling.logprobs or sampling.top_logprobs > 0

    @property
    def stop_sequence(self) -> str | None:
        """The stop string that ended the text, if one did."""
        return self._text.matched_stop

    def take_logprobs(self) -> list[TokenLogprob]:
        """The log-probabilities of the tokens read since the last call."""
        out, self._logprobs = self._logprobs, []
        return out

    def abort(self) -> None:
        """Cancel the engine request unless it already finished (idempotent)."""
        self._stream.abort()

    async def pieces(self) -> AsyncGenerator[str, None]:
        try:
            while self.finish_reason is None and not self._text.stopped:
                # every output ready now: one wake-up and one piece when the loop runs behind
                outputs = await self._stream.next_batch(self._interval)
                if not outputs:
                    break
                text, failed = self._read(outputs)
                if text:
                    yield text
                if failed is not None:
                    raise failed
            if self._text.stopped:  # a stop string: it wins over a final "length"
                if self.finish_reason is None:
                    self._stream.abort(FINISH_STOP)
                    await self._await_final_usage()
                self.finish_reason = FINISH_STOP
            elif self.finish_reason is None:  # the stream ended without a final output
                self.finish_reason = FINISH_ABORT
        finally:
            if self.finish_reason is None:
                self._stream.abort()  # the client went away or the handler failed
        tail = self._text.finish()
        if tail:
            yield tail

    def _read(self, outputs: list[TokenOutput]) -> tuple[str, GenerationFailed | None]:
        """The text of a batch of outputs, up to a stop string or the final output."""
        texts = []
        for i, out in enumerate(outputs):
            try:
                texts.append(self._on_output(out))
            except GenerationFailed as exc:
                return "".join(texts), exc
            if self._text.stopped:
                final = next((o for o in outputs[i + 1 :] if o.finished), None)
                if final is not None:  # already here: its usage, without the tokens past the stop
                    seen = self.usage.completion_tokens
                    self._take_usage(final)
                    self.usage.completion_tokens = seen
                    self.finish_reason = final.finish_reason
                break
            if self.finish_reason is not None:
                break
        return "".join(texts), None

    def _on_output(self, out: TokenOutput) -> str:
        text = ""
        if out.token_id is not None:
            self.usage.completion_tokens += 1
            self.usage.cached_tokens = out.cached_tokens  # every output carries the split
            text = self._text.add(out.token_id)
            if self._tracker is not None:
                self._tracker.add(out.token_id)
                self.usage.reasoning_tokens = self._tracker.reasoning_tokens
            if out.logprob is not None and out.token_id not in self._skip_ids:
                entry = TokenLogprob(out.token_id, out.logprob, tuple(out.top_logprobs))
                self._logprobs.append(entry)
        if out.finished:
            self._take_usage(out)
            if out.finish_reason in (FINISH_ERROR, FINISH_TIMEOUT):
                self.finish_reason = out.finish_reason
                message = out.error or "the engine failed on this request"
                raise GenerationFailed(message, out.finish_reason)
            self.finish_reason = out.finish_reason
        return text

    def _take_usage(self, out: TokenOutput) -> None:
        self.usage.prompt_tokens = out.prompt_tokens or self.usage.prompt_tokens
        self.usage.cached_tokens = out.cached_tokens
        self.usage.completion_tokens = max(out.completion_tokens, self.usage.completion_tokens)

    async def _await_final_usage(self) -> None:
        """Read on to the engine's final (abort) output, which carries the usage."""
        seen = self.usage.completion_tokens

        async def drain() -> None:
            async for out in self._stream:
                if out.finished:
                    self._take_usage(out)
                    return

        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(drain(), FINAL_OUTPUT_WAIT_S)
        # Tokens sampled after the stop string are not part of the answer.
        self.usage.completion_tokens = seen

"""The two generation endpoints: request body -> prompt ids -> engine -> JSON or SSE.

Why one module: the path every dialect's generation shares (the checks before the engine, the
prompt's ids, the request built and started, the answer as JSON or SSE); the dialects
(responses_api.py, anthropic_api.py, ollama_api.py) call into it, so its steps stay side by
side in the order a request takes them."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import weakref
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from aiohttp import web
from mlxcel.daemon.engine.types import (
    FINISH_TIMEOUT,
    AdmissionRejected,
    GenerationRequest,
    SamplingParams,
)
from mlxcel.daemon.mlx_lm_compat import wrapped_tokenizer
from mlxcel.daemon.server.generation import Generation, GenerationFailed, sampling_params
from mlxcel.daemon.server.logprob_format import TokenText, chat_logprobs, completion_logprobs
from mlxcel.daemon.server.openai_format import (
    SSE_DONE,
    ResponseShape,
    TextChunkSSE,
    new_request_id,
    sse,
)
from mlxcel.daemon.server.openai_schema import (
    APIError,
    ChatRequest,
    GenerationOptions,
    bad_request,
    parse_chat_request,
    parse_completion_request,
)
from mlxcel.daemon.server.reasoning import ReasoningPlan, plan_for
from mlxcel.daemon.server.reasoning import detect as detect_reasoning
from mlxcel.daemon.server.reasoning import known as reasoning_known
from mlxcel.daemon.server.request_policy import request_policy, request_speculative
from mlxcel.daemon.server.stream_write import DEFAULT_STREAM_TIMEOUT_S, StreamOut, stream_timeout
from mlxcel.daemon.server.turn import ToolMode, Turn, TurnEvent, template_tools, tool_mode

log = logging.getLogger("mlxcel.http")
# The unknown fields a request carried, for the X-Mlxcel-Ignored-Fields header.
IGNORED_FIELDS_KEY: Any = (
    web.RequestKey("mlxcel_ignored_fields", tuple)
    if hasattr(web, "RequestKey")  # aiohttp >= 3.13; a plain key before
    else "mlxcel_ignored_fields"
)

if TYPE_CHECKING:
    from mlxcel.daemon.server.http_app import ModelContext, ServingState
    from mlxcel.shared.snapshot import EngineSnapshot

RETRY_AFTER_QUEUE_FULL_S = "1"
SSE_HEADERS = {
    "Content-Type": "text/event-stream",
    "Cache-Control": "no-cache",
    "X-Accel-Buffering": "no",
}


@contextlib.contextmanager
def counting_rejections(state: ServingState, ctx: ModelContext) -> Iterator[None]:
    """Count and report requests refused before they reach the engine (it does its own)."""
    try:
        yield
    except APIError as err:
        if err.status == 400:
            reason = "too_long" if err.code == "context_length_exceeded" else "invalid_request"
            ctx.bridge.record_rejection(reason)
            ctx.runtime.reject(None, reason, err.message)
        raise


def check_model(ctx: ModelContext, model: str | None) -> None:
    """404 unless `model` names the served model (Ollama clients may add the tag ':latest')."""
    if model is not None and model.removesuffix(":latest") not in ctx.names:
        raise APIError(
            404,
            f"model {model!r} is not served here; this daemon serves {ctx.name!r}",
            "not_found_error",
            "model_not_found",
            "model",
        )


# The schema workers: the parsers that check JSON schemas (pure Python, ~0.4 s for a 64 KB schema
# the first time; tool_schema.check_schema) run here, never on the loop, and never on the
# tokenizer threads, so a hostile schema delays neither /health nor a plain prompt. Two threads:
# one request's new schemas do not hold up another's (docs/reliability.md).
SCHEMA_POOL = ThreadPoolExecutor(2, thread_name_prefix="mlxcel-schema")
# A prompt's text over ctx_per_slot x (the vocabulary's longest token, in UTF-8 bytes) x this
# can never fit the context: refused before any template or tokenizer sees it. The factor
# covers normalisers that shrink text (NFKC turns a 3-byte full-width letter into 1 byte).
TEXT_SLACK = 4
DEFAULT_TOKEN_BYTES = 64  # a tokenizer whose vocabulary we cannot read
_TOKEN_BYTES: weakref.WeakKeyDictionary[Any, int] = weakref.WeakKeyDictionary()


async def _off_loop(state: ServingState, func: Any, *args: Any, **kwargs: Any) -> Any:
    """On the tokenizer threads (`ServingState.executor`, several: the Rust tokenizer lets go of
    the GIL, so a long prompt does not hold a short one behind it)."""
    loop = asyncio.get_running_loop()
    return await loop.run_in_executor(state.executor, lambda: func(*args, **kwargs))


async def parse_off_loop(func: Callable[..., Any], *args: Any) -> Any:
    """`func(*args)` (a body parser that may check JSON schemas) on a schema worker."""
    return await asyncio.get_running_loop().run_in_executor(SCHEMA_POOL, func, *args)


def carries_schemas(body: Any) -> bool:
    """Whether parsing `body` may check a JSON schema (`tools`, `response_format`)."""
    return isinstance(body, dict) and ("tools" in body or "response_format" in body)


def longest_token_bytes(tokenizer: Any) -> int:
    """The UTF-8 length of the vocabulary's longest token string (special tokens included): no
    token stands for more text than this (a byte-level or SentencePiece token's string is at
    least as long in UTF-8 as the text it stands for). Computed once per tokenizer."""
    try:
        return _TOKEN_BYTES[tokenizer]
    except (KeyError, TypeError):
        pass
    hf = wrapped_tokenizer(tokenizer)
    try:
        vocab = hf.get_vocab()
        longest = max(len(str(t).encode("utf-8", "surrogatepass")) for t in vocab) if vocab else 0
    except Exception:  # a tokenizer without a readable vocabulary
        longest = 0
    longest = longest if longest > 0 else DEFAULT_TOKEN_BYTES
    with contextlib.suppress(TypeError):  # not weak-referenceable: computed each time
        _TOKEN_BYTES[tokenizer] = longest
    return longest


async def check_text_fits(state: ServingState, ctx: ModelContext, chars: int, where: str) -> None:
    """400 context_length_exceeded, before any template or tokenizer, for a prompt whose text
    (`chars` characters, each at least one byte) is more than the context per slot could hold
    in tokens however they split it (docs/reliability.md)."""
    ctx_per_slot = ctx.bridge.snapshot().config.ctx_per_slot
    if chars <= ctx_per_slot * TEXT_SLACK:  # fits whatever the vocabulary: no need to look
        return
    tokenizer = ctx.tokenizer
    try:
        per_token = _TOKEN_BYTES[tokenizer]
    except (KeyError, TypeError):
        per_token = await _off_loop(state, longest_token_bytes, tokenizer)
    limit = ctx_per_slot * per_token * TEXT_SLACK
    if chars > limit:
        raise APIError(
            400,
            f"the prompt's text is {chars} characters: more than the context per slot "
            f"({ctx_per_slot} tokens) can hold (at most {limit} characters for this "
            "model's vocabulary); nothing was tokenized",
            "invalid_request_error",
            "context_length_exceeded",
            where,
        )


def messages_chars(messages: list[dict[str, Any]]) -> int:
    """The characters of the messages' content (parsed: a string each), a lower bound of the
    prompt the template renders from them."""
    return sum(len(m.get("content") or "") for m in messages)


def note_ignored(request: web.Request, ignored: tuple[str, ...]) -> None:
    """Unknown fields we ignored: logged, and listed in X-Mlxcel-Ignored-Fields."""
    if ignored:
        request[IGNORED_FIELDS_KEY] = ignored
        log.debug("%s %s: ignored unknown fields %s", request.method, request.path, ignored)


def check_dialect_fields(
    request: web.Request, state: ServingState, body: dict[str, Any], known: frozenset[str]
) -> None:
    """Unknown fields of an Anthropic or Ollama body: ignored and listed, or refused (strict).
    They are never handed on to the OpenAI parser, where a name could mean something else."""
    unknown = tuple(sorted(set(body) - known))
    if unknown and state.strict_api:
        raise bad_request(f"unknown field '{unknown[0]}'", unknown[0], "unknown_field")
    note_ignored(request, unknown)


async def chat_prompt_ids(
    state: ServingState,
    ctx: ModelContext,
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None = None,
    template_kwargs: dict[str, Any] | None = None,
) -> list[int]:
    """The prompt the chat template renders; `template_kwargs` are extra template variables
    (`chat_template_kwargs`, e.g. `enable_thinking`: openai_schema checked their names)."""
    await check_text_fits(state, ctx, messages_chars(messages), "messages")
    kwargs: dict[str, Any] = {**(template_kwargs or {}), "add_generation_prompt": True}
    if tools:
        kwargs["tools"] = tools
    try:
        ids = await _off_loop(state, ctx.tokenizer.apply_chat_template, messages, **kwargs)
    except Exception as exc:  # jinja errors (e.g. roles must alternate) are the client's
        raise bad_request(f"the chat template refused these messages: {exc}", "messages") from None
    return list(ids)


async def completion_prompt_ids(
    state: ServingState, ctx: ModelContext, prompt: str | list[int]
) -> list[int]:
    if isinstance(prompt, str):
        await check_text_fits(state, ctx, len(prompt), "prompt")
        return list(await _off_loop(state, ctx.tokenizer.encode, prompt))
    return prompt  # ids outside the vocabulary: the engine's admission check refuses them


def within_vocab(sampling: SamplingParams, vocab_size: int) -> SamplingParams:
    """top_k at or over the vocabulary keeps every token: no top-k (mlx-lm raises on it)."""
    if sampling.top_k >= vocab_size:
        return dataclasses.replace(sampling, top_k=0)
    return sampling


def build_request(
    ctx: ModelContext,
    request_id: str,
    prompt_ids: list[int],
    options: GenerationOptions,
    endpoint: str = "",
    plan: ReasoningPlan | None = None,
) -> GenerationRequest:
    """The engine request, shapes only: its limits (an empty prompt, the context per slot, the
    vocabulary, the KV budget) are the engine's admission checks, which `start_generation`
    turns into the HTTP error (docs/api.md, "Errors"). With a reasoning `plan`, the engine
    gets its markup (budget, constraint on the answer only)."""
    sampling = within_vocab(sampling_params(options), ctx.vocab_size)
    if plan is not None:
        sampling = dataclasses.replace(sampling, reasoning=plan.spec())
    lane, timeout = request_policy(options.lane, options.timeout_s)
    speculative = request_speculative(options.speculative)
    if speculative != sampling.speculative:  # the X-Speculative header's (no body field)
        sampling = dataclasses.replace(sampling, speculative=speculative)
    return GenerationRequest(
        request_id=request_id,
        prompt_ids=tuple(prompt_ids),
        max_tokens=options.max_tokens or default_max_tokens(ctx.bridge.snapshot(), len(prompt_ids)),
        sampling=sampling,
        stop_token_ids=frozenset() if options.ignore_eos else ctx.eos_ids,
        endpoint=endpoint,
        lane=lane,
        timeout_s=timeout,
    )


def clamp_max_tokens(
    ctx: ModelContext, num_prompt: int, options: GenerationOptions
) -> GenerationOptions:
    """max_tokens as a ceiling, not a demand (Anthropic and Ollama clients send large ones):
    lowered to what is left of the slot's context and KV budget."""
    if options.max_tokens is None:
        return options
    room = default_max_tokens(ctx.bridge.snapshot(), num_prompt)
    return dataclasses.replace(options, max_tokens=min(options.max_tokens, room))


def default_max_tokens(snapshot: EngineSnapshot, num_prompt: int) -> int:
    """No max_tokens: what is left of the slot's context, and of the KV budget when bounded
    (a request reserves its KV ahead, so the context alone could never fit a small budget)."""
    room = snapshot.config.ctx_per_slot - num_prompt
    kv = snapshot.kv
    if kv.blocks_total is not None:
        room = min(room, kv.blocks_total * kv.block_size - num_prompt)
    return max(room, 1)


def start_generation(
    state: ServingState,
    ctx: ModelContext,
    request: GenerationRequest,
    options: GenerationOptions,
    plan: ReasoningPlan | None = None,
) -> Generation:
    try:
        return Generation(
            ctx.bridge,
            request,
            ctx.tokenizer.detokenizer,
            options.stop,
            ctx.skip_ids,
            plan,
        )
    except AdmissionRejected as exc:
        headers = {"Retry-After": RETRY_AFTER_QUEUE_FULL_S} if exc.http_status == 503 else {}
        kind = "server_error" if exc.http_status >= 500 else "invalid_request_error"
        code = ADMISSION_CODES.get(exc.reason, exc.reason)
        raise APIError(exc.http_status, exc.message, kind, code, headers=headers) from None


# The engine's refusal reasons as OpenAI error codes (the others keep their reason as the code).
ADMISSION_CODES = {"too_long": "context_length_exceeded", "invalid_request": "invalid_value"}


@dataclasses.dataclass(frozen=True)
class PreparedChat:
    """A validated chat request, its prompt ids, how tool calls come back, and its reasoning
    plan (None: the model has no reasoning markup). A dialect that passes `reasoning` on to
    `open_generation` gets the reasoning apart (TurnEvent.reasoning)."""

    req: ChatRequest
    prompt_ids: list[int]
    mode: ToolMode
    reasoning: ReasoningPlan | None = None


async def reasoning_plan(
    state: ServingState, ctx: ModelContext, prompt_ids: list[int], budget: int | None
) -> ReasoningPlan | None:
    """The request's reasoning plan; the model's markup is detected once, off the loop (it
    reads the vocabulary)."""
    if not reasoning_known(ctx.tokenizer):
        await _off_loop(state, detect_reasoning, ctx.tokenizer)
    return plan_for(ctx.tokenizer, prompt_ids, budget)


async def prepare_chat(
    request: web.Request, state: ServingState, ctx: ModelContext, body: Any
) -> PreparedChat:
    """OpenAI chat body -> prompt; the Anthropic and Ollama dialects translate to it first."""
    with counting_rejections(state, ctx):
        if carries_schemas(body):  # schema checks: on a schema worker
            req = await parse_off_loop(
                parse_chat_request, body, state.strict_api, state.sampling_defaults
            )
        else:
            req = parse_chat_request(body, state.strict_api, state.sampling_defaults)
        note_ignored(request, req.options.ignored)
        check_model(ctx, req.options.model)
        tools = template_tools(req.tools, req.tool_choice)
        prompt_ids = await chat_prompt_ids(state, ctx, req.messages, tools, req.template_kwargs)
    # Compiled on the bridge's grammar worker, so `submit` on the loop only looks it up.
    await ctx.bridge.compile_schema(req.options.json_schema)
    mode = tool_mode(ctx.tokenizer, req.tools, req.tool_choice)
    plan = await reasoning_plan(state, ctx, prompt_ids, req.reasoning_budget)
    return PreparedChat(req, prompt_ids, mode, plan)


async def handle_chat(
    request: web.Request, state: ServingState, ctx: ModelContext, body: Any
) -> web.StreamResponse:
    chat = await prepare_chat(request, state, ctx, body)
    return await serve_generation(
        request, state, ctx, "chat", chat.prompt_ids, chat.req.options, chat.mode, chat.reasoning
    )


async def handle_completion(
    request: web.Request, state: ServingState, ctx: ModelContext, body: Any
) -> web.StreamResponse:
    with counting_rejections(state, ctx):
        req = parse_completion_request(body, state.strict_api, state.sampling_defaults)
        note_ignored(request, req.options.ignored)
        check_model(ctx, req.options.model)
        prompt_ids = await completion_prompt_ids(state, ctx, req.prompt)
    return await serve_generation(request, state, ctx, "text", prompt_ids, req.options)


def open_generation(
    state: ServingState,
    ctx: ModelContext,
    request_id: str,
    prompt_ids: list[int],
    options: GenerationOptions,
    endpoint: str = "",
    reasoning: ReasoningPlan | None = None,
) -> Generation:
    """Validate against the context and submit; the caller aborts it when done. `reasoning`
    (PreparedChat.reasoning): the reasoning kept apart from the answer, its budget, and a
    JSON-schema constraint on the answer only (docs/api.md, "Reasoning")."""
    with counting_rejections(state, ctx):
        gen_request = build_request(ctx, request_id, prompt_ids, options, endpoint, reasoning)
    return start_generation(state, ctx, gen_request, options, reasoning)


async def serve_generation(
    request: web.Request,
    state: ServingState,
    ctx: ModelContext,
    kind: str,
    prompt_ids: list[int],
    options: GenerationOptions,
    mode: ToolMode | None = None,
    plan: ReasoningPlan | None = None,
) -> web.StreamResponse:
    """Submit to the engine and answer; the engine request never outlives the handler."""
    shape = ResponseShape(kind, new_request_id(kind), ctx.name)
    gen = open_generation(state, ctx, shape.request_id, prompt_ids, options, request.path, plan)
    answer = OpenAIAnswer(shape, options, TokenText(ctx.tokenizer))
    turn = Turn(gen, mode or ToolMode())
    try:
        if options.stream:
            return await stream_response(request, answer, turn, stream_timeout(ctx))
        return await respond(answer, turn)
    finally:
        gen.abort()  # the client left before or while reading: free the slot and KV now


@dataclasses.dataclass
class OpenAIAnswer:
    """Formats a turn's events as an OpenAI chat or text completion."""

    shape: ResponseShape
    options: GenerationOptions
    tokens: TokenText
    num_chars: int = 0
    num_calls: int = 0
    _text_sse: TextChunkSSE | None = None
    _reasoning_sse: TextChunkSSE | None = None

    def sse_chunks(self, event: TurnEvent) -> list[bytes]:
        """The SSE bytes of `chunks(event)`; a plain text or reasoning event (the streaming
        case per token) from a template."""
        plain = not event.tool_calls and not self.options.logprobs
        if plain and event.text and not event.reasoning:
            if self._text_sse is None:
                self._text_sse = TextChunkSSE(self.shape, self.options.include_usage)
            return [self._text_sse(event.text)]
        if plain and event.reasoning and not event.text:
            if self._reasoning_sse is None:
                usage = self.options.include_usage
                self._reasoning_sse = TextChunkSSE(self.shape, usage, reasoning=True)
            return [self._reasoning_sse(event.reasoning)]
        return [sse(chunk) for chunk in self.chunks(event)]

    def logprobs(self, event: TurnEvent) -> dict[str, Any] | None:
        if not self.options.logprobs:
            return None
        top = self.options.top_logprobs
        if self.shape.kind == "chat":
            return chat_logprobs(self.tokens, event.logprobs, top)
        out = completion_logprobs(self.tokens, event.logprobs, top, self.num_chars)
        self.num_chars += len(event.text)
        return out

    def chunks(self, event: TurnEvent) -> list[dict[str, Any]]:
        usage = self.options.include_usage
        out = []
        if event.reasoning:  # `delta.reasoning_content`, before any answer text of the event
            out.append(self.shape.chunk("", None, usage, reasoning=event.reasoning))
        if event.text or event.logprobs:
            out.append(self.shape.chunk(event.text, None, usage, logprobs=self.logprobs(event)))
        if event.tool_calls:
            calls = [c.to_openai(self.num_calls + i) for i, c in enumerate(event.tool_calls)]
            self.num_calls += len(calls)
            out.append(self.shape.chunk("", None, usage, tool_calls=calls))
        return out


async def respond(answer: OpenAIAnswer, turn: Turn) -> web.Response:
    merged = await turn.collect()
    calls = [c.to_openai() for c in turn.tool_calls] or None
    body = answer.shape.response(
        merged.text,
        turn.finish_reason,
        turn.gen.usage.to_dict(),
        calls,
        answer.logprobs(merged),
        merged.reasoning or None,
    )
    return web.json_response(body)


async def stream_response(
    request: web.Request,
    answer: OpenAIAnswer,
    turn: Turn,
    timeout: float = DEFAULT_STREAM_TIMEOUT_S,
) -> web.StreamResponse:
    """SSE; every write bounded by `timeout` (a client that reads nothing is cut)."""
    resp = web.StreamResponse(headers=SSE_HEADERS)
    out = StreamOut(request, resp, answer.shape.request_id, timeout)
    include_usage = answer.options.include_usage
    try:
        await resp.prepare(request)
        if answer.shape.kind == "chat":
            await out.write(sse(answer.shape.role_chunk(include_usage)))
        await _write_stream(out, answer, turn)
        await out.write(SSE_DONE)
        await out.write_eof()
    except ConnectionResetError:
        pass  # the client left or stopped reading; the caller's finally aborts the request
    return resp


async def _write_stream(resp: StreamOut, answer: OpenAIAnswer, turn: Turn) -> None:
    include_usage = answer.options.include_usage
    try:
        async with contextlib.aclosing(turn.events()) as events:
            async for event in events:
                for data in answer.sse_chunks(event):
                    await resp.write(data)
    except GenerationFailed as exc:
        if exc.finish_reason == FINISH_TIMEOUT:  # the finish_reason, then the error
            await resp.write(sse(answer.shape.chunk("", FINISH_TIMEOUT, include_usage)))
        await resp.write(sse(exc.api_error().body()))
        return
    await resp.write(sse(answer.shape.chunk("", turn.finish_reason, include_usage)))
    if include_usage:
        await resp.write(sse(answer.shape.usage_chunk(turn.gen.usage.to_dict())))

"""`--warm-prompts FILE`: prefill prompts at start so the first agent request hits the cache.

The file is a JSON list whose items are OpenAI chat bodies (`{"messages": [...], "tools":
[...]}`, rendered by the model's chat template as a chat request would be) or strings (raw
prompt text, as `/v1/completions` takes it). Each is prefilled with one generated token; its
KV enters the prompt cache (and the disk tier, which may already hold it: then it is read
back, not computed). It runs after the daemon is ready, one prompt at a time, so `/health`
and other requests are answered meanwhile (docs/tuning.md, "Warm prompts").
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from pathlib import Path
from typing import Any

from mlxcel.daemon.engine.types import GREEDY, AdmissionRejected, GenerationRequest
from mlxcel.daemon.server.completions import chat_prompt_ids, completion_prompt_ids
from mlxcel.daemon.server.openai_schema import parse_chat_request
from mlxcel.daemon.server.turn import template_tools

log = logging.getLogger("mlxcel.daemon")

MAX_WARM_FILE_BYTES = 64 << 20
MAX_WARM_PROMPTS = 1000
DISK_SCAN_WAIT_S = 30.0  # warming waits this long at most for the disk tier's start scan


class WarmPromptsError(ValueError):
    """The warm-prompts file cannot be used (said in one line at start)."""


def read_warm_prompts(path: str | Path) -> list[Any]:
    """The file's items, checked for shape (each rendered later, at warm time)."""
    file = Path(path).expanduser()
    try:
        size = file.stat().st_size
        if size > MAX_WARM_FILE_BYTES:
            raise WarmPromptsError(f"warm prompts file {file} is over 64 MiB")
        items = json.loads(file.read_text(encoding="utf-8"))
    except OSError as exc:
        raise WarmPromptsError(f"warm prompts file {file}: {exc.strerror or exc}") from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise WarmPromptsError(f"warm prompts file {file} is not JSON: {exc}") from None
    if not isinstance(items, list):
        raise WarmPromptsError(f"warm prompts file {file} must hold a JSON list")
    if len(items) > MAX_WARM_PROMPTS:
        raise WarmPromptsError(f"warm prompts file {file} has over {MAX_WARM_PROMPTS} prompts")
    for i, item in enumerate(items):
        if isinstance(item, str):
            continue
        if not isinstance(item, dict) or not isinstance(item.get("messages"), list):
            raise WarmPromptsError(
                f"warm prompts file {file}: item {i} is neither a string nor a chat body "
                "with messages"
            )
    return items


async def warm_prompts(items: list[Any], state: Any, ctx: Any) -> dict[str, int]:
    """Prefill each item's prompt (one token generated); a bad item is logged and skipped."""
    started = time.monotonic()
    disk = getattr(getattr(ctx.bridge, "engine", None), "disk", None)
    while disk is not None and not disk.ready and time.monotonic() - started < DISK_SCAN_WAIT_S:
        await asyncio.sleep(0.05)  # the disk tier's start scan: its prompts are found then
    done = tokens = cached = 0
    for i, item in enumerate(items):
        try:
            if isinstance(item, str):
                ids = await completion_prompt_ids(state, ctx, item)
            else:
                req = parse_chat_request(item, strict=False)
                tools = template_tools(req.tools, req.tool_choice)
                ids = await chat_prompt_ids(state, ctx, req.messages, tools, req.template_kwargs)
            request = GenerationRequest(
                f"warm-{i}-{int(started)}", tuple(ids), 1, GREEDY, frozenset(), endpoint="warm"
            )
            last = None
            async for out in ctx.bridge.submit(request):
                last = out
        except AdmissionRejected as exc:
            log.warning("warm prompt %d skipped: %s", i, exc)
            continue
        except Exception as exc:  # a client-style error (a template refusal, a bad body)
            log.warning("warm prompt %d skipped: %s", i, getattr(exc, "message", exc))
            continue
        done += 1
        tokens += len(ids)
        cached += last.cached_tokens if last is not None else 0
    log.info(
        "warmed %d of %d prompts (%d tokens, %d of them already cached) in %.1f s",
        done,
        len(items),
        tokens,
        cached,
        time.monotonic() - started,
    )
    return {"prompts": done, "tokens": tokens, "cached_tokens": cached}

"""`request.info {request_id}`: what the console's request detail cannot read from a snapshot:
the model serving it and its sampling parameters (never the prompt: only its length)."""

from __future__ import annotations

import dataclasses
from typing import Any

from mlxcel.shared.protocol import E_NOT_FOUND, ProtocolError


def request_info(host: Any, request_id: str) -> dict[str, Any]:
    """The waiting or running request `request_id` on any resident model; `not_found` else."""
    residents = list(host.resident.values()) if host is not None else []
    for resident in residents:
        # The bridge's streams are the requests the loop side still reads (this thread's).
        stream = getattr(resident.bridge, "_streams", {}).get(request_id)
        if stream is None:
            continue
        request = stream.request
        return {
            "request_id": request_id,
            "model": resident.ctx.name,
            "endpoint": request.endpoint,
            "prompt_tokens": len(request.prompt_ids),
            "max_tokens": request.max_tokens,
            "sampling": sampling_dict(request.sampling),
        }
    raise ProtocolError(E_NOT_FOUND, f"no waiting or running request {request_id!r}")


def sampling_dict(sampling: Any) -> dict[str, Any]:
    """The parameters that differ from the defaults (a grammar as `json_schema: true`)."""
    out: dict[str, Any] = {}
    defaults = type(sampling)()
    for f in dataclasses.fields(sampling):
        value = getattr(sampling, f.name)
        if value == getattr(defaults, f.name):
            continue
        if f.name == "json_schema":
            value = True
        elif f.name == "logit_bias":
            value = len(value or {})  # how many tokens are biased, not which
        out[f.name] = value
    return out

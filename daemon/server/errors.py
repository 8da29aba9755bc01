"""The HTTP layer's error: a status and the OpenAI error envelope (other dialects re-wrap it)."""

from __future__ import annotations

import json
import math
from typing import Any


class APIError(Exception):
    """An HTTP error in the OpenAI envelope."""

    def __init__(
        self,
        status: int,
        message: str,
        type: str = "invalid_request_error",
        code: str | None = None,
        param: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.code = code
        self.param = param
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }


def bad_request(message: str, param: str | None = None, code: str = "invalid_value") -> APIError:
    return APIError(400, message, code=code, param=param)


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):  # 1e999 parses to inf
        raise ValueError(f"the number {text[:40]} is out of range")
    return value


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def loads_finite(text: str | bytes) -> Any:
    """`json.loads` that refuses what JSON has no number for: NaN, Infinity, -Infinity and
    numbers out of float range such as 1e999 (ValueError). Every number it returns is finite,
    so whatever echoes it (a reply, a metric, an event) can be encoded again."""
    return json.loads(text, parse_float=_finite_float, parse_constant=_no_constant)

"""Request and response bodies of `rollout.serve.server`'s routes: reading one within the size
limit, decoding it so that no body can make the server fail other than with a 400 naming the
problem, and JSON responses.

Owns: the body size limit (`serve.max_body_bytes`); decoding a body (JSON, an object, UTF-8
throughout, nested at most MAX_DEPTH deep: a 400 naming the problem, never a RecursionError);
encoding JSON responses and errors (msgspec).
Does not own: routes (`rollout.serve.server`), the wire format (`rollout.serve.openai_api`).
"""

from __future__ import annotations

import json
from typing import Any

import msgspec

from rollout.serve import openai_api as api
from rollout.types import not_utf8


async def read_body(request: Any, limit: int) -> bytes:
    if int(request.headers.get("content-length") or 0) > limit:
        raise api.ApiError(413, f"request body over serve.max_body_bytes={limit}")
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise api.ApiError(413, f"request body over serve.max_body_bytes={limit}")
    return bytes(body)


def decode(body: bytes) -> dict[str, Any]:
    """The body as a JSON object whose strings are valid UTF-8, nested at most MAX_DEPTH deep."""
    try:
        data = msgspec.json.decode(body)
    except (msgspec.DecodeError, UnicodeDecodeError) as e:
        # Bytes that are not UTF-8: msgspec raises either error, by version, with an offset within
        # the string it was reading at best; the body's own offset is found here.
        if (where := _utf8_error(body)) is not None:
            raise api.ApiError(400, f"the request body is not valid UTF-8: {where}") from e
        field, reason = _lone_surrogate(body) or ("", f"malformed JSON: {e}")
        raise api.ApiError(400, reason, field or None) from e
    except RecursionError as e:  # msgspec's own depth limit (about 1000)
        raise api.ApiError(400, f"the request body is nested deeper than {MAX_DEPTH} levels") from e
    if not isinstance(data, dict):
        raise api.ApiError(400, "the request body must be a JSON object")
    if (problem := _unfit(data)) is not None:
        raise api.ApiError(400, problem[1], problem[0] or None)
    return data


MAX_DEPTH = 64  # JSON nesting a request may have: templates, tool schemas and our own walks recurse


def _lone_surrogate(body: bytes) -> tuple[str, str] | None:
    """(top-level field, reason) when `body`, which msgspec refused, is JSON whose only fault is a
    string with a lone surrogate escape (`"\\ud800"`); None otherwise. msgspec refuses those itself,
    but says "Input data was truncated" (a high surrogate before the closing quote) or "invalid
    utf-16 surrogate pair", naming no field; Python's json reads them, and `_unfit` names the
    field. Only on the error path: the body is parsed a second time."""
    try:
        data = json.loads(body)
    except (ValueError, RecursionError):  # malformed as msgspec says (JSONDecodeError is a ValueError)
        return None
    return _unfit(data) if isinstance(data, dict) else ("", "the request body must be a JSON object")


def _utf8_error(body: bytes) -> str | None:
    """Where `body` stops being UTF-8: "byte N: reason"."""
    try:
        body.decode("utf-8")
    except UnicodeDecodeError as e:
        return f"byte {e.start}: {e.reason}"
    return None


def _unfit(data: dict[str, Any]) -> tuple[str, str] | None:
    """(top-level field, reason) of the first value nested deeper than MAX_DEPTH, or string (key or
    value) that is not valid UTF-8 (a lone surrogate sent as `\\ud800`); None when all fit.
    Iterative, so that no depth makes it recurse."""
    stack: list[tuple[Any, int, str, str]] = [(v, 2, k, k) for k, v in data.items()]
    for key in data:
        if (reason := not_utf8(key)) is not None:
            return "", f"a key of the request body {reason}"
    while stack:
        value, depth, field, where = stack.pop()
        if isinstance(value, str):
            if (reason := not_utf8(value)) is not None:
                return field, f"{where}: {reason}"
            continue
        if not isinstance(value, (dict, list)):
            continue
        if depth > MAX_DEPTH:
            return field, f"{field}: nested deeper than {MAX_DEPTH} levels"
        if isinstance(value, dict):
            for key, item in value.items():
                if (reason := not_utf8(key)) is not None:
                    return field, f"{where}: a key {reason}"
                stack.append((item, depth + 1, field, f"{where}.{key}"))
        else:
            stack.extend(
                (item, depth + 1, field, f"{where}[{i}]") for i, item in enumerate(value) if type(item) is not int
            )
    return None


def json_response(body: Any, status: int = 200, headers: dict[str, str] | None = None) -> Any:
    """A JSON response encoded by msgspec (several times faster than `json.dumps` on token id lists)."""
    from fastapi.responses import Response

    return Response(msgspec.json.encode(body), status_code=status, media_type="application/json", headers=headers)


def error(e: api.ApiError) -> Any:
    return json_response(e.body(), e.status, e.headers)

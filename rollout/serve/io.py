"""What `rollout.serve.server`'s routes stand on: reading requests so that one cannot stall the others,
listening, the API key, the Prometheus figures.

Owns: the body size limit (`serve.max_body_bytes`); decoding a body (JSON, an object, UTF-8
throughout, nested at most MAX_DEPTH deep: a 400 naming the problem, never a RecursionError);
preparing a request (JSON decoding,
rendering, tokenizing) off the event loop when its body is large (`Preparer`: worker threads,
HEAVY_THREADS at a time; small bodies take well under a millisecond and stay on the loop), and
refusing a prompt that cannot fit the context before tokenizing it (`ServedChat`); binding the
listening socket itself (a port in use is an `OSError` naming the address, never uvicorn's
`sys.exit`); the API key's check at start and per request; `/metrics`.
Does not own: routes, sessions, episodes (`rollout.serve.server`), the wire format (`rollout.serve.openai_api`).
"""

from __future__ import annotations

import base64
import contextlib
import hmac
import json
import socket
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import anyio
import msgspec

from rollout.episodes.chat import ChatRenderer
from rollout.errors import InvalidConfigError
from rollout.log import get_logger
from rollout.serve import openai_api as api
from rollout.types import not_utf8

if TYPE_CHECKING:
    from rollout.metrics.figures import Collector

log = get_logger(__name__)
T = TypeVar("T")
INLINE_BYTES = 64 * 2**10  # bodies up to this are prepared on the loop (decoding + rendering: ~1 ms)
HEAVY_THREADS = 2  # larger ones in worker threads, this many at a time (tokenizers release the GIL)
SLACK = 2  # Unicode normalization (NFC) may merge a few characters into fewer: the bound allows for it
_SAFE_NORMALIZERS = {"NFC", "NFKC", "Prepend", "Replace", "Sequence", "Lowercase"}  # none drops text


class ServedChat(ChatRenderer):
    """The model's chat template, with a cheap bound in front of the tokenizer: a text longer than
    SLACK x max_model_len x (longest vocabulary entry) characters cannot have max_model_len tokens
    or fewer (each token covers at most that many characters of text: one byte per character of a
    byte-level entry, one character per SentencePiece character, a special token its content), so
    it is refused as over the context without tokenizing it. Off (no bound) for a tokenizer whose
    normalizer may delete text (BERT's accent stripping), where the argument does not hold."""

    def __init__(self, model_dir: str | Path, max_model_len: int):
        self.max_chars: int | None = None  # unbounded while the parent finds the end-of-turn token
        super().__init__(model_dir)
        self.max_model_len = max_model_len
        longest = max((len(entry) for entry in self.tokenizer.get_vocab()), default=1)
        self.max_chars = SLACK * max_model_len * longest if _keeps_text(self.tokenizer) else None

    def encode(self, text: str) -> list[int]:
        if self.max_chars is not None and len(text) > self.max_chars:
            raise api.ApiError(400, f"This model's maximum context length is {self.max_model_len} tokens. "
                                    f"However, your messages have {len(text)} characters, "
                                    f"more than {self.max_chars} cannot fit it.", "messages")  # fmt: skip
        return super().encode(text)


def served_chat(model_dir: str | Path, max_model_len: int) -> ServedChat | None:
    """The model's chat template, or None when it has none (token ids only)."""
    try:
        return ServedChat(model_dir, max_model_len)
    except InvalidConfigError as e:
        log.warning("serve: no chat template, chat and text prompts are refused", reason=str(e))
        return None


def _keeps_text(tokenizer: Any) -> bool:
    """Whether the fast tokenizer's normalizer is one that never deletes characters."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return False
    normalizer = json.loads(backend.to_str()).get("normalizer")
    pending = [normalizer] if normalizer else []
    while pending:
        step = pending.pop()
        if step.get("type") not in _SAFE_NORMALIZERS or (step.get("type") == "Replace" and not step.get("content")):
            return False
        pending.extend(step.get("normalizers") or [])
    return True


class Preparer:
    """Runs a request's preparation (`work(body)`: decode, check, render, tokenize) where it cannot
    stall the event loop: inline for a small body, else in a worker thread (HEAVY_THREADS at a time;
    the rest wait their turn without holding the loop)."""

    def __init__(self) -> None:
        self.limiter = anyio.CapacityLimiter(HEAVY_THREADS)

    async def run(self, body: bytes, work: Callable[[bytes], T]) -> T:
        if len(body) <= INLINE_BYTES:
            return work(body)
        return await anyio.to_thread.run_sync(work, body, limiter=self.limiter)


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


async def read_body(request: Any, limit: int) -> bytes:
    if int(request.headers.get("content-length") or 0) > limit:
        raise api.ApiError(413, f"request body over serve.max_body_bytes={limit}")
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise api.ApiError(413, f"request body over serve.max_body_bytes={limit}")
    return bytes(body)


def listen(host: str, port: int) -> socket.socket:
    """A listening socket on host:port (port 0: a free one). Raises OSError naming the address."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        sock = socket.socket(family, kind, proto)
    except OSError as e:
        raise OSError(e.errno, f"serve: cannot listen on {host}:{port}: {e.strerror or e}") from e
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(2048)
    except OSError as e:
        sock.close()
        raise OSError(e.errno, f"serve: cannot listen on {host}:{port}: {e.strerror or e}") from e
    sock.setblocking(False)
    return sock


def uvicorn_server(config: Any) -> Any:
    """uvicorn's server without its signal handlers: the engine's own handling of Ctrl-C and
    SIGTERM shuts everything down, this server included."""
    import uvicorn

    class Quiet(uvicorn.Server):
        @contextlib.contextmanager
        def capture_signals(self) -> Any:
            yield

    return Quiet(config)


def check_api_key(key: str | None) -> str | None:
    """The key, if HTTP can carry it in `Authorization: Bearer <key>`: printable ASCII without
    spaces (clients encode headers as ASCII; anything else made every request answer 500).
    Raises InvalidConfigError naming the problem."""
    if key is None:
        return None
    if not key:
        raise InvalidConfigError("serve.api_key (--api-key): empty; leave it out to serve without a key")
    for i, c in enumerate(key):
        if not 0x21 <= ord(c) <= 0x7E:
            raise InvalidConfigError(f"serve.api_key (--api-key): character {i} ({c!r}) cannot travel "
                                     "in an HTTP header: use printable ASCII without spaces")  # fmt: skip
    return key


UNAUTHORIZED = api.ApiError(401, "missing or wrong API key (Authorization: Bearer <key>, or HTTP Basic auth "
                                 "with the key as the password)", kind="authentication_error")  # fmt: skip


class ApiKey:
    """The API key as plain ASGI middleware (Starlette's `BaseHTTPMiddleware` costs a task group
    and two memory streams per request), on every route, vLLM's RL routes included: a request
    without it answers 401 whichever host it comes from (`authorized` says what carries it)."""

    def __init__(self, app: Any, key: str):
        self.app, self.key = app, key.encode("ascii")

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and not authorized(dict(scope["headers"]).get(b"authorization"), self.key):
            reply = error(UNAUTHORIZED)
            return await reply(scope, receive, send)
        await self.app(scope, receive, send)


def authorized(header: bytes | None, key: bytes) -> bool:
    """Whether an `Authorization` header carries the key: `Bearer <key>` (OpenAI's clients), or
    HTTP Basic auth with the key as the password, any user name. Basic is what vLLM's unmodified
    `HTTPVLLMWeightSyncClient` can send: it sets no header, but `requests` sends a URL's user info
    (`http://rollout:KEY@host:port`) or a `~/.netrc` entry as Basic auth. vLLM's own server leaves
    its RL routes outside `--api-key`; here they stay behind it, and no client address is exempt
    (a port-forward, SSH tunnel or sidecar proxy connects from loopback on anyone's behalf), since
    these routes pause every engine and replace the weights it serves. Compared in constant time."""
    scheme, _, token = (header or b"").partition(b" ")
    if scheme.lower() == b"bearer":
        return hmac.compare_digest(token, key)
    if scheme.lower() == b"basic":
        try:
            user_password = base64.b64decode(token, validate=True)
        except ValueError:  # binascii.Error
            return False
        _, colon, password = user_password.partition(b":")
        return bool(colon) and hmac.compare_digest(password, key)
    return False


class Stats:
    """Prometheus figures of the server, and the engine's (`rollout.metrics.figures`), for `GET /metrics`."""

    def __init__(self, collector: Collector):
        from prometheus_client import CollectorRegistry, Counter, Histogram

        self.collector = collector  # the engine's own figures (`RolloutEngine.prometheus_collector`)
        self.registry = CollectorRegistry()
        self.registry.register(collector)
        self.requests = Counter(
            "rollout_http_requests", "HTTP requests by path and status", ["path", "status"], registry=self.registry
        )
        self.latency = Histogram("rollout_http_latency_seconds", "HTTP request latency", ["path"],
                                 registry=self.registry,
                                 buckets=(0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60))  # fmt: skip
        self.prompt_tokens = Counter("rollout_http_prompt_tokens", "prompt tokens served", registry=self.registry)
        self.generated = Counter(
            "rollout_http_generated_tokens", "tokens generated for HTTP requests", registry=self.registry
        )
        self.episodes_forgotten = Counter("rollout_http_episodes_forgotten",
                                          "open episodes (turns kept, never rewarded) "
                                          "forgotten, the oldest first, past the server's bound",
                                          registry=self.registry)  # fmt: skip

    def request(self, path: str, status: int, seconds: float) -> None:
        self.requests.labels(path, str(status)).inc()
        self.latency.labels(path).observe(seconds)

    def tokens(self, prompt: int, generated: int) -> None:
        self.prompt_tokens.inc(prompt)
        self.generated.inc(generated)

    async def exposition(self) -> str:
        from prometheus_client import generate_latest

        await self.collector.refresh()
        return generate_latest(self.registry).decode()


def json_response(body: Any, status: int = 200, headers: dict[str, str] | None = None) -> Any:
    """A JSON response encoded by msgspec (several times faster than `json.dumps` on token id lists)."""
    from fastapi.responses import Response

    return Response(msgspec.json.encode(body), status_code=status, media_type="application/json", headers=headers)


def error(e: api.ApiError) -> Any:
    return json_response(e.body(), e.status, e.headers)

"""The server's API key: checked once at start, then on every request, vLLM's RL routes included.

Owns: which keys HTTP can carry (`check_api_key`), the ASGI middleware (`ApiKey`), and what an
`Authorization` header must say (`authorized`).
"""

from __future__ import annotations

import base64
import hmac
from typing import Any

from rollout.errors import InvalidConfigError
from rollout.serve import openai_api as api
from rollout.serve.bodies import error


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

"""`stream: true` answers: OpenAI's chunks (server-sent events) as the engine generates, in the
shapes vLLM's server sends.

A streamed request's tokens arrive after every engine step (`RolloutEngine.submit(on_tokens=)`);
`Chunks` turns each step's new tokens into one chunk per choice: the role first (chat), then
content deltas (through vLLM's streaming parser methods where `serve.tool_parser` /
`serve.reasoning_parser` are set: `delta.tool_calls`, `delta.reasoning`), each with the logprobs
and token ids of its tokens when asked, then a last chunk per choice with the rest, the finish
reason and the fields this server adds for learners whole (`openai_api.token_fields`: token ids,
logprobs, policy epochs, the Megatron / NeMo Gym fields), the usage if asked
(`stream_options.include_usage`), and `[DONE]`.

The text streamed is what the finished answer says (`openai_api.visible_text`): text a stop
string could still cut is held back (the longest stop string less one character, as vLLM's
detokenizer does), and so is a stop token's and a character still incomplete in UTF-8; whatever
was held back goes out with the last chunk. Owns: the chunks and their text. Does not own: the
request's run (`rollout.serve.server`), the finished answer's fields (`rollout.serve.openai_api`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import msgspec

from rollout.episodes.chat import ChatRenderer, Parsers
from rollout.log import get_logger
from rollout.serve import openai_api as api
from rollout.types import Trajectory

log = get_logger(__name__)


class Text:
    """One choice's text as its tokens arrive: decoded incrementally, what the client may see yet.
    A stop string ends it where vLLM's detokenizer ends it: at the first one in the text the
    tokens past `min_tokens` added (`check_stop_strings`), left out."""

    __slots__ = ("chat", "decode", "ids", "stop", "hold", "stop_ids", "min_tokens", "text", "sent", "prefix", "read",
                 "cut")  # fmt: skip

    def __init__(self, chat: ChatRenderer | None, stop: list[str], stop_ids: list[int], min_tokens: int = 0):
        self.chat, self.stop, self.stop_ids, self.min_tokens = chat, stop, set(stop_ids), min_tokens
        self.decode = decoder(chat) if chat is not None else None
        self.hold = max((len(s) for s in stop), default=1) - 1  # characters a stop string could still cut
        self.ids: list[int] = []
        self.text = ""  # decoded so far (a trailing stop token left out)
        self.sent = ""  # what the client has
        self.prefix = self.read = 0  # incremental decoding: ids[prefix:read] decode to the text's end
        self.cut: int | None = None  # where a stop string ended the text

    def add(self, ids: list[int]) -> str:
        """New tokens; the text the client may now see."""
        if self.chat is None:
            return ""
        for t in ids:
            if self.cut is not None:
                break
            self._one(t)
        if self.cut is not None:
            shown = self.text[: self.cut]
        else:
            shown = self.text[: len(self.text) - self.hold] if self.hold else self.text
        new = shown[len(self.sent) :]
        self.sent += new
        return new

    def _one(self, token: int) -> None:
        """One token, as vLLM's detokenizer takes it: decoded (a stop token's text once a token
        follows it), then, past `min_tokens`, the text it added searched for the stop string that
        completes first (the first listed on a tie)."""
        assert self.decode is not None
        self.ids.append(token)
        end = len(self.ids) - (1 if token in self.stop_ids else 0)
        grew = 0
        if end > self.read:
            before = self.decode(self.ids[self.prefix : self.read])
            after = self.decode(self.ids[self.prefix : end])
            if len(after) > len(before) and not after.endswith("\ufffd"):  # a whole character more
                grew = len(after) - len(before)
                self.text += after[len(before) :]
                self.prefix, self.read = self.read, end
        if grew and self.stop and len(self.ids) > self.min_tokens:
            best: tuple[int, int] | None = None  # (end, start) of the stop string completing first
            for s in self.stop:
                at = self.text.find(s, max(0, len(self.text) - grew - len(s) + 1))
                if at >= 0 and (best is None or at + len(s) < best[0]):
                    best = (at + len(s), at)
            if best is not None:
                self.cut = best[1]

    def rest(self, final: str) -> str:
        """The finished answer's text past what was sent."""
        if not final.startswith(self.sent):  # a tokenizer whose pieces do not decode as the whole does
            log.warning("serve: streamed text differs from the finished answer's", sent=len(self.sent))
        return final[len(self.sent) :]


class Chunks:
    """The chunks of one streamed chat or text completion (`start`, `step` per engine step, `end`)."""

    def __init__(
        self, call: api.Call, model: str, chat: ChatRenderer | None, parsers: Parsers | None, is_chat: bool,
        n: int, usage: bool,
    ):  # fmt: skip
        import time
        import uuid

        self.call, self.chat, self.is_chat, self.usage = call, chat, is_chat, usage
        self.head = {"id": f"{'chatcmpl' if is_chat else 'cmpl'}-{uuid.uuid4().hex}",
                     "object": "chat.completion.chunk" if is_chat else "text_completion",
                     "created": int(time.time()), "model": model}  # fmt: skip
        # Every chunk of one choice is this head, then the choice: its bytes are encoded once.
        self._opening = b"data: " + msgspec.json.encode({**self.head, "choices": []})[:-2]
        self.texts = [Text(chat, call.stop, call.stop_ids, call.sampling.get("min_tokens", 0)) for _ in range(n)]
        self.seen = [0] * n  # tokens of each choice sent
        use = parsers is not None and call.parse is not None and chat is not None and is_chat
        self.parsers = [parsers.streamer(call.parse, call.prompt_ids) for _ in range(n)] if use else None

    def start(self) -> bytes:
        """Chat: the role, before any token (as vLLM sends it); text completions start with text."""
        if not self.is_chat:
            return b""
        chunk = self._chunk({"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                             "finish_reason": None})  # fmt: skip
        if self.call.return_token_ids:
            chunk["prompt_token_ids"] = list(self.call.prompt_ids)
        return _event(chunk)

    def step(self, new: dict[int, tuple[list[int], list[float]]]) -> bytes:
        """One engine step's new tokens per choice: a chunk per choice with something to say."""
        out = []
        for k, (ids, lps) in sorted(new.items()):
            self.seen[k] += len(ids)
            text = self.texts[k].add(ids)
            if (choice := self._choice(k, text, ids, lps, False)) is not None:
                choice["finish_reason"] = None
                out.append(self._opening + msgspec.json.encode(choice) + b"]}\n\n")
        return b"".join(out)

    def end(self, trajs: list[Trajectory]) -> bytes:
        """The last chunk of every choice (the rest, the finish reason, the learner's fields), the
        usage if asked, [DONE]."""
        out = []
        call = self.call
        for k, traj in enumerate(trajs):
            ids, lps = list(traj.token_ids[self.seen[k] :]), list(traj.logprobs[self.seen[k] :])
            final = api.visible_text(self.chat, traj.token_ids, traj.finish_reason, call.stop, call.stop_ids)
            choice = self._choice(k, self.texts[k].rest(final), ids, lps, True) or {"index": k}
            reason = api.finish(traj)
            if self.parsers is not None and self.parsers[k].tools and reason == "stop":
                reason = "tool_calls"  # as vLLM's streaming path says once a tool call was streamed
            if self.is_chat:
                choice["delta"].update(api.token_fields(traj))
            else:
                choice.update(api.token_fields(traj))
            choice["finish_reason"] = reason
            out.append(_event(self._chunk(choice)))
        if self.usage:
            p, g = len(trajs[0].prompt_token_ids), sum(len(t.token_ids) for t in trajs)
            usage = {"prompt_tokens": p, "completion_tokens": g, "total_tokens": p + g}
            out.append(_event({**self.head, "choices": [], "usage": usage}))
        return b"".join(out) + b"data: [DONE]\n\n"

    def _choice(self, k: int, text: str, ids: list[int], lps: list[float], last: bool) -> dict[str, Any] | None:
        call = self.call
        if self.is_chat:
            if self.parsers is not None:
                delta = self.parsers[k].feed(text, ids, last) if (text or ids or last) else None
            else:
                delta = {"content": text} if text else None
            if delta is None and not (last or (ids and (call.logprobs or call.return_token_ids))):
                return None
            choice: dict[str, Any] = {"index": k, "delta": delta or {}, "logprobs": None}
            if call.logprobs:
                items = api.logprob_items(Trajectory(token_ids=ids, logprobs=lps), call.as_token_ids, self.chat)
                choice["logprobs"] = {"content": items}
        else:
            if not text and not last and not (ids and (call.logprobs or call.return_token_ids)):
                return None
            choice = {"index": k, "text": text, "logprobs": None}
            if call.logprobs:
                choice["logprobs"] = {"tokens": [f"token_id:{t}" for t in ids], "token_logprobs": list(lps)}
        if call.return_token_ids:
            choice["token_ids"] = list(ids)
        return choice

    def error(self, e: api.ApiError) -> bytes:
        """A failure after the stream began: OpenAI's error object as an event, then [DONE]."""
        return _event(e.body()) + b"data: [DONE]\n\n"

    def _chunk(self, choice: dict[str, Any]) -> dict[str, Any]:
        return {**self.head, "choices": [choice]}


def _event(data: dict[str, Any]) -> bytes:
    return b"data: " + msgspec.json.encode(data) + b"\n\n"


def decoder(chat: ChatRenderer) -> Callable[[list[int]], str]:
    """`chat.decode`, calling the Rust tokenizer directly where transformers' decode adds nothing to
    it (a `tokenizers` backend whose decode is transformers' own, without the clean-up of spaces):
    the same text, without transformers' per-call conversions, for the two decodes per streamed
    token."""
    from transformers.tokenization_utils_base import PreTrainedTokenizerBase
    from transformers.tokenization_utils_tokenizers import TokenizersBackend

    tok = chat.tokenizer
    plain = (
        isinstance(tok, TokenizersBackend)
        and type(tok)._decode is TokenizersBackend._decode
        and type(tok).decode is PreTrainedTokenizerBase.decode
        and not tok.clean_up_tokenization_spaces
    )
    if not plain:
        return chat.decode
    backend = tok._tokenizer
    return lambda ids: backend.decode(ids, skip_special_tokens=True)

"""`rollout.serve.sse`: a streamed answer's text, token by token, is the finished answer's: what a
stop string (split across tokens, or before `min_tokens`), a stop token or an unfinished UTF-8
character could still change is never sent early."""

from __future__ import annotations

import pytest

from rollout.episodes.chat import ChatRenderer
from rollout.serve import openai_api as api
from rollout.serve.sse import Text, decoder
from rollout.tiny import build_tiny


@pytest.fixture(scope="module")
def chat() -> ChatRenderer:
    return ChatRenderer(build_tiny())


def streamed(chat: ChatRenderer, ids: list[int], stop: list[str], stop_ids: list[int], min_tokens: int, step: int):
    """Each piece of text sent as `ids` arrive `step` at a time, and what the last chunk adds."""
    text = Text(chat, stop, stop_ids, min_tokens)
    pieces = [text.add(ids[k : k + step]) for k in range(0, len(ids), step)]
    final = api.visible_text(chat, ids, "stop", stop, stop_ids)
    return pieces, text.rest(final), final


@pytest.mark.parametrize("step", [1, 2, 5])
def test_a_stop_string_split_across_tokens_is_never_sent(chat, step):
    for text, stop, want in (("abc END", ["END", "xyz"], "abc "), ("abc E", ["END", "c E"], "ab")):
        ids = chat.encode(text)  # the engine ends the turn on the token completing a stop string
        pieces, rest, final = streamed(chat, ids, stop, [], 0, step)
        assert final == want and "".join(pieces) + rest == final
        assert not any(set(p) & set(text[len(want) :]) for p in pieces), pieces


def test_a_stop_string_before_min_tokens_is_text(chat):
    ids = chat.encode("xy-zz-")  # "-" at token 2 is inside min_tokens=3; the one at token 5 stops it
    pieces, rest, final = streamed(chat, ids, ["-"], [], 3, 1)
    assert "".join(pieces) == "xy-zz" and rest == "" and final == "xy-zz"


def test_a_stop_token_and_an_unfinished_character_wait(chat):
    eos = 2
    ids = [*chat.encode("hé"), eos]  # "é" is two byte tokens; the stop token's text is never shown
    text = Text(chat, [], [eos], 0)
    assert [text.add([t]) for t in ids] == ["h", "", "é", ""]
    assert text.rest(api.visible_text(chat, ids, "stop", [], [eos])) == ""


def test_the_streaming_decoder_gives_the_tokenizers_text(chat):
    import random

    decode = decoder(chat)
    rng = random.Random(0)
    vocab = len(chat.tokenizer)
    for ids in (
        [],
        [2],
        chat.encode("hé wörld <b> 1 2"),
        *([rng.randrange(vocab) for _ in range(n)] for n in range(1, 40)),
    ):
        assert decode(ids) == chat.decode(ids), ids

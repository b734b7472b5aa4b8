"""The API key on vLLM's RL routes: vLLM's unmodified `HTTPVLLMWeightSyncClient` (it sets no
header of its own) authenticates with the key in its URL or a netrc entry, sent as HTTP Basic
auth; without the key it is refused from any host, loopback included (`rollout.serve.auth.authorized`).
Over fake engines whose model workers run the real gloo worker engine."""

from __future__ import annotations

import base64
from urllib.parse import quote

import anyio
import pytest

from tests.support.rl_serving import STATE, TIMEOUT, http_trainer, rl_cfg, served


async def test_vllms_http_client_authenticates_with_the_key_in_its_url_or_netrc(tmp_path, monkeypatch):
    """vLLM's `HTTPVLLMWeightSyncClient` sets no header; `requests` sends a URL's user info (or a
    netrc entry) as HTTP Basic auth, which a keyed server takes with the key as the password: the
    unmodified client and trainer factory run a round. Without the key, or with a wrong one, even
    from loopback: 401 and no engine touched."""
    import requests
    from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient

    async with served(rl_cfg(tmp_path), api_key="se/cr:et@") as (engine, server, pool, http):
        host = server.url.removeprefix("http://")
        for url in (server.url, f"http://rollout:wrong@{host}"):
            client = HTTPVLLMWeightSyncClient(url, timeout=TIMEOUT)
            for call in (lambda: client.init_weight_transfer_engine({}), client.start_weight_update):
                with pytest.raises(requests.HTTPError, match="401"):
                    await anyio.to_thread.run_sync(call)
        assert engine.epoch == 0 and all(e.pauses == [] for e in pool.engines)
        keyed = f"http://rollout:{quote('se/cr:et@', safe='')}@{host}"  # the key percent-encoded
        t, source = await anyio.to_thread.run_sync(http_trainer, keyed, STATE)
        source.update({n: v + 1 for n, v in STATE.items()})
        await anyio.to_thread.run_sync(t.send_weights)
        assert engine.epoch == 1 and [e.commits for e in pool.engines] == [[1], [1]]
        t.shutdown()
        (tmp_path / "netrc").write_text("machine 127.0.0.1 login rollout password se/cr:et@\n")
        monkeypatch.setenv("NETRC", str(tmp_path / "netrc"))
        await anyio.to_thread.run_sync(HTTPVLLMWeightSyncClient(server.url).shutdown_weight_transfer_engine)


@pytest.mark.parametrize(("header", "admitted"), [
    (None, False),
    (b"Bearer sekrit", True),
    (b"bearer sekrit", True),
    (b"Bearer wrong", False),
    (b"Bearer sekrit2", False),
    (b"Basic " + base64.b64encode(b"rollout:sekrit"), True),
    (b"Basic " + base64.b64encode(b":sekrit"), True),
    (b"basic " + base64.b64encode(b"any:sekrit"), True),
    (b"Basic " + base64.b64encode(b"sekrit:"), False),  # the key is the password, not the user
    (b"Basic " + base64.b64encode(b"rollout:wrong"), False),
    (b"Basic " + base64.b64encode(b"sekrit"), False),
    (b"Basic not-base64!", False),
    (b"Digest sekrit", False),
    (b"sekrit", False),
])  # fmt: skip
def test_the_key_is_taken_as_a_bearer_token_or_as_basic_auths_password(header, admitted):
    from rollout.serve.auth import authorized

    assert authorized(header, b"sekrit") is admitted

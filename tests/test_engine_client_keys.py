"""EngineClient's bearer keys against an SGLang stand-in that applies SGLang's auth rules
(tests/_fake_sglang.py): the api key on /generate and /model_info, the admin key on control calls."""

from __future__ import annotations

import logging

import pytest
import trio

from agentrl.config import load_config
from agentrl.engine.client import EngineClient, EngineRequestError
from tests.test_weight_push import fakes

API, ADMIN = "api-key-abcdef123456", "admin-key-654321fedcba"


@pytest.fixture(scope="module")
def fake():
    (server,) = fakes(("--api-key", API, "--admin-api-key", ADMIN))
    yield server
    server.stop()


def _client(fake) -> EngineClient:
    cfg = load_config(
        None, [f"engine.urls=['{fake.url}']", "engine.request_retries=3", "engine.health_check_interval_s=0.5"]
    )
    return EngineClient.from_config(cfg.engine)


def test_the_api_key_opens_generate_and_the_admin_key_the_control_calls(fake, monkeypatch, caplog):
    monkeypatch.setenv("AGENTRL_ENGINE_API_KEY", API)
    monkeypatch.setenv("AGENTRL_ENGINE_ADMIN_API_KEY", ADMIN)
    caplog.set_level(logging.DEBUG)

    async def main():
        async with _client(fake) as client:
            result = await client.generate([1, 2, 3], {"max_new_tokens": 1})
            await client.pause("abort")
            paused = fake.state()["paused"]
            await client.continue_generation()
            await client.abort()
            return result, paused, await client.model_info(), await client.weight_versions()

    result, paused, info, versions = trio.run(main)
    assert result.output_ids == [1] and paused == "abort" and fake.state()["paused"] is None
    assert info["model_path"] == "fake" and versions == [fake.state()["weight_version"]]
    assert API not in caplog.text and ADMIN not in caplog.text


def test_a_missing_key_is_refused_at_once_with_the_variable_to_set(fake, monkeypatch, caplog):
    monkeypatch.delenv("AGENTRL_ENGINE_API_KEY", raising=False)
    monkeypatch.delenv("AGENTRL_ENGINE_ADMIN_API_KEY", raising=False)
    caplog.set_level(logging.DEBUG)
    before = [c for c in fake.state()["calls"] if c[0] == "/generate"]

    async def no_keys():
        async with _client(fake) as client:
            await client.generate([1, 2, 3], {"max_new_tokens": 1})

    with pytest.raises(EngineRequestError, match="401.*set AGENTRL_ENGINE_API_KEY") as e:
        trio.run(no_keys)
    assert e.value.status == 401
    assert len([c for c in fake.state()["calls"] if c[0] == "/generate"]) == len(before) + 1  # not retried

    # the api key alone: generation works, control calls need the server's admin key
    monkeypatch.setenv("AGENTRL_ENGINE_API_KEY", API)

    async def api_key_only():
        async with _client(fake) as client:
            await client.generate([1, 2, 3], {"max_new_tokens": 1})
            await client.pause("abort")

    with pytest.raises(Exception, match="401.*set AGENTRL_ENGINE_ADMIN_API_KEY") as e:
        trio.run(api_key_only)
    assert API not in str(e.value) and API not in caplog.text

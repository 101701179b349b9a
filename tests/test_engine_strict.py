"""The embedded engine where SGLang is strict: bearer keys (attacks included), the default
weight_version, --tp-size shadow ranks in the weight group, --dp-size, and builds without the
weight-update bracket. Real engine processes on loopback."""

from __future__ import annotations

import concurrent.futures
import os
import secrets
import types

import httpx
import pytest
import torch

from agentrl.agents.engine_routes import openai_routes
from agentrl.engine.launch import EngineProcess, wait_ready
from agentrl.engine.server import build_app
from agentrl.http_auth import AuthLevel, bearer_matches, decide_request_auth, level_of
from agentrl.net import free_port
from tests.conftest_engine import ENGINE_FLAGS, Teacher, max_abs_diff

API_KEY, ADMIN_KEY = "normal-" + secrets.token_hex(8), "admin-" + secrets.token_hex(8)
BASE_FLAGS = [f for f in ENGINE_FLAGS if f not in ("--weight-version", "0")]  # SGLang's default version


@pytest.fixture(scope="module")
def engines(engine_model, tmp_path_factory):
    """guarded: both keys from the environment; api_only: the api key from a _FILE, --dp-size 2;
    tp2: --tp-size 2 without the weight-update bracket."""
    logs = tmp_path_factory.mktemp("strict_logs")
    key_file = logs / "api_key"
    key_file.write_text(API_KEY + "\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("AGENTRL_ENGINE_")}
    specs = {
        "guarded": ([], {"AGENTRL_ENGINE_API_KEY": API_KEY, "AGENTRL_ENGINE_ADMIN_API_KEY": ADMIN_KEY}),
        "api_only": (["--dp-size", "2"], {"AGENTRL_ENGINE_API_KEY_FILE": str(key_file)}),
        "tp2": (["--tp-size", "2", "--disable-weight-update-bracket"], {}),
    }
    procs = {}
    try:
        for name, (flags, extra_env) in specs.items():
            procs[name] = EngineProcess(
                str(engine_model),
                free_port(),
                extra=[*BASE_FLAGS, *flags],
                log_path=logs / f"{name}.log",
                env={**env, **extra_env},
            ).start(wait_s=0)
        for p in procs.values():
            wait_ready(p.url, 240, process=p.process)
        yield {name: p.url for name, p in procs.items()}
    finally:
        for p in procs.values():
            p.stop()


def routes(**server) -> list:
    """The embedded engine's route table (build_app only reads these attributes before serving)."""
    engine = types.SimpleNamespace(scheduler=None, weight_update_bracket=True, **server)
    return build_app(engine, extra_routes=openai_routes(engine)).routes


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


# ---------------------------------------------------------------------------- the rules


@pytest.mark.parametrize(
    "api, admin, level, header, allowed, status",
    [
        ("", "", AuthLevel.NORMAL, None, True, 401),
        ("", "", AuthLevel.ADMIN_OPTIONAL, None, True, 401),
        ("k", "", AuthLevel.NORMAL, "Bearer k", True, 401),
        ("k", "", AuthLevel.NORMAL, "Bearer x", False, 401),
        ("k", "", AuthLevel.ADMIN_OPTIONAL, "Bearer k", True, 401),  # no admin key: the api key opens admin routes
        ("k", "a", AuthLevel.ADMIN_OPTIONAL, "Bearer k", False, 401),  # ... not when there is one
        ("k", "a", AuthLevel.ADMIN_OPTIONAL, "bearer a", True, 401),  # scheme case-insensitive
        ("k", "a", AuthLevel.NORMAL, "Bearer a", False, 401),  # the admin key does not open normal routes
        ("", "a", AuthLevel.NORMAL, None, True, 401),  # admin key only: normal routes stay open
        ("", "a", AuthLevel.ADMIN_OPTIONAL, None, False, 401),
        ("", "", AuthLevel.ADMIN_FORCE, "Bearer k", False, 403),
        ("k", "a", AuthLevel.ADMIN_OPTIONAL, "Basic a", False, 401),
        ("k", "a", AuthLevel.ADMIN_OPTIONAL, "Bearer", False, 401),
        ("k", "a", AuthLevel.ADMIN_OPTIONAL, "Bearer a ", False, 401),
    ],
)
def test_sglang_auth_rules(api, admin, level, header, allowed, status):
    d = decide_request_auth(
        method="POST", path="/x", authorization=header, api_key=api, admin_api_key=admin, level=level
    )
    assert (d.allowed, d.status) == (allowed, status)
    for path in ("/health", "/health_generate", "/ready", "/metrics"):  # probes never need a key
        assert decide_request_auth(
            method="GET", path=path, authorization=None, api_key="k", admin_api_key="a", level=level
        ).allowed


def test_keys_are_compared_in_constant_time(monkeypatch):
    seen = []
    real = secrets.compare_digest
    monkeypatch.setattr("agentrl.http_auth.secrets.compare_digest", lambda a, b: seen.append((a, b)) or real(a, b))
    assert bearer_matches("Bearer s3cret", "s3cret") and not bearer_matches("Bearer s3cres", "s3cret")
    assert seen == [(b"s3cret", b"s3cret"), (b"s3cres", b"s3cret")]
    assert not bearer_matches("Bearer caf\u00e9", "cafe")  # non-ASCII tokens are compared, not a crash


def test_routes_declare_sglang_admin_levels():
    admin = {r.path for r in routes() if level_of(r.endpoint) is AuthLevel.ADMIN_OPTIONAL}
    assert admin == {
        "/flush_cache",
        "/abort_request",
        "/pause_generation",
        "/continue_generation",
        "/init_weights_update_group",
        "/destroy_weights_update_group",
        "/begin_weight_update",
        "/end_weight_update",
        "/update_weights_from_distributed",
        "/update_weights_from_disk",
        "/update_weight_version",
        "/load_lora_adapter",
        "/unload_lora_adapter",
    }


# --------------------------------------------------------------------------- the attacks

# A request per admin route that would change the engine if it got through.
ATTACKS = {
    "/flush_cache": {},
    "/abort_request": {"abort_all": True},
    "/pause_generation": {"mode": "abort"},
    "/continue_generation": {},
    "/init_weights_update_group": {
        "master_address": "127.0.0.1",
        "master_port": 1,
        "rank_offset": 1,
        "world_size": 2,
        "group_name": "evil",
        "backend": "gloo",
    },
    "/destroy_weights_update_group": {},
    "/begin_weight_update": {},
    "/end_weight_update": {},
    "/update_weights_from_distributed": {"names": ["lm_head.weight"], "dtypes": ["float32"], "shapes": [[1]]},
    "/update_weights_from_disk": {"model_path": "MODEL", "weight_version": "evil"},
    "/update_weight_version": {"new_version": "evil"},
    "/load_lora_adapter": {"lora_name": "evil", "lora_path": "MODEL"},
    "/unload_lora_adapter": {"lora_name": "evil"},
}


def test_every_admin_route_refuses_missing_wrong_and_normal_keys(engines, engine_model):
    url = engines["guarded"]
    admin = [r for r in routes() if level_of(r.endpoint) is AuthLevel.ADMIN_OPTIONAL]
    assert {r.path for r in admin} == set(ATTACKS)  # a new admin route needs its attack here
    for route in admin:
        body = {k: (str(engine_model) if v == "MODEL" else v) for k, v in ATTACKS[route.path].items()}
        for method in sorted(route.methods - {"HEAD"}):
            for headers in (
                {},
                bearer("wrong"),
                bearer(API_KEY),
                {"Authorization": ADMIN_KEY},
                {"Authorization": f"Basic {ADMIN_KEY}"},
                bearer(ADMIN_KEY + "x"),
            ):
                r = httpx.request(
                    method, url + route.path, json=body if method != "GET" else None, headers=headers, timeout=30
                )
                assert (r.status_code, r.json()) == (401, {"error": "Unauthorized"}), (route.path, method, headers)
    info = httpx.get(url + "/server_info", headers=bearer(API_KEY), timeout=10).json()
    assert info["weight_version"] == "default" and not info["paused"] and info["weight_group"] is None
    # The admin key passes (a malformed body shows the request reached its handler).
    r = httpx.post(url + "/update_weight_version", json={"new_version": 5}, headers=bearer(ADMIN_KEY), timeout=10)
    assert r.status_code == 400 and "new_version" in r.json()["message"]


def test_normal_routes_need_the_api_key_and_health_stays_open(engines):
    url = engines["guarded"]
    gen = {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 2}}
    chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    for headers in ({}, bearer(ADMIN_KEY), bearer("wrong")):
        assert httpx.post(url + "/generate", json=gen, headers=headers, timeout=30).status_code == 401
        assert httpx.get(url + "/model_info", headers=headers, timeout=10).status_code == 401
        assert httpx.post(url + "/v1/chat/completions", json=chat, headers=headers, timeout=30).status_code == 401
        assert httpx.get(url + "/v1/models", headers=headers, timeout=10).status_code == 401
    ok = httpx.post(url + "/generate", json=gen, headers=bearer(API_KEY), timeout=30)
    assert ok.status_code == 200 and ok.json()["meta_info"]["weight_version"] == "default"
    ok = httpx.post(url + "/v1/chat/completions", json=chat, headers=bearer(API_KEY), timeout=30)
    assert ok.status_code == 200 and ok.json()["metadata"] == {"weight_version": "default"}
    assert httpx.get(url + "/health", timeout=10).status_code == 200
    assert httpx.get(url + "/health_generate", timeout=30).status_code == 200
    assert httpx.post(url + "/nowhere", headers=bearer(API_KEY), timeout=10).status_code == 404


def test_with_only_an_api_key_it_opens_admin_routes(engines):
    url = engines["api_only"]  # the key came from AGENTRL_ENGINE_API_KEY_FILE
    assert httpx.post(url + "/flush_cache", timeout=10).status_code == 401
    assert httpx.post(url + "/flush_cache", headers=bearer(ADMIN_KEY), timeout=10).status_code == 401
    assert httpx.post(url + "/flush_cache", headers=bearer(API_KEY), timeout=10).status_code == 200


# ------------------------------------------------------------------ versions, TP and DP


def test_weight_version_is_default_until_updated(engines):
    url = engines["tp2"]
    assert httpx.get(url + "/model_info", timeout=10).json()["weight_version"] == "default"
    body = httpx.post(
        url + "/generate", json={"input_ids": [3, 4], "sampling_params": {"max_new_tokens": 2}}, timeout=30
    ).json()
    assert body["meta_info"]["weight_version"] == "default"


def test_dp_size_above_one_refuses_the_weight_group(engines):
    url, key = engines["api_only"], bearer(API_KEY)
    info = httpx.get(url + "/server_info", headers=key, timeout=10).json()
    assert (info["tp_size"], info["dp_size"], info["pp_size"]) == (1, 2, 1)
    r = httpx.post(
        url + "/init_weights_update_group", headers=key, timeout=10, json=ATTACKS["/init_weights_update_group"]
    )
    assert r.status_code == 500
    assert r.json()["message"] == "data-parallel replicas are not supported for update weights from distributed"


def _join(url: str, world: int, group: str) -> tuple[object, dict]:
    """Trainer rank 0 of a gloo weight group with the engine at rank_offset 1."""
    from agentrl.weight_group import init_weight_group

    port = free_port()
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        answer = pool.submit(
            httpx.post,
            url + "/init_weights_update_group",
            timeout=60,
            json={
                "master_address": "127.0.0.1",
                "master_port": port,
                "rank_offset": 1,
                "world_size": world,
                "group_name": group,
                "backend": "gloo",
            },
        )
        pg = init_weight_group("gloo", "127.0.0.1", port, world, 0, group, timeout_s=60)
        return pg, answer.result().json()


def test_tp_size_two_joins_as_two_ranks(engines, engine_model):
    """SGLang joins one rank per TP rank: a trainer that counts one rank per engine is refused,
    one that counts two ranks updates the engine (the shadow rank receives every tensor too)."""
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    from agentrl.weight_group import destroy_weight_group, dtype_name

    url = engines["tp2"]
    assert httpx.get(url + "/server_info", timeout=10).json()["tp_size"] == 2
    assert httpx.post(url + "/begin_weight_update", json={}, timeout=10).status_code == 404  # no bracket here

    wrong, answer = _join(url, 2, "wrong")  # trainer + the engine's first rank meet; its second is rank 2 of 2
    destroy_weight_group(wrong)
    assert answer["success"] is False and "rank < size" in answer["message"]

    pg, answer = _join(url, 3, "right")
    assert answer["success"], answer
    model = AutoModelForCausalLM.from_pretrained(engine_model, dtype=torch.float32)
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.05)
    named = [(n, p.detach()) for n, p in model.named_parameters()]
    with concurrent.futures.ThreadPoolExecutor(1) as pool:  # no /begin_weight_update: this build has none
        answer = pool.submit(
            httpx.post,
            url + "/update_weights_from_distributed",
            timeout=60,
            json={
                "names": [n for n, _ in named],
                "dtypes": [dtype_name(t.dtype) for _, t in named],
                "shapes": [list(t.shape) for _, t in named],
                "group_name": "right",
                "weight_version": "1",
            },
        )
        for w in [dist.broadcast(t, src=0, group=pg, async_op=True) for _, t in named]:
            w.wait()  # returns only when rank 2 (the shadow) has received it as well
        assert answer.result().json() == {"success": True, "message": "Succeeded to update parameter online."}
    assert httpx.post(url + "/destroy_weights_update_group", json={"group_name": "right"}, timeout=30).json()["success"]
    destroy_weight_group(pg)
    prompt = [11, 12, 13]
    body = httpx.post(
        url + "/generate",
        timeout=60,
        json={
            "input_ids": prompt,
            "return_logprob": True,
            "sampling_params": {"max_new_tokens": 6, "temperature": 0.0, "ignore_eos": True},
        },
    ).json()
    assert body["meta_info"]["weight_version"] == "1"
    lps = [lp for lp, _, _ in body["meta_info"]["output_token_logprobs"]]
    assert max_abs_diff(lps, Teacher(model).logprobs(prompt, body["output_ids"])) <= 1e-4

"""agentrl against SGLang's own source (the pinned wheel, parsed with ``ast``; see tests/sglang_spec.py).

* What agentrl sends: the real ``EngineClient`` (inside real episodes, and one image request to an engine
  serving the tiny vision-language model), the agent endpoint (an AgentEnv
  episode through the openai SDK), the OpenAI SDK against the engine's own ``/v1`` routes, and the real
  weight updater drive an embedded engine behind a recording middleware; every recorded request must use a route
  and method in SGLang's table, and its JSON fields must be fields of that route's request struct
  with compatible types, required ones present (``sampling_params`` against SGLang's contract).
* What agentrl reads: the response fields the client, the actors' rollout and the weight updater declare
  they read (``*_FIELDS_READ``) must be keys SGLang writes where they are read: ``/generate`` and its
  ``meta_info``, a ``weight_versions`` span, an abort's ``finish_reason``, ``/model_info``, ``/server_info``
  (``ServerArgs``' fields, ``tp_size`` and ``dp_size`` as ints), and the answer of each control route agentrl
  calls (whether it worked, and why not).
* The embedded engine: each of its routes exists in SGLang with the same methods and auth level,
  its control bodies (``CONTROL_BODIES``) are SGLang's fields with SGLang's defaults, and it answers
  every recorded request.
* The snapshot: the parsed parts agentrl relies on must equal ``tests/data/sglang_spec.json``;
  when a newer SGLang is pinned the failure lists what changed.

The wheel is downloaded once (``~/.cache/agentrl/sglang-wheels``); without it these tests fail.
"""

from __future__ import annotations

import ast
import json
import os
import sys
import types
from pathlib import Path

import pytest
import torch
import trio

from agentrl.agents.engine_routes import openai_routes
from agentrl.agents.openai_api import ALL_FIELDS as CHAT_COMPLETION_FIELDS
from agentrl.config import LORA_ADAPTER_NAME
from agentrl.engine.client import EngineClient, GenerateResult
from agentrl.engine.launch import EngineProcess, wait_ready
from agentrl.engine.native_api import GENERATE_FIELDS
from agentrl.engine.server import CONTROL_BODIES, REQUIRED, build_app
from agentrl.episode import turn
from agentrl.http_auth import level_of
from agentrl.learner.weight_push import WeightUpdater
from agentrl.net import free_port
from tests import sglang_spec
from tests.conftest_engine import ENGINE_FLAGS

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def spec() -> sglang_spec.Spec:
    try:
        wheel = sglang_spec.fetch_wheel()
    except RuntimeError as e:
        pytest.fail(str(e))
    return sglang_spec.load_spec(sglang_spec.read_sources(wheel))


def embedded_routes() -> list:
    """The embedded engine's route table (build_app reads only these attributes before serving)."""
    server = types.SimpleNamespace(scheduler=None, weight_update_bracket=True)
    return build_app(server, extra_routes=openai_routes(server)).routes


def response_fields_read() -> dict[str, tuple[str, ...]]:
    """Where (``sglang_spec.Spec.written``) agentrl reads which keys of SGLang's answers."""
    return {
        "/generate": GenerateResult.FIELDS_READ,
        "/generate meta_info": GenerateResult.META_INFO_FIELDS_READ + turn.META_INFO_FIELDS_READ,
        "/generate meta_info.weight_versions[]": turn.SPAN_FIELDS_READ,
        "/generate meta_info.finish_reason (abort)": turn.ABORT_FIELDS_READ,
        "/model_info": EngineClient.MODEL_INFO_FIELDS_READ,
        "/server_info": WeightUpdater.SERVER_INFO_FIELDS_READ,
    }


# why a control call failed, as agentrl reports it (a plain-text answer is read as the message)
REASONS = ("message", "error_message", "error", sglang_spec.TEXT)


def relied_on_now(spec: sglang_spec.Spec) -> dict:
    """The snapshot's content: every route the embedded engine serves, with the request fields the
    engine reads (and therefore agentrl may send) and the answer keys agentrl reads there, and the
    response keys agentrl reads elsewhere."""
    fields = {r.path: set(CONTROL_BODIES.get(r.path, {})) for r in embedded_routes()}
    fields["/generate"] = set(GENERATE_FIELDS)
    fields["/v1/chat/completions"] = set(CHAT_COMPLETION_FIELDS)
    return sglang_spec.relied_on(spec, fields, response_fields_read(), WeightUpdater.ANSWER_FIELDS_READ)


# ------------------------------------------------------------------ capturing what agentrl sends


def drive_weight_updater(urls: list[str], model_path: Path, scratch: Path) -> None:
    """Everything the trainer side of the weight push sends, through its public API.
    (Re-point this when the trainer side moves; the checks below do not depend on it.)"""
    from transformers import AutoModelForCausalLM

    from agentrl.learner.lora import LoraSpec, adapter_parameters, add_adapters, write_adapter
    from agentrl.learner.weight_push import WeightUpdater

    named = list(AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).named_parameters())
    with WeightUpdater(urls, backend="gloo", bucket_bytes=1 << 20) as updater:
        updater.connect()
        assert updater.lagging(0) == updater.members  # the engine reports "default": it gets the weights
        updater.push(named, version=1)
        updater.push_from_disk(str(model_path), 2)
    with WeightUpdater(urls, backend="gloo", group_name="flat", load_format="flattened_bucket") as updater:
        updater.push(named, version=3)
    spec = LoraSpec(rank=2)  # LoRA adapter updates (learner.lora.sync = "adapter"): B = 0, the weights stay
    adapted = add_adapters(AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32), spec)
    folder = write_adapter(scratch / "adapter", dict(adapter_parameters(adapted)), spec, str(model_path))
    with WeightUpdater(urls, backend="gloo") as updater:
        updater.push_adapter(folder, 4)  # the first: nothing to unload yet
        updater.push_adapter(folder, 5)  # then unload, load


async def drive_client(urls: list[str], model_path: Path) -> None:
    """Real episodes (the calculator env, the actors' sampling params) plus every control call."""
    from transformers import AutoTokenizer

    from agentrl.config import AgentRLConfig
    from agentrl.envs.calculator import CalculatorEnv
    from agentrl.episode.rollout import run_episode, sampling_from_config, toolbox_for
    from agentrl.episode.turn import EpisodeLimits

    cfg = AgentRLConfig()
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    env = CalculatorEnv()
    limits = EpisodeLimits(max_turns=2, max_total_tokens=512, max_new_tokens_per_turn=16)
    tasks = env.tasks("train", seed=0)
    async with EngineClient(urls, health_check_interval_s=0.2) as client:
        for sampling in (sampling_from_config(cfg), sampling_from_config(cfg, greedy=True)):
            await run_episode(client, tokenizer, env, toolbox_for(env, cfg), next(tasks), sampling, limits)
        await client.pause("retract")
        await client.continue_generation()
        await client.abort("no-such-request")
        await client.abort()
        await client.model_info()
        await client.weight_versions()
    async with EngineClient(urls, lora_path=LORA_ADAPTER_NAME) as client:  # the adapter the updater loaded
        await client.generate([1, 2, 3], {"max_new_tokens": 2, "temperature": 0.0})
    await drive_openai_routes(urls, tokenizer, str(model_path))


async def drive_openai_routes(urls: list[str], tokenizer, model_name: str) -> None:
    """The agent endpoint's /generate calls (an AgentEnv episode through the openai SDK: tools, n, seed,
    stop, logprobs, a stitched streamed call) and the OpenAI SDK against the engine's own /v1 routes."""
    import openai

    from agentrl.agents.agent_runner import AgentRunner
    from agentrl.envs.agent import AgentEnv
    from agentrl.envs.base import Task

    tools = [
        {
            "type": "function",
            "function": {
                "name": "add",
                "description": "Add.",
                "parameters": {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
            },
        }
    ]
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2 + 3?"}]

    class Drive(AgentEnv):
        async def run(self, task, client):
            first = await client.chat.completions.create(
                model="m",
                messages=messages,
                tools=tools,
                n=2,
                seed=1,
                stop=["\n\n"],
                logprobs=True,
                max_tokens=8,
                temperature=0.7,
                top_p=0.9,
            )
            history = messages + [
                first.choices[0].message.model_dump(exclude_none=True),
                {"role": "user", "content": "Sure?"},
            ]
            stream = await client.chat.completions.create(
                model="m",
                messages=history,
                tools=tools,
                max_tokens=8,
                stream=True,
                stream_options={"include_usage": True},
            )
            [c async for c in stream]
            engine = openai.AsyncOpenAI(base_url=urls[0] + "/v1", api_key="unused", max_retries=0)
            await engine.models.list()
            await engine.chat.completions.create(
                model=model_name, messages=messages, tools=tools, max_tokens=8, seed=2, n=2, logprobs=True
            )
            stream = await engine.chat.completions.create(
                model=model_name, messages=messages, max_tokens=8, stream=True, stream_options={"include_usage": True}
            )
            [c async for c in stream]
            await engine.close()
            return 1.0

    async with AgentRunner(tokenizer, lambda: EngineClient(urls), forced_sampling={"temperature": 1.0}) as runner:
        await runner.play(Drive(), Task("t"))


async def drive_image_request(urls: list[str], model_path: Path) -> None:
    """One /generate with image_data, as an episode sends it: expanded ids and a data URL per image."""
    from PIL import Image
    from transformers import AutoTokenizer

    from agentrl.images import VisionProcessor, data_url, to_png

    tokenizer, vision = AutoTokenizer.from_pretrained(model_path), VisionProcessor.load(model_path)
    assert vision is not None
    png = to_png(Image.new("RGB", (56, 56), (200, 30, 30)))
    content = [{"type": "image"}, {"type": "text", "text": "colour?"}]
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": content}], add_generation_prompt=True, tokenize=False
    )
    ids = vision.expand(tokenizer.encode(text, add_special_tokens=False), [png])
    async with EngineClient(urls) as client:
        await client.generate(ids, {"max_new_tokens": 2, "temperature": 0.0}, image_data=[data_url(png)])


def recorder(model: Path, record: Path, logs: Path, name: str) -> EngineProcess:
    """The embedded engine serving ``model`` behind the recording middleware (started, not yet ready)."""
    port = free_port()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    proc = EngineProcess(str(model), port, log_path=logs / f"{name}.log", env=env)
    i = ENGINE_FLAGS.index("--weight-version")
    flags = ENGINE_FLAGS[:i] + ENGINE_FLAGS[i + 2 :]  # the engine reports SGLang's "default"
    proc.argv = [
        sys.executable,
        "-m",
        "tests._engine_recorder",
        str(record),
        "--model",
        str(model),
        "--port",
        str(port),
    ]
    proc.argv += flags
    return proc.start(wait_s=0)


@pytest.fixture(scope="module")
def recorded(engine_model, tmp_path_factory) -> list[dict]:
    from agentrl.models.builder import build_tiny_vl

    logs = tmp_path_factory.mktemp("conformance")
    record, vl_record = logs / "requests.jsonl", logs / "vl_requests.jsonl"
    vl_model = build_tiny_vl(logs / "tiny-vl")
    procs: list[EngineProcess] = []
    try:
        procs.append(proc := recorder(engine_model, record, logs, "engine"))
        procs.append(vl_proc := recorder(vl_model, vl_record, logs, "vl_engine"))  # starts while the other works
        wait_ready(proc.url, 240, process=proc.process)
        drive_weight_updater([proc.url], engine_model, logs)  # first: it sets the version the episodes need
        trio.run(drive_client, [proc.url], engine_model)
        wait_ready(vl_proc.url, 240, process=vl_proc.process)
        trio.run(drive_image_request, [vl_proc.url], vl_model)  # a vision-language model's engine
    finally:
        for p in procs:
            p.stop()
    return [json.loads(line) for f in (record, vl_record) for line in f.read_text().splitlines()]


# -------------------------------------------------------------------------------- checks


def request_errors(req: dict, spec: sglang_spec.Spec) -> list[str]:
    """Why ``req`` (one recorded request) would not be understood by SGLang as it is meant."""
    what = f"{req['method']} {req['path']}"
    route = spec.routes.get(req["path"])
    if route is None:
        return [f"{what}: SGLang {spec.version} has no route {req['path']}"]
    if req["method"] not in route.methods:
        return [f"{what}: SGLang serves {req['path']} with {route.methods} only"]
    body = req["body"]
    if body is None or route.request is None:
        return []
    if not isinstance(body, dict):
        return [f"{what}: the body is not a JSON object"]
    fields = spec.struct(route.request)
    errors = [f"{what}: {route.request} has no field {k!r}" for k in body if k not in fields]
    errors += [
        f"{what}: required field {k!r} of {route.request} is missing"
        for k, f in fields.items()
        if f.required and k not in body
    ]
    for k, v in body.items():
        if k in fields:
            err = sglang_spec.conformance_error(v, spec.annotation(route.request, k), spec, f"{what}: {k}")
            errors += [err] if err else []
    if req["path"] == "/generate":
        params = body.get("sampling_params") or {}
        for one in params if isinstance(params, list) else [params]:
            for k, v in one.items():
                if k not in spec.sampling_params:
                    errors.append(f"{what}: sampling_params.{k} is not in SGLang's contract")
                    continue
                err = sglang_spec.conformance_error(
                    v, spec.annotations[f"SamplingParams.{k}"], spec, f"{what}: sampling_params.{k}"
                )
                errors += [err] if err else []
    return errors


def test_every_request_agentrl_sends_is_one_sglang_understands(recorded, spec):
    sent = {(r["method"], r["path"]) for r in recorded}
    # The capture really covers the client and the weight push (a broken driver must not pass quietly).
    assert {
        ("POST", "/generate"),
        ("GET", "/ping"),
        ("POST", "/pause_generation"),
        ("POST", "/abort_request"),
        ("POST", "/init_weights_update_group"),
        ("POST", "/update_weights_from_distributed"),
        ("POST", "/update_weights_from_disk"),
        ("POST", "/destroy_weights_update_group"),
        ("POST", "/v1/chat/completions"),
        ("GET", "/v1/models"),
        ("POST", "/load_lora_adapter"),
        ("POST", "/unload_lora_adapter"),
    } <= sent, sent
    assert any((r["body"] or {}).get("lora_path") for r in recorded if r["path"] == "/generate")
    assert any((r["body"] or {}).get("image_data") for r in recorded if r["path"] == "/generate")
    errors = sorted({e for r in recorded for e in request_errors(r, spec)})
    assert not errors, "\n".join(errors)


def test_the_embedded_engine_answered_every_request(recorded):
    refused = [f"{r['method']} {r['path']} -> {r['status']}" for r in recorded if r["status"] >= 400]
    # the updater's first adapter push unloads an adapter the fresh engine does not hold: SGLang's
    # 400 there is expected (WeightUpdater._unload_adapter), once
    assert refused.count("POST /unload_lora_adapter -> 400") == 1, refused
    refused.remove("POST /unload_lora_adapter -> 400")
    assert not refused, "\n".join(refused)


def test_what_the_checks_reject(spec):
    """The checker itself: wrong routes, methods, fields, types, values and missing fields fail."""
    bad = [
        ({"method": "GET", "path": "/get_weight_version", "body": None}, "no route"),
        ({"method": "GET", "path": "/generate", "body": None}, "with ['POST', 'PUT'] only"),
        ({"method": "POST", "path": "/pause_generation", "body": {"mode": "sideways"}}, "must be one of"),
        ({"method": "POST", "path": "/update_weight_version", "body": {"new_version": 3}}, "must be str"),
        ({"method": "POST", "path": "/update_weight_version", "body": {}}, "'new_version' of"),
        ({"method": "POST", "path": "/abort_request", "body": {"abort": True}}, "no field 'abort'"),
        (
            {"method": "POST", "path": "/generate", "body": {"input_ids": [1], "image_data": 5}},
            "image_data must be str",
        ),
        ({"method": "POST", "path": "/generate", "body": {"input_ids": [1], "image_data": [[7]]}}, "image_data"),
        (
            {
                "method": "POST",
                "path": "/update_weights_from_distributed",
                "body": {"names": ["a"], "dtypes": ["float32"], "shapes": [["1"]]},
            },
            "shapes[0][0] must be int",
        ),
        (
            {"method": "POST", "path": "/generate", "body": {"input_ids": [1], "sampling_params": {"max_tokens": 3}}},
            "sampling_params.max_tokens",
        ),
        (
            {"method": "POST", "path": "/generate", "body": {"input_ids": [1], "sampling_params": {"top_k": "5"}}},
            "sampling_params.top_k",
        ),
    ]
    for req, needle in bad:
        errors = request_errors(req, spec)
        assert any(needle in e for e in errors), (req, errors)
    good = {
        "method": "POST",
        "path": "/generate",
        "body": {
            "input_ids": [[1, 2], [3]],
            "rid": ["a", "b"],
            "return_logprob": [True, False],
            "sampling_params": {"stop": ["x"], "stop_token_ids": [2]},
        },
    }
    assert request_errors(good, spec) == []


def test_response_fields_agentrl_reads_are_written_by_sglang(spec):
    for where, fields in response_fields_read().items():
        missing = [f for f in fields if f not in spec.written(where)]
        assert not missing, f"{where}: agentrl reads {missing}, which SGLang {spec.version} never writes there"
    # the weight updater computes rank offsets with int(): SGLang's fields are ints (default 1, as assumed)
    for name in WeightUpdater.SERVER_INFO_FIELDS_READ:
        assert (spec.server_args[name].annotation, spec.server_args[name].default) == ("int", "1"), name


def test_control_answers_say_whether_and_why(recorded, spec):
    """Every control route agentrl calls (the weight updater's and the client's, as recorded) answers
    with a reason agentrl reports when it fails; each answer key agentrl reads is one SGLang writes
    in the answer of a route agentrl calls."""
    control = sorted(
        {
            r["path"]
            for r in recorded
            if r["method"] == "POST" and r["path"] != "/generate" and not r["path"].startswith("/v1/")
        }
    )
    assert {"/update_weights_from_distributed", "/load_lora_adapter", "/pause_generation"} <= set(control), control
    silent = [p for p in control if not spec.written(p) & set(REASONS)]
    assert not silent, f"SGLang {spec.version} answers {silent} without any of {REASONS}"
    written = set().union(*(spec.written(p) for p in control))
    unread = [k for k in WeightUpdater.ANSWER_FIELDS_READ if k not in written]
    assert not unread, f"agentrl reads {unread} from control answers; SGLang {spec.version} writes them in none"


def test_answer_keys_are_read_per_route(spec):
    """The per-place key sets are narrower than "anywhere in SGLang" (a check that could not fail would
    pass these too): a key of one answer is not found in another's."""
    assert {"tp_size", "dp_size", "weight_version", "launch_command"} <= spec.written("/server_info")
    assert "new_version" not in spec.written("/server_info") and "success" not in spec.written("/model_info")
    assert "success" not in spec.written("/pause_generation") and "message" in spec.written("/pause_generation")
    assert {"success", "error_message"} <= spec.written("/load_lora_adapter")  # the io_struct output it returns
    assert "message" in spec.written("/abort_request")  # through _create_error_response's {"error": {...}}
    assert spec.written("/flush_cache") == {sglang_spec.TEXT} and sglang_spec.TEXT not in spec.written("/abort_request")
    assert "message" not in spec.written("/generate meta_info.weight_versions[]")
    assert "weight_version" not in spec.written("/generate meta_info.finish_reason (abort)")
    assert spec.written("/no_such_route") == set()


def test_embedded_routes_are_sglang_routes_with_its_methods_auth_and_fields(spec):
    problems = []
    for route in embedded_routes():
        theirs = spec.routes.get(route.path)
        if theirs is None:
            problems.append(f"{route.path}: not an SGLang {spec.version} route")
            continue
        if sorted(route.methods - {"HEAD"}) != theirs.methods:
            problems.append(f"{route.path}: methods {sorted(route.methods - {'HEAD'})}, SGLang {theirs.methods}")
        if level_of(route.endpoint).value != theirs.auth:
            problems.append(f"{route.path}: auth {level_of(route.endpoint).value}, SGLang {theirs.auth}")
        if route.path == "/generate":
            problems += [
                f"/generate: {k} is not a field of {theirs.request}"
                for k in GENERATE_FIELDS
                if k not in spec.structs[theirs.request]
            ]
        ours = CONTROL_BODIES.get(route.path)
        if ours is None:
            continue
        fields = spec.structs[theirs.request]
        for name, f in ours.items():
            if name not in fields:
                problems.append(f"{route.path}: {name} is not a field of {theirs.request}")
                continue
            sg = fields[name]
            if (f.default is REQUIRED) != sg.required:
                problems.append(f"{route.path}: {name} required={f.default is REQUIRED}, SGLang {sg.required}")
            elif not sg.required and _literal(sg.default) != f.default:
                problems.append(f"{route.path}: {name} defaults to {f.default!r}, SGLang to {sg.default}")
            node = spec.annotations[f"{theirs.request}.{name}"]
            for value in f.supported or ([] if f.default is REQUIRED else [f.default]):
                err = sglang_spec.conformance_error(value, node, spec, f"{route.path}: {name}")
                problems += [err] if err else []
    assert not problems, "\n".join(problems)


def _literal(source: str | None):
    try:
        return ast.literal_eval(source)
    except (ValueError, SyntaxError):
        return f"<{source}>"


def test_a_server_without_weight_version_reports_sglangs_default(spec):
    """SGLang's ``ServerArgs.weight_version`` defaults to ``"default"``; the embedded engine's flag, the
    scheduler and the launch helper say the same (the router test runs such a worker beside the real server)."""
    import inspect

    from agentrl.engine.scheduler import Scheduler
    from agentrl.engine.server import parse_args

    assert spec.server_args["weight_version"].default == repr("default")
    assert parse_args(["--model", "m"]).weight_version == "default"
    assert inspect.signature(Scheduler).parameters["weight_version"].default == "default"


def test_sglang_spec_matches_the_snapshot(spec):
    now = relied_on_now(spec)
    before = json.loads(sglang_spec.SNAPSHOT.read_text())
    changes = sglang_spec.diff(before, now)
    assert not changes, (
        f"SGLang's contract as parsed from the {spec.version} wheel differs from {sglang_spec.SNAPSHOT.name} "
        f"(- before, + now, ~ changed):\n"
        + "\n".join(changes)
        + "\nReview the changes (client, weight push, embedded engine), then: python -m tests.sglang_spec --write"
    )

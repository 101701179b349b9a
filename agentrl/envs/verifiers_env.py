"""verifiers environments (its classic API: ``SingleTurnEnv``, ``MultiTurnEnv``, ``ToolEnv``) as agentrl envs.

:class:`VerifiersEnv` takes a ``verifiers`` environment object, a ``"module:function"`` that builds one, or an
id for ``verifiers.load_environment``, and plays it in agentrl's token-exact episode: agentrl generates every
token; the adapter only maps messages between the two sides.

* Tasks are the dataset's rows (``dataset`` -> ``train``, ``eval_dataset`` -> ``test``; with only one of the
  two, rows are split by a hash of the prompt). The episode opens with the row's ``prompt`` as verifiers
  formats it (system prompt, few-shot, question).
* A ``ToolEnv``'s Python functions are agentrl tools with verifiers' own schemas; a call runs through the
  env's ``call_tool`` (errors are shown through its ``error_formatter``).
* Each text turn is added to the verifiers state's ``trajectory`` (``add_trajectory_step``); then the env's
  stop conditions (``is_completed``) and ``get_prompt_messages`` / ``env_response`` decide: stop, or one user
  message that agentrl appends as the simulated user's reply.
* The reward is the rubric's weighted sum; each weighted reward function is a component (weight times
  value, so that the components sum to the reward); a function that raises is agentrl's reward error.

verifiers is asyncio code and agentrl's episodes are trio: every call into verifiers runs on one asyncio
event loop in a thread of the env's own (:class:`_AsyncioThread`). What is not supported, and why:
docs/envs.md, "verifiers environments".
"""

from __future__ import annotations

import asyncio
import inspect
import json
import random
import signal
import threading
from collections.abc import Coroutine, Iterator
from typing import Any, TypeVar

import trio

from agentrl.envs.base import Env, Message, Task, _import_module_or_file, split_bucket
from agentrl.envs.rewards import without_reasoning
from agentrl.tools.base import Tool, ToolError
from agentrl.tools.parsing import HermesToolCallParser, ToolCallParser, get_parser

T = TypeVar("T")


class _AsyncioThread:
    """One asyncio event loop in a daemon thread; trio code awaits coroutines run on it."""

    def __init__(self) -> None:
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def _started(self) -> asyncio.AbstractEventLoop:
        with self._lock:
            if self._loop is None:
                loop = asyncio.new_event_loop()
                self._thread = threading.Thread(target=loop.run_forever, name="verifiers-asyncio", daemon=True)
                self._thread.start()
                self._loop = loop
            return self._loop

    async def run(self, coro: Coroutine[Any, Any, T]) -> T:
        """The coroutine's result, run on the loop; a trio cancellation cancels it there."""
        future = asyncio.run_coroutine_threadsafe(coro, self._started())
        token, done = trio.lowlevel.current_trio_token(), trio.Event()

        def wake(_: Any) -> None:
            try:
                token.run_sync_soon(done.set)
            except trio.RunFinishedError:
                pass

        future.add_done_callback(wake)
        try:
            await done.wait()
        finally:
            if not future.done():
                future.cancel()
        return future.result()

    def close(self) -> None:
        with self._lock:
            loop, thread, self._loop, self._thread = self._loop, self._thread, None, None
        if loop is not None and thread is not None:
            loop.call_soon_threadsafe(loop.stop)
            thread.join(timeout=10)
            if not thread.is_alive():
                loop.close()


class _NoModelClient:
    """Stands in for verifiers' model client: agentrl generates the tokens, so the env must never ask."""

    @staticmethod
    def make() -> Any:
        from verifiers.legacy.clients import Client

        class AgentrlGenerates(Client):
            def setup_client(self, config: Any) -> Any:
                return None

            async def to_native_tool(self, tool: Any) -> Any:
                return tool

            async def to_native_prompt(self, messages: Any) -> tuple[Any, dict]:
                return messages, {}

            async def get_native_response(self, prompt: Any, model: str, sampling_args: Any, tools: Any = None, **kw):
                raise RuntimeError("agentrl generates the policy's turns: a verifiers env cannot call the model itself")

            async def raise_from_native_response(self, response: Any) -> None:
                return None

            async def from_native_response(self, response: Any) -> Any:
                return response

            async def close(self) -> None:
                return None

        return AgentrlGenerates(None)


def load_verifiers_env(environment: Any, env_args: dict[str, Any] | None = None) -> Any:
    """A verifiers environment: ``environment`` itself, built by ``"module:function"`` (or
    ``"path/file.py:function"``) with ``env_args``, or ``verifiers.load_environment(id, **env_args)``.
    Signal handlers the env installs (verifiers' ``Environment`` sets SIGINT and SIGTERM) are undone."""
    import verifiers as vf

    if isinstance(environment, str):
        kept = _signal_handlers()
        try:
            if ":" in environment:
                module_name, attr = environment.rsplit(":", 1)
                factory = getattr(_import_module_or_file(module_name), attr, None)
                if not callable(factory):
                    raise ValueError(f"{environment!r} does not name a function that builds a verifiers environment")
                environment = factory(**(env_args or {}))
            else:
                environment = vf.load_environment(environment, **(env_args or {}))
        finally:
            for sig, handler in kept.items():
                signal.signal(sig, handler)
    if not isinstance(environment, vf.Environment):
        raise ValueError(f"expected a verifiers Environment, got {type(environment).__name__}")
    return environment


def _signal_handlers() -> dict[int, Any]:
    if threading.current_thread() is not threading.main_thread():
        return {}
    return {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}


def unsupported(env: Any) -> str | None:
    """Why agentrl cannot play ``env`` (None when it can): see docs/envs.md, "verifiers environments"."""
    import verifiers as vf

    kind = type(env).__name__
    if not isinstance(env, vf.MultiTurnEnv):
        return f"{kind} is not a MultiTurnEnv (SingleTurnEnv, MultiTurnEnv and ToolEnv are supported)"
    if type(env).get_model_response is not vf.Environment.get_model_response:
        return f"{kind} gets the model's turns its own way (get_model_response); agentrl generates every turn"
    if isinstance(env, vf.StatefulToolEnv):
        return f"{kind} is a StatefulToolEnv: its update_tool_args needs the turn's messages, which a tool call lacks"
    if env.tool_defs and not isinstance(env, vf.ToolEnv):
        return f"{kind} declares tool_defs but is not a ToolEnv: agentrl runs tool calls, and only a ToolEnv's tools"
    for rubric in _leaf_rubrics(env.rubric):
        for func, weight in zip(rubric.funcs, rubric.weights):
            if weight and rubric._is_group_func(func):
                name = getattr(func, "__name__", repr(func))
                return f"reward function {name!r} scores a whole group; agentrl scores each episode on its own"
    return None


def _leaf_rubrics(rubric: Any) -> list[Any]:
    import verifiers as vf

    if isinstance(rubric, vf.RubricGroup):
        return [leaf for r in rubric.rubrics for leaf in _leaf_rubrics(r)]
    return [rubric]


class VerifiersEnv(Env):
    """A verifiers environment as an agentrl env (module docstring; docs/envs.md).

    Args:
        environment: a verifiers ``Environment``, ``"module:function"`` that returns one, or a
            ``load_environment`` id (an installed environment package).
        env_args: keyword arguments for the function or ``load_environment``.
        test_fraction: with only one dataset, the share of rows (by a hash of the prompt) that are ``test``.
        tool_format: the model's tool-call format (``agentrl.tools.parsing.get_parser``); "" is Hermes.
    """

    name = "verifiers"

    def __init__(
        self,
        environment: Any,
        env_args: dict[str, Any] | None = None,
        test_fraction: float = 0.1,
        tool_format: str = "",
    ):
        self.vf_env = load_verifiers_env(environment, env_args)
        reason = unsupported(self.vf_env)
        if reason:
            raise ValueError(f"verifiers environment not supported: {reason}")
        self.name = self.vf_env.env_id or (
            environment.rsplit(":", 1)[-1] if isinstance(environment, str) else "verifiers"
        )
        self.test_fraction = test_fraction
        self.tool_parser: ToolCallParser = get_parser(tool_format) if tool_format else HermesToolCallParser()
        self.max_turns = self.vf_env.max_turns if self.vf_env.max_turns > 0 else None
        self._loop = _AsyncioThread()
        self._rows: dict[str, list[dict[str, Any]]] = {}
        self._client: Any = None
        self._tools = [_VerifiersTool(self, d) for d in (self.vf_env.tool_defs or [])]

    # tasks and prompts

    def rows(self, split: str) -> list[dict[str, Any]]:
        """The dataset rows of ``split`` as verifiers formats them (``prompt``, ``answer``, ``info``...)."""
        if not self._rows:
            train, test = self.vf_env.build_dataset(), self.vf_env.build_eval_dataset()
            if train is not None and test is not None:
                self._rows = {"train": train.to_list(), "test": test.to_list()}
            else:  # verifiers requires one of the two
                rows = (train if train is not None else test).to_list()  # pyright: ignore[reportOptionalMemberAccess]
                held = [
                    split_bucket(json.dumps(r["prompt"], sort_keys=True, default=str)) < self.test_fraction
                    for r in rows
                ]
                self._rows = {
                    "train": [r for r, h in zip(rows, held) if not h],
                    "test": [r for r, h in zip(rows, held) if h],
                }
        if split not in self._rows:
            raise ValueError(f"unknown split {split!r}: 'train' or 'test'")
        return self._rows[split]

    def tasks(self, split: str = "train", seed: int = 0) -> Iterator[Task]:
        rows = self.rows(split)
        tasks = [Task(id=f"{split}-{row.get('example_id', i)}", data=row) for i, row in enumerate(rows)]
        if split != "train":
            yield from tasks
            return
        if not tasks:
            raise ValueError(f"the verifiers environment {self.name!r} has no training rows")
        rng = random.Random(f"verifiers-{seed}")
        while True:
            order = list(range(len(tasks)))
            rng.shuffle(order)
            for i in order:
                yield tasks[i]

    def initial_messages(self, task: Task) -> list[Message]:
        prompt = task.data["prompt"]
        if not isinstance(prompt, list):
            raise ValueError("verifiers completion-style (string) prompts are not supported: chat prompts only")
        return [_agentrl_message(m) for m in prompt]

    def tools(self) -> list[Tool]:
        return list(self._tools)

    # the episode

    async def setup(self, task: Task) -> dict[str, Any]:
        return {"vf": await self._loop.run(self._init_state(task))}

    async def _init_state(self, task: Task) -> Any:
        import time

        import verifiers as vf

        if self._client is None:
            self._client = _NoModelClient.make()
        state = await self.vf_env.init_state(task.data, self._client, "agentrl", {})
        state["timing"].generation.start = state["timing"].setup.start = time.time()
        prompt = list(state["prompt"])
        try:
            state = await self.vf_env.setup_state(state) or state
        except vf.Error as e:
            raise RuntimeError(f"setup_state of {type(self.vf_env).__name__} failed: {type(e).__name__}: {e}") from e
        if list(state["prompt"]) != prompt:
            raise ValueError(
                f"{type(self.vf_env).__name__}.setup_state changed the prompt; agentrl opens with the row's"
            )
        if [t.name for t in state["tool_defs"]] != [t.name for t in self._tools]:
            raise ValueError("per-row tools (info['tool_defs']) are not supported: an agentrl env has one set of tools")
        state["timing"].setup.end = time.time()
        return state

    async def on_text_turn(self, task: Task, state: dict[str, Any], messages: list[Message]) -> str | None:
        return await self._loop.run(self._text_turn(state["vf"], messages))

    async def _text_turn(self, state: Any, messages: list[Message]) -> str | None:
        import verifiers as vf
        from verifiers.legacy.utils.message_utils import concat_messages, maybe_normalize_messages

        await self._add_steps(state, messages)
        if await self.vf_env.is_completed(state):
            return None
        last = state["trajectory"][-1]
        conversation = concat_messages([last["prompt"], last["completion"]])
        try:
            prompt = maybe_normalize_messages(
                await self.vf_env.get_prompt_messages(state), field_name="prompt_messages"
            )
        except vf.Error as e:  # as verifiers' rollout loop: the error ends the episode, which is scored
            state["error"] = e
            await self.vf_env.is_completed(state)
            return None
        if state.get("final_env_response") is not None:
            await self.vf_env.is_completed(state)
            return None
        return _user_reply(prompt, conversation, type(self.vf_env).__name__)

    async def _add_steps(self, state: Any, messages: list[Message]) -> None:
        """Append a trajectory step for each assistant turn of ``messages`` the state does not have yet."""
        from verifiers.legacy.types import TrajectoryStep

        prompt = list(state["prompt"])
        converted = prompt + self.vf_messages(messages[len(prompt) :])
        turns = [i for i, m in enumerate(converted) if m.role == "assistant" and i >= len(prompt)]
        for i in turns[len(state["trajectory"]) :]:
            step = TrajectoryStep(
                prompt=converted[:i],
                completion=[converted[i]],
                response=_response(converted[i]),
                tokens=None,
                reward=None,
                advantage=None,
                is_truncated=False,
                trajectory_id=state["trajectory_id"],
                extras={},
            )
            await self.vf_env.add_trajectory_step(state, step)

    def vf_messages(self, messages: list[Message]) -> list[Any]:
        """agentrl messages as verifiers messages: an assistant turn's tool calls (read with the episode's
        parser) become ``tool_calls`` with ids, and each tool result answers its call by id."""
        from verifiers.legacy.utils.message_utils import normalize_messages

        raw: list[dict[str, Any]] = []
        pending: list[str] = []
        for m in messages:
            if m["role"] == "assistant":
                raw.append(self._assistant(m, len(raw)))
                pending = [c["id"] for c in raw[-1].get("tool_calls", [])]
            elif m["role"] == "tool":  # results come first, in call order; then the parse errors (no name)
                call_id = pending.pop(0) if pending and "name" in m else "invalid_tool_call"
                raw.append({"role": "tool", "tool_call_id": call_id, "content": m["content"]})
            else:
                raw.append({"role": m["role"], "content": m["content"]})
        return normalize_messages(raw, field_name="messages")

    def _assistant(self, message: Message, index: int) -> dict[str, Any]:
        content = message.get("content") or ""
        calls = self.tool_parser.parse(without_reasoning(content)).calls
        for call in calls:
            content = content.replace(call.raw, "") if call.raw else content
        out: dict[str, Any] = {"role": "assistant", "content": content.strip() if calls else content}
        if calls:
            out["tool_calls"] = [
                {"id": f"call_{index}_{j}", "name": c.name, "arguments": json.dumps(c.arguments)}
                for j, c in enumerate(calls)
            ]
        return out

    # scoring and cleanup

    async def reward(self, task: Task, state: dict[str, Any], messages: list[Message]) -> dict[str, float]:
        return await self._loop.run(self._score(state, messages))

    async def _score(self, state: dict[str, Any], messages: list[Message]) -> dict[str, float]:
        vf_state = state["vf"]
        await self._add_steps(vf_state, messages)
        await self._finish(state)
        components: dict[str, float] = {}
        for rubric in _leaf_rubrics(self.vf_env.rubric):
            for name, value in (await _rubric_components(rubric, vf_state)).items():
                components[name] = components.get(name, 0.0) + value
        return components

    async def _finish(self, state: dict[str, Any]) -> None:
        """What verifiers does when a rollout ends: stop fields, then the env's cleanup handlers (they
        render ``state["completion"]``). Once per episode."""
        if not state.get("finished"):
            state["finished"] = True
            if not state["vf"].get("is_completed"):
                await self.vf_env.is_completed(state["vf"])
            await self.vf_env.cleanup(state["vf"])

    async def cleanup(self, task: Task, state: dict[str, Any]) -> None:
        if "vf" in state:
            await self._loop.run(self._cleanup(state))

    async def _cleanup(self, state: dict[str, Any]) -> None:
        await self._finish(state)
        await self.vf_env.rubric.cleanup(state["vf"])

    async def aclose(self) -> None:
        try:
            await self._loop.run(self.vf_env._teardown())
        finally:
            self._loop.close()

    # tools

    async def call_tool(self, state: dict[str, Any], name: str, arguments: dict[str, Any]) -> str:
        return await self._loop.run(self._call_tool(state.get("vf"), name, arguments))

    async def _call_tool(self, vf_state: Any, name: str, arguments: dict[str, Any]) -> str:
        import verifiers as vf

        env = self.vf_env
        if vf_state is not None and vf_state.get("error") is not None:
            raise ToolError(f"the episode has ended: {vf_state['error']}")
        try:
            message = await env.call_tool(name, arguments, f"call_{name}")
        except Exception as e:
            if vf_state is not None and env._should_stop_for_error(e):
                error = vf.ToolCallError()
                error.__cause__ = e
                vf_state["error"] = error
            raise ToolError(env.error_formatter(e)) from e
        return _text(message.content)


class _VerifiersTool(Tool):
    """A ``ToolEnv`` function, with the schema verifiers made for it, run by the env's ``call_tool``."""

    wants_state = True

    def __init__(self, owner: VerifiersEnv, tool_def: Any):
        self.owner = owner
        self.name = tool_def.name
        self.description = tool_def.description
        self.parameters = dict(tool_def.parameters)

    async def run(self, state: dict[str, Any] | None = None, **arguments: Any) -> str:
        return await self.owner.call_tool(state or {}, self.name, arguments)


async def _rubric_components(rubric: Any, state: Any) -> dict[str, float]:
    """``{name: weight * value}`` of the rubric's weighted reward functions, each called as verifiers'
    ``Rubric`` calls it (the arguments its signature names, from ``score_objects``), but raising: a
    function that raises fails the reward. A rubric that scores its own way gives its total."""
    from verifiers.legacy.rubrics.rubric import Rubric
    from verifiers.legacy.utils.async_utils import maybe_await

    if type(rubric).score_rollout is not Rubric.score_rollout:
        await rubric.score_rollout(state)
        return {type(rubric).__name__: float(state["reward"])}
    components: dict[str, float] = {}
    for func, weight in zip(rubric.funcs, rubric.weights):
        if not weight or rubric._is_group_func(func):
            continue  # a metric (weight 0) adds nothing to the reward
        name = getattr(func, "__name__", repr(func))
        params = inspect.signature(func).parameters
        objects = rubric.score_objects(state)
        if not any(p.kind == p.VAR_KEYWORD for p in params.values()):
            objects = {k: v for k, v in objects.items() if k in params}
        try:
            value = float(await maybe_await(func, **objects))
        except Exception as e:
            raise RuntimeError(f"verifiers reward function {name!r} raised {type(e).__name__}: {e}") from e
        components[name] = components.get(name, 0.0) + weight * value
    return components


def _user_reply(prompt: list[Any], conversation: list[Any], kind: str) -> str:
    """The one user message ``env_response`` appended to ``conversation``, as text."""
    if len(prompt) < len(conversation) or prompt[: len(conversation)] != conversation:
        raise ValueError(f"{kind}.get_prompt_messages rewrote the conversation; agentrl episodes only append to it")
    new = prompt[len(conversation) :]
    if len(new) != 1 or new[0].role != "user":
        roles = [m.role for m in new]
        raise ValueError(f"{kind}.env_response returned {roles}; agentrl takes exactly one user message per text turn")
    return _text(new[0].content)


def _text(content: Any) -> str:
    """Message content as text: text parts are joined; other parts (images, audio) are not supported."""
    if isinstance(content, str):
        return content
    parts = []
    for part in content or []:
        kind = part.get("type") if isinstance(part, dict) else getattr(part, "type", None)
        if kind != "text":
            raise ValueError(f"verifiers message content of type {kind!r} is not supported: text only")
        parts.append(part["text"] if isinstance(part, dict) else part.text)
    return "".join(parts)


def _agentrl_message(message: Any) -> Message:
    """A verifiers prompt message (a dict as the dataset stores it) as an agentrl message."""
    m = message if isinstance(message, dict) else message.model_dump()
    out: Message = {"role": m["role"], "content": _text(m.get("content")) if m.get("content") is not None else ""}
    calls = m.get("tool_calls")
    if calls:
        out["tool_calls"] = [_agentrl_call(c) for c in calls]
    if m["role"] == "tool" and m.get("name"):
        out["name"] = m["name"]
    return out


def _agentrl_call(call: dict[str, Any]) -> dict[str, Any]:
    function = call.get("function") or call
    arguments = function.get("arguments")
    return {
        "type": "function",
        "function": {
            "name": function["name"],
            "arguments": json.loads(arguments) if isinstance(arguments, str) else arguments,
        },
    }


def _response(message: Any) -> Any:
    """A verifiers ``Response`` for an assistant turn agentrl generated (tokens stay agentrl's)."""
    import time

    from verifiers.legacy.types import Response, ResponseMessage

    reply = ResponseMessage(
        content=message.content,
        tool_calls=message.tool_calls,
        finish_reason="tool_calls" if message.tool_calls else "stop",
        is_truncated=False,
    )
    return Response(id="agentrl", created=int(time.time()), model="agentrl", message=reply)

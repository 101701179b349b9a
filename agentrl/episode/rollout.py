"""The agent loop: one episode, one group of episodes, and greedy evaluation.

An episode alternates model turns and observations until it finishes:

1. **Model turn.** Ask the engine for at most ``min(max_new_tokens_per_turn, room left)``
   tokens, where the room left keeps space for the template to close the turn, so an episode
   never exceeds ``max_total_tokens``. The returned ids are appended exactly as generated, with
   their logprobs and the policy version the engine reports (see :mod:`agentrl.episode.chat`).
2. **Interruptions.** When a weight update pauses the engine with ``mode="abort"``, the request
   returns ``finish_reason.type == "abort"`` with its partial output. The loop keeps those tokens
   (with their logprobs and the old version) and asks again with the prompt extended by them,
   for the tokens still allowed: the turn continues under the new weights, and the per-token
   versions show where the policy changed. An episode survives any number of updates; only a run
   of aborts that return no tokens at all (the engine refusing the request) ends it as
   ``"aborted"``.
3. **Observation.** The turn's text is parsed for tool calls (Hermes ``<tool_call>`` by default,
   or ``env.tool_parser``). Calls are executed concurrently by the :class:`ToolBox` (time and
   output limits, errors as text) and each result becomes one ``tool`` message; a turn with
   only malformed calls gets the parse errors as ``tool`` messages so the model sees them; a
   turn without tool activity goes to ``env.on_text_turn`` (None ends the episode, a string is
   the next user message).

**Versions** (:func:`parse_weight_version`). An engine's ``weight_version`` is the learner's policy
version as a decimal string. SGLang started without ``--weight-version`` reports ``"default"``
until the learner sets a version (it does when it connects, before its first progress message).
A reply under ``"default"`` is not kept (no policy version produced it): the turn waits (logged
once per engine) and asks again, for at most ``EpisodeLimits.max_version_wait_s``, then the
episode fails with what to do. Any other version that is not an integer fails the episode at
once, naming the engine. Evaluation (``evaluate``) does not need versions and takes any. With
``learner.lora.sync = "adapter"`` a request names the adapter, which an engine at ``"default"``
may not hold yet (SGLang answers 400): such a refusal from an engine at ``"default"`` waits too.

Finish reasons: ``answer`` (the env accepted a text turn), ``max_turns``, ``context_full``
(no room for another turn or its observation; also a turn cut by the room left),
``truncated_tool_call`` (the per-turn token limit cut a ``<tool_call>`` open), ``aborted``.

Failures: a tool failure is an observation; a reward that raises, is not finite or exceeds
``learner.max_abs_reward`` in size scores the episode 0 with the error in
``metadata["reward_error"]`` (the learner drops any such reward that reaches it anyway). Anything else (engine unreachable after the client's
retries, an engine reply that breaks the protocol, an env whose ``setup``, ``initial_messages``
or ``on_text_turn`` raises, a template that does not write assistant content verbatim) raises
:class:`EpisodeFailed`;
:func:`run_group` then cancels the group's other episodes and reports the group as lost, never
silently.
"""

from __future__ import annotations

import logging
import math
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Protocol

import trio

from agentrl.envs.base import Env, Task, run_cleanup, score_episode
from agentrl.envs.rewards import without_reasoning
from agentrl.episode.chat import ChatCodec, Message, TokenChat, codec_for
from agentrl.protocol import Trajectory, TrajectoryGroup
from agentrl.tools.base import ToolBox, ToolCall, ToolResult
from agentrl.tools.parsing import HermesToolCallParser, ParsedTurn, ToolCallParser

log = logging.getLogger(__name__)

FINISH_REASONS = ("answer", "max_turns", "context_full", "truncated_tool_call", "aborted")
CLEANUP_TIMEOUT_S = 30.0


class GenerateResultLike(Protocol):
    output_ids: list[int]
    output_logprobs: list[float]
    finish_reason: dict
    weight_version: str
    meta_info: dict
    url: str  # the server that answered (named in errors)


class EngineClientLike(Protocol):
    """What the loop needs of :class:`agentrl.engine.client.EngineClient`."""

    async def generate(
        self,
        input_ids: list[int],
        sampling_params: dict,
        *,
        affinity_key: str | None = None,
        rid: str | None = None,
        return_logprob: bool = True,
    ) -> GenerateResultLike: ...


class EpisodeFailed(Exception):
    """The episode produced no usable trajectory (engine unreachable, protocol error, env bug)."""


UNSET_VERSION = "default"  # what SGLang reports before anybody set a weight version
_waiting_logged: set[str] = set()  # engines whose unset version was logged (once per process)


class VersionNotSet(Exception):
    """The engine reports ``"default"``: its weights have no policy version yet."""

    def __init__(self, url: str):
        super().__init__(url)
        self.url = url


def parse_weight_version(version: Any, url: str) -> int:
    """The policy version an engine reported; :class:`VersionNotSet` for SGLang's ``"default"``,
    :class:`EpisodeFailed` (naming the engine and the fix) for anything else that is not an integer."""
    try:
        return int(version)
    except (TypeError, ValueError):
        pass
    if version == UNSET_VERSION:
        raise VersionNotSet(url)
    raise EpisodeFailed(
        f"engine {url or '(unknown url)'} reports weight_version {version!r}, which is not a "
        "policy version (an integer): start it with --weight-version 0, or without --weight-version "
        "and let the learner set the version when it connects"
    )


async def _adapter_not_loaded_yet(client: Any, error: Exception) -> str:
    """The engine's URL when ``error`` is a 400 to a request naming the LoRA adapter
    (``learner.lora.sync = "adapter"``) from an engine that reports ``"default"``: a fresh or
    restarted engine the learner has not loaded the adapter into yet (it sets the version after
    loading it), so the turn waits as for ``"default"``; else ``""`` (the error stands)."""
    url = str(getattr(error, "url", ""))
    if getattr(error, "status", None) != 400 or not getattr(client, "lora_path", "") or not url:
        return ""
    try:
        versions = dict(zip([s.url for s in client.engines], await client.weight_versions()))
    except Exception:
        return ""
    mine = [v for u, v in versions.items() if url.startswith(u + "/")]  # the url is engine + path
    unset = UNSET_VERSION in (mine or list(versions.values()))  # behind a router: any engine
    return url.rsplit("/", 1)[0] if unset else ""


@dataclass(frozen=True)
class EpisodeLimits:
    max_turns: int = 4
    max_total_tokens: int = 1024
    max_new_tokens_per_turn: int = 128
    max_empty_aborts: int = 20  # aborts in a row that return no token before the episode gives up
    max_version_wait_s: float = 600.0  # how long a turn waits for an engine to leave weight_version "default"
    max_abs_reward: float = math.inf  # a larger reward is an env bug: scored 0 with reward_error

    @classmethod
    def from_config(cls, cfg: Any, env: Env | None = None, section: Any = None) -> EpisodeLimits:
        """The env section's limits (default: the run's only env), overridden by an env's own
        ``max_turns``/``max_total_tokens`` attributes when it sets them (not None; 0 is a value),
        and never above ``engine.max_context_tokens``."""
        from agentrl.envs import env_section

        env = env if env is not None else Env()
        section = env_section(cfg, section)
        turns = env.max_turns if env.max_turns is not None else section.max_turns
        tokens = env.max_total_tokens if env.max_total_tokens is not None else section.max_total_tokens
        return cls(
            max_turns=turns,
            max_total_tokens=min(tokens, cfg.engine.max_context_tokens),
            max_new_tokens_per_turn=cfg.actors.max_new_tokens_per_turn,
            max_abs_reward=cfg.learner.max_abs_reward,
        )


def sampling_from_config(cfg: Any, greedy: bool = False) -> dict[str, Any]:
    """SGLang sampling params from ``[actors]``; greedy is temperature 0."""
    if greedy:
        return {"temperature": 0.0}
    return {"temperature": cfg.actors.temperature, "top_p": cfg.actors.top_p, "top_k": cfg.actors.top_k}


def toolbox_for(env: Env, cfg: Any = None, section: Any = None) -> ToolBox:
    """The env's tools with its section's time and output limits (default: the run's only env;
    no limits without a config)."""
    if cfg is None and section is None:
        return ToolBox(env.tools())
    if section is None:
        from agentrl.envs import env_section

        section = env_section(cfg)
    return ToolBox(env.tools(), timeout_s=section.tool_timeout_s, max_output_chars=section.tool_max_output_chars)


@dataclass
class _Counters:
    num_turns: int = 0
    num_tool_calls: int = 0
    num_tool_errors: int = 0
    num_aborts: int = 0
    tool_latency_s: float = 0.0  # summed over calls
    tool_wall_s: float = 0.0  # wall time spent waiting for tools (calls of a turn overlap)
    generation_latency_s: float = 0.0  # wall time spent in /generate calls
    num_generate_calls: int = 0
    tool_faults: list[str] = field(default_factory=list)  # crashed or timed-out tool calls (their messages)
    abort_message: str = ""  # the engine's message of the last abort


class _Episode:
    """The mutable state of one running episode."""

    def __init__(
        self,
        client: EngineClientLike,
        codec: ChatCodec,
        env: Env,
        toolbox: ToolBox,
        task: Task,
        sampling: dict[str, Any],
        limits: EpisodeLimits,
        episode_id: str,
        versioned: bool = True,
    ):
        self.client, self.codec, self.env, self.toolbox, self.task = client, codec, env, toolbox, task
        self.versioned = versioned  # False (evaluation): any reported version is taken
        self.sampling = {k: v for k, v in sampling.items() if k != "max_new_tokens"}
        if codec.end_of_turn_id is not None:
            self.sampling.setdefault("stop_token_ids", [codec.end_of_turn_id])
        self.limits = limits
        self.id = episode_id
        self.parser: ToolCallParser = getattr(env, "tool_parser", None) or HermesToolCallParser()
        self.counters = _Counters()
        self.state: dict[str, Any] = {}
        self.chat: TokenChat | None = None

    async def play(self) -> str:
        """Run turns until the episode finishes; return the finish reason."""
        chat = self.chat
        assert chat is not None
        limits = self.limits
        # After an observation, leave room for one model token and the template's closing text.
        obs_limit = limits.max_total_tokens - self.codec.reserve_tokens - 1
        if len(chat) > obs_limit:
            raise EpisodeFailed(
                f"the prompt has {len(chat)} tokens and leaves no room for the model in "
                f"env.max_total_tokens={limits.max_total_tokens}"
            )
        while True:
            room = limits.max_total_tokens - len(chat) - self.codec.reserve_tokens
            budget = min(limits.max_new_tokens_per_turn, room)
            if budget < 1:
                return "context_full"
            stop = await self._model_turn(budget)
            self.counters.num_turns += 1
            if stop == "aborted":
                chat.close_turn_and_add([])
                return "aborted"
            # tool calls are read outside the reasoning, as SGLang separates reasoning first
            parsed = self.parser.parse(without_reasoning(chat.turn_content()))
            if stop == "length" and budget < limits.max_new_tokens_per_turn:
                chat.close_turn_and_add([])
                return "context_full"
            if stop == "length" and parsed.truncated:
                chat.close_turn_and_add([])
                return "truncated_tool_call"
            if parsed.has_tool_activity:
                if self.counters.num_turns >= limits.max_turns:
                    chat.close_turn_and_add([])
                    return "max_turns"
                observations = await self._run_tools(parsed)
            else:
                assistant = {"role": "assistant", "content": chat.turn_content()}
                reply = await self.env.on_text_turn(self.task, self.state, chat.messages + [assistant])
                if reply is None:
                    chat.close_turn_and_add([])
                    return "answer"
                if self.counters.num_turns >= limits.max_turns:
                    chat.close_turn_and_add([])
                    return "max_turns"
                observations = [{"role": "user", "content": str(reply)}]
            if not chat.close_turn_and_add(observations, max_len=obs_limit):
                return "context_full"

    async def _model_turn(self, budget: int) -> str:
        """Generate one model turn of at most ``budget`` tokens; 'stop', 'length' or 'aborted'."""
        chat = self.chat
        assert chat is not None
        remaining, empty_aborts, part = budget, 0, 0
        version_wait_started: float | None = None
        while True:
            params = {**self.sampling, "max_new_tokens": remaining}
            rid = f"{self.id}-{self.counters.num_turns}-{part}"
            part += 1
            start = time.monotonic()
            try:
                result = await self.client.generate(chat.tokens, params, affinity_key=self.id, rid=rid)
            except Exception as e:  # the client has already retried; trio.Cancelled is not an Exception
                unset = await _adapter_not_loaded_yet(self.client, e)
                if not unset:
                    raise EpisodeFailed(f"generate failed: {type(e).__name__}: {e}") from e
                if version_wait_started is None:
                    version_wait_started = time.monotonic()
                await self._wait_for_version(unset, time.monotonic() - version_wait_started)
                continue
            self.counters.generation_latency_s += time.monotonic() - start
            self.counters.num_generate_calls += 1
            try:
                ids, logprobs, versions, kind = _unpack(result, self.versioned)
            except VersionNotSet as e:  # the reply is dropped: no policy version produced it
                if version_wait_started is None:
                    version_wait_started = time.monotonic()
                await self._wait_for_version(e.url, time.monotonic() - version_wait_started)
                continue
            version_wait_started = None
            if len(ids) > remaining:
                raise EpisodeFailed(f"engine returned {len(ids)} tokens, {remaining} were asked for")
            chat.append_model(ids, logprobs, versions)
            remaining -= len(ids)
            if kind == "stop":
                return "stop"
            if kind == "length":
                return "length"
            # abort: keep the partial output and continue the same turn (likely under new weights)
            self.counters.num_aborts += 1
            self.counters.abort_message = str((result.finish_reason or {}).get("message", ""))
            if ids and self.codec.end_of_turn_id is not None and ids[-1] == self.codec.end_of_turn_id:
                return "stop"
            if remaining <= 0:
                return "length"
            if ids:
                empty_aborts = 0
                continue
            empty_aborts += 1
            if empty_aborts > self.limits.max_empty_aborts:
                return "aborted"
            await trio.sleep(min(1.0, 0.05 * empty_aborts))

    async def _wait_for_version(self, url: str, waited_s: float) -> None:
        if waited_s >= self.limits.max_version_wait_s:
            raise EpisodeFailed(
                f"engine {url} still reports weight_version {UNSET_VERSION!r} after {waited_s:.0f} s: no "
                "learner has set a policy version. Start the learner (it sets the version when it "
                "connects), or start the engine with --weight-version 0"
            )
        if url not in _waiting_logged:
            _waiting_logged.add(url)
            log.warning(
                "engine %s reports weight_version %r (no policy version yet): episodes wait for the learner "
                "to set it (it does when it connects); without a learner, start the engine with "
                "--weight-version 0",
                url,
                UNSET_VERSION,
            )
        await trio.sleep(min(2.0, 0.1 + 0.25 * waited_s))

    async def _run_tools(self, parsed: ParsedTurn) -> list[Message]:
        results: list[ToolResult | None] = [None] * len(parsed.calls)

        async def call(i: int, c: ToolCall) -> None:
            results[i] = await self.toolbox.execute(c, self.state)

        start = time.monotonic()
        if len(parsed.calls) == 1:
            await call(0, parsed.calls[0])
        elif parsed.calls:
            async with trio.open_nursery() as nursery:
                for i, c in enumerate(parsed.calls):
                    nursery.start_soon(call, i, c)
        self.counters.tool_wall_s += time.monotonic() - start
        messages: list[Message] = []
        for r in results:
            assert r is not None
            self.counters.num_tool_calls += 1
            self.counters.num_tool_errors += int(r.is_error)
            if r.tool_fault:
                self.counters.tool_faults.append(r.content)
            self.counters.tool_latency_s += r.latency_s
            messages.append({"role": "tool", "name": r.name, "content": r.content})
        for err in parsed.errors:
            self.counters.num_tool_errors += 1
            messages.append({"role": "tool", "content": err})
        return messages


# What is read here from SGLang's /generate meta_info beyond GenerateResult's fields
# (tests/test_engine_conformance.py: SGLang writes each there): the weight-version spans, each span's
# keys, and an abort's finish_reason (the reason goes into the counters).
META_INFO_FIELDS_READ = ("weight_versions",)
SPAN_FIELDS_READ = ("version", "start", "end")
ABORT_FIELDS_READ = ("type", "message")


def _unpack(result: GenerateResultLike, versioned: bool = True) -> tuple[list[int], list[float], list[int], str]:
    """Validate an engine reply; return (ids, logprobs, versions per token, finish type).
    Unversioned (evaluation): any version is taken (-1 for tokens under one that is not a number)."""
    ids = [int(i) for i in result.output_ids]
    logprobs = [0.0 if lp is None else float(lp) for lp in (result.output_logprobs or [])]
    if len(logprobs) != len(ids):
        raise EpisodeFailed(f"engine returned {len(ids)} output ids but {len(logprobs)} logprobs (return_logprob?)")
    kind = (result.finish_reason or {}).get("type")
    if kind not in ("stop", "length", "abort"):
        raise EpisodeFailed(f"engine returned an unknown finish_reason {result.finish_reason!r}")
    if not versioned:
        try:
            version = int(result.weight_version)
        except (TypeError, ValueError):
            version = -1
        return ids, logprobs, [version] * len(ids), kind
    versions = [parse_weight_version(result.weight_version, result.url)] * len(ids)
    # SGLang reports spans when the weights changed during one request (pause mode in_place).
    spans = (result.meta_info or {}).get("weight_versions")
    if isinstance(spans, list) and len(spans) > 1:
        try:
            for span in spans:
                v = parse_weight_version(span["version"], result.url)
                for i in range(max(0, int(span["start"])), min(len(ids), int(span["end"]))):
                    versions[i] = v
        except (KeyError, TypeError, ValueError):
            raise EpisodeFailed(f"engine {result.url} returned malformed weight_versions spans {spans!r}") from None
    return ids, logprobs, versions, kind


async def run_episode(
    client: EngineClientLike,
    tokenizer: Any,
    env: Env,
    toolbox: ToolBox,
    task: Task,
    sampling: dict[str, Any],
    limits: EpisodeLimits,
    *,
    episode_id: str | None = None,
    extra_metadata: dict[str, Any] | None = None,
    versioned: bool = True,
) -> Trajectory:
    """Play one episode of ``task`` and score it; raises :class:`EpisodeFailed` when it cannot.
    ``versioned=False`` (evaluation) takes any weight_version (``"default"`` included)."""
    codec = codec_for(tokenizer)
    ep = _Episode(client, codec, env, toolbox, task, sampling, limits, episode_id or uuid.uuid4().hex[:12], versioned)
    start = time.monotonic()
    try:
        ep.state = await env.setup(task)
    except Exception as e:
        raise EpisodeFailed(f"{type(env).__name__}.setup raised {type(e).__name__}: {e}") from e
    try:
        try:
            ep.chat = TokenChat.start(codec, env.initial_messages(task), toolbox.schemas())
            finish = await ep.play()
        except EpisodeFailed:
            raise
        except Exception as e:  # an env or template bug ends this episode, not the actor
            log.warning("episode %s crashed", ep.id, exc_info=True)
            raise EpisodeFailed(f"episode crashed: {type(e).__name__}: {e}") from e
        reward, components, reward_error = await score_episode(
            env, task, ep.state, ep.chat.messages, max_abs_reward=limits.max_abs_reward
        )
    finally:
        cleanup_error = await run_cleanup(env, task, ep.state, CLEANUP_TIMEOUT_S) or ""
        if cleanup_error:  # a leaking env is logged, the episode still counts
            log.warning("%s", cleanup_error)
    chat, c = ep.chat, ep.counters
    metadata: dict[str, Any] = {
        "env": env.name,
        "task_id": task.id,
        "episode_id": ep.id,
        "finish_reason": finish,
        "num_turns": c.num_turns,
        "num_tool_calls": c.num_tool_calls,
        "num_tool_errors": c.num_tool_errors,
        "num_aborts": c.num_aborts,
        "num_generate_calls": c.num_generate_calls,
        "tool_latency_s": c.tool_latency_s,
        "tool_wall_s": c.tool_wall_s,
        "generation_latency_s": c.generation_latency_s,
        "episode_wall_s": time.monotonic() - start,
        "num_model_tokens": chat.loss_mask.count(1),
        "messages": chat.messages,
    }
    if reward_error:
        metadata["reward_error"] = reward_error
    if c.tool_faults:
        metadata["num_tool_faults"] = len(c.tool_faults)
        metadata["tool_fault_messages"] = c.tool_faults[:3]
    if finish == "aborted":
        metadata["abort_message"] = c.abort_message
    if cleanup_error:
        metadata["cleanup_error"] = cleanup_error
    metadata.update(extra_metadata or {})
    return Trajectory(
        tokens=chat.tokens,
        loss_mask=chat.loss_mask,
        behavior_logprobs=chat.logprobs,
        weight_versions=chat.versions,
        reward=reward,
        reward_components=components,
        metadata=metadata,
    )


class GroupLost(Exception):
    """A group could not be completed; ``reason`` says why (the first failed episode's error)."""


async def run_group(
    client: EngineClientLike,
    tokenizer: Any,
    env: Env,
    toolbox: ToolBox,
    task: Task,
    sampling: dict[str, Any],
    limits: EpisodeLimits,
    n: int,
    *,
    group_id: str | None = None,
    actor_id: str = "",
    extra_metadata: dict[str, Any] | None = None,
) -> TrajectoryGroup:
    """Run the ``n`` samples of ``task`` concurrently and return them as one group.

    If any episode fails, the others are cancelled (their work is useless to GRPO) and
    :class:`GroupLost` is raised with the failure.
    """
    gid = group_id or uuid.uuid4().hex[:12]
    trajectories: list[Trajectory | None] = [None] * n
    failure: list[str] = []

    async def one(i: int, cancel: trio.CancelScope) -> None:
        try:
            trajectories[i] = await run_episode(
                client,
                tokenizer,
                env,
                toolbox,
                task,
                sampling,
                limits,
                episode_id=f"{gid}-{i}",
                extra_metadata=extra_metadata,
            )
        except EpisodeFailed as e:
            failure.append(str(e))
            cancel.cancel()

    async with trio.open_nursery() as nursery:
        for i in range(n):
            nursery.start_soon(one, i, nursery.cancel_scope)
    if failure:
        raise GroupLost(failure[0])
    return TrajectoryGroup(
        group_id=gid,
        task_id=task.id,
        env=env.name,
        trajectories=[t for t in trajectories if t is not None],
        actor_id=actor_id,
        created_at=time.time(),
    )


async def evaluate(
    client: EngineClientLike,
    tokenizer: Any,
    env: Env,
    tasks: list[Task],
    greedy: bool = True,
    concurrency: int = 64,
    *,
    toolbox: ToolBox | None = None,
    limits: EpisodeLimits | None = None,
    sampling: dict[str, Any] | None = None,
    agents: Any = None,
) -> dict[str, Any]:
    """Play one episode per task and report ``success_rate`` and ``reward_mean`` over the episodes
    that completed (``n``); episodes that failed (engine unreachable...) are counted in ``n_failed``
    and left out of the rates, so an outage does not read as a bad policy. An
    :class:`agentrl.agents.AgentEnv` is played by its agent through ``agents`` (an entered
    :class:`agentrl.agents.agent_runner.AgentRunner` that samples as the evaluation asks); its finish
    reason is the limit it reached, else its last call's.

    What went wrong without failing an episode is counted too, because it silently lowers the
    rates: episodes the engine ``aborted`` (they score like a wrong answer), episodes whose
    reward raised (scored 0) and tool calls that crashed or timed out. ``problems`` holds each
    kind's count and first messages; :func:`describe_problems` says it in words.
    """
    from agentrl.envs.agent import AgentEnv

    if isinstance(env, AgentEnv) and agents is None:
        raise ValueError(f"{type(env).__name__} is an AgentEnv: evaluating it needs an AgentRunner (agents=...)")
    toolbox = toolbox or toolbox_for(env)
    limits = limits or EpisodeLimits()
    sampling = dict(sampling or {})
    if greedy:
        sampling["temperature"] = 0.0
    limiter = trio.CapacityLimiter(max(1, concurrency))
    rewards: list[float] = []
    successes: list[bool] = []
    finish: dict[str, int] = {}
    problems = {kind: _Problem() for kind in PROBLEM_KINDS}
    by_group: dict[str, list[bool]] = {}

    async def play(task: Task) -> tuple[float, dict[str, Any]]:
        if isinstance(env, AgentEnv):
            sequences = await agents.play(env, task, limits=limits)
            meta = dict(sequences[-1].metadata)
            meta["finish_reason"] = meta.get("episode_limit") or meta.get("finish_reason", "?")
            return sequences[0].reward, meta
        traj = await run_episode(client, tokenizer, env, toolbox, task, sampling, limits, versioned=False)
        return traj.reward, traj.metadata

    async def one(task: Task) -> None:
        async with limiter:
            try:
                reward, meta = await play(task)
            except EpisodeFailed as e:
                problems["failed"].add(str(e))
                return
        rewards.append(reward)
        successes.append(bool(env.is_success(task, reward)))
        group = env.eval_group(task)
        if group is not None:
            by_group.setdefault(group, []).append(successes[-1])
        finish[meta["finish_reason"]] = finish.get(meta["finish_reason"], 0) + 1
        if meta["finish_reason"] == "aborted":
            problems["aborted"].add(meta.get("abort_message") or "aborted by the engine")
        if meta.get("reward_error"):
            problems["reward_errors"].add(meta["reward_error"])
        for message in meta.get("tool_fault_messages", []):
            problems["tool_faults"].add(message)
        problems["tool_faults"].count += max(
            0, meta.get("num_tool_faults", 0) - len(meta.get("tool_fault_messages", []))
        )

    async with trio.open_nursery() as nursery:
        for task in tasks:
            nursery.start_soon(one, task)
    n = len(rewards)
    return {
        "n": n,
        "n_failed": problems["failed"].count,
        "n_aborted": problems["aborted"].count,
        "n_reward_errors": problems["reward_errors"].count,
        "n_tool_faults": problems["tool_faults"].count,
        "success_rate": sum(successes) / n if n else 0.0,
        "reward_mean": sum(rewards) / n if n else 0.0,
        "success_by_group": {g: sum(v) / len(v) for g, v in sorted(by_group.items())},
        "finish_reasons": finish,
        "errors": problems["failed"].first,
        "problems": {kind: p.as_dict() for kind, p in problems.items() if p.count},
    }


def combine_evaluations(by_env: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """One evaluation of several envs: counts summed, rates over all their episodes (each env's
    result under ``by_env``). ``success_by_group`` keeps one env's labels as they are and prefixes
    them with the env's name when there are several."""
    n = sum(r["n"] for r in by_env.values())
    out: dict[str, Any] = {
        key: sum(r[key] for r in by_env.values())
        for key in ("n", "n_failed", "n_aborted", "n_reward_errors", "n_tool_faults")
    }
    out["success_rate"] = sum(r["success_rate"] * r["n"] for r in by_env.values()) / n if n else 0.0
    out["reward_mean"] = sum(r["reward_mean"] * r["n"] for r in by_env.values()) / n if n else 0.0
    several = len(by_env) > 1
    out["success_by_group"] = {
        (f"{env}/{g}" if several else g): rate for env, r in by_env.items() for g, rate in r["success_by_group"].items()
    }
    finish: dict[str, int] = {}
    problems: dict[str, _Problem] = {}
    for r in by_env.values():
        for reason, count in r["finish_reasons"].items():
            finish[reason] = finish.get(reason, 0) + count
        for kind, p in r["problems"].items():
            merged = problems.setdefault(kind, _Problem())
            merged.count += p["count"]
            merged.first += [m for m in p["first"] if m not in merged.first][: 3 - len(merged.first)]
    out["finish_reasons"] = finish
    out["errors"] = problems["failed"].first if "failed" in problems else []
    out["problems"] = {kind: p.as_dict() for kind, p in problems.items()}
    out["by_env"] = by_env
    return out


# what an evaluation counts besides success, and how it is said in words
PROBLEM_KINDS = {
    "failed": "episodes failed (no trajectory; left out of the rates)",
    "aborted": "episodes were aborted by the engine (scored as played)",
    "reward_errors": "episodes' rewards raised (scored 0)",
    "tool_faults": "tool calls crashed or timed out (to answer with an error on purpose, a tool raises ToolError)",
}


@dataclass
class _Problem:
    count: int = 0
    first: list[str] = field(default_factory=list)

    def add(self, message: str) -> None:
        self.count += 1
        if len(self.first) < 3 and message not in self.first:
            self.first.append(message)

    def as_dict(self) -> dict[str, Any]:
        return {"count": self.count, "first": self.first}


def describe_problems(result: dict[str, Any]) -> list[str]:
    """One plain line per kind of problem an evaluation met (none when it met none)."""
    total = result.get("n", 0) + result.get("n_failed", 0)
    lines = []
    for kind, words in PROBLEM_KINDS.items():
        problem = (result.get("problems") or {}).get(kind)
        if problem:
            of = f" of {total}" if kind != "tool_faults" else ""
            lines.append(f"{problem['count']}{of} {words}; first: {' | '.join(problem['first'])}")
    return lines

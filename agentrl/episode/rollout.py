"""The agent loop: one episode against an engine and an ``Env``, and one group of episodes (docs/episode.md).

An episode alternates model turns and observations until it finishes:

1. **Model turn** (:func:`agentrl.episode.turn.generate_turn`). Ask the engine for at most
   ``min(max_new_tokens_per_turn, room left)`` tokens, where the room left keeps space for the template
   to close the turn, so an episode never exceeds ``max_total_tokens``. Weight updates that abort the
   request are survived (the turn continues under the new weights); an engine still at SGLang's
   ``"default"`` version is waited for, logged once per engine. Only a run of aborts that return no
   tokens at all ends the episode as ``"aborted"``.
2. **Observation.** The turn's text is parsed for tool calls (Hermes ``<tool_call>`` by default, or
   ``env.tool_parser``). Calls are executed concurrently by the :class:`ToolBox` (time and output
   limits, errors as text) and each result becomes one ``tool`` message; a turn with only malformed
   calls gets the parse errors as ``tool`` messages; a turn without tool activity goes to
   ``env.on_text_turn`` (None ends the episode, a string is the next user message).

Finish reasons: ``answer`` (the env accepted a text turn), ``max_turns``, ``context_full`` (no room
for another turn or its observation; also a turn cut by the room left), ``truncated_tool_call`` (the
per-turn token limit cut a ``<tool_call>`` open), ``aborted``.

Failures: a tool failure is an observation; a reward that raises, is not finite or exceeds
``learner.max_abs_reward`` in size scores the episode 0 with ``metadata["reward_error"]``. Anything
else (engine unreachable after the client's retries, a reply that breaks the protocol, an env whose
``setup``, ``initial_messages`` or ``on_text_turn`` raises, a template that does not write assistant
content verbatim) raises :class:`~agentrl.episode.turn.EpisodeFailed`; :func:`run_group` then cancels
the group's other episodes and raises :class:`~agentrl.episode.turn.GroupLost`, never silently.
"""

from __future__ import annotations

import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import trio

from agentrl.envs.base import Env, Task, run_cleanup, score_episode
from agentrl.envs.rewards import without_reasoning
from agentrl.episode.chat import ChatCodec, Message, TokenChat, codec_for
from agentrl.episode.group import play_episodes
from agentrl.episode.turn import (
    UNSET_VERSION,
    EngineClientLike,
    EpisodeFailed,
    EpisodeLimits,
    TurnOptions,
    generate_turn,
)
from agentrl.protocol import Trajectory, TrajectoryGroup
from agentrl.tools.base import ToolBox, ToolCall, ToolResult
from agentrl.tools.parsing import HermesToolCallParser, ParsedTurn, ToolCallParser

log = logging.getLogger(__name__)

FINISH_REASONS = ("answer", "max_turns", "context_full", "truncated_tool_call", "aborted")
CLEANUP_TIMEOUT_S = 30.0
_waiting_logged: set[str] = set()  # engines whose unset version was logged (once per process)


def _log_version_wait(url: str) -> None:
    """Say once per engine that episodes wait for its policy version."""
    if url in _waiting_logged:
        return
    _waiting_logged.add(url)
    log.warning(
        "engine %s reports weight_version %r (no policy version yet): episodes wait for the learner "
        "to set it (it does when it connects); without a learner, start the engine with "
        "--weight-version 0",
        url,
        UNSET_VERSION,
    )


def sampling_from_config(cfg: Any, greedy: bool = False) -> dict[str, Any]:
    """SGLang sampling params from ``[actors]``; greedy is temperature 0."""
    if greedy:
        return {"temperature": 0.0}
    return {"temperature": cfg.actors.temperature, "top_p": cfg.actors.top_p, "top_k": cfg.actors.top_k}


def toolbox_for(env: Env, cfg: Any = None, section: Any = None) -> ToolBox:
    """The env's tools with its section's time and output limits (default: the run's only env;
    no limits without a config)."""
    if section is None:
        if cfg is None:
            return ToolBox(env.tools())
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
        self.sampling = {k: v for k, v in sampling.items() if k != "max_new_tokens"}
        if codec.end_of_turn_id is not None:
            self.sampling.setdefault("stop_token_ids", [codec.end_of_turn_id])
        self.limits = limits
        self.turn_options = TurnOptions(
            versioned=versioned,  # False (evaluation): any reported version is taken
            max_empty_aborts=limits.max_empty_aborts,
            max_version_wait_s=limits.max_version_wait_s,
            on_version_wait=_log_version_wait,
        )
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
        assert self.chat is not None
        c = self.counters
        turn = await generate_turn(
            self.client,
            self.chat,
            self.sampling,
            budget,
            affinity_key=self.id,
            rid_prefix=f"{self.id}-{c.num_turns}",
            options=self.turn_options,
        )
        c.generation_latency_s += turn.generation_latency_s
        c.num_generate_calls += turn.num_generate_calls
        c.num_aborts += turn.num_aborts
        if turn.num_aborts:
            c.abort_message = turn.abort_message
        return "aborted" if turn.kind == "abort" else turn.kind

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
                self.counters.tool_faults.append(str(r.content))  # a fault is always a text error
            self.counters.tool_latency_s += r.latency_s
            messages.append({"role": "tool", "name": r.name, "content": r.content})
        for err in parsed.errors:
            self.counters.num_tool_errors += 1
            messages.append({"role": "tool", "content": err})
        return messages


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
        "max_total_tokens": limits.max_total_tokens,
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
        tokens=np.asarray(chat.tokens, dtype=np.int32),
        loss_mask=np.asarray(chat.loss_mask, dtype=np.uint8),
        behavior_logprobs=np.asarray(chat.logprobs, dtype=np.float32),
        weight_versions=np.asarray(chat.versions, dtype=np.int32),
        reward=reward,
        reward_components=components,
        metadata=metadata,
        images=list(chat.images),
    )


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

    async def one(i: int) -> Trajectory:
        return await run_episode(
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

    trajectories = await play_episodes(n, one)
    return TrajectoryGroup(
        group_id=gid,
        task_id=task.id,
        env=env.name,
        trajectories=trajectories,
        actor_id=actor_id,
        created_at=time.time(),
    )

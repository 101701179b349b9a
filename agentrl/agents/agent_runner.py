"""Playing :class:`agentrl.envs.agent.AgentEnv` episodes from trio: one asyncio thread per actor process.

The actors run on trio; agent code written for the OpenAI SDK, the OpenAI Agents SDK or LangChain is
asyncio code. :class:`AgentRunner` owns **one asyncio event loop in a worker thread**, and in that loop:
the agent endpoint (:mod:`agentrl.agents.endpoint`) served by uvicorn on a loopback socket, an engine
client (:class:`agentrl.engine.client.EngineClient`) and every episode's agent code. So an agent's call
crosses no thread until it reaches the engines, all recording state is owned by that loop (no locks),
and the endpoint is real HTTP (any client works, in a subprocess or not in Python). Trio sees only
whole episodes: :meth:`AgentRunner.play` submits one coroutine to the loop and a done-callback wakes
trio (no thread held per episode). See docs/agents.md.

**Cancellation.** When trio cancels :meth:`AgentRunner.play`, the episode's asyncio task is cancelled
(generations still running are aborted at the engine) and trio waits, shielded, up to
``cancel_grace_s`` for its cleanup. An agent that swallows the cancellation is left behind (logged);
its key is closed, so it cannot write into any episode.

**Failures.** An agent (or ``setup``) that raises -- ``SystemExit`` included -- fails its episode with
:class:`agentrl.episode.turn.EpisodeFailed` naming the error; so does an agent that returns without
having called the model. A group is lost as a whole (:func:`agentrl.episode.group.play_episodes`).

**Limits.** ``play`` takes the env's :class:`agentrl.episode.turn.EpisodeLimits`: the endpoint refuses
a call past ``max_turns`` calls, or one whose prompt leaves no room in ``max_total_tokens``
(:mod:`agentrl.agents.recording`). An agent that raises after such a refusal has not failed: the
episode ended at its limit and is scored as played -- by ``env.reward`` of the last call's conversation
when the env has one, else 0 -- with ``metadata["episode_limit"]``. A reward that raises or is not
finite scores 0 with ``reward_error``. ``cleanup`` always runs, bounded by ``cleanup_timeout_s``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import math
import socket
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

import trio

from agentrl.agents.chat_service import ChatService
from agentrl.agents.endpoint import AgentEndpoint
from agentrl.envs.agent import AgentEnv
from agentrl.envs.base import Env, Task, score_episode, total_reward
from agentrl.episode.chat import ChatCodec
from agentrl.episode.group import play_episodes
from agentrl.episode.turn import EpisodeFailed, EpisodeLimits
from agentrl.protocol import Trajectory, TrajectoryGroup

log = logging.getLogger(__name__)
_URL_LOGGERS = ("httpx", "httpx2")  # the HTTP clients of openai 1.x/2.x and 3.x


class AgentRunner:
    """The asyncio side of one actor process (see the module docstring). Use from trio::

        async with AgentRunner(tokenizer, lambda: EngineClient(urls)) as runner:
            trajectories = await runner.play(env, task)      # one list per episode

    ``engine`` builds the engine client inside the asyncio thread (an httpx client belongs to the loop
    that made it); it must be an async context manager with ``generate`` (``EngineClient``).
    ``versioned``/``forced_sampling``/``default_max_tokens``/``max_tokens_cap``: see
    :class:`agentrl.agents.chat_service.ChatService` (training: versions on, the run's sampling forced). How an
    episode's completions are read (tool-call format, reasoning) is its env's: ``env.tool_parser`` and
    ``env.reasoning`` (:class:`agentrl.envs.agent.AgentEnv`).
    """

    def __init__(
        self,
        tokenizer: Any,
        engine: Callable[[], Any],
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        model_name: str = "agentrl",
        max_model_len: int | None = None,
        versioned: bool = True,
        forced_sampling: dict | None = None,
        default_max_tokens: int | None = None,
        max_tokens_cap: int | None = None,
        client_timeout_s: float = 600.0,
        client_max_retries: int = 2,
        cancel_grace_s: float = 10.0,
        cleanup_timeout_s: float = 30.0,
    ):
        self.codec = ChatCodec(tokenizer)  # its own: the endpoint's thread renders with it
        self._engine_factory = engine
        self._host, self._port = host, port
        self._service_kwargs: dict[str, Any] = {
            "model_name": model_name,
            "max_model_len": max_model_len,
            "versioned": versioned,
            "forced_sampling": forced_sampling,
            "default_max_tokens": default_max_tokens,
            "max_tokens_cap": max_tokens_cap,
        }
        self.client_timeout_s, self.client_max_retries = client_timeout_s, client_max_retries
        self.cancel_grace_s, self.cleanup_timeout_s = cancel_grace_s, cleanup_timeout_s
        self.url = ""
        self.endpoint: AgentEndpoint | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._started: concurrent.futures.Future = concurrent.futures.Future()
        self._stop: asyncio.Event | None = None
        self._episodes: set[asyncio.Task] = set()  # running episode tasks (owned by the loop)
        self._ssl: Any = None

    # -- lifecycle (trio) ---------------------------------------------------------------------
    async def __aenter__(self) -> AgentRunner:
        for name in _URL_LOGGERS:  # their per-request INFO lines would log the episode keys in the URLs
            logger = logging.getLogger(name)
            if logger.getEffectiveLevel() < logging.WARNING:
                logger.setLevel(logging.WARNING)
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((self._host, self._port))
        sock.listen(1024)
        self.url = f"http://{self._host}:{sock.getsockname()[1]}"
        self._thread = threading.Thread(target=self._main, args=(sock,), name="agentrl-agents", daemon=True)
        self._thread.start()
        try:
            await trio.to_thread.run_sync(self._started.result)
        except BaseException:
            await self.__aexit__(None, None, None)
            raise
        return self

    async def __aexit__(self, *exc: Any) -> None:
        if self._loop is not None and self._stop is not None and not self._loop.is_closed():
            with contextlib.suppress(RuntimeError):  # the loop already stopped
                self._loop.call_soon_threadsafe(self._stop.set)
        if self._thread is not None:
            with trio.CancelScope(shield=True):
                await trio.to_thread.run_sync(self._thread.join, 30.0)
            self._thread = None

    def _main(self, sock: socket.socket) -> None:
        loop = asyncio.new_event_loop()
        asyncio.set_event_loop(loop)
        self._loop = loop
        try:
            loop.run_until_complete(self._serve(sock))
        except BaseException as e:
            if not self._started.done():
                self._started.set_exception(e)
            else:
                log.exception("the agent endpoint's event loop failed")
        finally:
            with contextlib.suppress(Exception):
                loop.run_until_complete(loop.shutdown_asyncgens())
            loop.close()
            sock.close()

    async def _serve(self, sock: socket.socket) -> None:
        import ssl

        import uvicorn

        try:
            import openai  # noqa: F401 - imported once here (about a second), not in the first episode
        except ImportError as e:
            raise RuntimeError("AgentEnv episodes need the openai package: pip install 'agentrl[agents]'") from e
        # Every client's HTTP pool builds an SSL context (40 ms of CPU each) even for http://: build it once.
        self._ssl = ssl.create_default_context()
        self._stop = asyncio.Event()
        async with self._engine_factory() as engine:
            service = ChatService(self.codec, engine, continue_aborts=True, **self._service_kwargs)
            self.endpoint = AgentEndpoint(service)
            config = uvicorn.Config(
                self.endpoint.app,
                log_level="warning",
                access_log=False,
                lifespan="off",
                timeout_keep_alive=60,
                timeout_graceful_shutdown=5,
            )
            server = uvicorn.Server(config)
            serving = asyncio.ensure_future(server.serve(sockets=[sock]))
            self._started.set_result(None)  # the socket already listens: calls queue until uvicorn accepts
            stop = asyncio.ensure_future(self._stop.wait())
            await asyncio.wait({serving, stop}, return_when=asyncio.FIRST_COMPLETED)
            server.should_exit = True
            await serving
            stop.cancel()
            left = list(self._episodes)
            for task in left:  # episodes still running when the runner closes (their trio side is gone)
                task.cancel()
            if left:
                await asyncio.wait(left, timeout=self.cancel_grace_s)

    # -- episodes (trio) ----------------------------------------------------------------------
    async def play(
        self,
        env: AgentEnv,
        task: Task,
        *,
        episode_id: str | None = None,
        extra_metadata: dict[str, Any] | None = None,
        limits: EpisodeLimits | None = None,
    ) -> list[Trajectory]:
        """Play one episode of ``env`` on ``task``; its sequences as trajectories (each with the episode's
        reward). ``limits``: the env's ``max_turns`` (calls to the model), ``max_total_tokens`` (per
        sequence) and ``max_abs_reward`` (module docstring, "Limits"). Raises :class:`EpisodeFailed` when
        the agent fails."""
        if not isinstance(env, AgentEnv):
            raise TypeError(f"{type(env).__name__} is not an AgentEnv")
        episode_id = episode_id or uuid.uuid4().hex[:12]
        return await self._run_in_loop(self._episode(env, task, episode_id, extra_metadata or {}, limits))

    async def play_group(
        self,
        env: AgentEnv,
        task: Task,
        n: int,
        *,
        group_id: str | None = None,
        actor_id: str = "",
        extra_metadata: dict[str, Any] | None = None,
        limits: EpisodeLimits | None = None,
    ) -> TrajectoryGroup:
        """The ``n`` episodes of ``task``, concurrently (episode ids ``<group_id>-<i>``), as one group: every
        sequence of every episode, in episode order. When one episode fails the others are cancelled and
        :class:`agentrl.episode.turn.GroupLost` says why (:func:`agentrl.episode.group.play_episodes`).
        The learner's advantages are per episode (:func:`agentrl.learner.batching.episode_index`)."""
        gid = group_id or uuid.uuid4().hex[:12]

        async def one(i: int) -> list[Trajectory]:
            return await self.play(env, task, episode_id=f"{gid}-{i}", extra_metadata=extra_metadata, limits=limits)

        episodes = await play_episodes(n, one)
        return TrajectoryGroup(
            group_id=gid,
            task_id=task.id,
            env=env.name,
            trajectories=[t for episode in episodes for t in episode],
            actor_id=actor_id,
            created_at=time.time(),
        )

    async def _run_in_loop(self, coro: Any) -> Any:
        loop = self._loop
        if loop is None or loop.is_closed():
            coro.close()
            raise EpisodeFailed("the agent runner is not running")
        token = trio.lowlevel.current_trio_token()
        done = trio.Event()
        holder: dict[str, asyncio.Task] = {}

        def wake(_: asyncio.Task) -> None:
            with contextlib.suppress(trio.RunFinishedError):
                token.run_sync_soon(done.set)

        def start() -> None:
            holder["task"] = task = loop.create_task(coro)
            self._episodes.add(task)
            task.add_done_callback(self._episodes.discard)
            task.add_done_callback(wake)

        try:
            loop.call_soon_threadsafe(start)
        except RuntimeError as e:  # closed between the check and the call
            coro.close()
            raise EpisodeFailed("the agent runner is not running") from e
        try:
            await done.wait()
        except trio.Cancelled:
            loop.call_soon_threadsafe(lambda: holder["task"].cancel())
            with trio.CancelScope(shield=True), trio.move_on_after(self.cancel_grace_s):
                await done.wait()
            if not done.is_set():
                log.warning("an agent did not stop within %.0f s of its cancellation; left behind", self.cancel_grace_s)
            raise
        task = holder["task"]
        if task.cancelled():
            raise EpisodeFailed("the agent's asyncio task was cancelled from inside the agent, not by agentrl")
        error = task.exception()
        if isinstance(error, EpisodeFailed):
            raise error
        if error is not None:
            raise EpisodeFailed(f"the episode crashed: {type(error).__name__}: {error}") from error
        return task.result()

    async def _episode(
        self, env: AgentEnv, task: Task, episode_id: str, extra: dict[str, Any], limits: EpisodeLimits | None
    ) -> list[Trajectory]:
        """One episode, in the asyncio loop."""
        import openai

        endpoint = self.endpoint
        assert endpoint is not None
        start = time.monotonic()
        key, episode = endpoint.open_episode(
            episode_id,
            max_calls=limits.max_turns if limits else None,
            max_len=limits.max_total_tokens if limits else None,
            tool_parser=getattr(env, "tool_parser", None),
            reasoning=bool(getattr(env, "reasoning", False)),
        )
        client = openai.AsyncOpenAI(
            base_url=f"{self.url}/episodes/{key}/v1",
            api_key=key,
            timeout=self.client_timeout_s,
            max_retries=self.client_max_retries,
            http_client=openai.DefaultAsyncHttpxClient(verify=self._ssl),
        )
        state: dict[str, Any] = {}
        try:
            try:
                state = await env.setup(task)
            except Exception as e:
                raise EpisodeFailed(f"{type(env).__name__}.setup raised {type(e).__name__}: {e}") from e
            try:
                value = await env.run(task, client)
            except asyncio.CancelledError:
                raise
            except BaseException as e:
                if not (episode.limit and episode.sequences):
                    log.info("agent of episode %s raised", episode_id, exc_info=True)
                    raise EpisodeFailed(f"the agent ({type(env).__name__}.run) raised {type(e).__name__}: {e}") from e
                value = _LIMIT_REACHED  # the agent gave up at the env's limit: the episode is scored as played
            endpoint.close_episode(key)
            if not episode.sequences:
                raise EpisodeFailed(
                    f"the agent ({type(env).__name__}.run) returned without a completed call to the "
                    "model: nothing to train on"
                )
            max_abs = limits.max_abs_reward if limits else math.inf
            reward, components, reward_error = await _score(env, task, state, episode, value, max_abs)
            metadata: dict[str, Any] = {
                "env": env.name,
                "task_id": task.id,
                "episode_wall_s": time.monotonic() - start,
                "new_sequence_reasons": dict(episode.new_sequence_reasons),
                "num_stitched_calls": episode.num_stitched,
            }
            if episode.limit:
                metadata["episode_limit"] = episode.limit
            if reward_error:
                metadata["reward_error"] = reward_error
            metadata.update(extra)
            return episode.trajectories(reward, components, metadata)
        finally:
            endpoint.close_episode(key)
            with contextlib.suppress(Exception):
                await client.close()
            try:
                await asyncio.wait_for(env.cleanup(task, state), self.cleanup_timeout_s)
            except Exception as e:
                log.warning("cleanup of %s failed: %s: %s", type(env).__name__, type(e).__name__, e)


_LIMIT_REACHED = object()  # run() raised after the episode reached a limit


async def _score(
    env: AgentEnv, task: Task, state: dict, episode: Any, value: Any, max_abs_reward: float = math.inf
) -> tuple[float, dict[str, float], str | None]:
    """The agent's own reward, or ``env.reward`` of the last call's conversation when it returned None.
    An agent that raised at a limit is scored by ``env.reward`` when the env has one, else 0."""
    if value is _LIMIT_REACHED:
        if type(env).reward is Env.reward:
            return 0.0, {}, None
        value = None
    if value is None:
        return await score_episode(env, task, state, episode.final_messages(), max_abs_reward=max_abs_reward)
    try:
        total, components = total_reward(value)
    except (TypeError, ValueError, AttributeError) as e:
        return 0.0, {}, f"{type(env).__name__}.run returned {value!r}, not a reward (a number or named numbers): {e}"
    if not all(math.isfinite(r) for r in (total, *components.values())):
        return 0.0, {}, f"{type(env).__name__}.run returned a reward that is not finite: {value!r}"
    if not all(abs(r) <= max_abs_reward for r in (total, *components.values())):
        return (
            0.0,
            {},
            (f"{type(env).__name__}.run returned a reward beyond learner.max_abs_reward={max_abs_reward:g}: {value!r}"),
        )
    return total, components, None


async def play_agent_episode(
    env: AgentEnv, task: Task, tokenizer: Any, engine: Callable[[], Any], **runner_kwargs: Any
) -> list[Trajectory]:
    """One episode with an endpoint of its own (started and stopped around it): for scripts and checks.
    An actor process keeps one :class:`AgentRunner` for all its episodes instead."""
    async with AgentRunner(tokenizer, engine, **runner_kwargs) as runner:
        return await runner.play(env, task)

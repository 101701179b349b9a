"""``agentrl serve-actors``: build the parts of one actor process from the config and run it.

The engine client (``EngineClient.from_config``: keys, retries, health checks, the served
LoRA adapter) and the ZMQ channels of ``agentrl.transport`` (with the run's CURVE security) are
the real ones; tests of the logic above them use ``ActorService`` with in-memory channels.

Every env of the config (``[env]``, or each ``[[envs]]`` entry) is built with its section's
tools and limits. When one is an :class:`agentrl.agents.AgentEnv`, the process also runs one
:class:`agentrl.agents.agent_runner.AgentRunner` (the agent endpoint and its asyncio thread) for all
its agent episodes, with the run's sampling forced (the learner trains on
``actors.temperature``), ``actors.max_new_tokens_per_turn`` as every call's default and cap,
and its own client of the same engines. Each episode's completions are read as its env says
(``env.tool_parser``, ``env.reasoning``). With a judge model (``[judge]``), the process opens one
:class:`agentrl.engine.judge.EngineJudge` on ``judge.urls`` and the actor hands it to the envs that
declare a ``judge``. See docs/run.md.
"""

from __future__ import annotations

import json
import logging
import sys
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any

import trio

from agentrl.actors.actor import ActorEnv, ActorService, ActorSettings
from agentrl.agents.agent_runner import AgentRunner
from agentrl.config import AgentRLConfig
from agentrl.engine.client import EngineClient
from agentrl.engine.judge import EngineJudge
from agentrl.envs import make_envs
from agentrl.envs.agent import AgentEnv
from agentrl.episode.rollout import sampling_from_config, toolbox_for
from agentrl.episode.turn import EpisodeLimits
from agentrl.transport import GroupSender, ProgressSubscriber, security_from_config

log = logging.getLogger("agentrl.actors")


def engine_urls(cfg: AgentRLConfig) -> list[str]:
    """``engine.urls``, or the URLs ``agentrl run`` gives the engines it starts itself."""
    if cfg.engine.urls:
        return list(cfg.engine.urls)
    return [f"http://{cfg.engine.host}:{cfg.engine.base_port + i}" for i in range(cfg.engine.num_engines)]


def build_judge(cfg: AgentRLConfig) -> EngineJudge | None:
    """The judge of ``[judge]`` (its tokenizer loaded), not yet entered; None without a judge model."""
    if not cfg.judge.enabled:
        return None
    if not cfg.judge.urls:
        raise ValueError(
            "judge.model_path is set but judge.urls is empty: `agentrl run` starts the judge engines and fills "
            "it in; actors started on their own need the running judge engines' urls"
        )
    return EngineJudge.from_config(cfg.judge)


def build_actor_envs(cfg: AgentRLConfig) -> list[Any]:
    """Every env of the config as an :class:`agentrl.actors.actor.ActorEnv` (tools, limits, weight)."""
    return [
        ActorEnv(env, toolbox_for(env, cfg, section), EpisodeLimits.from_config(cfg, env, section), section.weight)
        for section, env in make_envs(cfg)
    ]


def agent_runner(
    cfg: AgentRLConfig, tokenizer: Any, client_factory: Any, *, evaluation: bool = False, greedy: bool = False
) -> AgentRunner:
    """The process's :class:`agentrl.agents.agent_runner.AgentRunner` for ``cfg``: training (versions on, the
    run's sampling forced) or ``evaluation`` (any version; temperature 0 when ``greedy``)."""
    return AgentRunner(
        tokenizer,
        client_factory,
        versioned=not evaluation,
        forced_sampling=sampling_from_config(cfg, greedy=greedy),
        default_max_tokens=cfg.actors.max_new_tokens_per_turn,
        max_tokens_cap=cfg.actors.max_new_tokens_per_turn,
        max_model_len=cfg.engine.max_context_tokens,
    )


def serve_actors(
    cfg: AgentRLConfig,
    *,
    dump_path: Path | None = None,
    max_groups: int | None = None,
    index: int = 0,
    num_actors: int | None = None,
    send: bool = True,
    wait_for_learner: bool = False,
    start_gate: Path | None = None,
    split: str = "train",
    log_interval_s: float = 30.0,
) -> int:
    """Run one actor process until it stops; print the report as JSON; return the exit code."""
    if not send and dump_path is None:
        raise ValueError("--no-send without --dump-trajectories would throw every group away")
    if not (Path(cfg.model.path) / "tokenizer_config.json").exists():
        raise ValueError(f"no tokenizer at model.path={cfg.model.path!r} (tokenizer_config.json missing)")
    if dump_path is not None:
        Path(dump_path).parent.mkdir(parents=True, exist_ok=True)

    from transformers import AutoTokenizer

    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for noisy in ("httpx", "httpx2", "httpcore"):  # one line per request otherwise
        logging.getLogger(noisy).setLevel(logging.WARNING)
    num_actors = num_actors or cfg.actors.num_processes
    settings = ActorSettings(
        group_size=cfg.actors.group_size,
        num_concurrent_episodes=cfg.actors.num_concurrent_episodes,
        actor_index=index,
        num_actors=num_actors,
        actor_id=f"actor{index}",
        max_groups=max_groups,
        max_unacked_groups=cfg.actors.max_unacked_groups,
        wait_for_learner=wait_for_learner,
        start_gate=start_gate,
        split=split,
        seed=cfg.run.seed,
        max_staleness=cfg.actors.max_staleness,
        log_interval_s=log_interval_s,
    )
    tokenizer = AutoTokenizer.from_pretrained(cfg.model.path)
    judge = build_judge(cfg)
    envs = build_actor_envs(cfg)

    def new_client() -> Any:
        return EngineClient.from_config(cfg.engine, urls=engine_urls(cfg), lora_path=cfg.learner.lora.served_adapter)

    async def main() -> dict[str, Any]:
        sender = progress = None
        try:
            if send:
                security = security_from_config(cfg.actors)
                sender = GroupSender(
                    cfg.actors.trajectory_endpoint, max_queued_groups=cfg.actors.send_queue_groups, security=security
                )
                progress = ProgressSubscriber(cfg.actors.progress_endpoint, security=security)
            async with AsyncExitStack() as stack:
                client = await stack.enter_async_context(new_client())
                if judge is not None:
                    await stack.enter_async_context(judge)
                agents = None
                if any(isinstance(e.env, AgentEnv) for e in envs):  # its own engine client, in its own thread
                    agents = await stack.enter_async_context(agent_runner(cfg, tokenizer, new_client))
                service = ActorService(
                    client=client,
                    tokenizer=tokenizer,
                    envs=envs,
                    agents=agents,
                    sampling=sampling_from_config(cfg),
                    settings=settings,
                    sender=sender,
                    progress=progress,
                    dump_path=dump_path,
                    judge=judge,
                )
                log.info(
                    "actor %s: %d engine(s), %d groups of %d open at most, env(s) %s, split %s",
                    settings.actor_id,
                    len(engine_urls(cfg)),
                    settings.max_open_groups,
                    settings.group_size,
                    ", ".join(f"{e.name} (weight {e.weight:g})" for e in envs),
                    split,
                )
                if judge is not None:
                    log.info(
                        "judge %s at %s for env(s) %s",
                        cfg.judge.model_path,
                        ", ".join(cfg.judge.urls),
                        ", ".join(service.judged) or "none (no env declares a judge)",
                    )
                return await service.run(handle_signals=True)
        finally:
            with trio.CancelScope(shield=True), trio.move_on_after(10):
                # env.aclose: process-wide resources (sandbox pools)
                for closable in (sender, progress, *(e.env for e in envs)):
                    if closable is not None:
                        await closable.aclose()

    report = trio.run(main)
    print(json.dumps(report), flush=True)
    log.info(
        "actor %s stopped (%s): delivered %d groups (%d acknowledged, %d resent), lost %d, abandoned %d groups "
        "(%d episodes), unsent %d",
        settings.actor_id,
        report["stop_reason"],
        report["groups_delivered"],
        report["groups_acked"],
        report["groups_resent"],
        report["groups_lost"],
        report["groups_abandoned"],
        report["episodes_abandoned"],
        report["groups_unsent"],
    )
    return 1 if report["failed"] else 0

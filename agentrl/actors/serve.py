"""``agentrl serve-actors``: build the parts of one actor process from the config and run it.

The engine client and the transport are looked up by import path (defaults: the project's
``agentrl.engine.client:EngineClient`` and ``agentrl.transport``) so that tests and users can
plug in their own implementations of the same interfaces.
"""

from __future__ import annotations

import importlib
import json
import logging
import sys
from pathlib import Path
from typing import Any

log = logging.getLogger("agentrl.actors")


def engine_urls(cfg: Any) -> list[str]:
    """``engine.urls``, or the URLs ``agentrl run`` gives the engines it starts itself."""
    if cfg.engine.urls:
        return list(cfg.engine.urls)
    return [f"http://{cfg.engine.host}:{cfg.engine.base_port + i}" for i in range(cfg.engine.num_engines)]


def import_object(path: str) -> Any:
    """``"module:attr"`` -> the attribute, ``"module"`` -> the module; errors name the path."""
    module_name, _, attr = path.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(f"cannot import {module_name!r}: {e}") from e
    if not attr:
        return module
    try:
        return getattr(module, attr)
    except AttributeError:
        raise ValueError(f"module {module_name!r} has no attribute {attr!r}") from None


def build_env(cfg: Any) -> Any:
    """The configured env: ``agentrl.envs.make_env(cfg)`` where the envs package provides it (it
    passes the ``[sandbox]`` section to envs that take one), else ``load_env(env.cls, env.kwargs)``."""
    import agentrl.envs
    from agentrl.envs.base import load_env

    make_env = getattr(agentrl.envs, "make_env", None)
    return make_env(cfg) if make_env is not None else load_env(cfg.env.cls, cfg.env.kwargs)


def serve_actors(cfg: Any, *, dump_path: Path | None = None, max_groups: int | None = None, index: int = 0,
                 num_actors: int | None = None, send: bool = True, wait_for_learner: bool = False,
                 split: str = "train", log_interval_s: float = 30.0,
                 engine_client: str = "agentrl.engine.client:EngineClient",
                 transport: str = "agentrl.transport") -> int:
    """Run one actor process until it stops; print the report as JSON; return the exit code."""
    if not send and dump_path is None:
        raise ValueError("--no-send without --dump-trajectories would throw every group away")
    if not (Path(cfg.model.path) / "tokenizer_config.json").exists():
        raise ValueError(f"no tokenizer at model.path={cfg.model.path!r} (tokenizer_config.json missing)")

    import trio
    from transformers import AutoTokenizer

    from agentrl.actors.rollout import EpisodeLimits, sampling_from_config, toolbox_for
    from agentrl.actors.service import ActorService, ActorSettings

    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for noisy in ("httpx", "httpcore"):  # one line per request otherwise
        logging.getLogger(noisy).setLevel(logging.WARNING)
    num_actors = num_actors or cfg.actors.num_processes
    settings = ActorSettings(
        group_size=cfg.actors.group_size, num_concurrent_episodes=cfg.actors.num_concurrent_episodes,
        actor_index=index, num_actors=num_actors, actor_id=f"actor{index}", max_groups=max_groups,
        max_unacked_groups=cfg.actors.max_unacked_groups,
        wait_for_learner=wait_for_learner, split=split, seed=cfg.run.seed, max_staleness=cfg.actors.max_staleness,
        log_interval_s=log_interval_s,
    )
    tokenizer = AutoTokenizer.from_pretrained(cfg.model.path)
    env = build_env(cfg)
    toolbox = toolbox_for(env, cfg)
    client_cls = import_object(engine_client)
    transport_mod = import_object(transport) if send else None

    async def main() -> dict[str, Any]:
        client = client_cls(engine_urls(cfg), router_url=cfg.engine.router_url,
                            max_retries=cfg.engine.request_retries,
                            health_check_interval_s=cfg.engine.health_check_interval_s,
                            lora_path=cfg.learner.lora.served_adapter)
        sender = progress = None
        try:
            if transport_mod is not None:
                security = transport_mod.security_from_config(cfg.actors)
                sender = transport_mod.GroupSender(cfg.actors.trajectory_endpoint,
                                                   max_queued_groups=cfg.actors.send_queue_groups, security=security)
                progress = transport_mod.ProgressSubscriber(cfg.actors.progress_endpoint, security=security)
            async with client:
                service = ActorService(client=client, tokenizer=tokenizer, env=env, toolbox=toolbox,
                                       sampling=sampling_from_config(cfg), limits=EpisodeLimits.from_config(cfg, env),
                                       settings=settings, sender=sender, progress=progress, dump_path=dump_path)
                log.info("actor %s: %d engine(s), %d groups of %d open at most, env %s, split %s",
                         settings.actor_id, len(engine_urls(cfg)), settings.max_open_groups, settings.group_size,
                         env.name, split)
                return await service.run(handle_signals=True)
        finally:
            with trio.CancelScope(shield=True), trio.move_on_after(10):
                for closable in (sender, progress, env):  # env.aclose: process-wide resources (sandbox pools)
                    if getattr(closable, "aclose", None) is not None:
                        await closable.aclose()

    report = trio.run(main)
    print(json.dumps(report), flush=True)
    log.info("actor %s stopped (%s): delivered %d groups (%d acknowledged, %d resent), lost %d, abandoned %d groups "
             "(%d episodes), unsent %d", settings.actor_id, report["stop_reason"], report["groups_delivered"],
             report["groups_acked"], report["groups_resent"], report["groups_lost"],
             report["groups_abandoned"], report["episodes_abandoned"], report["groups_unsent"])
    return 1 if report["failed"] else 0

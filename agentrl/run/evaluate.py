"""``agentrl eval CONFIG [--checkpoint PATH]``: success and reward on held-out tasks, per env.

The policy is ``model.path``, or a learner checkpoint exported to a temporary Hugging Face
folder first. Episodes are played exactly as in training (same agent loop, tools and
limits) through the engines in ``engine.urls``, or through one embedded engine started for
the evaluation and stopped afterwards. Greedy by default (temperature 0); ``--sampled``
uses ``actors.temperature``. Every env of the config is evaluated on ``eval.num_tasks`` tasks
(each env's result under ``by_env``, the rates over all episodes at the top; an AgentEnv is
played by its agent through an agent endpoint). The result is printed on stdout as JSON (no
file is written) and, when tracking is enabled, logged to a new MLflow run (or
``tracking.run_id``) as ``eval/*`` metrics (``eval/env/<name>/*`` per env) and as the artifact
``eval.json`` (the printed result).

An evaluation also counts what went wrong without failing an episode -- episodes the engine
aborted, rewards that raised, tool calls that crashed or timed out -- with the first messages
of each (``problems``; the counts also as ``eval/n_aborted``, ``eval/n_reward_errors`` and
``eval/n_tool_faults``), and the command says them in words on stderr: such failures lower
the success rate exactly like a bad policy would, so they must never pass unseen.
With a judge model (``[judge]``) the envs that declare a ``judge`` get one, on ``judge.urls`` or on a
judge engine started for the evaluation; its counts are the result's ``judge``. See docs/run.md.
"""

from __future__ import annotations

import contextlib
import itertools
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import trio

from agentrl.actors.actor import hand_judge
from agentrl.config import LORA_ADAPTER_NAME, AgentRLConfig
from agentrl.engine.client import EngineClient
from agentrl.engine.judge import EngineJudge, judge_engine_args
from agentrl.engine.launch import EngineProcess, engine_args
from agentrl.envs import make_envs
from agentrl.envs.agent import AgentEnv
from agentrl.episode.evaluation import combine_evaluations, evaluate
from agentrl.episode.rollout import sampling_from_config, toolbox_for
from agentrl.episode.turn import EpisodeLimits
from agentrl.learner.batching import metric_name
from agentrl.learner.weight_push import WeightUpdateError, WeightUpdater
from agentrl.models.builder import ensure_model
from agentrl.net import free_port
from agentrl.run.actor_process import agent_runner
from agentrl.secrets import bearer, read_secret
from agentrl.tracking import open_tracker


def evaluate_command(
    cfg: AgentRLConfig, *, checkpoint: Path | None = None, num_tasks: int | None = None, greedy: bool = True
) -> dict[str, Any]:
    """``agentrl eval``: the policy (``model.path`` or an exported checkpoint) evaluated on the engines of
    ``engine.urls``, or on one embedded engine started for it; logged to MLflow when tracking is on."""
    with tempfile.TemporaryDirectory(prefix="agentrl-eval-") as tmp:
        model_path = cfg.model.path
        if checkpoint is not None:
            from agentrl.learner.export import export_checkpoint

            model_path = str(export_checkpoint(checkpoint, Path(tmp) / "model"))
        else:
            ensure_model(model_path, cfg.model.init_size, seed=cfg.run.seed)
        data = cfg.model_dump()
        data["model"]["path"] = model_path
        data["eval"]["greedy"] = greedy
        engine = judge_engine = None
        if cfg.judge.enabled and not cfg.judge.urls:
            judge_engine = _start_judge_engine(cfg, Path(tmp))
            data["judge"]["urls"] = [judge_engine.url]
        if not cfg.engine.urls:
            extra = engine_args(
                "embedded",
                device=cfg.engine.device,
                dtype=cfg.model.dtype,
                max_running_requests=cfg.engine.max_running_requests,
                max_context_tokens=cfg.engine.max_context_tokens,
                num_threads=cfg.run.torch_num_threads,
                api_key_env=cfg.engine.api_key_env,
                admin_api_key_env=cfg.engine.admin_api_key_env,
            )
            engine = EngineProcess(
                model_path,
                free_port(cfg.engine.host),
                host=cfg.engine.host,
                extra=extra,
                log_path=Path(tmp) / "engine.log",
            ).start()
            data["engine"]["urls"] = [engine.url]
        try:
            eval_cfg = AgentRLConfig.model_validate(data)
            # an exported checkpoint (LoRA merged) or model.path is served as the engine's own weights
            name_adapter = checkpoint is None and bool(cfg.engine.urls)
            result = trio.run(lambda: evaluate_policy(eval_cfg, num_tasks, name_adapter=name_adapter))
        finally:
            for process in (engine, judge_engine):
                if process is not None:
                    process.stop()
    result["policy"] = str(checkpoint or cfg.model.path)
    _log(cfg, result)
    return result


def _start_judge_engine(cfg: AgentRLConfig, tmp: Path) -> EngineProcess:
    """One judge engine of ``[judge]`` for ``agentrl eval`` (on the CPU unless judge.device says cuda)."""
    j = cfg.judge
    extra = judge_engine_args(j, on_cpu=j.device == "cpu", num_threads=cfg.run.torch_num_threads)
    return EngineProcess(
        j.model_path,
        free_port(j.host),
        backend=j.backend,
        host=j.host,
        extra=extra,
        log_path=tmp / "judge.log",
        python=j.sglang_python or cfg.engine.sglang_python,
    ).start()


def load_policy_into_engines(cfg: AgentRLConfig, version: int = 0) -> None:
    """Every engine in ``engine.urls`` loads the policy ``model.path`` from disk and reports
    ``version``: pause, ``/update_weights_from_disk`` (SGLang's ``UpdateWeightFromDiskReqInput``:
    ``model_path``, ``weight_version``, ``flush_cache``), continue. ``agentrl run`` calls it for
    engines it did not start, before the evaluation before RL: their weights are unknown (an earlier
    run may have left its policy under any version number, even ``"0"``), so every one of them
    loads this run's policy, whatever it reports. With ``learner.lora.sync = "adapter"`` the
    adapter is unloaded first (the embedded engine merges it into the weights every request runs
    on; the learner loads its own). Raises ``WeightUpdateError`` naming the engine and the fix."""
    with WeightUpdater.from_config(cfg.engine) as updater:
        if cfg.learner.lora.served_adapter:
            updater.unload_adapter_everywhere(LORA_ADAPTER_NAME)
        try:
            updater.push_from_disk(cfg.model.path, version)
        except WeightUpdateError as e:
            raise WeightUpdateError(
                f"the engines in engine.urls must hold this run's policy before the evaluation before RL, and "
                f"loading {cfg.model.path} failed ({e}): the folder must be readable at that path by every engine "
                "(the same machine, or a shared file system)",
                e.status,
            ) from None


def _log(cfg: AgentRLConfig, result: dict[str, Any]) -> None:
    if not cfg.tracking.enabled:
        return
    run_dir = Path(cfg.run.run_dir or "runs/eval")
    tracker = open_tracker(
        cfg.tracking, run_dir, run_name=f"eval-{cfg.run.name}", resume_run_id=cfg.tracking.run_id or None
    )
    try:
        tracker.log_params({"eval.policy": result["policy"], "eval.greedy": result["greedy"]})
        tracker.log_metrics(eval_metrics(result, "eval"), step=0)
        tracker.log_json(result, "eval.json")  # what was printed: the problems' first messages included
    finally:
        tracker.close()


def eval_metrics(result: dict[str, Any], prefix: str) -> dict[str, float]:
    """An evaluation's numbers as MLflow metrics under ``prefix/``: rates, counts of problems and
    success per eval group, and the same per env under ``prefix/env/<name>/``."""
    metrics = {f"{prefix}/success_rate": result["success_rate"], f"{prefix}/reward_mean": result["reward_mean"]}
    for key in ("n", "n_failed", "n_aborted", "n_reward_errors", "n_tool_faults"):
        metrics[f"{prefix}/{key}"] = float(result.get(key, 0))
    for group, rate in (result.get("success_by_group") or {}).items():
        metrics[f"{prefix}/success/{metric_name(group)}"] = rate
    for env, sub in (result.get("by_env") or {}).items():
        metrics.update(eval_metrics(sub, f"{prefix}/env/{metric_name(env)}"))
    return metrics


async def newest_policy_engines(cfg: AgentRLConfig) -> tuple[int | None, list[str]]:
    """The highest policy version an engine in ``engine.urls`` reports, and the engines that report
    it. An engine that does not answer, or was restarted and holds no policy yet (``"default"``),
    is left out, so an evaluation never mixes in the warm start."""
    headers = bearer(read_secret(cfg.engine.api_key_env))
    versions: dict[str, int] = {}
    async with httpx.AsyncClient(timeout=10.0, headers=headers) as http:
        for url in cfg.engine.urls:
            try:
                versions[url] = int((await http.get(f"{url.rstrip('/')}/model_info")).json()["weight_version"])
            except (httpx.HTTPError, ValueError, KeyError, TypeError):
                continue
    newest = max(versions.values(), default=None)
    return newest, [u for u, v in versions.items() if v == newest]


async def evaluate_policy(
    cfg: AgentRLConfig, num_tasks: int | None = None, *, urls: list[str] | None = None, name_adapter: bool = True
) -> dict[str, Any]:
    """Greedy (or sampled) episodes on held-out tasks of every env through ``urls`` (default:
    ``engine.urls``): ``eval.num_tasks`` tasks per env, each env's result under ``by_env`` and the
    rates over all of them at the top (:func:`agentrl.episode.evaluation.combine_evaluations`). An
    AgentEnv is played by its agent through an agent endpoint opened for the evaluation.
    ``name_adapter``: with ``learner.lora.sync = "adapter"``, every request names the learner's
    adapter; False when the engines serve the policy as their own weights (before the learner has
    loaded the adapter: the base model is the policy at version 0, the adapters start at B = 0)."""
    from transformers import AutoTokenizer

    envs = make_envs(cfg)
    tokenizer = await trio.to_thread.run_sync(AutoTokenizer.from_pretrained, cfg.model.path)
    judge = None
    if cfg.judge.enabled:
        judge = await trio.to_thread.run_sync(lambda: EngineJudge.from_config(cfg.judge))
    sampling = sampling_from_config(cfg, greedy=cfg.eval.greedy)
    sampling["max_new_tokens"] = cfg.actors.max_new_tokens_per_turn

    lora_path = cfg.learner.lora.served_adapter if name_adapter else ""

    def new_client() -> EngineClient:
        return EngineClient.from_config(cfg.engine, urls=list(urls or cfg.engine.urls), lora_path=lora_path)

    by_env: dict[str, dict[str, Any]] = {}
    started = time.monotonic()
    try:
        async with contextlib.AsyncExitStack() as stack:
            client = await stack.enter_async_context(new_client())
            if judge is not None:
                await stack.enter_async_context(judge)
            hand_judge([env for _, env in envs], judge)
            agents = None
            if any(isinstance(env, AgentEnv) for _, env in envs):
                agents = await stack.enter_async_context(
                    agent_runner(cfg, tokenizer, new_client, evaluation=True, greedy=cfg.eval.greedy)
                )
            for section, env in envs:
                tasks = list(
                    itertools.islice(env.tasks(cfg.eval.split, seed=cfg.run.seed), num_tasks or cfg.eval.num_tasks)
                )
                env_started = time.monotonic()
                result = await evaluate(
                    client,
                    tokenizer,
                    env,
                    tasks,
                    greedy=cfg.eval.greedy,
                    concurrency=cfg.actors.num_concurrent_episodes,
                    toolbox=toolbox_for(env, cfg, section),
                    limits=EpisodeLimits.from_config(cfg, env, section),
                    sampling=sampling,
                    agents=agents,
                )
                result["seconds"] = round(time.monotonic() - env_started, 2)
                by_env[env.name] = result
    finally:
        with trio.CancelScope(shield=True):
            for _, env in envs:
                with contextlib.suppress(Exception):
                    await env.aclose()
    result = combine_evaluations(by_env)
    result["seconds"] = round(time.monotonic() - started, 2)
    result["greedy"] = cfg.eval.greedy
    if judge is not None:
        result["judge"] = judge.stats.summary()
    return result

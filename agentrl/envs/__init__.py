"""Environments: the :class:`Env` API, built-in envs and helpers to build them from a config.

:func:`make_env` builds the env of one env section (``cls`` with ``kwargs``; an env whose
constructor takes ``sandbox`` receives the ``[sandbox]`` section, updated by ``kwargs.sandbox``;
the section's ``name`` becomes the env's). :func:`make_envs` builds every env of a run and refuses
two with the same name, since groups, metrics and evaluations are keyed by it.
:func:`demonstrations` yields correct episodes for SFT; :func:`score_episode` and
:func:`run_cleanup` call ``reward`` and ``cleanup`` so that neither can crash an actor.

Built-in envs (``env.cls``): ``agentrl.envs.calculator:CalculatorEnv``,
``agentrl.envs.search_qa:SearchQAEnv``, ``agentrl.envs.code:CodeEnv``,
``agentrl.envs.reasoning_gym:ReasoningGymEnv``, ``agentrl.envs.judged:JudgedCalculatorEnv`` and
``agentrl.envs.verifiers_env:VerifiersEnv`` (verifiers environments). See docs/envs.md.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from agentrl.envs.base import Env, Message, Task, load_env, run_cleanup, score_episode, total_reward

if TYPE_CHECKING:
    from agentrl.config import AgentRLConfig, EnvSection

__all__ = [
    "Env",
    "Message",
    "Task",
    "check_env_names",
    "demonstrated",
    "demonstrations",
    "env_section",
    "load_env",
    "make_env",
    "make_envs",
    "run_cleanup",
    "score_episode",
    "total_reward",
]


from agentrl.envs.base import _import_module_or_file


def env_section(cfg: AgentRLConfig, section: EnvSection | None = None) -> EnvSection:
    """``section``, or the run's only env section; a config with ``[[envs]]`` must say which."""
    if section is not None:
        return section
    if cfg.env is None:
        raise ValueError(f"this config has {len(cfg.envs)} [[envs]] entries: name the env section to use")
    return cfg.env


def make_env(cfg: AgentRLConfig, section: EnvSection | None = None) -> Env:
    """Instantiate an env section's env (default: the run's only one), passing the sandbox
    settings to envs that take them."""
    section = env_section(cfg, section)
    kwargs = dict(section.kwargs)
    if isinstance(kwargs.get("sandbox"), dict):  # kwargs.sandbox refines the [sandbox] section
        kwargs["sandbox"] = {**cfg.sandbox.model_dump(), **kwargs["sandbox"]}
    elif "sandbox" not in kwargs and ":" in section.cls:
        module_name, cls_name = section.cls.rsplit(":", 1)
        try:
            cls = getattr(_import_module_or_file(module_name), cls_name, None)
        except ValueError:
            cls = None  # load_env reports it with a clear message
        if isinstance(cls, type) and "sandbox" in inspect.signature(cls.__init__).parameters:
            kwargs["sandbox"] = cfg.sandbox.model_dump()
    env = load_env(section.cls, kwargs)
    if section.name:
        env.name = section.name
    return env


def make_envs(cfg: AgentRLConfig) -> list[tuple[EnvSection, Env]]:
    """Every env of the run with its section, in config order; two envs with one name are an error."""
    built: list[tuple[EnvSection, Env]] = []
    try:
        for section in cfg.env_sections:
            built.append((section, make_env(cfg, section)))
        check_env_names([(s.cls, env.name) for s, env in built])
    except BaseException:
        for _, env in built:
            close_quietly(env)
        raise
    return built


def check_env_names(envs: list[tuple[str, str]]) -> None:
    """(class path, name) of a run's envs: a ValueError naming the envs that share a name."""
    seen: dict[str, list[str]] = {}
    for cls, name in envs:
        seen.setdefault(name, []).append(cls)
    twice = {name: classes for name, classes in seen.items() if len(classes) > 1}
    if twice:
        which = "; ".join(f"{name!r}: {', '.join(classes)}" for name, classes in twice.items())
        raise ValueError(
            f"env names must be unique in a run (groups, metrics and evaluations are keyed by them), "
            f"but several envs are named {which}: give each [[envs]] entry its own `name`"
        )


def close_quietly(env: Env) -> None:
    """``env.aclose()`` outside any event loop, for envs built and not used (errors ignored)."""
    import trio

    try:
        trio.run(env.aclose)
    except Exception:
        pass


def demonstrations(
    env: Env, num: int, seed: int = 0, split: str = "train", max_tasks: int | None = None
) -> Iterator[dict[str, Any]]:
    """Up to ``num`` records ``{"task_id", "messages", "tools"}`` of correct episodes.

    Tasks the env does not demonstrate (``demonstration`` returns None, e.g. questions
    harder than the calculator's ``demo_max_ops``) are skipped; at most ``max_tasks``
    (default ``100 * num``) tasks are looked at.
    """
    for _, record in demonstrated(env, num, seed, split, max_tasks):
        yield record


def demonstrated(
    env: Env, num: int, seed: int = 0, split: str = "train", max_tasks: int | None = None
) -> Iterator[tuple[Task, dict[str, Any]]]:
    """:func:`demonstrations` with the task of each record (to score it with ``env.reward``)."""
    schemas = [t.schema() for t in env.tools()]
    made = 0
    for i, task in enumerate(env.tasks(split, seed)):
        if made >= num or i >= (max_tasks if max_tasks is not None else 100 * max(num, 1)):
            return
        messages = env.demonstration(task)
        if messages is None:
            continue
        made += 1
        yield task, {"task_id": task.id, "messages": messages, "tools": schemas}

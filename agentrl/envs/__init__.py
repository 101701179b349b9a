"""Environments: the :class:`Env` API, built-in envs and helpers to build them from a config.

* :func:`make_env` builds the env named by ``cfg.env.cls`` with ``cfg.env.kwargs``; an env
  whose constructor takes a ``sandbox`` argument receives the ``[sandbox]`` section as a
  dict, updated by ``env.kwargs.sandbox`` when that is a table (for settings beyond the
  section, such as ``max_live`` or ``docker_host``).
* :func:`episode_limits` gives the turn and token limits (the env's own, else the config's).
* :func:`make_toolbox` wraps the env's tools in a :class:`~agentrl.tools.base.ToolBox` with
  the ``[env]`` section's time and output limits.
* :func:`demonstrations` yields correct episodes for the supervised warm start.
* :func:`score_episode` and :func:`run_cleanup` call an env's ``reward`` and ``cleanup`` so
  that neither a raising reward nor a cancelled episode can crash an actor.

Built-in envs (import paths for ``env.cls``): ``agentrl.envs.calculator:CalculatorEnv``,
``agentrl.envs.search_qa:SearchQAEnv``, ``agentrl.envs.code:CodeEnv``.
"""

from __future__ import annotations

import inspect
from typing import TYPE_CHECKING, Any, Iterator

from agentrl.envs.base import Env, Message, Task, load_env, run_cleanup, score_episode, total_reward

if TYPE_CHECKING:
    from agentrl.config import AgentRLConfig
    from agentrl.tools.base import ToolBox

__all__ = ["Env", "Message", "Task", "demonstrations", "episode_limits", "load_env", "make_env", "make_toolbox",
           "run_cleanup", "score_episode", "total_reward"]


from agentrl.envs.base import _import_module_or_file  # noqa: E402


def make_env(cfg: "AgentRLConfig") -> Env:
    """Instantiate the configured env, passing the sandbox settings to envs that take them."""
    kwargs = dict(cfg.env.kwargs)
    if isinstance(kwargs.get("sandbox"), dict):  # env.kwargs.sandbox refines the [sandbox] section
        kwargs["sandbox"] = {**cfg.sandbox.model_dump(), **kwargs["sandbox"]}
    elif "sandbox" not in kwargs and ":" in cfg.env.cls:
        module_name, cls_name = cfg.env.cls.rsplit(":", 1)
        try:
            cls = getattr(_import_module_or_file(module_name), cls_name, None)
        except ValueError:
            cls = None  # load_env reports it with a clear message
        if isinstance(cls, type) and "sandbox" in inspect.signature(cls.__init__).parameters:
            kwargs["sandbox"] = cfg.sandbox.model_dump()
    return load_env(cfg.env.cls, kwargs)


def episode_limits(env: Env, cfg: "AgentRLConfig") -> tuple[int, int]:
    """(max_turns, max_total_tokens) for the env's episodes: the env's own values where it
    sets them, else the ``[env]`` section's; never above ``engine.max_context_tokens``."""
    turns = env.max_turns if env.max_turns is not None else cfg.env.max_turns
    tokens = env.max_total_tokens if env.max_total_tokens is not None else cfg.env.max_total_tokens
    return turns, min(tokens, cfg.engine.max_context_tokens)


def make_toolbox(env: Env, cfg: "AgentRLConfig | None" = None) -> "ToolBox":
    """The env's tools with the ``[env]`` section's time and output limits."""
    from agentrl.tools.base import ToolBox

    if cfg is None:
        return ToolBox(env.tools())
    return ToolBox(env.tools(), timeout_s=cfg.env.tool_timeout_s, max_output_chars=cfg.env.tool_max_output_chars)


def demonstrations(env: Env, num: int, seed: int = 0, split: str = "train",
                   max_tasks: int | None = None) -> Iterator[dict[str, Any]]:
    """Up to ``num`` records ``{"task_id", "messages", "tools"}`` of correct episodes.

    Tasks the env does not demonstrate (``demonstration`` returns None, e.g. questions
    harder than the calculator's ``demo_max_ops``) are skipped; at most ``max_tasks``
    (default ``100 * num``) tasks are looked at.
    """
    schemas = [t.schema() for t in env.tools()]
    made = 0
    for i, task in enumerate(env.tasks(split, seed)):
        if made >= num or i >= (max_tasks if max_tasks is not None else 100 * max(num, 1)):
            return
        messages = env.demonstration(task)
        if messages is None:
            continue
        made += 1
        yield {"task_id": task.id, "messages": messages, "tools": schemas}

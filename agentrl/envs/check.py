"""What ``agentrl run --dry-run`` checks of an env before any process starts.

A newcomer's env fails in ways that a config check cannot see: a wrong ``env.cls``, a tool
whose schema cannot be built, ``tasks`` or ``initial_messages`` that raise, a first prompt that
does not fit ``env.max_total_tokens``, a warm start asked of an env without demonstrations.
:func:`check_env` runs each piece once, the way the actors will, and collects every problem
(one line each, naming the piece) instead of stopping at the first; ``notes`` say what was
checked. Nothing here trains or starts a server; the tokenizer is loaded only when the model
folder exists (a tiny model is built later by ``agentrl run`` itself).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from agentrl.config import AgentRLConfig
    from agentrl.envs.base import Env, Task


@dataclass
class EnvCheck:
    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems


def check_env(cfg: "AgentRLConfig") -> EnvCheck:
    """Build the env of ``cfg`` and exercise it once (see the module docstring)."""
    from agentrl.envs import make_env

    report = EnvCheck()
    try:
        env = make_env(cfg)
    except Exception as e:  # ValueError (bad path, kwargs), ToolSchemaError at import, anything the env raises
        report.problems.append(f"env.cls = {cfg.env.cls!r}: {type(e).__name__}: {e}")
        return report
    report.notes.append(f"env {cfg.env.cls} built with kwargs {sorted(cfg.env.kwargs)}")
    try:
        schemas = _check_tools(env, report)
        task = _first_task(env, "train", cfg.run.seed, report)
        _first_task(env, cfg.eval.split, cfg.run.seed, report)
        if task is not None:
            messages = _check_messages(env, task, report)
            if messages is not None:
                _check_prompt(cfg, env, messages, schemas, report)
            if cfg.sft.enabled and not cfg.sft.data:
                _check_demonstration(env, task, report)
    finally:
        _close(env)
    return report


def _check_tools(env: "Env", report: EnvCheck) -> list[dict[str, Any]] | None:
    from agentrl.tools.base import ToolBox

    try:
        box = ToolBox(env.tools())
        schemas = box.schemas()
    except Exception as e:
        report.problems.append(f"tools(): {type(e).__name__}: {e}")
        return None
    names = ", ".join(s["function"]["name"] for s in schemas) or "none"
    report.notes.append(f"tools: {names}")
    return schemas


def _first_task(env: "Env", split: str, seed: int, report: EnvCheck) -> "Task | None":
    from agentrl.envs.base import Task

    try:
        task = next(iter(env.tasks(split, seed)), None)
    except Exception as e:
        report.problems.append(f"tasks({split!r}): {type(e).__name__}: {e}")
        return None
    if task is None:
        report.problems.append(f"tasks({split!r}) yields no task")
    elif not isinstance(task, Task):
        report.problems.append(f"tasks({split!r}) yields {type(task).__name__}, not agentrl.envs.base.Task")
        return None
    return task


def _check_messages(env: "Env", task: "Task", report: EnvCheck) -> list[dict[str, Any]] | None:
    try:
        messages = env.initial_messages(task)
    except Exception as e:
        report.problems.append(f"initial_messages(task {task.id!r}): {type(e).__name__}: {e}")
        return None
    bad = [m for m in messages if not (isinstance(m, dict) and isinstance(m.get("role"), str) and "content" in m)] \
        if isinstance(messages, list) else [messages]
    if bad or not messages:
        report.problems.append(f"initial_messages(task {task.id!r}) must be a non-empty list of "
                               f"{{'role', 'content'}} dicts, got {messages!r:.200}")
        return None
    return messages


def _check_prompt(cfg: "AgentRLConfig", env: "Env", messages: list[dict[str, Any]],
                  schemas: list[dict[str, Any]] | None, report: EnvCheck) -> None:
    """Render the first prompt with the model's chat template and check it leaves room to answer."""
    from agentrl.envs import episode_limits

    if not (Path(cfg.model.path) / "config.json").exists():
        report.notes.append(f"prompt not rendered: no model at {cfg.model.path} yet")
        return
    from transformers import AutoTokenizer

    from agentrl.actors.chat import codec_for

    try:
        codec = codec_for(AutoTokenizer.from_pretrained(cfg.model.path))
        ids, _ = codec.prompt(messages, schemas or None)
    except Exception as e:
        report.problems.append(f"rendering the first prompt with {cfg.model.path}'s chat template: "
                               f"{type(e).__name__}: {e}")
        return
    _, max_total = episode_limits(env, cfg)
    room = max_total - len(ids) - codec.reserve_tokens
    report.notes.append(f"first prompt: {len(ids)} tokens of env.max_total_tokens = {max_total}")
    if room < 1:
        report.problems.append(f"the first prompt has {len(ids)} tokens and leaves no room for the model "
                               f"within env.max_total_tokens = {max_total}")
    elif room < min(cfg.actors.max_new_tokens_per_turn, 32):
        report.problems.append(f"the first prompt has {len(ids)} tokens and leaves only {room} for the "
                               f"model within env.max_total_tokens = {max_total}")


def _check_demonstration(env: "Env", task: "Task", report: EnvCheck) -> None:
    from agentrl.envs import demonstrations

    try:
        found = next(iter(demonstrations(env, 1)), None)
    except Exception as e:
        report.problems.append(f"demonstration(): {type(e).__name__}: {e} (sft.enabled needs demonstrations "
                               "or sft.data)")
        return
    if found is None:
        report.problems.append("sft.enabled = true but the env demonstrates no task (demonstration() returns "
                               "None): set sft.data to a JSONL of conversations, or sft.enabled = false")


def _close(env: "Env") -> None:
    import trio

    try:
        trio.run(env.aclose)
    except Exception as e:  # noqa: BLE001 - a dry run never fails on closing; say it
        print(f"# env check: aclose() raised {type(e).__name__}: {e}")


def summary_lines(report: EnvCheck) -> list[str]:
    """What ``--dry-run`` prints after the config."""
    lines = [f"# env check: {'ok' if report.ok else f'{len(report.problems)} problem(s)'}"]
    lines += [f"#   {note}" for note in report.notes]
    lines += [f"#   PROBLEM: {problem}" for problem in report.problems]
    return lines

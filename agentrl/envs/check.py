"""What ``agentrl run --dry-run`` checks of the envs before any process starts.

A newcomer's env fails in ways that a config check cannot see: a wrong ``env.cls``, a tool
whose schema cannot be built, ``tasks`` or ``initial_messages`` that raise, a first prompt that
does not fit ``env.max_total_tokens``, a warm start asked of an env without demonstrations.
:func:`check_env` runs each piece once, the way the actors will, and collects every problem
(one line each, naming the piece) instead of stopping at the first; ``notes`` say what was
checked. Nothing here trains or starts a server; the tokenizer is loaded only when the model
folder exists (a tiny model is built later by ``agentrl run`` itself).

Every env of the run is checked (``[[envs]]``: each entry, its lines prefixed with the entry
and the env's name, and two envs with one name are a problem). An
:class:`agentrl.agents.AgentEnv` writes its prompts in its agent at run time, so there is no
first prompt to render: its check is its tasks, that it implements ``run``, that the
``openai`` package its client needs is installed, and its demonstrations when SFT uses them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from agentrl.envs.base import Env

if TYPE_CHECKING:
    from agentrl.config import AgentRLConfig
    from agentrl.envs.base import Task


@dataclass
class EnvCheck:
    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems


def check_env(cfg: "AgentRLConfig") -> EnvCheck:
    """Build every env of ``cfg`` and exercise each once (see the module docstring)."""
    from agentrl.envs import check_env_names, close_quietly, make_env

    report = EnvCheck()
    several = len(cfg.env_sections) > 1
    built: list[tuple[str, Any, Env]] = []
    for key, section in cfg._env_keys():
        try:
            built.append((key, section, make_env(cfg, section)))
        except Exception as e:  # ValueError (bad path, kwargs), ToolSchemaError at import, anything the env raises
            report.problems.append(f"{key}.cls = {section.cls!r}: {type(e).__name__}: {e}")
    try:
        check_env_names([(section.cls, env.name) for _, section, env in built])
    except ValueError as e:
        report.problems.append(str(e))
    try:
        for key, section, env in built:
            one = EnvCheck()
            _check_one(cfg, key, section, env, one)
            prefix = f"{key} ({env.name}): " if several else ""
            report.notes += [prefix + note for note in one.notes]
            report.problems += [prefix + problem for problem in one.problems]
    finally:
        for _, _, env in built:
            close_quietly(env)
    return report


def _check_one(cfg: "AgentRLConfig", key: str, section: Any, env: "Env", report: EnvCheck) -> None:
    from agentrl.agents import AgentEnv

    report.notes.append(f"env {section.cls} built with kwargs {sorted(section.kwargs)}")
    schemas = _check_tools(env, report)
    task = _first_task(env, "train", cfg.run.seed, report)
    _first_task(env, cfg.eval.split, cfg.run.seed, report)
    if isinstance(env, AgentEnv):
        _check_agent(env, report)
    elif task is not None:
        messages = _check_messages(env, task, report)
        if messages is not None:
            _check_prompt(cfg, key, section, env, messages, schemas, report)
    if task is not None and cfg.sft.enabled and not cfg.sft.data:
        _check_demonstration(env, task, report)


def _check_agent(env: "Env", report: EnvCheck) -> None:
    """An AgentEnv: ``run`` is its own, and its client can be made."""
    from agentrl.agents import AgentEnv

    report.notes.append(f"agent env: its agent writes the prompts at run time ({type(env).__name__}.run); "
                        "no first prompt to render")
    if type(env).run is AgentEnv.run:
        report.problems.append(f"{type(env).__name__} is an AgentEnv without run(task, client): write the agent "
                               "that plays a task with the client it is given")
    try:
        import openai  # noqa: F401 - the client every agent episode gets
    except ImportError:
        report.problems.append("AgentEnv episodes need the openai package: pip install 'agentrl[agents]'")


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


def _check_prompt(cfg: "AgentRLConfig", key: str, section: Any, env: "Env", messages: list[dict[str, Any]],
                  schemas: list[dict[str, Any]] | None, report: EnvCheck) -> None:
    """Render the first prompt with the model's chat template and check it leaves room to answer."""
    if not (Path(cfg.model.path) / "config.json").exists():
        report.notes.append(f"prompt not rendered: no model at {cfg.model.path} yet")
        return
    from transformers import AutoTokenizer

    from agentrl.actors.chat import codec_for
    from agentrl.actors.rollout import EpisodeLimits

    try:
        codec = codec_for(AutoTokenizer.from_pretrained(cfg.model.path))
        ids, _ = codec.prompt(messages, schemas or None)
    except Exception as e:
        report.problems.append(f"rendering the first prompt with {cfg.model.path}'s chat template: "
                               f"{type(e).__name__}: {e}")
        return
    max_total = EpisodeLimits.from_config(cfg, env, section).max_total_tokens
    room = max_total - len(ids) - codec.reserve_tokens
    report.notes.append(f"first prompt: {len(ids)} tokens of {key}.max_total_tokens = {max_total}")
    if room < 1:
        report.problems.append(f"the first prompt has {len(ids)} tokens and leaves no room for the model "
                               f"within {key}.max_total_tokens = {max_total}")
    elif room < min(cfg.actors.max_new_tokens_per_turn, 32):
        report.problems.append(f"the first prompt has {len(ids)} tokens and leaves only {room} for the "
                               f"model within {key}.max_total_tokens = {max_total}")


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


def summary_lines(report: EnvCheck) -> list[str]:
    """What ``--dry-run`` prints after the config."""
    lines = [f"# env check: {'ok' if report.ok else f'{len(report.problems)} problem(s)'}"]
    lines += [f"#   {note}" for note in report.notes]
    lines += [f"#   PROBLEM: {problem}" for problem in report.problems]
    return lines

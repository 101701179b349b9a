"""What ``agentrl run --dry-run`` checks of the envs before any process starts.

A newcomer's env fails in ways that a config check cannot see: a wrong ``env.cls``, a tool
whose schema cannot be built, ``tasks`` or ``initial_messages`` that raise, a first prompt that
does not fit ``env.max_total_tokens``, a warm start asked of an env without demonstrations, a
``reward`` that raises or is not finite, a demonstration that calls a tool the env does not
have (SFT would teach that call). :func:`check_env` runs each piece once, the way the actors
will, and collects every problem (one line each, naming the piece) instead of stopping at the
first; ``notes`` say what was checked. Nothing here trains or starts a server.

Rewards are scored as the actor scores them (``setup``, ``reward``, ``cleanup``) on the first
``DEMOS_SCORED`` demonstrations and on the first task answered "I do not know." (a reward must
not raise on a wrong answer either). The tool calls of the first ``DEMOS_CHECKED``
demonstrations (``agentrl make-demos``: of every one it writes) are checked against the env's
tools: the name, then the arguments as the ToolBox checks a model's call (:class:`DemoChecker`).

The first prompt is rendered with the model's chat template. On a fresh clone the model folder
does not exist yet: with ``model.init_size = "tiny"`` it is built now, as ``agentrl run`` would
(about a second); a bigger size is not built here and the note says the one command that does;
with no ``init_size`` a run could not start, which is a problem.

Every env of the run is checked (``[[envs]]``: each entry, its lines prefixed with the entry
and the env's name, and two envs with one name are a problem). An
:class:`agentrl.agents.AgentEnv` writes its prompts in its agent at run time, so there is no
first prompt to render: its check is its tasks, that it implements ``run``, that the
``openai`` package its client needs is installed, and its demonstrations when SFT uses them.
See docs/run.md.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import trio

from agentrl.config import AgentRLConfig
from agentrl.envs import check_env_names, close_quietly, demonstrated, make_env
from agentrl.envs.agent import AgentEnv
from agentrl.envs.base import Env, Task, run_cleanup, score_episode
from agentrl.episode.chat import codec_for
from agentrl.episode.turn import EpisodeLimits
from agentrl.models.builder import ensure_model
from agentrl.tools.base import ToolBox, check_arguments

DEMOS_CHECKED = 20  # demonstrations whose tool calls --dry-run checks
DEMOS_SCORED = 3  # demonstrations scored by the env's reward
MAX_CALL_PROBLEMS = 5  # bad tool calls named one by one; the rest are counted
NON_ANSWER = "I do not know."  # the wrong answer a reward is also tried on


@dataclass
class EnvCheck:
    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    unchecked: list[str] = field(default_factory=list)  # what could not be checked, and how to check it

    @property
    def ok(self) -> bool:
        return not self.problems


def check_env(cfg: AgentRLConfig) -> EnvCheck:
    """Build every env of ``cfg`` and exercise each once (see the module docstring)."""
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

    checked = 0
    try:
        for key, section, env in built:
            one = EnvCheck()
            trio.run(_check_one, cfg, key, section, env, one)  # one event loop: the env's resources live in it
            checked += 1
            prefix = f"{key} ({env.name}): " if several else ""
            report.notes += [prefix + note for note in one.notes]
            report.problems += [prefix + problem for problem in one.problems]
            report.unchecked += [what for what in one.unchecked if what not in report.unchecked]
    finally:
        for _, _, env in built[checked:]:
            close_quietly(env)
    return report


async def _check_one(cfg: AgentRLConfig, key: str, section: Any, env: Env, report: EnvCheck) -> None:
    """Every check of one env, then ``env.aclose()`` in the same event loop (a sandbox pool opened
    to score a reward is closed where it was opened)."""
    try:
        report.notes.append(f"env {section.cls} built with kwargs {sorted(section.kwargs)}")
        schemas = _check_tools(env, report)
        task = _first_task(env, "train", cfg.run.seed, report)
        _first_task(env, cfg.eval.split, cfg.run.seed, report)
        also: list[tuple[str, Task, list[dict[str, Any]]]] = []  # scored with the demonstrations
        if isinstance(env, AgentEnv):
            _check_agent(env, report)
        elif task is not None:
            messages = _check_messages(env, task, report)
            if messages is not None:
                _check_prompt(cfg, key, section, env, messages, schemas, report)
                also.append(
                    (
                        f"task {task.id!r} answered {NON_ANSWER!r}",
                        task,
                        [*messages, {"role": "assistant", "content": NON_ANSWER}],
                    )
                )
        if task is not None:
            await _check_demonstrations(cfg, env, report, also)
    finally:
        with trio.CancelScope(shield=True):
            try:
                await env.aclose()
            except Exception:
                pass


def _check_agent(env: AgentEnv, report: EnvCheck) -> None:
    """An AgentEnv: ``run`` is its own, and its client can be made."""
    report.notes.append(
        f"agent env: its agent writes the prompts at run time ({type(env).__name__}.run); no first prompt to render"
    )
    if type(env).run is AgentEnv.run:
        report.problems.append(
            f"{type(env).__name__} is an AgentEnv without run(task, client): write the agent "
            "that plays a task with the client it is given"
        )
    try:
        import openai  # noqa: F401 - the client every agent episode gets
    except ImportError:
        report.problems.append("AgentEnv episodes need the openai package: pip install 'agentrl[agents]'")


def _check_tools(env: Env, report: EnvCheck) -> list[dict[str, Any]] | None:
    try:
        box = ToolBox(env.tools())
        schemas = box.schemas()
    except Exception as e:
        report.problems.append(f"tools(): {type(e).__name__}: {e}")
        return None
    names = ", ".join(s["function"]["name"] for s in schemas) or "none"
    report.notes.append(f"tools: {names}")
    return schemas


def _first_task(env: Env, split: str, seed: int, report: EnvCheck) -> Task | None:
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


def _check_messages(env: Env, task: Task, report: EnvCheck) -> list[dict[str, Any]] | None:
    try:
        messages = env.initial_messages(task)
    except Exception as e:
        report.problems.append(f"initial_messages(task {task.id!r}): {type(e).__name__}: {e}")
        return None
    bad = (
        [m for m in messages if not (isinstance(m, dict) and isinstance(m.get("role"), str) and "content" in m)]
        if isinstance(messages, list)
        else [messages]
    )
    if bad or not messages:
        report.problems.append(
            f"initial_messages(task {task.id!r}) must be a non-empty list of "
            f"{{'role', 'content'}} dicts, got {messages!r:.200}"
        )
        return None
    return messages


def _check_prompt(
    cfg: AgentRLConfig,
    key: str,
    section: Any,
    env: Env,
    messages: list[dict[str, Any]],
    schemas: list[dict[str, Any]] | None,
    report: EnvCheck,
) -> None:
    """Render the first prompt with the model's chat template and check it leaves room to answer."""
    if not _model_ready(cfg, report):
        return
    from transformers import AutoTokenizer

    try:
        codec = codec_for(AutoTokenizer.from_pretrained(cfg.model.path))
        ids, _ = codec.prompt(messages, schemas or None)
    except Exception as e:
        report.problems.append(
            f"rendering the first prompt with {cfg.model.path}'s chat template: {type(e).__name__}: {e}"
        )
        return
    max_total = EpisodeLimits.from_config(cfg, env, section).max_total_tokens
    room = max_total - len(ids) - codec.reserve_tokens
    report.notes.append(f"first prompt: {len(ids)} tokens of {key}.max_total_tokens = {max_total}")
    if room < 1:
        report.problems.append(
            f"the first prompt has {len(ids)} tokens and leaves no room for the model "
            f"within {key}.max_total_tokens = {max_total}"
        )
    elif room < min(cfg.actors.max_new_tokens_per_turn, 32):
        report.problems.append(
            f"the first prompt has {len(ids)} tokens and leaves only {room} for the "
            f"model within {key}.max_total_tokens = {max_total}"
        )


def _model_ready(cfg: AgentRLConfig, report: EnvCheck) -> bool:
    """Whether ``model.path`` holds a model, building the tiny one when ``model.init_size`` asks for it."""
    path, size = cfg.model.path, cfg.model.init_size
    if (Path(path) / "config.json").exists():
        return True
    command = f"agentrl init-model {path} --size {size or 'tiny'} --seed {cfg.run.seed}"
    if not size:
        report.problems.append(
            f"no model at {path} (config.json missing) and model.init_size is empty, so a run "
            f"cannot start: build one with `{command}`, or set model.path to a Hugging Face "
            "model folder"
        )
        return False
    if size != "tiny":
        report.unchecked.append(
            f"the first prompt: no model at {path} yet (`agentrl run` builds the {size} model "
            f"there first); to check it now: `{command}`"
        )
        return False

    try:
        ensure_model(path, size, seed=cfg.run.seed)
    except Exception as e:  # a folder it cannot write...
        report.problems.append(f"building the tiny model at {path} (model.init_size = 'tiny'): {type(e).__name__}: {e}")
        return False
    report.notes.append(f"built the tiny model at {path} (model.init_size = 'tiny'), as `agentrl run` would")
    return True


async def _score(
    env: Env, task: Task, messages: list[dict[str, Any]], max_abs_reward: float
) -> tuple[float, str | None]:
    """Score ``messages`` as the actor does (``setup``, ``reward``, ``cleanup``): (reward, error)."""
    try:
        state = await env.setup(task)
    except Exception as e:
        return 0.0, f"setup raised {type(e).__name__}: {e}"
    try:
        total, _, error = await score_episode(env, task, state, messages, max_abs_reward=max_abs_reward)
    finally:
        cleanup_error = await run_cleanup(env, task, state)
    return total, error or cleanup_error


class DemoChecker:
    """Checks demonstrations as they are made: every tool call against the env's tools (``add``),
    then ``env.reward`` of the first ``scored`` (``finish``). Problems name the task and message."""

    def __init__(self, env: Env, max_abs_reward: float = math.inf, scored: int = DEMOS_SCORED):
        if isinstance(env, AgentEnv) and type(env).reward is Env.reward:
            scored = 0  # its run() returns the reward: nothing to score a demonstration with
        self.env, self.max_abs_reward, self.scored = env, max_abs_reward, scored
        try:
            self.tools: dict[str, Any] | None = {t.name: t for t in ToolBox(env.tools()).tools}
        except Exception:
            self.tools = None
        self.count = 0
        self.call_problems: list[str] = []
        self.calls = 0
        self._to_score: list[tuple[Task, list[dict[str, Any]]]] = []

    def add(self, task: Task, messages: list[dict[str, Any]]) -> None:
        self.count += 1
        if len(self._to_score) < self.scored:
            self._to_score.append((task, messages))
        for i, message in enumerate(messages if isinstance(messages, list) else []):
            calls = message.get("tool_calls") if isinstance(message, dict) else None
            for call in calls or []:
                self.calls += 1
                why = self._call_problem(call)
                if why:
                    self.call_problems.append(f"the demonstration of task {task.id!r}, message {i}: {why}")

    def _call_problem(self, call: Any) -> str | None:
        if self.tools is None:
            return None
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            return f"a tool call must be {{'type': 'function', 'function': {{'name', 'arguments'}}}}, got {call!r:.200}"
        name, arguments = function["name"], function.get("arguments", {})
        if name not in self.tools:
            return f"calls the unknown tool {name!r}; the env's tools: {', '.join(self.tools) or 'none'}"
        if isinstance(arguments, str):  # the OpenAI form: a JSON string
            try:
                arguments = json.loads(arguments)
            except json.JSONDecodeError as e:
                return f"the arguments of {name} are not JSON ({e}): {arguments!r:.200}"
        return check_arguments(self.tools[name], arguments)

    async def score(self, also: Sequence[tuple[str, Task, list[dict[str, Any]]]] = ()) -> tuple[list[str], list[str]]:
        """(problems, notes): the bad tool calls, then the rewards of the first demonstrations and of
        ``also`` (``(label, task, messages)``: a wrong answer), each scored as the actor does."""
        problems = self.call_problems[:MAX_CALL_PROBLEMS]
        if len(self.call_problems) > MAX_CALL_PROBLEMS:
            problems.append(
                f"... and {len(self.call_problems) - MAX_CALL_PROBLEMS} more bad tool calls in the demonstrations"
            )
        if self.call_problems:
            problems[-1] += " (SFT would teach the model these calls)"
        rewards, notes = [], []
        for task, messages in self._to_score:
            reward, error = await _score(self.env, task, messages, self.max_abs_reward)
            if error:
                problems.append(f"the demonstration of task {task.id!r}: {error}")
            rewards.append(f"{reward:g}")
        if self.count:
            notes.append(
                f"demonstrations: {self.count} checked ({self.calls} tool calls), rewards of the first "
                f"{len(rewards)}: {', '.join(rewards) or '-'}"
            )
        for label, task, messages in also:
            reward, error = await _score(self.env, task, messages, self.max_abs_reward)
            if error:
                problems.append(f"{label}: {error} (the actors would score every such episode 0)")
            else:
                notes.append(f"reward of {label}: {reward:g}")
        return problems, notes

    def finish(self) -> tuple[list[str], list[str]]:
        """:meth:`score` in an event loop of its own, which then closes the env (``aclose``)."""

        async def score_and_close() -> tuple[list[str], list[str]]:
            try:
                return await self.score()
            finally:
                with trio.CancelScope(shield=True):
                    await self.env.aclose()

        return trio.run(score_and_close)


async def _check_demonstrations(
    cfg: AgentRLConfig, env: Env, report: EnvCheck, also: list[tuple[str, Task, list[dict[str, Any]]]]
) -> None:
    """The first demonstrations' tool calls and rewards (and ``also``'s rewards); no demonstration
    is a problem when SFT needs them."""
    needed = cfg.sft.enabled and not cfg.sft.data
    checker = DemoChecker(env, cfg.learner.max_abs_reward)
    try:
        for task, record in demonstrated(env, DEMOS_CHECKED, seed=cfg.run.seed):
            checker.add(task, record["messages"])
    except Exception as e:
        checker = DemoChecker(env, cfg.learner.max_abs_reward)  # what was added is not trusted
        line = f"demonstration(): {type(e).__name__}: {e}"
        if needed:
            report.problems.append(f"{line} (sft.enabled needs demonstrations or sft.data)")
        else:
            report.notes.append(f"{line} (unused: sft.enabled = false or sft.data is set)")
    else:
        if not checker.count and needed:
            report.problems.append(
                "sft.enabled = true but the env demonstrates no task (demonstration() returns "
                "None): set sft.data to a JSONL of conversations, or sft.enabled = false"
            )
    if "judge" in dir(type(env)) and getattr(env, "judge", None) is None:
        report.unchecked.append("the rewards: the env's reward awaits a judge, which --dry-run does not start")
        report.problems += checker.call_problems[:MAX_CALL_PROBLEMS]
        return
    problems, notes = await checker.score(also)
    report.problems += problems
    report.notes += notes


def summary_lines(report: EnvCheck) -> list[str]:
    """What ``--dry-run`` prints after the config."""
    verdict = "ok" if report.ok else f"{len(report.problems)} problem(s)"
    if report.ok and report.unchecked:
        verdict += f", but {len(report.unchecked)} piece(s) not checked"
    lines = [f"# env check: {verdict}"]
    lines += [f"#   {note}" for note in report.notes]
    lines += [f"#   NOT CHECKED: {what}" for what in report.unchecked]
    lines += [f"#   PROBLEM: {problem}" for problem in report.problems]
    return lines

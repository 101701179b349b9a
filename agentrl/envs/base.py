"""The environment API: what a user subclasses to define a task for an agent.

An environment answers five questions, each a method: where tasks come from (:meth:`Env.tasks`),
how an episode opens (:meth:`Env.initial_messages`), which tools the agent can call
(:meth:`Env.tools`), what follows a turn with no tool call (:meth:`Env.on_text_turn`: ``None``
ends the episode, a string is the simulated user's reply), and what the episode is worth
(:meth:`Env.reward`, a float or named components).

Per-episode resources live in the ``state`` dict from :meth:`Env.setup`; :meth:`Env.cleanup` always
runs, on cancellation and errors too; :meth:`Env.aclose` releases process-wide resources when the
actor stops. Envs are loaded by import path (``env.cls = "my_pkg.my_env:MyEnv"``, ``[env.kwargs]``
to the constructor), so users never edit agentrl. See docs/envs.md.
"""

from __future__ import annotations

import hashlib
import importlib
import math
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from agentrl.tools.base import Tool

Message = dict[str, Any]  # OpenAI-style chat message: {"role": ..., "content": ..., ...}


@dataclass
class Task:
    """One problem instance; ``data`` is whatever the env needs (question, answer, tests...)."""

    id: str
    data: dict[str, Any] = field(default_factory=dict)


class Env:
    """Base class for environments. Override what differs; the defaults are a plain chat."""

    name: str = "env"
    # Episode limits; None means the [env] config section's max_turns / max_total_tokens.
    # An env that needs tighter (or looser) limits sets them here (see agentrl.episode.turn.EpisodeLimits.from_config).
    max_turns: int | None = None
    max_total_tokens: int | None = None

    def tasks(self, split: str = "train", seed: int = 0) -> Iterator[Task]:
        """Yield tasks for ``split`` ("train" or "test"); may be infinite for "train"."""
        raise NotImplementedError(f"{type(self).__name__} must implement tasks()")

    def initial_messages(self, task: Task) -> list[Message]:
        """The opening messages of an episode (system and first user turn)."""
        raise NotImplementedError(f"{type(self).__name__} must implement initial_messages()")

    def tools(self) -> list[Tool]:
        """Tools offered to the agent in every episode of this env."""
        return []

    async def setup(self, task: Task) -> dict[str, Any]:
        """Create per-episode state (for example, acquire a sandbox). Returned dict is ``state``."""
        return {}

    async def cleanup(self, task: Task, state: dict[str, Any]) -> None:
        """Release per-episode resources; always called, also when the episode is cancelled."""

    async def on_text_turn(self, task: Task, state: dict[str, Any], messages: list[Message]) -> str | None:
        """The assistant answered without a tool call: ``None`` ends the episode, a string is the
        simulated user's next message."""
        return None

    async def reward(self, task: Task, state: dict[str, Any], messages: list[Message]) -> float | dict[str, float]:
        """Score a finished episode. A dict gives named components; their sum is the reward."""
        raise NotImplementedError(f"{type(self).__name__} must implement reward()")

    def is_success(self, task: Task, reward: float) -> bool:
        """Whether an episode with this reward counts as solved (for success rates)."""
        return reward >= 1.0

    def eval_group(self, task: Task) -> str | None:
        """A label for reporting success per kind of task in evaluations (e.g. "3 ops"), or None."""
        return None

    def demonstration(self, task: Task) -> list[Message] | None:
        """A correct episode for supervised warm-start (with the right tool calls), or None."""
        return None

    async def aclose(self) -> None:
        """Release process-wide resources (a sandbox pool); called once when the actor stops."""


def _import_module_or_file(name: str) -> Any:
    """``pkg.module`` by import, or ``path/to/file.py`` from that file (relative to the cwd), with
    the file's folder put on ``sys.path`` (at its end) so that it can import modules next to it.
    Every process that loads the env (actors, the SFT learner, ``agentrl run``) comes here."""
    if name.endswith(".py"):
        from importlib.util import module_from_spec, spec_from_file_location
        from pathlib import Path

        path = Path(name).resolve()
        if not path.is_file():
            raise ValueError(f"env file {name!r} does not exist (paths are relative to {Path.cwd()})")
        if str(path.parent) not in sys.path:  # its sibling modules import as they would for `python file.py`
            sys.path.append(str(path.parent))  # appended: an installed module of the same name wins
        spec = spec_from_file_location(f"agentrl_user_env_{path.stem}", path)
        if spec is None or spec.loader is None:
            raise ValueError(f"env file {name!r} cannot be loaded as a Python module")
        module = module_from_spec(spec)
        sys.modules[spec.name] = module
        try:
            spec.loader.exec_module(module)
        except Exception as e:
            raise ValueError(f"cannot load env file {name!r}: {type(e).__name__}: {e}") from e
        return module
    try:
        return importlib.import_module(name)
    except ImportError as e:
        raise ValueError(f"cannot import env module {name!r}: {e}") from e


def load_env(import_path: str, kwargs: dict[str, Any] | None = None) -> Env:
    """Instantiate ``"module.path:ClassName"`` (or ``"path/to/file.py:ClassName"``) with
    ``kwargs``; errors name what was wrong."""
    if ":" not in import_path:
        raise ValueError(f"env class must be given as 'module:Class', got {import_path!r}")
    module_name, cls_name = import_path.rsplit(":", 1)
    module = _import_module_or_file(module_name)
    cls = getattr(module, cls_name, None)
    if cls is None:
        raise ValueError(f"module {module_name!r} has no attribute {cls_name!r}")
    if not (isinstance(cls, type) and issubclass(cls, Env)):
        raise ValueError(f"{import_path} is not a subclass of agentrl.envs.base.Env")
    try:
        return cls(**(kwargs or {}))
    except TypeError as e:
        raise ValueError(f"cannot construct {import_path} with kwargs {sorted(kwargs or {})}: {e}") from e


def split_bucket(text: str) -> float:
    """A stable number in [0, 1) from ``text``: an env's train/test split assignment (same on every machine)."""
    return int(hashlib.sha1(text.encode()).hexdigest()[:8], 16) / 16**8


def total_reward(value: float | dict[str, float]) -> tuple[float, dict[str, float]]:
    """Normalise an env's reward to (total, components)."""
    if isinstance(value, dict):
        comps = {str(k): float(v) for k, v in value.items()}
        return sum(comps.values()), comps
    return float(value), {}


async def score_episode(
    env: Env, task: Task, state: dict[str, Any], messages: list[Message], *, max_abs_reward: float = math.inf
) -> tuple[float, dict[str, float], str | None]:
    """Call ``env.reward`` and normalise it; a reward that raises, is not a finite number or
    exceeds ``max_abs_reward`` in size (the total or a component) scores 0.0 and comes back
    with an error message (the episode is kept, the run goes on). Returns ``(total,
    components, error)``. Cancellation propagates."""
    try:
        value = await env.reward(task, state, messages)
        total, components = total_reward(value)
    except Exception as e:
        return 0.0, {}, f"reward of {type(env).__name__} failed: {type(e).__name__}: {e}"
    if not all(math.isfinite(r) for r in (total, *components.values())):
        return 0.0, {}, f"reward of {type(env).__name__} is not finite: {value!r}"
    if not all(abs(r) <= max_abs_reward for r in (total, *components.values())):
        return 0.0, {}, f"reward of {type(env).__name__} exceeds learner.max_abs_reward={max_abs_reward:g}: {value!r}"
    return total, components, None


async def run_cleanup(env: Env, task: Task, state: dict[str, Any], limit_s: float = 30.0) -> str | None:
    """Run ``env.cleanup`` shielded from cancellation and bounded by ``limit_s``; returns an
    error message instead of raising (so an episode's cleanup always runs, and never crashes
    the actor)."""
    import trio

    with trio.CancelScope(shield=True):
        with trio.move_on_after(limit_s) as scope:
            try:
                await env.cleanup(task, state)
            except Exception as e:
                return f"cleanup of {type(env).__name__} failed: {type(e).__name__}: {e}"
        if scope.cancelled_caught:
            return f"cleanup of {type(env).__name__} took longer than {limit_s:g} s"
    return None

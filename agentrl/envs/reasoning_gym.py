"""reasoning-gym's procedural task suites as an env, scored by reasoning-gym's own ``score_answer``.

``ReasoningGymEnv(dataset="chain_sum", config={...})`` takes one dataset by its registered name, or
``datasets=[{"name", "weight", "config"}, ...]`` several, mixed by weight through reasoning-gym's
``CompositeDataset``. Tasks are the datasets' items (question, answer, metadata); the model ends
with its answer in ``<answer>...</answer>`` tags, which ``reasoning_gym.utils.extract_answer``
takes from the final assistant turn (reasoning in ``<think>`` removed), and the reward
``{"score": ...}`` is the item's dataset's ``score_answer`` (partial credit included).
``is_success``: a score of 1; ``eval_group``: the dataset's name (with ``group_by``, also a
metadata value, e.g. "chain_sum num_terms=3").

Splits: a task's split is decided by the SHA-1 of its dataset name and question
(``split_bucket < test_fraction``: test), so train and test never share a question. ``train`` is
an infinite stream of composite datasets of ``size`` items, each seeded from ``dataset_seed``, the
stream's seed and a chunk number (as reasoning-gym's ``ReseedingDataset`` does); ``test`` is the
first ``num_test_tasks`` distinct test-split items of one dataset seeded from ``dataset_seed``
alone, the same whatever seed evaluation asks for.

Tools (``tools``): ``"calculator"`` and ``"python"`` (a sandbox per episode). Demonstrations
answer with the dataset's answer; with the calculator and an item whose ``metadata["expression"]``
the calculator evaluates to a right answer, they call it first, and on a ``demo_shortcut_rate``
fraction of multi-operator questions send only the first operation (a sloppy demonstrator, as in
the calculator quickstart). reasoning-gym is imported when the env is built. See docs/envs.md.
"""

from __future__ import annotations

import dataclasses
import difflib
import hashlib
import math
from collections.abc import Iterator
from typing import Any

from agentrl.envs.base import Message, Task, split_bucket
from agentrl.envs.rewards import final_assistant_text
from agentrl.envs.sandboxed import SandboxedEnv
from agentrl.tools.base import Tool
from agentrl.tools.calculator import CalculatorError, CalculatorTool, evaluate, format_number
from agentrl.tools.sandbox.base import SandboxSettings

TOOLS = ("calculator", "python")
ANSWER_FORMAT = "give the final answer in <answer></answer> tags."
_TOOL_HINTS = {"calculator": "Use the calculator", "python": "Run Python if it helps"}
_OPERATORS = {"+", "-", "*", "/"}


@dataclasses.dataclass(frozen=True)
class DatasetChoice:
    """One dataset of the mix: its registered name, relative weight and config (without seed and size)."""

    name: str
    weight: float
    config: dict[str, Any]


def default_system_prompt(tools: tuple[str, ...] | list[str]) -> str:
    """The short prompt: the tools to use, then the answer format reasoning-gym's extractor expects."""
    hints = [_TOOL_HINTS[t] for t in tools]
    if not hints:
        return ANSWER_FORMAT[0].upper() + ANSWER_FORMAT[1:]
    return f"{', '.join(hints)}, then {ANSWER_FORMAT}"


class ReasoningGymEnv(SandboxedEnv):
    name = "reasoning_gym"

    def __init__(
        self,
        dataset: str | None = None,
        config: dict[str, Any] | None = None,
        datasets: list[dict[str, Any]] | None = None,
        size: int = 10_000,
        dataset_seed: int = 0,
        num_test_tasks: int = 200,
        test_fraction: float = 0.1,
        tools: list[str] | tuple[str, ...] = (),
        system_prompt: str | None = None,
        group_by: str = "",
        demo_shortcut_rate: float = 0.0,
        sandbox: dict[str, Any] | SandboxSettings | None = None,
    ):
        super().__init__(sandbox)
        self.choices = parse_choices(dataset, config, datasets)
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ValueError(f"size must be a whole number >= 1, got {size!r}")
        if num_test_tasks < 1:
            raise ValueError(f"num_test_tasks must be >= 1, got {num_test_tasks}")
        if not 0.0 < test_fraction < 1.0:
            raise ValueError(f"test_fraction must be in (0, 1), got {test_fraction}")
        if not 0.0 <= demo_shortcut_rate <= 1.0:
            raise ValueError(f"demo_shortcut_rate must be in [0, 1], got {demo_shortcut_rate}")
        tools = [tools] if isinstance(tools, str) else list(tools)  # tools = "calculator" is one tool
        unknown = sorted(set(tools) - set(TOOLS))
        if unknown:
            raise ValueError(f"unknown tool(s) {', '.join(map(repr, unknown))}: the tools are {', '.join(TOOLS)}")
        self.size, self.dataset_seed = size, dataset_seed
        self.num_test_tasks, self.test_fraction = num_test_tasks, test_fraction
        self.tool_names = tuple(t for t in TOOLS if t in tools)
        self.system_prompt = default_system_prompt(self.tool_names) if system_prompt is None else system_prompt
        self.group_by = group_by
        self.demo_shortcut_rate = demo_shortcut_rate
        self.scorer = self.composite(_seed("score", dataset_seed))  # builds every dataset once: errors show now
        self._test_tasks: list[Task] | None = None

    # ------------------------------------------------------------------ tasks

    def composite(self, seed: int) -> Any:
        """reasoning-gym's ``CompositeDataset`` of the mix, ``size`` items seeded with ``seed``."""
        import reasoning_gym
        from reasoning_gym.composite import DatasetSpec

        specs = [DatasetSpec(name=c.name, weight=c.weight, config=dict(c.config)) for c in self.choices]
        try:
            return reasoning_gym.create_dataset("composite", size=self.size, seed=seed, datasets=specs)
        except (AssertionError, ValueError, TypeError, KeyError) as e:
            names = ", ".join(c.name for c in self.choices)
            raise ValueError(
                f"reasoning-gym cannot build {names} with size={self.size}: {type(e).__name__}: {e}"
            ) from e

    def tasks(self, split: str = "train", seed: int = 0) -> Iterator[Task]:
        if split == "train":
            return self._train(seed)
        if split == "test":
            return iter(self.test_tasks())
        raise ValueError(f"the reasoning-gym env has splits 'train' and 'test', not {split!r}")

    def _train(self, seed: int) -> Iterator[Task]:
        chunk = 0
        while True:
            found = False
            for task in self._items(self.composite(_seed("train", self.dataset_seed, seed, chunk))):
                if not self.in_test_split(task):
                    found = True
                    yield task
            if not found:
                raise ValueError(
                    f"all {self.size} items of {self._names()} fall in the test split: "
                    "the datasets have too few distinct questions (raise their difficulty or lower test_fraction)"
                )
            chunk += 1

    def test_tasks(self) -> list[Task]:
        """The fixed test set: the first ``num_test_tasks`` distinct test-split items."""
        if self._test_tasks is None:
            seen: dict[str, Task] = {}
            for task in self._items(self.composite(_seed("test", self.dataset_seed))):
                if self.in_test_split(task) and task.id not in seen:
                    seen[task.id] = task
                    if len(seen) >= self.num_test_tasks:
                        break
            if not seen:
                raise ValueError(f"no item of {self._names()} fell in the test split; raise size or test_fraction")
            self._test_tasks = list(seen.values())
        return self._test_tasks

    def _items(self, composite: Any) -> Iterator[Task]:
        for idx in range(self.size):
            yield task_from_entry(composite[idx])

    def in_test_split(self, task: Task) -> bool:
        return split_bucket(task_key(task.data["dataset"], task.data["question"])) < self.test_fraction

    def _names(self) -> str:
        return ", ".join(c.name for c in self.choices)

    # --------------------------------------------------------------- episode

    def initial_messages(self, task: Task) -> list[Message]:
        return [{"role": "system", "content": self.system_prompt}, {"role": "user", "content": task.data["question"]}]

    def tools(self) -> list[Tool]:
        out: list[Tool] = []
        if "calculator" in self.tool_names:
            out.append(CalculatorTool())
        if "python" in self.tool_names:
            out.append(self.python_tool())
        return out

    async def setup(self, task: Task) -> dict[str, Any]:
        return await super().setup(task) if "python" in self.tool_names else {}

    async def reward(self, task: Task, state: dict[str, Any], messages: list[Message]) -> dict[str, float]:
        return {"score": self.score(task, messages)}

    def score(self, task: Task, messages: list[Message]) -> float:
        """reasoning-gym's score of the final answer (None when there is no tagged answer)."""
        from reasoning_gym.utils import extract_answer

        text = final_assistant_text(messages)
        answer = extract_answer(text) if text is not None else None
        return self.score_answer(answer, task)

    def score_answer(self, answer: str | None, task: Task) -> float:
        """The item's dataset's own ``score_answer`` (the composite dispatches by ``source_dataset``)."""
        return float(self.scorer.score_answer(answer, task.data["entry"]))

    def is_success(self, task: Task, reward: float) -> bool:
        return reward >= 1.0

    def eval_group(self, task: Task) -> str:
        name = task.data["dataset"]
        metadata = task.data["entry"].get("metadata") or {}
        if self.group_by and self.group_by in metadata:
            return f"{name} {self.group_by}={metadata[self.group_by]}"
        return name

    def demonstration(self, task: Task) -> list[Message] | None:
        """An episode answering with the dataset's answer (None when that answer does not score 1);
        with the calculator, a call first (see the module docstring, the sloppy demonstrator)."""
        answer = task.data["answer"]
        if not isinstance(answer, str) or self.score_answer(answer, task) < 1.0:
            return None
        messages = self.initial_messages(task)
        expression = self._demo_expression(task)
        if expression is None:
            return [*messages, {"role": "assistant", "content": f"<answer>{answer}</answer>"}]
        result = format_number(evaluate(expression))
        call = {"type": "function", "function": {"name": "calculator", "arguments": {"expression": expression}}}
        return [
            *messages,
            {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "name": "calculator", "content": result},
            {"role": "assistant", "content": f"<answer>{result}</answer>"},
        ]

    def _demo_expression(self, task: Task) -> str | None:
        """What the demonstrator sends to the calculator, or None to answer without it."""
        expression = (task.data["entry"].get("metadata") or {}).get("expression")
        if "calculator" not in self.tool_names or not isinstance(expression, str):
            return None
        try:
            if self.score_answer(format_number(evaluate(expression)), task) < 1.0:
                return None  # the dataset means something else (e.g. floor division)
        except CalculatorError:
            return None
        parts = expression.split()
        multi = sum(p in _OPERATORS for p in parts) > 1
        if multi and split_bucket("shortcut " + task.id) < self.demo_shortcut_rate:
            first = " ".join(parts[:3])
            try:
                evaluate(first)
                return first
            except CalculatorError:
                pass
        return expression


# ------------------------------------------------------------------ helpers


def task_key(dataset: str, question: str) -> str:
    """The stable key of an item: its dataset and question (the split and the task id hash it)."""
    return f"{dataset}\n{question}"


def task_from_entry(entry: dict[str, Any]) -> Task:
    """A Task from a reasoning-gym item (``question``, ``answer``, ``metadata.source_dataset``)."""
    name = str(entry["metadata"]["source_dataset"])
    question = str(entry["question"])
    digest = hashlib.sha1(task_key(name, question).encode()).hexdigest()[:12]
    data = {"dataset": name, "question": question, "answer": entry.get("answer"), "entry": entry}
    return Task(id=f"{name}-{digest}", data=data)


def _seed(*parts: Any) -> int:
    """A stable 31-bit seed from ``parts`` (far apart for neighbouring inputs: reasoning-gym seeds items
    with ``seed + index``, so seeds 0 and 1 would share all but one item)."""
    text = "reasoning-gym-" + "-".join(str(p) for p in parts)
    return int(hashlib.sha1(text.encode()).hexdigest()[:8], 16) % 2**31


def parse_choices(
    dataset: str | None, config: dict[str, Any] | None, datasets: list[dict[str, Any]] | None
) -> list[DatasetChoice]:
    """The mix from either ``dataset`` (+ ``config``) or ``datasets``; errors name what is wrong."""
    if (dataset is None) == (datasets is None):
        raise ValueError(
            "give either `dataset` (one name, with `config`) or `datasets` (a list of {name, weight, config})"
        )
    if dataset is not None:
        specs: list[Any] = [{"name": dataset, "weight": 1.0, "config": config or {}}]
    else:
        if config is not None:
            raise ValueError("`config` goes with `dataset`; with `datasets`, give each entry its own `config`")
        if not isinstance(datasets, list) or not datasets:
            raise ValueError(f"`datasets` must be a non-empty list of {{name, weight, config}}, got {datasets!r}")
        specs = datasets
    choices = [_choice(i, spec) for i, spec in enumerate(specs)]
    names = [c.name for c in choices]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise ValueError(f"dataset(s) {', '.join(twice)} appear more than once in `datasets`")
    return choices


def _choice(i: int, spec: Any) -> DatasetChoice:
    where = f"datasets[{i}]"
    if not isinstance(spec, dict):
        raise ValueError(f"{where} must be a table {{name, weight, config}}, got {spec!r}")
    extra = sorted(set(spec) - {"name", "weight", "config"})
    if extra:
        raise ValueError(f"{where} has unknown key(s) {', '.join(extra)}; the keys are name, weight, config")
    name = spec.get("name")
    weight = spec.get("weight", 1.0)
    config = spec.get("config") or {}
    if not isinstance(name, str):
        raise ValueError(f"{where} needs a dataset `name`, got {name!r}")
    if isinstance(weight, bool) or not isinstance(weight, int | float) or not math.isfinite(weight) or weight <= 0:
        raise ValueError(f"the weight of dataset {name!r} must be a finite number > 0, got {weight!r}")
    if not isinstance(config, dict):
        raise ValueError(f"the config of dataset {name!r} must be a table, got {config!r}")
    _check_config(name, config)
    return DatasetChoice(name=name, weight=float(weight), config=dict(config))


def _check_config(name: str, config: dict[str, Any]) -> None:
    """The name is registered, the fields exist, seed and size are the env's, and the dataset's
    own ``validate`` accepts the values."""
    from reasoning_gym.factory import DATASETS

    if name not in DATASETS or name == "composite":
        close = difflib.get_close_matches(name, [n for n in DATASETS if n != "composite"], n=3)
        hint = f"; did you mean {', '.join(close)}?" if close else ""
        raise ValueError(f"unknown reasoning-gym dataset {name!r}{hint} ({len(DATASETS) - 1} are registered)")
    owned = sorted({"seed", "size"} & set(config))
    if owned:
        raise ValueError(f"the config of dataset {name!r} sets {', '.join(owned)}: use the env's dataset_seed and size")
    config_cls = DATASETS[name][1]
    known = {f.name for f in dataclasses.fields(config_cls)} - {"seed", "size"}
    unknown = sorted(set(config) - known)
    if unknown:
        raise ValueError(
            f"dataset {name!r} has no setting(s) {', '.join(unknown)}; its settings are {', '.join(sorted(known))}"
        )
    try:
        settings = config_cls(**config)
        if hasattr(settings, "validate"):
            settings.validate()
    except (AssertionError, ValueError, TypeError) as e:
        raise ValueError(f"reasoning-gym rejects the config of dataset {name!r} {config}: {e}") from e

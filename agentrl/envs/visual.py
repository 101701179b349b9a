"""A visual env that a tiny vision-language model learns on a CPU: name the colour of the left shape.

Each task is a small image drawn on the fly with PIL (seeded, deterministic PNG bytes): a coloured
square, circle or triangle in the left half, and on a ``two_shape_rate`` fraction of tasks a second
shape of another colour in the right half. The question is always "What colour is the shape on the
left?"; the user message is ``[{"type": "image", "image": <PNG bytes>}, {"type": "text", ...}]``.

Reward ``{"correct": ...}``: 1.0 when the final answer (the last assistant message, without a tool
call) names exactly one of the env's colours and it is the left shape's. Naming several colours
scores zero, so hedging is no way to the reward.

Demonstrations come from a **sloppy demonstrator**: on a ``demo_slip_rate`` fraction of the
two-shape tasks (chosen by the SHA-1 of the task id) it answers the right shape's colour. Imitation
learns that slip as it is (greedy success is high on one shape, low on two); only the reward says
that the left shape is meant. Knobs: ``colours``, ``image_size`` (a multiple of 28: 56 gives four
image tokens), ``two_shape_rate``, ``demo_slip_rate``, ``num_test_tasks``, ``test_fraction``.

With ``zoom = true`` the env offers a ``zoom`` tool ("thinking with images"): ``zoom(side)`` returns that
half of the image, enlarged, as a new image; the demonstrator zooms into the left half (on its slips,
the right) and names the colour it sees there.

Splits: ``train`` is an infinite stream; ``test`` is a fixed set of ``num_test_tasks`` tasks chosen
by the SHA-1 of their id, which the train stream skips. See examples/visual/README.md.
"""

from __future__ import annotations

import hashlib
import io
import random
import re
from collections.abc import Iterator
from typing import Any, Literal

from agentrl.envs.base import Env, Message, Task, split_bucket
from agentrl.envs.rewards import final_assistant_text
from agentrl.tools.base import Tool

SYSTEM_PROMPT = "Look at the image and answer with one colour."
ZOOM_SYSTEM_PROMPT = "Zoom into the image, then answer with one colour."
QUESTION = "What colour is the shape on the left?"

COLOURS: dict[str, tuple[int, int, int]] = {
    "red": (220, 40, 40),
    "green": (40, 170, 60),
    "blue": (40, 80, 220),
    "yellow": (235, 200, 30),
    "purple": (140, 60, 180),
    "orange": (245, 130, 20),
    "black": (20, 20, 20),
    "pink": (240, 120, 180),
}
SHAPES = ("square", "circle", "triangle")
BACKGROUND = (245, 245, 245)
_WORD = re.compile(r"[a-z]+")


class VisualEnv(Env):
    name = "visual"

    def __init__(
        self,
        colours: list[str] | None = None,
        image_size: int = 56,
        two_shape_rate: float = 0.7,
        demo_slip_rate: float = 0.7,
        num_test_tasks: int = 200,
        test_fraction: float = 0.1,
        zoom: bool = False,
        system_prompt: str | None = None,
    ):
        colours = list(colours) if colours is not None else ["red", "green", "blue", "yellow", "purple"]
        unknown = [c for c in colours if c not in COLOURS]
        if len(set(colours)) < 2 or unknown or len(set(colours)) != len(colours):
            raise ValueError(f"colours must be two or more distinct names of {sorted(COLOURS)}, got {colours}")
        if image_size < 56 or image_size % 28:
            raise ValueError(f"image_size must be a multiple of 28 and at least 56, got {image_size}")
        for name, rate in [("two_shape_rate", two_shape_rate), ("demo_slip_rate", demo_slip_rate)]:
            if not 0.0 <= rate <= 1.0:
                raise ValueError(f"{name} must be in [0, 1], got {rate}")
        if not 0.0 < test_fraction < 1.0:
            raise ValueError(f"test_fraction must be in (0, 1), got {test_fraction}")
        self.colours = colours
        self.image_size = image_size
        self.two_shape_rate = two_shape_rate
        self.demo_slip_rate = demo_slip_rate
        self.num_test_tasks = num_test_tasks
        self.test_fraction = test_fraction
        self.zoom = zoom
        self.system_prompt = (
            system_prompt if system_prompt is not None else ZOOM_SYSTEM_PROMPT if zoom else SYSTEM_PROMPT
        )

    # ------------------------------------------------------------------ tasks

    def tasks(self, split: str = "train", seed: int = 0) -> Iterator[Task]:
        if split == "train":
            return self._stream(random.Random(f"visual-train-{seed}"), test=False)
        if split == "test":
            return self._test_set()
        raise ValueError(f"visual env has splits 'train' and 'test', not {split!r}")

    def _test_set(self) -> Iterator[Task]:
        seen: set[str] = set()
        for task in self._stream(random.Random("visual-test"), test=True):
            if task.id not in seen:
                seen.add(task.id)
                yield task
            if len(seen) >= self.num_test_tasks:
                return

    def _stream(self, rng: random.Random, test: bool) -> Iterator[Task]:
        while True:
            task = self.sample_task(rng)
            if (split_bucket(task.id) < self.test_fraction) == test:
                yield task

    def sample_task(self, rng: random.Random) -> Task:
        """One random task (split membership is decided by the caller)."""
        two = rng.random() < self.two_shape_rate
        left, right = rng.sample(self.colours, 2)
        shapes = [self._shape(rng, left, side=0)]
        if two:
            shapes.append(self._shape(rng, right, side=1))
        spec = ";".join(f"{s['kind']},{s['colour']},{s['cx']},{s['cy']},{s['r']},{s['rgb']}" for s in shapes)
        task_id = "visual-" + hashlib.sha1(f"{self.image_size}|{spec}".encode()).hexdigest()[:12]
        return Task(
            id=task_id,
            data={"question": QUESTION, "answer": left, "other": right if two else None, "shapes": shapes},
        )

    def _shape(self, rng: random.Random, colour: str, side: int) -> dict[str, Any]:
        half = self.image_size // 2
        unit = self.image_size / 56
        jitter = round(3 * unit)
        rgb = [min(255, max(0, v + rng.randint(-15, 15))) for v in COLOURS[colour]]
        return {
            "kind": rng.choice(SHAPES),
            "colour": colour,
            "cx": side * half + half // 2 + rng.randint(-jitter, jitter),
            "cy": half + rng.randint(-jitter, jitter),
            "r": rng.randint(round(8 * unit), round(10 * unit)),
            "rgb": rgb,
        }

    def image(self, task: Task) -> bytes:
        """The task's image as PNG bytes (the same bytes every time)."""
        return _png(self._draw(task))

    def half(self, task: Task, side: str) -> bytes:
        """The ``left`` or ``right`` half of the task's image (its middle square), enlarged to the image's size."""
        from PIL import Image

        n, q = self.image_size // 2, self.image_size // 4
        x = 0 if side == "left" else n
        crop = self._draw(task).crop((x, q, x + n, q + n))
        return _png(crop.resize((self.image_size, self.image_size), Image.Resampling.NEAREST))

    def _draw(self, task: Task) -> Any:
        from PIL import Image, ImageDraw

        img = Image.new("RGB", (self.image_size, self.image_size), BACKGROUND)
        draw = ImageDraw.Draw(img)
        for s in task.data["shapes"]:
            cx, cy, r, fill = s["cx"], s["cy"], s["r"], tuple(s["rgb"])
            if s["kind"] == "square":
                draw.rectangle((cx - r, cy - r, cx + r, cy + r), fill=fill)
            elif s["kind"] == "circle":
                draw.ellipse((cx - r, cy - r, cx + r, cy + r), fill=fill)
            else:
                draw.polygon([(cx, cy - r), (cx - r, cy + r), (cx + r, cy + r)], fill=fill)
        return img

    # --------------------------------------------------------------- episode

    def initial_messages(self, task: Task) -> list[Message]:
        content = [{"type": "image", "image": self.image(task)}, {"type": "text", "text": task.data["question"]}]
        return [{"role": "system", "content": self.system_prompt}, {"role": "user", "content": content}]

    def tools(self) -> list[Tool]:
        return [ZoomTool()] if self.zoom else []

    async def setup(self, task: Task) -> dict[str, Any]:
        return {"halves": {side: self.half(task, side) for side in ("left", "right")}} if self.zoom else {}

    async def reward(self, task: Task, state: dict[str, Any], messages: list[Message]) -> dict[str, float]:
        return self.score(task, messages)

    def score(self, task: Task, messages: list[Message]) -> dict[str, float]:
        """The reward components (synchronous, for evaluation scripts)."""
        text = final_assistant_text(messages)
        return {"correct": 1.0 if text is not None and self.named_colours(text) == {task.data["answer"]} else 0.0}

    def named_colours(self, text: str) -> set[str]:
        """The env's colours that ``text`` names (whole words, any case)."""
        return {w for w in _WORD.findall(text.lower()) if w in self.colours}

    def is_success(self, task: Task, reward: float) -> bool:
        return reward >= 1.0

    def eval_group(self, task: Task) -> str:
        return f"{len(task.data['shapes'])} shape" + ("s" if len(task.data["shapes"]) > 1 else "")

    def demonstration(self, task: Task) -> list[Message] | None:
        """The sloppy demonstrator's episode: right on one-shape tasks; on a fixed ``demo_slip_rate``
        fraction of the two-shape tasks it looks at the right shape (zooms into the right half) and
        names its colour instead of the left one's."""
        slip = task.data["other"] is not None and split_bucket("slip " + task.id) < self.demo_slip_rate
        colour = task.data["other"] if slip else task.data["answer"]
        answer = {"role": "assistant", "content": f"The answer is {colour}."}
        if not self.zoom:
            return [*self.initial_messages(task), answer]
        side = "right" if slip else "left"
        call = {"type": "function", "function": {"name": "zoom", "arguments": {"side": side}}}
        return [
            *self.initial_messages(task),
            {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "name": "zoom", "content": [{"type": "image", "image": self.half(task, side)}]},
            answer,
        ]


class ZoomTool(Tool):
    """Show one half of the image, enlarged."""

    name = "zoom"

    async def run(self, side: Literal["left", "right"], state: dict[str, Any]) -> list[dict[str, Any]]:
        """Args:
        side: which half of the image to show
        """
        return [{"type": "image", "image": state["halves"][side]}]


def _png(image: Any) -> bytes:
    out = io.BytesIO()
    image.save(out, format="PNG")
    return out.getvalue()

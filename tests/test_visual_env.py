"""The visual env (examples/visual): seeded PNG images drawn on the fly, an exact reward on the final text only,
and a sloppy demonstrator whose slips only the reward can correct."""

from __future__ import annotations

import io
import itertools
from pathlib import Path

import pytest
import trio
from PIL import Image

from agentrl.envs import demonstrations, load_env
from agentrl.envs.visual import BACKGROUND, COLOURS, QUESTION, VisualEnv

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "visual" / "config.toml"
SHORT_DEMOS, SHORT_SFT_STEPS, SHORT_RL_STEPS = 3200, 300, 24  # the shortened run (the example: 6400, 300, 40)


def _open(png: bytes) -> Image.Image:
    assert png.startswith(b"\x89PNG\r\n\x1a\n")
    image = Image.open(io.BytesIO(png))
    image.load()
    return image


def _near(pixel: tuple[int, ...], colour: str) -> bool:
    return all(abs(a - b) <= 15 for a, b in zip(pixel, COLOURS[colour]))


def test_splits_are_disjoint_deterministic_and_sized():
    env = VisualEnv()
    test = list(env.tasks("test"))
    assert len(test) == 200 and len({t.id for t in test}) == 200
    assert [t.id for t in env.tasks("test", seed=3)] == [t.id for t in test]
    train = list(itertools.islice(env.tasks("train", seed=0), 3000))
    assert not {t.id for t in train} & {t.id for t in test}
    assert [t.id for t in itertools.islice(VisualEnv().tasks("train", seed=0), 50)] == [t.id for t in train[:50]]
    assert [t.id for t in itertools.islice(env.tasks("train", seed=1), 50)] != [t.id for t in train[:50]]
    assert {env.eval_group(t) for t in test} == {"1 shape", "2 shapes"}
    with pytest.raises(ValueError, match="splits 'train' and 'test'"):
        next(env.tasks("dev"))


def test_images_are_seeded_pngs_that_show_the_answer():
    env = VisualEnv()
    tasks = list(itertools.islice(env.tasks("train"), 300))
    assert sum(len(t.data["shapes"]) == 2 for t in tasks) / len(tasks) == pytest.approx(0.7, abs=0.1)
    for task in tasks:
        png = env.image(task)
        assert png == env.image(task) == VisualEnv().image(task)  # the same bytes every time
        image = _open(png)
        assert (image.format, image.mode, image.size) == ("PNG", "RGB", (56, 56))
        left = task.data["shapes"][0]
        assert _near(image.getpixel((left["cx"], left["cy"] + 2)), task.data["answer"])  # type: ignore[arg-type]
        right_half = image.crop((29, 0, 56, 56)).getcolors()
        if task.data["other"] is None:
            assert right_half == [(27 * 56, BACKGROUND)]
        else:
            shape = task.data["shapes"][1]
            assert shape["cx"] > 28 and task.data["other"] != task.data["answer"]
            assert _near(image.getpixel((shape["cx"], shape["cy"] + 2)), task.data["other"])  # type: ignore[arg-type]
    assert len({env.image(t) for t in tasks}) == len(tasks)
    assert _open(VisualEnv(image_size=112).image(next(VisualEnv(image_size=112).tasks()))).size == (112, 112)


def test_user_message_is_an_image_and_the_question():
    env = VisualEnv(system_prompt="Say the colour.")
    task = next(env.tasks())
    system, user = env.initial_messages(task)
    assert system == {"role": "system", "content": "Say the colour."}
    image, text = user["content"]
    assert user["role"] == "user" and image["type"] == "image" and image["image"] == env.image(task)
    assert text == {"type": "text", "text": QUESTION}
    assert env.tools() == [] and trio.run(env.setup, task) == {}


def test_images_are_already_in_agentrl_normal_form():
    from agentrl.images import to_png

    env = VisualEnv()
    png = env.image(next(env.tasks()))
    assert _open(to_png(png)).tobytes() == _open(png).tobytes()


def _score(env: VisualEnv, task, *turns: dict) -> float:
    return trio.run(env.reward, task, {}, [*env.initial_messages(task), *turns])["correct"]


def test_reward_reads_exactly_one_colour_from_the_final_answer():
    env = VisualEnv()
    task = next(t for t in env.tasks() if t.data["other"] is not None)
    answer, other = task.data["answer"], task.data["other"]
    said = lambda text: _score(env, task, {"role": "assistant", "content": text})  # noqa: E731
    assert said(f"The answer is {answer}.") == said(answer.upper()) == said(f"<think>{other}?</think> {answer}") == 1.0
    assert said(f"The answer is {other}.") == 0.0
    assert said(f"{answer} or {other}") == 0.0  # hedging names two colours
    assert said(f"{answer}dish") == said("I cannot see it") == said("") == 0.0
    call = {"type": "function", "function": {"name": "zoom", "arguments": {}}}
    assert _score(env, task, {"role": "assistant", "content": answer, "tool_calls": [call]}) == 0.0
    assert _score(env, task, {"role": "assistant", "content": answer}, {"role": "user", "content": answer}) == 0.0
    assert env.is_success(task, 1.0) and not env.is_success(task, 0.0)


def test_the_demonstrator_slips_on_two_shapes_only_and_always_the_same_way():
    env = VisualEnv(demo_slip_rate=0.7)
    slips = two = right = 0
    tasks = list(itertools.islice(env.tasks("train"), 1000))
    for task in tasks:
        demo = env.demonstration(task)
        assert demo is not None and demo == env.demonstration(task)
        assert demo[:-1] == env.initial_messages(task) and demo[-1]["role"] == "assistant"
        correct = env.score(task, demo)["correct"]
        right += int(correct)
        if task.data["other"] is None:
            assert correct == 1.0
            continue
        two += 1
        if not correct:
            slips += 1
            assert demo[-1]["content"] == f"The answer is {task.data['other']}."
    assert slips / two == pytest.approx(0.7, abs=0.06)
    assert right / len(tasks) == pytest.approx(0.3 + 0.7 * 0.3, abs=0.06)
    assert all(env.score(t, VisualEnv(demo_slip_rate=0.0).demonstration(t) or [])["correct"] for t in tasks)
    records = list(demonstrations(env, 20))
    assert len(records) == 20 and records[0]["tools"] == [] and records[0]["messages"] == env.demonstration(tasks[0])


def test_zoom_returns_the_asked_half_and_the_demonstrator_zooms_where_it_looks():
    from agentrl.tools.base import ToolBox, ToolCall

    env = VisualEnv(zoom=True)
    box = ToolBox(env.tools())
    assert [t.name for t in env.tools()] == ["zoom"] and env.system_prompt.startswith("Zoom")
    assert env.tools()[0].schema()["function"]["parameters"]["properties"]["side"]["enum"] == ["left", "right"]
    sides = set()
    for task in itertools.islice((t for t in env.tasks() if t.data["other"] is not None), 40):
        state = trio.run(env.setup, task)
        for side, colour in [("left", task.data["answer"]), ("right", task.data["other"])]:
            result = trio.run(box.execute, ToolCall("zoom", {"side": side}), state)
            assert not result.is_error and result.content == [{"type": "image", "image": env.half(task, side)}]
            image = _open(env.half(task, side))
            assert image.size == (56, 56) and len(image.getcolors() or []) == 2  # one shape, enlarged
            assert any(_near(c, colour) for _, c in image.getcolors() or [])  # type: ignore[arg-type]
        _, _, call, observation, answer = env.demonstration(task) or []
        side = call["tool_calls"][0]["function"]["arguments"]["side"]
        sides.add(side)
        assert observation == {
            "role": "tool",
            "name": "zoom",
            "content": [{"type": "image", "image": env.half(task, side)}],
        }
        assert (answer["content"] == f"The answer is {task.data['answer']}.") == (side == "left")
    assert sides == {"left", "right"}
    bad = trio.run(box.execute, ToolCall("zoom", {"side": "up"}), trio.run(env.setup, task))
    assert bad.is_error and "one of 'left', 'right'" in str(bad.content)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"colours": ["red"]}, "two or more"),
        ({"colours": ["red", "teal"]}, "two or more"),
        ({"colours": ["red", "red"]}, "two or more"),
        ({"image_size": 60}, "multiple of 28"),
        ({"image_size": 28}, "multiple of 28"),
        ({"two_shape_rate": 1.5}, "two_shape_rate"),
        ({"demo_slip_rate": -0.1}, "demo_slip_rate"),
        ({"test_fraction": 0.0}, "test_fraction"),
    ],
)
def test_bad_knobs_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        VisualEnv(**kwargs)


def test_colours_knob_limits_answers_and_the_reward():
    env = VisualEnv(colours=["orange", "black"], two_shape_rate=1.0)
    tasks = list(itertools.islice(env.tasks(), 40))
    assert {t.data["answer"] for t in tasks} == {t.data["other"] for t in tasks} == {"orange", "black"}
    assert env.named_colours("Red, orange and BLACK.") == {"orange", "black"}


@pytest.fixture(scope="module")
def tiny_vl(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from agentrl.models.builder import init_model

    return init_model(tmp_path_factory.mktemp("visual") / "tiny-vl", "tiny-vl")


@pytest.mark.parametrize("zoom", [False, True])
def test_a_demonstration_is_a_short_sample_that_carries_its_images(tiny_vl: Path, zoom: bool):
    """What SFT trains on: the image pads expanded (4 per 56x56 image), the PNGs beside the tokens, the loss on
    the assistant's tool call and answer only."""
    from transformers import AutoTokenizer

    from agentrl.learner.sft import tokenize_conversation

    tokenizer = AutoTokenizer.from_pretrained(tiny_vl)
    env = VisualEnv(zoom=zoom)
    task = next(t for t in env.tasks() if t.data["other"] is not None)
    demo = env.demonstration(task) or []
    sample = tokenize_conversation(tokenizer, demo, [t.schema() for t in env.tools()])
    pngs = [p["image"] for m in demo if isinstance(m["content"], list) for p in m["content"] if p["type"] == "image"]
    assert len(pngs) == 1 + zoom and sample.images == pngs
    assert list(sample.tokens).count(tokenizer.convert_tokens_to_ids("<|image_pad|>")) == 4 * len(pngs)
    assert sample.num_tokens < (180 if zoom else 70)
    learned = tokenizer.decode(sample.tokens[sample.loss_mask == 1])
    assert learned.endswith(demo[-1]["content"] + "<|im_end|>") and ("zoom" in learned) == zoom
    assert "image_pad" not in learned and "What colour" not in learned


def test_the_example_config_builds_the_env():
    from agentrl.config import load_config
    from agentrl.envs import make_env

    env = make_env(load_config(EXAMPLE))
    assert isinstance(env, VisualEnv) and env.name == "visual" and not env.zoom
    zoom = make_env(load_config(EXAMPLE.with_name("zoom.toml")))
    assert isinstance(zoom, VisualEnv) and zoom.zoom and [t.name for t in zoom.tools()] == ["zoom"]
    assert isinstance(load_env("agentrl.envs.visual:VisualEnv"), VisualEnv)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_shortened_visual_run_learns(tiny_vl: Path, tmp_path: Path):
    """examples/visual shortened: a smaller warm start on the sloppy demonstrations (images through SFT), then
    asynchronous GRPO with images through engine, actors and learner. Greedy success on held-out images rises,
    on the two-shape images the demonstrator got wrong."""
    from agentrl.config import load_config
    from agentrl.run.stages import run

    sets = [
        f"model.path={tiny_vl}",
        f"sft.num_demonstrations={SHORT_DEMOS}",
        f"sft.max_steps={SHORT_SFT_STEPS}",
        f"learner.max_steps={SHORT_RL_STEPS}",
        "eval.num_tasks=100",
        "tracking.enabled=false",
    ]
    summary = run(load_config(EXAMPLE, sets), tmp_path / "run", live_display=False)
    assert summary["learner_steps"] == SHORT_RL_STEPS
    before, after = summary["eval_before"], summary["eval_after"]
    assert before["n"] == after["n"] == 100 and before["n_failed"] == after["n_failed"] == 0
    assert before["success_by_group"]["1 shape"] >= 0.8  # the warm start sees colours
    assert before["success_by_group"]["2 shapes"] <= 0.4  # ... and slips as its demonstrator did
    assert summary["success_rise"] >= 0.1, (before, after)
    assert after["success_by_group"]["2 shapes"] >= before["success_by_group"]["2 shapes"] + 0.1

"""Engine and learner agree on image prompts: a two-turn chat whose second turn follows a tool's image, sampled
by the embedded engine over HTTP (its second turn served from the prefix cache), scored again by the learner's
packed forward. Every model token's logprob matches, as on the text path (tests/test_chaos.py)."""

from __future__ import annotations

import httpx
import numpy as np
import pytest
import torch
import trio
from PIL import Image

from agentrl.engine.client import EngineClient
from agentrl.episode.chat import ChatCodec, TokenChat
from agentrl.images import data_url, to_png
from agentrl.protocol import Trajectory, TrajectoryGroup
from tests.conftest_engine import ENGINE_FLAGS, start_engines


def noise(seed: int, size: tuple[int, int]) -> Image.Image:
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from agentrl.models.builder import build_tiny_vl

    return build_tiny_vl(tmp_path_factory.mktemp("agree") / "tiny-vl", seed=3)


@pytest.fixture(scope="module")
def engine(model_dir, tmp_path_factory):
    (proc,) = start_engines(model_dir, 1, tmp_path_factory.mktemp("agree-logs"), flags=ENGINE_FLAGS)
    yield proc
    proc.stop()


def test_the_openai_endpoint_takes_image_url_parts(engine):
    url = data_url(to_png(noise(5, (56, 56))))
    content = [{"type": "text", "text": "What is it?"}, {"type": "image_url", "image_url": {"url": url}}]
    body = {"messages": [{"role": "user", "content": content}], "max_tokens": 4, "temperature": 0}
    r = httpx.post(engine.url + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] > 4  # the image's 4 pads are in the prompt
    content[1]["image_url"]["url"] = "data:image/png;base64,AAAA"
    bad = httpx.post(engine.url + "/v1/chat/completions", json=body, timeout=60)
    assert bad.status_code == 400 and "not an image" in bad.json()["error"]["message"], bad.text


def test_engine_and_learner_logprobs_agree_across_a_tool_image(model_dir, engine):
    from transformers import AutoTokenizer

    from agentrl.learner.batching import AdvantageSpec, collate, samples_from_group
    from agentrl.learner.model import load_causal_lm, token_logprobs

    codec = ChatCodec(AutoTokenizer.from_pretrained(model_dir))
    chat = TokenChat.start(
        codec,
        [{"role": "user", "content": [{"type": "image", "image": noise(1, (56, 56))}, {"type": "text", "text": "?"}]}],
        None,
    )

    async def turn(rid: str) -> None:
        async with EngineClient([engine.url]) as client:
            out = await client.generate(
                chat.tokens,
                {"max_new_tokens": 6, "temperature": 1.0, "ignore_eos": True, "sampling_seed": 7},
                rid=rid,
                image_data=[data_url(png) for png in chat.images],
            )
        chat.append_model(out.output_ids, out.output_logprobs, [0] * len(out.output_ids))

    trio.run(turn, "t0")
    crop = {
        "role": "tool",
        "content": [{"type": "text", "text": "crop:"}, {"type": "image", "image": noise(2, (84, 56))}],
    }
    assert chat.close_turn_and_add([crop])
    trio.run(turn, "t1")
    assert len(chat.images) == 2 and len(codec.vision.image_spans(chat.tokens)) == 2
    traj = Trajectory(
        tokens=np.asarray(chat.tokens),
        loss_mask=np.asarray(chat.loss_mask),
        behavior_logprobs=np.asarray(chat.logprobs),
        weight_versions=np.asarray(chat.versions),
        reward=1.0,
        images=chat.images,
    )
    group = TrajectoryGroup("g", "t", "visual", [traj, traj], actor_id="a", session="s", seq=0)
    samples = samples_from_group(group, 0, AdvantageSpec())
    model = load_causal_lm(str(model_dir)).eval()
    mb = collate(samples[:1], vision=codec.vision, rope_model=model)
    with torch.no_grad():
        learner, _ = token_logprobs(model, mb)
    mask = mb.loss_mask.bool()
    # position i scores token i + 1 (the last position has no target)
    engine_lp = torch.from_numpy(np.append(np.asarray(chat.logprobs)[1:], 0.0).astype(np.float32))[mask]
    assert mask.sum() == 12
    torch.testing.assert_close(learner[mask], engine_lp, atol=1e-4, rtol=0)
    assert (engine_lp < -1e-3).all()  # sampled tokens of a random model: real logprobs, not zeros

"""The embedded engine on a vision-language model (the tiny Qwen2.5-VL): ``/generate`` with SGLang's
``image_data``, against transformers' own forward.

The reference is ``Qwen2_5_VLForConditionalGeneration(input_ids, pixel_values, image_grid_thw,
mm_token_type_ids)`` on prompt + output: without ``mm_token_type_ids`` transformers gives the text 1-D
positions instead of mRoPE (0.18 away on this model), so the reference passes them, as its processor does.
"""

from __future__ import annotations

import threading
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch
import trio
from PIL import Image

from agentrl.engine.native_api import Completion, RequestError, parse_generate
from agentrl.images import MAX_IMAGE_BYTES, data_url, to_png
from tests.conftest_engine import ENGINE_FLAGS, max_abs_diff, start_engines

CONTEXT = 512
GREEDY = {"max_new_tokens": 6, "temperature": 0.0, "ignore_eos": True}


def image(seed: int, size: tuple[int, int] = (56, 56)) -> bytes:
    """A noise image as PNG bytes (56x56: 4 image tokens; 100x80: 12)."""
    pixels = np.random.default_rng(seed).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    return to_png(Image.fromarray(pixels))


A, B, C = image(1), image(2, (100, 80)), image(3)


@pytest.fixture(scope="module")
def vl_model(tmp_path_factory) -> Path:
    from agentrl.models.builder import build_tiny_vl

    return build_tiny_vl(tmp_path_factory.mktemp("vl_model") / "tiny-vl", seed=0)


@pytest.fixture(scope="module")
def server(vl_model):
    from agentrl.engine.server import EngineServer

    server = EngineServer(str(vl_model), device="cpu", dtype="float32", max_context_tokens=CONTEXT)
    server.start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def hf(vl_model):
    from transformers import Qwen2_5_VLForConditionalGeneration

    return Qwen2_5_VLForConditionalGeneration.from_pretrained(vl_model, dtype=torch.float32).eval()


def prompt(server, *parts: str) -> list[int]:
    """A user turn of the chat template: ``"<image>"`` parts are images (one pad each), the rest text."""
    content = [{"type": "image"} if p == "<image>" else {"type": "text", "text": p} for p in parts]
    text = server.tokenizer.apply_chat_template(
        [{"role": "user", "content": content}], add_generation_prompt=True, tokenize=False
    )
    return server.tokenizer.encode(text, add_special_tokens=False)


def run(server, body: dict) -> list[Completion]:
    """``body`` through the server's own parsing and scheduler; the completions in prompt order."""
    call = server.parse({"return_logprob": True, "sampling_params": GREEDY, **body})
    out: dict[int, Completion] = {}
    done = threading.Condition()

    def on_update(i: int, c: Completion) -> None:
        if c.finish_reason is not None:
            with done:
                out[i] = c
                done.notify()

    server.submit(call, on_update)
    with done:
        assert done.wait_for(lambda: len(out) == len(call.inputs), timeout=120), "the engine did not answer"
    assert all(c.finish_reason == {"type": "length", "length": GREEDY["max_new_tokens"]} for c in out.values()), out
    return [out[i] for i in range(len(call.inputs))]


def hf_logprobs(hf, server, ids: list[int], pngs: list[bytes], output: list[int]) -> tuple[list[float], list[int]]:
    """transformers' logprobs of ``output`` after ``ids`` (expanded) with images ``pngs``, and its greedy tokens."""
    vision = server.runner.vision
    full = torch.tensor([ids + output])
    pixel_values, grid = vision.process(pngs)
    with torch.no_grad():
        logits = hf(
            input_ids=full,
            pixel_values=pixel_values,
            image_grid_thw=grid,
            mm_token_type_ids=(full == vision.image_token_id).int(),
        ).logits[0, len(ids) - 1 : -1]
    lp = torch.log_softmax(logits.float(), dim=-1)
    return lp.gather(1, torch.tensor(output)[:, None])[:, 0].tolist(), logits.argmax(-1).tolist()


def flush(server) -> None:
    assert server.scheduler.call(server.scheduler.flush_cache).result(timeout=60)


def test_greedy_logprobs_equal_a_transformers_forward(server, hf):
    ids = prompt(server, "<image>", "which is brighter?", "<image>")
    (c,) = run(server, {"input_ids": ids, "image_data": [data_url(A), data_url(B)]})
    expanded = server.runner.vision.expand(ids, [A, B])
    assert c.prompt_tokens == len(expanded) == len(ids) - 2 + 4 + 12
    reference, greedy = hf_logprobs(hf, server, expanded, [A, B], c.output_ids)
    assert max_abs_diff(c.output_logprobs, reference) <= 1e-4
    assert c.output_ids == greedy


def test_a_second_turn_from_the_prefix_cache_matches_a_cold_prefill(server, hf):
    """Turn 2 adds a new image after the cached part: its features are computed, the first image's are not needed."""
    flush(server)
    first = server.runner.vision.expand(prompt(server, "<image>", "describe"), [A])
    (one,) = run(server, {"input_ids": first, "image_data": data_url(A)})
    follow = first + one.output_ids + prompt(server, "and this one?", "<image>")
    body = {"input_ids": follow, "image_data": [data_url(A), data_url(B)]}
    (warm,) = run(server, body)
    assert warm.cached_tokens == len(first) + len(one.output_ids) - 1
    flush(server)
    (cold,) = run(server, body)
    assert cold.cached_tokens == 0
    assert warm.output_ids == cold.output_ids
    assert max_abs_diff(warm.output_logprobs, cold.output_logprobs) <= 1e-4
    expanded = server.runner.vision.expand(follow, [A, B])
    reference, _ = hf_logprobs(hf, server, expanded, [A, B], warm.output_ids)
    assert max_abs_diff(warm.output_logprobs, reference) <= 1e-4


def test_the_same_ids_with_another_image_share_no_cached_prefix(server):
    flush(server)
    ids = prompt(server, "<image>", "what is it?")
    (a,) = run(server, {"input_ids": ids, "image_data": data_url(A)})
    follow = server.runner.vision.expand(ids, [A]) + a.output_ids + prompt(server, "sure?")
    (other,) = run(server, {"input_ids": follow, "image_data": data_url(C)})
    assert other.cached_tokens == 0  # keyed by token ids alone, all but the last token would hit
    (same,) = run(server, {"input_ids": follow, "image_data": data_url(A)})
    assert same.cached_tokens == len(ids) - 1 + 4 + len(a.output_ids) - 1
    assert max_abs_diff(other.output_logprobs, same.output_logprobs) > 1e-3


def test_expanded_and_unexpanded_ids_give_the_same_answer(server):
    flush(server)
    ids = prompt(server, "<image>", "count")
    (short,) = run(server, {"input_ids": ids, "image_data": [data_url(B)]})
    flush(server)
    (full,) = run(server, {"input_ids": server.runner.vision.expand(ids, [B]), "image_data": [data_url(B)]})
    assert short.prompt_tokens == full.prompt_tokens == len(ids) + 11
    assert short.output_ids == full.output_ids
    assert max_abs_diff(short.output_logprobs, full.output_logprobs) <= 1e-5


def test_single_and_batch_forms_of_image_data(server, tmp_path):
    """SGLang's forms: one item or a list for one prompt; in a batch one item for all, one per prompt, or lists."""
    one, two = prompt(server, "<image>", "left"), prompt(server, "<image>", "right", "<image>")
    text_only = prompt(server, "no image here")
    path = tmp_path / "b.png"
    path.write_bytes(B)
    (single,) = run(server, {"input_ids": one, "image_data": data_url(A)})
    (listed,) = run(server, {"input_ids": one, "image_data": [data_url(A)]})
    (pair,) = run(server, {"input_ids": two, "image_data": [data_url(A), str(path)]})  # a local path too
    (plain,) = run(server, {"input_ids": text_only})
    for body in (
        {"input_ids": [one, two, text_only], "image_data": [[data_url(A)], [data_url(A), data_url(B)], None]},
        {"input_ids": [one, two, text_only], "image_data": [[data_url(A)], [data_url(A), data_url(B)], []]},
    ):
        batch = run(server, body)
        for got, alone in zip(batch, (single, pair, plain)):
            assert got.output_ids == alone.output_ids
            assert max_abs_diff(got.output_logprobs, alone.output_logprobs) <= 1e-4
    per_prompt = run(server, {"input_ids": [one, one], "image_data": [data_url(A), data_url(C)]})
    for_all = run(server, {"input_ids": [one, one], "image_data": data_url(A)})
    assert per_prompt[0].output_ids == for_all[0].output_ids == for_all[1].output_ids == single.output_ids
    assert max_abs_diff(per_prompt[1].output_logprobs, single.output_logprobs) > 1e-3  # image C, not A
    assert listed.output_ids == single.output_ids


def _refusal(body: dict, vision, context: int = CONTEXT) -> str:
    with pytest.raises(RequestError) as e:
        parse_generate(body, vocab_size=960, context_len=context, encode=lambda t: [5, 6], vision=vision)
    return str(e.value)


def test_every_refusal_names_its_field(server):
    vision = server.runner.vision
    ids = prompt(server, "<image>", "x")
    url = data_url(A)
    assert _refusal({"text": "hi", "image_data": url}, vision).startswith("image_data needs input_ids")
    assert _refusal({"input_ids": ids, "image_data": url}, None).startswith("image_data: the model")
    assert _refusal({"input_ids": ids, "image_data": [url, url]}, vision).startswith("image_data: 2 image(s)")
    assert _refusal({"input_ids": ids, "image_data": "data:image/png;base64,@@"}, vision).startswith("image_data:")
    assert _refusal({"input_ids": ids, "image_data": [7]}, vision).startswith("image_data[0]: expected")
    assert _refusal({"input_ids": ids, "image_data": ["https://x/y.png"]}, vision).startswith(
        "image_data[0]: image URLs"
    )
    too_big = "data:image/png;base64," + "A" * (MAX_IMAGE_BYTES * 4 // 3 + 100)
    assert "MAX_IMAGE_BYTES" in _refusal({"input_ids": ids, "image_data": [too_big]}, vision)
    batch = {"input_ids": [ids, ids]}
    assert _refusal({**batch, "image_data": [url]}, vision).startswith("image_data: The length of image_data")
    assert _refusal({**batch, "image_data": [[url], url]}, vision).startswith("image_data[1] must be a list")
    assert _refusal({**batch, "image_data": [[url], [url, "nope"]]}, vision).startswith("image_data[1]: 2 image(s)")
    assert _refusal({**batch, "image_data": [[url], ["nope"]]}, vision).startswith("image_data[1][0]: ")
    pad = ids.index(vision.image_token_id)
    two_pads = ids[:pad] + [vision.image_token_id] * 2 + ids[pad + 1 :]
    assert _refusal({"input_ids": two_pads, "image_data": url}, vision).startswith(
        "image_data: image 0: its placeholder"
    )
    # the context counts the expanded prompt: 12 tokens for B where the ids hold one pad
    message = _refusal({"input_ids": ids, "image_data": data_url(B)}, vision, context=len(ids) + 10)
    assert f"The input ({len(ids) + 11} tokens)" in message
    # accepted: pads without image_data are plain tokens (as in SGLang), and [] or null entries are no image
    for body in ({"input_ids": ids}, {"input_ids": ids, "image_data": []}, {"input_ids": [ids], "image_data": [None]}):
        for model in (vision, None):  # and a text model ignores image_data that holds no image, as SGLang
            (inp,) = parse_generate(body, vocab_size=960, context_len=CONTEXT, vision=model).inputs
            assert inp.input_ids == ids and inp.images == []


def test_a_real_server_answers_generate_with_image_data(vl_model, server, tmp_path_factory):
    """The engine process: ``/generate`` with image_data (the real client's and a raw batch), /model_info, a 400."""
    from agentrl.engine.client import EngineClient, EngineRequestError

    ids = prompt(server, "<image>", "what is it?")
    (expected,) = run(server, {"input_ids": ids, "image_data": data_url(A)})
    (proc,) = start_engines(vl_model, 1, tmp_path_factory.mktemp("vl_logs"), flags=ENGINE_FLAGS)
    try:
        raw = httpx.post(
            proc.url + "/generate",
            json={"input_ids": [ids, ids], "image_data": [data_url(A), data_url(C)], "sampling_params": GREEDY},
            timeout=120,
        )
        assert raw.status_code == 200, raw.text
        assert raw.json()[0]["output_ids"] == expected.output_ids
        assert raw.json()[0]["meta_info"]["prompt_tokens"] == len(ids) + 3
        assert httpx.get(proc.url + "/model_info", timeout=30).json()["has_image_understanding"] is True
        bad = httpx.post(proc.url + "/generate", json={"input_ids": ids, "image_data": ["x", "y"]}, timeout=30)
        assert bad.status_code == 400 and bad.json()["error"]["message"].startswith("image_data: 2 image(s)")

        async def through_the_client() -> None:
            async with EngineClient([proc.url]) as client:
                got = await client.generate(ids, GREEDY, image_data=[data_url(A)])
                assert got.output_ids == expected.output_ids and got.prompt_tokens == expected.prompt_tokens
                assert max_abs_diff(got.output_logprobs, expected.output_logprobs) <= 1e-4
                with pytest.raises(EngineRequestError, match=r"image_data\[0\]: not base64"):
                    await client.generate(ids, GREEDY, image_data=["@@"])

        trio.run(through_the_client)
    finally:
        proc.stop()


def test_a_saved_vision_model_loads_from_disk_into_the_engine(server, vl_model, tmp_path):
    """transformers saves Qwen2.5-VL in its original layout (model.layers.*, visual.*); the engine's update from
    disk maps it onto its modules (model.language_model.*, model.visual.*) and checks every tensor."""
    from agentrl.engine.weights import EngineWeightReceiver

    receiver = EngineWeightReceiver(server.runner)
    tensors = receiver.load_from_disk(str(vl_model))
    named = server.runner.named_tensors()
    assert any(n.startswith("model.visual.") for n in tensors) and set(tensors) <= set(named)
    assert len(tensors) >= len(named) - 1  # all of them (the tied lm_head may be absent)

"""Images from env and tool to the token-exact chat and the wire (agentrl/images.py, TokenChat, protocol)."""

from __future__ import annotations

import base64
import io

import numpy as np
import pytest
import trio
from PIL import Image

from agentrl.episode.chat import ChatCodec, TokenChat
from agentrl.images import (
    MAX_IMAGE_BYTES,
    ImageError,
    VisionProcessor,
    data_url,
    load_image_data_item,
    message_images,
    to_png,
)
from agentrl.protocol import ProtocolError, Trajectory, TrajectoryGroup, decode, encode
from agentrl.tools.base import ToolBox, ToolCall, tool


def square(colour: tuple[int, int, int], size: int = 56) -> Image.Image:
    return Image.new("RGB", (size, size), colour)


@pytest.fixture(scope="module")
def vl_dir(tmp_path_factory):
    from agentrl.models.builder import build_tiny_vl

    return build_tiny_vl(tmp_path_factory.mktemp("tiny-vl") / "model")


@pytest.fixture(scope="module")
def codec(vl_dir):
    from transformers import AutoTokenizer

    return ChatCodec(AutoTokenizer.from_pretrained(vl_dir))


def test_every_image_form_becomes_the_same_png():
    red = square((255, 0, 0))
    png = to_png(red)
    jpeg = io.BytesIO()
    red.save(jpeg, format="BMP")
    assert to_png(jpeg.getvalue()) == png
    assert to_png(data_url(png)) == png
    assert to_png(base64.b64encode(png).decode()) == png
    assert to_png(square((255, 0, 0)).convert("RGBA")) == png  # RGB whatever the mode


@pytest.mark.parametrize(
    ("bad", "named"),
    [
        (b"not an image", "not an image PIL can read"),
        ("data:image/png,abc", "data:<type>;base64"),
        ("%%%", "not base64"),
        (12, "got int"),
    ],
)
def test_an_unreadable_image_is_named(bad, named):
    with pytest.raises(ImageError, match=named):
        to_png(bad, "tool result")


def test_image_data_items_are_data_urls_base64_or_paths(tmp_path):
    png = to_png(square((0, 0, 255)))
    path = tmp_path / "blue.png"
    path.write_bytes(png)
    assert load_image_data_item(str(path), "image_data[0]") == png
    assert load_image_data_item(data_url(png), "image_data[0]") == png
    with pytest.raises(ImageError, match=r"image_data\[1\].*not fetched"):
        load_image_data_item("https://example.com/a.png", "image_data[1]")
    with pytest.raises(ImageError, match=r"image_data\[2\]"):
        load_image_data_item(["nested"], "image_data[2]")


def test_message_parts_keep_text_and_reference_images():
    png = to_png(square((0, 255, 0)))
    parts, pngs = message_images(
        [{"type": "text", "text": "Look: "}, {"type": "image_url", "image_url": {"url": data_url(png)}}], "m"
    )
    assert pngs == [png]
    assert parts[0] == {"type": "text", "text": "Look: "} and parts[1]["type"] == "image"
    with pytest.raises(ImageError, match="m part 0"):
        message_images([{"type": "audio", "data": "x"}], "m")


def test_the_prompt_is_the_template_with_each_pad_grown_to_its_image(codec):
    """The tokens equal what Qwen's processor makes: the template's text with the i-th pad repeated
    grid.prod() / merge^2 times, tokenized (computed here independently of TokenChat)."""
    images = [square((255, 0, 0)), square((0, 0, 255), size=112)]
    messages = [
        {"role": "system", "content": "Answer with one word."},
        {
            "role": "user",
            "content": [
                {"type": "image", "image": images[0]},
                {"type": "text", "text": "and"},
                {"type": "image", "image": images[1]},
                {"type": "text", "text": "What colours?"},
            ],
        },
    ]
    chat = TokenChat.start(codec, messages, None)
    tok = codec.tokenizer
    rendered = tok.apply_chat_template(
        [
            messages[0],
            {
                "role": "user",
                "content": [
                    {"type": "image"},
                    {"type": "text", "text": "and"},
                    {"type": "image"},
                    {"type": "text", "text": "What colours?"},
                ],
            },
        ],
        tokenize=False,
        add_generation_prompt=True,
    )
    processor = codec.vision.image_processor
    counts = [int(processor(images=[im], return_tensors="pt")["image_grid_thw"][0].prod()) // 4 for im in images]
    assert counts == [4, 16]
    pieces = rendered.split("<|image_pad|>")
    expected_text = pieces[0] + "".join("<|image_pad|>" * n + rest for n, rest in zip(counts, pieces[1:]))
    assert chat.tokens == tok.encode(expected_text, add_special_tokens=False)
    assert chat.text == codec.decode(chat.tokens) == expected_text
    assert chat.images == [to_png(im) for im in images]
    assert codec.vision.image_spans(chat.tokens) and len(codec.vision.image_spans(chat.tokens)) == 2
    assert "sha256" in chat.messages[1]["content"][0]  # recorded messages hold a digest, not the pixels


def test_a_tool_image_joins_the_prompt_of_the_next_turn_only(codec):
    chat = TokenChat.start(codec, [{"role": "user", "content": "Zoom in."}], None)
    assert chat.images == []
    call = '<tool_call>\n{"name": "zoom", "arguments": {}}\n</tool_call>'
    ids = codec.encode(call) + [codec.end_of_turn_id]
    chat.append_model(ids, [-0.5] * len(ids), [3] * len(ids))
    before = len(chat.tokens)
    crop = square((10, 200, 30))
    tool_message = {"role": "tool", "name": "zoom", "content": [{"type": "image", "image": crop}]}
    assert chat.close_turn_and_add([tool_message])
    assert chat.images == [to_png(crop)]
    ((start, end),) = codec.vision.image_spans(chat.tokens)
    assert start >= before and end - start == 4
    assert all(m == 0 for m in chat.loss_mask[before:])  # the observation is not the model's
    assert chat.text == codec.decode(chat.tokens)


def test_an_observation_with_an_image_that_does_not_fit_leaves_the_images_unchanged(codec):
    chat = TokenChat.start(codec, [{"role": "user", "content": "Zoom in."}], None)
    chat.append_model([codec.end_of_turn_id], [-0.1], [0])
    tool_message = {"role": "tool", "content": [{"type": "image", "image": square((1, 2, 3), size=224)}]}
    assert not chat.close_turn_and_add([tool_message], max_len=len(chat.tokens) + 10)
    assert chat.images == [] and codec.vision.image_spans(chat.tokens) == []


def test_a_text_model_refuses_images_by_name_and_joins_text_parts(tmp_path_factory):
    from transformers import AutoTokenizer

    from tests._actors_helpers import tiny_tokenizer_dir

    codec = ChatCodec(AutoTokenizer.from_pretrained(tiny_tokenizer_dir(tmp_path_factory)))
    assert codec.vision is None
    with pytest.raises(ImageError, match="text-only"):
        TokenChat.start(codec, [{"role": "user", "content": [{"type": "image", "image": square((0, 0, 0))}]}], None)
    chat = TokenChat.start(
        codec, [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}], None
    )
    assert chat.messages[0]["content"] == "ab"


def test_expand_refuses_a_placeholder_of_the_wrong_length(vl_dir):
    vision = VisionProcessor.load(vl_dir)
    assert vision is not None
    png = to_png(square((9, 9, 9)))
    pad = vision.image_token_id
    assert vision.expand([1, pad, 2], [png]) == [1, pad, pad, pad, pad, 2]
    assert vision.expand([1, pad, pad, pad, pad, 2], [png]) == [1, pad, pad, pad, pad, 2]
    with pytest.raises(ImageError, match="image 0: its placeholder has 2"):
        vision.expand([1, pad, pad, 2], [png])
    with pytest.raises(ImageError, match="1 image placeholders and 2 images"):
        vision.expand([1, pad, 2], [png, png])


def test_cache_keys_differ_by_image_and_match_by_image(vl_dir):
    vision = VisionProcessor.load(vl_dir)
    assert vision is not None
    red, blue = to_png(square((255, 0, 0))), to_png(square((0, 0, 255)))
    ids = vision.expand([5, vision.image_token_id, 6], [red])
    assert vision.cache_key(ids, [red]) == vision.cache_key(ids, [to_png(square((255, 0, 0)))])
    assert vision.cache_key(ids, [red]) != vision.cache_key(ids, [blue])
    assert vision.cache_key(ids, [red])[0] == 5 and min(vision.cache_key(ids, [red])) < 0


def test_a_tool_may_answer_with_an_image_and_a_broken_one_is_an_error_observation():
    @tool
    def zoom() -> object:
        """Zoom in."""
        return [{"type": "text", "text": "here"}, square((1, 1, 1))]

    @tool
    def broken() -> object:
        """Broken."""
        return [{"type": "image", "image": b"garbage"}]

    @tool
    def numbers() -> object:
        """Numbers."""
        return [1, 2, 3]

    box = ToolBox([zoom, broken, numbers])

    async def main():
        return [await box.execute(ToolCall(name, {})) for name in ("zoom", "broken", "numbers")]

    ok, bad, plain = trio.run(main)
    assert ok.content == [{"type": "text", "text": "here"}, {"type": "image", "image": to_png(square((1, 1, 1)))}]
    assert bad.is_error and bad.error_kind == "crash" and "cannot be read" in str(bad.content)
    assert plain.content == "[1, 2, 3]" and not plain.is_error


def _group(images: list) -> TrajectoryGroup:
    t = Trajectory(
        tokens=np.arange(4),
        loss_mask=np.array([0, 0, 1, 1]),
        behavior_logprobs=np.zeros(4),
        weight_versions=np.array([-1, -1, 0, 0]),
        reward=1.0,
        images=images,
    )
    return TrajectoryGroup("g", "t", "env", [t], actor_id="a", session="s", seq=0)


def test_images_travel_as_png_bytes_and_the_wire_checks_them():
    png = to_png(square((4, 5, 6)))
    back = decode(encode(_group([png, png])))
    assert isinstance(back, TrajectoryGroup) and back.trajectories[0].images == [png, png]
    import msgpack

    wire = msgpack.unpackb(encode(_group([png])), raw=False)
    wire["trajectories"][0]["images"] = ["a string"]
    with pytest.raises(ProtocolError, match="'images' item 0 has type str"):
        decode(msgpack.packb(wire))
    wire["trajectories"][0]["images"] = [b"x" * (MAX_IMAGE_BYTES + 1)]
    with pytest.raises(ProtocolError, match="more than"):
        decode(msgpack.packb(wire))


def test_the_tiny_vl_model_reads_an_image_in_transformers(vl_dir, codec):
    """init-model --size tiny-vl loads with AutoModelForImageTextToText and runs a forward on a prompt with an
    image (with mRoPE positions), whose image tokens change the next-token distribution."""
    import torch
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(vl_dir).eval()
    vision = codec.vision

    def logits(colour):
        chat = TokenChat.start(codec, [{"role": "user", "content": [{"type": "image", "image": square(colour)}]}], None)
        pixels, grid = vision.process(chat.images)
        ids = torch.tensor([chat.tokens])
        with torch.no_grad():
            out = model(
                input_ids=ids,
                pixel_values=pixels,
                image_grid_thw=grid,
                mm_token_type_ids=(ids == vision.image_token_id).int(),
            )
        return out.logits[0, -1]

    red, blue = logits((255, 0, 0)), logits((0, 0, 255))
    assert torch.isfinite(red).all() and not torch.allclose(red, blue)

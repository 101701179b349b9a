"""Images in agentrl: one normal form (RGB PNG bytes) and one processor, shared by episode, engine and learner.

* Every image an env or tool gives (a PIL image, the bytes of any format PIL reads, a ``data:`` URL or plain
  base64) becomes RGB PNG bytes (:func:`to_png`) as soon as it enters an episode. Those bytes travel everywhere:
  to the engine as SGLang's ``image_data`` (a data URL), to the learner inside the trajectory. PNG is lossless, so
  every side decodes the same pixels.
* :class:`VisionProcessor` wraps the model's own image processor (``AutoImageProcessor``: Qwen2-VL's patching,
  resizing and normalisation) and the tokenizer's vision tokens. The engine and the learner both call
  :meth:`VisionProcessor.process` on the same bytes, so their pixel values, and so their log-probabilities, agree.
* A prompt holds each image as a run of image-pad tokens, one per merged patch (Qwen2.5-VL: a 56x56 image is a
  4x4 patch grid merged 2x2 into 4 pads). A chat template writes one pad per image; :meth:`VisionProcessor.expand`
  makes it the run, as the processor (and SGLang) do.
* mRoPE (:meth:`VisionProcessor.rope_positions`) comes from the model's own ``get_rope_index``; text after the
  prompt sits at ``index + delta`` on all three axes.
* Prefix caches key prompts by :meth:`VisionProcessor.cache_key`: pads replaced by a value drawn from the image's
  digest, so two prompts that differ only in an image never share cached K/V.
"""

from __future__ import annotations

import base64
import binascii
import functools
import hashlib
import io
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

MAX_IMAGE_BYTES = 4 << 20  # PNG bytes of one image
MAX_IMAGE_PIXELS = 4096 * 4096  # what PIL may decode (a decompression bomb is an error, not a hang)


class ImageError(ValueError):
    """An image that cannot be read, or one that does not fit the prompt it comes with."""


def to_png(image: Any, where: str = "image") -> bytes:
    """``image`` (PIL image, bytes of any format PIL reads, a ``data:`` URL or base64 str) as RGB PNG bytes."""
    from PIL import Image

    if isinstance(image, str):
        image = _b64decode(image, where)
    if isinstance(image, (bytes, bytearray, memoryview)):
        image = _open(bytes(image), where)
    if not isinstance(image, Image.Image):
        raise ImageError(
            f"{where}: expected a PIL image, image bytes, a data URL or base64, got {type(image).__name__}"
        )
    if image.width * image.height > MAX_IMAGE_PIXELS:
        raise ImageError(f"{where}: {image.width}x{image.height} pixels is more than {MAX_IMAGE_PIXELS}")
    buf = io.BytesIO()
    image.convert("RGB").save(buf, format="PNG")
    png = buf.getvalue()
    if len(png) > MAX_IMAGE_BYTES:
        raise ImageError(f"{where}: {len(png)} PNG bytes is more than MAX_IMAGE_BYTES={MAX_IMAGE_BYTES}")
    return png


def _b64decode(text: str, where: str) -> bytes:
    if text.startswith("data:"):
        head, sep, text = text.partition(",")
        if not sep or not head.endswith(";base64"):
            raise ImageError(f"{where}: a data URL must be data:<type>;base64,<data>")
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError) as e:
        raise ImageError(f"{where}: not base64 ({e})") from None


def _open(data: bytes, where: str) -> Any:
    from PIL import Image

    Image.MAX_IMAGE_PIXELS = MAX_IMAGE_PIXELS
    try:
        image = Image.open(io.BytesIO(data))
        image.load()
    except Exception as e:  # PIL raises many types for bad data (UnidentifiedImageError, OSError, SyntaxError...)
        raise ImageError(f"{where}: not an image PIL can read ({type(e).__name__}: {e})") from None
    return image


def decode_png(png: bytes, where: str = "image") -> Any:
    """The PIL image of PNG bytes (as :func:`to_png` wrote them); :class:`ImageError` for anything else."""
    if len(png) > MAX_IMAGE_BYTES:
        raise ImageError(f"{where}: {len(png)} bytes is more than MAX_IMAGE_BYTES={MAX_IMAGE_BYTES}")
    image = _open(png, where)
    if image.format != "PNG":
        raise ImageError(f"{where}: expected PNG bytes, got {image.format}")
    return image.convert("RGB")


def digest(png: bytes) -> str:
    return hashlib.sha256(png).hexdigest()


def data_url(png: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(png).decode("ascii")


def load_image_data_item(item: Any, where: str) -> bytes:
    """One item of SGLang's ``image_data`` (a data URL, base64, or a local file path) as PNG bytes."""
    if not isinstance(item, str) or not item:
        raise ImageError(f"{where}: expected a non-empty string (data URL, base64 or file path), got {item!r:.60}")
    if item.startswith(("http://", "https://")):
        raise ImageError(f"{where}: image URLs are not fetched by this engine; send a data URL or base64")
    if not item.startswith("data:") and len(item) < 4096:
        path = Path(item)
        try:
            if path.is_file():
                return to_png(path.read_bytes(), where)
        except OSError:
            pass
    return to_png(item, where)


class VisionProcessor:
    """The model's image processor and vision tokens (see the module docstring)."""

    def __init__(self, image_processor: Any, image_token_id: int, vision_start_id: int, vision_end_id: int):
        self.image_processor = image_processor
        self.image_token_id = image_token_id
        self.vision_start_id = vision_start_id
        self.vision_end_id = vision_end_id
        self.merge_size = int(getattr(image_processor, "merge_size", 1))
        # pixel values are large (a 1-megapixel image is ~20 MB): a few are kept, for the samples of one group;
        # grids are small and asked for often (every prompt's expansion)
        self._processed = functools.lru_cache(maxsize=32)(self._process_one)
        self._grids = functools.lru_cache(maxsize=4096)(lambda png: tuple(self._processed(png)[1][0].tolist()))

    @classmethod
    def load(cls, model_path: str | Path) -> VisionProcessor | None:
        """The processor of a vision-language model; None for a text-only model (no ``vision_config``)."""
        config_file = Path(model_path) / "config.json"
        config = json.loads(config_file.read_text()) if config_file.is_file() else {}
        if "vision_config" not in config:
            return None
        from transformers import AutoImageProcessor

        pad, start, end = (config.get(k) for k in ("image_token_id", "vision_start_token_id", "vision_end_token_id"))
        if not (isinstance(pad, int) and isinstance(start, int) and isinstance(end, int)):
            raise ImageError(f"{config_file}: a vision config needs image/vision_start/vision_end token ids")
        return cls(AutoImageProcessor.from_pretrained(str(model_path)), pad, start, end)

    def _process_one(self, png: bytes) -> tuple[Any, Any]:
        out = self.image_processor(images=[decode_png(png)], return_tensors="pt")
        return out["pixel_values"].float(), out["image_grid_thw"].long()

    def process(self, pngs: Sequence[bytes]) -> tuple[Any, Any]:
        """``(pixel_values [P, D] float32, image_grid_thw [I, 3] long)`` of the images, in order."""
        import torch

        if not pngs:
            raise ImageError("process() needs at least one image")
        parts = [self._processed(bytes(p)) for p in pngs]
        return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])

    def num_tokens(self, png: bytes) -> int:
        t, h, w = self._grids(bytes(png))
        return t * h * w // self.merge_size**2

    def image_spans(self, ids: Sequence[int]) -> list[tuple[int, int]]:
        """``(start, end)`` (end exclusive) of each run of image pads in ``ids``."""
        spans: list[tuple[int, int]] = []
        pad, start = self.image_token_id, -1
        for i, t in enumerate(ids):
            if t == pad and start < 0:
                start = i
            elif t != pad and start >= 0:
                spans.append((start, i))
                start = -1
        if start >= 0:
            spans.append((start, len(ids)))
        return spans

    def expand(self, ids: Sequence[int], pngs: Sequence[bytes]) -> list[int]:
        """``ids`` with each image's pad run as long as the image's token count (a run of one is expanded)."""
        spans = self.image_spans(ids)
        if len(spans) != len(pngs):
            raise ImageError(f"the prompt has {len(spans)} image placeholders and {len(pngs)} images")
        out: list[int] = []
        last = 0
        for i, ((start, end), png) in enumerate(zip(spans, pngs)):
            n = self.num_tokens(png)
            if end - start not in (1, n):
                raise ImageError(f"image {i}: its placeholder has {end - start} pad tokens; the image needs {n}")
            out.extend(ids[last:start])
            out.extend([self.image_token_id] * n)
            last = end
        out.extend(ids[last:])
        return out

    def check(self, ids: Sequence[int], pngs: Sequence[bytes]) -> None:
        """:class:`ImageError` unless ``ids`` hold exactly one full-length pad run per image."""
        spans = self.image_spans(ids)
        if len(spans) != len(pngs):
            raise ImageError(f"{len(spans)} image placeholders and {len(pngs)} images")
        for i, ((start, end), png) in enumerate(zip(spans, pngs)):
            if end - start != self.num_tokens(png):
                raise ImageError(f"image {i}: {end - start} pad tokens, the image needs {self.num_tokens(png)}")

    def rope_positions(self, model: Any, ids: Sequence[int], grid_thw: Any) -> tuple[Any, int]:
        """mRoPE position ids ``[3, T]`` of ``ids`` (with images of ``grid_thw``) from the model's own
        ``get_rope_index``, and the delta of the text positions after them."""
        import torch

        inner = model.model if hasattr(model, "model") and hasattr(model.model, "get_rope_index") else model
        input_ids = torch.as_tensor(list(ids), dtype=torch.long)[None]
        mm_types = (input_ids == self.image_token_id).int()
        position_ids, delta = inner.get_rope_index(input_ids, mm_types, image_grid_thw=grid_thw)
        return position_ids[:, 0], int(delta.reshape(-1)[0])

    def cache_key(self, ids: Sequence[int], pngs: Sequence[bytes]) -> tuple[int, ...]:
        """``ids`` with each image's pads replaced by a negative value derived from that image's digest."""
        key = list(ids)
        for (start, end), png in zip(self.image_spans(ids), pngs):
            mark = -1 - int(digest(png)[:15], 16)
            key[start:end] = [mark] * (end - start)
        return tuple(key)


def message_images(content: Any, where: str) -> tuple[Any, list[bytes]]:
    """A message's content with its images taken out: ``(content for the chat template, PNG bytes in order)``.

    A string is returned as is. A list of parts keeps its text parts; an image part -- OpenAI's
    ``{"type": "image_url", "image_url": {"url": ...}}`` or agentrl's ``{"type": "image", "image": ...}`` (a PIL
    image, bytes, a data URL or base64) -- becomes ``{"type": "image", "sha256": <digest>}``, which the template
    renders as one image placeholder and which keeps recorded messages small."""
    if isinstance(content, str):
        return content, []
    if not isinstance(content, list):
        raise ImageError(f"{where}: content must be a string or a list of parts, got {type(content).__name__}")
    parts: list[dict[str, Any]] = []
    pngs: list[bytes] = []
    for i, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text" and isinstance(part.get("text"), str):
            parts.append({"type": "text", "text": part["text"]})
            continue
        if kind == "image_url":
            url = part.get("image_url")
            url = url.get("url") if isinstance(url, dict) else url
            png = to_png(url, f"{where} part {i}") if isinstance(url, str) else None
        elif kind == "image" and "image" in part:
            png = to_png(part["image"], f"{where} part {i}")
        elif kind == "image" and "sha256" in part:  # already taken out: its bytes are not here
            raise ImageError(f"{where} part {i}: an image reference without its image")
        else:
            png = None
        if png is None:
            raise ImageError(
                f"{where} part {i}: expected {{'type': 'text', 'text': str}}, {{'type': 'image', 'image': ...}} "
                f"or {{'type': 'image_url', 'image_url': {{'url': ...}}}}, got {part!r:.80}"
            )
        pngs.append(png)
        parts.append({"type": "image", "sha256": digest(png)})
    return parts, pngs

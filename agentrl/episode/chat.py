"""Token-in/token-out bookkeeping: one episode as token ids that always decode to its chat.

:class:`TokenChat` keeps the engine's view (token ids) and the env's view (chat messages) of one episode in
lock-step: ``tokens`` are exactly what the model was given and generated, and ``decode(tokens) == text`` after
every step.

* The prompt is ``apply_chat_template(messages, tools, add_generation_prompt=True)``, non-model tokens.
* Model tokens are appended exactly as the engine returned them, with their logprobs and weight versions,
  and are never re-tokenized; the assistant message's content is their raw decoded text.
* Everything else (the template's closing text, tool results, user replies, the next generation prompt) is
  rendered after a fixed *probe* conversation (:meth:`ChatCodec.suffix`), tokenized on its own and
  appended with ``loss_mask`` 0, logprob 0, version -1. The probe makes templates that rewrite history
  (Qwen3, Llama 3) safe: the tokens keep the text the model really saw.
* A turn that stopped by length gets the template's whole closing text; the loop reserves room for it, so
  an episode never exceeds ``max_total_tokens``.

Images (a vision-language model): a message's content may be a list of text and image parts; the images
become PNG bytes in ``images`` (in token order) and each one's single template placeholder becomes its run of
image pads (agentrl/images.py). Rendering shortcuts (the compiled Jinja template, the Rust tokenizer, a
per-group prompt cache) are checked against the plain transformers calls. See docs/episode.md.
"""

from __future__ import annotations

import json
import weakref
from array import array
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from agentrl.images import ImageError, VisionProcessor, message_images

Message = dict[str, Any]

_SENTINEL = "\x00agentrl-sentinel\x00"
_PROBE_TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "f",
            "description": "d",
            "parameters": {"type": "object", "properties": {"x": {"type": "string"}}, "required": ["x"]},
        },
    }
]
_PROBE = [
    {"role": "system", "content": "s"},
    {"role": "user", "content": "u <b>&"},
    {"role": "assistant", "content": '<tool_call>\n{"name": "f", "arguments": {"x": "1"}}\n</tool_call>'},
    {"role": "tool", "name": "f", "content": "r1"},
    {"role": "tool", "content": "r2"},
    {"role": "assistant", "content": "a"},
    {"role": "user", "content": "again"},
    {"role": "assistant", "content": ""},
]
# the fixed conversation that new messages are rendered after (see the module docstring)
_PROBE_USER: Message = {"role": "user", "content": "u"}
_PROBE_TURN: Message = {"role": "assistant", "content": _SENTINEL}
_PLAIN_KEYS = frozenset({"role", "content", "name"})


def _plain(message: Message) -> bool:
    return message.keys() <= _PLAIN_KEYS and all(isinstance(v, str) for v in message.values())


class TemplateMismatch(ValueError):
    """The chat template does not render messages in a way token-in/token-out can follow."""


class ChatCodec:
    """A tokenizer plus its chat template, with the few operations the agent loop needs.

    Built once per tokenizer (see :func:`codec_for`); stateless after construction.
    """

    def __init__(self, tokenizer: Any, *, prompt_cache_size: int = 256, vision: VisionProcessor | None = None):
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError(f"tokenizer {getattr(tokenizer, 'name_or_path', tokenizer)!r} has no chat template")
        self.tokenizer = tokenizer
        # the model's image processor when the tokenizer's directory holds a vision-language model
        self.vision = vision if vision is not None else _vision_of(tokenizer)
        self._backend = getattr(tokenizer, "backend_tokenizer", None)  # the Rust tokenizer, when fast
        self._fast = self._fast_renderer()
        self._prompts: OrderedDict[str, tuple[list[int], str]] = OrderedDict()
        self._prompt_cache_size = prompt_cache_size
        suffix = self.suffix([], None, add_generation_prompt=False)
        self.assistant_suffix = suffix  # the template's text after an assistant message, e.g. "<|im_end|>\n"
        suffix_ids = self.encode(suffix)
        self.reserve_tokens = len(suffix_ids)  # room kept for closing a turn the model did not close
        # The template's end-of-turn token: the suffix's first token when it is an added/special token
        # (<|im_end|>, <|eot_id|>). A model turn that stops on it has its content decoded without it.
        added = set(tokenizer.get_added_vocab().values()) | set(tokenizer.all_special_ids)
        first = suffix_ids[0] if suffix_ids else None
        self.end_of_turn_id: int | None = first if first in added else None
        self.end_of_turn_text = self.decode([self.end_of_turn_id]) if self.end_of_turn_id is not None else ""

    # ----------------------------------------------------------------- primitives

    def render(
        self, messages: list[Message], tools: list[dict] | None, add_generation_prompt: bool, plain: bool | None = None
    ) -> str:
        """``apply_chat_template(messages, tools, tokenize=False)``, through the compiled template when
        the messages are plain string dicts (what the loop writes), which skips transformers' copying.
        ``plain=True`` vouches for that without checking every message."""
        if plain is None:
            plain = all(_plain(m) for m in messages)
        if self._fast is not None and plain:
            return self._fast(messages, tools or None, add_generation_prompt)
        return self.tokenizer.apply_chat_template(
            messages, tools=tools or None, add_generation_prompt=add_generation_prompt, tokenize=False
        )

    def prompt(self, messages: list[Message], tools: list[dict] | None) -> tuple[list[int], str]:
        """The prompt's ids and text; the same as ``apply_chat_template(..., add_generation_prompt=True,
        tokenize=True)``. Cached: the ``n`` samples of a group share their prompt. Image parts must already
        be taken out (:meth:`take_images`); their pads are expanded by the caller."""
        key = json.dumps([messages, tools], sort_keys=True, default=str)
        hit = self._prompts.get(key)
        if hit is None:
            text = self.render(messages, tools, add_generation_prompt=True)
            hit = (self.encode(text), text)
            self._prompts[key] = hit
            if len(self._prompts) > self._prompt_cache_size:
                self._prompts.popitem(last=False)
        else:
            self._prompts.move_to_end(key)
        return list(hit[0]), hit[1]

    def suffix(self, new_messages: list[Message], tools: list[dict] | None, add_generation_prompt: bool) -> str:
        """The template's text after an assistant message's content when ``new_messages`` follow it, then
        the generation prompt if asked: ``<|im_end|>\\n<|im_start|>user\\n<tool_response>\\n...`` for Qwen.

        Rendered after the fixed probe ``[user, assistant SENTINEL]``, never after an episode's history,
        so a template that rewrites earlier turns cannot change it; the probe's preamble (system
        prompt, tools) comes before the sentinel and is cut off."""
        messages = [_PROBE_USER, _PROBE_TURN, *new_messages]
        rendered = self.render(messages, tools, add_generation_prompt, plain=all(_plain(m) for m in new_messages))
        at = rendered.find(_SENTINEL)
        if at < 0:
            raise TemplateMismatch(
                "the chat template does not render an assistant message's content verbatim; "
                "token-in/token-out cannot find where the model's text ends"
            )
        return rendered[at + len(_SENTINEL) :]

    def context_after_turn(
        self, model_ended_turn: bool, new_messages: list[Message], tools: list[dict] | None, add_generation_prompt: bool
    ) -> str:
        """The non-model text after a model turn: :meth:`suffix`, less the end-of-turn token when the model
        generated it (``model_ended_turn``)."""
        text = self.suffix(new_messages, tools, add_generation_prompt)
        if not model_ended_turn:
            return text
        if not text.startswith(self.end_of_turn_text):
            raise TemplateMismatch(
                f"the chat template closes an assistant turn with {text[:40]!r} here, not with "
                f"the end-of-turn token {self.end_of_turn_text!r} the model stopped on"
            )
        return text[len(self.end_of_turn_text) :]

    def assistant_text(self, message: Message, tools: list[dict] | None) -> str:
        """What a model generates for the assistant ``message``: the template's rendering of it as the latest
        turn, from the end of the generation prompt through the end-of-turn token (Qwen3:
        ``<think>\\n...\\n</think>\\n\\n`` + content + tool calls + ``<|im_end|>``). Rendered after the probe's
        user message, like :meth:`suffix`, so earlier turns cannot change it."""
        head = self.render([_PROBE_USER], tools, add_generation_prompt=True)
        full = self.render([_PROBE_USER, message], tools, add_generation_prompt=False)
        suffix = self.suffix([], tools, add_generation_prompt=False)
        if not full.startswith(head) or not full.endswith(suffix):
            raise TemplateMismatch(
                "the chat template does not render an assistant message as its generation "
                f"prompt + the message + {suffix!r} (got {full[len(head) - 40 :]!r})"
            )
        return full[len(head) : len(full) - len(suffix)] + self.end_of_turn_text

    def _fast_renderer(self) -> Callable[[list[Message], list[dict] | None, bool], str] | None:
        """transformers' own compiled (sandboxed) template, called directly; used only when it renders
        probe chats exactly as ``apply_chat_template`` does."""
        template = self.tokenizer.chat_template
        try:
            from transformers.utils.chat_template_utils import _compile_jinja_template

            compiled = _compile_jinja_template(template) if isinstance(template, str) else None
        except Exception:  # a transformers without it: the slow path is still exact
            compiled = None
        if compiled is None:
            return None
        kwargs = dict(self.tokenizer.special_tokens_map)

        def fast(messages: list[Message], tools: list[dict] | None, add_generation_prompt: bool) -> str:
            return compiled.render(
                messages=messages, tools=tools, documents=None, add_generation_prompt=add_generation_prompt, **kwargs
            )

        for tools in (None, _PROBE_TOOLS):
            for gen in (False, True):
                try:
                    same = fast(_PROBE, tools, gen) == self.tokenizer.apply_chat_template(
                        _PROBE, tools=tools, add_generation_prompt=gen, tokenize=False
                    )
                except Exception:
                    same = False
                if not same:
                    return None
        return fast

    def encode(self, text: str) -> list[int]:
        if self._backend is not None:
            return self._backend.encode(text, add_special_tokens=False).ids
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def take_images(self, messages: list[Message], where: str) -> tuple[list[Message], list[bytes]]:
        """``messages`` with image parts replaced by references (agentrl.images.message_images), and the images'
        PNG bytes in order. A text-only model given an image: :class:`ImageError`."""
        out: list[Message] = []
        pngs: list[bytes] = []
        for i, m in enumerate(messages):
            content = m.get("content")
            if isinstance(content, list):
                content, found = message_images(content, f"{where} message {i} ({m.get('role')})")
                if not found:  # text parts only: one string, which every chat template renders
                    content = "".join(part["text"] for part in content)
                m = {**m, "content": content}
                pngs.extend(found)
            out.append(m)
        if pngs and self.vision is None:
            raise ImageError(
                f"{where}: {len(pngs)} image(s), but the model at {getattr(self.tokenizer, 'name_or_path', '?')!r} "
                "is text-only (its config.json has no vision_config)"
            )
        return out, pngs

    def expand_images(self, text: str, pngs: list[bytes]) -> tuple[list[int], str]:
        """The ids and text of rendered ``text`` with each image's placeholder pad grown to its token count."""
        ids = self.encode(text)
        if not pngs:
            return ids, text
        assert self.vision is not None, "take_images refuses images for a text-only model"
        expanded = self.vision.expand(ids, pngs)
        return expanded, self.decode(expanded)

    def decode(self, ids: list[int]) -> str:
        if self._backend is not None:
            return self._backend.decode(list(ids), skip_special_tokens=False)
        return self.tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)


def _vision_of(tokenizer: Any) -> VisionProcessor | None:
    path = getattr(tokenizer, "name_or_path", "")
    return VisionProcessor.load(path) if path and Path(path).is_dir() else None


_CODECS: weakref.WeakKeyDictionary[Any, ChatCodec] = weakref.WeakKeyDictionary()


def codec_for(tokenizer: Any) -> ChatCodec:
    """The (cached) :class:`ChatCodec` of a Hugging Face tokenizer; a codec is returned as is."""
    if isinstance(tokenizer, ChatCodec):
        return tokenizer
    codec = _CODECS.get(tokenizer)
    if codec is None:
        codec = ChatCodec(tokenizer)
        _CODECS[tokenizer] = codec
    return codec


@dataclass
class TokenChat:
    """One episode's tokens and messages, kept so that the tokens always decode to the chat."""

    codec: ChatCodec
    tools: list[dict] | None
    messages: list[Message]
    tokens: list[int] = field(default_factory=list)
    # typed arrays: they become the trajectory's numpy arrays without a per-element conversion
    loss_mask: array = field(default_factory=lambda: array("B"))
    logprobs: array = field(default_factory=lambda: array("f"))
    versions: array = field(default_factory=lambda: array("i"))
    text: str = ""  # == decode(tokens): the chat as the model saw it
    images: list[bytes] = field(default_factory=list)  # PNG bytes, in the order of their pad runs in tokens
    turn_start: int = 0  # index of the current model turn's first token
    _turn_cache: tuple = ((-1, -1), "", "")

    @classmethod
    def start(cls, codec: ChatCodec, messages: list[Message], tools: list[dict] | None) -> TokenChat:
        """The chat of a prompt; image parts in ``messages`` are taken out into ``images`` (ImageError when
        one cannot be read or the model is text-only)."""
        plain, pngs = codec.take_images([dict(m) for m in messages], "the prompt")
        chat = cls(codec=codec, tools=tools or None, messages=plain)
        ids, text = codec.prompt(chat.messages, chat.tools)
        if pngs:
            ids, text = codec.expand_images(text, pngs)
            chat.images.extend(pngs)
        chat._append_context(ids, text)
        return chat

    def __len__(self) -> int:
        return len(self.tokens)

    # ----------------------------------------------------------------- model tokens

    def append_model(self, ids: list[int], logprobs: list[float], versions: list[int]) -> None:
        """Append tokens the model generated (part of the current turn), exactly as returned."""
        if not (len(ids) == len(logprobs) == len(versions)):
            raise ValueError(f"{len(ids)} ids, {len(logprobs)} logprobs, {len(versions)} versions")
        self.tokens.extend(ids)
        self.loss_mask.extend(array("B", [1]) * len(ids))
        self.logprobs.extend(array("f", logprobs))
        self.versions.extend(array("i", versions))

    def turn_ids(self) -> list[int]:
        return self.tokens[self.turn_start :]

    def turn_content(self) -> str:
        """The current model turn's text without the end-of-turn token it stopped on."""
        return self._turn_text()[0]

    def _turn_text(self) -> tuple[str, str]:
        """(content, all model text) of the current turn, decoded once per turn state. The end-of-turn
        token is an added token, decoded on its own, so the full text is content + its text."""
        key = (self.turn_start, len(self.tokens))
        if self._turn_cache[0] != key:
            ids = self.turn_ids()
            eot = self.codec.end_of_turn_id
            if ids and eot is not None and ids[-1] == eot:
                content = self.codec.decode(ids[:-1])
                self._turn_cache = (key, content, content + self.codec.end_of_turn_text)
            else:
                content = self.codec.decode(ids)
                self._turn_cache = (key, content, content)
        return self._turn_cache[1], self._turn_cache[2]

    # ----------------------------------------------------------------- non-model text

    def close_turn_and_add(self, new_messages: list[Message], *, max_len: int | None = None) -> bool:
        """Close the model's turn as an assistant message, then add ``new_messages`` (tool results,
        a user reply) and the next generation prompt.

        With ``new_messages`` empty the chat ends after the assistant message (no generation prompt).
        When ``max_len`` is given and the new tokens would take the episode past it, only the
        assistant message is closed, the new messages are left out, and False is returned.
        """
        content, model_text = self._turn_text()
        ended = len(model_text) > len(content)  # the model stopped on the end-of-turn token
        assistant = {"role": "assistant", "content": content}
        text = self.text + model_text
        if new_messages:
            new_messages, pngs = self.codec.take_images(new_messages, "an observation")
            delta = self.codec.context_after_turn(ended, new_messages, self.tools, add_generation_prompt=True)
            ids, delta = self.codec.expand_images(delta, pngs)
            if max_len is None or len(self.tokens) + len(ids) <= max_len:
                self.messages.append(assistant)
                self.messages.extend(dict(m) for m in new_messages)
                self.images.extend(pngs)
                self._append_context(ids, text + delta)
                return True
        delta = self.codec.context_after_turn(ended, [], self.tools, add_generation_prompt=False)
        self.messages.append(assistant)
        self._append_context(self.codec.encode(delta), text + delta)
        return not new_messages

    def _append_context(self, ids: list[int], text: str) -> None:
        """Append non-model tokens; ``text`` is the chat's text once they are in."""
        self.tokens.extend(ids)
        n = len(ids)
        self.loss_mask.extend(array("B", [0]) * n)
        self.logprobs.extend(array("f", [0.0]) * n)
        self.versions.extend(array("i", [-1]) * n)
        self.text = text
        self.turn_start = len(self.tokens)

"""The judge's client side: :class:`EngineJudge`, the :class:`agentrl.judging.Judge` an env's reward awaits.

A call renders its prompt to token ids with the judge model's tokenizer (chat messages through its
chat template with the generation prompt, text as it is), checks it against
``judge.max_context_tokens``, and sends it to the judge engines' ``/generate`` (the token API, through
:class:`JudgeEngineClient`: the engine client's balancing, retries and health probes) with
``judge.temperature`` (0: greedy). The reply's text goes through the env's ``parse`` (default:
:func:`agentrl.judging.first_number`) and comes back as a :class:`agentrl.judging.Verdict`.

**Batching.** Concurrent calls are gathered into one batched ``/generate`` (a list of ``input_ids``, as
SGLang and the embedded engine take it) of at most ``judge.max_batch`` calls: the first call of a batch
waits ``judge.batch_window_s`` for others, a full batch goes at once, and at most
``judge.max_concurrent_calls`` calls wait or run per process. The engines batch what runs at once
anyway (continuous batching); gathering saves the per-request HTTP, tokenizer-manager and scheduling
work when a group's episodes are scored together. ``max_batch = 1`` sends every call alone.

**Time limit.** ``judge.timeout_s`` (or an env's smaller ``timeout_s``) covers waiting for a slot, the
window and the generation; past it the call raises :class:`agentrl.judging.JudgeError` (``timeout``).
The batch it was in goes on for the others. Engine failures (``engine``), a prompt too long
(``prompt``) and a reply ``parse`` rejects (``malformed``; the first replies are logged) raise it too;
each is counted in :class:`agentrl.judging.JudgeStats`. A failed batch fails each of its calls, nothing else.

:func:`judge_engine_args` gives a judge engine its flags: ``--weight-version judge``, which it keeps,
since nothing but the learner's weight push changes it and that push targets ``engine.urls`` only.
See docs/run.md, "Rewards judged by a model".
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import anyio
from anyio.abc import TaskGroup
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from agentrl.config import JUDGE_WEIGHT_VERSION, JudgeSection
from agentrl.engine.client import EngineClient, EngineError, GenerateResult
from agentrl.engine.launch import engine_args
from agentrl.judging import JudgeError, JudgeStats, Parse, Prompt, Verdict, first_number

log = logging.getLogger(__name__)

MALFORMED_LOGGED = 5  # replies that are no verdict, logged (the counts are in JudgeStats)


class JudgeEngineClient(EngineClient):
    """The engine client with one more call: several prompts in one batched ``/generate``."""

    async def generate_batch(self, prompts: list[list[int]], sampling: list[dict[str, Any]]) -> list[GenerateResult]:
        """One ``/generate`` with a list of prompts (and one ``sampling_params`` each); one result
        per prompt, in order. No rid: a batch is never aborted by id."""
        payload = {"input_ids": prompts, "sampling_params": sampling, "return_logprob": False}
        body, url = await self._request("/generate", payload, None)
        if not isinstance(body, list) or len(body) != len(prompts):
            got = f"a list of {len(body)}" if isinstance(body, list) else type(body).__name__
            raise EngineError(f"{url}/generate answered {got} to a batch of {len(prompts)} prompts")
        return [GenerateResult.from_response(b, url) for b in body]


@dataclass
class JudgeSettings:
    """The ``[judge]`` keys a call uses (see :class:`agentrl.config.JudgeSection`)."""

    max_new_tokens: int = 64
    temperature: float = 0.0
    timeout_s: float = 60.0
    max_concurrent_calls: int = 64
    max_batch: int = 16
    batch_window_s: float = 0.01
    max_context_tokens: int = 4096

    @classmethod
    def from_config(cls, section: JudgeSection) -> JudgeSettings:
        return cls(**{name: getattr(section, name) for name in cls.__dataclass_fields__})


@dataclass(eq=False)
class _Call:
    ids: list[int]
    sampling: dict[str, Any]
    done: anyio.Event
    result: GenerateResult | None = None
    error: BaseException | None = None
    abandoned: bool = False  # its caller stopped waiting (time limit, cancellation): not sent


@dataclass(eq=False)
class EngineJudge:
    """Judge calls to the judge engines (module docstring). Use as ``async with``: it holds the
    engine client (health probes) and the task that gathers batches."""

    client: JudgeEngineClient
    tokenizer: Any
    settings: JudgeSettings = field(default_factory=JudgeSettings)
    stats: JudgeStats = field(default_factory=JudgeStats)

    def __post_init__(self) -> None:
        self._send: MemoryObjectSendStream[_Call] | None = None
        self._tg: TaskGroup | None = None
        self._limiter: anyio.CapacityLimiter | None = None

    @classmethod
    def from_config(cls, section: JudgeSection, *, urls: list[str] | None = None, tokenizer: Any = None) -> EngineJudge:
        """The judge of a ``[judge]`` section (``urls`` overrides ``judge.urls``); its tokenizer from ``judge.model_path``."""
        from agentrl.secrets import read_secret

        if tokenizer is None:
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(section.model_path)
        hint = f"set {section.api_key_env} (judge.api_key_env) to the judge engines' --api-key"
        client = JudgeEngineClient(
            list(urls if urls is not None else section.urls),
            max_retries=section.request_retries,
            timeout_s=section.timeout_s,
            api_key=read_secret(section.api_key_env),
            key_hints=(hint, hint),
        )
        return cls(client, tokenizer, JudgeSettings.from_config(section))

    async def __aenter__(self) -> EngineJudge:
        await self.client.__aenter__()
        self._limiter = anyio.CapacityLimiter(self.settings.max_concurrent_calls)
        send, receive = anyio.create_memory_object_stream[_Call](self.settings.max_concurrent_calls)
        self._send = send
        self._tg = anyio.create_task_group()
        await self._tg.__aenter__()
        self._tg.start_soon(self._gather, receive)
        return self

    async def __aexit__(self, *exc: Any) -> None:
        try:
            if self._tg is not None:
                self._tg.cancel_scope.cancel()
                await self._tg.__aexit__(None, None, None)
        finally:
            self._tg = None
            if self._send is not None:
                self._send.close()
                self._send = None
            await self.client.__aexit__(None, None, None)

    # ------------------------------------------------------------------ calls

    async def score(
        self,
        prompt: Prompt,
        *,
        parse: Parse | None = None,
        max_new_tokens: int | None = None,
        timeout_s: float | None = None,
    ) -> float:
        return (await self.judge(prompt, parse=parse, max_new_tokens=max_new_tokens, timeout_s=timeout_s)).score

    async def judge(
        self,
        prompt: Prompt,
        *,
        parse: Parse | None = None,
        max_new_tokens: int | None = None,
        timeout_s: float | None = None,
    ) -> Verdict:
        """The verdict on ``prompt`` (see :class:`agentrl.judging.Judge`); raises JudgeError."""
        if self._send is None:
            raise RuntimeError("EngineJudge is used outside its `async with`")
        s = self.settings
        limit = s.timeout_s if timeout_s is None else min(timeout_s, s.timeout_s)
        new_tokens = s.max_new_tokens if max_new_tokens is None else max(1, min(max_new_tokens, s.max_new_tokens))
        self.stats.calls += 1
        started = time.monotonic()
        try:
            ids = self.render(prompt, new_tokens)
            result = await self._generate(ids, {"max_new_tokens": new_tokens, "temperature": s.temperature}, limit)
            score = self._parse(result.text, parse)
        except JudgeError as e:
            self.stats.failures[e.kind] += 1
            raise
        except BaseException:  # cancelled with its episode (the actor stopping), or a bug: neither verdict nor failure
            self.stats.unfinished += 1
            raise
        latency = time.monotonic() - started
        self.stats.verdict(latency, result.weight_version)
        return Verdict(score=score, text=result.text, weight_version=result.weight_version, latency_s=latency)

    def _parse(self, text: str, parse: Parse | None) -> float:
        try:
            return _parse(text, parse or first_number)
        except JudgeError as e:
            if self.stats.failures["malformed"] < MALFORMED_LOGGED:
                shown = text if len(text) <= 200 else text[:197] + "..."
                log.warning("%s; the reply (one of the first %d such): %r", e, MALFORMED_LOGGED, shown)
            raise

    def render(self, prompt: Prompt, new_tokens: int) -> list[int]:
        """``prompt``'s token ids for the judge model; JudgeError (``prompt``) when empty or too long."""
        if isinstance(prompt, str):
            text = prompt
        else:
            text = self.tokenizer.apply_chat_template(list(prompt), tokenize=False, add_generation_prompt=True)
        ids = list(self.tokenizer.encode(text, add_special_tokens=False))
        room = self.settings.max_context_tokens
        if not ids:
            raise JudgeError("prompt", "the judge prompt is empty")
        if len(ids) + new_tokens >= room:
            raise JudgeError(
                "prompt",
                f"the judge prompt has {len(ids)} tokens; with {new_tokens} for the verdict that reaches "
                f"judge.max_context_tokens ({room})",
            )
        return ids

    async def _generate(self, ids: list[int], sampling: dict[str, Any], limit: float) -> GenerateResult:
        assert self._send is not None and self._limiter is not None
        call = _Call(ids, sampling, anyio.Event())
        try:
            with anyio.fail_after(limit):
                async with self._limiter:
                    self.stats.in_flight += 1
                    self.stats.in_flight_max = max(self.stats.in_flight_max, self.stats.in_flight)
                    try:
                        self._send.send_nowait(call)  # never full: the limiter admits at most its buffer
                        await call.done.wait()
                    finally:
                        self.stats.in_flight -= 1
        except TimeoutError:
            which = "judge.timeout_s" if limit == self.settings.timeout_s else "the env's timeout_s"
            raise JudgeError("timeout", f"no verdict within {limit:g} s ({which})") from None
        finally:
            call.abandoned = not call.done.is_set()
        if call.error is not None:
            e = call.error
            raise JudgeError("engine", f"the judge engines failed: {type(e).__name__}: {e}") from None
        assert call.result is not None
        if call.result.finish_reason.get("type") == "abort":
            raise JudgeError("engine", f"the judge engine aborted the call: {call.result.finish_reason}")
        return call.result

    # ------------------------------------------------------------------ batches

    async def _gather(self, receive: MemoryObjectReceiveStream[_Call]) -> None:
        """Form batches: the first call, what is already waiting, then what arrives within the window."""
        s = self.settings
        async with receive:
            async for first in receive:
                batch = [first]
                while len(batch) < s.max_batch:
                    try:
                        batch.append(receive.receive_nowait())
                    except anyio.WouldBlock:
                        break
                if len(batch) < s.max_batch and s.batch_window_s > 0:
                    with anyio.move_on_after(s.batch_window_s):
                        while len(batch) < s.max_batch:
                            batch.append(await receive.receive())
                live = [c for c in batch if not c.abandoned]
                if live:
                    assert self._tg is not None
                    self._tg.start_soon(self._send_batch, live)

    async def _send_batch(self, batch: list[_Call]) -> None:
        """One batched ``/generate``; every call of the batch gets its result or the batch's error."""
        self.stats.batch(len(batch))
        try:
            results = await self.client.generate_batch([c.ids for c in batch], [c.sampling for c in batch])
        except Exception as e:  # each waiting call raises it as a JudgeError; the gathering goes on
            for c in batch:
                c.error = e
        else:
            for c, r in zip(batch, results):
                c.result = r
        finally:
            for c in batch:
                c.done.set()


def _parse(text: str, parse: Callable[[str], float]) -> float:
    """``parse(text)`` as a finite float; JudgeError (``malformed``) otherwise. The message leaves the
    reply out, so that reward errors count by cause (the first replies are logged, see ``EngineJudge``)."""
    try:
        score = float(parse(text))
    except Exception as e:
        raise JudgeError("malformed", f"the judge's reply is no verdict ({type(e).__name__}: {e})") from None
    if not math.isfinite(score):
        raise JudgeError("malformed", f"the judge's verdict is not a finite number ({score})")
    return score


def judge_engine_args(
    section: JudgeSection, *, secret: Callable[[str], str] | None = None, on_cpu: bool = False, num_threads: int = 0
) -> list[str]:
    """The flags of a judge engine of ``section``: its own context, batch, dtype, key, and
    ``--weight-version judge`` (module docstring). ``secret(var)`` reads the key (SGLang takes it as a flag)."""
    from agentrl.secrets import read_secret

    secret = secret or read_secret
    sglang = section.backend == "sglang"
    keys: dict[str, str] = {"api_key": secret(section.api_key_env)} if sglang else {"api_key_env": section.api_key_env}
    sized = any(a.split("=", 1)[0] == "--max-total-tokens" for a in section.sglang_args)
    kv_tokens = min(section.max_running_requests, section.max_batch) * section.max_context_tokens
    return engine_args(
        section.backend,
        device=section.device,
        dtype=section.dtype,
        max_running_requests=section.max_running_requests,
        max_context_tokens=section.max_context_tokens,
        weight_version=JUDGE_WEIGHT_VERSION,
        num_threads=num_threads,
        gpus_per_engine=section.gpus_per_engine,
        mem_fraction_static=section.mem_fraction_static,
        sglang_args=section.sglang_args,
        on_cpu=on_cpu and sglang,
        max_total_tokens=kv_tokens if on_cpu and sglang and not sized else 0,
        **keys,
    )

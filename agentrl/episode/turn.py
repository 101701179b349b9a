"""One model turn against an engine, with the episode's limits and errors (docs/episode.md).

:func:`generate_turn` asks the engine for at most ``budget`` tokens and appends the returned ids to a
:class:`agentrl.episode.chat.TokenChat` exactly as generated, with their logprobs and the policy version
the engine reports. The actors' loop (:mod:`agentrl.episode.rollout`, on trio) and the agent endpoint
(:mod:`agentrl.agents.chat_service`, on asyncio) both generate through it; it sleeps with ``anyio``.
:class:`TurnOptions` holds what differs between them.

**Interruptions.** A weight update that pauses the engine with ``mode="abort"`` returns
``finish_reason.type == "abort"`` with partial output. The turn keeps those tokens and asks again with
the prompt extended by them, for the tokens still allowed (``continue_aborts``): per-token versions
show where the policy changed. Only more than ``max_empty_aborts`` aborts in a row that return no token
end the turn with the engine's abort.

**Versions** (:func:`parse_weight_version`). An engine's ``weight_version`` is the learner's policy
version as a decimal string. SGLang started without ``--weight-version`` reports ``"default"`` until the
learner sets one. With ``versioned`` a reply under ``"default"`` is dropped and the turn waits and asks
again, for at most ``max_version_wait_s``; any other version that is not an integer fails at once,
naming the engine. A 400 to a request naming the LoRA adapter from an engine at ``"default"`` (not
loaded yet) waits too when ``wrap_engine_errors``; any other engine error then fails the episode.

Invariants: a turn never appends more tokens than ``budget``; a reply that breaks the protocol
(ids and logprobs of different lengths, an unknown finish type, too many tokens) raises
:class:`EpisodeFailed`; request ids are ``<rid_prefix>-<part>``, part counting the turn's requests.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import anyio

from agentrl.envs.base import Env
from agentrl.episode.chat import TokenChat
from agentrl.images import data_url


class GenerateResultLike(Protocol):
    output_ids: list[int]
    output_logprobs: list[float]
    finish_reason: dict
    weight_version: str
    meta_info: dict
    url: str  # the server that answered (named in errors)


class EngineClientLike(Protocol):
    """What a turn needs of :class:`agentrl.engine.client.EngineClient`."""

    async def generate(
        self,
        input_ids: list[int],
        sampling_params: dict,
        *,
        affinity_key: str | None = None,
        rid: str | None = None,
        return_logprob: bool = True,
        image_data: list[str] | None = None,
    ) -> GenerateResultLike: ...


class EpisodeFailed(Exception):
    """The episode produced no usable trajectory (engine unreachable, protocol error, env bug)."""


class GroupLost(Exception):
    """A group could not be completed; the message says why (the first failed episode's error)."""


UNSET_VERSION = "default"  # what SGLang reports before anybody set a weight version


class VersionNotSet(Exception):
    """The engine reports ``"default"``: its weights have no policy version yet."""

    def __init__(self, url: str):
        super().__init__(url)
        self.url = url


def parse_weight_version(version: Any, url: str) -> int:
    """The policy version an engine reported; :class:`VersionNotSet` for SGLang's ``"default"``,
    :class:`EpisodeFailed` (naming the engine and the fix) for anything else that is not an integer."""
    try:
        return int(version)
    except (TypeError, ValueError):
        pass
    if version == UNSET_VERSION:
        raise VersionNotSet(url)
    raise EpisodeFailed(
        f"engine {url or '(unknown url)'} reports weight_version {version!r}, which is not a "
        "policy version (an integer): start it with --weight-version 0, or without --weight-version "
        "and let the learner set the version when it connects"
    )


@dataclass(frozen=True)
class EpisodeLimits:
    max_turns: int = 4
    max_total_tokens: int = 1024
    max_new_tokens_per_turn: int = 128
    max_empty_aborts: int = 20  # aborts in a row that return no token before the episode gives up
    max_version_wait_s: float = 600.0  # how long a turn waits for an engine to leave weight_version "default"
    max_abs_reward: float = math.inf  # a larger reward is an env bug: scored 0 with reward_error

    @classmethod
    def from_config(cls, cfg: Any, env: Env | None = None, section: Any = None) -> EpisodeLimits:
        """The env section's limits (default: the run's only env), overridden by an env's own
        ``max_turns``/``max_total_tokens`` attributes when it sets them (not None; 0 is a value),
        and never above ``engine.max_context_tokens``."""
        from agentrl.envs import env_section

        env = env if env is not None else Env()
        section = env_section(cfg, section)
        turns = env.max_turns if env.max_turns is not None else section.max_turns
        tokens = env.max_total_tokens if env.max_total_tokens is not None else section.max_total_tokens
        return cls(
            max_turns=turns,
            max_total_tokens=min(tokens, cfg.engine.max_context_tokens),
            max_new_tokens_per_turn=cfg.actors.max_new_tokens_per_turn,
            max_abs_reward=cfg.learner.max_abs_reward,
        )


@dataclass(frozen=True)
class TurnOptions:
    """How a turn treats versions, aborts and engine errors (module docstring)."""

    versioned: bool = True  # False (evaluation, the engine host): any reported version is taken
    continue_aborts: bool = True  # False: an abort ends the turn at once, as SGLang's server does
    max_empty_aborts: int = 20
    max_version_wait_s: float = 600.0
    wrap_engine_errors: bool = True  # False: an engine error propagates as raised (the caller answers it)
    on_version_wait: Callable[[str], None] | None = None  # called with the engine's URL each time a turn waits


@dataclass
class TurnResult:
    """How one turn ended and what it cost."""

    kind: str = ""  # "stop", "length" or "abort" (the engine's abort stands)
    finish: dict[str, Any] = field(default_factory=dict)  # the finish_reason it ended with (the engine's, or its own)
    weight_version: str = ""  # as the engine reported it on the last reply
    num_generate_calls: int = 0  # replies received
    num_aborts: int = 0  # aborts continued (or ended on)
    abort_message: str = ""  # the engine's message of the last abort
    generation_latency_s: float = 0.0  # wall time in the replies received


async def generate_turn(
    client: EngineClientLike,
    chat: TokenChat,
    sampling: dict[str, Any],
    budget: int | None,
    *,
    affinity_key: str,
    rid_prefix: str,
    options: TurnOptions,
) -> TurnResult:
    """Generate one model turn of at most ``budget`` tokens (None: the engine's limit) into ``chat``."""
    out = TurnResult()
    start_len, remaining = len(chat), budget
    eot = chat.codec.end_of_turn_id
    empty_aborts, part = 0, 0
    waiting_since: float | None = None
    # SGLang's image_data: the episode's images so far, as data URLs (only when there are any)
    images: dict[str, Any] = {"image_data": [data_url(png) for png in chat.images]} if chat.images else {}
    while True:
        params = {**sampling, "max_new_tokens": remaining}
        rid = f"{rid_prefix}-{part}"
        part += 1
        start = time.monotonic()
        try:
            reply = await client.generate(chat.tokens, params, affinity_key=affinity_key, rid=rid, **images)
        except Exception as e:  # the client has already retried; cancellation is not an Exception
            if not options.wrap_engine_errors:
                raise
            unset = await _adapter_not_loaded_yet(client, e)
            if not unset:
                raise EpisodeFailed(f"generate failed: {type(e).__name__}: {e}") from e
            waiting_since = waiting_since or time.monotonic()
            await _wait_for_version(unset, time.monotonic() - waiting_since, options)
            continue
        out.generation_latency_s += time.monotonic() - start
        out.num_generate_calls += 1
        try:
            ids, logprobs, versions, kind = unpack_result(reply, options.versioned)
        except VersionNotSet as e:  # the reply is dropped: no policy version produced it
            waiting_since = waiting_since or time.monotonic()
            await _wait_for_version(e.url, time.monotonic() - waiting_since, options)
            continue
        waiting_since = None
        if remaining is not None and len(ids) > remaining:
            raise EpisodeFailed(f"engine returned {len(ids)} tokens, {remaining} were asked for")
        chat.append_model(ids, logprobs, versions)
        out.kind, out.finish = kind, dict(reply.finish_reason or {})
        out.weight_version = str(reply.weight_version)
        if remaining is not None:
            remaining -= len(ids)
        if kind != "abort" or not options.continue_aborts:
            return out
        # abort: keep the partial output and continue the same turn (likely under new weights)
        out.num_aborts += 1
        out.abort_message = str(out.finish.get("message", ""))
        if ids and eot is not None and ids[-1] == eot:
            out.kind, out.finish = "stop", {"type": "stop", "matched": ids[-1]}
            return out
        if remaining is not None and remaining <= 0:
            out.kind, out.finish = "length", {"type": "length", "length": len(chat) - start_len}
            return out
        empty_aborts = 0 if ids else empty_aborts + 1
        if empty_aborts > options.max_empty_aborts:
            return out  # ends with the engine's abort
        if empty_aborts:
            await anyio.sleep(min(1.0, 0.05 * empty_aborts))


async def _wait_for_version(url: str, waited_s: float, options: TurnOptions) -> None:
    if waited_s >= options.max_version_wait_s:
        raise EpisodeFailed(
            f"engine {url} still reports weight_version {UNSET_VERSION!r} after {waited_s:.0f} s: no "
            "learner has set a policy version. Start the learner (it sets the version when it "
            "connects), or start the engine with --weight-version 0"
        )
    if options.on_version_wait is not None:
        options.on_version_wait(url)
    await anyio.sleep(min(2.0, 0.1 + 0.25 * waited_s))


async def _adapter_not_loaded_yet(client: Any, error: Exception) -> str:
    """The engine's URL when ``error`` is a 400 to a request naming the LoRA adapter
    (``learner.lora.sync = "adapter"``) from an engine that reports ``"default"``: a fresh or
    restarted engine the learner has not loaded the adapter into yet (it sets the version after
    loading it), so the turn waits as for ``"default"``; else ``""`` (the error stands)."""
    url = str(getattr(error, "url", ""))
    if getattr(error, "status", None) != 400 or not getattr(client, "lora_path", "") or not url:
        return ""
    try:
        versions = dict(zip([s.url for s in client.engines], await client.weight_versions()))
    except Exception:
        return ""
    mine = [v for u, v in versions.items() if url.startswith(u + "/")]  # the url is engine + path
    unset = UNSET_VERSION in (mine or list(versions.values()))  # behind a router: any engine
    return url.rsplit("/", 1)[0] if unset else ""


# What is read here from SGLang's /generate meta_info beyond GenerateResult's fields
# (tests/test_engine_conformance.py: SGLang writes each there): the weight-version spans, each span's
# keys, and an abort's finish_reason (the reason goes into the counters).
META_INFO_FIELDS_READ = ("weight_versions",)
SPAN_FIELDS_READ = ("version", "start", "end")
ABORT_FIELDS_READ = ("type", "message")


def unpack_result(result: GenerateResultLike, versioned: bool = True) -> tuple[list[int], list[float], list[int], str]:
    """Validate an engine reply; return (ids, logprobs, versions per token, finish type).
    Unversioned (evaluation): any version is taken (-1 for tokens under one that is not a number)."""
    ids = [int(i) for i in result.output_ids]
    logprobs = [0.0 if lp is None else float(lp) for lp in (result.output_logprobs or [])]
    if len(logprobs) != len(ids):
        raise EpisodeFailed(f"engine returned {len(ids)} output ids but {len(logprobs)} logprobs (return_logprob?)")
    kind = (result.finish_reason or {}).get("type")
    if kind not in ("stop", "length", "abort"):
        raise EpisodeFailed(f"engine returned an unknown finish_reason {result.finish_reason!r}")
    if not versioned:
        try:
            version = int(result.weight_version)
        except (TypeError, ValueError):
            version = -1
        return ids, logprobs, [version] * len(ids), kind
    versions = [parse_weight_version(result.weight_version, result.url)] * len(ids)
    # SGLang reports spans when the weights changed during one request (pause mode in_place).
    spans = (result.meta_info or {}).get("weight_versions")
    if isinstance(spans, list) and len(spans) > 1:
        try:
            for span in spans:
                v = parse_weight_version(span["version"], result.url)
                for i in range(max(0, int(span["start"])), min(len(ids), int(span["end"]))):
                    versions[i] = v
        except (KeyError, TypeError, ValueError):
            raise EpisodeFailed(f"engine {result.url} returned malformed weight_versions spans {spans!r}") from None
    return ids, logprobs, versions, kind

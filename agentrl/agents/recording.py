"""Episodes from calls: an agent's chat-completion calls grouped, stitched and turned into trajectories.

The endpoint groups the calls of one episode by its key (:mod:`agentrl.agents.endpoint`) and keeps them as
**sequences**: token lists the model saw, from a first prompt to the last completion, each trained on as one
:class:`agentrl.protocol.Trajectory`.

* **Stitching.** A call *extends* a sequence when its messages are the sequence's conversation so far (the
  last call's messages plus the reply it got, compared by :func:`agentrl.agents.openai_api.message_view`)
  followed by new messages, with the same tools, and the template renders the stitched text exactly. Its
  prompt is then the sequence's tokens plus the rendering of the new messages
  (:meth:`agentrl.episode.chat.TokenChat.close_turn_and_add`): no re-tokenization drift.
* Any other call starts a **new sequence**; the reason is kept in ``new_sequence_reason``.
* **Branches.** Choices 1..n-1 of a call, and the second of two concurrent extensions, start sequences
  that hold the shared prompt as context (``loss_mask`` 0).
* **Limits.** At most ``max_calls`` calls and ``max_len`` tokens per sequence; a refusal sets
  :attr:`Episode.limit` and the episode is scored as played.
* Every sequence carries the episode's reward and ``episode_id``; the learner's group is the ``n``
  episodes of a task (:func:`agentrl.learner.batching.episode_index`).

See docs/agents.md ("The stitching rule").
"""

from __future__ import annotations

from array import array
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from agentrl.agents.chat_service import CallPlan, clone_chats
from agentrl.agents.openai_api import ChatRequest, OpenAIRequestError, message_view
from agentrl.episode.chat import ChatCodec, TemplateMismatch, TokenChat
from agentrl.protocol import Trajectory
from agentrl.tools.parsing import ToolCallParser

NEW_SEQUENCE_REASONS = (
    "first_call",
    "reply_edited",
    "history_differs",
    "tools_differ",
    "template_not_prefix_stable",
    "branch",
)


@dataclass
class Sequence:
    """One token list of an episode (see the module docstring)."""

    chat: TokenChat  # prompt(s) and completions, the last turn not yet closed
    views: list[str]  # the conversation as the agent sees it, through the last reply returned
    tools_key: str
    context_tokens: int  # leading tokens copied from another sequence's prompt: never trained here
    index: int
    reason: str  # why it is a new sequence (NEW_SEQUENCE_REASONS)
    num_calls: int = 0
    num_generate_calls: int = 0
    num_aborts: int = 0
    generation_latency_s: float = 0.0
    finish_reason: str = ""  # of its last call (stop, length, tool_calls, abort)
    call_spans: list = field(default_factory=list)  # per call: [completion start, completion end] in tokens
    call_finish_reasons: list = field(default_factory=list)


@dataclass
class _Extends:
    sequence: Sequence
    calls_at_plan: int  # the sequence's num_calls when the call was planned (a later commit makes it a branch)


class EpisodeClosed(OpenAIRequestError):
    def __init__(self) -> None:
        super().__init__(
            "this episode has finished; its key no longer accepts calls", status=401, code="invalid_api_key"
        )


class Episode:
    """The calls of one episode as sequences; an :class:`agentrl.agents.chat_service.PromptSession`."""

    def __init__(
        self,
        episode_id: str,
        *,
        max_calls: int | None = None,
        max_len: int | None = None,
        tool_parser: ToolCallParser | None = None,
        reasoning: bool | None = None,
    ):
        self.id = episode_id
        self.max_calls, self.max_len = max_calls, max_len
        # how its completions are read (the env's tool_parser and reasoning); None: the service's defaults
        self.tool_parser, self.reasoning = tool_parser, reasoning
        self.limit = ""  # the limit a refused call reached: "max_turns" or "context_full"
        self.sequences: list[Sequence] = []
        self.num_calls = 0  # committed
        self.num_stitched = 0  # committed calls that extended a sequence
        self.new_sequence_reasons: Counter = Counter()
        self.closed = False
        self._planned = 0
        self._last: Sequence | None = None  # the sequence of the last committed call

    # -- PromptSession ------------------------------------------------------------------------
    def plan(self, request: ChatRequest, codec: ChatCodec) -> CallPlan:
        if self.closed:
            raise EpisodeClosed()
        if self.max_calls is not None and self.num_calls >= self.max_calls:
            self.limit = "max_turns"
            raise OpenAIRequestError(
                f"this episode has made its {self.max_calls} calls to the model (the env's "
                "max_turns): finish the episode",
                code="max_turns_exceeded",
            )
        chat, extends, reason = None, None, "first_call"
        if self.sequences:
            sequence, reason = self._find(request)
            if sequence is not None:
                chat = copy_chat(sequence.chat)
                try:
                    chat.close_turn_and_add(request.messages[len(sequence.views) :])
                    rendered = codec.render(chat.messages, chat.tools, add_generation_prompt=True)
                    if codec.expand_images(rendered, chat.images)[1] != chat.text:
                        raise TemplateMismatch("the template renders this history otherwise")
                    extends = _Extends(sequence, sequence.num_calls)
                except TemplateMismatch:
                    chat, reason = None, "template_not_prefix_stable"
        if chat is None:
            chat = TokenChat.start(codec, request.messages, request.tools)
        if self.max_len is not None and len(chat) + 1 + codec.reserve_tokens > self.max_len:
            self.limit = "context_full"
            raise OpenAIRequestError(
                f"This episode's maximum length is {self.max_len} tokens (the env's "
                f"max_total_tokens); the messages take {len(chat)}, which leaves no room for a "
                "completion",
                param="messages",
                code="context_length_exceeded",
            )
        self._planned += 1
        return CallPlan(
            request,
            clone_chats(chat, request.n),
            affinity_key=self.id,
            rid=f"{self.id}-{self._planned}",
            state=(extends, reason),
            max_len=self.max_len,
            tool_parser=self.tool_parser,
            reasoning=self.reasoning,
        )

    def commit(self, plan: CallPlan) -> None:
        if self.closed:  # the agent returned (or was cancelled) while this call generated: not recorded
            raise EpisodeClosed()
        extends, reason = plan.state
        req = plan.request
        self.num_calls += 1
        for i, r in enumerate(plan.results):
            assert r.out is not None, "commit() runs after every choice has its response"
            views = req.views + [message_view(r.out.message())]
            target = None
            if i == 0 and extends is not None and extends.sequence.num_calls == extends.calls_at_plan:
                target = extends.sequence
                target.chat, target.views = r.chat, views
                self.num_stitched += 1
            else:
                why = reason if extends is None and i == 0 else "branch"
                target = Sequence(
                    chat=r.chat,
                    views=views,
                    tools_key=req.tools_key,
                    context_tokens=r.prompt_len,
                    index=len(self.sequences),
                    reason=why,
                )
                self.sequences.append(target)
                self.new_sequence_reasons[why] += 1
            target.num_calls += 1
            target.num_generate_calls += r.num_generate_calls
            target.num_aborts += r.num_aborts
            target.generation_latency_s += r.generation_latency_s
            target.finish_reason = r.out.finish_reason
            target.call_spans.append([r.prompt_len, len(r.chat)])
            target.call_finish_reasons.append(r.out.finish_reason)
            if i == 0:
                self._last = target

    def _find(self, request: ChatRequest) -> tuple[Sequence | None, str]:
        """The sequence the request extends (the most recent one first), or why there is none."""
        reason = "history_differs"
        for s in reversed(self.sequences):
            k = len(s.views)
            if len(request.views) <= k:
                continue
            if request.views[:k] == s.views:
                if request.tools_key == s.tools_key:
                    return s, ""
                reason = "tools_differ"
            elif request.views[: k - 1] == s.views[:-1] and reason == "history_differs":
                reason = "reply_edited"
        return None, reason

    # -- results ------------------------------------------------------------------------------
    def final_messages(self) -> list[dict]:
        """The conversation of the last call, with its reply (what ``Env.reward`` is given)."""
        if self._last is None:
            return []
        content = self._last.chat.turn_content()
        return self._last.chat.messages + [{"role": "assistant", "content": content}]

    def trajectories(
        self, reward: float, reward_components: dict[str, float] | None = None, metadata: dict[str, Any] | None = None
    ) -> list[Trajectory]:
        """One trajectory per sequence, each with the episode's reward; closes every sequence's last
        turn (the template's closing tokens as context). Call once, after the episode ends."""
        out = []
        for s in self.sequences:
            chat = s.chat
            try:
                chat.close_turn_and_add([])
            except TemplateMismatch:  # the trajectory ends at the model's last token
                pass
            mask, logprobs, versions = array("B", chat.loss_mask), array("f", chat.logprobs), array("i", chat.versions)
            n = s.context_tokens
            mask[:n], logprobs[:n], versions[:n] = array("B", [0]) * n, array("f", [0.0]) * n, array("i", [-1]) * n
            meta = {
                "episode_id": self.id,
                "sequence_index": s.index,
                "num_sequences": len(self.sequences),
                "num_calls": s.num_calls,
                "episode_num_calls": self.num_calls,
                "num_turns": s.num_calls,
                "new_sequence_reason": s.reason,
                "finish_reason": s.finish_reason,
                "num_generate_calls": s.num_generate_calls,
                "num_aborts": s.num_aborts,
                "generation_latency_s": s.generation_latency_s,
                "num_model_tokens": mask.count(1),
                "call_spans": s.call_spans,
                "call_finish_reasons": s.call_finish_reasons,
                "messages": chat.messages,
            }
            meta.update(metadata or {})
            out.append(
                Trajectory(
                    tokens=np.asarray(chat.tokens, dtype=np.int32),
                    loss_mask=np.asarray(mask, dtype=np.uint8),
                    behavior_logprobs=np.asarray(logprobs, dtype=np.float32),
                    weight_versions=np.asarray(versions, dtype=np.int32),
                    reward=reward,
                    reward_components=dict(reward_components or {}),
                    metadata=meta,
                )
            )
        return out


def copy_chat(chat: TokenChat) -> TokenChat:
    return clone_chats(chat, 2)[1]

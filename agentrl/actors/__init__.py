"""Actors: the agent loop, group assembly, scheduling and sending (see docs/architecture.md).

* :mod:`agentrl.actors.chat`: token-in/token-out bookkeeping (tokens always decode to the chat).
* :mod:`agentrl.actors.rollout`: :func:`run_episode`, :func:`run_group`, :func:`evaluate`.
* :mod:`agentrl.actors.service`: :class:`ActorService`, one actor process (gating, sending, stopping).
* :mod:`agentrl.actors.serve`: the ``agentrl serve-actors`` command body.

Importing this package is cheap (trio, numpy, msgpack); transformers is only needed for the
tokenizer that callers pass in.
"""

from agentrl.actors.chat import ChatCodec, TemplateMismatch, TokenChat, codec_for
from agentrl.actors.rollout import (FINISH_REASONS, EpisodeFailed, EpisodeLimits, GroupLost, evaluate, run_episode,
                                    run_group, sampling_from_config, toolbox_for)
from agentrl.actors.service import ActorService, ActorSettings, budget_share

__all__ = [
    "ActorService", "ActorSettings", "ChatCodec", "EpisodeFailed", "EpisodeLimits", "FINISH_REASONS", "GroupLost",
    "TemplateMismatch", "TokenChat", "budget_share", "codec_for", "evaluate", "run_episode", "run_group",
    "sampling_from_config", "toolbox_for",
]

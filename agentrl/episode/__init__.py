"""The episode: what actors and the agent endpoint both stand on (docs/episode.md).

* :mod:`agentrl.episode.chat`: the token-exact chat (``TokenChat``, ``ChatCodec``): tokens always decode to the chat.
* :mod:`agentrl.episode.rollout`: one episode against an engine and an ``Env``, one group, their limits and errors.
"""

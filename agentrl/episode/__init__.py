"""The episode: what actors and the agent endpoint both stand on (docs/episode.md).

* :mod:`agentrl.episode.chat`: the token-exact chat (``TokenChat``, ``ChatCodec``): tokens always decode to the chat.
* :mod:`agentrl.episode.turn`: one model turn against an engine (``generate_turn``), the episode's limits and errors.
* :mod:`agentrl.episode.rollout`: one episode against an engine and an ``Env`` (``run_episode``), one group.
* :mod:`agentrl.episode.group`: the group player: episodes run concurrently, the first failure loses the group.
* :mod:`agentrl.episode.evaluation`: greedy evaluation and its report.
"""

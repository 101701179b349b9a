"""Train the agents people already have: an OpenAI-compatible endpoint that records token-exact episodes.

| module | owns |
| --- | --- |
| ``openai_api`` | OpenAI's chat-completions wire format: validation, messages for the template, tool calls out, responses, chunks |
| ``serving`` | ``ChatService``: ``/v1/chat/completions`` and ``/v1/models`` over token-in/token-out generation (both hosts) |
| ``episodes`` | calls grouped into an episode's sequences (the stitching rule), trajectories |
| ``endpoint`` | ``AgentEndpoint``: episode keys (the border) and the recording app |
| ``env`` | ``AgentEnv``: an env whose episodes are played by your agent code with an OpenAI client |
| ``runner`` | ``AgentRunner``: the asyncio thread (endpoint + agents) driven from trio; ``play`` = one episode |

See ``docs/agents.md``.
"""

from agentrl.agents.env import AgentEnv

__all__ = ["AgentEnv"]

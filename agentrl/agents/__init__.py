"""Train the agents people already have: an OpenAI-compatible endpoint that records token-exact episodes.

| module | owns |
| --- | --- |
| ``openai_api`` | OpenAI's chat-completions wire format: validation, messages for the template, tool calls out, responses, chunks |
| ``chat_service`` | ``ChatService``: ``/v1/chat/completions`` and ``/v1/models`` over token-in/token-out generation (both hosts) |
| ``recording`` | calls grouped into an episode's sequences (the stitching rule), trajectories |
| ``endpoint`` | ``AgentEndpoint``: episode keys (the border) and the recording app |
| ``engine_routes`` | the embedded engine's ``/v1`` routes (mounted by the engine process, not the engine) |
| ``agent_runner`` | ``AgentRunner``: the asyncio thread (endpoint + agents) driven from trio; ``play`` = one episode |

``AgentEnv`` (an env whose episodes your agent code plays with an OpenAI client) lives in
:mod:`agentrl.envs.agent` and is exported here, its public name. See ``docs/agents.md``.
"""

from agentrl.envs.agent import AgentEnv

__all__ = ["AgentEnv"]

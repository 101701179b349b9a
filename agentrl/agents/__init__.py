"""Train the agents people already have: an OpenAI-compatible endpoint that records token-exact episodes.

``openai_api`` is the wire format; ``chat_service`` serves ``/v1/chat/completions`` and
``/v1/models`` over token-in/token-out generation (for both hosts); ``recording`` groups calls into
an episode's sequences; ``endpoint`` holds episode keys and the recording app; ``engine_routes``
are the embedded engine's ``/v1`` routes; ``agent_runner`` runs the asyncio thread (endpoint and
agents) driven from trio. ``AgentEnv`` lives in :mod:`agentrl.envs.agent` and is exported here
under its public name. See docs/agents.md.
"""

from agentrl.envs.agent import AgentEnv

__all__ = ["AgentEnv"]

"""The embedded engine process: ``python -m agentrl.run.engine_process --model PATH --port N``.

The engine's native API (:mod:`agentrl.engine.server`) with the OpenAI-compatible ``/v1`` routes of
:mod:`agentrl.agents.engine_routes` mounted; ``agentrl serve-engine`` and every run start it this way.
See docs/run.md.
"""

from __future__ import annotations


def main(argv: list[str] | None = None) -> None:
    from agentrl.agents.engine_routes import openai_routes
    from agentrl.engine.server import parse_args, serve

    serve(parse_args(argv), routes_for=openai_routes)


if __name__ == "__main__":
    main()

"""Sandboxes for running model-written Python: ``local`` (bubblewrap), ``docker``, ``e2b``.

``make_pool(settings)`` is the entry point: a :class:`SandboxPool` whose sandboxes come from the
backend ``settings.backend`` names. Backends are imported only when used. See docs/tools.md.
"""

from __future__ import annotations

from typing import Any

from agentrl.tools.sandbox.base import ExecResult, Sandbox, SandboxSettings
from agentrl.tools.sandbox.pool import SandboxPool

__all__ = ["ExecResult", "Sandbox", "SandboxPool", "SandboxSettings", "create_sandbox", "make_pool"]


async def create_sandbox(settings: SandboxSettings, slot: int = 0) -> Sandbox:
    """A new sandbox of ``settings.backend``."""
    if settings.backend == "local":
        from agentrl.tools.sandbox.local import LocalSandbox

        return LocalSandbox(settings, slot)
    if settings.backend == "docker":
        from agentrl.tools.sandbox.docker import DockerSandbox

        return await DockerSandbox.create(settings, slot)
    if settings.backend == "e2b":
        from agentrl.tools.sandbox.e2b import E2BSandbox

        return await E2BSandbox.create(settings, slot)
    raise ValueError(f"unknown sandbox backend {settings.backend!r}")


def make_pool(settings: SandboxSettings | dict[str, Any] | None = None) -> SandboxPool:
    """A pool of sandboxes as configured (a dict is read as the ``[sandbox]`` section)."""
    if not isinstance(settings, SandboxSettings):
        settings = SandboxSettings.from_dict(settings)
    s = settings
    return SandboxPool(lambda slot: create_sandbox(s, slot), size=s.pool_size, max_live=s.max_live)

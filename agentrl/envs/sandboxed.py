"""A base class for environments whose episodes each get a code sandbox.

``SandboxedEnv(sandbox={...})`` takes the ``[sandbox]`` section, creates the pool lazily in the
actor process, puts one sandbox per episode into ``state["sandbox"]`` in :meth:`setup` and gives it
back in :meth:`cleanup`, shielded from cancellation. :meth:`python_tool` is the ``python`` tool bound
to that state. Subclasses call ``super().__init__(sandbox)``. See docs/envs.md.
"""

from __future__ import annotations

from typing import Any

from agentrl.envs.base import Env, Task
from agentrl.tools.python_sandbox import PythonTool
from agentrl.tools.sandbox import SandboxPool, SandboxSettings, make_pool


class SandboxedEnv(Env):
    def __init__(self, sandbox: dict[str, Any] | SandboxSettings | None = None):
        self.sandbox_settings = sandbox if isinstance(sandbox, SandboxSettings) else SandboxSettings.from_dict(sandbox)
        self._pool: SandboxPool | None = None

    @property
    def pool(self) -> SandboxPool:
        if self._pool is None or self._pool.closed:
            self._pool = make_pool(self.sandbox_settings)
        return self._pool

    def python_tool(self) -> PythonTool:
        return PythonTool(self.sandbox_settings)

    async def setup(self, task: Task) -> dict[str, Any]:
        return {"sandbox": await self.pool.acquire()}

    async def cleanup(self, task: Task, state: dict[str, Any]) -> None:
        sandbox = state.pop("sandbox", None)
        if sandbox is not None:
            # shielded and time-bounded inside; a closed pool closes the sandbox
            await (self._pool or self.pool).release(sandbox)

    async def aclose(self) -> None:
        if self._pool is not None:
            await self._pool.aclose()

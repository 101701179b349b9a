"""The ``python`` tool: run model-written code in the episode's sandbox.

The sandbox is ``state["sandbox"]``, put there by the env's ``setup``
(:class:`agentrl.envs.sandboxed.SandboxedEnv`), so the calls of one episode share it and its files
(except on the local backend when agentrl is not root). The model sees stdout, stderr, then a
bracketed status line when the code failed or hit a limit. The tool's time limit is the sandbox's
wall-clock limit plus a margin, so the sandbox reports a time-out first. See docs/tools.md.
"""

from __future__ import annotations

from typing import Any

from agentrl.tools.base import Tool
from agentrl.tools.sandbox.base import SandboxSettings


class PythonTool(Tool):
    """Run a Python program in a sandbox and return what it prints.

    Args:
        code: a complete Python program; print the values you want to see.
    """

    name = "python"

    def __init__(self, settings: SandboxSettings | None = None, state_key: str = "sandbox"):
        self.settings = settings or SandboxSettings()
        self.state_key = state_key
        self.timeout_s = self.settings.wall_time_s + 15.0

    async def run(self, code: str, state: dict[str, Any]) -> str:
        sandbox = state.get(self.state_key)
        if sandbox is None:
            raise RuntimeError(
                f"this episode has no sandbox (the env's setup must put one in state[{self.state_key!r}])"
            )
        result = await sandbox.run(code)
        return result.render(self.settings)

"""The ``e2b`` backend: a Firecracker micro-VM from e2b.dev per sandbox (e2b SDK).

The API key comes from ``E2B_API_KEY``, the template from ``settings.e2b_template``. A sandbox has
no internet access and ends after ``lifetime_s`` even if this process died. The runner is written
once, as root, to ``/opt/agentrl/runner.py`` (the code cannot alter it); the runner's per-run
limits apply inside the VM. The synchronous SDK runs in worker threads (its async variant is
asyncio; actors run on trio). Tests use a local stand-in for the SDK's ``Sandbox``.
See docs/tools.md.
"""

from __future__ import annotations

import json
import os
from typing import Any

import trio

from agentrl.tools.sandbox.base import ExecResult, Sandbox, SandboxSettings, parse_report, runner_source

HOST_GRACE_S = 10.0


def _sdk_sandbox_class() -> Any:
    try:
        from e2b import Sandbox as E2BSdkSandbox
    except ImportError:
        raise RuntimeError("the e2b sandbox needs the e2b SDK: pip install 'agentrl[e2b]'") from None
    if not os.environ.get("E2B_API_KEY"):
        raise RuntimeError("the e2b sandbox needs an API key in the E2B_API_KEY environment variable")
    return E2BSdkSandbox


class E2BSandbox(Sandbox):
    def __init__(
        self,
        settings: SandboxSettings,
        sdk: Any,
        *,
        control_dir: str = "/opt/agentrl",
        workdir: str = "/home/user/work",
    ):
        self.settings = settings
        self.sdk = sdk
        self.control_dir = control_dir.rstrip("/")
        self.work_path = workdir
        self.broken = False
        self._counter = 0

    @classmethod
    async def create(
        cls,
        settings: SandboxSettings,
        slot: int = 0,
        *,
        sandbox_cls: Any = None,
        control_dir: str = "/opt/agentrl",
        workdir: str = "/home/user/work",
    ) -> E2BSandbox:
        sdk_cls = sandbox_cls or _sdk_sandbox_class()
        sdk = await trio.to_thread.run_sync(
            lambda: sdk_cls.create(
                template=settings.e2b_template or None,
                timeout=int(settings.lifetime_s),
                allow_internet_access=False,
                metadata={"agentrl": "sandbox"},
            )
        )
        sandbox = cls(settings, sdk, control_dir=control_dir, workdir=workdir)
        try:
            await trio.to_thread.run_sync(
                lambda: sdk.files.write(f"{sandbox.control_dir}/runner.py", runner_source(), user="root")
            )
        except BaseException:
            await trio.to_thread.run_sync(sdk.kill)
            raise
        return sandbox

    async def execute(self, payload: dict[str, Any]) -> ExecResult:
        if self.broken:
            return ExecResult(exit_code=None, error="the e2b sandbox is gone")
        self._counter += 1
        path = f"{self.control_dir}/payload-{self._counter}.json"
        command = f"python3 -I {self.control_dir}/runner.py {path}"
        limit = self.settings.wall_time_s + HOST_GRACE_S

        def call() -> tuple[str, str]:
            self.sdk.files.write(path, json.dumps(payload), user="root")
            try:
                result = self.sdk.commands.run(command, timeout=limit)
            except Exception as e:
                # CommandExitException carries the output of a non-zero exit; the runner
                # itself always exits 0, so anything else is a failure of the sandbox.
                if hasattr(e, "stdout") and hasattr(e, "exit_code"):
                    return getattr(e, "stdout", None) or "", getattr(e, "stderr", None) or ""
                raise
            return result.stdout or "", result.stderr or ""

        try:
            with trio.move_on_after(limit + 5.0) as scope:
                out, err = await trio.to_thread.run_sync(call, abandon_on_cancel=True)
        except Exception as e:
            self.broken = True
            if type(e).__name__ == "TimeoutException":
                return ExecResult(exit_code=None, limit="wall_time")
            return ExecResult(exit_code=None, error=f"e2b command failed: {type(e).__name__}: {e}")
        if scope.cancelled_caught:
            self.broken = True
            return ExecResult(exit_code=None, limit="wall_time")
        return parse_report(out, err)

    async def reset(self) -> None:
        result = await self.execute(self.settings.payload("reset", workdir=self.work_path, sweep_uid=True))
        if result.error:
            raise RuntimeError(f"could not reset the e2b sandbox: {result.error}")

    async def close(self) -> None:
        self.broken = True
        try:
            await trio.to_thread.run_sync(self.sdk.kill)
        except Exception:
            pass  # already ended; e2b ends it at lifetime_s anyway

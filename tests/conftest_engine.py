"""Fixtures and helpers of the engine tests: the tiny model, two real engine processes, a teacher.

The two engines are started once per session (in parallel, the first through
``agentrl serve-engine``) and shared by the client, server and weight tests; every test
leaves them as it found them (unpaused, original weights, weight_version "0").
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ENGINE_FLAGS = [
    "--num-threads",
    "1",
    "--max-running-requests",
    "64",
    "--max-context-tokens",
    "1024",
    "--weight-version",
    "0",
]


@pytest.fixture(scope="session")
def engine_model(tmp_path_factory) -> Path:
    from agentrl.models.builder import init_model

    return init_model(tmp_path_factory.mktemp("engine_model") / "tiny", "tiny", seed=0)


@pytest.fixture(scope="session")
def engine_fleet(engine_model, tmp_path_factory):
    procs = start_engines(engine_model, 2, tmp_path_factory.mktemp("engine_logs"), via_cli=True)
    yield procs
    for p in procs:
        p.stop()


@pytest.fixture(scope="session")
def engine_urls(engine_fleet) -> list[str]:
    return [p.url for p in engine_fleet]


@pytest.fixture(scope="session")
def engine_teacher(engine_model):
    return Teacher(engine_model)


def start_engines(
    model: Path,
    n: int,
    log_dir: Path,
    *,
    via_cli: bool = False,
    flags: list[str] = ENGINE_FLAGS,
    env: dict | None = None,
):
    """Start ``n`` embedded engines on free ports (optionally the first through ``agentrl serve-engine``)."""
    from agentrl.engine.launch import EngineProcess, wait_ready
    from agentrl.net import free_port

    procs = []
    try:
        for i in range(n):
            port = free_port()
            p = EngineProcess(str(model), port, extra=flags, log_path=log_dir / f"engine{i}.log", env=env)
            if via_cli and i == 0:
                p.argv = [
                    sys.executable,
                    "-m",
                    "agentrl",
                    "serve-engine",
                    "--model",
                    str(model),
                    "--port",
                    str(port),
                    *flags,
                ]
            procs.append(p.start(wait_s=0))
        for p in procs:
            wait_ready(p.url, 240, process=p.process)
    except BaseException:
        for p in procs:
            p.stop()
        raise
    return procs


class Teacher:
    """Recomputes logprobs of a generation by one teacher-forced forward pass (fp32, CPU)."""

    def __init__(self, model_path_or_model):
        import torch
        from transformers import AutoModelForCausalLM

        if isinstance(model_path_or_model, (str, Path)):
            model_path_or_model = AutoModelForCausalLM.from_pretrained(model_path_or_model, dtype=torch.float32)
        self.model = model_path_or_model.eval()

    def logprobs(self, prompt: list[int], output: list[int], temperature: float = 1.0) -> list[float]:
        import torch

        if temperature < 1e-6:
            temperature = 1.0
        ids = torch.tensor([prompt + output])
        with torch.no_grad():
            logits = self.model(ids).logits[0, len(prompt) - 1 : -1].float()
        lp = torch.log_softmax(logits / temperature, dim=-1)
        return lp.gather(1, torch.tensor(output)[:, None])[:, 0].tolist()

    def greedy(self, prompt: list[int], n: int) -> list[int]:
        import torch

        ids = list(prompt)
        with torch.no_grad():
            for _ in range(n):
                ids.append(int(self.model(torch.tensor([ids])).logits[0, -1].argmax()))
        return ids[len(prompt) :]


def max_abs_diff(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b), (len(a), len(b))
    return max((abs(x - y) for x, y in zip(a, b)), default=0.0)

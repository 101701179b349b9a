"""GPU placement: which devices each process of a run gets.

``agentrl run`` starts the learner's ranks and its engines on one machine. Left alone, every
child would see every GPU and start on GPU 0. The plan is made here, once, by pure functions
(no torch import), and applied through the environment: each child gets
``CUDA_VISIBLE_DEVICES`` listing exactly its GPUs, so inside the child they are ``cuda:0..n-1``
(the embedded engine uses ``cuda:0``; SGLang gets ``--base-gpu-id 0 --tp-size n``; torchrun's
rank r uses ``cuda:LOCAL_RANK``). Children that need no GPU (actors, the retrieval server,
CPU engines) get an empty ``CUDA_VISIBLE_DEVICES`` when GPUs are visible, so they never
create a context on GPU 0.

**Visible GPUs** come from where a cluster job says them: ``CUDA_VISIBLE_DEVICES`` when set
(SLURM, Kubernetes' device plugin and ``docker --gpus`` set it; entries may be indices or
``GPU-``/``MIG-`` UUIDs, read as CUDA reads them: up to the first invalid entry), else the
indices ``nvidia-smi -L`` lists, else none: everything runs on the CPU and the children's
environment is left as it is.

**Layout.** The learner's ranks take the first GPUs (one each: ``learner.gpus``, or
``learner.nproc`` when ``gpus`` is 0), then each engine ``agentrl run`` starts takes the next
``engine.gpus_per_engine``, then each judge engine (``[judge]``) the next ``judge.gpus_per_engine``.
Nothing overlaps, and a plan that needs more GPUs than are visible is refused with the numbers.
``engine.colocate = true`` is the one explicit exception (never for judges), for
machines with fewer GPUs than processes (one GPU: the learner and one engine on it): engines
are then laid over the learner's GPUs. Colocated processes share memory (SGLang must be
capped with ``engine.mem_fraction_static``) and cannot form an NCCL group (NCCL refuses two
ranks on one device), so the weight push uses gloo.

:func:`plan_cluster` does the same sums for ``agentrl launch``: how many nodes the engines
and the learner need for a given number of GPUs per node. See docs/run.md.
"""

from __future__ import annotations

import math
import os
import re
import shutil
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


class PlacementError(ValueError):
    """A plan that cannot work (too few GPUs, an overlap, a device setting that contradicts it)."""


def parse_visible_devices(value: str) -> tuple[str, ...]:
    """``CUDA_VISIBLE_DEVICES`` as CUDA reads it: comma-separated, up to the first invalid entry."""
    devices: list[str] = []
    for item in value.split(","):
        item = item.strip()
        if not item or item.startswith("-"):
            break
        if item in devices:
            raise PlacementError(f"CUDA_VISIBLE_DEVICES={value!r} lists GPU {item} twice")
        devices.append(item)
    return tuple(devices)


def visible_gpus(environ: Mapping[str, str] | None = None, *, nvidia_smi: str = "nvidia-smi") -> tuple[str, ...]:
    """The GPUs this machine (or job) offers: ``CUDA_VISIBLE_DEVICES``, else ``nvidia-smi -L``, else none."""
    env = os.environ if environ is None else environ
    if "CUDA_VISIBLE_DEVICES" in env:
        return parse_visible_devices(env["CUDA_VISIBLE_DEVICES"])
    exe = shutil.which(nvidia_smi)
    if exe is None:
        return ()
    try:
        out = subprocess.run([exe, "-L"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return ()
    if out.returncode != 0:
        return ()
    return tuple(re.findall(r"^GPU (\d+):", out.stdout, flags=re.MULTILINE))


@dataclass(frozen=True)
class Placement:
    """Devices per process. ``()`` means the CPU. ``engines`` covers the engines this run starts."""

    visible: tuple[str, ...]
    learner: tuple[str, ...] = ()
    engines: tuple[tuple[str, ...], ...] = ()
    colocated: bool = False
    judges: tuple[tuple[str, ...], ...] = ()  # the judge engines this run starts (never shared)

    def __post_init__(self) -> None:
        learner_owners: dict[str, str] = {}
        for r, device in enumerate(self.learner):
            self._claim(learner_owners, device, f"learner rank {r}")
        engine_owners = {} if self.colocated else learner_owners  # colocated: engines overlay the learner
        for i, devices in enumerate(self.engines):
            for device in devices:
                self._claim(engine_owners, device, f"engine{i}")
        judge_owners = {**learner_owners, **engine_owners}
        hint = "a judge engine shares no GPU: give it GPUs of its own, or set judge.device = 'cpu'"
        for i, devices in enumerate(self.judges):
            for device in devices:
                self._claim(judge_owners, device, f"judge{i}", hint)

    def _claim(
        self,
        owners: dict[str, str],
        device: str,
        owner: str,
        hint: str = "set engine.colocate = true to share the learner's GPUs with the engines on purpose",
    ) -> None:
        if device not in self.visible:
            raise PlacementError(
                f"{owner} is placed on GPU {device}, which is not visible (visible: {_fmt(self.visible)})"
            )
        if device in owners:
            raise PlacementError(f"GPU {device} is given to both {owners[device]} and {owner}; {hint}")
        owners[device] = owner

    def env_for(self, devices: tuple[str, ...]) -> dict[str, str]:
        """The environment a child on ``devices`` gets (nothing when no GPU is visible at all)."""
        return {"CUDA_VISIBLE_DEVICES": ",".join(devices)} if self.visible else {}

    def learner_env(self) -> dict[str, str]:
        return self.env_for(self.learner)

    def engine_env(self, index: int) -> dict[str, str]:
        return self.env_for(self.engines[index])

    def judge_env(self, index: int) -> dict[str, str]:
        return self.env_for(self.judges[index] if index < len(self.judges) else ())

    def cpu_env(self) -> dict[str, str]:
        return self.env_for(())

    def describe(self) -> list[str]:
        """One line per process, for ``agentrl run --dry-run`` and the run's log."""
        if not self.visible:
            return [
                "GPUs visible: none (CUDA_VISIBLE_DEVICES empty, or unset and no GPU from nvidia-smi): every process on the CPU"
            ]
        lines = [f"GPUs visible: {_fmt(self.visible)} ({len(self.visible)})"]
        ranks = len(self.learner)
        lines.append(
            f"learner: {ranks} rank{'s' if ranks != 1 else ''} on GPU {_fmt(self.learner)}"
            if ranks
            else "learner: on the CPU"
        )
        for i, devices in enumerate(self.engines):
            where = f"GPU {_fmt(devices)}" if devices else "the CPU"
            shared = sorted(set(devices) & set(self.learner))
            note = " (shared with the learner: engine.colocate)" if shared else ""
            lines.append(f"engine{i}: {where}{note}")
        for i, devices in enumerate(self.judges):
            lines.append(f"judge{i}: {f'GPU {_fmt(devices)}' if devices else 'the CPU'}")
        lines.append("actors, retrieval server: no GPU")
        return lines


def _fmt(devices: tuple[str, ...]) -> str:
    return ",".join(devices) if devices else "none"


def _wants_gpu(preference: str, key: str, visible: tuple[str, ...]) -> bool:
    """Whether a process whose device setting is ``preference`` is placed on GPUs."""
    if preference == "cpu":
        return False
    if preference == "auto":
        return bool(visible)
    if preference == "cuda":
        if not visible:
            raise PlacementError(
                f"{key} = 'cuda' but no GPU is visible (CUDA_VISIBLE_DEVICES unset or empty, and nvidia-smi lists none)"
            )
        return True
    if preference.startswith("cuda:"):
        raise PlacementError(
            f"{key} = {preference!r}: agentrl run places every process itself (each sees only its "
            "own GPUs through CUDA_VISIBLE_DEVICES); use 'cuda' or 'auto'"
        )
    raise PlacementError(f"{key} must be auto, cpu or cuda; got {preference!r}")


def plan_placement(
    visible: tuple[str, ...],
    *,
    learner_gpus: int,
    num_engines: int,
    gpus_per_engine: int,
    colocate: bool = False,
    num_judges: int = 0,
    gpus_per_judge: int = 0,
) -> Placement:
    """Learner on the first ``learner_gpus`` GPUs, then ``num_engines`` × ``gpus_per_engine``, then
    ``num_judges`` × ``gpus_per_judge`` (0 learner GPUs: the learner on the CPU; 0 engines or 0 GPUs
    per engine: engines on the CPU; the same for judges)."""
    visible = tuple(visible)
    engine_total = num_engines * gpus_per_engine
    judge_total = num_judges * gpus_per_judge
    if colocate:
        if not learner_gpus or not engine_total:
            raise PlacementError(
                "engine.colocate lays the engines over the learner's GPUs, but "
                f"{'the learner' if not learner_gpus else 'the engines'} run on the CPU"
            )
        if engine_total > learner_gpus:
            raise PlacementError(
                f"engine.colocate lays the engines over the learner's GPUs: {num_engines} engine(s) × "
                f"{gpus_per_engine} GPU need {engine_total}, the learner has {learner_gpus}"
            )
        need = learner_gpus
    else:
        need = learner_gpus + engine_total
    judges_from = need
    need += judge_total
    if need > len(visible):
        parts = f"learner {learner_gpus} + engines {num_engines} × {gpus_per_engine}" if not colocate else "learner"
        parts += f" + judges {num_judges} × {gpus_per_judge}" if judge_total else ""
        hint = (
            "; on fewer GPUs, set engine.colocate = true to share them between the learner and the engines"
            if not colocate and learner_gpus and engine_total
            else ""
        )
        seen = f"{len(visible)} {'is' if len(visible) == 1 else 'are'} visible"
        raise PlacementError(f"the plan needs {need} GPUs ({parts}) but {seen} ({_fmt(visible)}){hint}")
    learner = visible[:learner_gpus]
    start = 0 if colocate else learner_gpus
    engines = tuple(
        visible[start + i * gpus_per_engine : start + (i + 1) * gpus_per_engine] if gpus_per_engine else ()
        for i in range(num_engines)
    )
    judges = tuple(
        visible[judges_from + i * gpus_per_judge : judges_from + (i + 1) * gpus_per_judge] if gpus_per_judge else ()
        for i in range(num_judges)
    )
    return Placement(visible=visible, learner=learner, engines=engines, colocated=colocate, judges=judges)


def learner_ranks(cfg: Any) -> int:
    """Learner ranks per machine: ``learner.gpus`` (one rank per GPU) when set, else ``learner.nproc``."""
    return cfg.learner.gpus or cfg.learner.nproc


def placement_for(cfg: Any, visible: tuple[str, ...]) -> Placement:
    """The plan for ``agentrl run`` with this config on a machine that shows ``visible``."""
    e, lc = cfg.engine, cfg.learner
    learner_on_gpu = _wants_gpu(lc.device, "learner.device", visible)
    if lc.gpus and not learner_on_gpu:
        why = f"learner.device = {lc.device!r}" if lc.device == "cpu" else "no GPU is visible"
        raise PlacementError(f"learner.gpus = {lc.gpus} but {why}")
    own_engines = 0 if e.urls else e.num_engines
    engines_on_gpu = own_engines > 0 and _wants_gpu(e.device, "engine.device", visible)
    if e.colocate and e.backend == "sglang" and engines_on_gpu and not e.mem_fraction_static:
        raise PlacementError(
            "engine.colocate with SGLang needs engine.mem_fraction_static (e.g. 0.4): SGLang "
            "otherwise reserves most of the GPU's memory and the learner runs out"
        )
    j = cfg.judge
    own_judges = j.num_engines if j.enabled and not j.urls else 0
    judges_on_gpu = own_judges > 0 and _wants_gpu(j.device, "judge.device", visible)
    plan = plan_placement(
        visible,
        learner_gpus=learner_ranks(cfg) if learner_on_gpu else 0,
        num_engines=own_engines,
        gpus_per_engine=e.gpus_per_engine if engines_on_gpu else 0,
        colocate=e.colocate and own_engines > 0,
        num_judges=own_judges,
        gpus_per_judge=j.gpus_per_engine if judges_on_gpu else 0,
    )
    weight_group_backend(e.weight_group_backend, plan)  # refused now rather than after the warm start
    return plan


def weight_group_backend(requested: str, placement: Placement) -> str:
    """``engine.weight_group_backend`` for this plan: colocated processes cannot share an NCCL group."""
    if not placement.colocated:
        return requested
    if requested == "nccl":
        raise PlacementError(
            "engine.colocate puts the learner and an engine on one GPU, where NCCL cannot join "
            "them (two ranks on one device): set engine.weight_group_backend = 'gloo' or 'auto'"
        )
    return "gloo"


# ------------------------------------------------------------------------------ clusters


@dataclass(frozen=True)
class ClusterLayout:
    """Nodes for ``agentrl launch``: engines fill whole nodes first, the learner has its own nodes."""

    gpus_per_node: int
    num_engines: int
    gpus_per_engine: int
    engines_per_node: int
    engine_nodes: int
    learner_nodes: int
    learner_ranks_per_node: int

    def engine_slots(self) -> list[tuple[int, int]]:
        """(engine node, engine index on that node) for every engine, in engine order."""
        return [(i // self.engines_per_node, i % self.engines_per_node) for i in range(self.num_engines)]

    def describe(self) -> list[str]:
        return [
            f"engines: {self.num_engines} × {self.gpus_per_engine} GPU on {self.engine_nodes} node(s), "
            f"{self.engines_per_node} per node",
            f"learner: {self.learner_nodes} node(s) × {self.learner_ranks_per_node} rank(s), one GPU each",
        ]


def plan_cluster(cfg: Any, *, gpus_per_node: int, learner_nodes: int) -> ClusterLayout:
    """How many nodes the engines and the learner of ``cfg`` take with ``gpus_per_node`` GPUs each."""
    e, lc = cfg.engine, cfg.learner
    if gpus_per_node < 1 or learner_nodes < 1:
        raise PlacementError(f"gpus per node ({gpus_per_node}) and learner nodes ({learner_nodes}) must be >= 1")
    if e.colocate:
        raise PlacementError(
            "engine.colocate shares one machine's GPUs; agentrl launch gives the engines and the "
            "learner their own nodes: set engine.colocate = false"
        )
    if e.gpus_per_engine > gpus_per_node:
        raise PlacementError(
            f"engine.gpus_per_engine ({e.gpus_per_engine}) exceeds the {gpus_per_node} GPUs of a "
            "node: one engine must fit on one node"
        )
    ranks = lc.gpus or (lc.nproc if lc.nproc > 1 else gpus_per_node)
    if ranks > gpus_per_node:
        raise PlacementError(
            f"the learner wants {ranks} ranks per node (learner.gpus / learner.nproc) but a node "
            f"has {gpus_per_node} GPUs"
        )
    per_node = gpus_per_node // e.gpus_per_engine
    return ClusterLayout(
        gpus_per_node=gpus_per_node,
        num_engines=e.num_engines,
        gpus_per_engine=e.gpus_per_engine,
        engines_per_node=per_node,
        engine_nodes=math.ceil(e.num_engines / per_node),
        learner_nodes=learner_nodes,
        learner_ranks_per_node=ranks,
    )

r"""What ``agentrl run`` starts: each child's command line and environment.

Pure functions over a planned config (no trio, no torch), so that ``agentrl run --dry-run``
prints exactly what a run would start, and tests can check every child's argv and
environment without starting it. :mod:`agentrl.run.supervisor` runs the :class:`ChildSpec`\s;
:mod:`agentrl.run.stages` decides when.

* :func:`plan_config` fills in what a run picks at start: the run folder, the policy, engine
  URLs and ZMQ endpoints on free loopback ports, and the weight group's backend when engines
  share the learner's GPUs (:mod:`agentrl.run.placement`).
* Each child's environment is its placement: ``CUDA_VISIBLE_DEVICES`` with its own GPUs
  (the learner's ranks, engine *i*'s GPUs, judge *i*'s) or none (actors, the retrieval server).
* Judge engines (``[judge]``): ``judge.urls`` of their own, never in ``engine.urls``, so the learner's
  weight push never reaches them; they serve ``judge.model_path`` at version ``judge`` for good.
* **Restart policy**, one place: every long-running child of the RL stage is restarted when it
  dies, up to ``MAX_RESTARTS`` times (the supervisor backs off between tries). An engine comes
  back *without* a weight version (``--weight-version default``: it serves the warm start,
  reports SGLang's "no version", and actors wait on it) until the learner notices it and
  pushes its policy (``agentrl.learner.weight_push``, "Membership"); engines that serve a LoRA
  adapter (``learner.lora.sync = "adapter"``) also start without one, until the learner loads it.
  A learner comes back from its latest checkpoint and journal; an actor continues its budget
  under the same id; a judge engine comes back as it started.

See docs/run.md.
"""

from __future__ import annotations

import shlex
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from agentrl.config import AgentRLConfig, dump_toml
from agentrl.engine.judge import judge_engine_args
from agentrl.engine.launch import config_engine_args, engine_command, sglang_cpu_env
from agentrl.envs.base import _import_module_or_file
from agentrl.net import free_port
from agentrl.run.placement import Placement, learner_ranks, weight_group_backend
from agentrl.secrets import read_secret

ENGINES_START_S = 300.0  # how long the run waits for an engine it started to answer
MAX_RESTARTS = 3  # how often a child of the RL stage (engine, learner, actor, retrieval server) is restarted


@dataclass
class ChildSpec:
    """One child process: its command line, log file, environment, and what its exit means."""

    name: str
    argv: list[str]
    log_path: Path
    env: dict[str, str] = field(default_factory=dict)  # added to os.environ
    critical: bool = False  # its failure ends the run
    max_restarts: int = 3
    cwd: str | None = None
    restart_argv: list[str] | None = None  # the command line of a restart (None: argv again)
    redact: tuple[str, ...] = ()  # secrets in argv: replaced by <redacted> in what the child writes to its log


def plan_config(
    cfg: AgentRLConfig, run_dir: Path, policy_path: str, placement: Placement | None = None
) -> AgentRLConfig:
    """The config every child gets: run_dir, policy, engine URLs and ZMQ endpoints filled in (and,
    when engines share the learner's GPUs, the gloo weight group NCCL cannot give them)."""
    data = cfg.model_dump()
    data["run"]["run_dir"] = str(run_dir)
    data["model"]["path"] = policy_path
    if not cfg.engine.urls:
        data["engine"]["urls"] = [f"http://{cfg.engine.host}:{free_port()}" for _ in range(cfg.engine.num_engines)]
    if cfg.judge.enabled and not cfg.judge.urls:
        data["judge"]["urls"] = [f"http://{cfg.judge.host}:{free_port()}" for _ in range(cfg.judge.num_engines)]
    if placement is not None:
        data["engine"]["weight_group_backend"] = weight_group_backend(cfg.engine.weight_group_backend, placement)
    for section in [data["env"]] if data["env"] is not None else data["envs"]:
        if section["kwargs"].get("search_url") == "auto":  # this run starts the retrieval server
            section["kwargs"]["search_url"] = f"http://127.0.0.1:{free_port()}"
    data["actors"]["trajectory_endpoint"] = f"tcp://127.0.0.1:{free_port()}"
    data["actors"]["progress_endpoint"] = f"tcp://127.0.0.1:{free_port()}"
    return AgentRLConfig.model_validate(data)


def owns_judges(cfg: AgentRLConfig) -> bool:
    """Whether ``agentrl run`` starts judge engines itself (a judge model and no ``judge.urls``); asked of
    the config before :func:`plan_config` fills the urls in."""
    return cfg.judge.enabled and not cfg.judge.urls


def judge_problem(cfg: AgentRLConfig) -> str | None:
    """Why the run cannot score: an env class that declares a ``judge`` in a config with no judge model
    (every reward it scores would be an error); None when there is none. Imports the env modules."""
    if cfg.judge.enabled:
        return None
    wanting = []
    for section in cfg.env_sections:
        module, name = section.cls.rsplit(":", 1)
        try:
            cls = getattr(_import_module_or_file(module), name, None)
        except ValueError:
            continue  # the env's own error comes where it is built
        if cls is not None and hasattr(cls, "judge"):
            wanting.append(section.name or section.cls)
    if not wanting:
        return None
    return (
        f"env(s) {', '.join(wanting)} score with a judge model, but the config has none: set judge.model_path "
        "(docs/run.md, 'Rewards judged by a model')"
    )


def policy_path(cfg: AgentRLConfig, run_dir: Path) -> str:
    """The policy the engines serve: the warm start's export, or ``model.path``."""
    return str(run_dir / "sft" / "model") if cfg.sft.enabled else cfg.model.path


def agentrl_argv(*args: str) -> list[str]:
    return [sys.executable, "-m", "agentrl", *args]


def write_config(cfg: AgentRLConfig, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(dump_toml(cfg))
    return path


# ------------------------------------------------------------------------------ children


def engine_specs(
    cfg: AgentRLConfig, run_dir: Path, placement: Placement, secret: Callable[[str], str] | None = None
) -> list[ChildSpec]:
    """The engines this run starts (``engine.urls`` of a planned config), each on its own devices.
    First started at version 0 (they serve ``model.path``, the learner's version 0); restarted
    without a version, so that nothing they answer before the learner's push counts. With
    ``learner.lora.sync = "adapter"`` also first started without one: every actor request names
    the adapter, which only the learner loads (it then sets the version), and SGLang refuses a
    request naming an adapter it has never loaded (actors wait on such an engine while it reports
    ``"default"``; a number means it holds the adapter).

    SGLang takes its keys only as flags and logs them at start (``server_args=...``, info level, from
    ``sglang/srt/entrypoints/engine.py:Engine._launch_subprocesses``; only watermark secrets are masked):
    an SGLang engine's keys are ``redact``ed from its log in the run folder."""
    e, python, secret_of = cfg.engine, cfg.engine.sglang_python, secret or read_secret
    keys = (
        tuple(k for k in (secret_of(e.api_key_env), secret_of(e.admin_api_key_env)) if k)
        if e.backend == "sglang"
        else ()
    )
    specs = []
    for i, url in enumerate(cfg.engine.urls):
        host, port = url.rsplit("//", 1)[1].rsplit(":", 1)
        on_cpu = i >= len(placement.engines) or not placement.engines[i]
        unversioned = config_engine_args(cfg, secret=secret, weight_version="default", on_cpu=on_cpu)
        extra = (
            unversioned if cfg.learner.lora.served_adapter else config_engine_args(cfg, secret=secret, on_cpu=on_cpu)
        )
        argv = engine_command(cfg.model.path, int(port), backend=e.backend, host=host, extra=extra, python=python)
        again = engine_command(
            cfg.model.path, int(port), backend=e.backend, host=host, extra=unversioned, python=python
        )
        specs.append(
            ChildSpec(
                f"engine{i}",
                argv,
                run_dir / "logs" / f"engine{i}.log",
                env=engine_env(cfg, placement, i, on_cpu),
                max_restarts=MAX_RESTARTS,
                restart_argv=again,
                redact=keys,
            )
        )
    return specs


def engine_env(cfg: AgentRLConfig, placement: Placement, index: int, on_cpu: bool) -> dict[str, str]:
    """Engine ``index``'s environment: its GPUs, and for SGLang its CPU switches (on no GPU) and
    ``engine.sglang_env`` (a ``PYTHONPATH`` there goes after the CPU stand-in's)."""
    env = placement.engine_env(index)
    if cfg.engine.backend != "sglang":
        return env
    user = dict(cfg.engine.sglang_env)
    if on_cpu:
        env.update(sglang_cpu_env(user) if "PYTHONPATH" in user else sglang_cpu_env())
        user.pop("PYTHONPATH", None)
    return {**env, **user}


def judge_specs(
    cfg: AgentRLConfig, run_dir: Path, placement: Placement, secret: Callable[[str], str] | None = None
) -> list[ChildSpec]:
    """The judge engines this run starts (``judge.urls`` of a planned config), each on its own devices
    (or the CPU), serving ``judge.model_path`` at version ``judge``; restarted as they started (they hold
    nothing the run changes). An SGLang judge's key is ``redact``ed from its log, as an engine's."""
    j = cfg.judge
    python = j.sglang_python or cfg.engine.sglang_python
    key = (secret or read_secret)(j.api_key_env) if j.backend == "sglang" else ""
    specs = []
    for i, url in enumerate(j.urls):
        host, port = url.rsplit("//", 1)[1].rsplit(":", 1)
        on_cpu = i >= len(placement.judges) or not placement.judges[i]
        extra = judge_engine_args(j, secret=secret, on_cpu=on_cpu, num_threads=cfg.run.torch_num_threads)
        env = placement.judge_env(i)
        if j.backend == "sglang" and on_cpu:
            env.update(sglang_cpu_env())
        specs.append(
            ChildSpec(
                f"judge{i}",
                engine_command(j.model_path, int(port), backend=j.backend, host=host, extra=extra, python=python),
                run_dir / "logs" / f"judge{i}.log",
                env=env,
                max_restarts=MAX_RESTARTS,
                redact=(key,) if key else (),
            )
        )
    return specs


def learner_spec(cfg: AgentRLConfig, run_dir: Path, placement: Placement) -> ChildSpec:
    """``agentrl learn`` on the learner's devices (torchrun starts one rank per device); restarted
    from its latest checkpoint (``learner.resume = "auto"``) and journal."""
    return ChildSpec(
        "learner",
        agentrl_argv("learn", "--config", str(run_dir / "config.toml")),
        run_dir / "logs" / "learner.log",
        env=placement.learner_env(),
        max_restarts=MAX_RESTARTS,
    )


def actor_specs(cfg: AgentRLConfig, run_dir: Path, placement: Placement) -> list[ChildSpec]:
    """``actors.num_processes`` actor processes, no GPU; restarted (what they had in flight is
    abandoned; the same id continues its budget)."""
    n = cfg.actors.num_processes
    specs = []
    for i in range(n):
        args = [
            "serve-actors",
            "--config",
            str(run_dir / "config.toml"),
            "--index",
            str(i),
            "--num-actors",
            str(n),
            "--wait-for-learner",
            "--start-gate",
            str(rl_gate_path(run_dir)),
            "--log-interval-s",
            "10",
        ]
        if cfg.actors.dump_trajectories:
            args += ["--dump-trajectories", str(trajectories_path(run_dir, i))]
        specs.append(
            ChildSpec(
                f"actor{i}",
                agentrl_argv(*args),
                run_dir / "logs" / f"actor{i}.log",
                env=placement.cpu_env(),
                max_restarts=MAX_RESTARTS,
            )
        )
    return specs


def rl_gate_path(run_dir: Path) -> Path:
    """The file whose existence lets the actors start episodes: the run's actors start up during the
    evaluation before RL and wait for it (an actor restarted later finds it there)."""
    return run_dir / "rl_started"


def trajectories_path(run_dir: Path, index: int) -> Path:
    """Where actor ``index`` appends its groups with ``actors.dump_trajectories``."""
    return run_dir / "trajectories" / f"actor{index}.jsonl"


def child_specs(
    cfg: AgentRLConfig,
    run_dir: Path,
    placement: Placement,
    *,
    own_engines: bool,
    own_judges: bool = False,
    secret: Callable[[str], str] | None = None,
) -> list[ChildSpec]:
    """Every long-running child of the RL stage, as ``agentrl run`` starts them (``cfg`` is planned)."""
    engines = engine_specs(cfg, run_dir, placement, secret) if own_engines else []
    judges = judge_specs(cfg, run_dir, placement, secret) if own_judges else []
    return [*engines, *judges, learner_spec(cfg, run_dir, placement), *actor_specs(cfg, run_dir, placement)]


def describe_children(specs: list[ChildSpec]) -> list[str]:
    """``NAME  CUDA_VISIBLE_DEVICES=...  argv``, one line per child (``--dry-run``)."""
    lines = []
    for spec in specs:
        env = " ".join(f"{k}={shlex.quote(v)}" for k, v in spec.env.items())
        lines.append(f"{spec.name:<9} {env + '  ' if env else ''}{shlex.join(spec.argv)}")
    return lines


def dry_run_lines(cfg: AgentRLConfig, run_dir: Path, placement: Placement) -> list[str]:
    """What ``agentrl run --dry-run`` prints after the config: the placement and every child's command."""

    def shown(var: str) -> str:  # the variable's name where a key is set: never print a key
        return f"${var}" if read_secret(var) else ""

    planned = plan_config(cfg, run_dir, policy_path(cfg, run_dir), placement)
    lines = ["placement (agentrl/run/placement.py):", *(f"  {line}" for line in placement.describe())]
    if cfg.sft.enabled:
        lines.append(f"  warm start (sft): the learner's devices, {learner_ranks(cfg)} rank(s)")
    lines.append(f"children in {run_dir} (ports are picked again at start):")
    specs = child_specs(
        planned, run_dir, placement, own_engines=not cfg.engine.urls, own_judges=owns_judges(cfg), secret=shown
    )
    lines += [f"  {line}" for line in describe_children(specs)]
    return lines

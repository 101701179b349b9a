"""The ``agentrl`` command.

Every command imports its heavy dependencies (torch, transformers, mlflow) inside its own body, so
``agentrl --help`` stays fast. Commands register here and nowhere else. See docs/run.md.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

app = typer.Typer(
    name="agentrl",
    help="Asynchronous, off-policy RL for multi-turn LLM agents.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)

ConfigArg = Annotated[Path, typer.Argument(help="Run config (TOML).", exists=False)]
ConfigOpt = Annotated[Path | None, typer.Option("--config", "-c", help="Run config (TOML).")]
OverrideOpt = Annotated[
    list[str] | None, typer.Option("--set", "-s", help="Override a config key: section.key=value (repeatable).")
]


def _load(config: Path | None, overrides: list[str] | None):
    from agentrl.config import ConfigError, load_config

    try:
        return load_config(config, overrides or [])
    except ConfigError as e:
        typer.secho(f"config error: {e}", fg=typer.colors.RED, err=True)
        raise typer.Exit(2) from None


@app.command("init-model")
def init_model_cmd(
    out_dir: Annotated[Path, typer.Argument(help="Folder to write the model and tokenizer to.")],
    size: Annotated[
        str,
        typer.Option(
            help="tiny (~1M params), small (~25M), 0.5b (Qwen2.5-0.5B shape) or tiny-vl (a ~1.2M Qwen2.5-VL)."
        ),
    ] = "tiny",
    seed: Annotated[int, typer.Option(help="Seed for the tokenizer corpus and the weights.")] = 0,
) -> None:
    """Build a Qwen3-architecture model (or a Qwen2.5-VL, tiny-vl) and byte-level BPE tokenizer offline."""
    from agentrl.models.builder import SIZES, count_parameters, init_model

    if size not in (*SIZES, "tiny-vl"):
        typer.secho(f"unknown size {size!r}; choose one of {', '.join(SIZES)}, tiny-vl", fg=typer.colors.RED, err=True)
        raise typer.Exit(2)
    path = init_model(out_dir, size=size, seed=seed)
    typer.echo(f"wrote a {size} model ({count_parameters(path):,} parameters) to {path}")


def _sglang_problem(cfg) -> str | None:
    """Why the SGLang engines this run would start cannot start (checked before anything runs)."""
    if cfg.engine.backend != "sglang" or cfg.engine.urls:
        return None
    from agentrl.engine.launch import sglang_problem

    return sglang_problem(cfg.engine.sglang_python)


@app.command("run")
def run_cmd(
    config: ConfigArg,
    overrides: OverrideOpt = None,
    dry_run: Annotated[
        bool,
        typer.Option(
            "--dry-run",
            help="Print the resolved config, the GPU placement and "
            "every child's command, and check the env (tools, a "
            "task, its prompt, its reward, its demonstrations), "
            "then exit.",
        ),
    ] = False,
    run_dir: Annotated[Path | None, typer.Option("--run-dir", help="Run folder (default: runs/<name>-<time>).")] = None,
    live: Annotated[
        bool,
        typer.Option(
            "--live/--no-live",
            help="Show the live progress table (on a terminal); --no-live: a plain progress line every 10 s instead.",
        ),
    ] = True,
) -> None:
    """Run everything a config needs: warm start, engines, learner, actors, evaluations."""
    from agentrl.config import dump_toml
    from agentrl.run.placement import PlacementError, placement_for, visible_gpus

    cfg = _load(config, overrides)
    try:
        placement = placement_for(cfg, visible_gpus())
    except PlacementError as e:
        typer.secho(f"placement error: {e}", fg=typer.colors.RED, err=True)
        raise typer.Exit(2) from None
    from agentrl.config import resolve_run_dir
    from agentrl.run.process_plan import dry_run_lines

    folder = resolve_run_dir(cfg, run_dir)
    engine_problem = _sglang_problem(cfg)
    if dry_run:
        from agentrl.run.preflight import check_env, summary_lines

        typer.echo(dump_toml(cfg))
        typer.echo("\n".join(f"# {line}" for line in dry_run_lines(cfg, folder, placement)))
        report = check_env(cfg)
        typer.echo("\n".join(summary_lines(report)))
        if engine_problem:
            typer.secho(f"engine check: {engine_problem}", fg=typer.colors.RED, err=True)
        if not report.ok or engine_problem:
            raise typer.Exit(2)
        return
    if engine_problem:
        typer.secho(f"error: {engine_problem}", fg=typer.colors.RED, err=True)
        raise typer.Exit(2)
    import json
    import logging

    from agentrl.run.stages import StopSignal, run
    from agentrl.run.supervisor import ChildFailed

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    for noisy in ("httpx", "httpx2", "httpcore", "mlflow"):  # one line per request otherwise
        logging.getLogger(noisy).setLevel(logging.WARNING)
    typer.echo(f"run folder: {folder}")
    try:
        summary = run(cfg, folder, live_display=live, placement=placement)
    except ChildFailed as e:
        typer.secho(f"run failed: {e}", fg=typer.colors.RED, err=True)
        raise typer.Exit(1) from None
    except KeyboardInterrupt:
        typer.secho("interrupted: every process was stopped", fg=typer.colors.YELLOW, err=True)
        raise typer.Exit(130) from None
    except StopSignal as e:
        typer.secho(
            f"{e}: every process was stopped; summary: {folder / 'summary.json'}", fg=typer.colors.YELLOW, err=True
        )
        raise typer.Exit(128 + e.signum) from None
    keys = ("eval_before", "eval_after", "success_rise", "learner_steps", "policy_versions_seen", "wall_time_s")
    typer.echo(json.dumps({k: summary.get(k) for k in keys}, indent=2, default=str))
    typer.echo(f"summary: {folder / 'summary.json'}")


@app.command("launch")
def launch_cmd(
    config: ConfigArg,
    target: Annotated[str, typer.Option("--target", help="slurm (a batch script) or k8s (manifests).")],
    out: Annotated[Path, typer.Option("--out", "-o", help="Folder to write the files to (shared by every node).")],
    overrides: OverrideOpt = None,
    gpus_per_node: Annotated[int, typer.Option(min=1, help="GPUs of each node.")] = 8,
    learner_nodes: Annotated[int, typer.Option(min=1, help="Nodes of the learner (one torchrun each).")] = 1,
    router: Annotated[
        bool | None,
        typer.Option("--router/--no-router", help="sglang-router in front of the engines (default: with > 1)."),
    ] = None,
    partition: Annotated[str, typer.Option(help="slurm: the partition.")] = "",
    time_limit: Annotated[str, typer.Option("--time", help="slurm: the job's time limit.")] = "24:00:00",
    image: Annotated[
        str, typer.Option(help="k8s: an image with agentrl, sglang and sglang-router.")
    ] = "agentrl:latest",
    namespace: Annotated[str, typer.Option(help="k8s: the namespace.")] = "default",
) -> None:
    """Write what to submit to a cluster for a config: a SLURM batch script or Kubernetes manifests."""
    from agentrl.run.cluster import ClusterOptions, write_launch
    from agentrl.run.placement import PlacementError

    cfg = _load(config, overrides)
    opts = ClusterOptions(
        gpus_per_node=gpus_per_node,
        learner_nodes=learner_nodes,
        router=router,
        partition=partition,
        time_limit=time_limit,
        image=image,
        namespace=namespace,
    )
    try:
        layout, files = write_launch(cfg, target, out, opts)
    except PlacementError as e:
        typer.secho(f"launch error: {e}", fg=typer.colors.RED, err=True)
        raise typer.Exit(2) from None
    for line in layout.describe():
        typer.echo(line)
    for path in files:
        typer.echo(f"wrote {path}")
    first = next(p for p in files if p.name in ("agentrl.sbatch", "agentrl.yaml"))
    typer.echo(f"submit: {'sbatch' if target == 'slurm' else 'kubectl apply -f'} {first}")


# ---------------------------------------------------------------- engine commands (serve-engine)


@app.command(
    "serve-engine",
    context_settings={"allow_extra_args": True, "ignore_unknown_options": True},
)
def serve_engine_cmd(
    ctx: typer.Context,
    model: Annotated[Path, typer.Option("--model", help="Local Hugging Face model folder.")],
    host: Annotated[str, typer.Option(help="Address to listen on.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="Port to listen on.")] = 30000,
    backend: Annotated[str, typer.Option(help="embedded (this process, CPU or one GPU) or sglang.")] = "embedded",
    device: Annotated[
        str, typer.Option(help="auto, cpu, cuda or cuda:N (sglang: cpu adds SGLang's CPU flags).")
    ] = "auto",
    dtype: Annotated[
        str, typer.Option(help="auto (bfloat16 on GPU, float32 on CPU), float32, bfloat16, float16.")
    ] = "auto",
    max_running_requests: Annotated[int, typer.Option(help="Requests decoded together at most.")] = 64,
    max_context_tokens: Annotated[int, typer.Option(help="Prompt + completion tokens per request at most.")] = 2048,
    weight_version: Annotated[
        str, typer.Option(help='weight_version reported until the first update (SGLang\'s default: "default").')
    ] = "default",
    num_threads: Annotated[int, typer.Option(help="embedded: torch threads (0: torch's default).")] = 0,
    sglang_python: Annotated[
        str, typer.Option(help="sglang: the interpreter of the virtualenv that has sglang (default: this one).")
    ] = "",
) -> None:
    """Serve a model over SGLang's native HTTP API (extra arguments go to the server as they are)."""
    from agentrl.engine.launch import EngineLaunchError, engine_args, engine_command, require_sglang, sglang_cpu_env

    if backend not in ("embedded", "sglang"):
        typer.secho(f"unknown backend {backend!r}; choose embedded or sglang", fg=typer.colors.RED, err=True)
        raise typer.Exit(2)
    flags = engine_args(
        backend,
        device=device,
        dtype=dtype,
        max_running_requests=max_running_requests,
        max_context_tokens=max_context_tokens,
        weight_version=weight_version,
        num_threads=num_threads,
        on_cpu=backend == "sglang" and device == "cpu",
    ) + list(ctx.args)
    if backend == "sglang":
        try:
            require_sglang(sglang_python)
        except EngineLaunchError as e:
            typer.secho(f"error: {e}", fg=typer.colors.RED, err=True)
            raise typer.Exit(2) from None
        import os

        argv = engine_command(str(model), port, backend="sglang", host=host, extra=flags, python=sglang_python)
        env = {**os.environ, **(sglang_cpu_env() if device == "cpu" else {})}
        os.execve(argv[0], argv, env)  # SGLang's own process tree replaces this one
    from agentrl.run.engine_process import main as serve_main

    serve_main(["--model", str(model), "--host", host, "--port", str(port), *flags])


# ------------------------------------------------------ env and actor commands (serve-actors, serve-search)


@app.command("serve-search")
def serve_search_cmd(
    corpus: Annotated[Path, typer.Option("--corpus", help='JSONL corpus: one {"id", "text"} object per line.')],
    host: Annotated[str, typer.Option(help="Interface to listen on.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="Port (0: a free one, printed at start-up).")] = 8001,
    token_env: Annotated[
        str,
        typer.Option(help="Environment variable (or <NAME>_FILE) holding a bearer token that /retrieve then requires."),
    ] = "AGENTRL_SEARCH_TOKEN",
) -> None:
    """Serve BM25 retrieval over a local corpus: POST /retrieve {"queries": [...], "top_k": k}."""
    from agentrl.secrets import SecretError
    from agentrl.tools.search_server import serve

    try:
        serve(corpus, host=host, port=port, token_env=token_env)
    except (ValueError, OSError, SecretError) as e:
        typer.secho(f"serve-search: {e}", fg=typer.colors.RED, err=True)
        raise typer.Exit(2) from None


@app.command("make-demos")
def make_demos_cmd(
    config: ConfigArg,
    out: Annotated[Path, typer.Option("--out", "-o", help="JSONL file to write.")],
    num: Annotated[int, typer.Option("--num", "-n", help="Number of demonstrations.")] = 1000,
    overrides: OverrideOpt = None,
) -> None:
    r"""Write the configured env's demonstration episodes (correct tool use) as JSONL for SFT
    (with [\[envs]], each env's share of NUM by weight). The env's demonstrations are checked first
    (tool calls against its tools, a few scored by its reward): a problem exits 2 and writes nothing."""
    import json

    from agentrl.envs import demonstrated, make_envs
    from agentrl.run.preflight import DemoChecker

    cfg = _load(config, overrides)
    try:
        envs = make_envs(cfg)
    except ValueError as e:
        typer.secho(f"make-demos: {e}", fg=typer.colors.RED, err=True)
        raise typer.Exit(2) from None
    out.parent.mkdir(parents=True, exist_ok=True)
    total_weight = sum(section.weight for section, _ in envs)
    partial = out.with_name(out.name + ".partial")  # becomes ``out`` only when every demonstration passed
    problems: list[str] = []
    with partial.open("w") as f:
        for section, env in envs:
            share = num if len(envs) == 1 else round(num * section.weight / total_weight)
            checker = DemoChecker(env, cfg.learner.max_abs_reward)
            try:
                for task, record in demonstrated(env, share, seed=cfg.run.seed):
                    checker.add(task, record["messages"])
                    f.write(json.dumps(record) + "\n")
            except Exception as e:  # the env's tasks() or demonstration() raised
                problems.append(f"{env.name}: demonstrations: {type(e).__name__}: {e}")
            found, notes = checker.finish()  # which closes the env
            problems += [f"{env.name}: {problem}" for problem in found]
            typer.echo(f"{type(env).__name__}: {'; '.join(notes) or 'no demonstrations'}")
    if problems:
        partial.unlink()
        for problem in problems:
            typer.secho(f"make-demos: PROBLEM: {problem}", fg=typer.colors.RED, err=True)
        typer.secho(f"make-demos: nothing written to {out}", fg=typer.colors.RED, err=True)
        raise typer.Exit(2)
    partial.replace(out)
    typer.echo(f"wrote them to {out}")


@app.command("serve-actors")
def serve_actors_cmd(
    config: ConfigOpt = None,
    overrides: OverrideOpt = None,
    dump_trajectories: Annotated[
        Path | None, typer.Option("--dump-trajectories", help="Also append every group to this JSONL file.")
    ] = None,
    max_groups: Annotated[int | None, typer.Option("--max-groups", min=1, help="Stop after N groups.")] = None,
    index: Annotated[int, typer.Option("--index", min=0, help="This actor's index among the actor processes.")] = 0,
    num_actors: Annotated[
        int | None,
        typer.Option("--num-actors", min=1, help="Actor processes in all (default: actors.num_processes)."),
    ] = None,
    send: Annotated[bool, typer.Option("--send/--no-send", help="Send groups to the learner over ZMQ.")] = True,
    wait_for_learner: Annotated[
        bool, typer.Option("--wait-for-learner", help="Start no episode before the learner's first progress message.")
    ] = False,
    start_gate: Annotated[
        Path | None,
        typer.Option(
            "--start-gate",
            help="Start no episode before this file exists (start up now, run later: agentrl run opens it when RL "
            "starts).",
        ),
    ] = None,
    split: Annotated[str, typer.Option("--split", help="Task split: train (cycles) or test (one pass).")] = "train",
    log_interval_s: Annotated[float, typer.Option("--log-interval-s", help="Seconds between metric lines.")] = 30.0,
) -> None:
    """Run many concurrent episodes against the engines and send them to the learner as groups."""
    cfg = _load(config, overrides)
    from agentrl.run.actor_process import serve_actors

    try:
        code = serve_actors(
            cfg,
            dump_path=dump_trajectories,
            max_groups=max_groups,
            index=index,
            num_actors=num_actors,
            send=send,
            wait_for_learner=wait_for_learner,
            start_gate=start_gate,
            split=split,
            log_interval_s=log_interval_s,
        )
    except ValueError as e:
        typer.secho(f"serve-actors: {e}", fg=typer.colors.RED, err=True)
        raise typer.Exit(2) from None
    raise typer.Exit(code)


# ------------------------------------------------------------- learner commands (learn, sft, export)

NprocOpt = Annotated[
    int | None,
    typer.Option(
        "--nproc", help="Ranks on this machine (default: learner.gpus, else learner.nproc); > 1 uses torchrun."
    ),
]
NnodesOpt = Annotated[int, typer.Option("--nnodes", min=1, help="Learner machines; > 1 joins them by c10d rendezvous.")]
RdzvEndpointOpt = Annotated[
    str, typer.Option("--rdzv-endpoint", help="HOST:PORT of the rendezvous, the same on every node (--nnodes > 1).")
]
RdzvIdOpt = Annotated[str, typer.Option("--rdzv-id", help="Rendezvous id, the same on every node of one job.")]
LocalAddrOpt = Annotated[
    str,
    typer.Option(
        "--local-addr",
        help="This node's address as the others reach it; the node whose address sorts "
        "first is rank 0 (default: its FQDN).",
    ),
]


def _learner_launch(
    command: str,
    config: Path | None,
    nproc: int | None,
    overrides: list[str] | None,
    nnodes: int,
    rdzv_endpoint: str,
    rdzv_id: str,
    local_addr: str,
) -> None:
    cfg = _load(config, overrides)  # validate before starting anything
    from agentrl.config import ConfigError
    from agentrl.learner.launch import Nodes, launch
    from agentrl.run.placement import learner_ranks

    nodes = Nodes(nnodes=nnodes, rdzv_endpoint=rdzv_endpoint, rdzv_id=rdzv_id, local_addr=local_addr)
    try:
        code = launch(command, config, list(overrides or []), nproc or learner_ranks(cfg), nodes)
    except (ConfigError, ValueError) as e:
        typer.secho(f"{command} error: {e}", fg=typer.colors.RED, err=True)
        raise typer.Exit(2) from None
    raise typer.Exit(code)


@app.command("learn")
def learn_cmd(
    config: ConfigOpt = None,
    nproc: NprocOpt = None,
    overrides: OverrideOpt = None,
    nnodes: NnodesOpt = 1,
    rdzv_endpoint: RdzvEndpointOpt = "",
    rdzv_id: RdzvIdOpt = "agentrl",
    local_addr: LocalAddrOpt = "",
) -> None:
    """Train the policy from trajectory groups (FSDP2; torchrun when --nproc > 1 or --nnodes > 1)."""
    _learner_launch("learn", config, nproc, overrides, nnodes, rdzv_endpoint, rdzv_id, local_addr)


@app.command("sft")
def sft_cmd(
    config: ConfigOpt = None,
    nproc: NprocOpt = None,
    overrides: OverrideOpt = None,
    nnodes: NnodesOpt = 1,
    rdzv_endpoint: RdzvEndpointOpt = "",
    rdzv_id: RdzvIdOpt = "agentrl",
    local_addr: LocalAddrOpt = "",
) -> None:
    """Supervised warm-start on conversations (sft.data JSONL, or the env's demonstrations)."""
    _learner_launch("sft", config, nproc, overrides, nnodes, rdzv_endpoint, rdzv_id, local_addr)


@app.command("export")
def export_cmd(
    checkpoint: Annotated[Path, typer.Argument(help="A checkpoint folder, a checkpoint root, or a run folder.")],
    out_dir: Annotated[Path, typer.Argument(help="Folder to write the Hugging Face model to.")],
    dtype: Annotated[str, typer.Option(help="float32, bfloat16 or float16.")] = "float32",
    adapter: Annotated[
        bool,
        typer.Option("--adapter", help="LoRA checkpoints: write the PEFT adapter folder instead of the merged model."),
    ] = False,
    base_model: Annotated[
        Path | None,
        typer.Option(
            "--base-model",
            help="LoRA checkpoints: the base model's folder, when not where meta.json's model_path says.",
        ),
    ] = None,
) -> None:
    """Write a learner checkpoint as a Hugging Face folder (safetensors, config, tokenizer); a LoRA
    checkpoint merged into its base model, or with --adapter as a PEFT adapter folder."""
    from agentrl.learner.export import export_checkpoint

    try:
        path = export_checkpoint(checkpoint, out_dir, dtype=dtype, adapter=adapter, base_model=base_model)
    except ValueError as e:
        typer.secho(f"export error: {e}", fg=typer.colors.RED, err=True)
        raise typer.Exit(2) from None
    typer.echo(f"exported {checkpoint} to {path}")


# ------------------------------------------------------------------------ run-level commands (eval)


@app.command("eval")
def eval_cmd(
    config: ConfigArg,
    overrides: OverrideOpt = None,
    checkpoint: Annotated[
        Path | None, typer.Option("--checkpoint", help="A learner checkpoint (or run folder) to evaluate.")
    ] = None,
    num_tasks: Annotated[
        int | None, typer.Option("--num-tasks", help="Held-out tasks (default eval.num_tasks).")
    ] = None,
    sampled: Annotated[bool, typer.Option("--sampled", help="Sample at actors.temperature instead of greedy.")] = False,
) -> None:
    """Success rate and mean reward on held-out tasks (greedy by default), printed and logged."""
    import json

    from agentrl.run.evaluate import evaluate_command

    cfg = _load(config, overrides)
    try:
        result = evaluate_command(cfg, checkpoint=checkpoint, num_tasks=num_tasks, greedy=not sampled)
    except ValueError as e:
        typer.secho(f"eval error: {e}", fg=typer.colors.RED, err=True)
        raise typer.Exit(2) from None
    typer.echo(json.dumps(result, indent=2))
    from agentrl.episode.evaluation import describe_problems

    for line in describe_problems(result):
        typer.secho(f"warning: {line}", fg=typer.colors.YELLOW, err=True)


def main() -> None:
    app()


if __name__ == "__main__":
    main()

"""The ``agentrl`` command.

Every command imports its heavy dependencies (torch, transformers, mlflow) inside its own
body, so ``agentrl --help`` stays fast. Commands register here and nowhere else.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

app = typer.Typer(
    name="agentrl",
    help="Asynchronous, off-policy RL for multi-turn LLM agents.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)

ConfigArg = Annotated[Path, typer.Argument(help="Run config (TOML).", exists=False)]
OverrideOpt = Annotated[
    Optional[list[str]], typer.Option("--set", "-s", help="Override a config key: section.key=value (repeatable).")
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
    size: Annotated[str, typer.Option(help="tiny (~1M params), small (~25M) or 0.5b (Qwen2.5-0.5B shape).")] = "tiny",
    seed: Annotated[int, typer.Option(help="Seed for the tokenizer corpus and the weights.")] = 0,
) -> None:
    """Build a Qwen3-architecture model and byte-level BPE tokenizer offline."""
    from agentrl.model_builder import SIZES, count_parameters, init_model

    if size not in SIZES:
        typer.secho(f"unknown size {size!r}; choose one of {', '.join(SIZES)}", fg=typer.colors.RED, err=True)
        raise typer.Exit(2)
    path = init_model(out_dir, size=size, seed=seed)
    typer.echo(f"wrote a {size} model ({count_parameters(path):,} parameters) to {path}")


@app.command("run")
def run_cmd(
    config: ConfigArg,
    overrides: OverrideOpt = None,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Validate and print the resolved config, then exit.")] = False,
) -> None:
    """Run everything a config needs: engines, learner, actors."""
    from agentrl.config import dump_toml

    cfg = _load(config, overrides)
    if dry_run:
        typer.echo(dump_toml(cfg))
        return
    typer.secho(
        "agentrl run can only validate configs in this build (use --dry-run); "
        "the supervisor that starts engines, learner and actors is not built yet.",
        fg=typer.colors.YELLOW,
        err=True,
    )
    raise typer.Exit(2)


# ---------------------------------------------------------------- engine commands (serve-engine)


# ------------------------------------------------------ env and actor commands (serve-actors, serve-search)


@app.command("serve-actors")
def serve_actors_cmd(
    config: ConfigArg,
    overrides: OverrideOpt = None,
    dump_trajectories: Annotated[
        Optional[Path], typer.Option("--dump-trajectories", help="Also append every group to this JSONL file.")
    ] = None,
    max_groups: Annotated[Optional[int], typer.Option("--max-groups", min=1, help="Stop after N groups.")] = None,
    index: Annotated[int, typer.Option("--index", min=0, help="This actor's index among the actor processes.")] = 0,
    num_actors: Annotated[
        Optional[int],
        typer.Option("--num-actors", min=1, help="Actor processes in all (default: actors.num_processes)."),
    ] = None,
    send: Annotated[bool, typer.Option("--send/--no-send", help="Send groups to the learner over ZMQ.")] = True,
    wait_for_learner: Annotated[
        bool, typer.Option("--wait-for-learner", help="Start no episode before the learner's first progress message.")
    ] = False,
    split: Annotated[str, typer.Option("--split", help="Task split: train (cycles) or test (one pass).")] = "train",
    log_interval_s: Annotated[float, typer.Option("--log-interval-s", help="Seconds between metric lines.")] = 30.0,
    engine_client: Annotated[str, typer.Option("--engine-client", hidden=True)] = "agentrl.engine.client:EngineClient",
    transport: Annotated[str, typer.Option("--transport", hidden=True)] = "agentrl.transport",
) -> None:
    """Run many concurrent episodes against the engines and send them to the learner as groups."""
    cfg = _load(config, overrides)
    from agentrl.actors.serve import serve_actors

    try:
        code = serve_actors(cfg, dump_path=dump_trajectories, max_groups=max_groups, index=index,
                            num_actors=num_actors, send=send, wait_for_learner=wait_for_learner, split=split,
                            log_interval_s=log_interval_s, engine_client=engine_client, transport=transport)
    except ValueError as e:
        typer.secho(f"serve-actors: {e}", fg=typer.colors.RED, err=True)
        raise typer.Exit(2) from None
    raise typer.Exit(code)


# ------------------------------------------------------------- learner commands (learn, sft, export)


# ------------------------------------------------------------------------ run-level commands (eval)


def main() -> None:
    app()


if __name__ == "__main__":
    main()

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


@app.command("serve-search")
def serve_search_cmd(
    corpus: Annotated[Path, typer.Option("--corpus", help="JSONL corpus: one {\"id\", \"text\"} object per line.")],
    host: Annotated[str, typer.Option(help="Interface to listen on.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="Port (0: a free one, printed at start-up).")] = 8001,
) -> None:
    """Serve BM25 retrieval over a local corpus: POST /retrieve {"queries": [...], "top_k": k}."""
    from agentrl.tools.search_server import serve

    try:
        serve(corpus, host=host, port=port)
    except (ValueError, OSError) as e:
        typer.secho(f"serve-search: {e}", fg=typer.colors.RED, err=True)
        raise typer.Exit(2) from None


@app.command("make-demos")
def make_demos_cmd(
    config: ConfigArg,
    out: Annotated[Path, typer.Option("--out", "-o", help="JSONL file to write.")],
    num: Annotated[int, typer.Option("--num", "-n", help="Number of demonstrations.")] = 1000,
    overrides: OverrideOpt = None,
) -> None:
    """Write the configured env's demonstration episodes (correct tool use) as JSONL for SFT."""
    import json

    from agentrl.envs import demonstrations, make_env

    cfg = _load(config, overrides)
    try:
        env = make_env(cfg)
    except ValueError as e:
        typer.secho(f"make-demos: {e}", fg=typer.colors.RED, err=True)
        raise typer.Exit(2) from None
    out.parent.mkdir(parents=True, exist_ok=True)
    count = 0
    with out.open("w") as f:
        for record in demonstrations(env, num, seed=cfg.run.seed):
            f.write(json.dumps(record) + "\n")
            count += 1
    typer.echo(f"wrote {count} demonstrations of {type(env).__name__} to {out}")


# ------------------------------------------------------------- learner commands (learn, sft, export)


# ------------------------------------------------------------------------ run-level commands (eval)


def main() -> None:
    app()


if __name__ == "__main__":
    main()

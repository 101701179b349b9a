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


# ------------------------------------------------------------- learner commands (learn, sft, export)

ConfigOpt = Annotated[Optional[Path], typer.Option("--config", "-c", help="Run config (TOML).")]
NprocOpt = Annotated[
    Optional[int], typer.Option("--nproc", help="Ranks on this machine (default: learner.nproc); > 1 uses torchrun.")
]


def _learner_launch(command: str, config: Path | None, nproc: int | None, overrides: list[str] | None) -> None:
    cfg = _load(config, overrides)  # validate before starting anything
    from agentrl.config import ConfigError
    from agentrl.learner.launch import launch

    try:
        code = launch(command, config, list(overrides or []), nproc or cfg.learner.nproc)
    except (ConfigError, ValueError) as e:
        typer.secho(f"{command} error: {e}", fg=typer.colors.RED, err=True)
        raise typer.Exit(2) from None
    raise typer.Exit(code)


@app.command("learn")
def learn_cmd(config: ConfigOpt = None, nproc: NprocOpt = None, overrides: OverrideOpt = None) -> None:
    """Train the policy from trajectory groups (FSDP2; torchrun when --nproc > 1)."""
    _learner_launch("learn", config, nproc, overrides)


@app.command("sft")
def sft_cmd(config: ConfigOpt = None, nproc: NprocOpt = None, overrides: OverrideOpt = None) -> None:
    """Supervised warm-start on conversations (sft.data JSONL, or the env's demonstrations)."""
    _learner_launch("sft", config, nproc, overrides)


@app.command("export")
def export_cmd(
    checkpoint: Annotated[Path, typer.Argument(help="A checkpoint folder, a checkpoint root, or a run folder.")],
    out_dir: Annotated[Path, typer.Argument(help="Folder to write the Hugging Face model to.")],
    dtype: Annotated[str, typer.Option(help="float32, bfloat16 or float16.")] = "float32",
) -> None:
    """Write a learner checkpoint as a Hugging Face folder (safetensors, config, tokenizer)."""
    from agentrl.learner.export import export_checkpoint

    try:
        path = export_checkpoint(checkpoint, out_dir, dtype=dtype)
    except ValueError as e:
        typer.secho(f"export error: {e}", fg=typer.colors.RED, err=True)
        raise typer.Exit(2) from None
    typer.echo(f"exported {checkpoint} to {path}")


# ------------------------------------------------------------------------ run-level commands (eval)


def main() -> None:
    app()


if __name__ == "__main__":
    main()

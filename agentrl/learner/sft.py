"""``agentrl sft``: supervised warm-start on conversations with tool calls.

Data: ``sft.data`` (JSONL, one ``{"messages": [...], "tools": [...]}`` per line), or when empty
``sft.num_demonstrations`` episodes from ``Env.demonstration(task)``.

A conversation is tokenised piece by piece exactly as the actor would have produced it
(:mod:`agentrl.episode.chat`): the prompt, then per assistant message the text the model
generates for it (:meth:`ChatCodec.assistant_text`) with loss, then the template's context up to
the next assistant message (:meth:`ChatCodec.context_after_turn`) without loss. So templates that
rewrite history (Qwen3's ``<think>`` blocks) are trained on what the model generated. Image parts
of the prompt and of tool results (a vision-language model) are taken out and expanded to their pad
runs as the actor does (:meth:`ChatCodec.take_images`); the sample carries their PNG bytes.

Training uses the learner's :class:`Trainer` (token-mean NLL of assistant tokens); the order of
examples is a fixed function of ``run.seed`` and the epoch, so a resumed run skips exactly what it
trained on. The result is exported to ``sft.output_dir`` as a Hugging Face folder. See
docs/learner.md.
"""

from __future__ import annotations

import itertools
import json
import logging
import math
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from agentrl.config import AgentRLConfig, dump_toml
from agentrl.jsonl import read_jsonl
from agentrl.learner.batching import Sample

log = logging.getLogger("agentrl.learner.sft")

Conversation = tuple[list[dict[str, Any]], list[dict[str, Any]] | None]


# ------------------------------------------------------------------------ tokenisation


def tokenize_conversation(tokenizer: Any, messages: list[dict], tools: list[dict] | None = None) -> Sample:
    """The conversation's tokens as the actor would have produced them, ``loss_mask = 1`` on the
    assistant turns (thinking, content, tool calls and the end-of-turn token)."""
    from agentrl.episode.chat import codec_for

    if not messages:
        raise ValueError("empty conversation")
    turns = [i for i, m in enumerate(messages) if m.get("role") == "assistant"]
    if not turns:
        raise ValueError("conversation has no assistant message to learn from")
    if turns[0] == 0:
        raise ValueError("conversation starts with an assistant message: its prompt (system, user) is missing")
    codec = codec_for(tokenizer)
    tools = tools or None
    prompt, images = codec.take_images(messages[: turns[0]], "the prompt")
    pieces: list[tuple[list[int], int]] = [(codec.expand_images(codec.render(prompt, tools, True), images)[0], 0)]
    for n, i in enumerate(turns):
        pieces.append((codec.encode(codec.assistant_text(messages[i], tools)), 1))
        following = turns[n + 1] if n + 1 < len(turns) else len(messages)
        observations, pngs = codec.take_images(messages[i + 1 : following], f"the messages after assistant turn {n}")
        context = codec.context_after_turn(
            codec.end_of_turn_id is not None, observations, tools, add_generation_prompt=following < len(messages)
        )
        pieces.append((codec.expand_images(context, pngs)[0], 0))
        images += pngs
    ids = np.asarray([t for piece, _ in pieces for t in piece], dtype=np.int32)
    mask = np.asarray([m for piece, m in pieces for _ in piece], dtype=np.uint8)
    return Sample(tokens=ids, loss_mask=mask, behavior_logprobs=np.zeros(len(ids), dtype=np.float32), images=images)


# ------------------------------------------------------------------------ data sources


def load_jsonl(path: str | Path) -> list[Conversation]:
    """The conversations of a JSONL file; a line that is not one is a ValueError naming it."""
    out = [_conversation(row, f"{path}:{lineno}") for lineno, row in read_jsonl(path)]
    if not out:
        raise ValueError(f"{path} holds no conversations")
    return out


ROLES = ("system", "user", "assistant", "tool")


def _conversation(row: Any, where: str) -> Conversation:
    """Check what the chat template and the loss mask rely on, so that a bad line is named here
    rather than failing inside the template (a user turn without content, a tool call without a
    name) or training on nothing (no assistant turn)."""
    if not isinstance(row, dict) or not isinstance(row.get("messages"), list):
        raise ValueError(f"{where}: expected an object with a 'messages' list")
    messages = row["messages"]
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            raise ValueError(f"{where}: messages[{i}] must be an object whose role is one of {', '.join(ROLES)}")
        content = m.get("content")
        parts = isinstance(content, list) and all(isinstance(p, dict) for p in content) and m["role"] != "assistant"
        if not isinstance(content, str) and not parts and not (content is None and m["role"] == "assistant"):
            raise ValueError(
                f"{where}: messages[{i}].content must be a string (or, outside assistant messages, a list of "
                'text and image parts: {"type": "text", "text": ...}, {"type": "image_url", "image_url": '
                '{"url": "data:image/png;base64,..."}})'
            )
        calls = m.get("tool_calls")
        if calls is not None and (
            m["role"] != "assistant" or not isinstance(calls, list) or not all(_is_tool_call(c) for c in calls)
        ):
            raise ValueError(
                f'{where}: messages[{i}].tool_calls must be a list of {{"function": {{"name": ..., '
                f'"arguments": {{...}}}}}} on an assistant message'
            )
    if not any(m["role"] == "assistant" for m in messages):
        raise ValueError(f"{where}: the conversation has no assistant message to learn from")
    tools = row.get("tools")
    if tools is not None and (not isinstance(tools, list) or not all(_is_tool_schema(t) for t in tools)):
        raise ValueError(
            f'{where}: \'tools\' must be a list of tool schemas ({{"type": "function", "function": '
            f'{{"name": ..., "parameters": {{...}}}}}})'
        )
    return messages, tools


def _is_tool_call(call: Any) -> bool:
    fn = call.get("function", call) if isinstance(call, dict) else None
    return isinstance(fn, dict) and isinstance(fn.get("name"), str) and isinstance(fn.get("arguments", {}), (dict, str))


def _is_tool_schema(tool: Any) -> bool:
    fn = tool.get("function", tool) if isinstance(tool, dict) else None
    params = fn.get("parameters", {}) if isinstance(fn, dict) else None
    return (
        isinstance(fn, dict)
        and isinstance(fn.get("name"), str)
        and isinstance(params, dict)
        and isinstance(params.get("properties", {}), dict)
    )


def tool_schema(tool: Any) -> dict[str, Any]:
    """A tool's OpenAI-style schema, from a dict or an object with ``schema``/``openai_schema``
    (an attribute or a method)."""
    if isinstance(tool, dict):
        return tool
    for name in ("schema", "openai_schema", "to_openai", "json_schema"):
        value = getattr(tool, name, None)
        if value is None:
            continue
        value = value() if callable(value) else value
        if isinstance(value, dict):
            return value
    raise ValueError(f"cannot get a JSON schema from tool {tool!r} (expected a dict or a .schema)")


def env_demonstrations(cfg: AgentRLConfig) -> list[Conversation]:
    """``sft.num_demonstrations`` correct episodes from the run's env, or from its ``[[envs]]`` in
    shares by weight (an env that demonstrates nothing gives none, and is named in the log)."""
    from agentrl.envs import close_quietly, make_envs

    envs = make_envs(cfg)
    total_weight = sum(section.weight for section, _ in envs)
    out: list[Conversation] = []
    try:
        for section, env in envs:
            want = cfg.sft.num_demonstrations
            if len(envs) > 1:
                want = round(want * section.weight / total_weight)
            made = _demonstrations(env, want, cfg.run.seed)
            if len(envs) > 1:
                log.info("%d demonstrations of %s (%s)", len(made), env.name, section.cls)
            out += made
    finally:
        for _, env in envs:
            close_quietly(env)
    if not out:
        raise ValueError(
            f"{', '.join(s.cls for s, _ in envs)} gave no demonstrations (Env.demonstration returned None)"
        )
    return out


def _demonstrations(env: Any, num: int, seed: int) -> list[Conversation]:
    tools = [tool_schema(t) for t in env.tools()] or None
    out: list[Conversation] = []
    for task in itertools.islice(env.tasks("train", seed=seed), num * 4):
        if len(out) >= num:
            break
        demo = env.demonstration(task)
        if not demo:
            continue
        if demo[0].get("role") == "assistant":
            demo = env.initial_messages(task) + list(demo)
        out.append((demo, tools))
    return out


def load_samples(cfg: AgentRLConfig, tokenizer: Any) -> list[Sample]:
    conversations = load_jsonl(cfg.sft.data) if cfg.sft.data else env_demonstrations(cfg)
    limit = cfg.learner.max_tokens_per_microbatch
    samples = []
    for i, (messages, tools) in enumerate(conversations, 1):
        try:
            sample = tokenize_conversation(tokenizer, messages, tools)
        except ValueError as e:
            where = cfg.sft.data or ", ".join(section.cls for section in cfg.env_sections)
            raise ValueError(f"{where}: conversation {i}: {e}") from None
        if sample.num_tokens > limit:
            log.warning("skipping a conversation of %d tokens (> learner.max_tokens_per_microbatch)", sample.num_tokens)
            continue
        samples.append(sample)
    if not samples:
        raise ValueError("no conversation fits in learner.max_tokens_per_microbatch")
    return samples


# ------------------------------------------------------------------------ batches


def epoch_batches(samples: list[Sample], batch_tokens: int, seed: int, epoch: int) -> list[list[int]]:
    """Indices of each step's batch in one epoch: a seeded shuffle cut into ~batch_tokens chunks."""
    order = list(range(len(samples)))
    random.Random(seed * 1_000_003 + epoch).shuffle(order)
    batches: list[list[int]] = []
    current: list[int] = []
    size = 0
    for i in order:
        if current and size + samples[i].num_tokens > batch_tokens:
            batches.append(current)
            current, size = [], 0
        current.append(i)
        size += samples[i].num_tokens
    if current:
        batches.append(current)
    return batches


def total_steps(cfg: AgentRLConfig, samples: list[Sample]) -> int:
    if cfg.sft.max_steps:
        return cfg.sft.max_steps
    per_epoch = len(epoch_batches(samples, cfg.sft.batch_tokens, cfg.run.seed, 0))
    return max(1, math.ceil(cfg.sft.epochs * per_epoch))


def batches_from(samples: list[Sample], cfg: AgentRLConfig, step: int) -> Iterator[list[Sample]]:
    """The batches of (0-based) steps ``step``, ``step + 1``, ...: deterministic, so a resume
    continues exactly where the interrupted run stopped."""
    epoch = 0
    while True:
        batches = epoch_batches(samples, cfg.sft.batch_tokens, cfg.run.seed, epoch)
        for indices in batches[step:]:
            yield [samples[i] for i in indices]
        step = max(0, step - len(batches))
        epoch += 1


# ------------------------------------------------------------------------ the command


def sft(cfg: AgentRLConfig) -> Path:
    """Run supervised warm-start; returns the exported Hugging Face folder (on every rank)."""
    from transformers import AutoTokenizer

    from agentrl.config import resolve_run_dir
    from agentrl.learner.checkpoint import checkpoint_root, latest_checkpoint, load_checkpoint, save_checkpoint
    from agentrl.learner.distributed import broadcast_object, init_distributed
    from agentrl.learner.export import export_checkpoint
    from agentrl.learner.loop import open_tracker, seed_everything
    from agentrl.learner.trainer import Trainer, TrainerSpec
    from agentrl.models.builder import ensure_model

    dist_info = init_distributed(cfg.learner.device)
    seed_everything(cfg.run.seed, cfg.run.torch_num_threads)
    run_dir = Path(broadcast_object(str(resolve_run_dir(cfg)) if dist_info.is_main else None))
    if dist_info.is_main:
        run_dir.mkdir(parents=True, exist_ok=True)
        ensure_model(cfg.model.path, cfg.model.init_size, seed=cfg.run.seed)
        (run_dir / "sft_config.toml").write_text(dump_toml(cfg))
    broadcast_object(None)
    tokenizer = AutoTokenizer.from_pretrained(cfg.model.path)
    samples = load_samples(cfg, tokenizer)
    steps = total_steps(cfg, samples)
    lc = cfg.learner
    spec = TrainerSpec(
        model_path=cfg.model.path,
        lr=cfg.sft.lr,
        algorithm="sft",
        weight_decay=lc.weight_decay,
        warmup_steps=cfg.sft.warmup_steps,
        lr_schedule=cfg.sft.lr_schedule,
        total_steps=steps,
        grad_clip=lc.grad_clip,
        max_tokens_per_microbatch=lc.max_tokens_per_microbatch,
        activation_checkpointing=lc.activation_checkpointing,
    )
    trainer = Trainer(spec, dist_info)
    root = checkpoint_root(run_dir, "sft")
    if lc.resume == "auto":
        path = broadcast_object(latest_checkpoint(root) if dist_info.is_main else None)
        if path is not None:
            load_checkpoint(path, trainer)
            if dist_info.is_main:
                log.info("resumed SFT from %s at step %d/%d", path, trainer.step, steps)
    tracker = open_tracker(cfg, run_dir) if dist_info.is_main else None
    metrics_file = run_dir / "sft_metrics.jsonl"
    if tracker is not None:
        tracker.log_params(
            {
                "sft.examples": len(samples),
                "sft.steps": steps,
                **{f"sft.{k}": v for k, v in cfg.sft.model_dump().items()},
            }
        )
    try:
        last_saved = trainer.step
        batches = batches_from(samples, cfg, trainer.step)
        while trainer.step < steps:
            batch = next(batches)
            metrics = trainer.sft_step(batch)
            metrics["throughput/tokens_per_s"] = sum(s.num_tokens for s in batch) / max(
                1e-9, metrics.get("time/forward_backward_s", 0) + metrics.get("time/optimizer_s", 0)
            )
            if dist_info.is_main:
                with metrics_file.open("a") as f:
                    f.write(json.dumps({"step": trainer.step, **metrics}) + "\n")
                # MLflow every 10 steps: a write costs ~50 ms (the main rank has the tracker)
                if tracker is not None and (trainer.step % 10 == 0 or trainer.step == steps):
                    tracker.log_metrics(metrics, step=trainer.step)
                    log.info("sft step %d/%d | nll %.4f", trainer.step, steps, metrics.get("sft/nll", float("nan")))
            if lc.checkpoint_every_steps and trainer.step % lc.checkpoint_every_steps == 0:
                save_checkpoint(root, trainer, keep=lc.keep_checkpoints)
                last_saved = trainer.step
        if trainer.step != last_saved or latest_checkpoint(root) is None:
            save_checkpoint(root, trainer, keep=lc.keep_checkpoints)
    finally:
        if tracker is not None:
            tracker.close()
    out = Path(cfg.sft.output_dir) if cfg.sft.output_dir else run_dir / "sft" / "model"
    if dist_info.is_main:
        latest = latest_checkpoint(root)
        assert latest is not None, "the run's last checkpoint was saved above"
        export_checkpoint(latest, out)
        log.info("SFT done after %d steps; model written to %s", trainer.step, out)
    broadcast_object(None)
    return out

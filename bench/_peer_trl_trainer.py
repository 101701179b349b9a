"""TRL's side of bench/peer_trl.py; runs INSIDE the TRL venv that peer_trl.py makes, with this tree on PYTHONPATH.

    python bench/_peer_trl_trainer.py SPEC.json

SPEC (written by peer_trl.py from agentrl's config): the model folder, the env (``cls``, ``kwargs``), the seed, the
episode limits, the learner's hyper-parameters (``lr_factors``: the learning rate's factor at every step, from
agentrl's own schedule), the run's size (``prompts`` x ``group_size``, ``max_steps``, ``save_every``) and
``reference``: agentrl's own prompt ids and tool-response ids for the first training task (TokenChat), its tool
message and the model turn that calls the tool.

TRL 1.16's GRPOTrainer with its native tool loop (``tools=[calculator]``, ``max_tool_calling_iterations`` =
``max_turns - 1``) trains on the env's training tasks in their order, scored by the env's own reward. Before
training, the prompt ids (``_tokenize_prompts``) and tool-response ids (``_get_tool_suffix_ids``) that this trainer
builds must equal agentrl's, and TRL's response parser must read the model turn as the same tool call; otherwise it
exits 3 naming the first differing position. ``check_only`` stops there.

Writes ``out_dir/trl_result.json``: the check, and for a run every optimizer step's wall time since
``on_train_begin`` (model loading excluded) less the time spent saving checkpoints, the saved checkpoints and the
number of episodes generated.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from pathlib import Path
from typing import Any

from agentrl.envs.base import Task, load_env, total_reward
from agentrl.tools.calculator import evaluate, format_number

# TRL's per-step metrics kept in the result: its lr, the training reward, its spread, how often it calls the tool
LOGGED = (
    "learning_rate",
    "reward",
    "reward_std",
    "frac_reward_zero_std",
    "tools/call_frequency",
    "completions/mean_length",
)


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression exactly.

    Args:
        expression: for example "37 + 48 * 2".
    """
    try:  # agentrl's CalculatorTool, and its ToolBox's text for a failing call
        return format_number(evaluate(expression))
    except Exception as e:
        return f"Error: calculator failed: {type(e).__name__}: {e}"


def make_reward(env: Any) -> Any:
    """The env's own reward on TRL's conversation (prompt + completion messages), one event loop per batch."""

    def env_reward(prompts: list, completions: list, task: list[str], **_: Any) -> list[float]:
        async def all_rewards() -> list[Any]:
            coros = []
            for prompt, completion, data in zip(prompts, completions, task, strict=True):
                t = json.loads(data)
                coros.append(env.reward(Task(id=t["id"], data=t["data"]), {}, [*prompt, *completion]))
            return await asyncio.gather(*coros)

        return [total_reward(value)[0] for value in asyncio.run(all_rewards())]

    env_reward.__name__ = "env_reward"
    return env_reward


def first_difference(ours: list[int], theirs: list[int]) -> str | None:
    """None when equal; else where they part (a position, or one being a prefix of the other)."""
    for i, (a, b) in enumerate(zip(ours, theirs)):
        if a != b:
            return f"position {i}: agentrl {a}, TRL {b} (agentrl {ours[i : i + 8]}..., TRL {theirs[i : i + 8]}...)"
    if len(ours) != len(theirs):
        return f"position {min(len(ours), len(theirs))}: agentrl has {len(ours)} ids, TRL {len(theirs)}"
    return None


def check_identity(trainer: Any, ref: dict[str, Any]) -> dict[str, Any]:
    """TRL's prompt ids, tool-response ids, tool schema, tool result and parsed tool call against agentrl's."""
    from transformers.utils import get_json_schema
    from trl.chat_template_utils import parse_response

    schema = {k: v for k, v in get_json_schema(calculator)["function"].items() if k != "return"}
    problems = []
    if [schema] != [s["function"] for s in ref["tool_schemas"]]:
        problems.append(f"tool schema: agentrl {ref['tool_schemas']}, TRL {schema}")
    prompt_ids = list(trainer._tokenize_prompts([ref["prompt_messages"]])[0][0])
    if (where := first_difference(ref["prompt_ids"], prompt_ids)) is not None:
        problems.append(f"prompt ids differ at {where}")
    parsed = parse_response(trainer._tokenizer, ref["turn_ids"], prefix=prompt_ids, tools=trainer.tools)
    calls = [c["function"] for c in parsed.get("tool_calls") or []]
    if calls != [ref["tool_call"]]:
        problems.append(f"TRL parses the model turn as {calls}, agentrl as {[ref['tool_call']]}")
    result = calculator(**ref["tool_call"]["arguments"])
    if result != ref["tool_message"]["content"]:
        problems.append(f"tool result: agentrl {ref['tool_message']['content']!r}, TRL's function {result!r}")
    tool_ids = list(trainer._get_tool_suffix_ids([{"role": "tool", "name": "calculator", "content": result}]))
    if (where := first_difference(ref["tool_ids"], tool_ids)) is not None:
        problems.append(f"tool-response ids differ at {where}")
    return {"prompt_ids": len(prompt_ids), "tool_ids": len(tool_ids), "problems": problems}


def dataset(env: Any, spec: dict[str, Any], rows: int) -> Any:
    """The env's training tasks in order (agentrl's single actor takes them so), as conversational prompts."""
    import itertools

    from datasets import Dataset

    tasks = itertools.islice(env.tasks("train", spec["seed"]), rows)
    return Dataset.from_list(
        [
            {"prompt": env.initial_messages(t), "task": json.dumps({"id": t.id, "data": t.data})}
            for t in tasks  # the task's data as JSON text: one column type for every row
        ]
    )


def make_clock() -> Any:
    """A callback: every optimizer step's time since on_train_begin, checkpoint saving left out."""
    from transformers import TrainerCallback

    class Clock(TrainerCallback):
        def __init__(self) -> None:
            self.t0 = self.mark = 0.0
            self.saving = 0.0
            self.steps: list[dict[str, float]] = []
            self.saves: list[int] = []
            self.logs: dict[int, dict[str, float]] = {}

        def on_train_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            self.t0 = self.mark = time.monotonic()

        def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            self.mark = time.monotonic()
            self.steps.append({"step": state.global_step, "t": self.mark - self.t0 - self.saving})

        def on_log(self, args: Any, state: Any, control: Any, logs: Any = None, **kw: Any) -> None:
            self.mark = time.monotonic()  # the step's logging comes before its checkpoint
            if logs and "reward" in logs:
                self.logs[state.global_step] = {k: float(logs[k]) for k in LOGGED if k in logs}

        def on_save(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            self.saving += time.monotonic() - self.mark
            self.saves.append(state.global_step)

    return Clock()


def follow_schedule(factors: list[float]) -> Any:
    """A callback: TRL's constant LambdaLR multiplies the lr by agentrl's factor of each step instead
    (agentrl.learner.trainer.lr_factor, computed on agentrl's side: warm-up 0, cosine or linear to a floor)."""
    from transformers import TrainerCallback

    class FollowSchedule(TrainerCallback):
        def on_train_begin(self, args: Any, state: Any, control: Any, lr_scheduler: Any = None, **kw: Any) -> None:
            scheduler = getattr(lr_scheduler, "scheduler", lr_scheduler)  # accelerate wraps it
            scheduler.lr_lambdas = [lambda step: factors[min(step, len(factors) - 1)]] * len(scheduler.lr_lambdas)

    return FollowSchedule()


def build(spec: dict[str, Any], env: Any, rows: int, clock: Any) -> Any:
    """The GRPOTrainer with agentrl's quickstart settings (REFERENCE: "TRL as a peer on the quickstart")."""
    from transformers import AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer
    from trl.chat_template_utils import qwen3_template

    tokenizer = AutoTokenizer.from_pretrained(spec["model"])
    tokenizer.response_template = qwen3_template  # Hermes <tool_call> turns ending in <|im_end|>, as agentrl parses
    data = dataset(env, spec, rows)
    longest_prompt = max(
        len(tokenizer.apply_chat_template(p, tools=[calculator], add_generation_prompt=True, tokenize=True))
        for p in data["prompt"]
    )
    out = Path(spec["out_dir"])
    args = GRPOConfig(
        output_dir=str(out),
        max_steps=spec["max_steps"],
        per_device_train_batch_size=spec["prompts"] * spec["group_size"],  # one optimizer step per generation
        gradient_accumulation_steps=1,
        num_generations=spec["group_size"],
        learning_rate=spec["lr"],
        lr_scheduler_type="constant",  # its lambda becomes agentrl's schedule (follow_schedule)
        warmup_steps=0,
        weight_decay=spec["weight_decay"],
        adam_beta1=0.9,
        adam_beta2=0.999,
        max_grad_norm=spec["grad_clip"],
        loss_type="dapo",
        scale_rewards="none",
        beta=0.0,
        epsilon=spec["clip_low"],
        epsilon_high=spec["clip_high"],
        temperature=spec["temperature"],
        top_p=spec["top_p"],
        top_k=max(spec["top_k"], 0),
        activation_checkpointing=False,  # TRL turns it on by default
        gradient_checkpointing=False,  # its deprecated alias, TRL's default True otherwise warns
        bf16=False,
        use_cpu=True,
        model_init_kwargs={"dtype": "float32"},
        # agentrl: at most max_new_tokens_per_turn a turn, max_total_tokens for the episode (prompt included)
        generation_kwargs={"max_new_tokens": spec["max_new_tokens_per_turn"]},
        max_completion_length=spec["max_total_tokens"] - longest_prompt,
        max_tool_calling_iterations=spec["max_turns"] - 1,
        shuffle_dataset=False,
        save_strategy="steps",
        save_steps=spec["save_every"],
        save_only_model=True,
        logging_steps=1,
        report_to="none",
        disable_tqdm=True,
        seed=spec["seed"],
        dataloader_num_workers=0,
    )
    return GRPOTrainer(
        model=spec["model"],
        reward_funcs=[make_reward(env)],
        args=args,
        train_dataset=data,
        processing_class=tokenizer,
        tools=[calculator],
        callbacks=[clock, follow_schedule(spec["lr_factors"])],
    )


def main() -> None:
    import transformers

    transformers.utils.logging.disable_progress_bar()
    spec = json.loads(Path(sys.argv[1]).read_text())
    out = Path(spec["out_dir"])
    out.mkdir(parents=True, exist_ok=True)
    env = load_env(spec["env_cls"], spec["env_kwargs"])
    clock = make_clock()
    rows = 1 if spec["check_only"] else spec["max_steps"] * spec["prompts"]
    trainer = build(spec, env, rows, clock)
    check = check_identity(trainer, spec["reference"])
    result: dict[str, Any] = {"check": check}
    (out / "trl_result.json").write_text(json.dumps(result))
    if check["problems"]:
        print("token identity: FAILED\n  " + "\n  ".join(check["problems"]), flush=True)
        sys.exit(3)
    print(f"token identity: prompt {check['prompt_ids']} ids, tool response {check['tool_ids']} ids, identical")
    if spec["check_only"]:
        return
    trainer.train()
    result |= {
        "steps": clock.steps,
        "saves": clock.saves,
        "saving_s": clock.saving,
        "logs": clock.logs,
        "episodes": clock.steps[-1]["step"] * spec["prompts"] * spec["group_size"] if clock.steps else 0,
    }
    (out / "trl_result.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()

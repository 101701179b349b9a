"""Rewards judged by a model: the judge client against real embedded engines, the env side, the run's plan,
and a shortened calculator run whose reward has a judged component, end to end with real processes.

The client tests use the session's two tiny engines (tests/conftest_engine.py): batching (concurrent calls
gathered into batched /generate requests, each reply the greedy continuation of its own prompt), the time
limit, bounded concurrency, parsing, prompts too long. The run uses the quickstart's warm start as both the
policy and, frozen, the judge (tests/_judge_env.py says why), with three envs: one judged, one whose judge
replies are never a verdict, one whose judge calls always time out.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import time
from pathlib import Path
from typing import Any

import pytest
import trio

from agentrl.config import JUDGE_WEIGHT_VERSION, ConfigError, load_config
from agentrl.engine.judge import EngineJudge, JudgeSettings
from agentrl.envs.base import Task, score_episode
from agentrl.envs.judged import JudgedCalculatorEnv
from agentrl.judging import JudgeError, JudgeStats, Verdict, first_number, give_judge
from agentrl.net import free_port

ROOT = Path(__file__).resolve().parent.parent
ANY_TEXT = lambda text: 1.0  # noqa: E731 -- a tiny random model's reply is no grade: count it as one


def judge_for(urls: list[str], model: Path, **settings: Any) -> EngineJudge:
    from transformers import AutoTokenizer

    section = load_config(None, [f"judge.model_path={model}", f"judge.urls={json.dumps(urls)}"]).judge
    judge = EngineJudge.from_config(section, tokenizer=AutoTokenizer.from_pretrained(model))
    judge.settings = JudgeSettings(**{**JudgeSettings.from_config(section).__dict__, **settings})
    return judge


def run_judge(judge: EngineJudge, calls: list[Any]) -> list[Verdict | JudgeError]:
    """Enter ``judge``, make every call (a coroutine function of the judge) at once, return the outcomes in order."""
    out: list[Verdict | JudgeError] = [JudgeError("prompt", "not run")] * len(calls)

    async def main() -> None:
        async with judge:

            async def one(i: int) -> None:
                try:
                    out[i] = await calls[i](judge)
                except JudgeError as e:
                    out[i] = e

            async with trio.open_nursery() as nursery:
                for i in range(len(calls)):
                    nursery.start_soon(one, i)

    trio.run(main)
    return out


def greedy_text(teacher: Any, tokenizer: Any, ids: list[int], n: int) -> str:
    """What the engine's greedy reply must be: the teacher's tokens up to the end of turn, decoded."""
    out = teacher.greedy(ids, n)
    if tokenizer.eos_token_id in out:
        out = out[: out.index(tokenizer.eos_token_id)]
    return tokenizer.decode(out, skip_special_tokens=True)


# ------------------------------------------------------------------------------ the client, real engines


def test_concurrent_calls_are_gathered_into_batches_and_each_gets_its_own_reply(
    engine_urls, engine_model, engine_teacher
):
    judge = judge_for(engine_urls, engine_model, max_batch=4, batch_window_s=0.5, max_new_tokens=6)
    prompts = [f"What is {i} + {i * 7}?" for i in range(10)]
    calls = [lambda j, p=p: j.judge(p, parse=ANY_TEXT) for p in prompts]
    verdicts = run_judge(judge, calls)
    assert all(isinstance(v, Verdict) for v in verdicts), verdicts
    stats = judge.stats.summary()
    # ten calls at once, at most four per request: 4 + 4 now, the last 2 after the window
    assert (stats["batches"], stats["batch_max"], judge.stats.batched_calls) == (3, 4, 10)
    assert stats["calls"] == stats["verdicts"] == 10 and stats["failures"] == 0
    assert stats["weight_versions"] == {"0": 10}  # the fixture engines' version, from every reply
    for prompt, verdict in zip(prompts, verdicts):
        assert isinstance(verdict, Verdict) and verdict.score == 1.0 and verdict.weight_version == "0"
        ids = judge.render(prompt, 6)
        assert verdict.text == greedy_text(engine_teacher, judge.tokenizer, ids, 6)  # its own prompt's reply


def test_one_call_per_request_with_max_batch_1_and_concurrency_is_bounded(engine_urls, engine_model):
    judge = judge_for(engine_urls, engine_model, max_batch=1, max_concurrent_calls=2, max_new_tokens=4)
    verdicts = run_judge(judge, [lambda j, i=i: j.judge(f"Say {i}.", parse=ANY_TEXT) for i in range(6)])
    assert all(isinstance(v, Verdict) for v in verdicts)
    s = judge.stats
    assert (s.batches, s.batch_max, s.in_flight_max, s.in_flight) == (6, 1, 2, 0)


def test_chat_messages_go_through_the_judge_models_chat_template(engine_urls, engine_model):
    judge = judge_for(engine_urls, engine_model)
    messages = [{"role": "user", "content": "Grade this: 7"}]
    text = judge.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert judge.render(messages, 8) == judge.tokenizer.encode(text, add_special_tokens=False)
    assert judge.render("plain text", 8) == judge.tokenizer.encode("plain text", add_special_tokens=False)


def test_a_call_past_its_time_limit_raises_and_the_judge_goes_on(engine_urls, engine_model):
    judge = judge_for(engine_urls, engine_model, timeout_s=30.0, batch_window_s=0.05)
    too_slow, fine, loose = run_judge(
        judge,
        [
            lambda j: j.judge("What is 1 + 1?", parse=ANY_TEXT, timeout_s=1e-4),
            lambda j: j.judge("What is 2 + 2?", parse=ANY_TEXT),
            lambda j: j.judge("What is 3 + 3?", parse=ANY_TEXT, timeout_s=1e9),  # an env cannot loosen it
        ],
    )
    assert isinstance(too_slow, JudgeError) and too_slow.kind == "timeout"
    assert "no verdict within 0.0001 s (the env's timeout_s)" in str(too_slow)
    assert isinstance(fine, Verdict) and isinstance(loose, Verdict)
    assert judge.stats.failures == {"timeout": 1} and judge.stats.verdicts == 2
    assert judge.stats.batched_calls == 2  # the abandoned call was never sent


def test_a_reply_that_is_no_verdict_is_malformed(engine_urls, engine_model, caplog):
    judge = judge_for(engine_urls, engine_model, max_new_tokens=5)

    def refuse(text: str) -> float:
        raise ValueError("no grade here")

    refused, nan, kept = run_judge(
        judge,
        [
            lambda j: j.judge("Grade it.", parse=refuse),
            lambda j: j.judge("Grade it.", parse=lambda text: math.nan),
            lambda j: j.score("Grade it.", parse=lambda text: 0.25),
        ],
    )
    assert isinstance(refused, JudgeError) and refused.kind == "malformed"
    assert "the judge's reply is no verdict (ValueError: no grade here)" in str(refused)
    assert isinstance(nan, JudgeError) and nan.kind == "malformed" and "not a finite number" in str(nan)
    assert kept == 0.25
    assert judge.stats.failures == {"malformed": 2}
    assert str(refused) == "the judge's reply is no verdict (ValueError: no grade here)"  # counted by cause
    logged = [r.getMessage() for r in caplog.records if "the reply (one of the first 5 such)" in r.getMessage()]
    assert len(logged) == 2  # each reply, while there are few


def test_a_prompt_too_long_fails_before_anything_is_sent(engine_urls, engine_model):
    judge = judge_for(engine_urls, engine_model, max_context_tokens=40, max_new_tokens=8)
    long, empty = run_judge(judge, [lambda j: j.judge("word " * 60, parse=ANY_TEXT), lambda j: j.judge("")])
    assert isinstance(long, JudgeError) and long.kind == "prompt" and "judge.max_context_tokens (40)" in str(long)
    assert isinstance(empty, JudgeError) and empty.kind == "prompt"
    assert judge.stats.batches == 0 and judge.stats.failures == {"prompt": 2}


def test_unreachable_judge_engines_fail_the_call_within_its_limit(engine_model):
    judge = judge_for([f"http://127.0.0.1:{free_port()}"], engine_model, timeout_s=2.0)
    started = time.monotonic()
    (failed,) = run_judge(judge, [lambda j: j.judge("anyone?", parse=ANY_TEXT)])
    assert isinstance(failed, JudgeError) and failed.kind in ("timeout", "engine")
    assert time.monotonic() - started < 10


def test_the_judge_is_used_only_inside_its_context(engine_urls, engine_model):
    judge = judge_for(engine_urls, engine_model)
    with pytest.raises(RuntimeError, match="outside its `async with`"):
        trio.run(lambda: judge.judge("x"))


# ------------------------------------------------------------------------------ the env side (no engine)


class ScriptedJudge:
    """A judge that replies from a script (or raises), parsing as the real one does."""

    def __init__(self, reply: str | JudgeError):
        self.reply, self.prompts, self.stats = reply, [], JudgeStats()

    async def judge(self, prompt, *, parse=None, max_new_tokens=None, timeout_s=None) -> Verdict:
        self.prompts.append(prompt)
        if isinstance(self.reply, JudgeError):
            raise self.reply
        return Verdict((parse or first_number)(self.reply), self.reply, JUDGE_WEIGHT_VERSION, 0.0)

    async def score(self, prompt, **kwargs) -> float:
        return (await self.judge(prompt, **kwargs)).score


def episode(env: JudgedCalculatorEnv, answer: str | None) -> tuple[Task, list[dict[str, Any]]]:
    task = next(env.tasks("test"))
    messages = env.initial_messages(task)
    if answer is not None:
        messages.append({"role": "assistant", "content": answer})
    return task, messages


def test_the_judged_component_is_the_judges_grade_times_its_weight():
    env = JudgedCalculatorEnv(judge_weight=0.5)
    give_judge([env], ScriptedJudge("7 out of 10"))
    task, messages = episode(env, f"The answer is {next(env.tasks('test')).data['answer']}.")
    total, components, error = trio.run(lambda: score_episode(env, task, {}, messages))
    assert error is None and components == {"correct": 1.0, "judged": 0.35} and total == pytest.approx(1.35)
    assert env.is_success(task, total)  # success stays the calculator's own check
    judge = env.judge
    assert isinstance(judge, ScriptedJudge)
    assert task.data["question"] in judge.prompts[0][0]["content"]  # the template, filled in


@pytest.mark.parametrize(
    ("reply", "error"),
    [
        ("11", "JudgeError: the judge's reply is no verdict"),  # a grade outside 0..10
        ("no idea", "JudgeError: the judge's reply is no verdict"),
        (JudgeError("timeout", "no verdict within 60 s (judge.timeout_s)"), "JudgeError: no verdict within 60 s"),
    ],
)
def test_a_failed_judgment_is_a_reward_error_not_a_crash(reply, error):
    from agentrl.engine.judge import _parse

    class ParsingJudge(ScriptedJudge):
        async def judge(self, prompt, *, parse=None, **kwargs) -> Verdict:
            if isinstance(self.reply, JudgeError):
                raise self.reply
            return Verdict(_parse(self.reply, parse or first_number), self.reply, "judge", 0.0)

    env = JudgedCalculatorEnv()
    give_judge([env], ParsingJudge(reply))
    task, messages = episode(env, "The answer is 3.")
    total, components, message = trio.run(lambda: score_episode(env, task, {}, messages))
    assert (total, components) == (0.0, {}) and message is not None
    assert message.startswith("reward of JudgedCalculatorEnv failed: ") and error in message


def test_an_episode_without_a_final_answer_is_not_judged():
    env = JudgedCalculatorEnv()
    judge = ScriptedJudge("10")
    give_judge([env], judge)
    task, messages = episode(env, None)
    assert trio.run(lambda: env.reward(task, {}, messages)) == {"correct": 0.0, "judged": 0.0}
    assert judge.prompts == []


def test_envs_that_declare_a_judge_get_it_and_need_one():
    from agentrl.actors.actor import hand_judge
    from agentrl.envs.agent import AgentEnv
    from agentrl.envs.calculator import CalculatorEnv

    judged, plain, judge = JudgedCalculatorEnv(), CalculatorEnv(), ScriptedJudge("1")
    assert give_judge([judged, plain], judge) == ["calculator-judged"]
    assert judged.judge is judge and not hasattr(plain, "judge")
    with pytest.raises(ValueError, match="calculator-judged score with a judge model, but the config has none"):
        give_judge([JudgedCalculatorEnv()], None)
    assert give_judge([CalculatorEnv()], None) == []

    class JudgedAgent(AgentEnv):
        name = "judged-agent"
        judge = None

    with pytest.raises(ValueError, match="AgentEnv.*judged-agent declare a judge"):
        hand_judge([JudgedAgent()], judge)
    with pytest.raises(ValueError, match="judge_weight must be in"):
        JudgedCalculatorEnv(judge_weight=1.0)


# ------------------------------------------------------------------------------ config and the run's plan


def test_judge_config_rules():
    assert not load_config(None).judge.enabled
    for overrides, match in [
        (['judge.urls=["http://127.0.0.1:9"]'], "judge.urls needs judge.model_path"),
        (
            ["judge.model_path=/m", 'judge.urls=["http://127.0.0.1:9"]', 'engine.urls=["http://127.0.0.1:9/"]'],
            "a judge engine must not serve the policy",
        ),
        (["judge.model_path=/m", "judge.gpus_per_engine=2"], "needs judge.backend = 'sglang'"),
        (["judge.model_path=/m", "judge.max_new_tokens=4096"], "must be below judge.max_context_tokens"),
        (["judge.model_path=/m", 'judge.sglang_args=["--tp-size", "2"]'], "judge.sglang_args sets --tp-size"),
    ]:
        with pytest.raises(ConfigError, match=match):
            load_config(None, overrides)


def test_the_run_plans_judge_engines_of_their_own_outside_the_weight_group(tmp_path):
    from agentrl.run.placement import PlacementError, placement_for
    from agentrl.run.process_plan import child_specs, dry_run_lines, owns_judges, plan_config

    cfg = load_config(
        None,
        [
            "judge.model_path=/judge",
            "judge.num_engines=2",
            "engine.num_engines=2",
            "learner.gpus=1",
            "engine.device=cuda",
        ],
    )
    placement = placement_for(cfg, ("0", "1", "2", "3", "4"))
    assert (placement.learner, placement.engines, placement.judges) == (("0",), (("1",), ("2",)), (("3",), ("4",)))
    with pytest.raises(PlacementError, match=r"judges 2 × 1"):
        placement_for(cfg, ("0", "1", "2", "3"))
    assert placement_for(
        cfg.model_copy(update={"judge": cfg.judge.model_copy(update={"device": "cpu"})}), ("0", "1", "2")
    ).judges == ((), ())

    planned = plan_config(cfg, tmp_path, "/policy", placement)
    assert len(planned.judge.urls) == 2 and not set(planned.judge.urls) & set(planned.engine.urls)
    specs = {
        s.name: s for s in child_specs(planned, tmp_path, placement, own_engines=True, own_judges=owns_judges(cfg))
    }
    assert [n for n in specs if n.startswith("judge")] == ["judge0", "judge1"]
    judge0 = specs["judge0"]
    assert judge0.argv[judge0.argv.index("--model") + 1] == "/judge"
    assert judge0.argv[judge0.argv.index("--weight-version") + 1] == JUDGE_WEIGHT_VERSION
    assert judge0.env == {"CUDA_VISIBLE_DEVICES": "3"} and judge0.restart_argv is None  # restarted as it started
    assert judge0.argv[judge0.argv.index("--port") + 1] == planned.judge.urls[0].rsplit(":", 1)[1]
    lines = dry_run_lines(cfg, tmp_path, placement)
    assert any(line.strip().startswith("judge1") for line in lines) and "  judge0: GPU 3" in lines
    # judges named by url are not started
    external = planned.model_copy(update={"judge": planned.judge.model_copy(update={"urls": ["http://10.0.0.9:8"]})})
    assert not owns_judges(external) and not [
        s for s in child_specs(external, tmp_path, placement, own_engines=True) if s.name.startswith("judge")
    ]


def test_a_run_whose_env_needs_a_judge_it_lacks_is_refused_before_anything_starts(tmp_path):
    from agentrl.run.placement import Placement
    from agentrl.run.process_plan import judge_problem
    from agentrl.run.stages import run

    sets = ["env.cls=agentrl.envs.judged:JudgedCalculatorEnv", "env.name=graded"]
    cfg = load_config(None, sets)
    assert "env(s) graded score with a judge model, but the config has none" in (judge_problem(cfg) or "")
    assert judge_problem(load_config(None, [*sets, "judge.model_path=/m"])) is None
    assert judge_problem(load_config(None)) is None
    with pytest.raises(ValueError, match="graded score with a judge model"):
        run(cfg, tmp_path / "run", live_display=False, placement=Placement(visible=()))
    assert not (tmp_path / "run").exists()


# ------------------------------------------------------------------------------ end to end


JUDGED_RUN = """
[run]
name = "judged"
torch_num_threads = 1
[engine]
max_context_tokens = 256
max_running_requests = 64
[judge]
model_path = "{judge}"
max_context_tokens = 256
max_new_tokens = 12
max_batch = 8
batch_window_s = 0.02
timeout_s = 120
[actors]
num_concurrent_episodes = 24
group_size = 4
max_new_tokens_per_turn = 32
max_staleness = 1
[[envs]]
cls = "tests._judge_env:ReferenceJudgedEnv"
name = "judged"
weight = 2.0
max_turns = 3
max_total_tokens = 256
kwargs = {{ max_ops = 1, judge_weight = 0.5 }}
[[envs]]
cls = "tests._judge_env:ReferenceJudgedEnv"
name = "garbled"
max_turns = 3
max_total_tokens = 256
kwargs = {{ max_ops = 1, strict = true }}
[[envs]]
cls = "tests._judge_env:ReferenceJudgedEnv"
name = "slow"
max_turns = 3
max_total_tokens = 256
kwargs = {{ max_ops = 1, judge_timeout_s = 0.0001 }}
[learner]
max_steps = 3
groups_per_step = 4
max_staleness = 1
dynamic_sampling = false
checkpoint_every_steps = 0
[sft]
enabled = true   # the warm start is in <run_dir>/sft/model already: reused
[eval]
num_tasks = 6
[tracking]
sample_episodes_every = 1
sample_episodes_groups = 16
"""


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_run_with_a_judged_reward_counts_its_failures_and_never_updates_the_judge(
    tmp_path: Path, quickstart_warm_start: Path
) -> None:
    from mlflow import MlflowClient

    from agentrl.run.accounting import final_reports
    from agentrl.run.stages import run

    run_dir = tmp_path / "run"
    shutil.copytree(quickstart_warm_start, run_dir / "sft" / "model")  # the policy
    judge_model = shutil.copytree(quickstart_warm_start, tmp_path / "judge")  # the same weights, frozen
    config = tmp_path / "judged.toml"
    config.write_text(JUDGED_RUN.format(judge=judge_model))
    cwd = os.getcwd()
    os.chdir(ROOT)  # the children import tests._judge_env
    try:
        summary = run(load_config(config), run_dir, live_display=False)
    finally:
        os.chdir(cwd)
    planned = load_config(run_dir / "config.toml")
    assert summary["learner_steps"] == 3
    assert any(f"judges: {judge_model} ready at {planned.judge.urls[0]}" in e for e in summary["events"])
    assert (run_dir / "logs" / "judge0.log").stat().st_size > 0

    # the actors' judge: calls counted, both failure kinds seen, every verdict from the judge's first weights
    (report,) = final_reports(run_dir)
    judge = report["judge"]
    # a call the actor's stop cancelled (its episode was cut) is unfinished, neither verdict nor failure
    assert judge["verdicts"] > 0 and judge["calls"] == judge["verdicts"] + judge["failures"] + judge["unfinished"]
    assert judge["failures_by_kind"]["malformed"] > 0 and judge["failures_by_kind"]["timeout"] > 0
    assert judge["weight_versions"] == {JUDGE_WEIGHT_VERSION: judge["verdicts"]}
    assert judge["batches"] > 0 and judge["batch_max"] >= 1
    # ... while the policy engines moved on, and the learner never addressed the judge engine
    assert len(summary["policy_versions_seen"]) >= 2
    assert planned.judge.urls[0] not in (run_dir / "logs" / "learner.log").read_text()

    # failed judgments are reward errors, in the run's events and summary and in the evaluations
    errors = {e["env"]: e for e in summary["reward_errors"]}
    assert set(errors) == {"garbled", "slow"} and len(summary["reward_errors"]) == 2, summary["reward_errors"]
    assert "the judge's reply is no verdict (ValueError: no 'Verdict: yes|no')" in errors["garbled"]["error"]
    assert "no verdict within 0.0001 s (the env's timeout_s)" in errors["slow"]["error"]
    assert any("reward error in env garbled" in e for e in summary["events"])
    for when in ("eval_before", "eval_after"):
        result = summary[when]
        by_env = result["by_env"]
        assert by_env["judged"]["n_reward_errors"] == 0 and by_env["judged"]["n"] == 6
        assert by_env["garbled"]["n_reward_errors"] >= 1 and by_env["slow"]["n_reward_errors"] >= 1
        assert set(result["judge"]["weight_versions"]) == {JUDGE_WEIGHT_VERSION}
        assert result["judge"]["failures_by_kind"]["timeout"] == by_env["slow"]["n_reward_errors"]

    # the judged component reached the learner: in its sample episodes (MLflow) and per-env counts
    rows = [json.loads(line) for line in (run_dir / "learner_metrics.jsonl").read_text().splitlines()]
    assert rows[-1].get("env/judged/received", 0) >= 1
    client = MlflowClient(tracking_uri=planned.tracking.uri)
    samples = [a.path for a in client.list_artifacts(planned.tracking.run_id, "samples")]
    assert samples
    judged = []
    for path in samples:
        doc = json.loads(Path(client.download_artifacts(planned.tracking.run_id, path, str(tmp_path))).read_text())
        judged += [e["reward_components"] for e in doc["episodes"] if e["env"] == "judged" and not e["reward_error"]]
    assert judged and all(set(c) == {"correct", "judged"} for c in judged)
    assert all(c["judged"] in (0.0, 0.5) for c in judged) and any(c["judged"] == 0.5 for c in judged)

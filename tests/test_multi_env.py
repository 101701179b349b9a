"""Several envs in one run, one of them an AgentEnv: evaluation per env (through the real engine client
and an agent endpoint), its MLflow metrics, and what ``--dry-run`` checks of each env."""

from __future__ import annotations

import pytest
import trio

from agentrl.config import load_config
from tests._actors_helpers import ScriptedEngine, TurnScript, load_tokenizer, tiny_tokenizer_dir
from tests._actors_user_env import prompt_solver

ENVS = """
[[envs]]
cls = "tests._actors_user_env:AddEnv"
weight = 2.0
[[envs]]
cls = "tests._actors_user_env:AddAgentEnv"
kwargs = { rewrite_history = true }
"""


def write_config(tmp_path, text: str, *overrides: str):
    path = tmp_path / "run.toml"
    path.write_text(text)
    return load_config(path, list(overrides))


def test_evaluation_reports_every_env_and_their_sum(tmp_path_factory, tmp_path):
    from agentrl.episode.evaluation import describe_problems
    from agentrl.run.evaluate import eval_metrics, evaluate_policy

    tok_dir = tiny_tokenizer_dir(tmp_path_factory)
    tokenizer = load_tokenizer(tok_dir)

    with ScriptedEngine(TurnScript(tokenizer, prompt_solver)) as engine:
        cfg = write_config(
            tmp_path,
            ENVS,
            f'model.path="{tok_dir}"',
            f'engine.urls=["{engine.url}"]',
            "eval.num_tasks=6",
            "eval.split=test",
            "engine.request_retries=0",
        )
        result = trio.run(evaluate_policy, cfg)
        sampled = trio.run(
            evaluate_policy, cfg.model_copy(update={"eval": cfg.eval.model_copy(update={"greedy": False})})
        )
    assert set(result["by_env"]) == {"add", "add-agent"}
    add, agent = result["by_env"]["add"], result["by_env"]["add-agent"]
    assert add["n"] == agent["n"] == 6 and result["n"] == 12 and result["n_failed"] == 0
    assert add["success_rate"] == agent["success_rate"] == result["success_rate"] == 1.0
    assert agent["finish_reasons"] == {"stop": 6} and add["finish_reasons"] == {"answer": 6}
    assert set(result["success_by_group"]) == {"add/even", "add/odd", "add-agent/even", "add-agent/odd"}
    assert sampled["greedy"] is False and sampled["n"] == 12
    assert describe_problems(result) == []
    metrics = eval_metrics(result, "eval_after")
    assert metrics["eval_after/env/add-agent/success_rate"] == 1.0 and metrics["eval_after/env/add/n"] == 6
    assert metrics["eval_after/success/add-agent_even"] == add["success_by_group"]["even"]
    # temperature 0 reached the engine for both kinds of env
    assert {r["sampling_params"]["temperature"] for r in engine.requests[:24]} == {0.0}


def test_dry_run_checks_each_env_and_understands_agent_envs(tmp_path):
    from agentrl.run.preflight import check_env, summary_lines

    report = check_env(write_config(tmp_path, ENVS, "sft.enabled=false"))
    text = "\n".join(summary_lines(report))
    assert report.ok, text
    assert "envs.1 (add-agent): agent env: its agent writes the prompts at run time" in text
    assert "envs.0 (add): tools: add, wait" in text

    # an agent env without run(), an env whose tasks raise, and two envs with one name
    broken = tmp_path / "broken.py"
    broken.write_text(
        "from agentrl.agents import AgentEnv\n"
        "class NoRun(AgentEnv):\n    name = 'add'\n"
        "    def tasks(self, split='train', seed=0):\n        raise KeyError('no data')\n"
    )
    report = check_env(write_config(tmp_path, ENVS + f'[[envs]]\ncls = "{broken}:NoRun"\n', "sft.enabled=true"))
    problems = "\n".join(report.problems)
    assert "envs.2 (add): NoRun is an AgentEnv without run(task, client)" in problems
    assert "envs.2 (add): tasks('train'): KeyError" in problems
    assert "unique" in problems and "'add'" in problems
    assert "envs.1 (add-agent): sft.enabled = true but the env demonstrates no task" in problems


def test_one_agent_env_alone_passes_the_dry_run_and_its_first_demonstration_is_checked(tmp_path):
    from agentrl.run.preflight import check_env

    cfg = load_config("examples/openai_agent/config.toml", ["model.path=/nonexistent"])
    report = check_env(cfg)
    assert report.ok, report.problems
    assert any("agent env" in n for n in report.notes) and any("tools: calculator" in n for n in report.notes)


@pytest.mark.parametrize("weights, share", [((1.0, 1.0), 0.5), ((3.0, 1.0), 0.75)])
def test_sft_takes_demonstrations_from_every_env_by_weight(tmp_path, weights, share):
    from agentrl.learner.sft import env_demonstrations

    text = f"""
[[envs]]
cls = "agentrl.envs.calculator:CalculatorEnv"
weight = {weights[0]}
[[envs]]
cls = "agentrl.envs.search_qa:SearchQAEnv"
weight = {weights[1]}
"""
    demos = env_demonstrations(write_config(tmp_path, text, "sft.num_demonstrations=40"))
    calc = [m for m, tools in demos if tools and tools[0]["function"]["name"] == "calculator"]
    assert len(demos) == 40 and len(calc) == round(40 * share)

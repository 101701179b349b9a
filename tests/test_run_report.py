"""What ``agentrl run`` shows while it runs and leaves behind: the live table, the plain progress lines
without a terminal, and ``summary.json`` (agentrl.run.report), from run folders written by hand."""

from __future__ import annotations

import json
from pathlib import Path

from agentrl.config import load_config

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "calculator" / "config.toml"


def test_live_table_shows_rl_rates(tmp_path: Path) -> None:
    import time

    from rich.console import Console

    from agentrl.run.report import RunState, progress_table

    cfg = load_config(EXAMPLE, ["learner.max_steps=20"])
    state = RunState(tmp_path)
    state.last_metrics = {"step": 3, "staleness/mean": 0.5, "reward/mean": 0.25}
    (tmp_path / "learner_status.json").write_text(
        json.dumps(
            {
                "received": 20,
                "consumed": 12,
                "duplicate": 0,
                "dropped": {"stale": 1, "zero_variance": 3},
                "buffered": 4,
                "groups_per_step": 16,
                "waiting_s": 0.0,
                "warning": "",
            }
        )
    )
    state.read_learner_status()
    state.rl_started = time.monotonic() - 10.0  # 20 groups x 8 episodes in 10 s
    state.restarts = {"engine0": 1, "learner": 2}
    console = Console(record=True, width=200)
    console.print(progress_table(state, cfg))
    text = console.export_text()
    assert "3 / 20" in text and "0.250" in text and "0.50" in text
    assert "20 / 12" in text and "4 (stale 1, zero_variance 3)" in text
    assert "engine0 1, learner 2" in text
    rate = float(text.split("episodes/s (received)")[1].split("│")[1])
    assert 15.0 < rate <= 16.0
    # one row per env: the learner's recent reward and success, groups, and the evaluations
    state.last_metrics.update(
        {
            "env/calculator/received": 12,
            "env/calculator/accepted": 9,
            "env/calculator/dropped_zero_variance": 3,
            "env/calculator/reward_recent": 0.4,
            "env/calculator/success_recent": 0.375,
            "env/calc agent/received": 8,
            "env/calc agent/accepted": 8,
            "env/calc agent/reward_recent": 0.5,
        }
    )
    state.eval_before = {
        "success_rate": 0.3,
        "reward_mean": 0.3,
        "n": 4,
        "by_env": {"calculator": {"success_rate": 0.25}, "calc agent": {"success_rate": 0.35}},
    }
    console = Console(record=True, width=140)
    console.print(progress_table(state, cfg))
    rows = {
        line.split("│")[1].strip(): line.split("│")[2].strip()
        for line in console.export_text().splitlines()
        if line.count("│") == 3
    }
    assert rows["env calculator"] == ("reward 0.400 · success 37.5% · groups 9 / dropped 3 · eval before 25.0%")
    assert rows["env calc agent"] == "reward 0.500 · groups 8 / dropped 0 · eval before 35.0%"
    assert rows["episodes (last step)"] == "-"  # no rollout/* yet
    state.last_metrics.update(
        {
            "rollout/episodes": 64.0,
            "rollout/turns_mean": 2.5,
            "rollout/tool_calls_mean": 1.25,
            "rollout/tool_errors_per_episode": 0.125,
            "rollout/truncated_frac": 0.0625,
            "rollout/response_tokens_mean": 180.4,
        }
    )
    console = Console(record=True, width=160)
    console.print(progress_table(state, cfg))
    assert (
        "64 received · turns 2.5 · tool calls 1.2 (errors 0.12) · truncated 6% · 180 tokens generated"
        in console.export_text()
    )


def test_live_table_and_summary_show_drops_and_the_learner_s_warning_before_any_step(tmp_path: Path) -> None:
    """A learner that never trains (every group dropped) still shows its counts by reason and its
    warning, in the live table, the events and summary.json (which said groups_received: 0)."""
    from rich.console import Console

    from agentrl.run.report import RunState, progress_table, summarize

    cfg = load_config(EXAMPLE)
    state = RunState(tmp_path)
    warning = "96 of the 99 groups received in the last 60 s had rewards that do not vary ..."
    (tmp_path / "learner_status.json").write_text(
        json.dumps(
            {
                "received": 99,
                "consumed": 0,
                "duplicate": 0,
                "dropped": {"zero_variance": 96},
                "buffered": 3,
                "groups_per_step": 16,
                "waiting_s": 61.0,
                "warning": warning,
            }
        )
    )
    state.read_learner_status()
    state.read_learner_status()  # said once
    console = Console(record=True, width=250)
    console.print(progress_table(state, cfg))
    text = console.export_text()
    assert "99 / 0" in text and "96 (zero_variance 96)" in text and "waiting 61 s for data: 3 / 16" in text
    assert warning in text
    summary = summarize(state, cfg, tmp_path)
    assert summary["groups_received"] == 99 and summary["groups_dropped"] == {"zero_variance": 96}
    assert summary["data_warning"] == warning
    assert sum(warning in e for e in summary["events"]) == 1


def test_without_a_terminal_the_live_view_is_a_plain_line_every_few_seconds(
    tmp_path: Path, capsys, monkeypatch
) -> None:
    """A batch job's log (stdout not a terminal) gets one plain progress line every PLAIN_LINE_S, with
    the data warning when there is one."""
    import agentrl.run.report as report
    from agentrl.run.report import PlainLines, RunState

    clock = [1000.0]
    monkeypatch.setattr(report.time, "monotonic", lambda: clock[0])
    cfg = load_config(EXAMPLE, ["learner.max_steps=20"])
    state = RunState(tmp_path)
    state.last_metrics = {"step": 5, "reward/mean": 0.5}
    state.versions_seen = {5}
    state.data.update(received=40, consumed=32, dropped={"zero_variance": 2}, warning="too flat")
    lines = PlainLines(state, cfg)
    lines.update()
    clock[0] += 3.0
    lines.update()  # too soon: nothing
    clock[0] += report.PLAIN_LINE_S
    lines.update()
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 2
    assert "step 5/20 | policy v5 | reward 0.500 | groups received 40 consumed 32 dropped 2 (zero_variance 2)" in out[0]
    assert out[0].endswith("WARNING: too flat")

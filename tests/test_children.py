"""What ``agentrl run`` starts: every child's argv and environment from the placement, the
``--dry-run`` printout, and one real run on a pretend GPU list whose children's environments
are read from /proc while they run (the processes themselves run on the CPU)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import tomllib
import uuid
from pathlib import Path

import pytest

from agentrl.config import load_config
from agentrl.engine.launch import SGLANG_VERSION
from agentrl.run.placement import placement_for
from agentrl.run.process_plan import actor_specs, child_specs, plan_config
from tests._learner_helpers import REPO, subprocess_env, tiny_model  # noqa: F401
from tests._processes import stop_agentrl_run
from tests.test_cli import run_cli
from tests.test_sglang_launch import interpreter_with_sglang


def _pairs(argv: list[str]) -> dict[str, str]:
    flags = [a for a in argv if a.startswith("--")]
    return {f: argv[argv.index(f) + 1] for f in flags if argv.index(f) + 1 < len(argv)}


def test_child_specs_carry_their_devices_flags_and_keys(tmp_path):
    cfg = load_config(
        None,
        [
            "engine.backend=sglang",
            "engine.num_engines=2",
            "engine.gpus_per_engine=2",
            "learner.gpus=2",
            "actors.num_processes=2",
            "engine.mem_fraction_static=0.8",
            "model.dtype=bfloat16",
            "model.path=/models/m",
        ],
    )
    placement = placement_for(cfg, ("0", "1", "2", "3", "4", "5"))
    planned = plan_config(cfg, tmp_path, "/models/m", placement)
    keys = {"AGENTRL_ENGINE_API_KEY": "k-user", "AGENTRL_ENGINE_ADMIN_API_KEY": "k-admin"}
    specs = {
        s.name: s
        for s in child_specs(planned, tmp_path, placement, own_engines=True, secret=lambda var: keys.get(var, ""))
    }
    assert list(specs) == ["engine0", "engine1", "learner", "actor0", "actor1"]

    for i, devices in enumerate(("2,3", "4,5")):
        engine = specs[f"engine{i}"]
        assert engine.env == {"CUDA_VISIBLE_DEVICES": devices} and not engine.critical and engine.max_restarts == 3
        assert engine.argv[:3] == [sys.executable, "-m", "sglang.launch_server"]
        flags = _pairs(engine.argv)
        assert planned.engine.urls[i] == f"http://{flags['--host']}:{flags['--port']}"
        assert flags["--model-path"] == "/models/m" and flags["--dtype"] == "bfloat16"
        assert flags["--tp-size"] == "2" and flags["--base-gpu-id"] == "0"  # its own GPUs, from the first
        assert flags["--weight-version"] == "0" and flags["--mem-fraction-static"] == "0.8"
        assert flags["--api-key"] == "k-user" and flags["--admin-api-key"] == "k-admin"
        assert engine.log_path == tmp_path / "logs" / f"engine{i}.log"
        # a restart is the same server without a version: what it answers before the learner's push is not kept
        again = _pairs(engine.restart_argv)
        assert again == {**flags, "--weight-version": "default"}

    learner = specs["learner"]
    assert learner.env == {"CUDA_VISIBLE_DEVICES": "0,1"} and not learner.critical and learner.max_restarts == 3
    assert learner.restart_argv is None  # the same command: it resumes from its checkpoint
    assert learner.argv == [sys.executable, "-m", "agentrl", "learn", "--config", str(tmp_path / "config.toml")]
    for i in range(2):
        actor = specs[f"actor{i}"]
        assert actor.env == {"CUDA_VISIBLE_DEVICES": ""} and not actor.critical and actor.max_restarts == 3
        assert _pairs(actor.argv)["--index"] == str(i) and _pairs(actor.argv)["--num-actors"] == "2"
        assert "--wait-for-learner" in actor.argv and "--dump-trajectories" not in actor.argv
    dumping = load_config(None, ["actors.dump_trajectories=true"])
    actor = actor_specs(
        plan_config(dumping, tmp_path, "/m", placement_for(dumping, ())), tmp_path, placement_for(dumping, ())
    )[0]
    assert _pairs(actor.argv)["--dump-trajectories"] == str(tmp_path / "trajectories" / "actor0.jsonl")
    assert planned.engine.weight_group_backend == "auto"  # nothing shares a GPU


def test_an_sglang_engines_keys_never_reach_its_log(tmp_path):
    """SGLang 0.5.23 takes keys only as flags and logs ``server_args={...}`` with them at start
    (entrypoints/engine.py: Engine._launch_subprocesses; only watermark secrets masked). A stand-in that
    logs its argv the same way, started by the supervisor from the engine's real spec, crashes and is
    restarted: its log in the run folder holds neither key, and still everything else."""
    import dataclasses

    import trio

    from agentrl.run.supervisor import ChildFailed, Supervisor

    cfg = load_config(None, ["engine.backend=sglang", "engine.num_engines=1", "model.path=/models/m"])
    placement = placement_for(cfg, ("0", "1"))
    planned = plan_config(cfg, tmp_path, "/models/m", placement)
    keys = {"AGENTRL_ENGINE_API_KEY": "sk-user-7f3a", "AGENTRL_ENGINE_ADMIN_API_KEY": "sk-admin-91c2"}
    (engine,) = [
        s
        for s in child_specs(planned, tmp_path, placement, own_engines=True, secret=lambda var: keys.get(var, ""))
        if s.name == "engine0"
    ]
    assert engine.redact == ("sk-user-7f3a", "sk-admin-91c2") and "sk-user-7f3a" in engine.argv  # SGLang needs it
    sglang = [
        sys.executable,
        "-c",
        "import sys; print('server_args=' + repr(dict(zip(sys.argv[1::2], sys.argv[2::2]))),"
        " flush=True); sys.exit('bye ' + sys.argv[sys.argv.index('--admin-api-key') + 1])",
        *engine.argv[3:],
    ]
    stand_in = dataclasses.replace(engine, argv=sglang, restart_argv=sglang, max_restarts=1)

    async def main() -> None:
        async with trio.open_nursery() as n:
            sup = Supervisor(stop_grace_s=2)
            await sup.start(n, stand_in)
            n.start_soon(sup.wait_for_failure)

    with pytest.raises(BaseExceptionGroup) as info:
        trio.run(main)
    failed = info.value.subgroup(ChildFailed).exceptions[0]
    log = (tmp_path / "logs" / "engine0.log").read_text()
    assert "sk-user" not in log and "sk-admin" not in log and "sk-" not in failed.log_tail
    assert log.count("'--api-key': '<redacted>'") == 2 and log.count("bye <redacted>") == 2  # start and restart
    assert "'--model-path': '/models/m'" in log and "bye <redacted>" in failed.log_tail
    embedded = load_config(None, ["engine.num_engines=1"])
    (plain,) = [
        s
        for s in child_specs(
            plan_config(embedded, tmp_path, "/m", placement_for(embedded, ())),
            tmp_path,
            placement_for(embedded, ()),
            own_engines=True,
            secret=lambda var: keys.get(var, ""),
        )
        if s.name == "engine0"
    ]
    assert plain.redact == () and "sk-user-7f3a" not in plain.argv  # it reads its keys from its environment


def test_colocated_children_share_the_gpu_and_push_weights_over_gloo(tmp_path):
    cfg = load_config(None, ["engine.colocate=true"])
    placement = placement_for(cfg, ("0",))
    planned = plan_config(cfg, tmp_path, cfg.model.path, placement)
    specs = {s.name: s for s in child_specs(planned, tmp_path, placement, own_engines=True)}
    assert specs["engine0"].env == specs["learner"].env == {"CUDA_VISIBLE_DEVICES": "0"}
    assert planned.engine.weight_group_backend == "gloo"
    assert _pairs(specs["engine0"].argv)["--device"] == "auto"  # the one GPU it sees is cuda:0


def test_dry_run_prints_the_placement_and_every_childs_command(tmp_path, monkeypatch):
    config = tmp_path / "run.toml"
    python = interpreter_with_sglang(tmp_path, SGLANG_VERSION)  # what the engine check asks (without importing it)
    # no model folder yet (as before a first run) of a size the check does not build: it loads no tokenizer
    config.write_text(
        f"[model]\npath = '{tmp_path / 'model'}'\ninit_size = 'small'\n[engine]\nbackend = 'sglang'\nnum_engines = 2\n"
        f"sglang_python = '{python}'\n[learner]\ngpus = 2\n"
    )
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-a,GPU-b,GPU-c,GPU-d")
    monkeypatch.setenv("AGENTRL_ENGINE_API_KEY", "never-printed")
    rc, text, heavy, err = run_cli("run", str(config), "--dry-run", "--run-dir", str(tmp_path / "r"))
    assert rc == 0 and not {"torch", "transformers", "mlflow"} & set(heavy), err  # the env check may import trio
    assert tomllib.loads(text)["learner"]["gpus"] == 2  # the plan is in comments: the output is still the config
    comments = [line[2:] for line in text.splitlines() if line.startswith("# ")]
    assert "  learner: 2 ranks on GPU GPU-a,GPU-b" in comments
    assert "  engine0: GPU GPU-c" in comments and "  engine1: GPU GPU-d" in comments
    children = {line.split()[0]: line for line in comments if line.startswith("  ") and " -m " in line}
    assert set(children) == {"engine0", "engine1", "learner", "actor0"}
    assert "CUDA_VISIBLE_DEVICES=GPU-d " in children["engine1"]
    assert f"{python} -m sglang.launch_server" in children["engine1"]
    assert "--tp-size 1 --base-gpu-id 0" in children["engine1"] and "--weight-version 0" in children["engine1"]
    assert "--api-key '$AGENTRL_ENGINE_API_KEY'" in children["engine0"] and "never-printed" not in text
    assert "CUDA_VISIBLE_DEVICES=GPU-a,GPU-b " in children["learner"]
    assert "CUDA_VISIBLE_DEVICES='' " in children["actor0"]


def test_run_refuses_a_plan_that_does_not_fit_before_starting_anything(tmp_path, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    rc, _, _, err = run_cli(
        "run", str(REPO / "examples" / "calculator" / "config.toml"), "--run-dir", str(tmp_path / "r")
    )
    assert rc == 2
    assert "placement error: the plan needs 2 GPUs (learner 1 + engines 1 × 1) but 1 is visible (0)" in err
    assert "engine.colocate = true" in err and not (tmp_path / "r").exists()


def _processes_with(marker: str) -> dict[int, tuple[list[str], str | None]]:
    """argv and CUDA_VISIBLE_DEVICES of every live process whose environment carries ``marker``."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            environ = (entry / "environ").read_bytes().split(b"\0")
            argv = [a.decode() for a in (entry / "cmdline").read_bytes().split(b"\0") if a]
        except OSError:
            continue
        env = dict(item.decode(errors="replace").split("=", 1) for item in environ if b"=" in item)
        if env.get("AGENTRL_TEST_MARKER") == marker:
            found[int(entry.name)] = (argv, env.get("CUDA_VISIBLE_DEVICES"))
    return found


def _role(argv: list[str], ports: list[str]) -> str:
    if "agentrl.run.engine_process" in argv:
        return f"engine{ports.index(argv[argv.index('--port') + 1])}"
    if "serve-actors" in argv:
        return f"actor{argv[argv.index('--index') + 1]}"
    if "learn" in argv:
        return "learner"
    return "run" if "run" in argv else "other"


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_real_run_gives_each_child_its_devices(tiny_model, tmp_path):
    """`agentrl run` with CUDA_VISIBLE_DEVICES=3,5,7: the learner sees 3, engine0 5, engine1 7, the actor
    none, read from each live child's /proc/<pid>/environ; all of them run on the CPU (no GPU here)."""
    marker = uuid.uuid4().hex
    run_dir = tmp_path / "run"
    overrides = [
        f"model.path={tiny_model}",
        "sft.enabled=false",
        "engine.num_engines=2",
        "learner.max_steps=2",
        "learner.groups_per_step=2",
        "actors.group_size=2",
        "actors.num_concurrent_episodes=8",
        "learner.dynamic_sampling=false",
        "actors.max_new_tokens_per_turn=24",
        "eval.num_tasks=4",
        "tracking.enabled=false",
        "learner.checkpoint_every_steps=0",
    ]
    argv = [
        sys.executable,
        "-m",
        "agentrl",
        "run",
        str(REPO / "examples" / "calculator" / "config.toml"),
        "--no-live",
        "--run-dir",
        str(run_dir),
    ]
    for item in overrides:
        argv += ["-s", item]
    env = {**subprocess_env(), "CUDA_VISIBLE_DEVICES": "3,5,7", "AGENTRL_TEST_MARKER": marker}
    proc = subprocess.Popen(
        argv, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    seen: dict[str, str | None] = {}
    end = time.monotonic() + 540  # inside the test's 600 s: what is left stops the run (and its children)
    try:
        deadline = time.monotonic() + 400
        while not {"engine0", "engine1", "learner", "actor0"} <= set(seen) and proc.poll() is None:
            assert time.monotonic() < deadline, f"children seen so far: {seen}"
            if (run_dir / "config.toml").exists():
                urls = tomllib.loads((run_dir / "config.toml").read_text())["engine"]["urls"]
                ports = [u.rsplit(":", 1)[1] for u in urls]
                for child_argv, devices in _processes_with(marker).values():
                    seen.setdefault(_role(child_argv, ports), devices)
            time.sleep(0.2)
        out, _ = proc.communicate(timeout=max(1.0, end - time.monotonic()))
    finally:
        stop_agentrl_run(proc, grace_s=40)
    assert proc.returncode == 0, out[-3000:]
    assert seen["run"] == "3,5,7"
    assert (seen["learner"], seen["engine0"], seen["engine1"], seen["actor0"]) == ("3", "5", "7", "")
    events = "\n".join(json.loads((run_dir / "summary.json").read_text())["events"])
    assert "placement: learner: 1 rank on GPU 3" in events and "placement: engine1: GPU 7" in events
    assert "GPUs visible: 3,5,7" in out  # the plan is in the run's log too

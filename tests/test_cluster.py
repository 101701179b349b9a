"""``agentrl launch``: the SLURM batch script and Kubernetes manifests generated from a run config.

The scripts must pass ``bash -n``; the SLURM script's own logic (node lists, the learner's head,
the overrides it builds, the per-engine GPU slices) is also run here with stand-ins for ``srun``,
``scontrol``, ``curl`` and ``python`` on PATH that record what they were asked to start (no
scheduler or GPU exists on this machine). The manifests must load as YAML with the expected
objects, ports and environment, and never hold a key's value.
"""

from __future__ import annotations

import os
import re
import shlex
import stat
import subprocess
import sys
import zipfile
from pathlib import Path

import httpx
import pytest
import yaml

from agentrl.config import load_config
from agentrl.engine.launch import config_engine_args
from tests import sglang_spec
from tests._learner_helpers import REPO

EXAMPLE = REPO / "examples" / "gpu_sglang" / "config.toml"
SEARCH = "env.kwargs.search_url=http://search:8001"
ROUTER_FLAGS = {"--host", "--port", "--worker-urls", "--policy"}  # what agentrl passes (plus --api-key with a key)
ROUTER_VERSION = "0.3.2"  # sglang-router, whose launcher's flags are read from its wheel (router_flags)


@pytest.fixture(scope="module")
def sglang_flags() -> frozenset[str]:
    """``python -m sglang.launch_server``'s flags, read from the pinned SGLang wheel's server_args.py
    and the arg_groups/fields namespaces it assembles ServerArgs from (tests/sglang_spec.py)."""
    try:
        return sglang_spec.launch_server_flags()
    except RuntimeError as e:
        pytest.fail(str(e))


@pytest.fixture(scope="module")
def router_flags() -> frozenset[str]:
    """``python -m sglang_router.launch_router``'s flags, read from the sglang-router wheel's argparse
    calls (``router_args.py``; its Rust core takes them from there). Downloaded once next to SGLang's."""
    cache = sglang_spec.wheel_cache()
    found = sorted(cache.glob(f"sglang_router-{ROUTER_VERSION}-*.whl"))
    if not found:
        cmd = [
            sys.executable,
            "-m",
            "pip",
            "download",
            f"sglang-router=={ROUTER_VERSION}",
            "--no-deps",
            "--only-binary=:all:",
            "--python-version",
            "3.11",
            "--platform",
            "manylinux2014_x86_64",
            "--dest",
            str(cache),
            "--quiet",
            "--disable-pip-version-check",
        ]
        run = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        found = sorted(cache.glob(f"sglang_router-{ROUTER_VERSION}-*.whl"))
        if not found:
            pytest.fail(f"could not download sglang-router {ROUTER_VERSION}: {run.stderr[-2000:]}")
    with zipfile.ZipFile(found[0]) as wheel:
        source = wheel.read("sglang_router/router_args.py").decode()
    flags = {f"--{name}" for name in re.findall(r'f"--\{prefix\}([a-z0-9-]+)"', source)}
    flags |= set(re.findall(r'"(--[a-z][a-z0-9-]+)"', source))
    assert {"--worker-urls", "--policy", "--api-key", "--health-check-endpoint"} <= flags  # the parse works
    return frozenset(flags)


def launch(tmp_path: Path, target: str, *args: str) -> tuple[subprocess.CompletedProcess, Path]:
    out = tmp_path / target
    env = {**os.environ, "PYTHONPATH": str(REPO), "AGENTRL_ENGINE_API_KEY": "sk-never-in-a-file"}
    res = subprocess.run(
        [sys.executable, "-m", "agentrl", "launch", str(EXAMPLE), "--target", target, "-o", str(out), *args],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    return res, out


def _flags(argv: list[str]) -> set[str]:
    return {a.split("=", 1)[0] for a in argv if a.startswith("--")}


# ------------------------------------------------------------------------------ SLURM


def _stub(folder: Path, name: str, body: str) -> None:
    path = folder / name
    path.write_text("#!/bin/bash\n" + body + "\n")
    path.chmod(path.stat().st_mode | stat.S_IEXEC)


def test_slurm_script_and_its_logic(tmp_path, router_flags):
    res, out = launch(
        tmp_path,
        "slurm",
        "-s",
        SEARCH,
        "-s",
        "engine.num_engines=5",
        "-s",
        "engine.gpus_per_engine=2",
        "-s",
        "learner.gpus=8",
        "-s",
        "actors.num_processes=3",
        "--learner-nodes",
        "2",
        "--gpus-per-node",
        "8",
        "--partition",
        "gpu",
        "--time",
        "02:00:00",
    )
    assert res.returncode == 0, res.stderr
    sbatch, engines, router_sh = out / "agentrl.sbatch", out / "engines.sh", out / "router.sh"
    assert f"submit: sbatch {sbatch}" in res.stdout
    for script in (sbatch, engines, router_sh):
        check = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
        assert check.returncode == 0, check.stderr
        assert "sk-never-in-a-file" not in script.read_text()
    text = sbatch.read_text()
    for line in (
        "#SBATCH --nodes=4",
        "#SBATCH --gpus-per-node=8",
        "#SBATCH --partition=gpu",
        "#SBATCH --time=02:00:00",
        "ENGINE_NODES=2",
        "ENGINES_PER_NODE=4",
        "NUM_ENGINES=5",
        "LEARNER_NODES=2",
    ):
        assert line in text
    cfg = load_config(out / "config.toml")  # the file every process reads
    assert Path(cfg.run.run_dir).is_absolute() and cfg.engine.urls == [] and cfg.model.init_size == ""

    # run the batch script with a pretend scheduler: which steps would start, with what
    bin_dir, log = tmp_path / "bin", tmp_path / "steps.log"
    bin_dir.mkdir()
    _stub(bin_dir, "scontrol", 'printf "gpu-b10\\ngpu-b02\\ngpu-a7\\ngpu-a12\\n"')  # engine nodes first, then learner
    _stub(bin_dir, "curl", "exit 0")
    # one write per step (background steps run concurrently: two writes per line interleaved); the learner's
    # step waits for the 6 others' lines: its end ends the script, whose EXIT trap kills steps not yet logged
    _stub(
        bin_dir,
        "srun",
        f'line=$(printf "%q " "$@"); echo "$line" >> {log}\n'
        f'if [[ " $* " == *" learn "* ]]; then\n'
        f"  for _ in $(seq 200); do (( $(wc -l < {log}) >= 7 )) && break; sleep 0.05; done\nfi",
    )
    env = {
        **os.environ,
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
        "SLURM_JOB_NODELIST": "gpu-[a7,a12,b02,b10]",
        "SLURM_JOB_ID": "77",
    }
    run = subprocess.run(["bash", str(sbatch)], env=env, capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    steps: dict[str, list[list[str]]] = {}  # background steps log in any order: group them by what they start
    for line in log.read_text().splitlines():
        step = shlex.split(line)
        kind = next(
            a.rsplit("/", 1)[-1]
            for a in step
            if a.endswith(("engines.sh", "router.sh")) or a in ("serve-actors", "learn")
        )
        steps.setdefault(kind, []).append(step)
    assert {k: len(v) for k, v in steps.items()} == {"engines.sh": 2, "router.sh": 1, "serve-actors": 3, "learn": 1}
    engine_steps = {next(a for a in s if a.startswith("--nodelist=")): s for s in steps["engines.sh"]}
    assert engine_steps["--nodelist=gpu-b10"][-1] == "4" and engine_steps["--nodelist=gpu-b02"][-1] == "1"
    urls = [f"http://gpu-b10:{30000 + j}" for j in range(4)] + ["http://gpu-b02:30000"]
    (router,) = steps["router.sh"]
    assert router[router.index(str(router_sh)) + 1 :] == urls
    check_router_sh(tmp_path, router_sh, urls, router_flags)

    def settings(step: list[str]) -> list[str]:
        return [step[i + 1] for i, a in enumerate(step) if a == "-s"]

    (learner,) = steps["learn"]
    assert "--nodes=2" in learner and "--nodelist=gpu-a12,gpu-a7" in learner  # sorted as c10d sorts them
    argv = learner[learner.index("agentrl") :]
    assert argv[:10] == [
        "agentrl",
        "learn",
        "--config",
        str(out / "config.toml"),
        "--nproc",
        "8",
        "--nnodes",
        "2",
        "--rdzv-endpoint",
        "gpu-a12:29400",
    ]
    assert argv[10:12] == ["--rdzv-id", "agentrl-77"]
    learn_cfg = load_config(out / "config.toml", settings(learner))
    assert learn_cfg.engine.urls == urls and learn_cfg.engine.router_url == "http://gpu-b10:30010"
    assert learn_cfg.learner.weight_sync_address == "gpu-a12" and learn_cfg.learner.weight_sync_port == 29500
    assert learn_cfg.actors.trajectory_endpoint == "tcp://0.0.0.0:5557"  # rank 0 binds every interface
    actor_steps = sorted(steps["serve-actors"], key=lambda s: s[s.index("--index") + 1])
    for i, step in enumerate(actor_steps):
        assert "--gres=none" in step and "--overlap" in step
        argv = step[step.index("agentrl") :]
        assert argv[argv.index("--index") + 1] == str(i) and argv[argv.index("--num-actors") + 1] == "3"
        actor_cfg = load_config(out / "config.toml", settings(step))
        assert actor_cfg.actors.trajectory_endpoint == "tcp://gpu-a12:5557"
        assert actor_cfg.actors.progress_endpoint == "tcp://gpu-a12:5558" and actor_cfg.engine.urls == urls


def test_launch_server_flags_come_from_sglangs_source(sglang_flags):
    """Every flag agentrl can give ``sglang.launch_server`` (all of config_engine_args' options on) is one
    SGLang declares; the derived set is SGLang's own, not a superset of whatever is asked."""
    cfg = load_config(
        None,
        [
            "engine.backend=sglang",
            "engine.gpus_per_engine=2",
            "engine.mem_fraction_static=0.8",
            "model.dtype=bfloat16",
            "learner.lora.rank=8",
            "learner.lora.sync=adapter",
        ],
    )
    argv = config_engine_args(cfg, secret=lambda var: f"key-of-{var}")
    assert {
        "--enable-lora",
        "--max-lora-rank",
        "--lora-target-modules",
        "--api-key",
        "--admin-api-key",
        "--dtype",
        "--mem-fraction-static",
    } <= _flags(argv)
    assert _flags(argv) <= sglang_flags, _flags(argv) - sglang_flags
    assert {"--model-path", "--host", "--port"} <= sglang_flags  # the server_argv prefix
    assert {
        "--tensor-parallel-size",
        "--model",
        "--config",
        "--sampling-backend",
    } <= sglang_flags  # aliases, add_argument
    # the embedded engine's flags, a no_cli field (watermark_key) and an abbreviation are not SGLang's
    assert not {"--max-context-tokens", "--api-key-env", "--num-threads", "--watermark-key", "--tp"} & sglang_flags


def check_router_sh(tmp_path: Path, router_sh: Path, urls: list[str], router_flags: frozenset[str]) -> None:
    """router.sh with a stand-in for python that logs its arguments (keys included, as a router might) and
    records its argv: the engines' api key reaches ``--api-key`` (also from a _FILE), never the log."""
    bin_dir, argv_log = tmp_path / "router-bin", tmp_path / "router-argv.log"
    bin_dir.mkdir()
    _stub(bin_dir, "python", f'printf "%q " "$@" >> {argv_log}; echo >> {argv_log}; echo "router config: $*" >&2')
    key_file = tmp_path / "router-key"
    key_file.write_text("sk-router-from-file\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("AGENTRL_ENGINE_")}
    env["PATH"] = f"{bin_dir}:{os.environ['PATH']}"
    for extra, key in (({"AGENTRL_ENGINE_API_KEY_FILE": str(key_file)}, "sk-router-from-file"), ({}, None)):
        run = subprocess.run(
            ["bash", str(router_sh), *urls], env={**env, **extra}, capture_output=True, text=True, timeout=60
        )
        assert run.returncode == 0, run.stderr
        argv = shlex.split(argv_log.read_text().splitlines()[-1])
        assert argv[:2] == ["-m", "sglang_router.launch_router"]
        assert argv[argv.index("--worker-urls") + 1 : argv.index("--policy")] == urls
        assert _flags(argv) <= router_flags, _flags(argv) - router_flags
        if key:
            assert _flags(argv) == ROUTER_FLAGS | {"--api-key"} and argv[argv.index("--api-key") + 1] == key
            assert key not in run.stdout + run.stderr and "--api-key <redacted>" in run.stdout
        else:
            assert _flags(argv) == ROUTER_FLAGS


def test_slurm_engine_node_gives_each_server_its_gpus_and_keys(tmp_path, sglang_flags):
    res, out = launch(
        tmp_path,
        "slurm",
        "-s",
        SEARCH,
        "-s",
        "engine.gpus_per_engine=2",
        "-s",
        "engine.mem_fraction_static=0.85",
        "-s",
        "engine.api_key_env=MY_KEY",
    )
    assert res.returncode == 0, res.stderr
    bin_dir, log = tmp_path / "bin", tmp_path / "servers.log"
    bin_dir.mkdir()
    # a stand-in for SGLang: records how it was started, and logs its arguments, keys included, as SGLang
    # 0.5.23 does at start (server_args=..., entrypoints/engine.py), on stdout and stderr
    _stub(
        bin_dir,
        "python",
        f'echo "$CUDA_VISIBLE_DEVICES $*" >> {log}; echo "server_args=$*"; echo "error: key ${{*: -1}} refused" >&2',
    )
    key_file = tmp_path / "key"
    key_file.write_text("from-a-file\n")
    env = {
        **os.environ,
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
        "CUDA_VISIBLE_DEVICES": "4,5,6,7",
        "MY_KEY_FILE": str(key_file),
        "AGENTRL_ENGINE_ADMIN_API_KEY": "from-a-file-adm",
    }
    run = subprocess.run(["bash", str(out / "engines.sh"), "2"], env=env, capture_output=True, text=True, timeout=60)
    assert run.returncode == 1  # a server that exits ends the node's step
    # what the step writes to logs/engines-NODE.log in the run folder: everything but the keys
    step_log = run.stdout + run.stderr
    assert "from-a-file" not in step_log and step_log.count("--api-key <redacted> --admin-api-key <redacted>") == 2
    assert step_log.count("error: key <redacted> refused") == 2 and "--tp-size 2" in step_log
    lines = sorted(log.read_text().splitlines())
    assert len(lines) == 2
    for line, (devices, port) in zip(lines, (("4,5", "30000"), ("6,7", "30001"))):
        gpus, argv = line.split(" ", 1)
        argv = shlex.split(argv)
        assert gpus == devices and argv[:2] == ["-m", "sglang.launch_server"]
        flags = dict(zip(argv[2::2], argv[3::2]))
        assert flags["--port"] == port and flags["--tp-size"] == "2" and flags["--base-gpu-id"] == "0"
        assert flags["--weight-version"] == "0" and flags["--mem-fraction-static"] == "0.85"
        assert flags["--api-key"] == "from-a-file" and flags["--admin-api-key"] == "from-a-file-adm"
        assert _flags(argv) <= sglang_flags, _flags(argv) - sglang_flags
    # too few GPUs for the engines it should start: a clear error, nothing started
    log.unlink()
    env["CUDA_VISIBLE_DEVICES"] = "0,1,2"
    run = subprocess.run(["bash", str(out / "engines.sh"), "2"], env=env, capture_output=True, text=True, timeout=60)
    assert run.returncode == 2 and "need 4 GPUs; this step sees 3" in run.stderr and not log.exists()


# ------------------------------------------------------------------------------ Kubernetes


def test_kubernetes_manifests(tmp_path, sglang_flags, router_flags):
    res, out = launch(
        tmp_path,
        "k8s",
        "-s",
        "env.kwargs.search_url=http://agentrl-search:8001",
        "-s",
        "engine.num_engines=3",
        "-s",
        "engine.gpus_per_engine=2",
        "-s",
        "engine.mem_fraction_static=0.8",
        "-s",
        "engine.admin_api_key_env=ADMIN_TOKEN",
        "--learner-nodes",
        "2",
        "--namespace",
        "rl",
        "--image",
        "registry/agentrl:1",
    )
    assert res.returncode == 0, res.stderr
    text = (out / "agentrl.yaml").read_text()
    assert "sk-never-in-a-file" not in text
    docs = list(yaml.safe_load_all(text))
    by_kind = {(d["kind"], d["metadata"]["name"]): d for d in docs}
    assert set(by_kind) == {
        ("ConfigMap", "agentrl-config"),
        ("Service", "agentrl-engine"),
        ("StatefulSet", "agentrl-engine"),
        ("Service", "agentrl-router"),
        ("Deployment", "agentrl-router"),
        ("Service", "agentrl-learner"),
        ("Job", "agentrl-learner"),
        ("Job", "agentrl-actors"),
    }
    assert all(d["metadata"]["namespace"] == "rl" for d in docs)

    config_text = by_kind[("ConfigMap", "agentrl-config")]["data"]["config.toml"]
    (tmp_path / "pod.toml").write_text(config_text)
    cfg = load_config(tmp_path / "pod.toml")  # the ConfigMap's config, as every pod reads it
    urls = [f"http://agentrl-engine-{i}.agentrl-engine:30000" for i in range(3)]
    assert cfg.engine.urls == urls and cfg.engine.router_url == "http://agentrl-router:30010"
    assert cfg.actors.trajectory_endpoint == "tcp://agentrl-learner-0.agentrl-learner:5557"
    assert cfg.learner.weight_sync_address == "agentrl-learner-0.agentrl-learner"
    assert cfg.run.run_dir.startswith("/runs/")

    def container(kind: str, name: str) -> dict:
        return by_kind[(kind, name)]["spec"]["template"]["spec"]["containers"][0]

    def script(c: dict) -> str:
        assert c["command"][:2] == ["/bin/bash", "-c"]
        check = subprocess.run(["bash", "-n"], input=c["command"][2], capture_output=True, text=True)
        assert check.returncode == 0, check.stderr
        return c["command"][2]

    def key_env(c: dict) -> dict:
        return {e["name"]: e["valueFrom"]["secretKeyRef"] for e in c["env"]}

    keys = {
        "AGENTRL_ENGINE_API_KEY": {"name": "agentrl-engine-keys", "key": "api-key", "optional": True},
        "ADMIN_TOKEN": {"name": "agentrl-engine-keys", "key": "admin-api-key", "optional": True},
    }
    engines = by_kind[("StatefulSet", "agentrl-engine")]
    assert engines["spec"]["replicas"] == 3 and engines["spec"]["serviceName"] == "agentrl-engine"
    sglang = container("StatefulSet", "agentrl-engine")
    assert sglang["image"] == "registry/agentrl:1" and sglang["resources"]["limits"]["nvidia.com/gpu"] == 2
    assert sglang["ports"] == [{"name": "http", "containerPort": 30000}] and key_env(sglang) == keys
    engine_argv = shlex.split(script(sglang).rsplit("exec ", 1)[1].split(" ${KEYS")[0])
    assert engine_argv[:3] == ["python", "-m", "sglang.launch_server"]
    assert _flags(engine_argv) <= sglang_flags, _flags(engine_argv) - sglang_flags
    flags = dict(zip(engine_argv[3::2], engine_argv[4::2]))
    assert flags["--tp-size"] == "2" and flags["--weight-version"] == "0" and flags["--host"] == "0.0.0.0"
    assert flags["--mem-fraction-static"] == "0.8" and '--admin-api-key "$key"' in script(sglang)
    assert by_kind[("Service", "agentrl-engine")]["spec"]["clusterIP"] == "None"

    # probes: /ping (no generation, 200 while paused), never SGLang's /health with a 1 s limit; no liveness
    for probe in ("startupProbe", "readinessProbe"):
        command = sglang[probe]["exec"]["command"]
        assert command[:2] == ["python", "-c"] and "/ping" in command[2] and "AGENTRL_ENGINE_API_KEY" in command[2]
        assert sglang[probe]["timeoutSeconds"] >= 6  # the probe's own request waits 5 s
    assert sglang["startupProbe"]["failureThreshold"] * sglang["startupProbe"]["periodSeconds"] >= 1800
    assert "livenessProbe" not in sglang and "/health" not in str(sglang)

    router = container("Deployment", "agentrl-router")
    router_argv = shlex.split(script(router).rsplit("exec ", 1)[1].split(" ${ROUTER_KEYS")[0])
    assert router_argv[:3] == ["python", "-m", "sglang_router.launch_router"]
    assert _flags(router_argv) == ROUTER_FLAGS and _flags(router_argv) <= router_flags
    assert router_argv[router_argv.index("--worker-urls") + 1 :][:3] == urls
    assert '--api-key "$key"' in script(router) and "$(secret AGENTRL_ENGINE_API_KEY)" in script(router)
    assert key_env(router) == {"AGENTRL_ENGINE_API_KEY": keys["AGENTRL_ENGINE_API_KEY"]}  # not the admin key
    assert by_kind[("Service", "agentrl-router")]["spec"]["ports"][0]["port"] == 30010

    learner_job = by_kind[("Job", "agentrl-learner")]["spec"]
    assert learner_job["completionMode"] == "Indexed" and learner_job["completions"] == learner_job["parallelism"] == 2
    assert learner_job["template"]["spec"]["subdomain"] == "agentrl-learner"
    learner = container("Job", "agentrl-learner")
    assert learner["resources"]["limits"]["nvidia.com/gpu"] == 4 and key_env(learner) == keys
    learn = shlex.split(script(learner).removeprefix("exec "))
    assert learn[:4] == ["agentrl", "learn", "--config", "/etc/agentrl/config.toml"]
    assert learn[learn.index("--nnodes") + 1] == "2"
    assert learn[learn.index("--rdzv-endpoint") + 1] == "agentrl-learner-0.agentrl-learner:29400"
    assert learn[learn.index("--local-addr") + 1] == "$(hostname).agentrl-learner"
    assert "actors.trajectory_endpoint=tcp://0.0.0.0:5557" in learn
    service_ports = {p["name"]: p["port"] for p in by_kind[("Service", "agentrl-learner")]["spec"]["ports"]}
    assert service_ports == {"rdzv": 29400, "weight-sync": 29500, "trajectories": 5557, "progress": 5558}

    actors = by_kind[("Job", "agentrl-actors")]["spec"]
    assert actors["completionMode"] == "Indexed" and actors["completions"] == 4
    actor = container("Job", "agentrl-actors")
    assert "resources" not in actor and key_env(actor) == keys
    serve = shlex.split(script(actor).removeprefix("exec "))
    assert serve[:2] == ["agentrl", "serve-actors"] and serve[serve.index("--index") + 1] == "$JOB_COMPLETION_INDEX"


@pytest.fixture(scope="module")
def keyed_engine(engine_model, tmp_path_factory):
    """An embedded engine with an api key (SGLang's auth rules: /ping is a normal route)."""
    from tests.conftest_engine import start_engines

    (proc,) = start_engines(
        engine_model,
        1,
        tmp_path_factory.mktemp("keyed_engine"),
        env={**os.environ, "AGENTRL_ENGINE_API_KEY": PROBE_KEY},
    )
    yield proc.url
    proc.stop()


PROBE_KEY = "sk-probe-0123456789"


def test_the_engine_probe_passes_with_the_pods_key_and_while_paused(keyed_engine):
    """The manifest's probe command itself, run against a real engine that wants a key."""
    from agentrl.net import free_port
    from agentrl.run.cluster import ping_probe

    cfg = load_config(None, [SEARCH])
    port = int(keyed_engine.rsplit(":", 1)[1])
    command = ping_probe(cfg, port)["exec"]["command"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("AGENTRL_ENGINE_")}

    def probe(**extra: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, *command[1:]], env={**env, **extra}, capture_output=True, text=True, timeout=30
        )

    assert probe(AGENTRL_ENGINE_API_KEY=PROBE_KEY).returncode == 0
    refused = probe()
    assert refused.returncode == 1 and "401" in refused.stderr
    headers = {"Authorization": f"Bearer {PROBE_KEY}"}
    assert (
        httpx.post(
            keyed_engine + "/pause_generation", json={"mode": "in_place"}, headers=headers, timeout=10
        ).status_code
        == 200
    )
    try:
        assert probe(AGENTRL_ENGINE_API_KEY=PROBE_KEY).returncode == 0
        assert httpx.get(keyed_engine + "/ready", timeout=10).status_code == 503  # /ready: not while paused
    finally:
        httpx.post(keyed_engine + "/continue_generation", json={}, headers=headers, timeout=10)
    nobody = ping_probe(cfg, free_port())["exec"]["command"][2]  # no engine there: the probe fails
    assert subprocess.run([sys.executable, "-c", nobody], env=env, capture_output=True, timeout=30).returncode == 1


def test_launch_refuses_what_a_cluster_cannot_run(tmp_path):
    res, _ = launch(tmp_path, "slurm")
    assert res.returncode == 2 and "search_url = 'auto'" in res.stderr
    res, _ = launch(tmp_path, "slurm", "-s", SEARCH, "-s", "engine.backend=embedded", "-s", "engine.gpus_per_engine=1")
    assert res.returncode == 2 and "set engine.backend = 'sglang'" in res.stderr
    res, _ = launch(tmp_path, "k8s", "-s", SEARCH, "-s", "model.path=models/m")
    assert res.returncode == 2 and "model.path must be an absolute path" in res.stderr
    res, _ = launch(tmp_path, "slurm", "-s", SEARCH, "-s", "engine.gpus_per_engine=4", "--gpus-per-node", "2")
    assert res.returncode == 2 and "exceeds the 2 GPUs of a node" in res.stderr
    res, _ = launch(tmp_path, "pbs", "-s", SEARCH)
    assert res.returncode == 2 and "unknown target 'pbs'" in res.stderr

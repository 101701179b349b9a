"""``agentrl launch``: what a user submits to a cluster, generated from a run config.

The layout is ``agentrl run``'s, spread over nodes (:func:`agentrl.run.placement.plan_cluster`):
SGLang servers fill the first nodes, each on its own GPUs (``--tp-size`` = ``engine.gpus_per_engine``,
``--base-gpu-id 0`` inside its ``CUDA_VISIBLE_DEVICES``), behind sglang-router when there is more than
one; the learner has its own nodes, one torchrun per node joined by c10d rendezvous (``agentrl learn
--nnodes``); actors run on CPUs next to the engines. Every process gets the same config file; what
only exists at submit time (node names, the router's and the learner's addresses) is passed as
``--set`` overrides, and the learner binds on ``0.0.0.0`` while actors connect to its head node.

* **slurm**: ``agentrl.sbatch`` (one batch job) and ``engines.sh`` (one engine node's servers), next
  to ``config.toml``.
* **k8s**: ``agentrl.yaml``: a ConfigMap with the config; engines as a StatefulSet behind a headless
  Service (stable names for the weight push); the router as a Deployment + Service; the learner as an
  Indexed Job behind a headless Service (index 0 is rank 0); actors as an Indexed Job (each actor's
  ``--index`` is its completion index: its share of the budget is its own).

Invariants: only commands that exist are referenced (every SGLang and sglang-router flag is checked
in tests/test_cluster.py against the pinned wheels, via tests/sglang_spec.py). API keys never appear
in the files: a shell expands them at start from the environment variables the config names (in
Kubernetes, from a Secret), and logs that would show them write ``<redacted>``. Engine probes ask
``/ping`` (200 while a weight push pauses the server; ``/health`` generates a token and is marked
unhealthy during a pause), and engines get no liveness probe: a restarted engine has left the weight
group. See docs/run.md.
"""

from __future__ import annotations

import shlex
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agentrl.config import AgentRLConfig, dump_toml
from agentrl.engine.launch import config_engine_args
from agentrl.run.placement import ClusterLayout, PlacementError, plan_cluster

TARGETS = ("slurm", "k8s")
SECRET_NAME = "agentrl-engine-keys"  # Kubernetes Secret with keys `api-key` and `admin-api-key`


@dataclass(frozen=True)
class ClusterOptions:
    """What the config does not say about the cluster."""

    gpus_per_node: int = 8
    learner_nodes: int = 1
    router: bool | None = None  # None: a router when there is more than one engine
    router_policy: str = "cache_aware"
    partition: str = ""  # slurm
    time_limit: str = "24:00:00"  # slurm
    image: str = "agentrl:latest"  # k8s: an image with agentrl, sglang and sglang-router
    namespace: str = "default"  # k8s
    rdzv_port: int = 29400
    router_port: int = 30010


@dataclass(frozen=True)
class Ports:
    engine: int
    router: int
    rdzv: int
    weight_sync: int
    trajectory: int
    progress: int


def wants_router(layout: ClusterLayout, opts: ClusterOptions) -> bool:
    return opts.router if opts.router is not None else layout.num_engines > 1


def _endpoint_port(endpoint: str, default: int) -> int:
    tail = endpoint.rsplit(":", 1)[-1]
    return int(tail) if tail.isdigit() else default


def ports_for(cfg: AgentRLConfig, opts: ClusterOptions) -> Ports:
    return Ports(
        engine=cfg.engine.base_port,
        router=opts.router_port,
        rdzv=opts.rdzv_port,
        weight_sync=cfg.learner.weight_sync_port or 29500,
        trajectory=_endpoint_port(cfg.actors.trajectory_endpoint, 5557),
        progress=_endpoint_port(cfg.actors.progress_endpoint, 5558),
    )


def check_config(cfg: AgentRLConfig) -> None:
    if cfg.engine.backend != "sglang":
        raise PlacementError("agentrl launch starts SGLang servers: set engine.backend = 'sglang'")
    if any(s.kwargs.get("search_url") == "auto" for s in cfg.env_sections):
        raise PlacementError(
            "env.kwargs.search_url = 'auto' starts a retrieval server next to a one-machine run; "
            "on a cluster start `agentrl serve-search --host 0.0.0.0` where the actors can reach it "
            "and set env.kwargs.search_url to its URL"
        )


def server_argv(cfg: AgentRLConfig, port: str) -> list[str]:
    """SGLang's command line for one engine, without keys (a shell adds them from the environment)."""
    return [
        "python",
        "-m",
        "sglang.launch_server",
        "--model-path",
        cfg.model.path,
        "--host",
        "0.0.0.0",
        "--port",
        port,
        *config_engine_args(cfg, secret=lambda var: ""),
    ]


def router_argv(urls: list[str], port: int | str, policy: str) -> list[str]:
    return [
        "python",
        "-m",
        "sglang_router.launch_router",
        "--host",
        "0.0.0.0",
        "--port",
        port if isinstance(port, str) else str(port),
        "--worker-urls",
        *urls,
        "--policy",
        policy,
    ]


class Raw(str):
    """A shell word written as it is (an expansion such as ``"$CONFIG"``), not quoted."""


def shell_join(argv: list[str]) -> str:
    return " ".join(a if isinstance(a, Raw) else shlex.quote(a) for a in argv)


SECRET_SHELL = """secret() {  # the value of $1, or the content of the file named by ${1}_FILE (agentrl/secrets.py)
  local file_var="${1}_FILE"
  if [[ -n "${!1:-}" ]]; then printf '%s' "${!1}"
  elif [[ -n "${!file_var:-}" ]]; then printf '%s' "$(< "${!file_var}")"
  fi
}"""


def _key_flags_shell(cfg: AgentRLConfig) -> str:
    e = cfg.engine
    return (
        f"KEYS=()\n"
        f'key=$(secret {e.api_key_env}); [[ -z "$key" ]] || KEYS+=(--api-key "$key")\n'
        f'key=$(secret {e.admin_api_key_env}); [[ -z "$key" ]] || KEYS+=(--admin-api-key "$key")'
    )


def _router_key_shell(cfg: AgentRLConfig) -> str:
    """``ROUTER_KEYS``: sglang-router's ``--api-key`` (the key it sends to the workers) when the engines have one."""
    return f'ROUTER_KEYS=()\nkey=$(secret {cfg.engine.api_key_env}); [[ -z "$key" ]] || ROUTER_KEYS+=(--api-key "$key")'


ROUTER_KEY_ARGS = '${ROUTER_KEYS[@]+"${ROUTER_KEYS[@]}"}'


def _redact_shell(cfg: AgentRLConfig) -> str:
    """``redact_keys``: stdin to stdout, line by line, with the engine keys written ``<redacted>``. SGLang
    logs its keys at start (``server_args=...``, sglang/srt/entrypoints/engine.py), and a SLURM step's
    output is a file in the run folder. The keys reach awk through its environment, never its argv;
    the longer first (one key may begin the other)."""
    e = cfg.engine
    return (
        f"redact_keys() {{  # SGLang logs its keys at start (server_args=...): none in the log\n"
        f'  REDACT_A="$(secret {e.api_key_env})" REDACT_B="$(secret {e.admin_api_key_env})" LC_ALL=C awk \'\n'
        '    BEGIN { a = ENVIRON["REDACT_A"]; b = ENVIRON["REDACT_B"]\n'
        "            if (length(a) < length(b)) { t = a; a = b; b = t }\n"
        "            k[1] = a; k[2] = b }\n"
        '    { for (i = 1; i <= 2; i++) if (k[i] != "") {\n'
        '        out = ""; s = $0\n'
        '        while ((p = index(s, k[i])) > 0) { out = out substr(s, 1, p - 1) "<redacted>"; s = substr(s, p + length(k[i])) }\n'
        "        $0 = out s\n"
        "      }\n"
        "      print; fflush() }'\n"
        "}"
    )


# ------------------------------------------------------------------------------ SLURM


def slurm_files(cfg: AgentRLConfig, layout: ClusterLayout, opts: ClusterOptions, out_dir: Path) -> dict[str, str]:
    """``agentrl.sbatch`` and ``engines.sh`` (contents by file name); ``config.toml`` is written beside them."""
    p = ports_for(cfg, opts)
    use_router = wants_router(layout, opts)
    out_dir = out_dir.resolve()
    run_dir = cfg.run.run_dir
    name = cfg.run.name
    learn = ["agentrl", "learn", "--config", Raw('"$CONFIG"'), "--nproc", str(layout.learner_ranks_per_node)]
    if layout.learner_nodes > 1:
        learn += [
            "--nnodes",
            str(layout.learner_nodes),
            "--rdzv-endpoint",
            Raw('"$LEARNER_HEAD:$RDZV_PORT"'),
            "--rdzv-id",
            Raw('"agentrl-$SLURM_JOB_ID"'),
        ]
    partition = f"#SBATCH --partition={opts.partition}\n" if opts.partition else ""
    router_block = (
        '''ROUTER_URL="http://${ENGINE_HOSTS[0]}:$ROUTER_PORT"
srun --nodes=1 --ntasks=1 --nodelist="${ENGINE_HOSTS[0]}" --overlap --gres=none \\
    --output="$RUN_DIR/logs/router.log" bash "$LAUNCH_DIR/router.sh" "${ENGINE_URLS[@]}" &
wait_healthy "$ROUTER_URL"'''
        if use_router
        else 'ROUTER_URL=""  # one engine: no router'
    )
    sbatch = f'''#!/bin/bash
# Generated by `agentrl launch --target slurm` from the config of run "{name}". Submit with:
#   sbatch {out_dir / "agentrl.sbatch"}
# from a shell whose environment has agentrl, sglang and sglang-router (the job inherits it).
# {out_dir} and the run folder must be on a file system every node sees. Engine API keys come
# from ${cfg.engine.api_key_env} / ${cfg.engine.admin_api_key_env} (or their _FILE variants) when set.
#
# Layout: {layout.describe()[0]};
#         {layout.describe()[1]}; actors on the engine nodes' CPUs.
#SBATCH --job-name=agentrl-{name}
#SBATCH --nodes={layout.engine_nodes + layout.learner_nodes}
#SBATCH --gpus-per-node={layout.gpus_per_node}
#SBATCH --exclusive
#SBATCH --time={opts.time_limit}
#SBATCH --output={out_dir}/slurm-%j.out
{partition}set -euo pipefail

LAUNCH_DIR={shlex.quote(str(out_dir))}
CONFIG="$LAUNCH_DIR/config.toml"
RUN_DIR={shlex.quote(run_dir)}
ENGINE_NODES={layout.engine_nodes}
ENGINES_PER_NODE={layout.engines_per_node}
NUM_ENGINES={layout.num_engines}
LEARNER_NODES={layout.learner_nodes}
NUM_ACTORS={cfg.actors.num_processes}
ENGINE_PORT={p.engine}
ROUTER_PORT={p.router}
RDZV_PORT={p.rdzv}
WEIGHT_SYNC_PORT={p.weight_sync}
TRAJECTORY_PORT={p.trajectory}
PROGRESS_PORT={p.progress}
mkdir -p "$RUN_DIR/logs"
trap 'kill $(jobs -p) 2>/dev/null || true' EXIT  # the learner's end ends every other step

wait_healthy() {{  # URL: until URL/health answers (SGLang loads the model first), at most 30 minutes
  local deadline=$((SECONDS + 1800))
  until curl -sf -o /dev/null "$1/health"; do
    if (( SECONDS > deadline )); then echo "agentrl: $1 is not healthy after 30 minutes; see $RUN_DIR/logs" >&2; exit 1; fi
    sleep 10
  done
}}

mapfile -t NODES < <(scontrol show hostnames "$SLURM_JOB_NODELIST")
ENGINE_HOSTS=("${{NODES[@]:0:ENGINE_NODES}}")
# torchrun's c10d rendezvous makes rank 0 the node whose --local-addr sorts first: sort the same way
mapfile -t LEARNER_HOSTS < <(printf '%s\\n' "${{NODES[@]:ENGINE_NODES:LEARNER_NODES}}" | LC_ALL=C sort)
LEARNER_HEAD=${{LEARNER_HOSTS[0]}}

# ---- engines: one step per engine node with all its GPUs; engines.sh gives each server its own
ENGINE_URLS=()
for n in "${{!ENGINE_HOSTS[@]}}"; do
  count=$(( NUM_ENGINES - n * ENGINES_PER_NODE ))
  (( count <= ENGINES_PER_NODE )) || count=$ENGINES_PER_NODE
  srun --nodes=1 --ntasks=1 --nodelist="${{ENGINE_HOSTS[n]}}" --output="$RUN_DIR/logs/engines-${{ENGINE_HOSTS[n]}}.log" \\
      bash "$LAUNCH_DIR/engines.sh" "$count" &
  for ((j = 0; j < count; j++)); do ENGINE_URLS+=("http://${{ENGINE_HOSTS[n]}}:$((ENGINE_PORT + j))"); done
done
for url in "${{ENGINE_URLS[@]}}"; do wait_healthy "$url"; done

# ---- router: generation only; agentrl sends weight updates and pauses to every engine itself
{router_block}

# ---- what only exists now: every engine (weight updates), the router, the learner's head node
URLS_TOML="[$(printf '"%s", ' "${{ENGINE_URLS[@]}}" | sed 's/, $//')]"
SETTINGS=(-s "engine.urls=$URLS_TOML" -s "engine.router_url=$ROUTER_URL"
          -s "learner.weight_sync_address=$LEARNER_HEAD" -s "learner.weight_sync_port=$WEIGHT_SYNC_PORT")

# ---- actors on the engine nodes' CPUs; one that dies is started again (its share of the budget is its own)
for ((i = 0; i < NUM_ACTORS; i++)); do
  host=${{ENGINE_HOSTS[i % ENGINE_NODES]}}
  srun --nodes=1 --ntasks=1 --nodelist="$host" --overlap --gres=none --output="$RUN_DIR/logs/actor$i.log" \\
      bash -c 'for attempt in 1 2 3 4; do "$@" && exit 0; echo "actor exited with $?; attempt $attempt of 4" >&2; sleep 5; done; exit 1' actor \\
      agentrl serve-actors --config "$CONFIG" --index "$i" --num-actors "$NUM_ACTORS" --wait-for-learner \\
      "${{SETTINGS[@]}}" -s "actors.trajectory_endpoint=tcp://$LEARNER_HEAD:$TRAJECTORY_PORT" \\
      -s "actors.progress_endpoint=tcp://$LEARNER_HEAD:$PROGRESS_PORT" &
done

# ---- learner: one torchrun per learner node; rank 0 on $LEARNER_HEAD binds the sockets on every interface
srun --nodes="$LEARNER_NODES" --ntasks-per-node=1 --nodelist="$(IFS=,; echo "${{LEARNER_HOSTS[*]}}")" \\
    --output="$RUN_DIR/logs/learner-%N.log" \\
    bash -c 'exec "$@" --local-addr "$SLURMD_NODENAME"' learner \\
    {shell_join(learn)} "${{SETTINGS[@]}}" \\
    -s "actors.trajectory_endpoint=tcp://0.0.0.0:$TRAJECTORY_PORT" -s "actors.progress_endpoint=tcp://0.0.0.0:$PROGRESS_PORT" &
status=0
wait $! || status=$?
echo "agentrl: the learner exited with status $status; stopping the engines, router and actors"
exit "$status"
'''
    engines = f"""#!/bin/bash
# One engine node's SGLang servers, each on its own GPUs. Generated by `agentrl launch --target slurm`;
# agentrl.sbatch runs it on every engine node:  bash engines.sh COUNT
set -euo pipefail
COUNT=$1
GPUS_PER_ENGINE={layout.gpus_per_engine}
ENGINE_PORT={p.engine}
# the GPUs SLURM gave this step, else all of the node's
IFS=, read -r -a GPUS <<< "${{CUDA_VISIBLE_DEVICES:-$(seq -s, 0 {layout.gpus_per_node - 1})}}"
if (( ${{#GPUS[@]}} < COUNT * GPUS_PER_ENGINE )); then
  echo "engines.sh: $COUNT engines x $GPUS_PER_ENGINE GPUs need $((COUNT * GPUS_PER_ENGINE)) GPUs; this step sees ${{#GPUS[@]}} (${{CUDA_VISIBLE_DEVICES:-}})" >&2
  exit 2
fi
{SECRET_SHELL}
{_key_flags_shell(cfg)}
{_redact_shell(cfg)}

for ((j = 0; j < COUNT; j++)); do
  devices=$(IFS=,; echo "${{GPUS[*]:j * GPUS_PER_ENGINE:GPUS_PER_ENGINE}}")
  echo "engines.sh: engine $j on GPU $devices, port $((ENGINE_PORT + j))"
  CUDA_VISIBLE_DEVICES=$devices {shell_join(server_argv(cfg, Raw('"$((ENGINE_PORT + j))"')))} \\
      ${{KEYS[@]+"${{KEYS[@]}}"}} 2>&1 | redact_keys &
done
wait -n  # an engine that exits ends the step: engines are critical (a new one would miss the weight group)
exit 1
"""
    files = {"agentrl.sbatch": sbatch, "engines.sh": engines}
    if use_router:
        files["router.sh"] = f"""#!/bin/bash
# sglang-router in front of the engines. Generated by `agentrl launch --target slurm`; agentrl.sbatch
# runs it on the first engine node:  bash router.sh ENGINE_URL...
set -euo pipefail
{SECRET_SHELL}
{_router_key_shell(cfg)}
{_redact_shell(cfg)}

{shell_join(router_argv([Raw('"$@"')], p.router, opts.router_policy))} {ROUTER_KEY_ARGS} 2>&1 | redact_keys
"""
    return files


# ------------------------------------------------------------------------------ Kubernetes


def _labels(component: str) -> dict[str, str]:
    return {"app": "agentrl", "component": component}


def _key_env(cfg: AgentRLConfig) -> list[dict[str, Any]]:
    """The engine key variables, from the Secret when it exists (optional: no Secret, no keys)."""
    return [
        {"name": var, "valueFrom": {"secretKeyRef": {"name": SECRET_NAME, "key": key, "optional": True}}}
        for var, key in ((cfg.engine.api_key_env, "api-key"), (cfg.engine.admin_api_key_env, "admin-api-key"))
    ]


PING_PROBE = """import os, sys, urllib.request
key = os.environ.get({var!r}, "")
request = urllib.request.Request("http://127.0.0.1:{port}/ping", headers={{"Authorization": "Bearer " + key}} if key else {{}})
try:
    urllib.request.build_opener(urllib.request.ProxyHandler({{}})).open(request, timeout=5)
except Exception as e:
    sys.exit(f"/ping: {{e}}")
"""


def ping_probe(cfg: AgentRLConfig, port: int) -> dict[str, Any]:
    """An exec probe of the engine's ``/ping`` with the api key from the pod's environment, when set
    (a key cannot come from a Secret into an httpGet probe's headers)."""
    return {
        "exec": {"command": ["python", "-c", PING_PROBE.format(var=cfg.engine.api_key_env, port=port)]},
        "timeoutSeconds": 10,
    }


def _volumes(cfg: AgentRLConfig, with_runs: bool) -> tuple[list[dict], list[dict]]:
    models_dir = str(Path(cfg.model.path).parent)
    volumes = [
        {"name": "models", "persistentVolumeClaim": {"claimName": "agentrl-models", "readOnly": True}},
        {"name": "config", "configMap": {"name": "agentrl-config"}},
    ]
    mounts = [
        {"name": "models", "mountPath": models_dir, "readOnly": True},
        {"name": "config", "mountPath": "/etc/agentrl", "readOnly": True},
    ]
    if with_runs:
        volumes.append({"name": "runs", "persistentVolumeClaim": {"claimName": "agentrl-runs"}})
        mounts.append({"name": "runs", "mountPath": "/runs"})
    volumes.append({"name": "shm", "emptyDir": {"medium": "Memory"}})  # NCCL and SGLang want a large /dev/shm
    mounts.append({"name": "shm", "mountPath": "/dev/shm"})
    return volumes, mounts


def _sh(script: str) -> list[str]:
    return ["/bin/bash", "-c", script]


def _headless_service(component: str, ports: dict[str, int], ns: str) -> dict:
    """``agentrl-<component>``: no cluster IP, one DNS name per pod (``<pod>.agentrl-<component>``)."""
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": f"agentrl-{component}", "namespace": ns, "labels": _labels(component)},
        "spec": {
            "clusterIP": "None",
            "publishNotReadyAddresses": True,  # names resolve before readiness
            "selector": _labels(component),
            "ports": [{"name": k, "port": v, "targetPort": v} for k, v in ports.items()],
        },
    }


K8S_HEAD = "agentrl-learner-0.agentrl-learner"  # the learner's index-0 pod: rank 0


def k8s_addresses(cfg: AgentRLConfig, layout: ClusterLayout, opts: ClusterOptions) -> dict[str, Any]:
    """Every address the processes need, by Service DNS name (known before anything starts)."""
    p = ports_for(cfg, opts)
    use_router = wants_router(layout, opts)
    return {
        "engine.urls": [f"http://agentrl-engine-{i}.agentrl-engine:{p.engine}" for i in range(layout.num_engines)],
        "engine.router_url": f"http://agentrl-router:{p.router}" if use_router else "",
        "learner.weight_sync_address": K8S_HEAD,
        "learner.weight_sync_port": p.weight_sync,
        "actors.trajectory_endpoint": f"tcp://{K8S_HEAD}:{p.trajectory}",
        "actors.progress_endpoint": f"tcp://{K8S_HEAD}:{p.progress}",
    }


def kubernetes_objects(cfg: AgentRLConfig, layout: ClusterLayout, opts: ClusterOptions) -> list[dict]:
    """The manifests, as objects (``agentrl.yaml`` is their YAML); ``cfg`` holds the cluster's addresses."""
    p = ports_for(cfg, opts)
    ns = opts.namespace
    engine_urls = list(cfg.engine.urls)
    use_router = bool(cfg.engine.router_url)
    head = K8S_HEAD
    config_file = "/etc/agentrl/config.toml"
    objects: list[dict] = [
        {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": {"name": "agentrl-config", "namespace": ns, "labels": _labels("config")},
            "data": {"config.toml": dump_toml(cfg)},
        }
    ]

    # engines: a StatefulSet gives each one a stable name, which the weight push needs
    volumes, mounts = _volumes(cfg, with_runs=False)
    engine_script = (
        "set -euo pipefail\n" + SECRET_SHELL + "\n" + _key_flags_shell(cfg) + "\n"
        f"exec {shell_join(server_argv(cfg, str(p.engine)))} " + '${KEYS[@]+"${KEYS[@]}"}'
    )
    objects.append(_headless_service("engine", {"http": p.engine}, ns))
    objects.append(
        {
            "apiVersion": "apps/v1",
            "kind": "StatefulSet",
            "metadata": {"name": "agentrl-engine", "namespace": ns, "labels": _labels("engine")},
            "spec": {
                "serviceName": "agentrl-engine",
                "replicas": layout.num_engines,
                "podManagementPolicy": "Parallel",
                "selector": {"matchLabels": _labels("engine")},
                "template": {
                    "metadata": {"labels": _labels("engine")},
                    "spec": {
                        "containers": [
                            {
                                "name": "sglang",
                                "image": opts.image,
                                "command": _sh(engine_script),
                                "env": _key_env(cfg),
                                "ports": [{"name": "http", "containerPort": p.engine}],
                                "resources": {"limits": {"nvidia.com/gpu": layout.gpus_per_engine}},
                                "readinessProbe": {
                                    **ping_probe(cfg, p.engine),
                                    "periodSeconds": 10,
                                    "failureThreshold": 3,
                                },
                                "startupProbe": {
                                    **ping_probe(cfg, p.engine),
                                    "periodSeconds": 10,
                                    "failureThreshold": 180,
                                },
                                "volumeMounts": mounts,
                            }
                        ],
                        "volumes": volumes,
                    },
                },
            },
        }
    )

    if use_router:
        router_script = (
            "set -euo pipefail\n" + SECRET_SHELL + "\n" + _router_key_shell(cfg) + "\n"
            f"exec {shell_join(router_argv(engine_urls, p.router, opts.router_policy))} {ROUTER_KEY_ARGS}"
        )
        objects.append(
            {
                "apiVersion": "v1",
                "kind": "Service",
                "metadata": {"name": "agentrl-router", "namespace": ns, "labels": _labels("router")},
                "spec": {
                    "selector": _labels("router"),
                    "ports": [{"name": "http", "port": p.router, "targetPort": p.router}],
                },
            }
        )
        objects.append(
            {
                "apiVersion": "apps/v1",
                "kind": "Deployment",
                "metadata": {"name": "agentrl-router", "namespace": ns, "labels": _labels("router")},
                "spec": {
                    "replicas": 1,
                    "selector": {"matchLabels": _labels("router")},
                    "template": {
                        "metadata": {"labels": _labels("router")},
                        "spec": {
                            "containers": [
                                {
                                    "name": "router",
                                    "image": opts.image,
                                    "command": _sh(router_script),
                                    "env": _key_env(cfg)[
                                        :1
                                    ],  # the api key only: the one the router sends to the engines
                                    "ports": [{"name": "http", "containerPort": p.router}],
                                    "readinessProbe": {
                                        "httpGet": {"path": "/health", "port": p.router},
                                        "periodSeconds": 10,
                                    },
                                }
                            ]
                        },
                    },
                },
            }
        )

    # learner: an Indexed Job; pod i is agentrl-learner-i.agentrl-learner, index 0 sorts first: rank 0
    volumes, mounts = _volumes(cfg, with_runs=True)
    learn = ["agentrl", "learn", "--config", config_file, "--nproc", str(layout.learner_ranks_per_node)]
    if layout.learner_nodes > 1:
        learn += [
            "--nnodes",
            str(layout.learner_nodes),
            "--rdzv-endpoint",
            f"{head}:{p.rdzv}",
            "--rdzv-id",
            f"agentrl-{cfg.run.name}",
        ]
    learn += [
        "-s",
        f"actors.trajectory_endpoint=tcp://0.0.0.0:{p.trajectory}",  # rank 0 binds every interface
        "-s",
        f"actors.progress_endpoint=tcp://0.0.0.0:{p.progress}",
    ]
    learn_script = f'exec {shell_join(learn)} --local-addr "$(hostname).agentrl-learner"'
    objects.append(
        _headless_service(
            "learner",
            {"rdzv": p.rdzv, "weight-sync": p.weight_sync, "trajectories": p.trajectory, "progress": p.progress},
            ns,
        )
    )
    objects.append(
        {
            "apiVersion": "batch/v1",
            "kind": "Job",
            "metadata": {"name": "agentrl-learner", "namespace": ns, "labels": _labels("learner")},
            "spec": {
                "completionMode": "Indexed",
                "completions": layout.learner_nodes,
                "parallelism": layout.learner_nodes,
                "backoffLimit": 3,
                "template": {
                    "metadata": {"labels": _labels("learner")},
                    "spec": {
                        "subdomain": "agentrl-learner",
                        "restartPolicy": "OnFailure",
                        "containers": [
                            {
                                "name": "learner",
                                "image": opts.image,
                                "command": _sh(learn_script),
                                "env": _key_env(cfg),
                                "ports": [
                                    {"name": n, "containerPort": v}
                                    for n, v in (
                                        ("rdzv", p.rdzv),
                                        ("weight-sync", p.weight_sync),
                                        ("trajectories", p.trajectory),
                                        ("progress", p.progress),
                                    )
                                ],
                                "resources": {"limits": {"nvidia.com/gpu": layout.learner_ranks_per_node}},
                                "volumeMounts": mounts,
                            }
                        ],
                        "volumes": volumes,
                    },
                },
            },
        }
    )

    # actors: CPU only; an Indexed Job, since each actor's index is its share of the budget
    volumes, mounts = _volumes(cfg, with_runs=False)
    n = cfg.actors.num_processes
    serve = ["agentrl", "serve-actors", "--config", config_file, "--num-actors", str(n), "--wait-for-learner"]
    objects.append(
        {
            "apiVersion": "batch/v1",
            "kind": "Job",
            "metadata": {"name": "agentrl-actors", "namespace": ns, "labels": _labels("actors")},
            "spec": {
                "completionMode": "Indexed",
                "completions": n,
                "parallelism": n,
                "backoffLimit": 3 * n,
                "template": {
                    "metadata": {"labels": _labels("actors")},
                    "spec": {
                        "restartPolicy": "OnFailure",
                        "containers": [
                            {
                                "name": "actor",
                                "image": opts.image,
                                "command": _sh(f'exec {shell_join(serve)} --index "$JOB_COMPLETION_INDEX"'),
                                "env": _key_env(cfg),
                                "volumeMounts": mounts,
                            }
                        ],
                        "volumes": volumes,
                    },
                },
            },
        }
    )
    return objects


def kubernetes_yaml(cfg: AgentRLConfig, layout: ClusterLayout, opts: ClusterOptions) -> str:
    import yaml

    class Dumper(yaml.SafeDumper):
        pass

    def text(dumper: yaml.SafeDumper, value: str) -> yaml.ScalarNode:
        return dumper.represent_scalar("tag:yaml.org,2002:str", value, style="|" if "\n" in value else None)

    Dumper.add_representer(str, text)

    header = (
        f'# Generated by `agentrl launch --target k8s` from the config of run "{cfg.run.name}".\n'
        f"# Needs: PersistentVolumeClaims agentrl-models (the model at {cfg.model.path}) and agentrl-runs\n"
        "# (ReadWriteMany when the learner has several nodes), an image with agentrl, sglang and\n"
        f"# sglang-router ({opts.image}), and optionally the engine keys:\n"
        f"#   kubectl -n {opts.namespace} create secret generic {SECRET_NAME} --from-literal=api-key=... "
        "--from-literal=admin-api-key=...\n"
        f"# Layout: {layout.describe()[0]}; {layout.describe()[1]}.\n"
        f"# Apply: kubectl apply -f agentrl.yaml\n"
    )
    return header + yaml.dump_all(kubernetes_objects(cfg, layout, opts), Dumper=Dumper, sort_keys=False, width=120)


# ------------------------------------------------------------------------------ entry point


def cluster_config(cfg: AgentRLConfig, target: str, layout: ClusterLayout, opts: ClusterOptions) -> AgentRLConfig:
    """The config every process of the cluster reads: the run folder fixed (every node writes to it), a
    model that is never built, and the addresses: by DNS name for k8s; for slurm they exist only when
    the job runs, so the file has none and the batch script passes them as overrides."""
    data = cfg.model_dump()
    stamp = f"{cfg.run.name}-{time.strftime('%Y%m%d-%H%M%S')}"
    if target == "k8s":
        if not Path(cfg.model.path).is_absolute():
            raise PlacementError(
                f"model.path must be an absolute path inside the pods (a volume mounts its folder); "
                f"got {cfg.model.path!r}"
            )
        data["run"]["run_dir"] = f"/runs/{Path(cfg.run.run_dir).name or stamp}"
        for key, value in k8s_addresses(cfg, layout, opts).items():
            section, name = key.split(".")
            data[section][name] = value
    else:
        data["run"]["run_dir"] = str(Path(cfg.run.run_dir or Path("runs") / stamp).resolve())
        data["engine"]["urls"], data["engine"]["router_url"] = [], ""
    data["model"]["init_size"] = ""  # a cluster never builds a model: it serves one from model.path
    return AgentRLConfig.model_validate(data)


def write_launch(
    cfg: AgentRLConfig, target: str, out_dir: Path, opts: ClusterOptions
) -> tuple[ClusterLayout, list[Path]]:
    """Write the files for ``target`` into ``out_dir``; returns the layout and the files."""
    if target not in TARGETS:
        raise PlacementError(f"unknown target {target!r}; choose {' or '.join(TARGETS)}")
    check_config(cfg)
    layout = plan_cluster(cfg, gpus_per_node=opts.gpus_per_node, learner_nodes=opts.learner_nodes)
    cfg = cluster_config(cfg, target, layout, opts)
    out_dir.mkdir(parents=True, exist_ok=True)
    if target == "k8s":
        files = {"agentrl.yaml": kubernetes_yaml(cfg, layout, opts)}
    else:
        files = {"config.toml": dump_toml(cfg), **slurm_files(cfg, layout, opts, out_dir)}
    written = []
    for name, text in files.items():
        path = out_dir / name
        path.write_text(text)
        if name.endswith((".sh", ".sbatch")):
            path.chmod(0o755)
        written.append(path)
    return layout, written

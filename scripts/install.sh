#!/usr/bin/env bash
# Installs agentrl and everything its tests need into ./.venv (override with AGENTRL_VENV).
#
# torch: on a machine without an NVIDIA GPU this pins the CPU build (AGENTRL_TORCH, default
# torch==2.13.0, whose CPU wheel the pip configuration of our dev/CI machines provides) so
# that an unpinned requirement never pulls a multi-GB CUDA build. With a GPU, the newest
# torch from the index is used unless AGENTRL_TORCH says otherwise.
# System packages (bubblewrap for the local code sandbox) are installed when running as
# root with apt-get available; elsewhere the script says what is missing.
# SGLang (opt-in, AGENTRL_SGLANG=1): a second virtualenv (AGENTRL_SGLANG_VENV, default .venv-sglang)
# with the SGLang release agentrl is tested against and sglang-router. SGLang pins its own torch and
# transformers, so it cannot share .venv; point engine.sglang_python at its interpreter. About 11 GB.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${AGENTRL_VENV:-.venv}
SGLANG_ROUTER_PIN=0.3.2  # the router release whose flags agentrl passes (agentrl/run/cluster.py)
PY=${PYTHON:-python3}

if ! command -v bwrap >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    (apt-get install -y -q bubblewrap >/dev/null 2>&1 || { apt-get update -q >/dev/null && apt-get install -y -q bubblewrap >/dev/null; }) \
      || echo "install.sh: could not install bubblewrap; the local sandbox will be unavailable" >&2
  else
    echo "install.sh: bubblewrap (bwrap) is missing; install it for the local code sandbox" >&2
  fi
fi

# pip's notes about absent local mirror folders are noise; real errors still fail the script.
pip_install() { "$VENV/bin/python" -m pip install -q --disable-pip-version-check "$@" 2> >(grep -v "^WARNING: Location" >&2); }

[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
pip_install --upgrade pip
if [ -z "${AGENTRL_TORCH:-}" ]; then
  if command -v nvidia-smi >/dev/null 2>&1; then AGENTRL_TORCH="torch"; else AGENTRL_TORCH="torch==2.13.0"; fi
fi
pip_install "$AGENTRL_TORCH" -e ".[dev]"
"$VENV/bin/python" -c "import agentrl, torch; print(f'agentrl {agentrl.__version__} installed in $VENV (torch {torch.__version__})')"

if [ "${AGENTRL_SGLANG:-0}" = 1 ]; then
  SGLANG_VENV=${AGENTRL_SGLANG_VENV:-.venv-sglang}
  SGLANG_PIN=$("$VENV/bin/python" -c "from agentrl.engine.launch import SGLANG_VERSION as v; print(v)")
  [ -x "$SGLANG_VENV/bin/python" ] || "$PY" -m venv "$SGLANG_VENV"
  VENV=$SGLANG_VENV pip_install "sglang==$SGLANG_PIN" "sglang-router==$SGLANG_ROUTER_PIN"
  "$SGLANG_VENV/bin/python" -c "import importlib.metadata as m; print('sglang', m.version('sglang'), 'and sglang-router', m.version('sglang-router'), 'installed in $SGLANG_VENV: engine.sglang_python = \"$SGLANG_VENV/bin/python\"')"
fi

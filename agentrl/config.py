"""Typed run configuration: one TOML file per run, one section per process.

Rules: sections ``[run]``, ``[model]``, ``[engine]``, ``[judge]``, ``[actors]``, ``[env]`` or ``[[envs]]`` (never
both; :attr:`AgentRLConfig.env_sections` gives the list either way), ``[sandbox]``, ``[learner]``,
``[sft]``, ``[eval]``, ``[tracking]``, at most three levels deep. Unknown keys are an error naming
the dotted key and the file; cross-field rules live in the schema (``model_validator``). CLI
overrides are ``section.key=value``, parsed as TOML when they parse and as a string otherwise.
Units are in names (``*_s``, ``*_tokens``, ``num_*``). The comment at the end of a field's line is
its documentation (``agentrl.config_docs``).

This module imports neither torch nor transformers, so ``agentrl --help`` stays fast.
See docs/config.md.
"""

from __future__ import annotations

import datetime
import re
import time
import tomllib
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

# SGLang flags that agentrl writes itself (agentrl/engine/launch.py:engine_args), with the key that sets them
SGLANG_FLAGS_FROM_CONFIG = {
    "--tp-size": "engine.gpus_per_engine",
    "--tensor-parallel-size": "engine.gpus_per_engine",
    "--tp": "engine.gpus_per_engine",
    "--base-gpu-id": "engine.gpus_per_engine",
    "--mem-fraction-static": "engine.mem_fraction_static",
    "--weight-version": "the learner's policy version",
    "--context-length": "engine.max_context_tokens",
    "--max-running-requests": "engine.max_running_requests",
    "--api-key": "engine.api_key_env",
    "--admin-api-key": "engine.admin_api_key_env",
}


class ConfigError(ValueError):
    """A user error in a config file or override; the message names the key and the file."""


class Section(BaseModel):
    # NaN and infinities are no setting (a NaN learning rate, an infinite time-out): refused by name
    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)


class RunSection(Section):
    name: str = "agentrl"  # the run's name: the run folder's prefix and the MLflow run name
    seed: int = 0  # seed of task sampling, SFT order and model init
    run_dir: str = ""  # empty: runs/<name>-<timestamp>
    torch_num_threads: int = Field(default=0, ge=0)  # 0: leave torch's default


class ModelSection(Section):
    path: str = "runs/models/tiny"  # a local Hugging Face folder
    init_size: Literal["tiny", "small", "0.5b", "tiny-vl", ""] = "tiny"  # built at `path` when absent; "" = never build
    dtype: Literal["float32", "bfloat16", "float16"] = (
        "float32"  # dtype of the engines' weights and of the pushed weights (the learner trains in fp32)
    )


class EngineSection(Section):
    backend: Literal["embedded", "sglang"] = (
        "embedded"  # embedded (this package's SGLang-compatible engine, CPU or one GPU) or sglang
    )
    urls: list[str] = []  # empty: `agentrl run` starts `num_engines` servers itself
    router_url: str = ""  # generation through sglang-router; weight updates still go to `urls`
    num_engines: int = Field(default=1, ge=1)  # servers `agentrl run` starts when `urls` is empty
    host: str = "127.0.0.1"  # address the engines `agentrl run` starts listen on
    base_port: int = Field(
        default=30000, ge=1, le=65535
    )  # first port for engines started with fixed ports (agentrl run picks free ports)
    max_running_requests: int = Field(default=64, ge=1)  # requests an engine decodes together at most (its batch)
    max_context_tokens: int = Field(
        default=2048, ge=16
    )  # prompt + completion tokens of one request at most (SGLang's --context-length)
    device: str = "auto"  # auto | cpu | cuda
    # Placement (agentrl/run/placement.py): each engine `agentrl run` starts gets its own GPUs
    gpus_per_engine: int = Field(default=1, ge=1)  # GPUs per engine, SGLang's --tp-size (embedded: 1)
    mem_fraction_static: float = Field(default=0.0, ge=0, lt=1)  # SGLang's --mem-fraction-static; 0: SGLang's default
    colocate: bool = False  # engines share the learner's GPUs (one-GPU machines); sglang then needs mem_fraction_static
    request_retries: int = Field(
        default=5, ge=0
    )  # retries of a /generate call on connection errors and 5xx, with back-off
    health_check_interval_s: float = Field(
        default=2.0, gt=0
    )  # how often the client polls each engine's /ping (liveness, no generation)
    weight_group_backend: Literal["auto", "gloo", "nccl"] = (
        "auto"  # backend of the weight-update group; auto: nccl when the learner sees a GPU, else gloo
    )
    weight_bucket_mb: float = Field(default=64.0, gt=0)  # size of a weight-push bucket (one HTTP call + its broadcasts)
    sglang_args: list[str] = []  # extra flags for `python -m sglang.launch_server`
    sglang_python: str = ""  # interpreter of the virtualenv that has sglang (AGENTRL_SGLANG=1 scripts/install.sh builds .venv-sglang); empty: agentrl's own
    sglang_env: dict[str, str] = {}  # extra environment variables of the SGLang engine processes `agentrl run` starts
    # Bearer tokens: the config names the environment variables, never holds a key (agentrl/secrets.py)
    api_key_env: str = (
        "AGENTRL_ENGINE_API_KEY"  # NAME of the variable (or <NAME>_FILE) holding SGLang's --api-key (/generate)
    )
    admin_api_key_env: str = "AGENTRL_ENGINE_ADMIN_API_KEY"  # NAME of the variable (or <NAME>_FILE) holding --admin-api-key (weights, pause...)


JUDGE_WEIGHT_VERSION = "judge"  # the weight_version judge engines `agentrl run` starts report, always


class JudgeSection(Section):
    """A judge model that env rewards await (docs/run.md, "Rewards judged by a model"), served by
    engines of its own that are never in the learner's weight group."""

    model_path: str = ""  # a local Hugging Face folder: what the judge engines serve and whose tokenizer renders the prompts; empty: no judge
    backend: Literal["embedded", "sglang"] = "embedded"  # embedded (this package's engine) or sglang
    urls: list[str] = []  # running judge engines (never policy engines); empty: `agentrl run` starts `num_engines`
    num_engines: int = Field(default=1, ge=1)  # judge engines `agentrl run` starts when `urls` is empty
    host: str = "127.0.0.1"  # address the judge engines `agentrl run` starts listen on
    device: str = "auto"  # auto | cpu | cuda; on a GPU each judge engine gets its own GPUs, after the policy engines'
    gpus_per_engine: int = Field(default=1, ge=1)  # GPUs per judge engine, SGLang's --tp-size (embedded: 1)
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"  # auto: bfloat16 on a GPU, float32 on the CPU
    mem_fraction_static: float = Field(default=0.0, ge=0, lt=1)  # SGLang's --mem-fraction-static; 0: SGLang's default
    max_running_requests: int = Field(default=64, ge=1)  # requests a judge engine decodes together at most
    max_context_tokens: int = Field(default=4096, ge=16)  # prompt + verdict tokens of one judge call at most
    sglang_args: list[str] = []  # extra flags for the judge's `python -m sglang.launch_server`
    sglang_python: str = ""  # interpreter with sglang for the judge engines; empty: engine.sglang_python
    api_key_env: str = (
        "AGENTRL_JUDGE_API_KEY"  # NAME of the variable (or <NAME>_FILE) holding the judge engines' --api-key
    )
    # Calls (agentrl/engine/judge.py): greedy by default, batched, time-limited, counted
    max_new_tokens: int = Field(default=64, ge=1)  # tokens of one verdict at most (an env may ask for fewer)
    temperature: float = Field(default=0.0, ge=0)  # sampling temperature of the judge (0: greedy)
    timeout_s: float = Field(
        default=60.0, gt=0
    )  # per call, queueing and generation together; past it the reward raises JudgeError (a reward error)
    max_concurrent_calls: int = Field(default=64, ge=1)  # judge calls one process has waiting or in flight at most
    max_batch: int = Field(default=16, ge=1)  # calls sent together in one batched /generate at most (1: one call each)
    batch_window_s: float = Field(
        default=0.01, ge=0
    )  # how long the first call of a batch waits for others before the batch is sent
    request_retries: int = Field(default=2, ge=0)  # retries of a judge /generate on connection errors and 5xx

    @property
    def enabled(self) -> bool:
        return bool(self.model_path)

    @model_validator(mode="after")
    def _check(self) -> JudgeSection:
        if self.urls and not self.model_path:
            raise ValueError("judge.urls needs judge.model_path: the judge's tokenizer renders the prompts")
        if self.backend == "embedded" and self.gpus_per_engine > 1:
            raise ValueError("judge.gpus_per_engine > 1 needs judge.backend = 'sglang' (tensor parallel)")
        if self.backend == "embedded" and self.mem_fraction_static:
            raise ValueError("judge.mem_fraction_static is SGLang's flag: set it to 0 or use judge.backend = 'sglang'")
        if self.max_new_tokens >= self.max_context_tokens:
            raise ValueError(
                f"judge.max_new_tokens ({self.max_new_tokens}) must be below judge.max_context_tokens "
                f"({self.max_context_tokens})"
            )
        owned = sorted({a.split("=", 1)[0] for a in self.sglang_args} & set(SGLANG_FLAGS_FROM_CONFIG))
        if owned:
            raise ValueError(
                f"judge.sglang_args sets {', '.join(owned)}, which agentrl derives from the [judge] keys "
                "(gpus_per_engine, mem_fraction_static, max_context_tokens, max_running_requests, api_key_env)"
            )
        return self


class ActorsSection(Section):
    num_processes: int = Field(
        default=1, ge=1
    )  # actor processes `agentrl run` starts (each takes a share of the budget)
    num_concurrent_episodes: int = Field(default=64, ge=1)  # episodes one actor process runs at once
    group_size: int = Field(default=8, ge=1)  # samples per task, sent as one group (GRPO's n)
    max_staleness: int = Field(default=1, ge=0)  # 0 = synchronous; see docs/learner.md, "The budget"
    temperature: float = Field(
        default=1.0, ge=0
    )  # sampling temperature of training episodes (the learner's logprobs use it too)
    top_p: float = Field(default=1.0, gt=0, le=1)  # nucleus sampling of training episodes (1: off)
    top_k: int = -1  # top-k sampling of training episodes (-1: off)
    max_new_tokens_per_turn: int = Field(default=128, ge=1)  # tokens one model turn may generate at most
    trajectory_endpoint: str = "tcp://127.0.0.1:5557"  # actors PUSH -> learner PULL
    progress_endpoint: str = "tcp://127.0.0.1:5558"  # learner PUB -> actors SUB
    send_queue_groups: int = Field(default=16, ge=1)  # groups queued for sending before an actor waits for the learner
    max_unacked_groups: int = Field(
        default=256, ge=1
    )  # sent groups an actor keeps to resend until the learner acknowledges them
    dump_trajectories: bool = False  # agentrl run: each actor process appends every group it produces to <run_dir>/trajectories/actor<i>.jsonl
    # CURVE on both endpoints (agentrl/transport/security.py)
    curve_secret_key_env: str = "AGENTRL_CURVE_SECRET_KEY"  # NAME of the variable (or <NAME>_FILE) holding the run's CURVE secret key; required beyond loopback
    allow_plaintext_network: bool = False  # true: non-loopback endpoints without CURVE (a network you trust)


class EnvSection(Section):
    """An environment: ``[env]`` (one per run) or each ``[[envs]]`` entry (several, sampled by weight)."""

    cls: str = "agentrl.envs.calculator:CalculatorEnv"  # import path "module:Class" (or "path/to/file.py:Class")
    kwargs: dict[str, Any] = {}  # passed to the env's constructor
    name: str = ""  # the env's name in groups, metrics and evaluations (unique in a run); empty: the class's `name`
    weight: float = Field(default=1.0, gt=0)  # [[envs]]: relative share of the groups an actor starts from this env
    max_turns: int = Field(default=4, ge=1)  # model turns per episode (an AgentEnv: calls to the model per episode)
    max_total_tokens: int = Field(default=1024, ge=16)  # tokens per episode (an AgentEnv: per sequence of an episode)
    tool_timeout_s: float = Field(
        default=10.0, gt=0
    )  # per tool call (agentrl's own loop; an AgentEnv runs its own tools)
    tool_max_output_chars: int = Field(default=2000, ge=16)  # a longer tool result is cut (agentrl's own loop)
    search_corpus: str = ""  # JSONL corpus `agentrl run` serves when env.kwargs.search_url = "auto"
    # the search tool reads env.kwargs.search_token_env (same default)
    search_token_env: str = "AGENTRL_SEARCH_TOKEN"  # NAME of the variable (or <NAME>_FILE) holding the token of the search server `agentrl run` starts


class SandboxSection(Section):
    backend: Literal["local", "docker", "e2b"] = "local"  # where code runs: local (bubblewrap), docker or e2b
    image: str = "agentrl-python:latest"  # docker image
    e2b_template: str = ""  # e2b template id; empty = the SDK's default
    pool_size: int = Field(default=4, ge=0)  # reset sandboxes kept ready
    cpu_time_s: float = Field(default=5.0, gt=0)  # CPU seconds of one run at most
    wall_time_s: float = Field(default=10.0, gt=0)  # wall seconds of one run at most
    memory_mb: int = Field(default=256, ge=16)  # memory of one run's processes, in total where cgroups exist
    max_processes: int = Field(default=32, ge=1)  # processes one run may start
    max_output_chars: int = Field(default=4000, ge=16)  # stdout/stderr kept per run


LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


class LoraSection(Section):
    """LoRA: low-rank adapters trained on a frozen base model (docs/learner.md, "LoRA")."""

    rank: int = Field(default=0, ge=0)  # adapter rank r; 0: LoRA off, every parameter is trained
    alpha: float = Field(default=16.0, gt=0)  # the adapters' output is scaled by alpha / rank
    dropout: float = Field(default=0.0, ge=0, lt=1)  # dropout on the adapters' input while training (0: none)
    target_modules: list[str] = Field(
        default_factory=lambda: list(LORA_TARGETS)
    )  # names of the linear layers that get adapters
    sync: Literal["merged", "adapter"] = (
        "merged"  # engines get merged full weights (any SGLang), or the adapter alone via /load_lora_adapter (SGLang --enable-lora; a folder the engines can read)
    )

    @property
    def served_adapter(self) -> str:
        """The adapter name requests carry in ``lora_path`` (``sync = "adapter"``), else ""."""
        return LORA_ADAPTER_NAME if self.rank > 0 and self.sync == "adapter" else ""

    @model_validator(mode="after")
    def _check(self) -> LoraSection:
        if self.rank == 0 and self.sync == "adapter":
            raise ValueError("learner.lora.sync = 'adapter' needs learner.lora.rank > 0")
        if self.rank > 0 and not self.target_modules:
            raise ValueError("learner.lora.target_modules is empty: name the linear layers that get adapters")
        return self


LORA_ADAPTER_NAME = "agentrl-policy"  # the adapter's name on the engines with learner.lora.sync = "adapter"


class LearnerSection(Section):
    algorithm: Literal["grpo", "ppo"] = "grpo"  # grpo (no critic) or ppo (a critic and GAE)
    nproc: int = Field(default=1, ge=1)  # ranks on this machine (torchrun is used when > 1)
    gpus: int = Field(default=0, ge=0)  # GPUs on this machine, one rank each (then nproc is 1 or equal); 0: nproc
    device: str = "auto"  # auto, cpu or cuda
    lr: float = Field(default=3e-4, gt=0)  # the policy's AdamW learning rate
    critic_lr: float = Field(default=1e-4, gt=0)  # the critic's learning rate (ppo)
    weight_decay: float = Field(default=0.0, ge=0)  # AdamW weight decay
    warmup_steps: int = Field(default=0, ge=0)  # linear learning-rate warm-up steps
    lr_schedule: Literal["constant", "cosine", "linear"] = (
        "constant"  # after warm-up: constant, cosine or linear to 0 at max_steps
    )
    lr_decay_steps: int = Field(
        default=0, ge=0
    )  # the step a cosine or linear decay ends at, constant after it (Megatron's lr-decay-iters); 0: max_steps
    min_lr_ratio: float = Field(default=0.0, ge=0, le=1)  # where a cosine or linear decay ends, a fraction of lr
    max_steps: int = Field(default=100, ge=0)  # optimiser steps of the run (the learner exits after them)
    groups_per_step: int = Field(default=16, ge=1)  # trajectory groups (tasks x group_size episodes) per step
    first_groups_per_step: int = Field(
        default=0, ge=0
    )  # groups of the first step, doubled each step up to groups_per_step: the first update comes sooner, the actors' budget ramps with it (docs/performance.md, "The first update"); 0: groups_per_step from the first step
    max_tokens_per_microbatch: int = Field(default=8192, ge=16)  # tokens packed into one forward/backward
    grad_clip: float = Field(default=1.0, gt=0)  # gradient-norm clip
    # Loss (docs/algorithms.md: every objective, estimator, correction and normaliser)
    advantage: Literal["grpo", "rloo", "gae", "reinforce_pp"] = (
        "grpo"  # grpo (group mean), rloo (leave-one-out), gae (ppo's critic), reinforce_pp (group mean, batch-whitened)
    )
    normalize_advantage_std: bool = False  # divide GRPO advantages by the group's reward std
    clip_eps_low: float = Field(default=0.2, ge=0)  # PPO ratio clip below 1
    clip_eps_high: float = Field(default=0.2, ge=0)  # PPO ratio clip above 1 (DAPO's clip-higher when larger)
    dual_clip: float = Field(default=0.0, ge=0)  # 0 disables; else > 1 (e.g. 3.0)
    objective: Literal["ppo", "cispo"] = (
        "ppo"  # ppo (clipped ratio) or cispo (REINFORCE with a clipped, stopped weight)
    )
    ratio_level: Literal["token", "sequence"] = "token"  # token (PPO) or sequence (GSPO: one length-normalised ratio)
    decoupled: bool = True  # AReaL: ratio to the proximal policy, weight prox/behaviour
    behavior_weight_cap: float = Field(default=2.0, gt=0)  # cap of the prox/behaviour (or TIS) importance weight
    behavior_weight_mode: Literal["clamp", "mask"] = "clamp"  # clamp the weight at the cap, or mask tokens beyond it
    behavior_weight_floor: float = Field(
        default=0.0, ge=0
    )  # IcePop's alpha (with behavior_weight_mode = "mask"): tokens whose prox/behaviour weight is below it are masked
    sequence_mask_low: float = Field(
        default=0.0, ge=0
    )  # mask a whole sequence whose geometric-mean prox/behaviour weight is below this; 0: off
    sequence_mask_high: float = Field(default=0.0, ge=0)  # ... or above this; 0: off
    tis: Literal["none", "token", "sequence"] = (
        "none"  # truncated importance sampling per token or sequence (with decoupled = false)
    )
    kl_coef: float = Field(default=0.0, ge=0)  # KL penalty to the reference (initial) policy; 0: none
    kl_estimator: Literal["k1", "k2", "k3"] = "k3"  # k1, k2 (squared log ratio / 2) or k3 KL estimator
    entropy_coef: float = Field(default=0.0, ge=0)  # entropy bonus; 0: none
    loss_normalization: Literal["token", "sequence", "constant"] = (
        "token"  # over tokens, over sequences, or constant (Dr. GRPO: sequences x normalization_tokens)
    )
    normalization_tokens: int = Field(
        default=0, ge=0
    )  # the fixed length of loss_normalization = "constant"; 0: the largest env.max_total_tokens
    overlong_penalty_tokens: int = Field(
        default=0, ge=0
    )  # DAPO's overlong shaping: a linear penalty over this many tokens before env.max_total_tokens; 0: off
    overlong_penalty: float = Field(default=0.0, ge=0)  # the penalty at the limit (and for a truncated episode); 0: off
    gamma: float = Field(default=1.0, ge=0, le=1)  # discount of GAE
    gae_lambda: float = Field(default=0.95, ge=0, le=1)  # lambda of GAE
    value_clip: float = Field(default=0.2, ge=0)  # PPO critic: clip of V - V_old; 0 disables
    num_minibatches: int = Field(default=1, ge=1)  # optimiser updates per step; > 1 recomputes pi_prox first
    # Data
    max_staleness: int = Field(default=1, ge=0)  # groups older than this many versions are dropped
    dynamic_sampling: bool = True  # drop groups whose rewards do not vary
    wait_log_interval_s: float = Field(default=30.0, gt=0)  # how often to log while waiting for groups
    max_wait_for_data_s: float = Field(
        default=600.0, ge=0
    )  # stop (with a checkpoint) after this long without a batch once data flows (e.g. every group zero-variance); 0: wait forever
    max_abs_reward: float = Field(
        default=1000.0, gt=0
    )  # a reward (or component) beyond +-this, or not finite, is a bug: the group is dropped as malformed_reward
    # Systems
    sync_every_steps: int = Field(default=1, ge=1)  # steps between weight pushes (each bumps the policy version)
    activation_checkpointing: bool = False  # recompute activations in the backward (less memory, more time)
    checkpoint_every_steps: int = Field(default=50, ge=0)  # 0: only at the end
    keep_checkpoints: int = Field(default=2, ge=1)  # newest checkpoints kept on disk
    resume: Literal["auto", "never"] = "auto"  # auto: continue from the run folder's latest checkpoint; never
    weight_sync_address: str = "127.0.0.1"  # address of rank 0 as the engines see it (weight-update group)
    weight_sync_port: int = Field(default=0, ge=0, le=65535)  # 0: a free port
    engines_start_timeout_s: float = Field(
        default=0.0, ge=0
    )  # the first weight group waits this long for every engine to answer (a learner started before its engines); 0: one that does not is left out and joins when it answers
    lora: LoraSection = LoraSection()  # [learner.lora]: train low-rank adapters instead of every parameter

    @model_validator(mode="after")
    def _check_corrections(self) -> LearnerSection:
        for problem in learner_combination_problems(self):
            raise ValueError(problem)
        return self


def loss_combination_problems(loss: Any) -> list[str]:
    """Why a combination of policy-loss keys makes no sense (empty: it composes). ``loss`` is a
    ``LearnerSection`` or the learner's ``PolicyLossConfig``: both carry these keys under these names."""
    problems = []
    if loss.decoupled and loss.tis != "none":
        problems.append(
            "learner.decoupled and learner.tis both correct pi_prox/pi_behaviour; set learner.decoupled = false to use TIS (choose one)"
        )
    if loss.objective == "cispo" and loss.ratio_level == "sequence":
        problems.append(
            "learner.objective = 'cispo' weights each token's log-probability by its own clipped ratio (a token-level "
            "REINFORCE weight); learner.ratio_level = 'sequence' (GSPO) replaces the token ratio: choose one"
        )
    if loss.objective == "cispo" and loss.dual_clip:
        problems.append("learner.dual_clip bounds PPO's clipped objective; learner.objective = 'cispo' has none")
    floor, cap = loss.behavior_weight_floor, loss.behavior_weight_cap
    if floor < 0:
        problems.append(f"learner.behavior_weight_floor must be >= 0 (0: off), got {floor}")
    if floor and not (loss.decoupled and loss.behavior_weight_mode == "mask"):
        problems.append(
            "learner.behavior_weight_floor (IcePop) masks tokens of the decoupled weight: it needs "
            "learner.decoupled = true and learner.behavior_weight_mode = 'mask'"
        )
    if floor >= cap:
        problems.append(f"learner.behavior_weight_floor ({floor}) must be below learner.behavior_weight_cap ({cap})")
    low, high = loss.sequence_mask_low, loss.sequence_mask_high
    if low > 0 and high > 0 and low > high:
        problems.append(f"learner.sequence_mask_low ({low}) must not exceed learner.sequence_mask_high ({high})")
    if low < 0 or low >= 1:
        problems.append(f"learner.sequence_mask_low ({low}) must be in (0, 1) (0: off)")
    if high < 0 or 0 < high <= 1:
        problems.append(f"learner.sequence_mask_high ({high}) must be above 1 (0: off)")
    return problems


def learner_combination_problems(lc: LearnerSection) -> list[str]:
    """Why a combination of ``[learner]`` keys makes no sense (empty: it composes)."""
    problems = loss_combination_problems(lc)
    if (lc.overlong_penalty_tokens > 0) != (lc.overlong_penalty > 0):
        problems.append(
            "learner.overlong_penalty_tokens and learner.overlong_penalty turn overlong shaping on together: "
            f"set both above 0 or both to 0 (got {lc.overlong_penalty_tokens} and {lc.overlong_penalty})"
        )
    if lc.lr_schedule == "constant" and (lc.lr_decay_steps or lc.min_lr_ratio):
        problems.append(
            "learner.lr_decay_steps and learner.min_lr_ratio shape a decaying learner.lr_schedule "
            "('cosine' or 'linear'); it is 'constant'"
        )
    if lc.normalization_tokens and lc.loss_normalization != "constant":
        problems.append("learner.normalization_tokens is the constant of learner.loss_normalization = 'constant'")
    return problems


class SftSection(Section):
    enabled: bool = False  # `agentrl run` warm-starts with SFT before RL when true
    data: str = ""  # JSONL of conversations; empty = the env's demonstrations
    num_demonstrations: int = Field(default=2000, ge=0)  # demonstrations drawn from the env when data is empty
    epochs: float = Field(default=1.0, gt=0)  # passes over the data (when max_steps is 0)
    lr: float = Field(default=1e-3, gt=0)  # AdamW learning rate of the warm start
    batch_tokens: int = Field(default=8192, ge=16)  # tokens per SFT step
    max_steps: int = Field(default=0, ge=0)  # 0: derived from epochs
    warmup_steps: int = Field(default=0, ge=0)  # linear learning-rate warm-up steps of SFT
    lr_schedule: Literal["constant", "cosine", "linear"] = "constant"  # after warm-up: constant, cosine or linear to 0
    output_dir: str = ""  # Hugging Face folder written at the end; empty: <run_dir>/sft/model


class EvalSection(Section):
    num_tasks: int = Field(default=200, ge=1)  # held-out tasks per evaluation
    greedy: bool = True  # temperature 0 (false: actors.temperature)
    every_steps: int = Field(default=0, ge=0)  # 0: only before and after
    split: str = "test"  # the env's split evaluations draw from


class TrackingSection(Section):
    enabled: bool = True  # log to MLflow
    uri: str = ""  # empty: sqlite:///<run_dir>/mlflow.db
    experiment: str = "agentrl"  # MLflow experiment name
    run_id: str = ""  # log into this existing MLflow run (`agentrl run` sets it for its children)
    sample_episodes_every: int = Field(
        default=10, ge=0
    )  # every this many learner steps, the best and worst episodes of a few of the step's groups as the artifact samples/step_<step>.json; 0: never
    sample_episodes_groups: int = Field(
        default=2, ge=1
    )  # groups of the step shown in a sample, each as its best and worst episode


class AgentRLConfig(Section):
    run: RunSection = RunSection()
    model: ModelSection = ModelSection()
    engine: EngineSection = EngineSection()
    judge: JudgeSection = JudgeSection()  # a judge model for rewards; off while judge.model_path is empty
    actors: ActorsSection = ActorsSection()
    env: EnvSection | None = None  # one env ([env]); None when the run has [[envs]]
    envs: list[EnvSection] = []  # several envs ([[envs]] entries), sampled by weight per group; never with [env]
    sandbox: SandboxSection = SandboxSection()
    learner: LearnerSection = LearnerSection()
    sft: SftSection = SftSection()
    eval: EvalSection = EvalSection()
    tracking: TrackingSection = TrackingSection()

    @model_validator(mode="before")
    @classmethod
    def _one_env_form(cls, data: Any) -> Any:
        """``[env]`` or ``[[envs]]``, never both; neither is the default ``[env]``."""
        if not isinstance(data, dict):
            return data
        has_env, has_envs = data.get("env") is not None, bool(data.get("envs"))
        if has_env and has_envs:
            raise ValueError(
                "the config has both [env] and [[envs]]: use [env] for a run of one env, or only "
                "[[envs]] entries for several (an override env.x=... on a config with [[envs]] "
                "adds an [env]; address an entry as envs.<index>.x=...)"
            )
        if not has_env and not has_envs:
            data = {**data, "env": {}}
        return data

    @property
    def env_sections(self) -> list[EnvSection]:
        """The run's environments: ``[[envs]]``, or ``[env]`` alone."""
        return list(self.envs) if self.envs else [self.env or EnvSection()]

    @model_validator(mode="after")
    def _cross_field_checks(self) -> AgentRLConfig:
        for key, section in self._env_keys():
            if ":" not in section.cls:
                raise ValueError(f"{key}.cls must be 'module:Class', got {section.cls!r}")
            if section.max_total_tokens > self.engine.max_context_tokens:
                raise ValueError(
                    f"{key}.max_total_tokens ({section.max_total_tokens}) exceeds "
                    f"engine.max_context_tokens ({self.engine.max_context_tokens})"
                )
        names = [s.name for s in self.envs if s.name]
        if len(names) != len(set(names)):
            twice = sorted({n for n in names if names.count(n) > 1})
            raise ValueError(
                f"[[envs]] names must be unique in a run; {', '.join(map(repr, twice))} appear more than once"
            )
        if self.learner.dual_clip and self.learner.dual_clip <= 1.0:
            raise ValueError("learner.dual_clip must be 0 (off) or > 1")
        cache = self.learner.overlong_penalty_tokens
        for key, section in self._env_keys():
            if cache and cache >= section.max_total_tokens:
                raise ValueError(
                    f"learner.overlong_penalty_tokens ({cache}) must be below {key}.max_total_tokens "
                    f"({section.max_total_tokens}): the penalty ramps over the last tokens before that limit"
                )
        if self.learner.algorithm == "ppo" and self.learner.advantage != "gae":
            raise ValueError("learner.algorithm = 'ppo' trains a critic and needs learner.advantage = 'gae'")
        if self.learner.algorithm == "grpo" and self.learner.advantage == "gae":
            raise ValueError("learner.advantage = 'gae' needs a critic: set learner.algorithm = 'ppo'")
        if self.learner.algorithm == "grpo" and self.actors.group_size < 2:
            raise ValueError("GRPO needs actors.group_size >= 2 (several samples of one task)")
        if self.actors.max_staleness != self.learner.max_staleness:
            raise ValueError(
                f"actors.max_staleness ({self.actors.max_staleness}) and learner.max_staleness "
                f"({self.learner.max_staleness}) must be equal: it is one knob (0 = synchronous), "
                "set in both sections so that each process can be started on its own"
            )
        shared = sorted({u.rstrip("/") for u in self.judge.urls} & {u.rstrip("/") for u in self.engine.urls})
        if shared:
            raise ValueError(
                f"judge.urls and engine.urls share {', '.join(shared)}: a judge engine must not serve the "
                "policy (the learner pushes its weights into every engine in engine.urls)"
            )
        e = self.engine
        if e.backend == "embedded" and e.gpus_per_engine > 1:
            raise ValueError(
                f"engine.gpus_per_engine = {e.gpus_per_engine} needs engine.backend = 'sglang' "
                "(tensor parallel); the embedded engine runs on one device"
            )
        if e.backend == "embedded" and e.mem_fraction_static:
            raise ValueError(
                "engine.mem_fraction_static is SGLang's --mem-fraction-static; the embedded engine "
                "has no static memory pool: set it to 0 or use engine.backend = 'sglang'"
            )
        owned = sorted({a.split("=", 1)[0] for a in e.sglang_args} & set(SGLANG_FLAGS_FROM_CONFIG))
        if owned:
            raise ValueError(
                f"engine.sglang_args sets {', '.join(owned)}, which agentrl derives from its own keys "
                f"({', '.join(SGLANG_FLAGS_FROM_CONFIG[f] for f in owned)}): set those instead"
            )
        lc = self.learner
        if lc.gpus and lc.nproc > 1 and lc.nproc != lc.gpus:
            raise ValueError(
                f"learner.gpus ({lc.gpus}) and learner.nproc ({lc.nproc}) disagree: the learner runs "
                "one rank per GPU; set only learner.gpus"
            )
        return self

    def _env_keys(self) -> list[tuple[str, EnvSection]]:
        """(the key path a message names, section) of every env."""
        if self.envs:
            return [(f"envs.{i}", s) for i, s in enumerate(self.envs)]
        return [("env", self.env or EnvSection())]


def parse_override(item: str) -> tuple[list[str], Any]:
    """Split ``section.key=value`` into a key path and a TOML-parsed value."""
    if not _is_text(item):
        raise ConfigError(f"override {item!r} is not valid UTF-8 text")
    if "=" not in item:
        raise ConfigError(f"override {item!r} is not of the form section.key=value")
    key, raw = item.split("=", 1)
    path = [p for p in key.strip().split(".")]
    if len(path) < 2 or any(not p for p in path):
        raise ConfigError(f"override key {key!r} must be dotted, like learner.lr")
    try:
        value = tomllib.loads(f"v = {raw}")["v"]
    except (tomllib.TOMLDecodeError, ValueError, RecursionError):  # also too many digits, too deep
        value = raw
    return path, value


def _is_text(value: str) -> bool:
    """False for strings holding lone surrogates (undecodable bytes of a command line)."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _set_path(tree: dict[str, Any], path: list[str], value: Any) -> None:
    """Set ``value`` at ``path``; a number addresses an entry of an array of tables (``envs.1.weight``)."""
    node: Any = tree
    for i, part in enumerate(path):
        last = i == len(path) - 1
        if isinstance(node, list):
            if not (part.isdigit() and int(part) < len(node)):
                raise ConfigError(
                    f"cannot override {'.'.join(path)}: {'.'.join(path[:i])} has {len(node)} "
                    f"entries, addressed as 0..{len(node) - 1}"
                )
            if last:
                node[int(part)] = value
                return
            node = node[int(part)]
        elif isinstance(node, dict):
            if last:
                node[part] = value
                return
            node = node.setdefault(part, {})
        else:
            raise ConfigError(f"cannot override {'.'.join(path)}: {'.'.join(path[:i])} is not a table")


def _format_errors(err: ValidationError, source: str) -> str:
    lines = []
    for e in err.errors():
        key = ".".join(str(p) for p in e["loc"])
        if not key:  # a rule across sections: its message names the keys
            lines.append(f"{e['msg'].removeprefix('Value error, ')} (in {source})")
        elif e["type"] == "extra_forbidden":
            lines.append(f"unknown key '{key}' in {source}{_did_you_mean(e['loc'])}")
        else:
            lines.append(f"invalid value for '{key}' in {source}: {e['msg']}")
    return "; ".join(lines)


def _did_you_mean(loc: tuple[Any, ...]) -> str:
    """``"; did you mean 'learner.lr'?"`` for an unknown key close to a field of its section
    (difflib over the section's fields), else ``""``."""
    import difflib
    import typing

    model: Any = AgentRLConfig
    for part in loc[:-1]:
        if isinstance(part, int):  # an [[envs]] entry
            continue
        field = model.model_fields.get(part) if isinstance(part, str) else None
        if field is None:
            return ""
        types = [field.annotation, *typing.get_args(field.annotation)]
        types += [inner for t in types for inner in typing.get_args(t)]  # list[EnvSection] | None
        model = next((t for t in types if isinstance(t, type) and issubclass(t, BaseModel)), None)
        if model is None:  # a free-form table such as env.kwargs
            return ""
    close = difflib.get_close_matches(str(loc[-1]), list(model.model_fields), n=1, cutoff=0.6)
    if not close:
        return ""
    return f"; did you mean '{'.'.join(str(p) for p in (*loc[:-1], close[0]))}'?"


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> AgentRLConfig:
    """Load a TOML file (or the defaults when ``path`` is None) and apply overrides."""
    tree: dict[str, Any] = {}
    source = "the defaults"
    if path is not None:
        source = str(path)
        try:
            tree = tomllib.loads(Path(path).read_text(encoding="utf-8"))
        except FileNotFoundError as e:
            raise ConfigError(f"config file not found: {path}") from e
        except OSError as e:  # a folder, no permission, ...
            raise ConfigError(f"cannot read config file {path}: {e.strerror or e}") from e
        except UnicodeDecodeError as e:
            raise ConfigError(f"{path} is not UTF-8 text (byte {e.start})") from e
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"{path} is not valid TOML: {e}") from e
        except RecursionError:
            raise ConfigError(f"{path} is not valid TOML: arrays or tables nested too deeply") from None
        except ValueError as e:  # tomllib lets int()'s limit on digits through
            raise ConfigError(f"{path} is not valid TOML: {e}") from e
    for item in overrides or []:
        key_path, value = parse_override(item)
        _set_path(tree, key_path, value)
    if overrides:
        source += " (with overrides)"
    try:
        return AgentRLConfig.model_validate(tree)
    except ValidationError as e:
        raise ConfigError(_format_errors(e, source)) from None


def dump_toml(cfg: AgentRLConfig) -> str:
    """Render a config back to TOML (the resolved config of a run); it loads back to an equal config."""
    out: list[str] = []
    for section, body in cfg.model_dump().items():
        if body is None or body == []:  # the env form the config does not use
            continue
        for entry in body if isinstance(body, list) else [body]:
            out += _toml_table(section, entry, array=isinstance(body, list))
    return "\n".join(out)


def _toml_table(section: str, body: dict[str, Any], array: bool) -> list[str]:
    out = [f"[[{section}]]" if array else f"[{section}]"]
    nested = {}
    for key, value in body.items():
        if isinstance(value, dict):
            nested[key] = value
        else:
            out.append(f"{key} = {_toml_value(value)}")
    for key, table in nested.items():
        out.append(f"\n[{section}.{key}]")
        for k, v in table.items():
            out.append(f"{_toml_key(k)} = {_toml_value(v)}")
    out.append("")
    return out


_BARE_KEY = re.compile(r"[A-Za-z0-9_-]+")
_ESCAPES = {'"': '\\"', "\\": "\\\\", "\b": "\\b", "\t": "\\t", "\n": "\\n", "\f": "\\f", "\r": "\\r"}


def _toml_key(key: str) -> str:
    return key if _BARE_KEY.fullmatch(key) else _toml_string(key)


def _toml_string(text: str) -> str:
    """A TOML basic string: quotes, backslashes and control characters escaped."""
    return (
        '"'
        + "".join(_ESCAPES.get(ch) or (f"\\u{ord(ch):04x}" if ord(ch) < 0x20 or ord(ch) == 0x7F else ch) for ch in text)
        + '"'
    )


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)  # TOML spells inf and nan as Python does
    if isinstance(value, str):
        return _toml_string(value)
    if isinstance(value, (datetime.datetime, datetime.date, datetime.time)):
        return value.isoformat()  # TOML's date-times are RFC 3339
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{_toml_key(k)} = {_toml_value(v)}" for k, v in value.items()) + "}"
    raise TypeError(f"cannot render {type(value).__name__} as TOML")


def resolve_run_dir(cfg: AgentRLConfig, run_dir: str | Path | None = None) -> Path:
    """``run_dir`` (``--run-dir``), else ``run.run_dir``, else ``runs/<name>-<timestamp>`` (resume needs a
    fixed one). The one place a run's folder is decided: ``agentrl run``, the learner and SFT ask here."""
    if run_dir:
        return Path(run_dir)
    if cfg.run.run_dir:
        return Path(cfg.run.run_dir)
    return Path("runs") / f"{cfg.run.name}-{time.strftime('%Y%m%d-%H%M%S')}"

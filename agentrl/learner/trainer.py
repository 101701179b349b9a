"""The trainer: FSDP2 models, AdamW, the LR schedule, and one function per step.

A step (:meth:`Trainer.rl_step`): plan (split the batch into ``num_minibatches`` optimiser batches,
each packed into micro-batches dealt evenly over ranks, with one global loss normaliser);
prepare without gradient (PPO's GAE, proximal logprobs when there is more than one update, the
KL reference); update (forward/backward per micro-batch, clip, AdamW; a step whose gradient norm is
not finite is skipped and counted); PPO's critic; scheduler and metrics.

The loss is multiplied by the world size because FSDP averages gradients over ranks while the
loss is already normalised over the whole batch. With LoRA (``spec.lora``) only the adapters train;
the forward is the same, and PPO's critic stays a full model. See docs/learner.md.
"""

from __future__ import annotations

import math
import time
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from agentrl.learner.batching import MicroBatch, Sample, collate, loss_normalizer, plan_microbatches
from agentrl.learner.distributed import DistInfo
from agentrl.learner.lora import LoraSpec, adapters_disabled, add_adapters
from agentrl.learner.loss import PolicyLossConfig, gae_advantages, policy_loss, sft_loss, value_loss
from agentrl.learner.model import (
    load_causal_lm,
    load_value_model,
    shard_model,
    token_logprobs,
    token_values,
)


def _padded(x: Tensor, *, rows: int, length: int, seq: Tensor, pos: Tensor) -> Tensor:
    """Packed per-token values as a [rows, length] grid: token i at (seq[i], pos[i]), zeros elsewhere."""
    return torch.zeros(rows, length, dtype=x.dtype, device=x.device).index_put_((seq, pos), x)


@dataclass(frozen=True)
class TrainerSpec:
    """Everything the trainer needs, independent of where it came from (learn or sft)."""

    model_path: str
    lr: float
    algorithm: str = "grpo"  # grpo | ppo | sft
    weight_decay: float = 0.0
    warmup_steps: int = 0
    lr_schedule: str = "constant"  # constant | cosine | linear
    total_steps: int = 100
    decay_steps: int = 0  # where the decay ends (0: total_steps)
    min_lr_ratio: float = 0.0  # the decay's floor, a fraction of lr
    grad_clip: float = 1.0
    max_tokens_per_microbatch: int = 8192
    activation_checkpointing: bool = False
    temperature: float = 1.0  # the engines' sampling temperature: logprobs are of logits / T
    loss: PolicyLossConfig = field(default_factory=PolicyLossConfig)
    num_minibatches: int = 1
    critic_lr: float = 1e-4
    value_clip: float = 0.2
    gamma: float = 1.0
    gae_lambda: float = 0.95
    normalize_advantage_std: bool = False  # PPO: whiten GAE advantages over the batch
    lora: LoraSpec | None = None  # train adapters on the frozen policy (None: every parameter)

    @classmethod
    def for_learn(cls, cfg: Any, model_path: str | None = None) -> TrainerSpec:
        lc = cfg.learner
        temperature = cfg.actors.temperature if cfg.actors.temperature > 0 else 1.0
        return cls(
            model_path=model_path or cfg.model.path,
            lr=lc.lr,
            algorithm=lc.algorithm,
            weight_decay=lc.weight_decay,
            warmup_steps=lc.warmup_steps,
            lr_schedule=lc.lr_schedule,
            total_steps=lc.max_steps,
            decay_steps=lc.lr_decay_steps,
            min_lr_ratio=lc.min_lr_ratio,
            grad_clip=lc.grad_clip,
            max_tokens_per_microbatch=lc.max_tokens_per_microbatch,
            activation_checkpointing=lc.activation_checkpointing,
            temperature=temperature,
            loss=PolicyLossConfig.from_learner(lc, max(e.max_total_tokens for e in cfg.env_sections)),
            num_minibatches=lc.num_minibatches,
            critic_lr=lc.critic_lr,
            value_clip=lc.value_clip,
            gamma=lc.gamma,
            gae_lambda=lc.gae_lambda,
            normalize_advantage_std=lc.normalize_advantage_std,
            lora=LoraSpec.from_config(lc.lora),
        )


def lr_factor(step: int, *, warmup_steps: int, total_steps: int, schedule: str, min_ratio: float = 0.0) -> float:
    """Multiplier of the base LR at optimiser step ``step`` (0-based): linear warm-up over
    ``warmup_steps``, then constant, or cosine or linear from 1 to ``min_ratio`` at ``total_steps``
    (the decay's end) and ``min_ratio`` after it."""
    if warmup_steps and step < warmup_steps:
        return (step + 1) / warmup_steps
    if schedule == "constant":
        return 1.0
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    if schedule == "cosine":
        return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))
    if schedule == "linear":
        return min_ratio + (1.0 - min_ratio) * (1.0 - progress)
    raise ValueError(f"unknown lr_schedule {schedule!r}")


class MetricAccumulator:
    """Combines per-micro-batch metrics over micro-batches and ranks.

    ``add`` takes a loss function's metrics (means weighted by token count, ``*_min`` and
    ``*_max`` extrema); ``add_sum`` adds values that sum over micro-batches and ranks.
    """

    def __init__(self) -> None:
        self.weighted: dict[str, Tensor] = {}
        self.weights: dict[str, float] = defaultdict(float)
        self.mins: dict[str, Tensor] = {}
        self.maxs: dict[str, Tensor] = {}
        self.sums: dict[str, Tensor] = {}

    def add(self, metrics: dict[str, Tensor], weight: float, prefix: str = "") -> None:
        for key, value in metrics.items():
            name = prefix + key
            value = value.detach().float()
            if key.endswith("_min"):
                self.mins[name] = torch.minimum(self.mins[name], value) if name in self.mins else value
            elif key.endswith("_max"):
                self.maxs[name] = torch.maximum(self.maxs[name], value) if name in self.maxs else value
            elif weight > 0:
                self.weighted[name] = self.weighted.get(name, 0.0) + value * weight
                self.weights[name] += weight
            else:
                self.weighted.setdefault(name, torch.zeros((), device=value.device))
                self.weights[name] += 0.0

    def add_sum(self, name: str, value: Tensor | float) -> None:
        value = torch.as_tensor(value, dtype=torch.float32).detach()
        self.sums[name] = self.sums[name] + value.to(self.sums[name].device) if name in self.sums else value

    def reduce(self, device: torch.device) -> dict[str, float]:
        """All-reduce over ranks (the key sets are the same on every rank) and return floats."""
        out: dict[str, float] = {}
        mean_keys = sorted(self.weighted)
        sum_keys = sorted(self.sums)
        packed = (
            torch.stack(
                [torch.as_tensor(self.weighted[k], dtype=torch.float32, device=device) for k in mean_keys]
                + [torch.tensor(self.weights[k], dtype=torch.float32, device=device) for k in mean_keys]
                + [self.sums[k].to(device) for k in sum_keys]
            )
            if (mean_keys or sum_keys)
            else torch.zeros(0, device=device)
        )
        mins = torch.stack([self.mins[k].to(device) for k in sorted(self.mins)]) if self.mins else None
        maxs = torch.stack([self.maxs[k].to(device) for k in sorted(self.maxs)]) if self.maxs else None
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(packed, op=dist.ReduceOp.SUM)
            if mins is not None:
                dist.all_reduce(mins, op=dist.ReduceOp.MIN)
            if maxs is not None:
                dist.all_reduce(maxs, op=dist.ReduceOp.MAX)
        values = packed.cpu().tolist()
        n = len(mean_keys)
        for i, k in enumerate(mean_keys):
            if values[n + i] > 0:
                out[k] = values[i] / values[n + i]
        for i, k in enumerate(sum_keys):
            out[k] = values[2 * n + i]
        for keys, tensor in ((sorted(self.mins), mins), (sorted(self.maxs), maxs)):
            if tensor is not None:
                for k, v in zip(keys, tensor.cpu().tolist()):
                    if math.isfinite(v):
                        out[k] = v
        return out


class Timer:
    """Wall-clock seconds per phase; synchronises the GPU at phase boundaries."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.seconds: dict[str, float] = defaultdict(float)

    @contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        start = time.perf_counter()
        try:
            yield
        finally:
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            self.seconds[name] += time.perf_counter() - start


class Trainer:
    """The policy (and PPO's critic, and the KL reference) under FSDP2, with their optimisers."""

    def __init__(self, spec: TrainerSpec, dist_info: DistInfo) -> None:
        from transformers import AutoConfig

        from agentrl.images import VisionProcessor

        self.spec = spec
        self.dist = dist_info
        self.device = dist_info.device
        self.hf_config = AutoConfig.from_pretrained(spec.model_path)
        self.vision = VisionProcessor.load(spec.model_path)  # None: a text model
        if spec.lora is None:
            policy = load_causal_lm(spec.model_path, device=self.device)
        else:  # adapters initialised on the CPU (one seed for every rank), then moved
            policy = add_adapters(load_causal_lm(spec.model_path), spec.lora).to(self.device)
        self.policy = shard_model(policy, device=self.device, activation_checkpointing=spec.activation_checkpointing)
        self.optimizer = self._adamw(self.policy, spec.lr)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer,
            partial(
                lr_factor,
                warmup_steps=spec.warmup_steps,
                total_steps=spec.decay_steps or spec.total_steps,
                schedule=spec.lr_schedule,
                min_ratio=spec.min_lr_ratio,
            ),
        )
        self.critic: nn.Module | None = None
        self.critic_optimizer: torch.optim.Optimizer | None = None
        if spec.algorithm == "ppo":
            self.critic = shard_model(
                load_value_model(spec.model_path, device=self.device),
                device=self.device,
                activation_checkpointing=spec.activation_checkpointing,
            )
            self.critic_optimizer = self._adamw(self.critic, spec.critic_lr)
        self.reference: nn.Module | None = None  # with LoRA: the policy's base (adapters off), see reference_logprobs
        if spec.algorithm != "sft" and spec.loss.kl_coef > 0 and spec.lora is None:
            self.reference = shard_model(
                load_causal_lm(spec.model_path, device=self.device), device=self.device, trainable=False
            )
        self.step = 0  # optimiser steps taken (= train steps)
        self.skipped_updates = 0  # updates skipped for a non-finite gradient norm

    def _adamw(self, model: nn.Module, lr: float) -> torch.optim.Optimizer:
        return torch.optim.AdamW(
            [p for p in model.parameters() if p.requires_grad],
            lr=lr,
            betas=(0.9, 0.999),
            eps=1e-8,
            weight_decay=self.spec.weight_decay,
        )

    @property
    def uses_reference(self) -> bool:
        """Whether the loss has a KL term against the reference policy (``model.path``)."""
        return self.spec.algorithm != "sft" and self.spec.loss.kl_coef > 0

    def reference_logprobs(self, mb: MicroBatch) -> Tensor:
        """Logprobs under the reference policy: the frozen copy, or with LoRA the policy with its
        adapters off (the same base weights, no second model)."""
        if self.reference is not None:
            return token_logprobs(self.reference, mb, temperature=self.spec.temperature)[0]
        with adapters_disabled(self.policy):
            return token_logprobs(self.policy, mb, temperature=self.spec.temperature)[0]

    @property
    def pad_token_id(self) -> int:
        return int(getattr(self.hf_config.get_text_config(), "pad_token_id", None) or 0)

    @property
    def vocab_size(self) -> int:
        return int(self.hf_config.get_text_config().vocab_size)

    # ------------------------------------------------------------------ planning

    def plan(self, samples: list[Sample]) -> list[MicroBatch]:
        """This rank's micro-batches of ``samples`` (same plan computed on every rank)."""
        plan = plan_microbatches(
            [s.num_tokens for s in samples], self.spec.max_tokens_per_microbatch, self.dist.world_size
        )
        return [
            collate(
                [samples[i] for i in indices],
                pad_token_id=self.pad_token_id,
                vision=self.vision,
                rope_model=self.policy,
            ).to(self.device)
            for indices in plan[self.dist.rank]
        ]

    def _minibatches(self, samples: list[Sample]) -> list[tuple[list[MicroBatch], float]]:
        """Split into ``num_minibatches`` contiguous optimiser batches with their normalisers."""
        m = max(1, min(self.spec.num_minibatches, len(samples)))
        bounds = [round(i * len(samples) / m) for i in range(m + 1)]
        out = []
        for lo, hi in zip(bounds[:-1], bounds[1:]):
            part = samples[lo:hi]
            normalizer = loss_normalizer(part, self.spec.loss.normalization, self.spec.loss.normalization_tokens)
            out.append((self.plan(part), normalizer))
        return out

    # ------------------------------------------------------------------ the RL step

    def rl_step(self, samples: list[Sample]) -> dict[str, float]:
        """One GRPO/PPO step on ``samples`` (the same list on every rank); returns metrics."""
        timer = Timer(self.device)
        acc = MetricAccumulator()
        with timer("time/plan_s"):
            minibatches = self._minibatches(samples)
        every_mb = [mb for mbs, _ in minibatches for mb in mbs]

        with timer("time/prepare_s"), torch.no_grad():
            if self.critic is not None:
                self._compute_gae(every_mb)
            if len(minibatches) > 1 and self.spec.loss.uses_proximal:
                for mb in every_mb:
                    mb.extras["proximal"] = token_logprobs(self.policy, mb, temperature=self.spec.temperature)[0]
            if self.uses_reference:
                for mb in every_mb:
                    mb.extras["reference"] = self.reference_logprobs(mb)

        grad_norms = []
        for micro_batches, normalizer in minibatches:
            with timer("time/forward_backward_s"):
                for mb in micro_batches:
                    loss = self._policy_loss(mb, normalizer, acc)
                    (loss * self.dist.world_size).backward()
                    acc.add_sum("loss/total", loss.detach() / len(minibatches))
            with timer("time/optimizer_s"):
                grad_norms.append(self._apply_gradients(self.policy, self.optimizer))

        if self.critic is not None:
            with timer("time/critic_s"):
                for micro_batches, _ in minibatches:
                    self._critic_update(micro_batches, acc)

        self.scheduler.step()
        self.step += 1
        metrics = acc.reduce(self.device)
        metrics.update(timer.seconds)
        metrics["grad_norm"] = sum(grad_norms) / len(grad_norms)
        metrics["lr"] = float(self.scheduler.get_last_lr()[0])
        metrics["skipped_updates"] = float(self.skipped_updates)
        return metrics

    def _policy_loss(self, mb: MicroBatch, normalizer: float, acc: MetricAccumulator) -> Tensor:
        cfg = self.spec.loss
        logprobs, entropy = token_logprobs(
            self.policy, mb, temperature=self.spec.temperature, with_entropy=True, entropy_grad=cfg.entropy_coef > 0
        )
        proximal = mb.extras.get("proximal", logprobs.detach())
        loss, metrics = policy_loss(
            logprobs,
            proximal,
            mb.behavior_logprobs,
            mb.advantages,
            mb.loss_mask,
            cfg,
            seq_ids=mb.seq_ids,
            num_seqs=mb.num_seqs,
            normalizer=normalizer,
            seq_weights=mb.seq_weights,
            ref_logprobs=mb.extras.get("reference"),
            entropy=entropy,
        )
        acc.add(metrics, weight=mb.num_loss_tokens, prefix="policy/")
        return loss

    def _apply_gradients(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> float:
        from torch.distributed.tensor import DTensor

        params = [p for p in model.parameters() if p.requires_grad]
        norm = torch.nn.utils.clip_grad_norm_(params, self.spec.grad_clip)
        if isinstance(norm, DTensor):
            norm = norm.full_tensor()
        norm_value = float(norm)
        if math.isfinite(norm_value):
            optimizer.step()
        else:
            self.skipped_updates += 1
        optimizer.zero_grad(set_to_none=True)
        return norm_value

    # ------------------------------------------------------------------ PPO's critic

    def critic_and_optimizer(self) -> tuple[nn.Module, torch.optim.Optimizer]:
        """PPO's critic and its optimiser; RuntimeError for an algorithm without a critic."""
        if self.critic is None or self.critic_optimizer is None:
            raise RuntimeError(f"algorithm {self.spec.algorithm!r} has no critic")
        return self.critic, self.critic_optimizer

    def _compute_gae(self, micro_batches: list[MicroBatch]) -> None:
        """Old values, GAE advantages and returns for every micro-batch (no gradient)."""
        critic, _ = self.critic_and_optimizer()
        for mb in micro_batches:
            values = token_values(critic, mb)
            seq = mb.seq_ids
            pos = mb.token_positions()
            length = int(pos.max()) + 1
            mask = mb.loss_mask
            padded = partial(_padded, rows=mb.num_seqs, length=length, seq=seq, pos=pos)
            # The reward sits on each sequence's last action.
            last = torch.full((mb.num_seqs,), -1, dtype=torch.long, device=seq.device)
            last = last.scatter_reduce(0, seq[mask], pos[mask], reduce="amax")
            rewards = torch.zeros(mb.num_seqs, length, device=values.device)
            has = last >= 0
            rewards[has.nonzero().squeeze(-1), last[has]] = mb.rewards[has]
            adv, ret = gae_advantages(rewards, padded(values), padded(mask), self.spec.gamma, self.spec.gae_lambda)
            mb.advantages = adv[seq, pos]
            mb.extras["old_values"] = values
            mb.extras["returns"] = ret[seq, pos]
        if self.spec.normalize_advantage_std:
            self._whiten_advantages(micro_batches)

    def _whiten_advantages(self, micro_batches: list[MicroBatch]) -> None:
        stats = torch.zeros(3, device=self.device, dtype=torch.float64)
        for mb in micro_batches:
            a = mb.advantages[mb.loss_mask].double()
            stats += torch.stack([a.sum(), (a * a).sum(), a.new_tensor(float(a.numel()))])
        if self.dist.world_size > 1:
            dist.all_reduce(stats)
        n = stats[2].clamp(min=1)
        mean = stats[0] / n
        std = (stats[1] / n - mean**2).clamp(min=0).sqrt()
        for mb in micro_batches:
            mb.advantages = ((mb.advantages - mean) / (std + 1e-6)).float() * mb.loss_mask

    def _critic_update(self, micro_batches: list[MicroBatch], acc: MetricAccumulator) -> None:
        normalizer = float(max(1, sum(mb.num_loss_tokens for mb in micro_batches)))
        if self.dist.world_size > 1:
            count = torch.tensor(normalizer, device=self.device)
            dist.all_reduce(count)
            normalizer = float(count)
        critic, optimizer = self.critic_and_optimizer()
        for mb in micro_batches:
            values = token_values(critic, mb)
            loss, metrics = value_loss(
                values,
                mb.extras["old_values"],
                mb.extras["returns"],
                mb.loss_mask,
                clip=self.spec.value_clip,
                normalizer=normalizer,
            )
            (loss * self.dist.world_size).backward()
            acc.add(metrics, weight=mb.num_loss_tokens, prefix="critic/")
        norm = self._apply_gradients(critic, optimizer)
        acc.add_sum("critic/grad_norm", norm / self.dist.world_size / max(1, self.spec.num_minibatches))

    # ------------------------------------------------------------------ SFT

    def sft_step(self, samples: list[Sample]) -> dict[str, float]:
        """One supervised step: NLL of the masked (assistant) tokens, token mean over the batch."""
        timer = Timer(self.device)
        acc = MetricAccumulator()
        with timer("time/plan_s"):
            micro_batches = self.plan(samples)
            normalizer = loss_normalizer(samples, "token")
        with timer("time/forward_backward_s"):
            for mb in micro_batches:
                logprobs, _ = token_logprobs(self.policy, mb)
                loss, metrics = sft_loss(logprobs, mb.loss_mask, normalizer=normalizer)
                (loss * self.dist.world_size).backward()
                acc.add(metrics, weight=mb.num_loss_tokens, prefix="sft/")
                acc.add_sum("loss/total", loss.detach())
        with timer("time/optimizer_s"):
            grad_norm = self._apply_gradients(self.policy, self.optimizer)
        self.scheduler.step()
        self.step += 1
        metrics = acc.reduce(self.device)
        metrics.update(timer.seconds)
        metrics["grad_norm"] = grad_norm
        metrics["lr"] = float(self.scheduler.get_last_lr()[0])
        return metrics

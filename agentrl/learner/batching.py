"""From trajectory groups to packed micro-batches.

The path of a group through the learner:

1. :func:`validate_group` rejects what cannot be trained on (no model tokens, token ids
   outside the vocabulary, non-finite or positive behaviour logprobs, a sequence longer
   than a micro-batch, a reward or reward component that is not finite or exceeds
   ``max_abs_reward`` in size). :class:`GroupBuffer` counts every drop by reason and never
   raises. The reward check is the learner's border: one reward of 1e300 made the group's
   advantages -inf/NaN and the trainer skipped the whole step.
2. **Staleness.** A group's staleness is ``policy_version - oldest_version``, where the
   oldest version is the oldest policy that produced any of its model tokens. Groups with
   staleness > ``max_staleness`` are dropped (and counted) both on arrival and when a step
   takes them, since a group can go stale while it waits. ``max_staleness = 0`` is the
   synchronous system: only data from the current weights is trained on. A group *newer*
   than the learner (possible after a restart from an older checkpoint) is kept with
   staleness 0 and counted as ``future_version``: the importance weight still corrects it.
3. **Dynamic sampling** (DAPO) drops groups whose rewards do not vary: every GRPO/RLOO
   advantage would be 0, so they cost compute and shrink the effective batch.
4. :func:`samples_from_group` turns a group into :class:`Sample` s with their advantage
   (GRPO or RLOO over the group; GAE is computed later by the trainer with the critic).
5. :func:`plan_microbatches` packs sequences into micro-batches of at most
   ``max_tokens`` tokens and splits them evenly over ranks: every rank gets the same
   number of micro-batches (FSDP's collectives need that), filled longest-first into the
   least-loaded bin, so token counts per rank stay within one sequence of each other.
6. :func:`collate` concatenates the sequences of one micro-batch into a single row with no
   padding: ``position_ids`` restart at 0 for each sequence and ``cu_seqlens`` marks the
   boundaries, which the varlen attention (``model.py``) uses so attention never crosses
   sequences. Targets are shifted inside each sequence: element ``i`` scores token
   ``i + 1`` of the same sequence; the last position of a sequence scores nothing.
"""

from __future__ import annotations

import math
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Iterable

import numpy as np

from agentrl.protocol import TrajectoryGroup


@dataclass
class Sample:
    """One trajectory ready for training."""

    tokens: np.ndarray  # int32 [T]
    loss_mask: np.ndarray  # uint8 [T]
    behavior_logprobs: np.ndarray  # float32 [T]
    advantage: float = 0.0  # sequence advantage (GRPO/RLOO); GAE fills per-token values later
    reward: float = 0.0
    staleness: int = 0

    @property
    def num_tokens(self) -> int:
        return len(self.tokens)


# --------------------------------------------------------------------------- validation


def validate_group(
    group: TrajectoryGroup, *, vocab_size: int, max_sequence_tokens: int, max_abs_reward: float = math.inf
) -> str | None:
    """Return why ``group`` cannot be trained on (a counter key), or None when it is fine."""
    if not group.trajectories:
        return "malformed_empty"
    for traj in group.trajectories:
        rewards = [traj.reward, *traj.reward_components.values()]
        if not all(math.isfinite(r) and abs(r) <= max_abs_reward for r in rewards):
            return "malformed_reward"
        mask = traj.loss_mask.astype(bool)
        if len(traj.tokens) < 2 or not mask[1:].any():
            return "malformed_no_model_tokens"
        if traj.num_tokens > max_sequence_tokens:
            return "too_long"
        if traj.tokens.min() < 0 or traj.tokens.max() >= vocab_size:
            return "malformed_token_id"
        lp = traj.behavior_logprobs[mask]
        if not np.isfinite(lp).all() or (lp > 1e-3).any():
            return "malformed_logprob"
        if (traj.weight_versions[mask] < 0).any():
            return "malformed_version"
    return None


def group_staleness(group: TrajectoryGroup, policy_version: int) -> int:
    """Versions between the oldest policy that wrote a token of ``group`` and ``policy_version``."""
    return policy_version - group.oldest_version()


class GroupBuffer:
    """Groups received and not yet trained on; drops and counts what cannot be used.

    ``counters`` holds ``received``, ``accepted``, ``dropped_<reason>``, ``future_version``,
    ``consumed`` (taken for a step) and ``duplicate`` (counted by the learner's ledger, which
    sees duplicates before the buffer does).
    """

    def __init__(
        self,
        *,
        max_staleness: int,
        dynamic_sampling: bool,
        vocab_size: int,
        max_sequence_tokens: int,
        max_abs_reward: float = math.inf,
    ) -> None:
        self.max_abs_reward = max_abs_reward
        self.max_staleness = max_staleness
        self.dynamic_sampling = dynamic_sampling
        self.vocab_size = vocab_size
        self.max_sequence_tokens = max_sequence_tokens
        self.groups: deque[TrajectoryGroup] = deque()
        self.counters: Counter[str] = Counter()

    def __len__(self) -> int:
        return len(self.groups)

    def _drop(self, reason: str) -> str:
        self.counters[f"dropped_{reason}"] += 1
        return reason

    def add(self, group: TrajectoryGroup, policy_version: int) -> str | None:
        """Keep ``group`` or drop it; returns the drop reason (None when kept)."""
        self.counters["received"] += 1
        reason = validate_group(
            group,
            vocab_size=self.vocab_size,
            max_sequence_tokens=self.max_sequence_tokens,
            max_abs_reward=self.max_abs_reward,
        )
        if reason is not None:
            return self._drop(reason)
        if group_staleness(group, policy_version) > self.max_staleness:
            return self._drop("stale")
        if self.dynamic_sampling and np.ptp(np.asarray(group.rewards, dtype=np.float64)) < 1e-9:
            return self._drop("zero_variance")
        if group_staleness(group, policy_version) < 0:
            self.counters["future_version"] += 1
        self.counters["accepted"] += 1
        self.groups.append(group)
        return None

    def take(self, n: int, policy_version: int) -> list[TrajectoryGroup] | None:
        """The ``n`` oldest groups that are still fresh enough, or None (and nothing taken)
        when fewer than ``n`` remain after dropping the stale ones."""
        fresh: deque[TrajectoryGroup] = deque()
        for group in self.groups:
            if group_staleness(group, policy_version) > self.max_staleness:
                self._drop("stale")
            else:
                fresh.append(group)
        self.groups = fresh
        if len(self.groups) < n:
            return None
        self.counters["consumed"] += n
        return [self.groups.popleft() for _ in range(n)]


# --------------------------------------------------------------------------- advantages


def samples_from_group(
    group: TrajectoryGroup, policy_version: int, *, advantage: str = "grpo", normalize_std: bool = False
) -> list[Sample]:
    """The group's trajectories with their advantage (``grpo``, ``rloo``, or ``gae``: 0 for now)."""
    import torch

    from agentrl.learner.loss import grpo_advantages, rloo_advantages

    rewards = torch.tensor(group.rewards, dtype=torch.float32)
    if advantage == "grpo":
        adv = grpo_advantages(rewards, normalize_std=normalize_std).tolist()
    elif advantage == "rloo":
        adv = rloo_advantages(rewards).tolist() if len(rewards) > 1 else [0.0]
    elif advantage == "gae":
        adv = [0.0] * len(rewards)
    else:
        raise ValueError(f"unknown advantage {advantage!r}")
    staleness = max(0, group_staleness(group, policy_version))
    return [
        Sample(
            tokens=t.tokens,
            loss_mask=t.loss_mask,
            behavior_logprobs=t.behavior_logprobs,
            advantage=float(a),
            reward=float(t.reward),
            staleness=staleness,
        )
        for t, a in zip(group.trajectories, adv)
    ]


# --------------------------------------------------------------------------- packing


def plan_microbatches(lengths: list[int], max_tokens: int, world_size: int = 1) -> list[list[list[int]]]:
    """Assign sequence indices to micro-batches: ``plan[rank][k]`` is a list of indices.

    Every rank gets the same number of micro-batches ``K`` (the smallest for which the
    greedy packing fits); a micro-batch may be empty when there are fewer sequences than
    slots. Longest sequences go first, each into the least-loaded micro-batch that still
    has room, which keeps the ranks' token counts even. Deterministic: every rank computes
    the same plan from the same lengths.
    """
    if any(n > max_tokens for n in lengths):
        raise ValueError(f"a sequence of {max(lengths)} tokens exceeds the micro-batch budget of {max_tokens}")
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    k = max(1, math.ceil(sum(lengths) / (max_tokens * world_size)))
    while True:
        bins: list[list[int]] = [[] for _ in range(world_size * k)]
        load = [0] * len(bins)
        ok = True
        for i in order:
            fits = [b for b in range(len(bins)) if load[b] + lengths[i] <= max_tokens]
            if not fits:
                ok = False
                break
            b = min(fits, key=lambda j: (load[j], j))
            bins[b].append(i)
            load[b] += lengths[i]
        if ok:
            return [[sorted(bins[r * k + j]) for j in range(k)] for r in range(world_size)]
        k += 1


@dataclass
class MicroBatch:
    """One packed row of sequences, as torch tensors (see the module docstring)."""

    input_ids: "torch.Tensor"  # [1, N] long
    position_ids: "torch.Tensor"  # [1, N] long, restarting at 0 per sequence
    cu_seqlens: "torch.Tensor"  # [S + 1] int32 on CPU: sequence boundaries
    seq_ids: "torch.Tensor"  # [N] long: sequence index of each position
    targets: "torch.Tensor"  # [N] long: token scored at each position
    loss_mask: "torch.Tensor"  # [N] bool
    behavior_logprobs: "torch.Tensor"  # [N] float32
    advantages: "torch.Tensor"  # [N] float32
    rewards: "torch.Tensor"  # [S] float32
    num_seqs: int
    num_loss_tokens: int
    # Filled by the trainer before the update (no gradient):
    extras: dict[str, "torch.Tensor"] = field(default_factory=dict)

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[1])

    def to(self, device: "torch.device | str") -> "MicroBatch":
        move = lambda t: t.to(device, non_blocking=True)  # noqa: E731
        return MicroBatch(
            input_ids=move(self.input_ids),
            position_ids=move(self.position_ids),
            cu_seqlens=self.cu_seqlens,
            seq_ids=move(self.seq_ids),
            targets=move(self.targets),
            loss_mask=move(self.loss_mask),
            behavior_logprobs=move(self.behavior_logprobs),
            advantages=move(self.advantages),
            rewards=move(self.rewards),
            num_seqs=self.num_seqs,
            num_loss_tokens=self.num_loss_tokens,
            extras={k: move(v) for k, v in self.extras.items()},
        )


def collate(samples: list[Sample], pad_token_id: int = 0) -> MicroBatch:
    """Pack ``samples`` into one row; an empty list gives a 1-token dummy with no loss tokens
    (a rank with nothing to do still runs the forward so that FSDP's collectives line up)."""
    import torch

    if not samples:
        samples = [
            Sample(
                tokens=np.array([pad_token_id], dtype=np.int32),
                loss_mask=np.zeros(1, dtype=np.uint8),
                behavior_logprobs=np.zeros(1, dtype=np.float32),
            )
        ]
    tokens = np.concatenate([s.tokens for s in samples]).astype(np.int64)
    lengths = np.array([s.num_tokens for s in samples], dtype=np.int64)
    starts = np.concatenate([[0], np.cumsum(lengths)])
    positions = np.concatenate([np.arange(n) for n in lengths])
    seq_ids = np.repeat(np.arange(len(samples)), lengths)
    # Shift inside each sequence: position i scores token i + 1; the last position scores nothing.
    targets = np.zeros_like(tokens)
    mask = np.zeros(len(tokens), dtype=bool)
    behavior = np.zeros(len(tokens), dtype=np.float32)
    advantages = np.zeros(len(tokens), dtype=np.float32)
    for s, start in zip(samples, starts[:-1]):
        n = s.num_tokens
        sl = slice(start, start + n - 1)
        targets[sl] = s.tokens[1:]
        mask[sl] = s.loss_mask[1:].astype(bool)
        behavior[sl] = s.behavior_logprobs[1:]
        advantages[sl] = s.advantage
    return MicroBatch(
        input_ids=torch.from_numpy(tokens)[None],
        position_ids=torch.from_numpy(positions)[None],
        cu_seqlens=torch.from_numpy(starts.astype(np.int32)),
        seq_ids=torch.from_numpy(seq_ids),
        targets=torch.from_numpy(targets),
        loss_mask=torch.from_numpy(mask),
        behavior_logprobs=torch.from_numpy(behavior),
        advantages=torch.from_numpy(advantages),
        rewards=torch.tensor([s.reward for s in samples], dtype=torch.float32),
        num_seqs=len(samples),
        num_loss_tokens=int(mask.sum()),
    )


def loss_normalizer(samples: Iterable[Sample], normalization: str) -> float:
    """The global normaliser of one optimiser batch: loss tokens, or sequences with loss tokens."""
    counts = [int(s.loss_mask[1:].sum()) for s in samples]
    if normalization == "token":
        return float(max(1, sum(counts)))
    return float(max(1, sum(1 for c in counts if c > 0)))


def batch_statistics(groups: list[TrajectoryGroup], samples: list[Sample]) -> dict[str, float]:
    """Reward, advantage, length and staleness statistics of one step's batch, for logging."""
    rewards = np.array([s.reward for s in samples], dtype=np.float64)
    adv = np.array([s.advantage for s in samples], dtype=np.float64)
    lengths = np.array([s.num_tokens for s in samples], dtype=np.float64)
    model_tokens = np.array([int(s.loss_mask.sum()) for s in samples], dtype=np.float64)
    stats = {
        "batch/groups": float(len(groups)),
        "batch/sequences": float(len(samples)),
        "batch/tokens": float(lengths.sum()),
        "batch/model_tokens": float(model_tokens.sum()),
        "batch/seq_len_mean": float(lengths.mean()) if len(lengths) else 0.0,
        "batch/seq_len_max": float(lengths.max()) if len(lengths) else 0.0,
        "reward/mean": float(rewards.mean()) if len(rewards) else 0.0,
        "reward/std": float(rewards.std()) if len(rewards) else 0.0,
        "reward/min": float(rewards.min()) if len(rewards) else 0.0,
        "reward/max": float(rewards.max()) if len(rewards) else 0.0,
        "advantage/mean": float(adv.mean()) if len(adv) else 0.0,
        "advantage/std": float(adv.std()) if len(adv) else 0.0,
        "advantage/min": float(adv.min()) if len(adv) else 0.0,
        "advantage/max": float(adv.max()) if len(adv) else 0.0,
        "advantage/zero_frac": float((np.abs(adv) < 1e-9).mean()) if len(adv) else 0.0,
    }
    staleness = Counter(s.staleness for s in samples)
    for lag, count in sorted(staleness.items()):
        stats[f"staleness/{lag}"] = count / max(1, len(samples))
    stats["staleness/mean"] = float(np.mean([s.staleness for s in samples])) if samples else 0.0
    return stats

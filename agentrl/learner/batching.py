"""From trajectory groups to packed micro-batches.

A group's path through the learner: :func:`validate_group` rejects what cannot be trained on
(:class:`GroupBuffer` counts every drop by reason and never raises); groups staler than
``max_staleness`` are dropped on arrival and again when a step takes them (a group newer than the
learner, after a restart from an older checkpoint, is kept with staleness 0 and counted as
``future_version``); dynamic sampling drops groups whose episode rewards do not vary;
:func:`samples_from_groups` gives each sequence its episode's advantage (GRPO, RLOO, REINFORCE++;
DAPO's overlong shaping first);
:func:`plan_microbatches` packs sequences into micro-batches of at most ``max_tokens`` tokens and
gives every rank the same number of them (FSDP's collectives need that); :func:`collate` joins one
micro-batch into a single unpadded row (``position_ids`` restart per sequence, ``cu_seqlens`` marks
the boundaries, targets are shifted inside each sequence).

Images (vision-language models): a trajectory's PNG images go with each of its samples; the border
drops a group whose images do not match their pad runs, are too large or do not decode; ``collate``
keeps each sequence's images with it (``pixel_values`` / ``image_grid_thw`` in packed order) and
builds mRoPE ``position_ids`` [3, 1, N] per sequence from the model's own ``get_rope_index``.

Invariant: whatever is about episodes (baseline, std, dynamic sampling, reward statistics) uses
one reward per episode, however many sequences an agent episode has (:func:`episode_index`); every
sequence gets its episode's advantage.

See docs/learner.md.
"""

from __future__ import annotations

import math
import re
from collections import Counter, deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from agentrl.images import MAX_IMAGE_BYTES
from agentrl.protocol import Trajectory, TrajectoryGroup

if TYPE_CHECKING:
    import torch

    from agentrl.images import VisionProcessor


@dataclass
class Sample:
    """One trajectory ready for training."""

    tokens: np.ndarray  # int32 [T]
    loss_mask: np.ndarray  # uint8 [T]
    behavior_logprobs: np.ndarray  # float32 [T]
    advantage: float = 0.0  # its episode's advantage (GRPO/RLOO); GAE fills per-token values later
    reward: float = 0.0
    staleness: int = 0
    episode_weight: float = 1.0  # 1 / the number of sequences of its episode (sequence-mean loss)
    reward_shaping: float = 0.0  # what overlong shaping added to its episode's reward (in ``reward``)
    images: list[bytes] = field(default_factory=list)  # PNG bytes, in the order of their pad runs in ``tokens``

    @property
    def num_tokens(self) -> int:
        return len(self.tokens)


# --------------------------------------------------------------------------- episodes


def episode_index(trajectories: list[Trajectory]) -> tuple[list[float], list[int]]:
    """(one reward per episode, the episode of each trajectory), by ``metadata["episode_id"]`` in
    order of first appearance; a trajectory without an episode id is an episode of its own. An
    episode's reward is its first trajectory's (every sequence of an episode carries it)."""
    rewards: list[float] = []
    where: dict[str, int] = {}
    index = []
    for k, t in enumerate(trajectories):
        key = t.metadata.get("episode_id")
        key = f"\x00{k}" if key is None else str(key)
        if key not in where:
            where[key] = len(rewards)
            rewards.append(float(t.reward))
        index.append(where[key])
    return rewards, index


def episode_rewards(group: TrajectoryGroup) -> list[float]:
    """One reward per episode of ``group`` (see :func:`episode_index`)."""
    return episode_index(group.trajectories)[0]


# --------------------------------------------------------------------------- validation


def validate_group(
    group: TrajectoryGroup,
    *,
    vocab_size: int,
    max_sequence_tokens: int,
    max_abs_reward: float = math.inf,
    vision: VisionProcessor | None = None,
) -> str | None:
    """Return why ``group`` cannot be trained on (a counter key), or None when it is fine.
    ``vision``: the model's processor (None: a text model, where no trajectory may carry images)."""
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
        if traj.images or vision is not None:
            reason = image_problem(traj, vision)
            if reason is not None:
                return reason
    return None


def image_problem(traj: Trajectory, vision: VisionProcessor | None) -> str | None:
    """Why ``traj``'s images cannot be trained on: ``malformed_image_count`` (images and pad runs
    differ in number; a text model has no pad runs), ``image_too_large`` (over ``MAX_IMAGE_BYTES``),
    ``malformed_image`` (not PNG bytes that decode), ``malformed_image_tokens`` (a pad run whose
    length is not the image's token count); None when they fit."""
    if vision is None:
        return "malformed_image_count" if traj.images else None
    spans = vision.image_spans(traj.tokens.tolist())
    if len(spans) != len(traj.images):
        return "malformed_image_count"
    for (start, end), png in zip(spans, traj.images):
        if len(png) > MAX_IMAGE_BYTES:
            return "image_too_large"
        try:
            tokens = vision.num_tokens(png)  # decodes the PNG (ImageError) and runs the image processor
        except Exception:  # the border never raises: whatever the processor refuses is malformed
            return "malformed_image"
        if end - start != tokens:
            return "malformed_image_tokens"
    return None


def group_staleness(group: TrajectoryGroup, policy_version: int) -> int:
    """Versions between the oldest policy that wrote a token of ``group`` and ``policy_version``."""
    return policy_version - group.oldest_version()


class GroupBuffer:
    """Groups received and not yet trained on; drops and counts what cannot be used.

    ``counters`` holds ``received``, ``accepted``, ``dropped_<reason>``, ``future_version``,
    ``consumed`` (taken for a step) and ``duplicate`` (counted by the learner's ledger, which
    sees duplicates before the buffer does). ``env_counters[env]`` holds ``received``,
    ``accepted`` and ``dropped_<reason>`` per env name (the first ``MAX_ENVS`` names; any
    later one is counted under ``"other"``, so a sender cannot grow the metrics without bound),
    and ``env_recent[env]`` the (reward, success) of the last ``RECENT_EPISODES`` episodes of
    its valid groups, before staleness and dynamic sampling (which keeps only groups whose
    rewards vary, so the batch's rewards say little about how well the policy does).
    """

    MAX_ENVS = 32
    RECENT_EPISODES = 256

    def __init__(
        self,
        *,
        max_staleness: int,
        dynamic_sampling: bool,
        vocab_size: int,
        max_sequence_tokens: int,
        max_abs_reward: float = math.inf,
        vision: VisionProcessor | None = None,
    ) -> None:
        self.max_abs_reward = max_abs_reward
        self.vision = vision
        self.max_staleness = max_staleness
        self.dynamic_sampling = dynamic_sampling
        self.vocab_size = vocab_size
        self.max_sequence_tokens = max_sequence_tokens
        self.groups: deque[TrajectoryGroup] = deque()
        # id(group) -> its oldest policy version, for every group in ``groups`` (held through ``restore`` only):
        # ``take`` runs at every poll, and recomputing it (O(tokens)) per buffered group outgrew the time between groups
        self._oldest: dict[int, int] = {}
        self.counters: Counter[str] = Counter()
        self.env_counters: dict[str, Counter[str]] = {}
        self.env_recent: dict[str, deque[tuple[float, bool | None]]] = {}

    def __len__(self) -> int:
        return len(self.groups)

    def _env_name(self, group: TrajectoryGroup) -> str:
        known = group.env in self.env_counters or len(self.env_counters) < self.MAX_ENVS
        return group.env if known else "other"

    def _env(self, group: TrajectoryGroup) -> Counter[str]:
        return self.env_counters.setdefault(self._env_name(group), Counter())

    def _remember(self, group: TrajectoryGroup) -> None:
        recent = self.env_recent.setdefault(self._env_name(group), deque(maxlen=self.RECENT_EPISODES))
        rewards, index = episode_index(group.trajectories)
        success: dict[int, bool | None] = {}
        for t, e in zip(group.trajectories, index):
            ok = t.metadata.get("success")
            success.setdefault(e, ok if isinstance(ok, bool) else None)
        recent.extend((r, success[e]) for e, r in enumerate(rewards))

    def env_metrics(self) -> dict[str, float]:
        """Per env: the counters, and the reward and success rate of its recent episodes
        (``env/<name>/reward_recent``, ``env/<name>/success_recent``; success where the actor
        said, ``metadata["success"]`` from ``Env.is_success``)."""
        out: dict[str, float] = {}
        for env, counters in sorted(self.env_counters.items()):
            key = metric_name(env)
            out.update({f"env/{key}/{k}": float(v) for k, v in counters.items()})
            recent = self.env_recent.get(env)
            if recent:
                out[f"env/{key}/reward_recent"] = float(np.mean([r for r, _ in recent]))
                judged = [ok for _, ok in recent if ok is not None]
                if judged:
                    out[f"env/{key}/success_recent"] = sum(judged) / len(judged)
        return out

    def _drop(self, reason: str, group: TrajectoryGroup) -> str:
        self.counters[f"dropped_{reason}"] += 1
        self._env(group)[f"dropped_{reason}"] += 1
        return reason

    def add(self, group: TrajectoryGroup, policy_version: int) -> str | None:
        """Keep ``group`` or drop it; returns the drop reason (None when kept)."""
        self.counters["received"] += 1
        self._env(group)["received"] += 1
        reason = validate_group(
            group,
            vocab_size=self.vocab_size,
            max_sequence_tokens=self.max_sequence_tokens,
            max_abs_reward=self.max_abs_reward,
            vision=self.vision,
        )
        if reason is not None:
            return self._drop(reason, group)
        self._remember(group)
        oldest = group.oldest_version()
        if policy_version - oldest > self.max_staleness:
            return self._drop("stale", group)
        if self.dynamic_sampling and np.ptp(np.asarray(episode_rewards(group), dtype=np.float64)) < 1e-9:
            return self._drop("zero_variance", group)
        if policy_version - oldest < 0:
            self.counters["future_version"] += 1
        self.counters["accepted"] += 1
        self._env(group)["accepted"] += 1
        self.restore(group, oldest)
        return None

    def restore(self, group: TrajectoryGroup, oldest: int | None = None) -> None:
        """Hold ``group`` (``oldest``: its oldest version, when known) as accepted before, e.g. a
        checkpoint's pending group; counts nothing."""
        self._oldest[id(group)] = group.oldest_version() if oldest is None else oldest
        self.groups.append(group)

    def take(self, n: int, policy_version: int) -> list[TrajectoryGroup] | None:
        """The ``n`` oldest groups that are still fresh enough, or None (and nothing taken)
        when fewer than ``n`` remain after dropping the stale ones."""
        fresh: deque[TrajectoryGroup] = deque()
        for group in self.groups:
            if policy_version - self._oldest[id(group)] > self.max_staleness:
                del self._oldest[id(group)]
                self._drop("stale", group)
            else:
                fresh.append(group)
        self.groups = fresh
        if len(self.groups) < n:
            return None
        self.counters["consumed"] += n
        taken = [self.groups.popleft() for _ in range(n)]
        for group in taken:
            del self._oldest[id(group)]
        return taken


# --------------------------------------------------------------------------- advantages


@dataclass(frozen=True)
class AdvantageSpec:
    """How episode rewards become advantages (the ``[learner]`` keys of the same names)."""

    advantage: str = "grpo"  # grpo | rloo | gae | reinforce_pp
    normalize_std: bool = False  # GRPO: divide by the group's reward std
    overlong_penalty_tokens: int = 0  # DAPO's overlong shaping: the ramp before the limit; 0: off
    overlong_penalty: float = 0.0

    @classmethod
    def from_learner(cls, lc: Any) -> AdvantageSpec:
        return cls(lc.advantage, lc.normalize_advantage_std, lc.overlong_penalty_tokens, lc.overlong_penalty)


TRUNCATED_FINISHES = ("context_full", "truncated_tool_call")  # the episode hit its length limit


def overlong_shaping(length: int, limit: int, cache: int, penalty: float, truncated: bool) -> float:
    """DAPO's soft overlong punishment: 0 up to ``limit - cache`` tokens, then a linear ramp down to
    ``-penalty`` at ``limit``, and ``-penalty`` for an episode the limit cut (``truncated``)."""
    if truncated:
        return -penalty
    over = length - (limit - cache)
    return -penalty * min(1.0, over / cache) if over > 0 else 0.0


def _episode_shaping(group: TrajectoryGroup, index: list[int], spec: AdvantageSpec) -> list[float]:
    """The overlong shaping of each episode, from its last sequence (0 without a recorded limit:
    episodes played through the agent endpoint have none)."""
    last: dict[int, Trajectory] = {e: t for t, e in zip(group.trajectories, index)}
    out = [0.0] * (max(index) + 1 if index else 0)
    if not spec.overlong_penalty_tokens:
        return out
    for e, t in last.items():
        limit = t.metadata.get("max_total_tokens")
        if isinstance(limit, int) and limit > spec.overlong_penalty_tokens:
            truncated = t.metadata.get("finish_reason") in TRUNCATED_FINISHES
            out[e] = overlong_shaping(
                t.num_tokens, limit, spec.overlong_penalty_tokens, spec.overlong_penalty, truncated
            )
    return out


def samples_from_group(
    group: TrajectoryGroup, policy_version: int, spec: AdvantageSpec = AdvantageSpec()
) -> list[Sample]:
    """The group's trajectories with their episode's advantage over the group's episode rewards
    (plus overlong shaping): ``grpo`` (and ``reinforce_pp``, whitened later over the batch by
    :func:`samples_from_groups`) subtract the mean, ``rloo`` leaves one out, ``gae`` gives 0 (the
    critic fills it in). See the module docstring, "Episodes and sequences"."""
    import torch

    from agentrl.learner.loss import grpo_advantages, rloo_advantages

    rewards, index = episode_index(group.trajectories)
    shaping = _episode_shaping(group, index, spec)
    per_episode = torch.tensor(rewards, dtype=torch.float64) + torch.tensor(shaping, dtype=torch.float64)
    if spec.advantage in ("grpo", "reinforce_pp"):
        adv = grpo_advantages(per_episode, normalize_std=spec.normalize_std and spec.advantage == "grpo").tolist()
    elif spec.advantage == "rloo":
        adv = rloo_advantages(per_episode).tolist() if len(rewards) > 1 else [0.0]
    elif spec.advantage == "gae":
        adv = [0.0] * len(rewards)
    else:
        raise ValueError(f"unknown advantage {spec.advantage!r}")
    sequences = Counter(index)
    staleness = max(0, group_staleness(group, policy_version))
    return [
        Sample(
            tokens=t.tokens,
            loss_mask=t.loss_mask,
            behavior_logprobs=t.behavior_logprobs,
            advantage=float(adv[e]),
            reward=float(t.reward) + shaping[e],
            staleness=staleness,
            episode_weight=1.0 / sequences[e],
            reward_shaping=shaping[e],
            images=list(t.images),
        )
        for t, e in zip(group.trajectories, index)
    ]


def samples_from_groups(groups: list[TrajectoryGroup], policy_version: int, spec: AdvantageSpec) -> list[Sample]:
    """One step's samples; ``reinforce_pp`` whitens the group-centred advantages over the whole
    batch, each episode counted once (its sequences share its weight)."""
    samples = [s for g in groups for s in samples_from_group(g, policy_version, spec)]
    if spec.advantage == "reinforce_pp" and samples:
        import torch

        from agentrl.learner.loss import whiten

        values = torch.tensor([s.advantage for s in samples], dtype=torch.float64)
        weights = torch.tensor([s.episode_weight for s in samples], dtype=torch.float64)
        for s, a in zip(samples, whiten(values, weights).tolist()):
            s.advantage = float(a)
    return samples


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

    input_ids: torch.Tensor  # [1, N] long
    position_ids: torch.Tensor  # [1, N] long, restarting at 0 per sequence; a VLM's: mRoPE [3, 1, N]
    cu_seqlens: torch.Tensor  # [S + 1] int32 on CPU: sequence boundaries
    seq_ids: torch.Tensor  # [N] long: sequence index of each position
    targets: torch.Tensor  # [N] long: token scored at each position
    loss_mask: torch.Tensor  # [N] bool
    behavior_logprobs: torch.Tensor  # [N] float32
    advantages: torch.Tensor  # [N] float32
    rewards: torch.Tensor  # [S] float32
    seq_weights: torch.Tensor  # [S] float32: each sequence's episode_weight (sequence-mean loss)
    num_seqs: int
    num_loss_tokens: int
    pixel_values: torch.Tensor | None = None  # [P, D] float32: the images' patches in packed order; None: no images
    image_grid_thw: torch.Tensor | None = None  # [I, 3] long
    # Filled by the trainer before the update (no gradient):
    extras: dict[str, torch.Tensor] = field(default_factory=dict)

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[1])

    def token_positions(self) -> torch.Tensor:
        """[N] long: each token's index inside its sequence (``position_ids`` are mRoPE's for a VLM)."""
        import torch

        starts = self.cu_seqlens.to(self.seq_ids.device, torch.long)[self.seq_ids]
        return torch.arange(self.num_tokens, device=self.seq_ids.device) - starts

    def to(self, device: torch.device | str) -> MicroBatch:
        move = lambda t: t.to(device, non_blocking=True)  # noqa: E731
        maybe = lambda t: None if t is None else move(t)  # noqa: E731
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
            seq_weights=move(self.seq_weights),
            num_seqs=self.num_seqs,
            num_loss_tokens=self.num_loss_tokens,
            pixel_values=maybe(self.pixel_values),
            image_grid_thw=maybe(self.image_grid_thw),
            extras={k: move(v) for k, v in self.extras.items()},
        )


def collate(
    samples: list[Sample], pad_token_id: int = 0, *, vision: VisionProcessor | None = None, rope_model: Any = None
) -> MicroBatch:
    """Pack ``samples`` into one row; an empty list gives a 1-token dummy with no loss tokens
    (a rank with nothing to do still runs the forward so that FSDP's collectives line up).
    ``vision`` / ``rope_model``: a vision-language model's processor and the model itself (for
    ``get_rope_index``); then the row has mRoPE positions and its sequences' images."""
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
    pixels = grids = None
    position_ids = torch.from_numpy(positions)[None]
    if any(s.images for s in samples):
        if vision is None:
            raise ValueError("a sample has images but the model has no vision processor (a text model)")
        pixels, grids = vision.process([png for s in samples for png in s.images])
    if vision is not None:
        position_ids = mrope_positions(samples, vision, rope_model, grids)[:, None]
    return MicroBatch(
        input_ids=torch.from_numpy(tokens)[None],
        position_ids=position_ids,
        cu_seqlens=torch.from_numpy(starts.astype(np.int32)),
        seq_ids=torch.from_numpy(seq_ids),
        targets=torch.from_numpy(targets),
        loss_mask=torch.from_numpy(mask),
        behavior_logprobs=torch.from_numpy(behavior),
        advantages=torch.from_numpy(advantages),
        rewards=torch.tensor([s.reward for s in samples], dtype=torch.float32),
        seq_weights=torch.tensor([s.episode_weight for s in samples], dtype=torch.float32),
        num_seqs=len(samples),
        num_loss_tokens=int(mask.sum()),
        pixel_values=pixels,
        image_grid_thw=grids,
    )


def mrope_positions(
    samples: list[Sample], vision: VisionProcessor, rope_model: Any, grids: torch.Tensor | None
) -> torch.Tensor:
    """[3, N]: each sequence's mRoPE positions (its own images' grids, :meth:`VisionProcessor.rope_positions`;
    a sequence without images counts 0, 1, 2, ... on all three axes), concatenated."""
    import torch

    parts = []
    first = 0
    for s in samples:
        if s.images:
            assert grids is not None, "collate processed the images of every sample"
            grid = grids[first : first + len(s.images)]
            parts.append(vision.rope_positions(rope_model, s.tokens.tolist(), grid)[0])
            first += len(s.images)
        else:
            parts.append(torch.arange(s.num_tokens).expand(3, -1))
    return torch.cat(parts, dim=1)


def loss_normalizer(samples: Iterable[Sample], normalization: str, normalization_tokens: int = 0) -> float:
    """The global normaliser of one optimiser batch: loss tokens (``token``), episodes with loss
    tokens (``sequence``: each sequence with loss tokens counts its ``episode_weight``), or those
    episodes times ``normalization_tokens`` (``constant``, Dr. GRPO)."""
    samples = list(samples)
    counts = [int(s.loss_mask[1:].sum()) for s in samples]
    if normalization == "token":
        return float(max(1, sum(counts)))
    episodes = max(1.0, sum(s.episode_weight for s, c in zip(samples, counts) if c > 0))
    if normalization == "constant":
        if normalization_tokens < 1:
            raise ValueError("loss normalization 'constant' needs normalization_tokens >= 1")
        return episodes * normalization_tokens
    return episodes


def batch_statistics(groups: list[TrajectoryGroup], samples: list[Sample]) -> dict[str, float]:
    """Reward, advantage, length and staleness statistics of one step's batch, for logging.
    Rewards are over episodes, lengths and advantages over sequences (per env:
    :meth:`GroupBuffer.env_metrics`)."""
    episode_rewards_all: list[float] = []
    for g in groups:
        episode_rewards_all += episode_rewards(g)
    rewards = np.array(episode_rewards_all, dtype=np.float64)
    adv = np.array([s.advantage for s in samples], dtype=np.float64)
    lengths = np.array([s.num_tokens for s in samples], dtype=np.float64)
    model_tokens = np.array([int(s.loss_mask.sum()) for s in samples], dtype=np.float64)
    shaping = [s.reward_shaping for s in samples]
    stats = {
        "batch/groups": float(len(groups)),
        "batch/episodes": float(len(rewards)),
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
    if any(shaping):  # overlong shaping, over sequences; the reward/* keys are the env's rewards
        stats["reward/overlong_shaping_mean"] = float(np.mean(shaping))
        stats["reward/overlong_shaped_frac"] = float(np.mean([x != 0 for x in shaping]))
    images = [png for s in samples for png in s.images]
    if images:  # the PNG bytes the batch trains on
        stats["batch/images"] = float(len(images))
        stats["batch/image_bytes"] = float(sum(len(png) for png in images))
    staleness = Counter(s.staleness for s in samples)
    for lag, count in sorted(staleness.items()):
        stats[f"staleness/{lag}"] = count / max(1, len(samples))
    stats["staleness/mean"] = float(np.mean([s.staleness for s in samples])) if samples else 0.0
    return stats


_METRIC_UNSAFE = re.compile(r"[^A-Za-z0-9_.\- ]")


def metric_name(name: str) -> str:
    """An env name as a part of a metric key (MLflow takes letters, digits, ``_ - . /`` and
    spaces; anything else becomes ``_``, and a name is cut at 64 characters)."""
    return _METRIC_UNSAFE.sub("_", str(name))[:64] or "_"

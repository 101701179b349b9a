"""The learner on images (tiny Qwen2.5-VL): packed logprobs equal the model's own forward, gradients reach
the vision tower, the border drops malformed images by reason, SFT learns from image demonstrations,
checkpoints and exports keep the image processor, and FSDP2 over 2 torchrun ranks ends where 1 rank does.

This file is also the torchrun worker of the 2-rank test (``python -m torch.distributed.run ... THIS OUT MODEL``).
"""

from __future__ import annotations

import io
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from agentrl.protocol import Trajectory, TrajectoryGroup
from tests._learner_helpers import PYTHON, REPO, subprocess_env

TEXT_IDS = (3, 900)  # ordinary token ids of the tiny vocabulary (the vision tokens come after them)


@pytest.fixture(scope="session")
def tiny_vl(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from agentrl.models.builder import build_tiny_vl

    path = tmp_path_factory.getbasetemp() / "learner-tiny-vl"
    if not (path / "config.json").exists():
        build_tiny_vl(path, seed=0)
    return path


@pytest.fixture(scope="module")
def dist_info():
    from agentrl.learner.distributed import init_distributed

    torch.set_num_threads(1)
    return init_distributed("cpu")


def png(colour: tuple[int, int, int], size: tuple[int, int], mark: int = 0) -> bytes:
    """A solid image with a square of another colour at ``mark`` (so images of one colour differ)."""
    from PIL import Image, ImageDraw

    image = Image.new("RGB", size, colour)
    ImageDraw.Draw(image).rectangle((mark, mark, mark + 13, mark + 13), fill=(255 - colour[0], 128, colour[2]))
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


IMAGES = [png((200, 30, 30), (56, 56)), png((30, 30, 200), (84, 112), 20), png((30, 200, 30), (112, 56), 5)]


def trajectory(rng: np.random.Generator, vision, pngs: list[bytes], *, reward: float, answer: int = 12) -> Trajectory:
    """Prompt text, each image as ``<vision_start> pads <vision_end>`` with text after it, then model tokens."""
    ids = list(rng.integers(*TEXT_IDS, 5))
    for image in pngs:
        ids += [vision.vision_start_id, *[vision.image_token_id] * vision.num_tokens(image), vision.vision_end_id]
        ids += list(rng.integers(*TEXT_IDS, 3))
    prompt = len(ids)
    ids += list(rng.integers(*TEXT_IDS, answer))
    mask = np.zeros(len(ids), np.uint8)
    mask[prompt:] = 1
    behavior = np.where(mask, -rng.uniform(0.5, 6.0, len(ids)), 0.0).astype(np.float32)
    return Trajectory(
        tokens=np.asarray(ids, np.int32),
        loss_mask=mask,
        behavior_logprobs=behavior,
        weight_versions=np.where(mask, 0, -1).astype(np.int32),
        reward=reward,
        images=list(pngs),
    )


def image_groups(vision, seed: int = 0) -> list[TrajectoryGroup]:
    """Three groups: two images, one image, and text only (so some micro-batches hold no image)."""
    rng = np.random.default_rng(seed)
    layouts = [[IMAGES[0], IMAGES[1]], [IMAGES[2]], []]
    return [
        TrajectoryGroup(
            group_id=f"g{k}",
            task_id=f"t{k}",
            env="visual",
            trajectories=[trajectory(rng, vision, pngs, reward=float(i % 2)) for i in range(2)],
            actor_id="a",
            session="s",
            seq=k,
        )
        for k, pngs in enumerate(layouts)
    ]


def image_samples(vision, seed: int = 0, advantage: str = "grpo") -> list:
    from agentrl.learner.batching import AdvantageSpec, samples_from_groups

    return samples_from_groups(image_groups(vision, seed), 0, AdvantageSpec(advantage))


def _spec(path: Path, **kw):
    from agentrl.learner.loss import PolicyLossConfig
    from agentrl.learner.trainer import TrainerSpec

    base = dict(
        model_path=str(path),
        lr=1e-2,
        max_tokens_per_microbatch=64,
        num_minibatches=2,
        loss=PolicyLossConfig(kl_coef=0.05, entropy_coef=0.01, normalization="sequence"),
    )
    return TrainerSpec(**{**base, **kw})


def full_params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter gathered in full (collective: every rank calls it and gets all of them)."""
    from torch.distributed.tensor import DTensor

    return {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone() for n, p in model.named_parameters()}


# --------------------------------------------------------------------------- logprobs


def test_packed_image_logprobs_equal_each_sequence_alone(tiny_vl):
    """Two image sequences and a text one in one packed row (mRoPE positions per sequence, images in
    packed order) score every token as transformers' own forward of each sequence alone does."""
    from transformers import AutoModelForImageTextToText

    from agentrl.images import VisionProcessor
    from agentrl.learner.batching import collate
    from agentrl.learner.model import load_causal_lm, token_logprobs

    vision = VisionProcessor.load(tiny_vl)
    assert vision is not None
    samples = image_samples(vision)[::2]  # two images, one image, text only
    assert [len(s.images) for s in samples] == [2, 1, 0]
    model = load_causal_lm(str(tiny_vl)).eval()
    mb = collate(samples, vision=vision, rope_model=model)
    assert mb.position_ids.shape == (3, 1, mb.num_tokens) and mb.image_grid_thw is not None
    assert mb.image_grid_thw.tolist() == [[1, 4, 4], [1, 8, 6], [1, 4, 8]]
    with torch.no_grad():
        packed, _ = token_logprobs(model, mb, all_positions=True)
    reference = AutoModelForImageTextToText.from_pretrained(tiny_vl, dtype=torch.float32).eval()
    starts = mb.cu_seqlens.tolist()
    for k, s in enumerate(samples):
        ids = torch.from_numpy(s.tokens.astype(np.int64))[None]
        extra = {}
        if s.images:
            pixels, grid = vision.process(s.images)
            types = (ids == vision.image_token_id).int()
            extra = dict(pixel_values=pixels, image_grid_thw=grid, mm_token_type_ids=types)
        with torch.no_grad():
            logits = reference(input_ids=ids, **extra).logits[0].float()
        alone = torch.log_softmax(logits, -1)[:-1].gather(-1, ids[0, 1:, None]).squeeze(-1)
        torch.testing.assert_close(packed[starts[k] : starts[k + 1] - 1], alone, atol=1e-5, rtol=0)
    # the images are what the scores depend on: another image changes the first sequence's tokens after it
    other = collate([samples[0]], vision=vision, rope_model=model)
    other.pixel_values, other.image_grid_thw = vision.process([IMAGES[0], png((0, 0, 0), (84, 112))])
    with torch.no_grad():
        changed, _ = token_logprobs(model, other, all_positions=True)
    assert (changed[: starts[1] - 1] - packed[: starts[1] - 1]).abs().max() > 1e-4


def test_bidirectional_modules_get_full_attention():
    """A module with ``is_causal`` False (a vision block) attends both ways over what it passes, whatever
    text boundaries transformers forwards in its kwargs; a causal one keeps to each packed sequence."""
    import torch.nn.functional as F

    from agentrl.learner.model import varlen_attention

    q, k, v = (torch.randn(1, 2, 6, 4) for _ in range(3))
    vision = torch.nn.Module()
    vision.is_causal = False
    text_bounds = torch.tensor([0, 2, 6], dtype=torch.int32)
    out, _ = varlen_attention(vision, q, k, v, None, cu_seq_lens_q=text_bounds, is_causal=False)
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v).transpose(1, 2))
    out, _ = varlen_attention(vision, q, k, v, None, cu_seq_lens_q=text_bounds)  # the module's own flag
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v).transpose(1, 2))
    causal, _ = varlen_attention(torch.nn.Module(), q, k, v, None, cu_seq_lens_q=text_bounds)
    second = F.scaled_dot_product_attention(q[:, :, 2:], k[:, :, 2:], v[:, :, 2:], is_causal=True)
    torch.testing.assert_close(causal[:, 2:], second.transpose(1, 2))


# --------------------------------------------------------------------------- training


@pytest.mark.parametrize("algorithm", ["grpo", "ppo"])
def test_a_step_on_images_trains_the_vision_tower(tiny_vl, dist_info, algorithm):
    """GRPO with a KL reference, and PPO with its critic, on a batch of image and text micro-batches:
    the vision tower's weights move; image metrics are counted."""
    from torch.distributed.fsdp import FSDPModule

    from agentrl.learner.batching import batch_statistics
    from agentrl.learner.trainer import Trainer

    trainer = Trainer(_spec(tiny_vl, algorithm=algorithm), dist_info)
    assert trainer.vision is not None and trainer.vocab_size > trainer.vision.image_token_id
    blocks = list(trainer.policy.get_submodule("model.visual.blocks"))
    assert blocks and all(isinstance(b, FSDPModule) for b in blocks)  # each vision block is a unit of its own
    samples = image_samples(trainer.vision, advantage="gae" if algorithm == "ppo" else "grpo")
    before = full_params(trainer.policy)
    metrics = trainer.rl_step(samples)
    after = full_params(trainer.policy)
    assert np.isfinite(metrics["loss/total"]) and metrics["skipped_updates"] == 0
    for name in ("model.visual.patch_embed.proj.weight", "model.visual.blocks.0.attn.qkv.weight"):
        assert (after[name] - before[name]).abs().max() > 1e-6, name
    stats = batch_statistics(image_groups(trainer.vision), samples)
    assert stats["batch/images"] == 6 and stats["batch/image_bytes"] == 2 * sum(len(p) for p in IMAGES)


def test_malformed_images_drop_their_group_by_reason(tiny_vl):
    from agentrl.images import MAX_IMAGE_BYTES, VisionProcessor
    from agentrl.learner.batching import GroupBuffer

    vision = VisionProcessor.load(tiny_vl)
    assert vision is not None

    def buffer(with_vision: bool = True) -> GroupBuffer:
        kw = dict(max_staleness=4, dynamic_sampling=False, vocab_size=960, max_sequence_tokens=512)
        return GroupBuffer(**kw, vision=vision if with_vision else None)

    def spoiled(change) -> TrajectoryGroup:
        group = image_groups(vision)[0]
        change(group.trajectories[1])
        return group

    def fewer(t):
        t.images = t.images[:1]

    def too_large(t):
        t.images = [t.images[0], b"\x89PNG" + b"\x00" * MAX_IMAGE_BYTES]

    def not_png(t):
        t.images = [t.images[0], b"\x89PNG\r\n\x1a\n not really a png"]

    def jpeg(t):
        from PIL import Image

        buf = io.BytesIO()
        Image.new("RGB", (84, 112)).save(buf, format="JPEG")
        t.images = [t.images[0], buf.getvalue()]

    def other_size(t):  # a 56x56 image where the pads are those of an 84x112 one
        t.images = [t.images[0], IMAGES[0]]

    cases = {
        "malformed_image_count": fewer,
        "image_too_large": too_large,
        "malformed_image": not_png,
        "malformed_image_tokens": other_size,
    }
    buf = buffer()
    for reason, change in cases.items():
        assert buf.add(spoiled(change), policy_version=0) == reason
        assert buf.counters[f"dropped_{reason}"] == 1
    assert buf.add(spoiled(jpeg), policy_version=0) == "malformed_image"  # PNG only on the wire
    assert buf.add(image_groups(vision)[0], policy_version=0) is None and len(buf) == 1
    assert buf.env_counters["visual"]["dropped_malformed_image"] == 2
    text_model = buffer(with_vision=False)  # a text model: any image is one it has no placeholder for
    assert text_model.add(image_groups(vision)[1], policy_version=0) == "malformed_image_count"
    assert text_model.add(image_groups(vision)[2], policy_version=0) is None


def test_collate_without_a_processor_refuses_images(tiny_vl):
    from agentrl.images import VisionProcessor
    from agentrl.learner.batching import collate

    vision = VisionProcessor.load(tiny_vl)
    samples = image_samples(vision)
    with pytest.raises(ValueError, match="no vision processor"):
        collate(samples[:1])
    text = collate(samples[-1:])  # a text sample, text model: positions as before
    assert text.position_ids.shape == (1, text.num_tokens) and text.pixel_values is None


def _conversation(colour: tuple[int, int, int], name: str, k: int) -> list[dict]:
    """A user shows an image; the assistant asks for a crop; the tool returns one; the assistant answers."""
    shown = png(colour, (112, 56), k)
    crop = png(colour, (56, 56), k)
    return [
        {"role": "user", "content": [{"type": "image", "image": shown}, {"type": "text", "text": "Which colour?"}]},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"type": "function", "function": {"name": "crop", "arguments": {"box": [0, 0, 4, 4]}}}],
        },
        {"role": "tool", "content": [{"type": "image_url", "image_url": {"url": _data_url(crop)}}]},
        {"role": "assistant", "content": f"It is {name}."},
    ]


def _data_url(image: bytes) -> str:
    from agentrl.images import data_url

    return data_url(image)


def test_sft_tokenizes_image_conversations_and_learns(tiny_vl, dist_info):
    """Image parts in the prompt and in a tool result become pad runs with the sample's images in order;
    SFT on such demonstrations lowers the loss."""
    from transformers import AutoTokenizer

    from agentrl.learner.sft import _conversation as check_row
    from agentrl.learner.sft import tokenize_conversation
    from agentrl.learner.trainer import Trainer

    tok = AutoTokenizer.from_pretrained(tiny_vl)
    tools = [{"type": "function", "function": {"name": "crop", "parameters": {"type": "object"}}}]
    colours = [((200, 30, 30), "red"), ((30, 200, 30), "green"), ((30, 30, 200), "blue")]
    rows = [_conversation(c, name, k) for k, (c, name) in enumerate(colours)]
    check_row({"messages": rows[0], "tools": tools}, "row")  # the JSONL check takes content parts
    samples = [tokenize_conversation(tok, m, tools) for m in rows]
    trainer = Trainer(_spec(tiny_vl, algorithm="sft", lr=3e-3, max_tokens_per_microbatch=256), dist_info)
    vision = trainer.vision
    assert vision is not None
    first = samples[0]
    assert first.images == [png(colours[0][0], (112, 56), 0), png(colours[0][0], (56, 56), 0)]
    spans = vision.image_spans(first.tokens.tolist())
    assert [e - s for s, e in spans] == [vision.num_tokens(p) for p in first.images] == [8, 4]
    assert not any(first.loss_mask[s - 1 : e + 1].any() for s, e in spans)  # images are context, not trained on
    masked = tok.decode(first.tokens[first.loss_mask.astype(bool)].tolist())
    assert masked.endswith("It is red.<|im_end|>") and "<tool_call>" in masked
    losses = [trainer.sft_step(samples)["sft/nll"] for _ in range(8)]
    assert losses[-1] < 0.7 * losses[0], losses


def test_checkpoint_and_export_keep_the_image_processor(tiny_vl, dist_info, tmp_path):
    from transformers import AutoModelForImageTextToText

    from agentrl.images import VisionProcessor
    from agentrl.learner.checkpoint import save_checkpoint
    from agentrl.learner.export import export_checkpoint
    from agentrl.learner.trainer import Trainer

    trainer = Trainer(_spec(tiny_vl, num_minibatches=1), dist_info)
    trainer.rl_step(image_samples(trainer.vision))
    trained = full_params(trainer.policy)
    ckpt = save_checkpoint(tmp_path / "ckpt", trainer)
    assert VisionProcessor.load(ckpt / "hf") is not None
    out = export_checkpoint(ckpt, tmp_path / "hf")
    exported = VisionProcessor.load(out)
    assert exported is not None and exported.num_tokens(IMAGES[1]) == 12
    assert exported.process(IMAGES)[0].equal(trainer.vision.process(IMAGES)[0])
    model = AutoModelForImageTextToText.from_pretrained(out, dtype=torch.float32)
    state = model.state_dict()
    for name in ("model.visual.blocks.0.attn.qkv.weight", "model.language_model.layers.0.mlp.up_proj.weight"):
        assert torch.equal(state[name], trained[name]), name


# --------------------------------------------------------------------------- FSDP2 over 2 ranks


def test_two_ranks_train_images_as_one_rank_does(tiny_vl, dist_info, tmp_path):
    """FSDP2 (vision blocks sharded as units) over 2 gloo ranks: two GRPO steps on image samples, with
    micro-batches where one rank has images and the other has none, end with the same full weights on
    both ranks, and the same as one rank's."""
    from agentrl.images import VisionProcessor
    from agentrl.learner.batching import plan_microbatches
    from agentrl.learner.model import load_causal_lm

    vision = VisionProcessor.load(tiny_vl)
    samples = image_samples(vision, seed=1)
    half = len(samples) // 2  # the trainer's two optimiser batches
    has_images = [
        [any(part[i].images for i in mb) for mb in rank]
        for part in (samples[:half], samples[half:])
        for rank in plan_microbatches([s.num_tokens for s in part], 64, 2)
    ]
    # the blank image keeps the collectives in step where one rank has images and the other none
    assert any(a != b for a, b in zip(has_images[0] + has_images[2], has_images[1] + has_images[3])), has_images
    cmd = [
        PYTHON, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
        str(Path(__file__).resolve()), str(tmp_path), str(tiny_vl),
    ]  # fmt: skip
    proc = subprocess.run(cmd, env=subprocess_env(), capture_output=True, text=True, timeout=300, cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    rank0, rank1 = (torch.load(tmp_path / f"params-rank{r}.pt", weights_only=True) for r in (0, 1))
    one = run_steps(str(tiny_vl))
    initial = full_params(load_causal_lm(str(tiny_vl)))
    sharded = [n for n in rank0 if ".visual.blocks." in n]
    assert sharded and set(rank0) == set(rank1) == set(one)
    for name in rank0:
        assert torch.equal(rank0[name], rank1[name]), name
        # a key bias's gradient is 0 up to rounding (softmax ignores what adds the same to every key's score):
        # Adam turns that rounding into whole steps, which differ with the reduction order of 1 or 2 ranks
        if not name.endswith("k_proj.bias"):
            assert (rank0[name] - one[name]).abs().max() < 1e-5, name
    assert max((one[n] - initial[n]).abs().max().item() for n in sharded) > 1e-4  # the vision blocks trained


def run_steps(model_path: str) -> dict[str, torch.Tensor]:
    """Two GRPO steps on the image batch in the current process group; every rank's full weights."""
    from agentrl.learner.distributed import init_distributed
    from agentrl.learner.trainer import Trainer

    torch.set_num_threads(1)
    trainer = Trainer(_spec(Path(model_path), lr=1e-3), init_distributed("cpu"))
    assert trainer.vision is not None
    for seed in (1, 2):
        metrics = trainer.rl_step(image_samples(trainer.vision, seed=seed))
        assert metrics["skipped_updates"] == 0
    return full_params(trainer.policy)


if __name__ == "__main__":  # the torchrun worker
    import torch.distributed as dist

    from agentrl.learner.distributed import shutdown_distributed

    params = run_steps(sys.argv[2])
    torch.save(params, Path(sys.argv[1]) / f"params-rank{dist.get_rank()}.pt")
    shutdown_distributed()

"""LoRA in the learner (``[learner.lora]``): only adapters train, the KL reference is the base
with adapters off, the merged push and both exports are what peft and transformers compute,
checkpoints hold the adapters and resume exactly."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from agentrl.learner.lora import LoraSpec
from agentrl.learner.loss import PolicyLossConfig
from tests._learner_helpers import fixed_samples, sample_logprobs, tiny_model  # noqa: F401

SPEC = LoraSpec(rank=4, alpha=8.0)


@pytest.fixture(scope="module")
def dist_info():
    from agentrl.learner.distributed import init_distributed

    torch.set_num_threads(1)
    return init_distributed("cpu")


def _trainer(path, dist_info, lora: LoraSpec | None = SPEC, **kw):
    from agentrl.learner.trainer import Trainer, TrainerSpec

    base = dict(model_path=str(path), lr=2e-2, max_tokens_per_microbatch=96, temperature=1.0, lora=lora)
    base.update(kw)
    return Trainer(TrainerSpec(**base), dist_info)


def _local(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def _params(trainer) -> dict[str, torch.Tensor]:
    return {n: _local(p) for n, p in trainer.policy.named_parameters()}


def _peft_model(base_path, trainer):
    """peft's own model with the trainer's adapter values: the reference for merges and exports."""
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

    from agentrl.learner.lora import adapter_parameters, peft_name

    model = get_peft_model(
        AutoModelForCausalLM.from_pretrained(base_path, dtype=torch.float32), SPEC.peft_config(str(base_path))
    )
    theirs = dict(model.named_parameters())
    with torch.no_grad():
        for name, p in adapter_parameters(trainer.policy):
            theirs[peft_name(name).replace(".weight", ".default.weight")].copy_(_local(p))
    return model.eval()


def _logprobs(model, samples) -> list[torch.Tensor]:
    out = []
    with torch.no_grad():
        for s in samples:
            ids = torch.from_numpy(s.tokens.astype(np.int64))[None]
            lp = torch.log_softmax(model(input_ids=ids).logits[0].float(), -1)[:-1]
            out.append(lp.gather(-1, ids[0, 1:, None]).squeeze(-1))
    return out


def test_only_the_adapters_train_and_have_optimizer_state(tiny_model, dist_info):
    trainer = _trainer(tiny_model, dist_info)
    trainable = {n for n, p in trainer.policy.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    assert {n.split(".lora_")[0] for n in trainable} == {
        f"model.layers.{i}.{m}"
        for i in range(4)
        for m in (
            "self_attn.q_proj",
            "self_attn.k_proj",
            "self_attn.v_proj",
            "self_attn.o_proj",
            "mlp.gate_proj",
            "mlp.up_proj",
            "mlp.down_proj",
        )
    }
    before = _params(trainer)
    metrics = trainer.rl_step(fixed_samples(0))
    after = _params(trainer)
    assert np.isfinite(metrics["loss/total"]) and metrics["grad_norm"] > 0
    changed = {n for n in before if not torch.equal(before[n], after[n])}
    assert changed and changed <= trainable  # the base did not move
    assert any(".lora_B." in n for n in changed)  # B starts at 0 and moved
    optimizer_params = {id(p) for group in trainer.optimizer.param_groups for p in group["params"]}
    assert optimizer_params == {id(p) for p in trainer.policy.parameters() if p.requires_grad}
    assert len(trainer.optimizer.state) == len(trainable)
    assert all(p.grad is None for p in trainer.policy.parameters() if not p.requires_grad)


def test_the_kl_reference_is_the_base_model_with_adapters_off(tiny_model, dist_info):
    from transformers import AutoModelForCausalLM

    from agentrl.learner.batching import collate
    from agentrl.learner.model import token_logprobs

    trainer = _trainer(tiny_model, dist_info, loss=PolicyLossConfig(kl_coef=0.1))
    assert trainer.reference is None and trainer.uses_reference  # no second copy of the model
    first = trainer.rl_step(fixed_samples(1))
    assert first["policy/kl"] == pytest.approx(0.0, abs=1e-7)  # B = 0: the policy is the base
    trainer.rl_step(fixed_samples(2))
    samples = fixed_samples(3, groups=1)
    mb = collate(samples, pad_token_id=trainer.pad_token_id)
    trainable = [n for n, p in trainer.policy.named_parameters() if p.requires_grad]
    with torch.no_grad():
        reference = trainer.reference_logprobs(mb)
        policy, _ = token_logprobs(trainer.policy, mb)
    assert [n for n, p in trainer.policy.named_parameters() if p.requires_grad] == trainable  # switched back on
    base = _logprobs(AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval(), samples)
    starts = mb.cu_seqlens.tolist()
    mask = mb.loss_mask.bool()
    for j, lp in enumerate(base):
        sl = slice(starts[j], starts[j + 1] - 1)
        assert torch.allclose(reference[sl][mask[sl]], lp[mask[sl]], atol=1e-5)
    assert (policy - reference)[mask].abs().max() > 1e-3  # the adapters did change the policy
    assert trainer.rl_step(fixed_samples(4))["policy/kl"] > 0


def test_the_merged_push_is_peft_merge_under_the_base_names(tiny_model, dist_info):
    import weakref

    from transformers import AutoModelForCausalLM

    from agentrl.learner.lora import MergedWeight
    from agentrl.learner.weight_push import tensors_to_push
    from tests._learner_helpers import iter_full_tensors

    trainer = _trainer(tiny_model, dist_info)
    base_sd = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).state_dict()
    untrained = dict(iter_full_tensors(trainer.policy))
    assert set(untrained) == set(base_sd) - {"lm_head.weight"}  # base names, tied head left out
    assert all(torch.equal(untrained[n], base_sd[n]) for n in untrained)  # B = 0: the base exactly
    trainer.rl_step(fixed_samples(5))
    merged_ref = _peft_model(tiny_model, trainer).merge_and_unload().state_dict()
    bucket = 64 << 10
    largest = max(t.numel() * 4 for _, t in tensors_to_push(trainer.policy))
    alive, peak, changed = [], 0, 0
    for name, tensor in iter_full_tensors(trainer.policy, bucket_bytes=bucket):
        assert torch.allclose(tensor, merged_ref[name], atol=1e-6), name
        changed += not torch.equal(tensor, base_sd[name])
        alive.append((weakref.ref(tensor), tensor.numel() * 4))
        del tensor
        peak = max(peak, sum(n for ref, n in alive if ref() is not None))
    assert changed == 28  # every adapted layer: 7 per decoder layer
    assert peak <= max(bucket, largest)  # one bucket of merged weights at a time, never the model
    assert sum(isinstance(t, MergedWeight) for _, t in tensors_to_push(trainer.policy)) == 28


def test_checkpoint_holds_the_adapters_and_resumes_the_next_step_exactly(tiny_model, dist_info, tmp_path):
    from agentrl.learner.checkpoint import (
        checkpoint_meta,
        dcp_reader,
        latest_checkpoint,
        load_checkpoint,
        save_checkpoint,
    )

    kw = dict(warmup_steps=2, lr_schedule="cosine", total_steps=10, loss=PolicyLossConfig(kl_coef=0.05))
    first = _trainer(tiny_model, dist_info, **kw)
    first.rl_step(fixed_samples(6))
    path = save_checkpoint(tmp_path, first, state={"policy_version": 3})
    keys = set(dcp_reader(path).read_metadata().state_dict_metadata)
    policy_keys = {k for k in keys if k.startswith("policy.")}
    assert policy_keys and all(".lora_A." in k or ".lora_B." in k for k in policy_keys), sorted(policy_keys)[:3]
    assert checkpoint_meta(path)["lora"] == SPEC.as_dict()
    expected = first.rl_step(fixed_samples(7))
    expected_params = _params(first)

    resumed = _trainer(tiny_model, dist_info, **kw)
    assert load_checkpoint(latest_checkpoint(tmp_path), resumed)["policy_version"] == 3
    got = resumed.rl_step(fixed_samples(7))
    assert got["loss/total"] == expected["loss/total"] and got["lr"] == expected["lr"]
    assert all(torch.equal(t, _params(resumed)[n]) for n, t in expected_params.items())

    for other in (None, LoraSpec(rank=8, alpha=8.0)):  # a run set up otherwise is refused by name
        with pytest.raises(ValueError, match="learner.lora"):
            load_checkpoint(path, _trainer(tiny_model, dist_info, lora=other))


def test_export_merged_and_as_a_peft_adapter_give_the_learners_logits(tiny_model, dist_info, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM
    from typer.testing import CliRunner

    from agentrl.cli import app
    from agentrl.learner.checkpoint import save_checkpoint
    from agentrl.learner.export import export_checkpoint

    trainer = _trainer(tiny_model, dist_info)
    trainer.rl_step(fixed_samples(8))
    trainer.rl_step(fixed_samples(9))
    save_checkpoint(tmp_path / "ckpt", trainer)
    samples = fixed_samples(10, groups=1)
    learner = sample_logprobs(trainer, samples)
    base = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    assert max((a - b).abs().max() for a, b in zip(learner, _logprobs(base, samples))) > 1e-3  # it learnt

    merged = export_checkpoint(tmp_path / "ckpt", tmp_path / "merged")
    assert not (merged / "adapter_config.json").exists()
    result = CliRunner().invoke(app, ["export", str(tmp_path / "ckpt"), str(tmp_path / "adapter"), "--adapter"])
    assert result.exit_code == 0, result.output
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert config["r"] == 4 and config["lora_alpha"] == 8.0 and config["peft_type"] == "LORA"

    plain = AutoModelForCausalLM.from_pretrained(merged, dtype=torch.float32).eval()
    adapted = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32), tmp_path / "adapter"
    ).eval()
    for model in (plain, adapted):
        for ours, theirs in zip(learner, _logprobs(model, samples)):
            assert torch.allclose(ours, theirs, atol=1e-5)

    result = CliRunner().invoke(
        app, ["export", str(tmp_path / "ckpt"), str(tmp_path / "x"), "--base-model", str(tmp_path / "nowhere")]
    )
    assert result.exit_code == 2 and "--base-model" in result.output
    full = _trainer(tiny_model, dist_info, lora=None)
    save_checkpoint(tmp_path / "full", full)
    with pytest.raises(ValueError, match="without LoRA"):
        export_checkpoint(tmp_path / "full", tmp_path / "y", adapter=True)


def test_adapters_only_on_linear_layers_and_never_on_a_tied_head(tiny_model):
    from agentrl.learner.lora import add_adapters
    from agentrl.learner.model import load_causal_lm

    with pytest.raises(ValueError, match="embed_tokens"):
        add_adapters(load_causal_lm(str(tiny_model)), LoraSpec(rank=2, target_modules=("embed_tokens",)))
    with pytest.raises(ValueError, match="tied"):
        add_adapters(load_causal_lm(str(tiny_model)), LoraSpec(rank=2, target_modules=("lm_head",)))
    with pytest.raises(ValueError, match="learner.lora.target_modules"):
        add_adapters(load_causal_lm(str(tiny_model)), LoraSpec(rank=2, target_modules=("no_such_proj",)))


def test_config_section():
    from agentrl.config import ConfigError, load_config

    cfg = load_config(None, ["learner.lora.rank=8", "learner.lora.alpha=32", 'learner.lora.target_modules=["q_proj"]'])
    spec = LoraSpec.from_config(cfg.learner.lora)
    assert spec == LoraSpec(rank=8, alpha=32.0, target_modules=("q_proj",)) and spec.scaling == 4.0
    assert LoraSpec.from_config(load_config().learner.lora) is None  # rank 0: off
    assert cfg.learner.lora.served_adapter == ""  # merged pushes name no adapter
    assert load_config(None, ["learner.lora.rank=8", "learner.lora.sync=adapter"]).learner.lora.served_adapter
    for bad, needle in (
        (["learner.lora.sync=adapter"], "rank > 0"),
        (["learner.lora.rnk=4"], "learner.lora.rnk"),
        (["learner.lora.rank=-1"], "learner.lora.rank"),
        (["learner.lora.rank=4", "learner.lora.target_modules=[]"], "target_modules"),
    ):
        with pytest.raises(ConfigError, match=needle):
            load_config(None, bad)


def test_learn_loop_pushes_merged_weights_or_the_adapter_alone(tiny_model, tmp_path):
    """``agentrl learn``'s loop with [learner.lora]: merged full weights under the base names by
    default; with ``sync = "adapter"`` a PEFT folder per version, loaded at start (the engines do not
    hold the adapter the actors' requests name) and after every step."""
    from agentrl.config import load_config
    from agentrl.learner.distributed import init_distributed
    from agentrl.learner.loop import Learner, LearnerIO
    from tests._learner_helpers import ListSource, Recorder, make_group

    class AdapterRecorder(Recorder):
        def __init__(self) -> None:
            super().__init__()
            self.adapters: list[tuple[int, list[str]]] = []

        def push_adapter(self, folder, version: int) -> dict:
            self.adapters.append((version, sorted(p.name for p in folder.iterdir())))
            return {}

    init_distributed("cpu")
    rng = np.random.default_rng(1)
    for sync in ("merged", "adapter"):
        rec = AdapterRecorder()
        cfg = load_config(
            None,
            [
                f'model.path="{tiny_model}"',
                f'run.run_dir="{tmp_path / sync}"',
                "learner.groups_per_step=2",
                "learner.max_tokens_per_microbatch=128",
                "learner.max_steps=1",
                'learner.device="cpu"',
                "tracking.enabled=false",
                "actors.group_size=4",
                "learner.lora.rank=4",
                f"learner.lora.sync={sync}",
            ],
        )
        groups = [make_group(rng, group_id=f"{sync}{i}") for i in range(2)]
        learner = Learner(cfg, io=LearnerIO(source=ListSource(groups), progress=rec, weights=rec))
        assert learner.run() == "done"
        if sync == "merged":
            assert [v for v, _ in rec.pushes] == [1] and not rec.adapters
            names = rec.pushes[0][1]
            assert "model.layers.0.mlp.up_proj.weight" in names
            assert not [n for n in names if "lora_" in n or "base_layer" in n]
        else:
            assert not rec.pushes
            assert rec.adapters == [(v, ["adapter_config.json", "adapter_model.safetensors"]) for v in (0, 1)]
            assert sorted(p.name for p in (tmp_path / sync / "lora_adapters").iterdir()) == ["v00000000", "v00000001"]


def test_activation_checkpointing_with_adapters_replays_and_matches(tiny_model, dist_info):
    results = {}
    for ac in (False, True):
        trainer = _trainer(tiny_model, dist_info, activation_checkpointing=ac)
        calls = []
        trainer.policy.model.layers[0].self_attn.q_proj.base_layer.register_forward_hook(lambda *a: calls.append(1))
        metrics = trainer.rl_step(fixed_samples(11, groups=2))
        results[ac] = (metrics["loss/total"], metrics["grad_norm"], len(calls))
    assert results[True][2] == 2 * results[False][2]  # replayed in the backward (the base frozen, no input grads)
    assert results[True][:2] == pytest.approx(results[False][:2], rel=1e-6)


def test_a_peft_folder_is_read_only_when_it_is_a_plain_lora(tmp_path):
    """The embedded engine reads folders named in /load_lora_adapter: what is not a LoRA of linear
    layers that compose is refused by name, before anything touches the weights."""
    from safetensors.torch import save_file

    from agentrl.peft_format import read_adapter

    def folder(name: str, tensors: dict, **config) -> str:
        path = tmp_path / name
        path.mkdir()
        (path / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 2, "lora_alpha": 4, **config}))
        if tensors is not None:
            save_file(tensors, str(path / "adapter_model.safetensors"))
        return str(path)

    layer = "base_model.model.model.layers.0.self_attn.q_proj"
    a, b = torch.ones(2, 8), torch.ones(16, 2)
    good = read_adapter(folder("good", {f"{layer}.lora_A.weight": a, f"{layer}.lora_B.weight": b}))
    assert good.scaling == 2.0 and list(good.factors) == ["model.layers.0.self_attn.q_proj"]
    assert read_adapter(
        folder("rs", {f"{layer}.lora_A.weight": a, f"{layer}.lora_B.weight": b}, use_rslora=True)
    ).scaling == pytest.approx(4 / 2**0.5)
    bad = [
        (folder("nofile", None), "adapter_model.safetensors"),
        (folder("half", {f"{layer}.lora_A.weight": a}), "lacks lora_B"),
        (folder("shape", {f"{layer}.lora_A.weight": a, f"{layer}.lora_B.weight": torch.ones(16, 3)}), "do not compose"),
        (folder("embed", {"base_model.model.model.embed_tokens.lora_embedding_A": a}), "unexpected tensor"),
        (folder("prefix", {"model.layers.0.self_attn.q_proj.lora_A.weight": a}), "unexpected tensor"),
        (folder("dora", {}, use_dora=True), "use_dora"),
        (folder("rank", {}, r=0), "positive integer"),
        (folder("ia3", {}, peft_type="IA3"), "only LoRA"),
        (folder("pattern", {}, rank_pattern={"q_proj": 4}), "rank_pattern"),
        (str(tmp_path / "missing"), "adapter_config.json"),
    ]
    for path, needle in bad:
        with pytest.raises(ValueError, match=needle):
            read_adapter(path)

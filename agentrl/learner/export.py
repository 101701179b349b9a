"""``agentrl export CHECKPOINT OUT_DIR``: a checkpoint as a Hugging Face model folder.

The output is what ``AutoModelForCausalLM.from_pretrained`` and an SGLang server load:
``model.safetensors`` (the policy's weights, full tensors), ``config.json``,
``generation_config.json`` and the tokenizer files with the chat template, all taken from
the checkpoint's ``hf/`` copy of the original model folder.

DCP reads the sharded checkpoint into a plain single-process model, whatever world size
wrote it, so exporting needs neither torchrun nor the training machine.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from agentrl.learner.checkpoint import latest_checkpoint


def resolve_checkpoint(path: str | Path) -> Path:
    """Accept a checkpoint folder, a checkpoint root (with ``latest``), or a run folder."""
    p = Path(path)
    if (p / ".metadata").exists():
        return p
    for root in (p, p / "checkpoints" / "learn", p / "checkpoints" / "sft"):
        found = latest_checkpoint(root)
        if found is not None:
            return found
    raise ValueError(f"no checkpoint at {p}: expected a step_* folder, a checkpoint root with 'latest', or a run folder")


def export_checkpoint(checkpoint: str | Path, out_dir: str | Path, *, dtype: str = "float32") -> Path:
    """Write the checkpoint's policy to ``out_dir`` as a Hugging Face folder; returns it."""
    import torch
    import torch.distributed.checkpoint as dcp
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    ckpt = resolve_checkpoint(checkpoint)
    hf = ckpt / "hf"
    if not (hf / "config.json").exists():
        raise ValueError(f"{ckpt} has no hf/config.json; it was not written by agentrl's learner")
    if dtype not in ("float32", "bfloat16", "float16"):
        raise ValueError(f"dtype must be float32, bfloat16 or float16, got {dtype!r}")
    config = AutoConfig.from_pretrained(hf)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    state = {"policy": model.state_dict()}
    dcp.load(state, checkpoint_id=str(ckpt))
    model.load_state_dict(state["policy"])
    model = model.to(getattr(torch, dtype))
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    AutoTokenizer.from_pretrained(hf).save_pretrained(out)
    if (hf / "generation_config.json").exists():
        shutil.copy2(hf / "generation_config.json", out / "generation_config.json")
    return out

"""``agentrl export CHECKPOINT OUT_DIR``: a checkpoint as a Hugging Face model folder.

The output is what ``AutoModelForCausalLM.from_pretrained`` (a vision-language model:
``AutoModelForImageTextToText``) and an SGLang server load: the policy's full weights as
``model.safetensors`` plus the config, generation config, tokenizer and image-processor files
(``PROCESSOR_FILES``) from the checkpoint's ``hf/`` copy. Any world size's checkpoint is read in one process.
A LoRA checkpoint is merged into its base model by default (the same merge the weight push
sends), or written as a PEFT adapter folder with ``adapter=True``. See docs/learner.md.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

from torch.distributed.checkpoint.state_dict_loader import load as dcp_load

from agentrl.learner.checkpoint import dcp_reader, latest_checkpoint

# What a processor saves besides the tokenizer (AutoProcessor / AutoImageProcessor.save_pretrained), copied as is:
# the image processor's settings that agentrl.images.VisionProcessor loads, and the chat template.
PROCESSOR_FILES = (
    "preprocessor_config.json",
    "video_preprocessor_config.json",
    "processor_config.json",
    "chat_template.jinja",
    "chat_template.json",
)


def resolve_checkpoint(path: str | Path) -> Path:
    """Accept a checkpoint folder, a checkpoint root (with ``latest``), or a run folder."""
    p = Path(path)
    if (p / ".metadata").exists():
        return p
    for root in (p, p / "checkpoints" / "learn", p / "checkpoints" / "sft"):
        found = latest_checkpoint(root)
        if found is not None:
            return found
    raise ValueError(
        f"no checkpoint at {p}: expected a step_* folder, a checkpoint root with 'latest', or a run folder"
    )


def export_checkpoint(
    checkpoint: str | Path,
    out_dir: str | Path,
    *,
    dtype: str = "float32",
    adapter: bool = False,
    base_model: str | Path | None = None,
) -> Path:
    """Write the checkpoint's policy to ``out_dir`` as a Hugging Face folder (a LoRA checkpoint:
    merged, or with ``adapter`` as a PEFT adapter folder); returns it."""
    import torch
    from transformers import AutoConfig, AutoTokenizer

    from agentrl.learner.checkpoint import checkpoint_meta
    from agentrl.learner.model import auto_model_class

    ckpt = resolve_checkpoint(checkpoint)
    hf = ckpt / "hf"
    if not (hf / "config.json").exists():
        raise ValueError(f"{ckpt} has no hf/config.json; it was not written by agentrl's learner")
    if dtype not in ("float32", "bfloat16", "float16"):
        raise ValueError(f"dtype must be float32, bfloat16 or float16, got {dtype!r}")
    meta = checkpoint_meta(ckpt) or {}
    out = Path(out_dir)
    if meta.get("lora"):
        model = _merged_or_adapter(ckpt, meta, out, adapter=adapter, base_model=base_model)
        if model is None:
            return out
    else:
        if adapter:
            raise ValueError(f"{ckpt} was trained without LoRA (learner.lora.rank = 0): it has no adapter to export")
        config = AutoConfig.from_pretrained(hf)
        model = auto_model_class(config).from_config(config, dtype=torch.float32)
        state = {"policy": model.state_dict()}
        dcp_load(state, storage_reader=dcp_reader(ckpt))
        model.load_state_dict(state["policy"])
    model = model.to(getattr(torch, dtype))
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    AutoTokenizer.from_pretrained(hf).save_pretrained(out)
    for name in ("generation_config.json", *PROCESSOR_FILES):
        if (hf / name).exists():
            shutil.copy2(hf / name, out / name)
    return out


def _merged_or_adapter(ckpt: Path, meta: dict, out: Path, *, adapter: bool, base_model: str | Path | None) -> Any:
    """A LoRA checkpoint: the base model with the checkpoint's adapters; returns the merged plain
    model, or writes the PEFT folder to ``out`` and returns None."""
    import torch
    from transformers import AutoConfig

    from agentrl.learner.lora import LoraSpec, MergedWeight, adapter_parameters, add_adapters, push_items, write_adapter

    base = Path(base_model or meta.get("model_path", ""))
    if not (base / "config.json").exists():
        raise ValueError(
            f"{ckpt} holds LoRA adapters; their base model {str(base)!r} (meta.json model_path) has no "
            "config.json here: pass the base model's folder (--base-model)"
        )
    from agentrl.learner.model import auto_model_class

    spec = LoraSpec(**{**meta["lora"], "target_modules": tuple(meta["lora"]["target_modules"])})
    cls = auto_model_class(AutoConfig.from_pretrained(base))
    model = add_adapters(cls.from_pretrained(base, dtype=torch.float32), spec)
    state = {"policy": {n: p.detach() for n, p in adapter_parameters(model)}}
    dcp_load(state, storage_reader=dcp_reader(ckpt))
    with torch.no_grad():
        for name, param in adapter_parameters(model):
            param.copy_(state["policy"][name])
    if adapter:
        write_adapter(out, dict(adapter_parameters(model)), spec, str(base))
        return None
    merged = {n: (t.merged() if isinstance(t, MergedWeight) else t.detach()) for n, t in push_items(model)}
    plain = cls.from_pretrained(base, dtype=torch.float32)
    missing, unexpected = plain.load_state_dict(merged, strict=False)
    if unexpected or set(missing) - {"lm_head.weight"}:
        raise ValueError(f"merging {ckpt}'s adapters: unexpected {unexpected[:5]}, missing {missing[:5]}")
    return plain

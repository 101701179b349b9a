"""PEFT's LoRA adapter folder: what the learner writes and the embedded engine loads.

``adapter_config.json`` (peft's ``LoraConfig``) and ``adapter_model.safetensors`` with
``base_model.model.<layer>.lora_A.weight`` ``[r, in]`` and ``...lora_B.weight`` ``[out, r]`` per
adapted linear layer; the layer's output gains ``scaling * B @ A @ x`` with ``scaling = lora_alpha
/ r`` (``/ sqrt(r)`` with ``use_rslora``), as ``PeftModel.save_pretrained`` writes and SGLang loads.
No torch at import. See docs/learner.md.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

PEFT_PREFIX = "base_model.model."  # what PeftModel puts before the base model's parameter names
ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"


@dataclass
class AdapterFiles:
    """A PEFT adapter folder as the embedded engine reads it: the factors per adapted layer
    (base model names of the layer), with alpha / rank."""

    folder: Path
    scaling: float
    rank: int
    factors: dict[str, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)  # layer -> (A, B)


def read_adapter(folder: str | Path) -> AdapterFiles:
    """Read a PEFT LoRA folder; ValueError names what is missing or not supported."""
    from safetensors.torch import load_file

    folder = Path(folder)
    config_file = folder / ADAPTER_CONFIG
    if not config_file.is_file():
        raise ValueError(f"{folder} has no {ADAPTER_CONFIG}")
    try:
        config = json.loads(config_file.read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"{config_file} is not a JSON file: {e}") from None
    if not isinstance(config, dict) or config.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"{config_file}: only LoRA adapters are supported (peft_type {config.get('peft_type')!r})")
    rank, alpha = config.get("r"), config.get("lora_alpha")
    if not (isinstance(rank, int) and rank > 0 and isinstance(alpha, (int, float))):
        raise ValueError(f"{config_file}: r must be a positive integer and lora_alpha a number")
    for key in ("use_dora", "fan_in_fan_out"):
        if config.get(key):
            raise ValueError(f"{config_file}: {key} is not supported")
    if config.get("rank_pattern") or config.get("alpha_pattern"):
        raise ValueError(f"{config_file}: per-layer rank_pattern / alpha_pattern are not supported")
    scaling = alpha / (rank**0.5) if config.get("use_rslora") else alpha / rank
    weights = folder / ADAPTER_WEIGHTS
    if not weights.is_file():
        raise ValueError(f"{folder} has no {ADAPTER_WEIGHTS}")
    files = AdapterFiles(folder, float(scaling), rank)
    pairs: dict[str, dict[str, Any]] = {}
    for name, tensor in load_file(str(weights)).items():
        if not name.startswith(PEFT_PREFIX) or not name.endswith(".weight"):
            raise ValueError(f"{weights}: unexpected tensor {name!r}")
        stem = name[len(PEFT_PREFIX) : -len(".weight")]
        layer, _, kind = stem.rpartition(".")
        if kind not in ("lora_A", "lora_B"):
            raise ValueError(f"{weights}: unexpected tensor {name!r} (only lora_A / lora_B of linear layers)")
        pairs.setdefault(layer, {})[kind] = tensor
    for layer, pair in pairs.items():
        if set(pair) != {"lora_A", "lora_B"}:
            raise ValueError(f"{weights}: {layer} lacks {({'lora_A', 'lora_B'} - set(pair)).pop()}")
        a, b = pair["lora_A"], pair["lora_B"]
        if a.dim() != 2 or b.dim() != 2 or a.shape[0] != b.shape[1]:
            raise ValueError(f"{weights}: {layer}: lora_A {list(a.shape)} and lora_B {list(b.shape)} do not compose")
        files.factors[layer] = (a, b)
    if not files.factors:
        raise ValueError(f"{weights} holds no adapter")
    return files

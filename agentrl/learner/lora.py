"""LoRA in the learner: adapters on a frozen base, merged on the fly for the engines.

:func:`add_adapters` injects peft's LoRA layers (linear layers only) before FSDP2 shards the
model and freezes everything else, so only the adapters have gradients and AdamW state. The KL
reference is the policy with its adapters switched off (:func:`adapters_disabled`), not a copy.

Names: inside the learner an adapted layer's weight is ``...q_proj.base_layer.weight``; engines get
the base model's names with the adapter merged (:func:`push_items`); PEFT folders get PEFT's names
(:func:`peft_name`). A :class:`MergedWeight` (base, A, B, scaling) stands for ``W + scaling * B @ A``
and is materialised only when its push bucket is gathered, so rank 0 never holds more than one
bucket of merged weights. See docs/learner.md.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from agentrl.peft_format import ADAPTER_CONFIG, ADAPTER_WEIGHTS, PEFT_PREFIX

if TYPE_CHECKING:
    import torch
    from peft.tuners.lora import LoraLayer
    from torch import nn

ADAPTER = "default"  # peft's adapter name inside the learner (one adapter)
INIT_SEED = 0  # the adapters' initial A, the same on every rank and in every run


@dataclass(frozen=True)
class LoraSpec:
    """What ``[learner.lora]`` asks for (``rank`` > 0)."""

    rank: int
    alpha: float = 16.0
    dropout: float = 0.0
    target_modules: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")

    @classmethod
    def from_config(cls, lora: Any) -> LoraSpec | None:
        """From a ``[learner.lora]`` section; None when ``rank`` is 0 (LoRA off)."""
        if lora.rank == 0:
            return None
        return cls(rank=lora.rank, alpha=lora.alpha, dropout=lora.dropout, target_modules=tuple(lora.target_modules))

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "target_modules": list(self.target_modules)}

    def peft_config(self, base_model_path: str = "") -> Any:
        from peft import LoraConfig

        return LoraConfig(
            r=self.rank,
            lora_alpha=self.alpha,  # pyright: ignore[reportArgumentType]  # peft says int; alpha / r takes any number
            lora_dropout=self.dropout,
            target_modules=list(self.target_modules),
            bias="none",
            task_type="CAUSAL_LM",
            base_model_name_or_path=base_model_path or None,
        )


def add_adapters(model: nn.Module, spec: LoraSpec) -> nn.Module:
    """Inject LoRA adapters (peft) into ``model`` in place and freeze everything else; returns it.

    The adapters start as peft initialises them (A random, B = 0): the adapted model computes
    exactly what the base model computes until the first update. A is drawn from a fixed seed
    (``INIT_SEED``) in a forked RNG, so every rank and every run starts from the same adapters
    whatever its RNG state (FSDP2 shards each rank's own values; it broadcasts nothing). Call it
    on the CPU model, before moving it to its device."""
    import torch
    from peft import inject_adapter_in_model

    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(INIT_SEED)
            model = inject_adapter_in_model(spec.peft_config(), model, adapter_name=ADAPTER)
    except ValueError as e:  # peft: "Target modules {...} not found in the base model"
        raise ValueError(f"learner.lora.target_modules {list(spec.target_modules)}: {e}") from None
    for name, module in lora_layers(model):
        if (
            type(module).__name__ != "Linear"
            or getattr(module, "fan_in_fan_out", False)
            or getattr(module, "use_dora", {}).get(ADAPTER, False)
        ):
            raise ValueError(
                f"learner.lora.target_modules selects {name} ({type(module).__module__}."
                f"{type(module).__name__}): only plain nn.Linear layers can get adapters here"
            )
    get_head = getattr(model, "get_output_embeddings", None)
    head = get_head() if get_head is not None else None
    tied = bool(getattr(getattr(model, "config", None), "tie_word_embeddings", False))
    if tied and any(m is head for _, m in lora_layers(model)):
        raise ValueError(
            "learner.lora.target_modules adapts the LM head, which is tied to the input embeddings: "
            "the engines tie it again and would drop the adapter; leave it out"
        )
    for name, param in model.named_parameters():
        param.requires_grad_(".lora_A." in name or ".lora_B." in name)
    return model


def lora_layers(model: nn.Module) -> list[tuple[str, LoraLayer]]:
    """``(module name, peft LoRA layer)`` of every adapted layer, in module order."""
    from peft.tuners.lora import LoraLayer

    return [(name, m) for name, m in model.named_modules() if isinstance(m, LoraLayer)]


def has_adapters(model: nn.Module) -> bool:
    """Whether ``model`` carries LoRA factors (by name: no peft import for models without them)."""
    return any(".lora_A." in name for name, _ in model.named_parameters())


@contextmanager
def adapters_disabled(model: nn.Module) -> Iterator[None]:
    """The base model: every adapter switched off inside the block (peft's own switch, as
    ``PeftModel.disable_adapter`` uses it), then on again with the same trainable parameters."""
    layers = [m for _, m in lora_layers(model)]
    trainable = [p for p in model.parameters() if p.requires_grad]
    for m in layers:
        m.enable_adapters(False)
    try:
        yield
    finally:
        for m in layers:
            m.enable_adapters(True)
        for p in trainable:  # enable_adapters(True) re-marks the active adapter trainable; make it exact
            p.requires_grad_(True)


# ------------------------------------------------------------------------------ names


def base_name(name: str) -> str:
    """The base model's name of a learner parameter (``q_proj.base_layer.weight`` -> ``q_proj.weight``)."""
    return name.replace(".base_layer.", ".")


def peft_name(name: str) -> str:
    """PEFT's saved name of an adapter factor (``...lora_A.default.weight`` ->
    ``base_model.model....lora_A.weight``)."""
    return PEFT_PREFIX + name.replace(f".{ADAPTER}.", ".")


def adapter_parameters(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """The adapters' factors under their learner names, in a fixed order (the same on every rank)."""
    return [(n, p) for n, p in model.named_parameters() if ".lora_A." in n or ".lora_B." in n]


# ------------------------------------------------------------------------------ merging


@dataclass
class MergedWeight:
    """Stands for ``base + scaling * B @ A`` of one adapted layer in the weight push's plan: it has
    the base weight's shape, dtype and size, and is computed only when its bucket is gathered."""

    base: Any  # the base layer's weight (a DTensor under FSDP2)
    lora_a: Any  # [rank, in]
    lora_b: Any  # [out, rank]
    scaling: float

    @property
    def shape(self) -> torch.Size:
        return self.base.shape

    @property
    def dtype(self) -> torch.dtype:
        return self.base.dtype

    def numel(self) -> int:
        return self.base.numel()

    def merged(self) -> torch.Tensor:
        """The full merged tensor in the base weight's dtype (gathers: every rank must call it)."""
        import torch

        base, a, b = (_full(t) for t in (self.base, self.lora_a, self.lora_b))
        with torch.no_grad():
            delta = (b.float() @ a.float()) * self.scaling
            return (base.float() + delta).to(base.dtype)


def _full(t: Any) -> torch.Tensor:
    import torch
    from torch.distributed.tensor import DTensor

    data = t.data if isinstance(t, torch.nn.Parameter) else t
    return (data.full_tensor() if isinstance(data, DTensor) else data).detach()


def push_items(model: nn.Module) -> list[tuple[str, Any]]:
    """What the engines get from an adapted model, under the base model's names, in
    ``named_parameters()`` order: an adapted layer's weight as a :class:`MergedWeight`, every
    other base parameter as it is; the adapters' factors are folded in, never sent."""
    merged: dict[str, MergedWeight] = {}
    for name, layer in lora_layers(model):
        merged[f"{name}.base_layer.weight"] = MergedWeight(
            layer.base_layer.weight,
            layer.lora_A[ADAPTER].weight,
            layer.lora_B[ADAPTER].weight,
            float(layer.scaling[ADAPTER]),
        )
    out: list[tuple[str, Any]] = []
    for name, param in model.named_parameters():
        if ".lora_A." in name or ".lora_B." in name:
            continue
        out.append((base_name(name), merged.get(name, param)))
    return out


# ------------------------------------------------------------------------------ PEFT folders


def write_adapter(
    folder: str | Path, tensors: dict[str, torch.Tensor], spec: LoraSpec, base_model_path: str = ""
) -> Path:
    """A PEFT adapter folder (``adapter_config.json`` + ``adapter_model.safetensors``) from the
    full factors under their learner names; what ``PeftModel.from_pretrained`` and SGLang's
    ``/load_lora_adapter`` read. The weights file is written first and renamed into place, the
    config last, so a reader that sees the config sees complete weights."""
    import os

    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tmp = folder / (ADAPTER_WEIGHTS + ".tmp")
    save_file({peft_name(n): t.detach().contiguous().cpu() for n, t in tensors.items()}, str(tmp))
    os.replace(tmp, folder / ADAPTER_WEIGHTS)
    config = spec.peft_config(base_model_path).to_dict()
    config = {k: (sorted(v) if isinstance(v, set) else v) for k, v in config.items()}
    (folder / (ADAPTER_CONFIG + ".tmp")).write_text(json.dumps(config, indent=2, default=str))
    os.replace(folder / (ADAPTER_CONFIG + ".tmp"), folder / ADAPTER_CONFIG)
    return folder

"""Low-rank adapters (LoRA, Hu et al. 2021, arXiv 2106.09685) on an AR model's linear layers, through `peft`.

Fine-tuning with `--lora-rank R` freezes the model and trains a rank-R update of each attention and
feed-forward projection (`scale = alpha / R`). A run's checkpoints hold the frozen weights and the adapters
(`meta["lora"]` says how to rebuild them, so training resumes exactly); loading one for use merges the
adapters into the weights, so every decoder sees a plain Transformer.
"""

from __future__ import annotations

from torch import nn

from diffar.errors import DiffarError

TARGETS = ["qkv", "proj", "gate_up", "down"]  # every linear layer of a block (models/transformer.py)


def _peft():
    try:
        import peft
    except ImportError as e:
        raise DiffarError("LoRA needs the peft package: pip install peft") from e
    return peft


def add_lora(model: nn.Module, rank: int, alpha: float) -> nn.Module:
    """`model` with fresh adapters (B = 0: it computes what it did) on every block's linear layers; only the
    adapters train."""
    if rank <= 0 or alpha <= 0:
        raise DiffarError(f"LoRA rank and alpha must be positive, got rank {rank}, alpha {alpha}")
    peft = _peft()
    config = peft.LoraConfig(r=rank, lora_alpha=alpha, lora_dropout=0.0, target_modules=TARGETS)
    return peft.inject_adapter_in_model(config, model)


def merge_lora(model: nn.Module) -> nn.Module:
    """Fold every adapter into the weight it adapts and put the plain layer back in its place."""
    peft = _peft()
    for name, module in list(model.named_modules()):
        if isinstance(module, peft.tuners.lora.LoraLayer):
            module.merge()
            parent_name, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent_name), child, module.get_base_layer())
    for p in model.parameters():
        p.requires_grad_(True)
    return model

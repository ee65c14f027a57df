"""Where and how a loaded model runs: at fp32, bf16, fp16, or int8 (weight-only int8 linear layers with bf16
activations, CPU only), on the CPU or a CUDA device, with its decoding step compiled or not. Decoders follow the
model: every tensor they make is created on the device of the model's weights (`model_device`)."""

from __future__ import annotations

import torch
from torch import nn

from diffar.errors import DiffarError
from diffar.models.int8_linear import int8_linears
from diffar.models.packed_linear import can_pack, pack_linears

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
PRECISIONS = (*DTYPES, "int8")
DEVICES = ("cpu", "cuda")


def resolve_device(name: str) -> torch.device:
    """`cpu` or `cuda[:i]`, with a one-line error when this machine has no CUDA device."""
    if not isinstance(name, str) or name.split(":")[0] not in DEVICES:
        raise DiffarError(f"unknown device {name!r}; choose one of {', '.join(DEVICES)}")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise DiffarError(f"--device {name}: this machine has no CUDA device "
                          f"(torch {torch.__version__} sees none); use --device cpu")
    return torch.device(name)


def model_device(model: nn.Module) -> torch.device:
    """The device of a model's weights (a parameter or, for a fully quantised model, a buffer)."""
    for tensor in (*model.parameters(), *model.buffers()):
        return tensor.device
    return torch.device("cpu")


def place(model: nn.Module, dtype: str = "fp32", device: str = "cpu") -> nn.Module:
    """`model` in eval mode at the precision named `dtype` (PRECISIONS) on `device`."""
    if dtype not in PRECISIONS:
        raise DiffarError(f"unknown dtype {dtype!r}; choose one of {', '.join(PRECISIONS)}")
    target = resolve_device(device)
    if dtype == "int8":
        if target.type != "cpu":
            raise DiffarError("--dtype int8 (weight-only int8 kernels) runs on the CPU only; use bf16 on CUDA")
        return int8_linears(model.to(target, torch.bfloat16).eval())
    model = model.to(target, DTYPES[dtype]).eval()
    # CPU fp32 and bf16 linear layers get prepacked oneDNN products (models/packed_linear.py): in bf16 ~2x faster
    # decoding steps, in fp32 1.3-1.6x at batch 1 and 1.3x at batch 8 on an AMD EPYC (docs/benchmarks.md)
    return pack_linears(model)


def draft_dtype(dtype: str, device: str = "cpu") -> str:
    """The precision a drafter runs at beside a target placed at `dtype` on `device`: bf16 where bf16 products
    are fast (CUDA, or a CPU with oneDNN bf16) or the target is int8, else the target's own. A draft's precision
    never changes the verified text, only how much of it is accepted, and bf16 halves what a draft pass reads
    (a 7M target's fp32 drafter: a draft 2.5 -> 1.9 ms, docs/benchmarks.md)."""
    if dtype in ("bf16", "fp16"):
        return dtype
    fast = resolve_device(device).type == "cuda" or can_pack(torch.zeros(1, dtype=torch.bfloat16))
    return "bf16" if fast or dtype == "int8" else dtype


def compile_decode(model: nn.Module) -> None:
    """Compile an AR model's cached decoding passes with torch.compile, in place: the one-token step
    (`Transformer.decode`) and the multi-token pass that draft-and-verify decoders run over a prompt and over
    each block they verify (`Transformer.extend`).

    Shapes are dynamic, so one graph serves every slot and block length; the weights are frozen into the graph
    as constants, so that inductor lays them out once for its matrix kernels. Each batch size gets its own graphs
    (the packed layouts are made for it) and its own KV caches, which a graph is bound to: they grow by doubling
    from 256 slots, each size a graph. `max-autotune` times inductor's own matrix kernels against
    aten's per shape and keeps the faster: on the CPU its AMX kernels run the int8 and bf16 products at batch
    8 ~2x faster than aten's. Not CUDA graphs: the cache length changes every step. The first step of each
    batch size compiles: about a minute on a 2-core CPU (measured on SmolLM2-135M: docs/benchmarks.md).

    Freezing is set in inductor's global config: passed in `options` it did not reach the weight packing (a
    batch-8 fp32 step took 65 ms, against 40 ms frozen and 70 ms eager)."""
    model.kv_pool = {}  # the caches a graph was traced with stay its own (Transformer.setup_cache)
    model.decode = _compiled(model.decode)
    model.extend = _compiled(model.extend)


def compile_draft(drafter: nn.Module) -> None:
    """Compile a block drafter's pass (`BlockDrafter.draft_hidden`) as `compile_decode` compiles its target's."""
    drafter.draft_hidden = _compiled(drafter.draft_hidden)


def _compiled(fn):
    import torch._dynamo.config as dynamo
    import torch._inductor.config as inductor

    inductor.freezing = True
    inductor.autotune_num_choices_displayed = 0  # no autotuning tables on stderr
    inductor.max_autotune_report_choices_stats = False  # nor its statistics
    dynamo.recompile_limit = max(dynamo.recompile_limit, 64)  # a graph per batch size and cache (not 8, then eager)
    return torch.compile(fn, dynamic=True, mode="max-autotune-no-cudagraphs")

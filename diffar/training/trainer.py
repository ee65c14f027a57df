"""A model-agnostic trainer: any `Trainable` module, whose forward(**batch) returns (output, loss).

AdamW, linear warm-up then cosine decay, gradient clipping and accumulation, optional bf16 autocast,
periodic validation, a JSONL metrics log, atomic checkpoints and exact resume. Launched with
`torchrun --nproc_per_node N` it trains with DistributedDataParallel (gloo on CPU, nccl on GPU). The
global batch of a step is the same whatever the number of processes or accumulation steps, and the loss
is the mean over all its target tokens, so such runs agree.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import math
import os
import pickle
import signal
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch
import torch.distributed as dist
from safetensors import SafetensorError
from safetensors.torch import load_model
from torch.nn.parallel import DistributedDataParallel
from tqdm import tqdm

from diffar.checkpoint import read_meta, resolve, save_run_checkpoint
from diffar.config import Config
from diffar.data.batching import IGNORE_INDEX
from diffar.errors import DiffarError, Interrupted
from diffar.evaluation.metrics import mean_nll, perplexity
from diffar.tokenizer import Tokenizer

# A resumed run must continue the same experiment: these fields of config.json have to agree.
RESUME_MUST_MATCH = ("kind", "model", "task", "corpus", "block_size", "tokenizer_sha256")
# TrainConfig fields a resumed run may change freely (run longer, evaluate or save at another pace); any other
# change (lr, batch size, seed...) makes a different experiment and needs `override`, which records it.
RESUME_MAY_CHANGE = ("max_steps", "eval_every", "eval_examples", "save_every")


class Trainable(Protocol):
    """What the trainer needs of a model, besides being an nn.Module."""

    loss_is_nll: bool  # the loss is a mean token NLL, so exp(val_loss) is a perplexity worth logging
    loss_parts: dict[str, float]  # the terms of the last forward's loss (detached), logged per step

    def __call__(self, **batch: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]: ...


@dataclass
class TrainConfig(Config):
    max_steps: int = 2000
    batch_size: int = 32  # sequences per process per micro-step
    grad_accum: int = 1
    lr: float = 1e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 100
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0
    precision: str = "fp32"  # "fp32" | "bf16" (autocast)
    eval_every: int = 200
    eval_examples: int = 256
    save_every: int = 200
    seed: int = 1234

    def checks(self):
        rules = [(getattr(self, name) > 0, name, "must be positive")
                 for name in ("max_steps", "batch_size", "grad_accum", "eval_every", "save_every", "eval_examples")]
        rules += [
            (math.isfinite(self.lr) and self.lr > 0, "lr", "must be a positive number"),
            (0 <= self.min_lr_ratio <= 1, "min_lr_ratio", "must be in [0, 1]"),
            (self.warmup_steps >= 0, "warmup_steps", "must be >= 0"),
            (math.isfinite(self.weight_decay) and self.weight_decay >= 0, "weight_decay", "must be >= 0"),
            (0 <= self.beta1 < 1, "beta1", "must be in [0, 1)"),
            (0 <= self.beta2 < 1, "beta2", "must be in [0, 1)"),
            (math.isfinite(self.grad_clip) and self.grad_clip > 0, "grad_clip", "must be positive"),
            (self.precision in ("fp32", "bf16"), "precision", "must be fp32 or bf16"),
            (0 <= self.seed < 2**63, "seed", "must be in 0..2**63 - 1"),
        ]
        return [(ok, f"{name} {rule}, got {getattr(self, name)}") for ok, name, rule in rules]


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Linear warm-up to cfg.lr, then cosine decay to cfg.lr * min_lr_ratio at max_steps."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    progress = min(1.0, (step - cfg.warmup_steps) / max(1, cfg.max_steps - cfg.warmup_steps))
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


class Trainer:
    def __init__(self, model: Trainable, train_data, valid_data, cfg: TrainConfig, run_dir: str | Path,
                 meta: dict, tokenizer: Tokenizer, override: bool = False):
        """`meta` goes into every checkpoint's config.json (model kind and config, corpus, task...). `override`
        lets a resumed run change its training hyperparameters (the change is kept in the meta's "history")."""
        self.cfg, self.run_dir, self.meta, self.tokenizer = cfg, Path(run_dir), dict(meta), tokenizer
        self.override = override
        self.train_data, self.valid_data = train_data, valid_data
        self.world, self.rank = int(os.environ.get("WORLD_SIZE", 1)), int(os.environ.get("RANK", 0))
        cuda = torch.cuda.is_available()
        self.device = torch.device(f"cuda:{os.environ.get('LOCAL_RANK', 0)}" if cuda else "cpu")
        if cuda:
            torch.cuda.set_device(self.device)
        if self.world > 1 and not dist.is_initialized():
            dist.init_process_group("nccl" if cuda else "gloo")
        self.model = model.to(self.device)
        self.ddp = DistributedDataParallel(model, device_ids=[self.device] if cuda else None) if self.world > 1 \
            else None
        decay = [p for p in model.parameters() if p.dim() >= 2]
        no_decay = [p for p in model.parameters() if p.dim() < 2]
        self.optimizer = torch.optim.AdamW(
            [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
            lr=cfg.lr, betas=(cfg.beta1, cfg.beta2),
        )
        self.step = 0
        self.last_metrics: dict = {}
        self.loss_parts: dict[str, float] = {}  # a model's own loss terms (its `loss_parts`), logged per step
        self.metrics_path = self.run_dir / "metrics.jsonl"

    # ---- data -------------------------------------------------------------------------------------
    def micro_batches(self, step: int) -> list[dict[str, torch.Tensor]]:
        """This process's micro-batches of `step`: a seeded draw that depends only on (seed, step)."""
        cfg, world = self.cfg, self.world
        g = torch.Generator().manual_seed(cfg.seed * 1_000_003 + step)
        idx = self.train_data.sample_indices(g, cfg.grad_accum * world * cfg.batch_size)
        out = []
        for m in range(cfg.grad_accum):
            start = (m * world + self.rank) * cfg.batch_size
            batch = self.train_data.batch(idx[start:start + cfg.batch_size])
            out.append({k: v.to(self.device) for k, v in batch.items()})
        return out

    def autocast(self):
        if self.cfg.precision == "bf16":
            return torch.autocast(device_type=self.device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def all_sum(self, values: list[float]) -> list[float]:
        """Sum over processes (identity on one)."""
        if self.world == 1:
            return values
        t = torch.tensor(values, dtype=torch.float64, device=self.device)
        dist.all_reduce(t)
        return t.tolist()

    # ---- state ------------------------------------------------------------------------------------
    def resume(self) -> bool:
        if not (self.run_dir / "latest").is_file():
            if self.rank == 0 and self.metrics_path.exists():  # a run killed before its first checkpoint
                self.metrics_path.unlink()
            return False
        folder = resolve(self.run_dir)
        saved = read_meta(folder)
        expected = json.loads(json.dumps({**self.meta, "tokenizer_sha256": self.tokenizer.sha256}))  # as saved
        differ = [k for k in RESUME_MUST_MATCH if saved.get(k) != expected.get(k)]
        if differ:
            raise DiffarError(f"{self.run_dir} holds a run of a different model/data ({', '.join(differ)} differ); "
                              f"choose another --out")
        changed = self._changed_hyperparameters(saved)
        try:
            load_model(self.model, str(folder / "model.safetensors"), device=str(self.device))
            with warnings.catch_warnings():  # a corrupt file's unpickler warnings: the error below says it all
                warnings.simplefilter("ignore")
                state = torch.load(folder / "train_state.pt", weights_only=True, map_location=self.device)
            self.optimizer.load_state_dict(state["optimizer"])
            self.step, self.last_metrics = int(state["step"]), state.get("last_metrics", {})
        except (OSError, SafetensorError, RuntimeError, ValueError, EOFError, KeyError, TypeError,
                pickle.UnpicklingError) as e:
            raise DiffarError(f"cannot resume from {folder}: its weights or train_state.pt are unreadable") from e
        # every later checkpoint keeps the run's history of overridden settings
        history = saved.get("history", []) + ([{"step": self.step, "changed": changed}] if changed else [])
        if history:
            self.meta["history"] = history
        if self.rank == 0 and self.metrics_path.exists():  # keep only log lines up to the checkpoint
            kept = []
            for line in self.metrics_path.read_text().splitlines():
                try:
                    if json.loads(line)["step"] <= self.step:
                        kept.append(line)
                except (ValueError, KeyError, TypeError):
                    pass  # a line cut short by the kill
            self.metrics_path.write_text("".join(ln + "\n" for ln in kept))
        return True

    def _changed_hyperparameters(self, saved: dict) -> dict:
        """The training settings that differ from the saved run's (but for RESUME_MAY_CHANGE), as {field: [old,
        new]}; refused unless `override`."""
        old, new = saved.get("train", {}), self.cfg.to_dict()
        changed = {k: [old[k], new[k]] for k in new if k in old and old[k] != new[k] and k not in RESUME_MAY_CHANGE}
        if changed and not self.override:
            listed = ", ".join(f"--{k.replace('_', '-')} {a} -> {b}" for k, (a, b) in changed.items())
            raise DiffarError(f"{self.run_dir} was trained with other settings ({listed}); rerun with the saved "
                              f"ones, or pass --override to continue with the new ones")
        return changed

    def save(self) -> None:
        if self.rank == 0:
            state = {"optimizer": self.optimizer.state_dict(), "step": self.step, "last_metrics": self.last_metrics}
            meta = {**self.meta, "train": self.cfg.to_dict(), "metrics": self.last_metrics}
            save_run_checkpoint(self.run_dir, self.step, self.model, meta, self.tokenizer, state)
        if self.world > 1:
            dist.barrier()

    def log(self, record: dict) -> None:
        if self.rank == 0:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            with open(self.metrics_path, "a") as f:
                f.write(json.dumps(record) + "\n")

    # ---- loop -------------------------------------------------------------------------------------
    def evaluate(self) -> float:
        """Token-weighted mean loss over a fixed set of validation examples."""
        self.model.eval()
        with self.autocast(), torch.random.fork_rng():  # a model that samples (noise, anchors) scores alike
            torch.manual_seed(self.cfg.seed)
            nll = mean_nll(self.model, self.valid_data, self.cfg.batch_size, self.cfg.eval_examples, self.device)
        self.model.train()
        return nll

    def train_step(self) -> tuple[float, int, int]:
        """One optimizer step on the global batch; returns (mean loss per target token, target tokens, positions
        read: the whole sequences, prompts and padding included)."""
        cfg, net = self.cfg, self.ddp or self.model
        for group in self.optimizer.param_groups:
            group["lr"] = lr_at(self.step, cfg)
        micro = self.micro_batches(self.step)
        torch.manual_seed(cfg.seed * 1_000_003 + self.step * 64 + self.rank)  # the model's own draws (resumable)
        counts = [int((b["targets"] != IGNORE_INDEX).sum()) for b in micro]
        total, positions = self.all_sum([float(sum(counts)), float(sum(b["targets"].numel() for b in micro))])
        # Each micro-batch's mean loss, weighted by its share of the global batch's target tokens. DDP
        # averages gradients over processes, hence the factor `world`.
        loss_sum, parts = 0.0, {}
        for m, (batch, n) in enumerate(zip(micro, counts)):
            sync = self.ddp is None or m == len(micro) - 1
            with (contextlib.nullcontext() if sync else self.ddp.no_sync()), self.autocast():
                _, loss = net(**batch)
            (loss * (n * self.world / total)).backward()
            loss_sum += loss.item() * n
            for k, v in self.model.loss_parts.items():
                parts[k] = parts.get(k, 0.0) + v * n
        loss_sum = self.all_sum([loss_sum])[0]
        self.loss_parts = {k: round(v / sum(counts), 5) for k, v in parts.items()}  # this process's share
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), cfg.grad_clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        return loss_sum / total, int(total), int(positions)

    def fit(self) -> dict:
        """Train to cfg.max_steps, resuming from the run folder if it holds a checkpoint.

        Ctrl-C (or SIGTERM) finishes the current step, saves, and stops; rerunning resumes exactly. The run
        folder is locked meanwhile: a second trainer on it is refused (their checkpoints and logs would mix).
        """
        if self.rank != 0:
            return self._fit()
        self.run_dir.mkdir(parents=True, exist_ok=True)
        with open(self.run_dir / ".lock", "w") as lock:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                raise DiffarError(f"another trainer is writing {self.run_dir}; wait for it or choose another "
                                  f"--out") from None
            return self._fit()  # the lock goes with the file's closing

    def _fit(self) -> dict:
        resumed = self.resume()
        if resumed and self.step >= self.cfg.max_steps:
            if self.rank == 0:
                print(f"{self.run_dir} is already at step {self.step}, at or past --max-steps {self.cfg.max_steps}: "
                      f"nothing to train (raise --max-steps to go on)")
            return self.last_metrics
        if self.rank == 0:
            n_params = sum(p.numel() for p in self.model.parameters())
            where = f"resuming at step {self.step}" if resumed else "starting"
            print(f"{where}: {n_params / 1e6:.2f}M params, {len(self.train_data)} train examples, "
                  f"{self.world} process(es) x batch {self.cfg.batch_size} x accum {self.cfg.grad_accum}, "
                  f"{self.device.type}")
        signalled = []
        handlers = {s: signal.signal(s, lambda *_: signalled.append(True)) for s in (signal.SIGINT, signal.SIGTERM)}
        self.model.train()
        bar = tqdm(total=self.cfg.max_steps, initial=self.step, disable=self.rank != 0, dynamic_ncols=True)
        stop = False
        try:
            while self.step < self.cfg.max_steps and not stop:
                t0 = time.perf_counter()
                loss, tokens, positions = self.train_step()
                seconds = time.perf_counter() - t0
                tok_s, target_s = positions / seconds, tokens / seconds
                stop = self.all_sum([float(bool(signalled))])[0] > 0  # every process stops at the same step
                record = {"step": self.step, "loss": round(loss, 6), **self.loss_parts,
                          "lr": lr_at(self.step - 1, self.cfg), "tokens_per_s": round(tok_s, 1),
                          "target_tokens_per_s": round(target_s, 1)}
                if self.step % self.cfg.eval_every == 0 or self.step == self.cfg.max_steps:
                    val = self.evaluate()
                    record["val_loss"] = round(val, 6)
                    if self.model.loss_is_nll:
                        record["val_ppl"] = round(perplexity(val), 3)
                    self.last_metrics = {k: record[k] for k in ("step", "val_loss", "val_ppl") if k in record}
                self.log(record)
                bar.update(1)
                bar.set_postfix(loss=f"{loss:.3f}", tok_s=f"{tok_s:.0f}", target_tok_s=f"{target_s:.0f}",
                                **({"val": f"{record['val_loss']:.3f}"} if "val_loss" in record else {}))
                if self.step % self.cfg.save_every == 0 or self.step == self.cfg.max_steps or stop:
                    self.save()
        finally:
            bar.close()
            for s, h in handlers.items():
                signal.signal(s, h)
            if self.world > 1:
                dist.destroy_process_group()
        if stop:
            raise Interrupted(f"interrupted at step {self.step}; checkpoint saved, rerun the same command to resume")
        return self.last_metrics

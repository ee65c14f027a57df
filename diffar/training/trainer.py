"""A model-agnostic trainer: any nn.Module whose forward(**batch) returns (output, loss).

AdamW, linear warm-up then cosine decay, gradient clipping and accumulation, optional bf16 autocast,
periodic validation, a JSONL metrics log, atomic checkpoints and exact resume. Launched with
`torchrun --nproc_per_node N` it trains with DistributedDataParallel (gloo on CPU, nccl on GPU); the
global batch of a step is the same whatever the number of processes, so runs agree.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import signal
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import load_model
from torch.nn.parallel import DistributedDataParallel
from tqdm import tqdm

from diffar.checkpoint import resolve, save_run_checkpoint
from diffar.errors import DiffarError
from diffar.tokenizer import Tokenizer


@dataclass
class TrainConfig:
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

    def __post_init__(self):
        for name in ("max_steps", "batch_size", "grad_accum", "eval_every", "save_every", "eval_examples"):
            if getattr(self, name) <= 0:
                raise DiffarError(f"--{name.replace('_', '-')} must be positive, got {getattr(self, name)}")
        if self.precision not in ("fp32", "bf16"):
            raise DiffarError(f"--precision must be fp32 or bf16, got {self.precision!r}")
        if self.lr <= 0:
            raise DiffarError(f"--lr must be positive, got {self.lr}")


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Linear warm-up to cfg.lr, then cosine decay to cfg.lr * min_lr_ratio at max_steps."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    progress = min(1.0, (step - cfg.warmup_steps) / max(1, cfg.max_steps - cfg.warmup_steps))
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


class Trainer:
    def __init__(self, model: torch.nn.Module, train_data, valid_data, cfg: TrainConfig, run_dir: str | Path,
                 meta: dict, tokenizer: Tokenizer):
        """`meta` goes into every checkpoint's config.json (model kind and config, corpus, task...)."""
        self.cfg, self.run_dir, self.meta, self.tokenizer = cfg, Path(run_dir), meta, tokenizer
        self.train_data, self.valid_data = train_data, valid_data
        self.world, self.rank = int(os.environ.get("WORLD_SIZE", 1)), int(os.environ.get("RANK", 0))
        if self.world > 1 and not dist.is_initialized():
            dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
        self.model = model
        self.ddp = DistributedDataParallel(model) if self.world > 1 else None
        decay = [p for p in model.parameters() if p.dim() >= 2]
        no_decay = [p for p in model.parameters() if p.dim() < 2]
        self.optimizer = torch.optim.AdamW(
            [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
            lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), fused=False,
        )
        self.step = 0
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
            out.append(self.train_data.batch(idx[start:start + cfg.batch_size]))
        return out

    def autocast(self):
        if self.cfg.precision == "bf16":
            return torch.autocast(device_type="cpu", dtype=torch.bfloat16)
        return contextlib.nullcontext()

    # ---- state ------------------------------------------------------------------------------------
    def resume(self) -> bool:
        if not (self.run_dir / "latest").is_file():
            return False
        folder = resolve(self.run_dir)
        if not (folder / "train_state.pt").is_file():
            raise DiffarError(f"{folder} has no train_state.pt to resume from")
        if json.loads((folder / "config.json").read_text()).get("model") != self.meta.get("model"):
            raise DiffarError(f"{self.run_dir} holds a run of a different model; choose another --out")
        load_model(self.model, str(folder / "model.safetensors"))
        state = torch.load(folder / "train_state.pt", weights_only=True)
        self.optimizer.load_state_dict(state["optimizer"])
        self.step = state["step"]
        if self.rank == 0 and self.metrics_path.exists():  # drop log lines past the checkpoint
            lines = [ln for ln in self.metrics_path.read_text().splitlines() if json.loads(ln)["step"] <= self.step]
            self.metrics_path.write_text("".join(ln + "\n" for ln in lines))
        return True

    def save(self) -> None:
        if self.rank == 0:
            state = {"optimizer": self.optimizer.state_dict(), "step": self.step}
            meta = {**self.meta, "train": asdict(self.cfg), "metrics": self.last_metrics}
            save_run_checkpoint(self.run_dir, self.step, self.model, meta, self.tokenizer, state)
        if self.world > 1:
            dist.barrier()

    def log(self, record: dict) -> None:
        if self.rank == 0:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            with open(self.metrics_path, "a") as f:
                f.write(json.dumps(record) + "\n")

    # ---- loop -------------------------------------------------------------------------------------
    @torch.no_grad()
    def evaluate(self) -> float:
        """Token-weighted mean loss over a fixed set of validation examples."""
        self.model.eval()
        idx = self.valid_data.eval_indices(self.cfg.eval_examples)
        total, count = 0.0, 0
        for i in range(0, len(idx), self.cfg.batch_size):
            batch = self.valid_data.batch(idx[i:i + self.cfg.batch_size])
            n = int((batch["targets"] != -100).sum())
            with self.autocast():
                _, loss = self.model(**batch)
            total, count = total + float(loss) * n, count + n
        self.model.train()
        return total / count

    def train_step(self) -> tuple[float, int]:
        cfg, net = self.cfg, self.ddp or self.model
        for group in self.optimizer.param_groups:
            group["lr"] = lr_at(self.step, cfg)
        loss_sum, tokens = 0.0, 0
        micro = self.micro_batches(self.step)
        for m, batch in enumerate(micro):
            sync = self.ddp is None or m == len(micro) - 1
            with (contextlib.nullcontext() if sync else self.ddp.no_sync()), self.autocast():
                _, loss = net(**batch)
            (loss / cfg.grad_accum).backward()
            loss = loss.detach()
            loss_sum += loss.item() / cfg.grad_accum
            tokens += int((batch["targets"] != -100).sum())
        if self.ddp is not None:  # log the global batch's loss, not this rank's share
            stats = torch.tensor([loss_sum, tokens], dtype=torch.float64)
            dist.all_reduce(stats)
            loss_sum, tokens = float(stats[0]) / self.world, int(stats[1])
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), cfg.grad_clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        return loss_sum, tokens

    def fit(self) -> dict:
        """Train to cfg.max_steps, resuming from the run folder if it holds a checkpoint.

        Ctrl-C (or SIGTERM) finishes the current step, saves, and stops; rerunning resumes exactly.
        """
        torch.manual_seed(self.cfg.seed)
        resumed = self.resume()
        self.last_metrics: dict = {}
        if self.rank == 0:
            n_params = sum(p.numel() for p in self.model.parameters())
            where = f"resuming at step {self.step}" if resumed else "starting"
            print(f"{where}: {n_params / 1e6:.2f}M params, {len(self.train_data)} train examples, "
                  f"{self.world} process(es) x batch {self.cfg.batch_size} x accum {self.cfg.grad_accum}")
        stop = []
        handlers = {s: signal.signal(s, lambda *_: stop.append(True)) for s in (signal.SIGINT, signal.SIGTERM)}
        self.model.train()
        bar = tqdm(total=self.cfg.max_steps, initial=self.step, disable=self.rank != 0, dynamic_ncols=True)
        try:
            while self.step < self.cfg.max_steps and not stop:
                t0 = time.perf_counter()
                loss, tokens = self.train_step()
                tok_s = tokens / (time.perf_counter() - t0)
                record = {"step": self.step, "loss": round(loss, 6), "lr": lr_at(self.step - 1, self.cfg),
                          "tokens_per_s": round(tok_s, 1)}
                if self.step % self.cfg.eval_every == 0 or self.step == self.cfg.max_steps:
                    val = self.evaluate()
                    record.update(val_loss=round(val, 6), val_ppl=round(math.exp(min(val, 50)), 3))
                    self.last_metrics = {k: record[k] for k in ("step", "val_loss", "val_ppl")}
                self.log(record)
                bar.update(1)
                bar.set_postfix(loss=f"{loss:.3f}", tok_s=f"{tok_s:.0f}",
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
            raise DiffarError(f"interrupted at step {self.step}; checkpoint saved, rerun the same command to resume")
        return self.last_metrics

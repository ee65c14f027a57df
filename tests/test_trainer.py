import json
import signal
import subprocess
import sys
import time

import pytest
import torch

from diffar.data.batching import build_dataset
from diffar.data.corpora import load_corpus
from diffar.models.transformer import Transformer, TransformerConfig
from diffar.training.trainer import Trainer, TrainConfig, lr_at
from tests.conftest import ROOT, TINY_TRAIN, run_cli


def _trainer(tokenizer, run_dir, seed=0, override=False, **cfg):
    """Trains on the (small) valid split, validates on the held-out test works."""
    data = build_dataset(load_corpus("shakespeare", "valid"), tokenizer, block_size=64)
    held_out = build_dataset(load_corpus("shakespeare", "test"), tokenizer, block_size=64)
    torch.manual_seed(seed)
    model = Transformer(TransformerConfig.from_preset("tiny", vocab_size=tokenizer.vocab_size))
    meta = {"kind": "ar", "model": model.config.to_dict(), "task": "continuation", "corpus": "shakespeare"}
    defaults = dict(max_steps=8, batch_size=4, warmup_steps=2, eval_every=4, eval_examples=8, save_every=2,
                    lr=3e-3)
    return Trainer(model, data, held_out, TrainConfig(**{**defaults, **cfg}), run_dir, meta, tokenizer, override)


def _losses(run_dir):
    """The metrics log without its timing column."""
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if k not in ("tokens_per_s", "target_tokens_per_s")} for r in records]


def test_lr_schedule():
    cfg = TrainConfig(max_steps=100, warmup_steps=10, lr=1.0, min_lr_ratio=0.1)
    assert lr_at(0, cfg) == pytest.approx(0.1) and lr_at(9, cfg) == pytest.approx(1.0)
    assert lr_at(100, cfg) == pytest.approx(0.1)
    assert all(lr_at(s, cfg) >= lr_at(s + 1, cfg) for s in range(10, 100))


def test_short_training_lowers_held_out_loss(tokenizer, tmp_path):
    trainer = _trainer(tokenizer, tmp_path, max_steps=40, eval_every=40, save_every=40)
    before = trainer.evaluate()
    after = trainer.fit()["val_loss"]
    assert after < before - 0.5, (before, after)
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert all(r["tokens_per_s"] >= r["target_tokens_per_s"] > 0 for r in records)  # positions read >= scored


def test_killed_run_resumes_exactly(tokenizer, tmp_path):
    reference = _trainer(tokenizer, tmp_path / "ref")
    reference.fit()

    crashed = _trainer(tokenizer, tmp_path / "crash")
    real_step = crashed.train_step

    def dying_step():
        if crashed.step == 5:  # after the step-4 checkpoint and one more logged step
            raise RuntimeError("simulated kill")
        return real_step()

    crashed.train_step = dying_step
    with pytest.raises(RuntimeError, match="simulated kill"):
        crashed.fit()
    assert (tmp_path / "crash" / "latest").read_text().strip() == "ckpt-0000004"
    assert len(_losses(tmp_path / "crash")) == 5
    resumed = _trainer(tokenizer, tmp_path / "crash", seed=99)  # different init: must be overwritten
    resumed.fit()
    assert _losses(tmp_path / "crash") == _losses(tmp_path / "ref")



def test_resume_refuses_changed_settings_unless_overridden(tokenizer, tmp_path):
    from diffar.checkpoint import read_meta, resolve
    from diffar.errors import DiffarError

    _trainer(tokenizer, tmp_path, max_steps=4).fit()
    for changed in (dict(lr=1e-2), dict(batch_size=8), dict(warmup_steps=3)):
        with pytest.raises(DiffarError, match=f"--{next(iter(changed)).replace('_', '-')} .* -> .*--override"):
            _trainer(tokenizer, tmp_path, max_steps=6, **changed).fit()
    assert read_meta(resolve(tmp_path))["train"]["max_steps"] == 4  # nothing was trained or written
    _trainer(tokenizer, tmp_path, max_steps=6, eval_every=3).fit()  # run longer, evaluate at another pace: fine
    _trainer(tokenizer, tmp_path, max_steps=8, lr=1e-2, override=True).fit()
    meta = read_meta(resolve(tmp_path))
    assert meta["train"]["lr"] == 1e-2 and meta["history"] == [{"step": 6, "changed": {"lr": [3e-3, 1e-2]}}]

def test_ctrl_c_saves_and_resumes(tokenizer_path, tmp_path):
    """A real process: SIGINT finishes the step, saves, exits 130 with a one-line message; rerun completes."""
    args = ["train", "ar", "--corpus", "shakespeare", "--tokenizer", tokenizer_path, "--block-size", "64",
            *TINY_TRAIN, "--max-steps", "300", "--save-every", "1000", "--eval-every", "1000"]
    proc = subprocess.Popen([sys.executable, "-m", "diffar.cli", *map(str, args), "--out", str(tmp_path / "run")],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    metrics = tmp_path / "run" / "metrics.jsonl"
    deadline = time.time() + 120
    while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 3) and time.time() < deadline:
        time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130 and "Traceback" not in err
    assert err.strip().splitlines()[-1].startswith("interrupted at step")  # not "error: ..."
    stopped_at = int(err.split("interrupted at step ")[1].split(";")[0])
    assert 3 <= stopped_at < 300
    assert (tmp_path / "run" / "latest").read_text().strip() == f"ckpt-{stopped_at:07d}"
    done = run_cli(*args, "--out", tmp_path / "run")
    assert done.returncode == 0, done.stderr
    assert f"resuming at step {stopped_at}" in done.stdout
    assert [r["step"] for r in _losses(tmp_path / "run")] == list(range(1, 301))


def test_a_run_folder_takes_one_trainer_at_a_time(tokenizer, tmp_path):
    import fcntl

    from diffar.errors import DiffarError

    tmp_path.mkdir(exist_ok=True)
    with open(tmp_path / ".lock", "w") as held:  # another trainer, as far as this one can tell
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        with pytest.raises(DiffarError, match="another trainer is writing"):
            _trainer(tokenizer, tmp_path, max_steps=2).fit()
    assert not (tmp_path / "latest").exists()
    _trainer(tokenizer, tmp_path, max_steps=2).fit()  # free again
    assert (tmp_path / "latest").read_text().strip() == "ckpt-0000002"


def test_max_steps_at_or_below_the_saved_step_says_so(tokenizer, tmp_path, capsys):
    _trainer(tokenizer, tmp_path, max_steps=4).fit()
    capsys.readouterr()
    metrics = _trainer(tokenizer, tmp_path, max_steps=3).fit()
    assert "already at step 4, at or past --max-steps 3: nothing to train" in capsys.readouterr().out
    assert metrics["step"] == 4 and len(_losses(tmp_path)) == 4

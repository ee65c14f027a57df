"""`torchrun --nproc_per_node 2` (gloo) trains the same model as one process with the same global batch."""

import json
import os
import subprocess
import sys

import pytest

from tests.conftest import ROOT, run_cli

COMMON = ["train", "ar", "--preset", "tiny", "--block-size", "64", "--max-steps", "4", "--warmup-steps", "1",
          "--eval-every", "4", "--eval-examples", "8", "--save-every", "4", "--lr", "3e-3"]


def _metrics(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("corpus, single, per_rank", [
    ("shakespeare", ["--batch-size", "8"], ["--batch-size", "4"]),  # equal-length windows
    # seq2seq: target lengths differ between rows, and accumulation runs DDP's no_sync path
    ("kjv2web", ["--batch-size", "4", "--grad-accum", "2"], ["--batch-size", "2", "--grad-accum", "2"]),
])
def test_two_process_ddp_matches_single_process(tokenizer_path, tmp_path, corpus, single, per_rank):
    args = [*COMMON, "--corpus", corpus, "--tokenizer", str(tokenizer_path)]
    one = run_cli(*args, *single, "--out", tmp_path / "single")
    assert one.returncode == 0, one.stderr
    ddp = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "-m", "diffar.cli",
         *args, *per_rank, "--out", str(tmp_path / "ddp")],
        cwd=ROOT, capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert ddp.returncode == 0, ddp.stderr[-3000:]
    a, b = _metrics(tmp_path / "single"), _metrics(tmp_path / "ddp")
    assert [r["step"] for r in a] == [r["step"] for r in b] == [1, 2, 3, 4]
    for ra, rb in zip(a, b):
        assert rb["loss"] == pytest.approx(ra["loss"], rel=1e-4, abs=1e-4)
    assert b[-1]["val_loss"] == pytest.approx(a[-1]["val_loss"], rel=1e-4)
    assert b[-1]["loss"] < b[0]["loss"]  # it trained, not just agreed

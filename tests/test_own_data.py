"""The README's "Your own data" block, run as written in a fresh folder outside the repository: every command
but the last (`diffar serve`, which runs until stopped) through bash, then that server, asked for a completion."""

import os
import re
import subprocess
import sys
from pathlib import Path

import httpx

from tests.conftest import ROOT, answers_health, free_port


def readme_block() -> list[str]:
    text = (ROOT / "README.md").read_text()
    block = re.search(r"<!-- own-data:start -->\n```bash\n(.*?)```\n<!-- own-data:end -->", text, re.S).group(1)
    return block.rstrip("\n").split("\n")


def test_the_readme_own_data_walkthrough_runs_as_written(tmp_path):
    *commands, serve = readme_block()
    assert serve.startswith("diffar serve ")
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    proc = subprocess.run(["bash", "-c", "set -euo pipefail\n" + "\n".join(commands)], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    assert {"pairs.jsonl", "test.jsonl", "my-tok.json", "eval-mine.json", "bench-mine.json"} <= \
        {p.name for p in tmp_path.iterdir()}
    assert "[ar]" in proc.stderr and "tokens/s" in proc.stderr  # generate's speed line

    port = free_port()
    server = subprocess.Popen(["bash", "-c", "exec " + serve.replace("8010", str(port))], cwd=tmp_path, env=env,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        url = f"http://127.0.0.1:{port}"
        assert answers_health(url, server)
        reply = httpx.post(url + "/v1/completions", json={"prompt": "sun moon tree", "max_tokens": 8}, timeout=60)
        assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] >= 1
    finally:
        server.terminate()
        server.wait(timeout=10)

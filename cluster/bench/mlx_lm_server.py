"""mlx_lm.server's prompt cache as a peer in the same run: its cold and cached time to first token.

`bench ttft --vs-mlx-lm-server` starts `python -m mlx_lm.server` on the same model (one process per
model, on loopback), and for each prompt length sends over HTTP, with max_tokens=1 and temperature 0:
- a warm-up prompt of that length (kernels are compiled per shape on a GPU);
- the prompt, cold (nothing of it in the server's LRUPromptCache);
- the same prompt again, cached.
The prompt is our token prompt decoded to text, so the server tokenizes it itself: the row reports the
token count it saw (`usage.prompt_tokens`). Its figures include HTTP and JSON on loopback; ours (the
ttft rows) are measured in process, so the comparison flatters the server slightly.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

from cluster.ports import free_port

START_TIMEOUT_S = 300.0


class MlxLmServer:
    def __init__(self, model_dir: Path):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.NamedTemporaryFile(prefix="mlx_lm.server-", suffix=".log")  # its traceback, if it fails
        self.proc = subprocess.Popen([sys.executable, "-m", "mlx_lm.server", "--model", str(model_dir),
                                      "--host", "127.0.0.1", "--port", str(self.port)],
                                     stdout=subprocess.DEVNULL, stderr=self.log)
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"mlx_lm.server exited ({self.proc.returncode}): {self.stderr_tail()}")
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=2):
                    return
            except OSError:
                time.sleep(0.5)
        self.close()
        raise RuntimeError(f"mlx_lm.server did not answer on {self.url} within {START_TIMEOUT_S:.0f}s")

    def complete(self, text: str) -> tuple[float, int]:
        """(seconds to the whole reply of one token, prompt tokens the server counted)."""
        body = json.dumps({"prompt": text, "max_tokens": 1, "temperature": 0.0}).encode()
        request = urllib.request.Request(f"{self.url}/v1/completions", body, {"Content-Type": "application/json"})
        t0 = time.perf_counter()
        try:
            with urllib.request.urlopen(request, timeout=600) as r:
                reply = json.loads(r.read())
        except urllib.error.HTTPError as e:  # it answers a failed generation with 404 and the error as the body
            raise RuntimeError(f"mlx_lm.server answered {e.code}: {e.read()[:2000].decode(errors='replace')}; "
                               f"its log ends: {self.stderr_tail()}") from e
        return time.perf_counter() - t0, int(reply.get("usage", {}).get("prompt_tokens", 0))

    def measure(self, warmup: str, text: str) -> dict:
        self.complete(warmup)
        cold, tokens = self.complete(text)
        cached, _ = self.complete(text)
        return {"server_tokens": tokens, "server_cold_s": cold, "server_cached_s": cached,
                "server_cached_vs_cold": cached / cold}

    def stderr_tail(self, n: int = 2000) -> str:
        return Path(self.log.name).read_bytes()[-n:].decode(errors="replace")

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

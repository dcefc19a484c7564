"""The local real teacher: ``transformers serve`` over a preset, on loopback.

``metachunk teacher serve`` and ``make demo`` use it so that the whole distillation path (HTTP,
openai client, cache, limits, parsing) runs for real without an API key or a GPU. The answers of
a 135M model are poor; the pipelines treat them as a real teacher's bad day.

``transformers serve DIR`` preloads the model and answers only requests whose ``model`` equals
``DIR`` exactly, so :attr:`LocalTeacher.model` is the resolved folder path.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LocalTeacher:
    """``with LocalTeacher("smollm2") as t: t.base_url, t.model`` — a served preset."""

    def __init__(
        self,
        model: str = "smollm2",
        port: int | None = None,
        threads: int | None = None,
        log: Path | None = None,
    ):
        from metachunk.models import resolve

        self.model = str(resolve(model))  # converts the preset on first use
        self.port = port or free_port()
        self.base_url = f"http://127.0.0.1:{self.port}/v1"
        self.threads = threads
        self.log = log
        self.process: subprocess.Popen | None = None
        self._log_file = None

    def start(self, timeout: float = 300.0) -> LocalTeacher:
        command = [
            sys.executable, "-m", "transformers.cli.transformers", "serve", self.model,
            "--host", "127.0.0.1", "--port", str(self.port), "--device", "cpu", "--log-level", "warning",
        ]  # fmt: skip
        env = dict(os.environ, HF_HUB_OFFLINE="1")
        if self.threads:
            env["OMP_NUM_THREADS"] = str(self.threads)
        out = subprocess.DEVNULL
        if self.log:
            Path(self.log).parent.mkdir(parents=True, exist_ok=True)
            out = self._log_file = open(self.log, "ab")  # noqa: SIM115 (closed in stop)
        self.process = subprocess.Popen(
            command, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(
                    f"the local teacher exited with code {self.process.returncode}; see {self.log or 'its output'}"
                )
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=2) as r:
                    if r.status == 200:
                        return self
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"the local teacher did not become healthy within {timeout:.0f}s")

    def stop(self) -> None:
        if self.process and self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)  # uvicorn shuts down cleanly on SIGTERM
            try:
                self.process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()
        if self._log_file:
            self._log_file.close()
            self._log_file = None

    def __enter__(self) -> LocalTeacher:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

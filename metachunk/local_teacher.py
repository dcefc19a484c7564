"""The local real teacher: a preset served on loopback by a real OpenAI-compatible server.

``metachunk teacher serve`` and ``make demo`` use it so that the whole distillation path (HTTP,
openai client, cache, limits, structured outputs, parsing) runs for real without an API key or a
GPU. The answers of a 135M model are poor; the pipelines treat them as a real teacher's bad day.

Two backends, one interface (``with LocalTeacher(...) as t: t.base_url, t.model``):

- ``llama.cpp``: llama-cpp-python's server (``pip install 'metachunk[llamacpp]'``, compiled from
  source once per machine). It serves the preset's GGUF file as it ships, quantised, and applies
  a request's JSON schema as a grammar while decoding (``response_format: {"type":
  "json_object", "schema": ...}``: `structured_output` is ``json_object_schema``). Its
  ``json_schema`` form answered HTTP 500 when probed (0.3.36), so it is not used.
- ``transformers``: ``transformers serve DIR``, which needs no compiler. It runs the dequantised
  fp32 folder, does not constrain decoding (``structured_output: none``) and answers only
  requests whose ``model`` equals ``DIR`` exactly, so `model` is the folder path there.

``auto`` takes llama.cpp when it is installed.

A server that answers its health check can still die on its first real request: a llama.cpp built
with ``-march=native`` on a CPU with AMX crashed in ggml's AMX matmul (SIGSEGV), after which every
request failed to connect and a tolerant recipe carried on with nothing distilled. So
`LocalTeacher.start` sends one one-token completion before it says the server is ready, and
`LocalTeacher.failure` tells the runner whether the server has died since.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from metachunk.artifacts import InputError
from metachunk.command import Result
from metachunk.config import check_choices, option

BACKENDS = ("auto", "llama.cpp", "transformers")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def port_in_use(port: int) -> None:
    """Refuse a port another process holds, naming it: a server a killed run left behind is then
    "port 8000 is in use by pid 1234 (python -m llama_cpp.server ...)", not a startup timeout."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the servers bind: TIME_WAIT is no holder
        try:
            s.bind(("127.0.0.1", port))
            return
        except OSError:
            pass
    holder = ""
    with contextlib.suppress(Exception):
        import psutil

        for conn in psutil.net_connections(kind="tcp"):
            if conn.laddr and conn.laddr.port == port and conn.status == psutil.CONN_LISTEN and conn.pid:
                cmd = " ".join(psutil.Process(conn.pid).cmdline()[:4])
                holder = f" by pid {conn.pid} ({cmd} ...)"
                break
    raise RuntimeError(f"port {port} is in use{holder}; stop it, or pick another --port")


def llama_cpp_available() -> bool:
    return importlib.util.find_spec("llama_cpp") is not None


def pick_backend(backend: str = "auto") -> str:
    if backend not in BACKENDS:
        raise ValueError(f"unknown teacher backend {backend!r}; known: {', '.join(BACKENDS)}")
    if backend == "auto":
        return "llama.cpp" if llama_cpp_available() else "transformers"
    if backend == "llama.cpp" and not llama_cpp_available():
        raise RuntimeError(
            "the llama.cpp backend needs llama-cpp-python's server: pip install 'metachunk[llamacpp]' "
            "(compiled from source: several minutes, once)"
        )
    return backend


class LocalTeacher:
    """``with LocalTeacher("smollm2") as t: t.base_url, t.model`` — a served preset.

    ``model``: a preset name, or for ``transformers`` a local HF dir, for ``llama.cpp`` a
    ``.gguf`` file. `model` is the name requests must send; `serve_preset` says
    whether a recipe naming the preset needs ``serve_preset: true`` to send it; and
    `structured_output` is the recipe setting under which this backend decodes a schema.
    """

    def __init__(
        self,
        model: str = "smollm2",
        port: int | None = None,
        threads: int | None = None,
        log: Path | None = None,
        backend: str = "transformers",
        n_ctx: int = 4096,
    ):
        self.backend = pick_backend(backend)
        self.port = port or free_port()
        self.base_url = f"http://127.0.0.1:{self.port}/v1"
        self.threads = threads
        self.log = log
        self.process: subprocess.Popen | None = None
        self._log_file = None
        if self.backend == "llama.cpp":
            from metachunk.models import PRESETS, gguf_file

            self.source = gguf_file(model) if model in PRESETS else Path(model)
            if self.source.suffix != ".gguf" or not self.source.is_file():
                raise RuntimeError(f"the llama.cpp backend serves a preset or a .gguf file; got {model!r}")
            # Any name: llama-cpp-python's server answers every request with its one model. The
            # preset's name, so a recipe's `model: smollm2` works without serve_preset.
            self.model = model if model in PRESETS else self.source.stem
            self.serve_preset = False
            self.structured_output = "json_object_schema"
            self.command = [
                sys.executable, "-m", "llama_cpp.server", "--model", str(self.source),
                "--model_alias", self.model, "--host", "127.0.0.1", "--port", str(self.port),
                "--n_ctx", str(n_ctx), "--n_threads", str(threads or os.cpu_count() or 1), "--verbose", "False",
            ]  # fmt: skip
            self.health_path = "/v1/models"
        else:
            from metachunk.models import resolve

            self.source = resolve(model)  # converts the preset on first use
            self.model = str(self.source)
            self.serve_preset = True
            self.structured_output = "none"
            self.command = [
                sys.executable, "-m", "transformers.cli.transformers", "serve", self.model,
                "--host", "127.0.0.1", "--port", str(self.port), "--device", "cpu", "--log-level", "warning",
            ]  # fmt: skip
            self.health_path = "/health"

    def describe(self) -> str:
        if self.backend == "llama.cpp":
            return f"llama.cpp server (llama-cpp-python) on {self.source.name}"
        return f"transformers serve on {self.source}"

    def start(self, timeout: float = 300.0) -> LocalTeacher:
        env = dict(os.environ, HF_HUB_OFFLINE="1")
        if self.threads:
            env["OMP_NUM_THREADS"] = str(self.threads)
        if self.backend == "llama.cpp":
            # ggml's OpenMP threads spin while they wait for each other; when another process holds a
            # core, spinning threads slow decoding tenfold (docs/performance.md, Other figures).
            env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
        from metachunk.stopping import guarded

        out = subprocess.DEVNULL
        try:
            if self.log:
                Path(self.log).parent.mkdir(parents=True, exist_ok=True)
                out = self._log_file = open(self.log, "ab")  # noqa: SIM115 (closed in stop)
            port_in_use(self.port)
            # Its own session (a terminal's Ctrl-C goes to metachunk, which stops it in order); guarded:
            # it dies with metachunk even when metachunk is SIGKILLed.
            self.process = subprocess.Popen(
                guarded(self.command), env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
            )
            self._wait_until_ready(timeout)
        except (
            BaseException
        ):  # the port is taken, it died, never became ready, or the run was stopped (Stopped)
            self.stop()
            raise
        return self

    def _wait_until_ready(self, timeout: float) -> None:
        """Until the server answers its health check and one real completion."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(
                    f"the local teacher ({self.backend}) exited with code {self.process.returncode}; "
                    f"see {self.log or 'its output'}"
                )
            try:
                with urllib.request.urlopen(
                    f"http://127.0.0.1:{self.port}{self.health_path}", timeout=2
                ) as r:
                    if r.status == 200:
                        break
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(0.5)
        else:
            raise RuntimeError(f"the local teacher did not become healthy within {timeout:.0f}s")
        self._first_completion(deadline - time.monotonic())

    def _first_completion(self, timeout: float) -> None:
        """One real one-token completion: a server that crashes on it is caught here, not in a stage."""
        messages = [{"role": "user", "content": "Hello"}]
        body = json.dumps({"model": self.model, "messages": messages, "max_tokens": 1, "temperature": 0})
        request = urllib.request.Request(
            f"{self.base_url}/chat/completions",
            data=body.encode(),
            headers={"Content-Type": "application/json"},
        )
        try:
            with urllib.request.urlopen(request, timeout=max(timeout, 30.0)):
                pass
        except urllib.error.HTTPError:
            pass  # it answered: the server is alive, whatever it thought of the request
        except (urllib.error.URLError, ConnectionError, TimeoutError) as e:
            time.sleep(0.5)  # let a crashing process finish dying, so failure() can say how it died
            died = self.failure()
            if died is None:
                raise RuntimeError(
                    f"the local teacher ({self.backend}) failed its first completion ({e}); see {self.log or 'its output'}"
                ) from None
            hint = ""
            if self.backend == "llama.cpp":
                hint = (" A llama-cpp-python built with -march=native crashes this way on CPUs with AMX: rebuild it "
                        "for AVX2 with the Makefile's LLAMA_CMAKE_ARGS (README, Install), or use backend: transformers.")  # fmt: skip
            raise RuntimeError(
                f"the local teacher ({self.backend}) {died} on its first completion; see {self.log or 'its output'}.{hint}"
            ) from None

    def failure(self) -> str | None:
        """How the started server died (``"was killed by SIGSEGV"``, ``"exited with code 1"``), or None
        while it runs (or before it was started)."""
        if self.process is None or self.process.poll() is None:
            return None
        code = self.process.returncode
        if code < 0:
            try:
                return f"was killed by {signal.Signals(-code).name}"
            except ValueError:
                return f"was killed by signal {-code}"
        return f"exited with code {code}"

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


# ---- `metachunk teacher serve` -------------------------------------------------------------------


@dataclass
class ServeConfig:
    model: str = option("smollm2", "preset name, a .gguf (llama.cpp) or a local HF dir")
    port: int = option(8000, "port on 127.0.0.1")
    backend: str = option(
        "auto",
        "llama.cpp: llama-cpp-python's server on the GGUF file, decoding under a request's JSON schema "
        "(pip install 'metachunk[llamacpp]'); transformers: `transformers serve`, no compiler needed; "
        "auto: llama.cpp when installed",
        choices=["auto", "llama.cpp", "transformers"],
    )
    threads: int | None = option(None, "CPU threads (default: all cores)")

    def __post_init__(self):
        check_choices(self)
        if not 0 < self.port < 65536:
            raise ValueError(f"'port' must be in 1..65535, got {self.port}")
        if self.threads is not None and self.threads < 1:
            raise ValueError(f"'threads' must be >= 1, got {self.threads}")


def serve(cfg: ServeConfig) -> Result:
    """``metachunk teacher serve``: the server until Ctrl-C; exit 1 if it does not start."""
    try:
        teacher = LocalTeacher(cfg.model, port=cfg.port, threads=cfg.threads, backend=cfg.backend)
    except (RuntimeError, ValueError) as e:
        raise InputError("teacher serve", str(e)) from None
    print(f"starting the {teacher.describe()} on {teacher.base_url} ...", file=sys.stderr)
    try:
        teacher.start()
    except RuntimeError as e:  # it did not start, or died on its first completion
        print(f"metachunk: error: {e}", file=sys.stderr)
        return Result(1)
    try:
        print(
            f"ready: base_url={teacher.base_url} model={teacher.model}"
            + (" (serve_preset: true)" if teacher.serve_preset else "")
            + f" structured_output={teacher.structured_output}; Ctrl-C stops it",
            file=sys.stderr,
        )
        teacher.process.wait()
    except KeyboardInterrupt as e:
        from metachunk.stopping import Stopped

        print("stopping the local teacher", file=sys.stderr)
        if isinstance(e, Stopped):  # SIGTERM or SIGHUP: the command's status says so (143, 129)
            raise
    finally:
        teacher.stop()
    return Result()

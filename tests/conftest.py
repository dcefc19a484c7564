"""Shared pytest fixtures: an offline tiny Qwen2 model, a fake Hub; and those of ``support/fixtures.py``.
The real corpora are named datasets: ``support.data.data_file``."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ["HF_HUB_OFFLINE"] = "1"

# planted distilled records, the SFT dataset built from them (session-scoped)
pytest_plugins = ["support.fixtures"]


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    """A `metachunk.stopping.Stopped` escaping a test fails that test. It is a KeyboardInterrupt (as
    Ctrl-C's is, so asyncio lets it through), which pytest takes for the user's Ctrl-C and stops
    the whole session on."""
    from metachunk.stopping import Stopped

    try:
        return (yield)
    except Stopped as e:
        raise AssertionError(f"{item.nodeid}: metachunk's Stopped({e}) escaped the test") from e


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Qwen2ForCausalLM + Qwen2-style BPE tokenizer saved as a normal HF folder.

    Built once per test session (about a second once torch/transformers are imported).
    """
    from tiny_model import build_tiny_qwen2

    return build_tiny_qwen2(tmp_path_factory.mktemp("tiny_qwen2"))


@pytest.fixture(scope="session")
def smollm2():
    """(model, tokenizer) of the real SmolLM2-135M-Instruct preset, fp32 on CPU, loaded once.

    Tests using it are ``@pytest.mark.integration``; they skip when the preset package is missing.
    """
    from metachunk.models import ModelNotFoundError, load_causal_lm

    try:
        return load_causal_lm("smollm2", device="cpu", dtype="float32")  # exact: the references are fp32
    except ModelNotFoundError as e:
        pytest.skip(str(e))


@pytest.fixture
def fake_hub(monkeypatch, tmp_path):
    """Route every huggingface_hub request to a ``hub_mock.FakeHub``; restore the default client afterwards."""
    import httpx2
    from hub_mock import FakeHub
    from huggingface_hub import constants, set_client_factory
    from huggingface_hub.utils._http import default_client_factory, hf_request_event_hook

    hub = FakeHub()
    # hf_xet (when the upload pipeline starts a session) writes its logs under HF_XET_CACHE: keep them in
    # tmp_path, where the token scan looks
    monkeypatch.setenv("HF_XET_CACHE", str(tmp_path / "xet"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)  # the test suite runs offline
    monkeypatch.setattr(constants, "HF_DEBUG", True)  # log each request as curl too: the most verbose path

    def factory():
        return httpx2.Client(
            transport=httpx2.MockTransport(hub.handler),
            event_hooks={"request": [hf_request_event_hook]},  # the real client's hook (offline check, logs)
            follow_redirects=True,
        )

    set_client_factory(factory)
    yield hub
    set_client_factory(default_client_factory)  # also closes the mock session

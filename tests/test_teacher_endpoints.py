"""Several endpoints per teacher (``base_urls``): requests spread over them, the answer's cache key
ignores which one answered, and when one dies mid-run the others carry the rest, every request
answered exactly once (``metachunk/teacher.py``, ``EndpointGroup``)."""

from __future__ import annotations

import contextlib
import json
import signal
import threading
import time

import yaml
from support.loopback_server import serve_in_subprocess

from metachunk.cli import main

ITEMS = '[{"missing": "who she is", "supplement": "Emma Woodhouse, the heroine", "score": 9}]'


def write_job(root, base_urls, n=40):
    root.mkdir(parents=True, exist_ok=True)
    docs, chunks = root / "documents.jsonl", root / "chunks.jsonl"
    with docs.open("w") as d, chunks.open("w") as c:
        for i in range(n):
            text = (
                f"Passage {i}. Emma Woodhouse, handsome, clever, and rich, had lived {i} years in Highbury."
            )
            d.write(json.dumps({"id": f"d{i}", "text": text}) + "\n")
            c.write(
                json.dumps({"id": f"d{i}", "chunks": [{"text": text, "start": 0, "end": len(text)}]}) + "\n"
            )
    block = {"model": "loopback", "base_urls": base_urls, "max_tokens": 64, "concurrency": 4, "timeout": 5.0,
             "max_retries": 1}  # fmt: skip
    recipe = {"task": "rewrite", "documents": str(docs), "chunks": str(chunks), "out": str(root / "run"),
              "lang": "en", "progress": False,
              "teachers": {s: dict(block) for s in ("reflection", "refinement", "completion")}}  # fmt: skip
    path = root / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return path


def test_three_endpoints_one_dies_mid_run_the_others_carry_the_rest(tmp_path, capsys):
    with contextlib.ExitStack() as stack:
        # The one that dies answers after 0.25 s: a request that reaches it after the killer's snapshot of what it
        # saw cannot be answered before the kill lands, so the snapshot holds every answer it gave.
        servers = [stack.enter_context(serve_in_subprocess(latency=latency, replies={'"score"': ITEMS}))
                   for latency in (0.05, 0.05, 0.25)]  # fmt: skip
        recipe = write_job(tmp_path, [s.base_url for s in servers])
        dying = servers[2]
        seen_by_dying = {}

        def kill_when_busy():
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline:
                with contextlib.suppress(OSError):
                    stats = dying.stats()
                    if stats["requests"] >= 10:
                        seen_by_dying.update(stats["by_key"])
                        dying.process.send_signal(signal.SIGKILL)
                        return
                time.sleep(0.02)

        killer = threading.Thread(target=kill_when_busy)
        killer.start()
        code = main(["distill", "rewrite", "--config", str(recipe)])
        killer.join()
        err = capsys.readouterr().err
        assert code == 0, err
        assert dying.process.poll() is not None, "the server was not killed"
        survivors = [s.stats()["by_key"] for s in servers[:2]]

    records = [json.loads(line) for line in (tmp_path / "run" / "rewrite.jsonl").read_text().splitlines()]
    assert len(records) == 40 and all(r["status"] == "ok" for r in records)
    keys = [e["request_key"] for r in records for e in r["stages"].values()]
    assert len(keys) == len(set(keys)) == 120
    # Every key the survivors answered, they answered once and only one of them did.
    assert all(n == 1 for by_key in survivors for n in by_key.values())
    assert not set(survivors[0]) & set(survivors[1])
    # What the dead one had received and a survivor answered again: only what was in flight at the kill,
    # at most the three stages' concurrency of 4 each; an answer it had given is never asked again.
    assert len(set(seen_by_dying) & (set(survivors[0]) | set(survivors[1]))) <= 3 * 4
    # Together with what the dead one answered before it died, every request got its answer.
    assert set(keys) <= set(survivors[0]) | set(survivors[1]) | set(seen_by_dying)
    assert all(len(s) > 10 for s in survivors)  # both carried load


def test_the_cache_key_does_not_name_the_endpoint(tmp_path, capsys):
    with (
        serve_in_subprocess(replies={'"score"': ITEMS}) as a,
        serve_in_subprocess(replies={'"score"': ITEMS}) as b,
    ):
        assert (
            main(["distill", "rewrite", "--config", str(write_job(tmp_path / "one", [a.base_url], n=5))]) == 0
        )
        first = [json.loads(x) for x in (tmp_path / "one" / "run" / "rewrite.jsonl").read_text().splitlines()]
        assert (
            main(["distill", "rewrite", "--config", str(write_job(tmp_path / "two", [b.base_url], n=5))]) == 0
        )
        second = [
            json.loads(x) for x in (tmp_path / "two" / "run" / "rewrite.jsonl").read_text().splitlines()
        ]
    keys = [[e["request_key"] for e in r["stages"].values()] for r in first]
    assert keys == [[e["request_key"] for e in r["stages"].values()] for r in second]

"""Teacher prompts: versioned template files next to the stage that uses them.

``prompts/{name}.{lang}.txt`` holds a ``<<<system>>>`` part and a ``<<<user>>>`` part, filled
with ``str.format``. The sha256 of the file is the prompt's version: it is part of every
request's cache key and is recorded on every output record, so editing a prompt re-asks the
teacher for exactly the requests that prompt builds, and every answer says which text produced it.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from functools import cache
from importlib.resources import files

LANGS = ("zh", "en")


@dataclass(frozen=True)
class Prompt:
    name: str
    lang: str
    system: str
    user: str
    sha256: str

    def messages(self, **values: str) -> list[dict]:
        return [
            {"role": "system", "content": self.system},
            {"role": "user", "content": self.user.format(**values)},
        ]


@cache
def load_prompt(name: str, lang: str) -> Prompt:
    if lang not in LANGS:
        raise ValueError(f"no prompts for language {lang!r}; have {', '.join(LANGS)}")
    resource = files("distill") / "prompts" / f"{name}.{lang}.txt"
    data = resource.read_bytes()
    text = data.decode("utf-8")
    head, sep, user = text.partition("\n<<<user>>>\n")
    if not head.startswith("<<<system>>>\n") or not sep:
        raise ValueError(f"{resource}: expected a '<<<system>>>' line first and one '<<<user>>>' line")
    system = head[len("<<<system>>>\n") :].strip()
    return Prompt(name, lang, system, user.strip(), hashlib.sha256(data).hexdigest())

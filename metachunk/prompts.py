"""The prompt-file format: versioned chat templates that live next to the stage that uses them.

``PACKAGE/prompts/{name}.{lang}.txt`` holds a ``<<<system>>>`` line, the system part, a
``<<<user>>>`` line and the user part, filled with ``str.format``. The sha256 of the file's bytes
is the prompt's version: it is part of every teacher request's cache key and is recorded on every
output record and run manifest, so editing a prompt re-asks exactly the requests it builds, and
every answer says which text produced it.

Each stage keeps its own files and a small loader that knows its names: the teacher prompts
(``distill/prompts/``, `metachunk.distill.prompts.load_prompt`), the students' and MoC's prompts
(``chunking/prompts/``, `metachunk.chunking.students.load_student_prompt`,
`metachunk.chunking.moc.load_moc_prompt`), LumberChunker's (`metachunk.chunking.lumber.load_lumber_prompt`)
and the RAG answer prompt (``eval/prompts/``, `metachunk.eval.generate.load_rag_prompt`). MSP's
Table 6/7 prompts are plain completion text, not chat, and keep their own reader
(`metachunk.chunking.msp.load_msp_prompt`).

A stage whose answer must be JSON also has ``PACKAGE/prompts/{name}.schema.json``, the JSON Schema
of its answer (one per stage, for every language), versioned the same way: its sha256 is recorded
on every stage entry and run manifest, and joins a request's cache key when the request sends the
schema to the endpoint (`metachunk.teacher.TeacherConfig` ``structured_output``).
A teacher's answer schema has an object at its root (what OpenAI's strict mode and every
``json_object`` mode answer with); a schema that constrains a local model's decoding (the MoC
experts' ``chunking/prompts/moc_expert.schema.json``, `metachunk.chunking.moc`) may have any root.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from dataclasses import dataclass, field
from functools import cache
from importlib.resources import files
from pathlib import Path

LANGS = ("zh", "en")


@dataclass(frozen=True)
class Prompt:
    """A versioned prompt file: a ``<<<system>>>`` part and a ``<<<user>>>`` part filled with
    ``str.format``; ``sha256`` is the file's hash."""

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


def check_lang(lang: str) -> None:
    if lang not in LANGS:
        raise ValueError(f"no prompts for language {lang!r}; have {', '.join(LANGS)}")


def parse_prompt(name: str, lang: str, data: bytes, where) -> Prompt:
    """The prompt in ``data`` (a file's bytes; ``where`` names it in errors)."""
    text = data.decode("utf-8")
    head, sep, user = text.partition("\n<<<user>>>\n")
    if not head.startswith("<<<system>>>\n") or not sep:
        raise ValueError(f"{where}: expected a '<<<system>>>' line first and one '<<<user>>>' line")
    system = head[len("<<<system>>>\n") :].strip()
    return Prompt(name, lang, system, user.strip(), hashlib.sha256(data).hexdigest())


@cache
def load_prompt_file(package: str, name: str, lang: str) -> Prompt:
    """``{package}/prompts/{name}.{lang}.txt``, read once per process."""
    check_lang(lang)
    resource = files(package) / "prompts" / f"{name}.{lang}.txt"
    return parse_prompt(name, lang, resource.read_bytes(), resource)


@dataclass(frozen=True)
class Schema:
    """A stage's answer schema file; ``sha256`` is the file's hash, ``data`` the JSON Schema."""

    name: str
    data: dict = field(compare=False, repr=False)
    sha256: str


def parse_schema(name: str, data: bytes, where, object_root: bool = True) -> Schema:
    """The JSON Schema in ``data`` (a file's bytes), checked against its draft's metaschema;
    ``object_root``: it must describe an object (a teacher endpoint's answer)."""
    from jsonschema.exceptions import SchemaError
    from jsonschema.validators import validator_for

    try:
        schema = json.loads(data)
        validator_for(schema).check_schema(schema)
    except (ValueError, SchemaError) as e:
        raise ValueError(f"{where}: not a JSON Schema ({str(e).splitlines()[0]})") from None
    # OpenAI's strict json_schema mode and every json_object mode answer with an object.
    if object_root and schema.get("type") != "object":
        raise ValueError(f'{where}: the answer schema must have an object at its root ("type": "object")')
    return Schema(name, schema, hashlib.sha256(data).hexdigest())


@cache
def load_schema_file(package: str, name: str, object_root: bool = True) -> Schema | None:
    """``{package}/prompts/{name}.schema.json``, read once per process; None: the stage's answer is text."""
    resource = files(package) / "prompts" / f"{name}.schema.json"
    if not resource.is_file():
        return None
    return parse_schema(name, resource.read_bytes(), resource, object_root)


def prompt_files(package: str, *heads: str) -> list[Path]:
    """The prompt and schema files of ``{package}/prompts/`` whose names begin with one of
    ``heads`` (every file when none is given): what a command declares it reads."""
    folder = Path(str(files(package) / "prompts"))
    return sorted(p for p in folder.iterdir() if p.is_file() and (not heads or p.name.startswith(heads)))


def file_hashes(paths: Iterable[Path]) -> dict[str, str]:
    """``{"chunking/prompts/NAME": sha256}`` for each prompt or schema file, keyed by its stage
    folder and name (the same in a checkout and an installed wheel): the one place fingerprints
    and manifests hash prompt files."""
    out = {}
    for p in paths:
        p = Path(p)
        out[f"{p.parent.parent.name}/{p.parent.name}/{p.name}"] = hashlib.sha256(p.read_bytes()).hexdigest()
    return dict(sorted(out.items()))

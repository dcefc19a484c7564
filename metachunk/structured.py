"""Reading a JSON stage's answer: valid by its schema, repaired, or unparseable.

A stage whose answer must be JSON (its schema: `metachunk.prompts.Schema`) reads each answer
here, and every answer gets one of three outcomes, counted per stage in the run's summary:

* ``valid``: the answer is JSON (all of it, nothing around it) and the schema's validator
  (``jsonschema``) accepts it. Decoding under the schema should give only these, but the answer is
  validated anyway: grammars do not enforce every keyword (llama.cpp's ignored an integer ``minimum``).
* ``repaired``: it is not, yet the fallback got a value from it: the maintained ``json-repair``
  library when the endpoint was asked for nothing (``structured_output: none``) and what it made
  has the schema's shape (`shaped_like`), then the stage's own lenient reader (a code fence,
  prose around the JSON, elements missing a field dropped).
* ``unparseable``: neither got anything; the stage asks again (``parse_retries``).

The stage's reader (``parse``) takes text and returns its value or None, so that the same reader
serves every outcome; a ``valid`` answer whose value the reader still refuses (MoC: no chunk found
in the text) keeps its outcome, and the stage treats it as it treats any refused answer.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import TypeVar

from metachunk.prompts import Schema

T = TypeVar("T")
OUTCOMES = ("valid", "repaired", "unparseable")

_validators: dict[str, object] = {}  # by schema sha256: a validator is built once per process


def is_valid(data, schema: Schema) -> bool:
    """Whether ``data`` (decoded JSON) is an instance of ``schema``."""
    validator = _validators.get(schema.sha256)
    if validator is None:
        from jsonschema.validators import validator_for

        validator = _validators[schema.sha256] = validator_for(schema.data)(schema.data)
    return validator.is_valid(data)


_FENCE = re.compile(r"^```(?:json)?\s*|\s*```$")


def json_in_text(text: str, openers: str = "{[", whole: bool = False) -> dict | list | None:
    """The JSON object or list a model's answer holds, or None: all of the text (a code fence
    around it dropped), else from its first opening bracket in ``openers`` to the last matching
    closing one (not with ``whole``: for an answer whose other format may hold brackets). Only a
    value that one of ``openers`` opens counts (``"["``: a list).

    The lenient readers of every stage start here (a model wraps JSON in a fence or prose)."""
    kinds = tuple({"{": dict, "[": list}[opener] for opener in openers)
    text = _FENCE.sub("", text.strip())
    starts = [i for i in (text.find(opener) for opener in openers) if i >= 0]
    candidates = [text]
    if starts and not whole:
        first = min(starts)
        last = text.rfind("}" if text[first] == "{" else "]")
        if last > first:
            candidates.append(text[first : last + 1])
    for candidate in candidates:
        try:
            value = json.loads(candidate)
        except ValueError:
            continue
        if isinstance(value, kinds):
            return value
    return None


def shaped_like(data, schema: Schema, text: str) -> bool:
    """Whether a repaired value has the schema's top-level shape: its type, and an object's required
    keys; or, for an object that wraps one array (``{"chunks": [...]}``, ``{"items": [...]}``), that
    array given bare, the prompts' older shape, when the answer (``text``) is that list. json-repair
    makes JSON of whatever brackets it finds, and an answer in a stage's other format (MoC's chunks
    between dash lines) holds brackets as text: "see [2]" repairs to ``[2]``, "in [Table 3]" to
    ``["Table 3"]``, neither of which may stand for the answer. The fields inside are the stage's
    reader's to judge."""
    kind = schema.data.get("type")
    if kind == "object":
        if isinstance(data, dict):
            return all(key in data for key in schema.data.get("required", ()))
        items = _wrapped_items(schema)
        return (
            isinstance(data, list)
            and bool(data)
            and items is not None
            and _FENCE.sub("", text.strip()).startswith("[")
            and all(isinstance(x, items) for x in data)
        )
    if kind == "array":
        return isinstance(data, list) and bool(data)
    return isinstance(data, (dict, list)) and bool(data)


def _wrapped_items(schema: Schema) -> type | None:
    """The Python type of the items of the one array an object schema requires, or None."""
    required = schema.data.get("required") or []
    if len(required) != 1:
        return None
    prop = (schema.data.get("properties") or {}).get(required[0]) or {}
    if prop.get("type") != "array":
        return None
    return {"string": str, "object": dict}.get((prop.get("items") or {}).get("type"))


def read_answer(
    text: str, schema: Schema, parse: Callable[[str], T | None], repair: bool
) -> tuple[T | None, str]:
    """``(value, outcome)`` of an answer ``text``: ``parse``'s value (None when nothing could be read)
    and one of `OUTCOMES`. ``repair``: try ``json-repair`` before the stage's own reader."""
    try:
        data = json.loads(text)
    except ValueError:
        pass
    else:
        if is_valid(data, schema):
            return parse(text), "valid"
    value = None
    if repair:
        import json_repair

        repaired = json_repair.loads(text)  # "" when it finds no JSON at all
        if shaped_like(repaired, schema, text):
            value = parse(json.dumps(repaired, ensure_ascii=False))
    if value is None:
        value = parse(text)
    return value, "repaired" if value is not None else "unparseable"

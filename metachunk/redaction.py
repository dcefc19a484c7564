"""Secrets never reach a file, a log or the terminal.

Every API key the toolkit reads from the environment is registered here the moment it is read;
`redact` then replaces it, wherever it appears, by ``[REDACTED]``, together with the value
of any ``Authorization`` / ``api-key`` / ``x-api-key`` header quoted in a text (a server that
echoes the request headers in an error body) and the password part of a URL. Writers call it
before writing, not after: the answer store, records, exception messages, the CLI's error lines
and tracebacks.
"""

from __future__ import annotations

import re

MASK = "[REDACTED]"

_secrets: set[str] = set()
# `Authorization: Bearer sk-...`, `"api-key": "..."`, `x-api-key=...`: the header's value, quoted or not.
_HEADER = re.compile(
    r"""(?ix)
    (["']?(?:authorization|x-api-key|api-key|api_key)["']?\s*[:=]\s*["']?)  # the header name and separator
    (?:(bearer|basic|token)\s+)?                                            # an auth scheme, kept
    ([^\s"',;}]+)                                                           # the value
    """
)
_URL_PASSWORD = re.compile(r"(?i)\b([a-z][a-z0-9+.-]*://[^/\s:@]*:)[^/\s@]+@")


def register_secret(value: str | None) -> None:
    """Remember ``value`` (an API key, a token) so that `redact` removes it everywhere, also as a
    JSON string holds it escaped: a raw body is redacted before it is parsed, and a server may
    write ``/`` as ``\\/`` (PHP's and some Java encoders' default) or escape non-ASCII, which the
    parsed text then reads back as the key itself. Short values are refused as secrets: masking
    every "x" or "EMPTY" would garble real text."""
    if value and len(value) >= 8:
        import json

        escaped = json.dumps(value)[1:-1]
        _secrets.update(
            {value, escaped, escaped.replace("/", "\\/"), json.dumps(value, ensure_ascii=False)[1:-1]}
        )


def redact(text: str, headers: bool = True) -> str:
    """``text`` with every registered secret masked and, with ``headers``, every quoted auth
    header value and URL password too. A teacher's answer is redacted with ``headers=False``: only
    exact secrets are masked there, so that prose like "Authorization: granted" stays intact."""
    if not text:
        return text
    for secret in sorted(_secrets, key=len, reverse=True):  # a key that contains another goes first
        if secret in text:
            text = text.replace(secret, MASK)
    if not headers:
        return text
    text = _HEADER.sub(lambda m: m.group(1) + (m.group(2) + " " if m.group(2) else "") + MASK, text)
    return _URL_PASSWORD.sub(lambda m: m.group(1) + MASK + "@", text)


_private_urls: dict[str, str] = {}  # a URL kept out of the recipe -> how it is shown


def register_private_url(url: str) -> None:
    """A URL read from the environment (``base_url_env``), which may carry a token after its host (a
    gateway's account or route key): `safe_url` shows it as its scheme and host only. Only there: the
    path itself is no secret to mask in every text (``/openai/v1`` is in answers about APIs)."""
    host_end = len("/".join(url.split("/")[:3]))
    if url[host_end:]:
        _private_urls[url] = url[:host_end] + "/" + MASK


def safe_url(url: str) -> str:
    """A URL fit to print: no password, no registered secret (a key in the query string), and a
    private URL's path masked."""
    for private, shown in _private_urls.items():
        if url.startswith(private):
            url = shown + url[len(private) :]
            break
    return redact(url)

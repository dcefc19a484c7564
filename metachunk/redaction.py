"""Secrets never reach a file, a log or the terminal.

Every API key the toolkit reads from the environment is registered here the moment it is read;
`redact` then replaces it, wherever it appears, by ``[REDACTED]``, together with the value
of any ``Authorization`` / ``api-key`` / ``x-api-key`` header quoted in a text (a server that
echoes the request headers in an error body), the userinfo of a URL, a credential in a URL's query
string, and the path of a URL read from the environment. Writers call it
before writing, not after: the answer store, records, exception messages, the CLI's error lines
and tracebacks.
"""

from __future__ import annotations

import re

MASK = "[REDACTED]"

_secrets: set[str] = set()
_short_secrets: set[str] = set()  # keys of 4 to 7 characters: masked in error texts only
# `Authorization: Bearer sk-...`, `"api-key": "..."`, `x-api-key=...`: the header's value, quoted or not,
# also inside a JSON string that quotes JSON (`{\"authorization\": \"Bearer ...\"}`). Azure API Management's
# `Ocp-Apim-Subscription-Key`, OpenStack's `X-Auth-Token`, Google's `x-goog-api-key` and `apikey` gateways too.
_HEADER = re.compile(
    r"""(?ix)
    (\\?["']?(?:(?:proxy-)?authorization|x-api-key|api-key|api_key|apikey|x-goog-api-key|x-auth-token
       |ocp-apim-subscription-key)\\?["']?\s*[:=]\s*\\?["']?)              # the header name and separator
    (?:(bearer|basic|token)\s+)?                                            # an auth scheme, kept
    ((?:[^\s"',;}\\]|\\(?!["']))+)                                          # the value (\" ends it, \/ not)
    """
)
# The userinfo of a URL (``https://user:password@host``, ``https://TOKEN@host``): all of it, up to the
# host's "@" (a password may hold an "@" of its own). A scheme of at most 32 characters: an unbounded one
# made a long run of "a-a-a-..." quadratic (28 s for 100 KB).
_URL_USERINFO = re.compile(r"(?i)\b([a-z][a-z0-9+.-]{0,31}://)[^/\s?#\"'<>,;(){}|]*@")
# A credential in a URL's query string or its ``;`` parameters: a name that is, or ends in, one of these
# words (``?key=``, ``?api_key=``, ``&subscription-key=``, ``X-Amz-Security-Token=``, a signed URL's ``sig=``
# or ``X-Amz-Signature=``, ``client_secret=``); ``monkey=`` is no ``key=``: the word follows a separator.
# ``code=`` (an Azure Functions key) only as the whole name: ``country_code=`` is none.
CREDENTIAL_WORDS = ("key", "apikey", "token", "auth", "password", "passwd", "secret", "sig", "signature",
                    "credential")  # fmt: skip
_QUERY_CREDENTIAL = re.compile(
    r"(?i)([?&;](?:(?:[\w.-]*[-_.])?(?:" + "|".join(CREDENTIAL_WORDS) + r")|code)=)[^&;\s\"'#]+"
)


def register_secret(value: str | None) -> None:
    """Remember ``value`` (an API key, a token) so that `redact` removes it everywhere, also as a
    JSON string holds it escaped: a raw body is redacted before it is parsed, and a server may
    write ``/`` as ``\\/`` (PHP's and some Java encoders' default) or escape non-ASCII, which the
    parsed text then reads back as the key itself (other escapes are undone before: the teacher
    re-serialises a body it stores). A value of 4 to 7 characters that holds more than letters
    (vLLM's ``--api-key secret1``, ``1234``) is masked in error texts only: in an answer's body it
    would garble numbers and prose ("created": 17[REDACTED]5678), and a placeholder of letters
    ("EMPTY", "none") is no secret at all."""
    if value and 4 <= len(value) < 8 and not value.isalpha():
        _short_secrets.add(value)
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
    # a gateway's 404 quotes the request's path; a short key is masked where it cannot garble an answer
    for path in sorted(_private_paths | _short_secrets, key=len, reverse=True):
        if path in text:
            text = text.replace(path, MASK)
    text = _HEADER.sub(lambda m: m.group(1) + (m.group(2) + " " if m.group(2) else "") + MASK, text)
    text = _QUERY_CREDENTIAL.sub(lambda m: m.group(1) + MASK, text)
    return _URL_USERINFO.sub(lambda m: m.group(1) + MASK + "@", text)


def url_credentials(url: str) -> str | None:
    """What in ``url`` is a credential (``user:key@host``, ``?api_key=...``), said without repeating it;
    None when nothing is. Such a URL is refused where it is configured: the key belongs in the environment
    variable that ``api_key_env`` names, and the URL is written to manifests and logs."""
    authority = url.partition("://")[2].split("/")[0].split("?")[0].split("#")[0]
    if "@" in authority:
        return "credentials (user:key@host)"
    found = _QUERY_CREDENTIAL.search(url)
    return f"a credential in its query string ({found.group(1)[1:]}...)" if found else None


_private_urls: dict[str, str] = {}  # a URL kept out of the recipe -> how it is shown
_private_paths: set[str] = set()  # their paths, and the key-like segments of those, masked in error texts


def register_private_url(url: str) -> None:
    """A URL read from the environment (``base_url_env``), which may carry a token after its host (a
    gateway's account or route key): `safe_url` shows it as its scheme and host only, and `redact` masks
    its path, and each segment that looks like a key, in error texts (a server's 404 quotes the path it
    was sent). Not in answers (``headers=False``): ``/openai/v1`` is in answers about APIs, and an
    Azure deployment named after its model (``gpt-4o-2024-08-06``) in answers about models."""
    host_end = len("/".join(url.split("/")[:3]))
    path = url[host_end:].rstrip("/")
    if path:
        _private_urls[url] = url[:host_end] + "/" + MASK
        if len(path) >= 8:  # not "/v1": it is in every URL of every API
            _private_paths.add(path)
        _private_paths.update(p for p in path.split("/") if _looks_like_a_token(p))


def _looks_like_a_token(segment: str) -> bool:
    """A path segment that reads as a key, not a word (``acct-7f3a9c2e51``, not ``deployments``): masked on
    its own where an error quotes only part of the path."""
    return len(segment) >= 8 and any(c.isdigit() for c in segment) and any(c.isalpha() for c in segment)


def safe_url(url: str) -> str:
    """A URL fit to print: no password, no registered secret (a key in the query string), and a
    private URL's path masked."""
    for private, shown in _private_urls.items():
        if url.startswith(private):
            url = shown + url[len(private) :]
            break
    return redact(url)

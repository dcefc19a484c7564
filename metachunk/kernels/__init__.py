"""C kernels for the CPU work that torch's own ops leave slow, compiled on first use.

One so far, :func:`lse_rows_bf16` (``lse_rows_bf16.c``): the log-sum-exp of each row of the LM
head's bfloat16 logits, in float32, for :mod:`metachunk.scoring`. Torch's way, a float32 copy of
the tile then ``log_softmax`` in place, took 6.5 ms per 1,024 x 8,192 tile on one thread of an AMD
EPYC (Zen 4); the kernel 1.9 ms, equal to float32 ``logsumexp`` within 2e-6 (docs/performance.md).

The source ships with the package and is compiled with the system's C compiler (``$CC``, else
``cc``) into ``$METACHUNK_CACHE/kernels/`` (default ``~/.cache/metachunk/kernels``), named by a
hash of the source, the flags and the compiler, so a changed file or compiler builds anew, and
written atomically, so runs started together never load half a library. ctypes releases the GIL
for the call, so :func:`metachunk.scoring.token_nll`'s streams run it side by side.

Where a kernel cannot be had, the caller keeps torch's ops: the loader returns None and
:func:`status` says why (no AVX-512F, no compiler, a failed build, or ``METACHUNK_KERNELS=0``).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

SOURCE = Path(__file__).with_name("lse_rows_bf16.c")
FLAGS = ("-O2", "-mavx512f", "-mfma", "-shared", "-fPIC")
_why: dict[str, str] = {}


def status() -> dict[str, str]:
    """Each kernel's state, once asked for: "compiled (PATH)" or why torch's ops run instead."""
    return dict(_why)


@functools.cache
def lse_rows_bf16():
    """``f(x, out)``: ``out[r] = logsumexp(x[r])`` in float32 for a 2-D bfloat16 CPU tensor ``x``
    whose rows are contiguous, into ``out``, a float32 CPU vector of ``len(x)`` (any stride); or
    None where the kernel is not available (see :func:`status`)."""
    name = "lse_rows_bf16"
    lib = _compiled(name)
    if lib is None:
        return None
    fn = lib.lse_rows_bf16
    i64 = ctypes.c_int64
    fn.argtypes = [ctypes.c_void_p, i64, i64, i64, ctypes.c_void_p, i64]
    fn.restype = None

    def lse(x, out) -> None:
        if x.dim() != 2 or x.stride(1) != 1 or out.dim() != 1 or len(out) != len(x):
            raise ValueError(f"lse_rows_bf16: a row-contiguous 2-D tile and a vector of its rows, got "
                             f"{tuple(x.shape)} (strides {x.stride()}) and {tuple(out.shape)}")  # fmt: skip
        fn(x.data_ptr(), x.shape[0], x.shape[1], x.stride(0), out.data_ptr(), out.stride(0))

    return lse


def _compiled(name: str) -> ctypes.CDLL | None:
    from metachunk.models import cache_dir, cpu_flags

    if os.environ.get("METACHUNK_KERNELS", "1") == "0":
        _why[name] = "off (METACHUNK_KERNELS=0)"
        return None
    if "avx512f" not in cpu_flags():
        _why[name] = "the CPU has no AVX-512F"
        return None
    cc = os.environ.get("CC") or "cc"
    if shutil.which(cc) is None:
        _why[name] = f"no C compiler ({cc!r} not found; set CC)"
        return None
    try:
        version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError) as e:
        _why[name] = f"{cc} --version failed: {e}"
        return None
    key = hashlib.sha256(SOURCE.read_bytes() + repr((FLAGS, version)).encode()).hexdigest()[:16]
    target = cache_dir() / "kernels" / f"{name}-{key}.so"
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
            built = Path(tmp) / target.name
            command = [cc, *FLAGS, str(SOURCE), "-o", str(built)]
            try:
                run = subprocess.run(command, capture_output=True, text=True, timeout=300)
            except (OSError, subprocess.SubprocessError) as e:
                _why[name] = f"{cc} failed: {e}"
                return None
            if run.returncode != 0:
                _why[name] = f"{cc} failed: {(run.stderr or run.stdout).strip()[-500:]}"
                return None
            os.replace(built, target)
    try:
        lib = ctypes.CDLL(str(target))
    except OSError as e:
        _why[name] = f"loading {target} failed: {e}"
        return None
    _why[name] = f"compiled ({target})"
    return lib

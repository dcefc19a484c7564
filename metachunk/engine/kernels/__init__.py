"""C kernels for the CPU work that torch's own ops leave slow, compiled on first use.

One so far, `lse_rows_bf16` (``lse_rows_bf16.c``): the log-sum-exp of each row of the LM
head's bfloat16 logits, in float32, for `metachunk.engine.scoring`. Torch's way, a float32 copy of
the tile then ``log_softmax`` in place, took 6.5 ms per 1,024 x 8,192 tile on one thread of an AMD
EPYC (Zen 4); the kernel 1.9 ms, equal to float32 ``logsumexp`` within 2e-6 (docs/performance.md).

The source ships with the package and is compiled with the system's C compiler (``$CC``, else
``cc``) into ``$METACHUNK_CACHE/kernels/`` (default ``~/.cache/metachunk/kernels``), named by a
hash of the source, the flags and the compiler, so a changed file or compiler builds anew, and
written atomically, so runs started together never load half a library. ctypes releases the GIL
for the call, so `metachunk.engine.scoring.token_nll`'s streams run it side by side.

Where a kernel cannot be had, the caller keeps torch's ops: the loader returns None and
`status` says why (no AVX-512F, no compiler, a failed build, or ``METACHUNK_KERNELS=0``).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shlex
import shutil
import subprocess
import tempfile
from pathlib import Path

SOURCE = Path(__file__).with_name("lse_rows_bf16.c")
FLAGS = ("-O2", "-mavx512f", "-mfma", "-shared", "-fPIC", "-lm")
_why: dict[str, str] = {}


def status() -> dict[str, str]:
    """Each kernel's state, once asked for: "compiled (PATH)" or why torch's ops run instead."""
    return dict(_why)


@functools.cache
def lse_rows_bf16():
    """``f(x, out)``: ``out[r] = logsumexp(x[r])`` in float32 for a 2-D bfloat16 CPU tensor ``x``
    whose rows are contiguous, into ``out``, a float32 CPU vector of ``len(x)`` (any stride); or
    None where the kernel is not available (see `status`)."""
    name = "lse_rows_bf16"
    lib = _compiled(name)
    if lib is None:
        return None
    fn = lib.lse_rows_bf16
    i64 = ctypes.c_int64
    fn.argtypes = [ctypes.c_void_p, i64, i64, i64, ctypes.c_void_p, i64]
    fn.restype = None

    def lse(x, out) -> None:
        import torch

        ok = (x.dtype == torch.bfloat16 and out.dtype == torch.float32 and x.device.type == out.device.type == "cpu"
              and x.dim() == 2 and x.stride(1) == 1 and out.dim() == 1 and len(out) == len(x))  # fmt: skip
        if not ok:  # the C code trusts its pointers: anything else would read or write out of bounds
            raise ValueError(f"lse_rows_bf16: a row-contiguous 2-D bfloat16 CPU tile and a float32 CPU vector "
                             f"of its rows, got {x.dtype} {tuple(x.shape)} (strides {x.stride()}) on {x.device} "
                             f"and {out.dtype} {tuple(out.shape)} on {out.device}")  # fmt: skip
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
    cc = shlex.split(os.environ.get("CC", "")) or ["cc"]  # "ccache gcc" too
    if shutil.which(cc[0]) is None:
        _why[name] = f"no C compiler ({cc[0]!r} not found; set CC)"
        return None
    try:
        version = subprocess.run([*cc, "--version"], capture_output=True, text=True, timeout=30).stdout
        key = hashlib.sha256(SOURCE.read_bytes() + repr((FLAGS, version)).encode()).hexdigest()[:16]
        target = cache_dir() / "kernels" / f"{name}-{key}.so"
        if not target.exists():
            target.parent.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
                built = Path(tmp) / target.name
                run = subprocess.run([*cc, str(SOURCE), *FLAGS, "-o", str(built)],
                                     capture_output=True, text=True, timeout=300)  # fmt: skip
                if run.returncode != 0:
                    _why[name] = f"{' '.join(cc)} failed: {(run.stderr or run.stdout).strip()[-500:]}"
                    return None
                # atomic: a run started alongside loads a whole library or builds its own
                os.replace(built, target)
        lib = ctypes.CDLL(str(target))
    except (OSError, subprocess.SubprocessError) as e:  # a read-only cache, a hung compiler, a bad library
        _why[name] = f"building or loading the kernel failed: {e}"
        return None
    _why[name] = f"compiled ({target})"
    return lib

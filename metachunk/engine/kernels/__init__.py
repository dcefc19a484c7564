"""Kernels for the LM head's log-sum-exp where torch's own ops leave it slow, built on first use:
a C kernel on CPU, and on a GPU the same reduction compiled by ``torch.compile``
(`lse_rows_compiled`).

One so far, `lse_rows_bf16` (``lse_rows_bf16.c``): the log-sum-exp of each row of the LM
head's bfloat16 logits, in float32, for `metachunk.engine.scoring`. Torch's way writes a float32 copy
of the tile, then ``log_softmax`` reads and rewrites it; the kernel reads the bf16 rows once and
reduces them in float32, equal to float32 ``logsumexp`` within 2e-6 (its speed on one thread:
docs/performance.md).

The source ships with the package and is compiled with the system's C compiler (``$CC``, else
``cc``) into ``$METACHUNK_CACHE/kernels/`` (default ``~/.cache/metachunk/kernels``), named by a
hash of the source, the flags and the compiler, so a changed file or compiler builds anew, and
written atomically, so runs started together never load half a library. ctypes releases the GIL
for the call, so `metachunk.engine.scoring.token_nll`'s streams run it side by side.

Where a kernel cannot be had, the caller keeps torch's ops: the loader returns None and
`status` says why (no AVX-512F, no compiler, a failed build, or ``METACHUNK_KERNELS=0``).

On a GPU the head is bound by memory, not by its matmul: for each 8,192 x 32,768 tile of bf16
logits (0.5 GB), torch's ops write a float32 copy (1 GB) and ``log_softmax`` reads and rewrites
it, ~5 GB of traffic for one float per row. `lse_rows_compiled` is ``logsumexp(x.float())`` as one
kernel (Inductor's Triton reduction, the cast fused into its loads), which reads the tile and
writes nothing else.
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


# The devices whose bf16 head tiles take `lse_rows_compiled` (CPUs have the C kernel, which also
# needs no compile at load).
COMPILED_LSE_DEVICES = ("cuda",)


@functools.cache
def lse_rows_compiled(device: str = "cuda:0"):
    """``f(x) -> logsumexp(x.float(), dim=-1)`` for a contiguous 2-D tile of bf16 logits on
    ``device`` (``str(tensor.device)``: the graph is compiled for one device), compiled by
    ``torch.compile`` into one kernel; or None where that cannot be had (see `status`).

    Compiled once per process with dynamic shapes: one graph serves every tile of at least two rows
    and two columns, and Dynamo specializes a size of 1 into a second (a tensor that is a view of
    another, such as a slice of a reused buffer, would add guards on its base and strides, so the
    caller passes fresh tiles). Both are compiled here, on small tiles checked against torch's ops;
    a compiler that fails (no Triton, no C compiler for its launcher) or disagrees leaves torch's
    ops in place. `metachunk.engine.scoring.warm_up_head` calls it while a model loads."""
    name = f"lse_rows_compiled ({device})"
    if os.environ.get("METACHUNK_KERNELS", "1") == "0":
        _why[name] = "off (METACHUNK_KERNELS=0)"
        return None
    import torch

    def lse_rows(x):
        return torch.logsumexp(x.float(), dim=-1)

    try:
        compiled = torch.compile(lse_rows, dynamic=True, fullgraph=True)
        generator = torch.Generator(device=device).manual_seed(0)
        # Under inference mode, as the engine calls it: Dynamo guards on the grad mode.
        with torch.inference_mode():
            for shape in ((64, 1000), (1, 1000)):
                x = (torch.randn(shape, generator=generator, device=device) * 8).to(torch.bfloat16)
                error = (compiled(x) - lse_rows(x)).abs().max().item()
                if not error <= 1e-4:  # fp32 rounding of values near 30 is ~4e-6
                    _why[name] = f"compiled, but {error:.2e} off torch's ops on a test tile: not used"
                    return None
    except torch.OutOfMemoryError:  # the device is full, not the compiler broken: as any batch would
        raise
    except Exception as e:  # an Inductor or Triton failure of any kind: torch's ops run instead
        if isinstance(getattr(e, "inner_exception", None), torch.OutOfMemoryError):
            raise  # Dynamo wraps what its backend raised (BackendCompilerFailed): full, not broken
        _why[name] = f"torch.compile failed: {type(e).__name__}: {str(e).strip()[:500]}"
        return None
    _why[name] = "compiled (torch.compile)"
    return compiled


def _compiled(name: str) -> ctypes.CDLL | None:
    from metachunk.artifacts import cache_dir
    from metachunk.models import cpu_flags

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

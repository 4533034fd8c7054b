"""The suite's C kernels: built on first use with the system's C compiler, loaded with ``ctypes``.

A kernel's source sits beside its module (``variants/*.c``, shipped as package data). It is built once
per machine into ``$ATTNBENCH_CACHE`` (default ``~/.cache/attnbench``), named by a hash of the source,
the flags and the compiler, with ``$CC`` (default ``cc``) and :data:`FLAGS`. Where it cannot be built
or loaded, :meth:`CKernel.load` returns None and :attr:`CKernel.error` says why in one line: the
caller falls back to PyTorch and its record says which ran.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path

FLAGS = ("-O3", "-march=native", "-ffast-math", "-fopenmp", "-shared", "-fPIC")


def cache_dir() -> Path:
    """Where built kernels are kept."""
    return Path(os.environ.get("ATTNBENCH_CACHE", Path.home() / ".cache" / "attnbench"))


class CKernel:
    """One C source, built and loaded at most once per process (see the module docstring).

    ``declare`` sets the ``restype``/``argtypes`` of the library's functions after it loads."""

    def __init__(self, source: str, what: str, declare: Callable[[ctypes.CDLL], None]) -> None:
        self.source = Path(__file__).with_name(source)
        self.what = what  # the kernel's name in messages ("the decode kernel")
        self.declare = declare
        self.lib: ctypes.CDLL | None = None
        self.error: str | None = None

    def load(self) -> ctypes.CDLL | None:
        """The built library (built now if needed), or None if it cannot be built or loaded."""
        if self.lib is not None or self.error is not None:
            return self.lib
        cc = os.environ.get("CC", "cc")
        src = self.source.read_bytes()
        tag = hashlib.sha256(src + " ".join((cc, *FLAGS)).encode()).hexdigest()[:16]
        lib = cache_dir() / f"{self.source.stem}-{tag}.so"
        try:
            if not lib.exists():
                lib.parent.mkdir(parents=True, exist_ok=True)
                # built beside its final name and renamed: jobs starting together never load half a file
                fd, tmp = tempfile.mkstemp(suffix=".so", dir=lib.parent)
                os.close(fd)
                run = subprocess.run(
                    [cc, *FLAGS, "-o", tmp, str(self.source), "-lm"],
                    capture_output=True,
                    text=True,
                    timeout=120,
                )
                if run.returncode != 0:
                    os.unlink(tmp)
                    first = (run.stderr.strip().splitlines() or ["no message"])[0]
                    self.error = f"{cc} could not build {self.source.name}: {first}"
                    return None
                os.replace(tmp, lib)
            self.lib = ctypes.CDLL(str(lib))
        except (OSError, subprocess.SubprocessError) as exc:
            self.error = f"{self.what} could not be built or loaded with {cc}: {exc}"
            return None
        self.declare(self.lib)
        return self.lib

    def unusable(self, refusal: str | None) -> str | None:
        """Why a call cannot run on this kernel here: ``refusal`` (what the kernel cannot take), else
        why it could not be built; None if it can run."""
        if refusal is None and self.load() is None:
            return self.error
        return refusal

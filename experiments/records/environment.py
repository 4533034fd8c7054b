"""What machine and software a record was measured on, so records from many machines can merge."""

from __future__ import annotations

import functools
import hashlib
import os
import platform
import socket
import subprocess
import sys
from importlib import metadata
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[2]  # the checkout: this file is experiments/records/environment.py


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def cpu_model() -> str:
    """The CPU's model name as ``/proc/cpuinfo`` gives it (else what :mod:`platform` knows)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cpu_capability() -> str:
    """The widest vector instruction set torch's CPU kernels dispatch to on this machine ("AVX512",
    "AVX2", "DEFAULT", ...). Two hosts of one cloud machine type can share a model name ("AMD EPYC")
    and differ here, and with it in GEMM rate and in which kernels win (docs/methodology.md)."""
    return torch.backends.cpu.get_cpu_capability()


def _git(*args: str) -> str | None:
    try:
        out = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=10, check=True)
        return out.stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None


#: the sources of the measured and measuring code: the variants (their C kernels included), the
#: integrations and the harness; the report's code reads records and makes none, so it is left out
#: (a report-only change does not send every record to be measured again)
CODE_SOURCES = ("*.py", "*.c", "*.h")
NOT_MEASURING = ("experiments/report",)


@functools.cache
def code_version() -> str:
    """Hash of the measuring and measured code (:data:`CODE_SOURCES` under variants/, integrations/ and
    experiments/, but not :data:`NOT_MEASURING`).

    A record is reused on resume only if it was made by the same code, whether or not git is there.
    """
    h = hashlib.sha256()
    for pkg in ("variants", "integrations", "experiments"):
        files = {f for pattern in CODE_SOURCES for f in (ROOT / pkg).rglob(pattern)}
        for f in sorted(files):
            rel = f.relative_to(ROOT).as_posix()
            if rel.startswith(NOT_MEASURING):
                continue
            h.update(rel.encode())
            h.update(f.read_bytes())
    return h.hexdigest()[:12]


def c_compiler() -> str | None:
    """The first line of ``$CC --version`` (``cc`` when unset), the compiler that builds the suite's C
    kernels; None when there is none (the variants then run their PyTorch paths)."""
    cc = os.environ.get("CC", "cc")
    try:
        out = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=10, check=True)
    except (OSError, subprocess.SubprocessError):
        return None
    return (out.stdout.strip().splitlines() or [cc])[0]


#: environment variables that change how fast a kernel runs and that no other field of a record says:
#: OpenMP's thread waiting and binding (beside one busy core of this project's 2-core VM, a test file
#: of small fwd+bwd jobs took 38 s with a sleeping wait and 79 s with the spinning default), MKL's and
#: oneDNN's instruction-set caps, torch's CPU dispatch, a preloaded allocator, CUDA's synchronous
#: launches, cuBLAS's and TF32's switches, Inductor's and torch's allocator settings. Names (or
#: prefixes, ending in ``_``) as the libraries read them.
SPEED_SETTINGS = (
    "OMP_", "GOMP_", "KMP_", "MKL_", "ONEDNN_", "DNNL_", "ATEN_CPU_CAPABILITY", "LD_PRELOAD",
    "CUDA_LAUNCH_BLOCKING", "CUBLAS_", "NVIDIA_TF32_OVERRIDE", "TORCHINDUCTOR_", "PYTORCH_CUDA_ALLOC_CONF",
)  # fmt: skip


def speed_settings(environ: dict[str, str] | None = None) -> str | None:
    """The :data:`SPEED_SETTINGS` set in ``environ`` (this process's environment by default), as
    ``"NAME=value; ..."`` sorted by name, or None when none is set (what records from before the field
    mean too, so they still resume). ``O(len(environ))``."""
    env = os.environ if environ is None else environ
    found = sorted(f"{k}={v}" for k, v in env.items() if k.startswith(SPEED_SETTINGS) and v)
    return "; ".join(found) or None


#: the suffixes of the native sources a module may build and load from beside itself (a data file of
#: the module's name, weights say, is not hashed: it may be large, and it is not code)
_NATIVE_SOURCES = (".c", ".cc", ".cpp", ".cu", ".h", ".hpp")


def variant_code_files(cls: type) -> list[Path]:
    """The source files whose code ``cls`` runs: the modules of ``cls`` and its attention base classes
    (torch's and builtins' left out), every module of their packages those modules reach through
    their globals (a name imported from it, or the module itself), transitively, and beside each such
    module the native sources of its name (``sparse_kernel.py``'s ``sparse_kernel.c``).
    ``flex`` reaches ``variants/flex_kernel.py``, ``naive`` does not. Sorted by module name;
    ``O(modules x globals)``, a handful of modules for a built-in variant."""
    import inspect
    import types

    start = {c.__module__ for c in cls.__mro__ if c.__module__.split(".")[0] not in ("torch", "builtins")}
    packages = {m.split(".")[0] for m in start}
    seen, todo = set(start), list(start)
    while todo:
        module = sys.modules.get(todo.pop())
        for value in vars(module).values() if module is not None else ():
            name = (
                value.__name__ if isinstance(value, types.ModuleType) else getattr(value, "__module__", None)
            )
            if isinstance(name, str) and name.split(".")[0] in packages and name not in seen:
                seen.add(name)
                todo.append(name)
    files: list[Path] = []
    for name in sorted(seen):
        try:
            src = inspect.getsourcefile(sys.modules[name])
        except (KeyError, TypeError):
            continue
        if src:
            path = Path(src)
            files += [
                path,
                *sorted(f for f in path.parent.glob(f"{path.stem}.*") if f.suffix in _NATIVE_SOURCES),
            ]
    return files


def variant_code_version(cls: type) -> str:
    """Hash of the source files ``cls`` runs (:func:`variant_code_files`: its own, its attention base
    classes', the modules of their packages they use, and C sources beside them; a third-party
    variant's own files included), so resume never reuses a record made by other kernel code, and a
    comparison names the variants whose code changed."""
    h = hashlib.sha256()
    for path in variant_code_files(cls):
        h.update(path.read_bytes())
    return h.hexdigest()[:12]


def gpu_info() -> dict[str, object]:
    """Name, memory and driver of the GPU torch calls device 0 as ``nvidia-smi`` reports them, or an
    empty dict: the first of ``$CUDA_VISIBLE_DEVICES`` where it is set (none visible: empty), else
    GPU 0.

    Asked of ``nvidia-smi``, not torch, on purpose: the sweep's own process must not create a CUDA
    context (it would hold GPU memory for the whole sweep). A CUDA job adds torch's own view of the
    device it ran on (:func:`experiments.measure.kernel.torch_gpu_info`, called in the job's process).
    """
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    first = None if visible is None else visible.split(",")[0].strip()
    if first is not None and (not first or first.startswith("-")):
        return {}  # torch sees no GPU (an empty list or -1), so no job runs on one
    try:
        out = subprocess.run(
            [
                "nvidia-smi",
                *([] if first is None else ["-i", first]),  # an index or a UUID, as nvidia-smi takes them
                "--query-gpu=name,memory.total,driver_version,compute_cap",
                "--format=csv,noheader,nounits",
            ],
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        )
        name, mem_mib, driver, cap = (s.strip() for s in out.stdout.strip().splitlines()[0].split(","))
    except (OSError, subprocess.SubprocessError, IndexError, ValueError):
        return {}
    try:
        mem_gib: object = round(float(mem_mib) / 1024, 1)
    except ValueError:
        mem_gib = None
    return {"gpu_name": name, "gpu_memory_gib": mem_gib, "gpu_driver": driver, "gpu_capability": cap}


@functools.cache
def _static_environment() -> dict[str, object]:
    dirty = _git("status", "--porcelain", "--untracked-files=no")
    return {
        "host": socket.gethostname(),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu_model": cpu_model(),
        "cpu_capability": cpu_capability(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
        "xformers": _version("xformers"),
        "triton": _version("triton"),
        "transformers": _version("transformers"),
        "hydra": _version("hydra-core"),
        "c_compiler": c_compiler(),
        "git_commit": _git("rev-parse", "--short=12", "HEAD"),
        "git_dirty": None if dirty is None else bool(dirty),
        "code_version": code_version(),
        "speed_settings": speed_settings(),
    }


def kind_environment(kind: str, pretrained: dict[str, Any] | None = None) -> dict[str, object]:
    """The library versions only one kind of job runs on, for its record and resume: a pretrained job
    (``kind == "pretrained"``) reads its weights from the encoder package ``pretrained["package"]``
    (``pretrained_package_version``) and turns its texts into token ids with ``tokenizers``; other kinds
    get ``{}``, so a new tokenizers or weights release never sends a kernel record to be measured again."""
    if kind != "pretrained":
        return {}
    package = str((pretrained or {}).get("package") or "")
    return {
        "pretrained_package_version": _version(package.replace("_", "-")) if package else None,
        "tokenizers": _version("tokenizers"),
    }


def environment() -> dict[str, object]:
    """The machine and library versions, plus the current thread count and GPU."""
    env = dict(_static_environment())
    env["threads"] = torch.get_num_threads()
    env.update(gpu_info())
    return env

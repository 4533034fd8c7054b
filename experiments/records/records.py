"""Records: one JSON file per job, written atomically; found again by config hash on resume."""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..measure.spec import JobSpec

SCHEMA_VERSION = 1

# config fields that say how to run a job, not what is measured: they do not enter the hash
_NOT_HASHED = {
    "records_dir",
    "isolate",
    "timeout_s",
    "settle_s",
    "retry_unstable",
    "resume",
    "progress",
    "report",
    "objective",
    "roofline",
}
# fields added after records were committed: at their default (null) they are left out, so the configs
# of older records hash as before and resume finds them
_HASHED_UNLESS_NULL = {"kv_heads", "scale", "bias", "model", "pretrained"}
# likewise, fields added later whose default is not null: left out at that default
_HASHED_UNLESS_DEFAULT = {"round": 0, "documents": 1, "grad_check_scores": JobSpec.grad_check_scores}


#: a sweep folder's list of the records its jobs wrote (one JSON object per line, appended)
MANIFEST = "manifest.jsonl"


def config_hash(cfg: dict[str, Any]) -> str:
    """Stable 16-hex-digit hash of the measured configuration (key order does not matter)."""
    measured = {
        k: v
        for k, v in cfg.items()
        if k not in _NOT_HASHED
        and not (k in _HASHED_UNLESS_NULL and v is None)
        and not (k in _HASHED_UNLESS_DEFAULT and v == _HASHED_UNLESS_DEFAULT[k])
    }
    blob = json.dumps(measured, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def write_record(record: dict[str, Any], directory: str | Path) -> Path:
    """Write ``record`` as ``<hash>-<time>-<pid>.json`` in ``directory`` atomically; return the path.

    The temporary file lives in the same folder so ``os.replace`` is a rename: an interrupted job
    leaves either nothing or a whole record.
    """
    directory = Path(directory)
    stamp = record.get("started_at", "").replace(":", "").replace("-", "")[:15]
    final = directory / f"{record['config_hash']}-{stamp}-{os.getpid()}.json"
    return write_json_atomic(final, record)


def write_json_atomic(final: Path, obj: object) -> Path:
    """Write ``obj`` as JSON to ``final`` through a temporary file in the same folder and a rename,
    readable by group and others (a shared results folder); returns ``final``."""
    final.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=final.parent, prefix=".tmp-", suffix=".json")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(obj, f, indent=1, sort_keys=True, default=str)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)  # mkstemp makes it 0600
        os.replace(tmp, final)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return final


def read_json(path: Path) -> dict[str, Any] | None:
    """The JSON object in ``path``, or None when it is missing or unreadable (a ceiling or canary
    file another job is writing)."""
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


#: every status a job's record may have, in the order tables list them
STATUSES = ("ok", "unsupported", "unavailable", "oom", "killed", "timeout", "nan", "error")


#: a record's parts that are JSON objects where present (null allowed): the store flattens them
_OBJECT_PARTS = ("figures", "variant", "roofline")
#: config fields that hold a whole number or null: tables group, sort and plot by them
_WHOLE_CONFIG = (
    "batch", "tokens", "heads", "seq_len", "kv_len", "kv_heads", "head_dim", "v_head_dim", "threads",
    "seed", "round", "documents",
)  # fmt: skip
#: figures that are numbers or null wherever they appear: the timings the tables and plots divide
_TIME_FIGURES = ("_median_s", "_iqr_s")


def _kind_of_value(v: object) -> str:
    return "null" if v is None else type(v).__name__


def record_problem(rec: dict[str, Any]) -> str | None:
    """Why ``rec``, a JSON object with a ``config_hash`` and a ``status``, is not a whole record (None
    when it is): a record holds its config and environment, and a status of :data:`STATUSES`; its
    figures, variant description, ceiling and ``config.variant`` are objects, its sizes whole numbers
    and its timings numbers (a hand-edited or foreign file would otherwise break a report midway)."""
    missing = [k for k in ("config", "env") if not isinstance(rec.get(k), dict)]
    if missing:
        return f"a record's hash and status, but no {' or '.join(missing)}"
    if rec["status"] not in STATUSES:
        return f"status {rec['status']!r} is none of {', '.join(STATUSES)}"
    cfg = rec["config"]
    parts = {**{k: rec.get(k) for k in _OBJECT_PARTS}, "config.variant": cfg.get("variant")}
    for name, part in parts.items():
        if part is not None and not isinstance(part, dict):
            return f"its {name} is a {_kind_of_value(part)}, not an object"
    for k in _WHOLE_CONFIG:
        v = cfg.get(k)
        if v is not None and (isinstance(v, bool) or not isinstance(v, int)):
            return f"its config.{k} is {v!r}, not a whole number"
    for k, v in (rec.get("figures") or {}).items():
        if (
            k.endswith(_TIME_FIGURES)
            and v is not None
            and (isinstance(v, bool) or not isinstance(v, (int, float)))
        ):
            return f"its figures.{k} is {v!r}, not a number"
    return None


def read_records(directory: str | Path) -> list[dict[str, Any]]:
    """All records under ``directory`` (recursively); unreadable files are reported, not dropped silently."""
    out = []
    for path in sorted(Path(directory).rglob("*.json")):
        if path.name.startswith(".tmp-"):
            continue
        try:
            rec = json.loads(path.read_text())
        except (OSError, ValueError) as exc:  # ValueError: bad JSON or bytes that are not UTF-8
            print(f"warning: skipping unreadable record {path}: {exc}")
            continue
        if not (isinstance(rec, dict) and "config_hash" in rec and "status" in rec):
            continue  # another JSON (a script's output, a roofline file): not a record
        why = record_problem(rec)
        if why is not None:
            print(f"warning: skipping {path}: {why}")
            continue
        rec["_path"] = str(path)
        out.append(rec)
    return out


#: statuses a re-run would reproduce: only these are reused on resume (error, timeout, killed, nan
#: and unavailable may come out otherwise after a fix, a longer timeout or an install)
REUSABLE = frozenset({"ok", "unsupported", "oom"})
#: what must match between a record's ``env`` and this run's for the record to be reused: the
#: measuring code (the C kernels' sources included), the variant's own source (third-party plugins
#: included), torch and CUDA, Python (the pretrained experiment's corpus is its standard library's
#: docstrings), the machine, the threads the job runs on (``threads=null`` takes every CPU it may
#: use), the C allocator's settings, the compiler that builds the C kernels (none: the PyTorch paths
#: run), and the libraries some variants and jobs run on; a pretrained job's weights package and
#: tokenizers are in the env of pretrained records only
#: (:func:`~experiments.records.environment.kind_environment`), so other kinds compare None with None
FINGERPRINT = (
    "code_version", "variant_code", "torch", "cuda", "python", "host", "cpu_model", "cpu_capability",
    "gpu_name", "job_threads", "malloc", "c_compiler", "xformers", "triton", "transformers",
    "pretrained_package_version", "tokenizers", "speed_settings",
)  # fmt: skip


def find_existing(
    directory: str | Path,
    chash: str,
    env: dict[str, Any],
    not_reusable: Callable[[dict[str, Any]], str | None] | None = None,
) -> Path | None:
    """A record of this config (hash ``chash``) that resume may reuse, if any: its status is in
    :data:`REUSABLE`, its environment matches ``env`` on every :data:`FINGERPRINT` field, and
    ``not_reusable(record)`` (the sweep's check of its figures) gives no reason against it; a record
    it refuses is named in a warning and measured again."""
    directory = Path(directory)
    if not directory.is_dir():
        return None
    for path in sorted(directory.glob(f"{chash}-*.json"), reverse=True):  # newest first
        try:
            rec = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            print(f"warning: skipping unreadable record {path}: {type(exc).__name__}: {exc}"[:300])
            continue
        if not isinstance(rec, dict) or not isinstance(rec.get("env"), dict):
            print(f"warning: skipping {path}: not a record")
            continue
        if rec.get("status") not in REUSABLE:
            continue
        if not all(rec["env"].get(k) == env.get(k) for k in FINGERPRINT):
            continue
        why = not_reusable(rec) if not_reusable is not None else None
        if why is not None:
            print(f"warning: not reusing {path}: {why}; measuring again"[:300])
            continue
        return path
    return None


def unwritable_dir(path: Path) -> str | None:
    """Why a file cannot be written in folder ``path`` (made with its parents if missing), or None.
    Tried for real, not asked of ``os.access``, which says yes to root on any mount; the folders it
    made are removed again (whoever writes there makes them then: Hydra, the report)."""
    if path.exists() and not path.is_dir():
        return "it is a file, not a folder"
    made = [p for p in (path, *path.parents) if not p.exists()]  # deepest first
    try:
        path.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path, prefix=".tmp-probe-")
        os.close(fd)
        os.unlink(tmp)
    except OSError as exc:
        return exc.strerror or str(exc)
    finally:
        for p in made:
            try:
                p.rmdir()
            except OSError:  # never made, or another process filled it meanwhile
                pass
    return None

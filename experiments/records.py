"""Records: one JSON file per job, written atomically; found again by config hash on resume."""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path
from typing import Any

SCHEMA_VERSION = 1

# config fields that say how to run a job, not what is measured: they do not enter the hash
_NOT_HASHED = {"records_dir", "isolate", "timeout_s", "resume", "progress", "report"}


def config_hash(cfg: dict[str, Any]) -> str:
    """Stable 16-hex-digit hash of the measured configuration (key order does not matter)."""
    measured = {k: v for k, v in cfg.items() if k not in _NOT_HASHED}
    blob = json.dumps(measured, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def write_record(record: dict[str, Any], directory: str | Path) -> Path:
    """Write ``record`` as ``<hash>-<time>-<pid>.json`` in ``directory`` atomically; return the path.

    The temporary file lives in the same folder so ``os.replace`` is a rename: an interrupted job
    leaves either nothing or a whole record.
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    stamp = record.get("started_at", "").replace(":", "").replace("-", "")[:15]
    final = directory / f"{record['config_hash']}-{stamp}-{os.getpid()}.json"
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=".tmp-", suffix=".json")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(record, f, indent=1, sort_keys=True, default=str)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, final)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return final


def read_records(directory: str | Path) -> list[dict[str, Any]]:
    """All records under ``directory`` (recursively); unreadable files are reported, not dropped silently."""
    out = []
    for path in sorted(Path(directory).rglob("*.json")):
        if path.name.startswith(".tmp-"):
            continue
        try:
            rec = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            print(f"warning: skipping unreadable record {path}: {exc}")
            continue
        if isinstance(rec, dict) and "config_hash" in rec and "status" in rec:
            rec["_path"] = str(path)
            out.append(rec)
    return out


def find_existing(directory: str | Path, chash: str, code_version: str, host: str) -> Path | None:
    """A record of this config made by the same code on the same host, if any (for resume)."""
    directory = Path(directory)
    if not directory.is_dir():
        return None
    for path in sorted(directory.glob(f"{chash}-*.json")):
        try:
            rec = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError):
            continue
        env = rec.get("env", {})
        if env.get("code_version") == code_version and env.get("host") == host:
            return path
    return None

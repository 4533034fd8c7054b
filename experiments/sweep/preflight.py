"""Command-line checks before Hydra composes anything: bad values get one line, not Hydra's page.

``run.py`` passes ``sys.argv`` through :func:`preflight`, which

- refuses a setting the config does not have (``seqlen=64`` or ``+seqlen=64``, which Hydra would
  add and no job would read) with one line naming the closest known ones;
- refuses a list of a config group's options (``variant=[sdpa,naive]``, which Hydra merges into one
  config) with one line giving the sweep that was meant (``-m variant=sdpa,naive``);
- refuses an unknown variant (``variant=nosuch``), named sweep or other group option
  (``experiment=nosuch``, ``+task=nosuch``) or an enum value the schema does not know (``dtype=fp8``)
  with one line naming what is known, and exit code 1;
- gives Hydra's own composition errors one line: a value of the wrong type (``seq_len=abc``) or a
  Hydra group option that does not exist (``hydra/launcher=jobilb``, with the available ones);
- turns ``variant.<knob>=<value>`` into ``++variant.<knob>=<value>``, so a knob the variant's config
  file does not list reaches the runner, which names the variant's real knobs in one line
  (``unknown knob 'windo' for local_window; knobs: window, block``) instead of Hydra asking for ``+``.

Then it composes each job the command line's own comma lists make (up to :data:`MAX_CHECKED` of them)
and runs the job's checks on it (:func:`experiments.sweep.checks.check_job`: value ranges, knobs,
building the variant), so ``seq_len=0`` or ``variant.window=-5`` is one line and exit code 1 before
any job is launched, in a sweep as in a single run. Sweep syntax that is not a plain comma list
(``glob(...)``, ``range(...)``, ``choice(...)``) is left to Hydra; the jobs check themselves again.
"""

from __future__ import annotations

import dataclasses
import difflib
import fnmatch
import itertools
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..measure.spec import CHOICES
from ..records.records import unwritable_dir
from .schema import BenchConfig

CONF = Path(__file__).resolve().parents[2] / "conf"
#: the settings that are booleans: only true and false are taken (OmegaConf would read yes, on or 2)
BOOLEANS = frozenset(f.name for f in dataclasses.fields(BenchConfig) if f.type == "bool")
#: jobs of the command line's own comma lists checked before launch (beyond: each job checks itself)
MAX_CHECKED = 64
_PLAIN = re.compile(r"^[^()\[\]{}'\"$]*$")  # a plain value or comma list, no sweep functions
_LIST = re.compile(r"^\[[^()\[\]{}'\"$]*\]$")  # one list of plain values: [0,5], [] (no sweep inside)


def known_variants() -> list[str]:
    """Names ``variant=`` accepts: the config files under ``conf/variant`` (``pretrained/sparse_b16`` for
    one in a subfolder: a registered variant with preset knobs) and every registered variant."""
    import variants

    root = CONF / "variant"
    files = {p.relative_to(root).with_suffix("").as_posix() for p in root.rglob("*.yaml")}
    return sorted(files | set(variants.available()))


def variants_only() -> list[str]:
    """The registered variants (the names of :func:`known_variants` that are not knob presets)."""
    return [k for k in known_variants() if "/" not in k]


#: config groups whose option a command line names (``experiment=quick``, ``+task=recall``)
_GROUPS = ("experiment", "task", "model", "pretrained")


def group_options(group: str) -> list[str]:
    """The options of config group ``group``: its files under ``conf/<group>/``."""
    root = CONF / group
    return sorted(p.relative_to(root).with_suffix("").as_posix() for p in root.rglob("*.yaml"))


def known_settings() -> list[str]:
    """Top-level names an override may set: the schema's fields and the config groups under ``conf/``."""
    from .schema import BenchConfig

    groups = {p.name for p in CONF.iterdir() if p.is_dir()}
    return sorted({f.name for f in dataclasses.fields(BenchConfig)} | groups)


def _variant_knobs() -> set[str]:
    """Every knob of every registered variant (``window``, ``block``, ...)."""
    import variants
    from variants.registry import knob_defaults

    return {k for name in variants.available() for k in knob_defaults(variants.get(name))}


def _fail(msg: str) -> None:
    print(f"error: {msg}", file=sys.stderr, flush=True)
    raise SystemExit(1)


def slurm_problem(ping: list[str] | None = None) -> str | None:
    """Why ``hydra/launcher=slurm`` cannot submit here (no Slurm, or no controller answers ``scontrol
    ping``), or None. ``ping``: the command that asks (tests hand it a stand-in)."""
    import subprocess

    cmd = ping or ["scontrol", "ping"]
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=20, check=False)
    except FileNotFoundError:
        return "Slurm is not installed here (no scontrol)"
    except subprocess.TimeoutExpired:
        return "the Slurm controller did not answer `scontrol ping` in 20 s"
    said = " ".join((p.stdout + p.stderr).split())
    if p.returncode or " is UP" not in said:
        return f"no Slurm controller answers `scontrol ping` ({said or f'exit {p.returncode}'})"
    return None


def _swept_by(experiment: str) -> list[str]:
    """The settings the named sweep ``experiment`` lists values of (``hydra.sweeper.params`` in
    ``conf/experiment/<name>.yaml``); none for a name that is no file there (refused later)."""
    from omegaconf import OmegaConf

    path = CONF / "experiment" / f"{experiment}.yaml"
    if not path.is_file():
        return []
    params = OmegaConf.select(OmegaConf.load(path), "hydra.sweeper.params", default=None)
    return list(params or [])


def _check_variant_glob(arg: str) -> None:
    """Exit with one line when ``variant=glob(...)`` matches no variant, or one of its exclude
    patterns takes away nothing it matched: ``glob(local*,sparse)`` reads ``sparse`` as an exclude
    (Hydra's second argument), so it ran local_window alone without a word."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    try:
        glob = OverridesParser.create().parse_overrides([arg.lstrip("+")])[0].value()
    except Exception:  # noqa: BLE001 - a malformed glob: Hydra's own message, at launch
        return
    names = known_variants()
    matched = sorted({n for pat in glob.include for n in fnmatch.filter(names, pat)})
    if not matched:
        _fail(f"'{arg}' matches no variant; known variants: {', '.join(variants_only())}")
    idle = [pat for pat in glob.exclude if not fnmatch.filter(matched, pat)]
    if idle and "exclude=" in arg:
        _fail(f"'{arg}': exclude {', '.join(idle)} takes away nothing {', '.join(glob.include)} matched")
    if idle:
        together = ",".join([*glob.include, *idle])
        _fail(
            f"'{arg}': glob's second argument excludes, and {', '.join(idle)} takes away nothing "
            f"{', '.join(glob.include)} matched; for several patterns give one list: "
            f"'variant=glob([{together}])'"
        )


def _group_list(key: str, value: str) -> str | None:
    """Why ``<group>=[a,b]`` (``key``: the group as written, ``+task`` included) cannot mean what it
    seems to, or None. Hydra reads a list of a config group's options as one config merged from all
    of them, not as a sweep: ``variant=[sdpa,naive]`` ran naive's class with sdpa's knobs and failed
    on "unknown knob 'backend' for naive"."""
    if not (value.startswith("[") and value.endswith("]")):
        return None
    names = [v.strip() for v in value[1:-1].split(",") if v.strip()]
    if len(names) < 2:
        return None  # one option in brackets is that option
    group = key.lstrip("+")
    if group == "experiment":
        return "a list merges the named sweeps into one; run one named sweep at a time (experiment=<name>)"
    return f"a list merges the {group} configs into one; sweep them with -m {key}={','.join(names)}"


def preflight(argv: list[str]) -> list[str]:
    """``argv`` with variant knobs made force-add overrides; exits with one line on a bad value."""
    out = [argv[0]]
    known_keys = known_settings()
    multirun = any(a in ("-m", "--multirun") for a in argv[1:])
    shown = [a for a in argv[1:] if a in ("--cfg", "-c", "--info", "-i")]
    if multirun and shown:  # Hydra: "Only one of --run, --multirun, --cfg ... can be specified", a page
        _fail(f"{shown[0]} prints a config and runs nothing: drop -m (python run.py {shown[0]} job ...)")
    for arg in argv[1:]:
        key, eq, value = arg.partition("=")
        if key.startswith("+") and key.lstrip("+") == "experiment":  # Hydra's answer is advice for YAML
            _fail(f"{arg}: experiment is a setting already; write {arg.lstrip('+')}")
        plain_list = eq and "," in value and _PLAIN.match(value) and not key.startswith(("hydra", "-"))
        if plain_list and not multirun:  # Hydra's "Ambiguous value" page
            _fail(f"{arg}: a comma list is a sweep; run it with -m (python run.py -m ... {arg})")
        if key.lstrip("+") == "experiment" and eq:
            if multirun and "," in value:  # Hydra would run one job per sweep, each with neither's lists
                _fail(f"{arg}: one named sweep at a time (python run.py -m experiment=<name>)")
            given = {a.partition("=")[0].lstrip("+") for a in argv[1:]}
            if not multirun and (lists := [k for k in _swept_by(value) if k not in given]):
                # a single run takes the sweep's settings and none of its lists: one job, of defaults
                _fail(
                    f"{arg} sweeps {', '.join(lists)}: run it with -m (python run.py -m {arg}), or give "
                    "each of them one value for a single job"
                )
        if key == "hydra/launcher" and value == "slurm" and (why := slurm_problem()):
            _fail(
                f"hydra/launcher=slurm: {why}; start a one-machine cluster with "
                "`sudo scripts/slurm_cluster.sh start`, or run without it"
            )
        if not eq or key.startswith(("-", "~")) or key.startswith("hydra"):
            out.append(arg)
            continue
        bare = key.lstrip("+")
        root = bare.split(".", 1)[0]
        if root == "extra" and not key.startswith("+"):  # Hydra: "Key 'tag' is not in struct (extra has )"
            _fail(f"{arg}: extra holds tags of your own; add one with a +: +extra.<tag>=<value>")
        if bare in BOOLEANS and _PLAIN.match(value):  # OmegaConf reads yes, on, 2 and -1 as true
            for v in value.split(","):
                if v.lower() not in ("true", "false"):
                    _fail(f"{bare}={v}: expected true or false")
        if multirun and bare == "records_dir" and ("," in value or value.startswith(("choice(", "glob("))):
            # the sweep checks and locks its records_dir before the first job, against a second writer
            _fail(f"{arg}: a sweep writes one records_dir, which it locks; run one sweep per folder")
        if root not in known_keys:
            close = difflib.get_close_matches(root, known_keys, n=3)
            if root in _variant_knobs():
                close = [f"variant.{root}"] + close
            hint = f"did you mean {' or '.join(close)}? " if close else ""
            _fail(f"unknown setting '{root}' in '{arg}'; {hint}`python run.py --cfg job` lists the settings")
        if (bare == "variant" or bare in _GROUPS) and (why := _group_list(key, value)):
            _fail(f"{arg}: {why}")
        if bare == "variant" and _PLAIN.match(value):
            known = known_variants()
            for name in value.split(","):
                if name not in known:
                    names = ", ".join(variants_only())
                    presets = ", ".join(k for k in known if "/" in k)
                    _fail(
                        f"unknown variant '{name}'; known variants: {names}"
                        + (f"; knob presets: {presets}" if presets else "")
                    )
        elif bare == "variant" and value.startswith("glob("):
            _check_variant_glob(arg)
        elif bare in _GROUPS and _PLAIN.match(value):
            known = group_options(bare)
            for name in value.split(","):
                if name not in known and name != "null":
                    _fail(f"unknown {bare} '{name}'; known: {', '.join(known)} (conf/{bare}/)")
        elif bare in CHOICES and _PLAIN.match(value):
            allowed = [e.value for e in CHOICES[bare]]
            for v in value.split(","):
                if v not in allowed:
                    _fail(f"{bare}={v}: expected one of {', '.join(allowed)}")
        elif bare.startswith("variant.") and not key.startswith("+"):
            arg = "++" + arg  # add or override: the runner checks the knob against the variant
        out.append(arg)
    check_jobs(out[1:])
    check_output_dir(out[1:], multirun)
    return out


def check_output_dir(args: list[str], multirun: bool) -> None:
    """One line and exit 1 when the folder Hydra will write this run's files to, ``hydra.sweep.dir``
    (a sweep) or ``hydra.run.dir`` (a single run) as the command line sets it, cannot be made or
    written: Hydra itself answers with two chained tracebacks. A value Hydra interpolates is left to it."""
    wanted = "hydra.sweep.dir" if multirun else "hydra.run.dir"
    for arg in args:
        key, eq, value = arg.partition("=")
        if eq and key.lstrip("+") == wanted and "${" not in value and (why := unwritable_dir(Path(value))):
            _fail(f"{wanted} {value} cannot be created: {why}")


def _job_overrides(args: list[str]) -> list[list[str]] | None:
    """The override lists of the jobs the command line's comma lists make (None when the command
    line names another config or uses sweep syntax Hydra expands itself)."""
    lists = []
    for arg in args:
        if arg.startswith("-"):
            if arg in ("-cn", "-cp", "-cd") or arg.startswith(("--config", "--info", "--help", "-h")):
                return None  # another config, or not a run
            continue
        key, eq, value = arg.partition("=")
        bare = key.lstrip("+~")
        if bare == "hydra.searchpath":
            return None  # options from other config folders: Hydra finds them, this compose would not
        if not eq or (bare.startswith("hydra") and not bare.startswith("hydra/")):
            continue  # Hydra's own settings; a Hydra group's option (hydra/launcher=...) is checked
        if _LIST.match(value):  # one list value (pretrained.full_layers=[0,5]), not a sweep
            lists.append([arg])
            continue
        if not _PLAIN.match(value):
            return None
        lists.append([f"{key}={v}" for v in value.split(",")] if "," in value else [arg])
    return [list(job) for job in itertools.islice(itertools.product(*lists), MAX_CHECKED)]


def check_jobs(args: list[str]) -> None:
    """Compose each job of the command line (:func:`_job_overrides`) and run the job's checks; the
    first that fails ends the run with its one line."""
    jobs = _job_overrides(args)
    if not jobs:
        return
    from hydra import compose, initialize_config_dir
    from hydra.errors import HydraException
    from omegaconf import OmegaConf, open_dict

    from .checks import check_job, one_line

    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        for job in jobs:
            try:
                composed = compose("config", overrides=job, return_hydra_config=True)
            except HydraException as exc:
                _fail(composition_error(exc) + _close_keys(exc, job, compose))
            with open_dict(composed):
                del composed["hydra"]  # checked by composing; the job's checks read the rest
            cfg = OmegaConf.to_container(composed, resolve=True, enum_to_str=True)
            try:
                check_job(cfg)
            except Exception as exc:
                _fail(one_line(exc))


def _close_keys(exc: Exception, job: list[str], compose: Callable[..., Any]) -> str:
    """For ``model.hiden=64`` (a key the chosen group option does not have): ``; did you mean
    model.hidden?`` and the keys it has, read from the job composed without that override."""
    from omegaconf import DictConfig, OmegaConf

    m = re.search(r"Could not override '([\w.]+)'", str(exc))
    if not m or "not in struct" not in str(exc.__cause__) or "." not in m.group(1):
        return ""
    parent, _, key = m.group(1).rpartition(".")
    try:
        rest = [o for o in job if o.lstrip("+~").partition("=")[0] != m.group(1)]
        node = OmegaConf.select(compose("config", overrides=rest), parent)
    except Exception:  # noqa: BLE001 - only a hint: Hydra's line stands alone
        return ""
    if not isinstance(node, DictConfig):
        return ""
    keys = sorted(str(k) for k in node)
    close = [f"{parent}.{k}" for k in difflib.get_close_matches(key, keys, n=3)]
    hint = f"; did you mean {' or '.join(close)}?" if close else ""
    return f"{hint} ({parent} has {', '.join(keys)})"


def composition_error(exc: Exception) -> str:
    """Hydra's multi-line composition error as one line: a value of the wrong type (``seq_len=abc``:
    its override and OmegaConf's reason) or a group option that does not exist
    (``hydra/launcher=jobilb``: the option and the available ones)."""
    text = str(exc)
    missing = re.search(r"Could not find '([^']+)/([^'/]+)'", text)
    options = re.search(r"Available options in '[^']+':\n((?:\t[^\n]+\n?)+)", text)
    if missing:
        group, name = missing.groups()
        known = ", ".join(line.strip() for line in options.group(1).splitlines()) if options else ""
        return f"{group}={name}: no such option" + (f"; available: {known}" if known else "")
    not_chosen = re.search(r"Could not override '([^']+)'\. No match in the defaults list", text)
    if not_chosen and not_chosen.group(1) in _GROUPS:  # task=copy where no experiment chose a task
        group = not_chosen.group(1)
        return (
            f"{group}=...: nothing chose a {group} to override; add one with +{group}=<name> "
            f"(`{group}=` replaces the one a named sweep already chose)"
        )
    head = text.strip().splitlines()[0].removeprefix("Error merging override ")
    cause = str(exc.__cause__).strip().splitlines()[0] if exc.__cause__ else ""
    return f"{head}: {cause}" if cause else head

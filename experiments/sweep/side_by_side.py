"""Two versions of the code measured side by side: the same sweep from a baseline commit (checked
out in a git worktree for the run) and from this checkout, alternating round by round, then the
report of this side against the baseline.

    python -m experiments.sweep.side_by_side <commit> [--rounds 3] [--out DIR] [--plugin CHECKOUT]
        [OVERRIDES ...]

Why: two runs made apart are compared only while the machine kept its state (``report --baseline``
marks the cells of a host whose ceilings or canary moved: this VM's memory ran at half the speed two
days apart). Rounds taken in the order baseline, this, this, baseline, ... (ABBA) meet the same
phases of a noisy machine on both sides, and the report shows each cell's median round.

OVERRIDES are the sweep's, as ``python run.py -m`` takes them (``experiment=scaling
variant=local_window,sparse``); ``round``, ``records_dir``, ``resume``, ``report`` and
``hydra.sweep.dir`` are this command's. Each side's records go to ``DIR/baseline/records`` and
``DIR/this/records`` (this side with the checkout's uncommitted changes, if any: its records say
``git_dirty``), each sweep's output to ``DIR/<side>/round<r>.log`` and its folder to
``DIR/<side>/sweeps/round<r>``, the baseline's checkout to ``DIR/baseline_checkout`` while it runs
(in the output folder: a launcher's jobs on other nodes see it where the folder is shared), the
comparison to ``DIR/report``. ``DIR`` must not hold an earlier comparison's records (they would be
compared with the new ones). The comparison is of kernel jobs' times: a sweep of other jobs (model,
task, pretrained) is stopped after its first sweep, in one line. Exit code 0 when every sweep and the
report ended 0, else 1. A third party's variant must be importable from both
commits.

``--plugin CHECKOUT``: the two versions are a plugin's, not this repository's: ``commit`` is one of the
git checkout ``CHECKOUT`` of a package whose ``attnbench.variants`` entry points are installed from it
(``pip install -e``). The baseline side imports the plugin's modules from a worktree of that commit
(put first on ``PYTHONPATH``), this side from the checkout as it is; this repository's code is this
checkout's on both sides. The records then share a commit and a package version, and differ in the
variant's source hash, which the comparison names.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import re
import subprocess
import sys
from collections.abc import Sequence
from datetime import datetime, timezone
from importlib.metadata import entry_points
from pathlib import Path

from experiments.measure.spec import Kind
from experiments.records.records import read_records
from variants.registry import ENTRY_POINT_GROUP

#: the checkout this module belongs to: "this" side
ROOT = Path(__file__).resolve().parents[2]
#: settings this command sets for each sweep, which the overrides must not
OWN_SETTINGS = ("round", "records_dir", "resume", "hydra.sweep.dir", "report")
#: rounds per side by default: three, as the reference sweeps run (quick_reference)
DEFAULT_ROUNDS = 3


class SideBySideError(RuntimeError):
    """Something this command cannot do, said in one line."""


def _git(*args: str, cwd: Path = ROOT) -> str:
    """``git args`` in ``cwd``; its output, or :class:`SideBySideError` with git's own last line."""
    try:
        run = subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, timeout=120)
    except OSError as exc:
        raise SideBySideError(f"git could not run: {exc}") from None
    if run.returncode:
        last = (run.stderr.strip().splitlines() or ["(no message)"])[-1]
        raise SideBySideError(f"git {' '.join(args)}: {last}")
    return run.stdout.strip()


def resolve(commit: str, repo: Path = ROOT) -> str:
    """The full hash of ``commit`` (a hash, branch, tag or ``HEAD~3``) in the repository at ``repo``."""
    try:
        return _git("rev-parse", "--verify", "--quiet", f"{commit}^{{commit}}", cwd=repo)
    except SideBySideError:
        raise SideBySideError(f"'{commit}' is not a commit of the repository at {repo}") from None


def plugin_import_roots(checkout: Path, top: Path) -> list[Path]:
    """The folders, relative to ``top`` (the git repository holding ``checkout``, a plugin's folder),
    that the installed ``attnbench.variants`` entry points' modules under ``checkout`` are imported
    from (the checkout itself, or its ``src``). :class:`SideBySideError` when none is imported from
    under it: the plugin was installed without ``-e`` (from a copy in site-packages) or from another
    checkout. Imports the modules' parent packages (``find_spec``); O(entry points)."""
    roots: set[Path] = set()
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        module = ep.value.split(":")[0].strip()
        try:
            spec = importlib.util.find_spec(module)
        except (ImportError, ValueError):  # a broken plugin: the registry says so when it loads it
            continue
        if spec is None or not spec.origin or not Path(spec.origin).is_file():
            continue
        origin = Path(spec.origin).resolve()
        # dilated_attn.dilated in <root>/dilated_attn/dilated.py; a package's origin is its __init__.py
        root = origin.parents[module.count(".") + (origin.name == "__init__.py")]
        if root == checkout or checkout in root.parents:
            roots.add(root.relative_to(top))
    if not roots:
        raise SideBySideError(
            f"no installed attnbench.variants entry point is imported from {checkout}: install the plugin "
            f"from that checkout with `pip install -e {checkout}`"
        )
    return sorted(roots)


def _with_path(folders: Sequence[Path]) -> dict[str, str]:
    """This process's environment with ``folders`` first on ``PYTHONPATH`` (ahead of an editable
    install's finder, which Python asks after the path)."""
    old = os.environ.get("PYTHONPATH")
    return {**os.environ, "PYTHONPATH": os.pathsep.join([*map(str, folders), *([old] if old else [])])}


def check_overrides(overrides: Sequence[str]) -> None:
    """Refuse an override of a setting this command makes itself (:data:`OWN_SETTINGS`), or one that
    is not ``key=value``, in one line."""
    for o in overrides:
        key = o.split("=", 1)[0].lstrip("+~")
        if "=" not in o:
            raise SideBySideError(f"'{o}' is not an override (key=value, as `python run.py -m` takes)")
        if key in OWN_SETTINGS:
            raise SideBySideError(
                f"{key} is set by side_by_side for each sweep; leave it out of the overrides"
            )


def order(rounds: int) -> list[tuple[int, str]]:
    """The sweeps in the order they run: ``(round, side)``, ABBA (baseline first in even rounds, this
    side first in odd ones), so a drift of the machine over the run falls on both sides alike."""
    sides = ("baseline", "this")
    return [(r, side) for r in range(rounds) for side in (sides if r % 2 == 0 else sides[::-1])]


def sweep_command(overrides: Sequence[str], round_: int, side_dir: Path) -> list[str]:
    """The ``python run.py -m`` command of one side's round, run from that side's checkout."""
    return [
        sys.executable, "run.py", "-m", *overrides, f"round={round_}",
        f"records_dir={side_dir / 'records'}", "resume=false", "report=false",
        f"hydra.sweep.dir={side_dir / 'sweeps' / f'round{round_}'}",
    ]  # fmt: skip


def _last_line(text: str) -> str:
    """The last line of ``text`` that is neither blank nor Hydra's ``HYDRA_FULL_ERROR`` hint, or
    ``(no output)``."""
    lines = [line.strip() for line in text.splitlines() if line.strip() and "HYDRA_FULL_ERROR" not in line]
    return lines[-1] if lines else "(no output)"


def failure_reason(output: str) -> str:
    """What a failed sweep's ``output`` says went wrong, in one line: a setting this command passes
    that the side's config does not have (a baseline older than the setting; Hydra says ``Key 'round'
    not in 'BenchConfig'``) as such, else its last line (:func:`_last_line`)."""
    missing = re.search(r"Key '([\w.]+)' not in '\w+'", output)
    if missing and missing.group(1) in OWN_SETTINGS:
        return (
            f"its config has no setting '{missing.group(1)}', which side_by_side sets for each sweep: the "
            "commit predates it and cannot run side by side; pick a later baseline"
        )
    return _last_line(output)


def run_sweep(cmd: list[str], cwd: Path, log: Path, env: dict[str, str] | None = None) -> int:
    """Run one sweep in ``cwd`` (with the environment ``env``, None: this process's), its output
    (stdout and stderr) shown indented as it comes and kept in ``log``; its exit code."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with (
        log.open("w") as keep,
        subprocess.Popen(
            cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1
        ) as proc,
    ):
        assert proc.stdout is not None  # piped above
        for line in proc.stdout:
            keep.write(line)
            print(f"  {line}", end="", flush=True)
    return proc.returncode


def not_kernel_jobs(records: Path) -> str:
    """The kinds other than ``kernel`` among the records in ``records`` (``model``, ``task``, ...),
    joined, or an empty string: the comparison is of kernel jobs' times, so a sweep of other jobs is
    stopped after its first round rather than after all of them. ``O(records)`` file reads."""
    kinds = {r.get("kind", Kind.kernel.value) for r in read_records(records)}
    return ", ".join(sorted(kinds - {Kind.kernel.value}))


def run(commit: str, overrides: Sequence[str], rounds: int, out: Path, plugin: Path | None = None) -> int:
    """Measure ``overrides``' sweep ``rounds`` times from ``commit`` and from this checkout (in
    :func:`order`), then write the report of this side against the baseline into ``out/report``.
    ``plugin``: ``commit`` is one of that plugin checkout's, whose modules the baseline side imports
    from a worktree of it (:func:`plugin_import_roots`). Returns the exit code: 1 when a sweep or the
    report failed, else 0. Takes the two sweeps' time ``rounds`` times over, plus a worktree checkout."""
    if rounds < 1:
        raise SideBySideError(f"--rounds must be at least 1, got {rounds}")
    check_overrides(overrides)
    # a plugin's repository from its top: the checkout given may be a folder inside it (a monorepo)
    repo = ROOT if plugin is None else Path(_git("rev-parse", "--show-toplevel", cwd=plugin)).resolve()
    roots = [] if plugin is None else plugin_import_roots(plugin, repo)
    sha = resolve(commit, repo)
    for side in ("baseline", "this"):  # an earlier comparison's records would join this one's
        if any((out / side / "records").glob("*.json")):
            raise SideBySideError(
                f"--out {out} holds an earlier comparison's records ({out / side / 'records'}), which "
                "would be compared with this one's: pass another --out or remove it"
            )
    out.mkdir(parents=True, exist_ok=True)
    # in the output folder, not /tmp: a launcher's jobs on other nodes see it where out is shared
    worktree = out / "baseline_checkout"
    if worktree.exists():
        raise SideBySideError(f"{worktree} exists (a stopped run's): remove it or pass another --out")
    _git("worktree", "add", "--detach", str(worktree), sha, cwd=repo)
    failed = []
    try:
        head = _git("rev-parse", "--short=12", "HEAD", cwd=repo)
        if plugin is None:  # each side runs its own checkout of this repository
            checkouts = {"baseline": worktree, "this": ROOT}
            envs: dict[str, dict[str, str] | None] = {"baseline": None, "this": None}
            names = {"baseline": f"baseline {sha[:12]}", "this": f"this checkout ({head})"}
        else:  # this repository's checkout on both sides, each importing its own checkout of the plugin
            checkouts = {"baseline": ROOT, "this": ROOT}
            envs = {
                side: _with_path([c / r for r in roots])
                for side, c in (("baseline", worktree), ("this", repo))
            }
            names = {
                "baseline": f"baseline {sha[:12]} of {repo}",
                "this": f"the plugin's checkout {repo} ({head}, as it is)",
            }
        plan = order(rounds)
        for i, (r, side) in enumerate(plan, 1):
            print(f"[{i}/{len(plan)}] round {r}: {names[side]}", flush=True)
            cmd, log = sweep_command(overrides, r, out / side), out / side / f"round{r}.log"
            code = run_sweep(cmd, checkouts[side], log, envs[side])
            if code:
                failed.append(f"{names[side]}, round {r}: exit {code}: {failure_reason(log.read_text())}")
                if not (out / side / "records").exists():
                    break  # this side's code cannot run the sweep at all (a refused override): stop
            if i == 1 and (other := not_kernel_jobs(out / side / "records")):
                raise SideBySideError(
                    f"the sweep's jobs are {other} jobs; side_by_side compares kernel jobs' times (the "
                    "report's comparison), so it stopped after the first sweep"
                )
    finally:
        _git("worktree", "remove", "--force", str(worktree), cwd=repo)
    this, base = out / "this" / "records", out / "baseline" / "records"
    if failed and not (this.exists() and base.exists()):  # a side could not run: nothing to compare
        for f in failed:
            print(f"error: {f}", file=sys.stderr)
        return 1
    cmd = [sys.executable, "-m", "experiments.report.report", str(this), "--baseline", str(base)]
    report = subprocess.run([*cmd, "--out", str(out / "report")], cwd=ROOT, capture_output=True, text=True)
    tables = out / "report" / "tables.md"
    text = tables.read_text() if tables.exists() else ""
    heading = "## Against the baseline"
    # the comparison's section (the count of verdicts, the speedup and memory tables), as the report wrote it
    print(
        text[text.index(heading) :].strip() if heading in text else _last_line(report.stdout + report.stderr)
    )
    print(f"\nreport: {tables}")
    if report.returncode:
        failed.append(f"the report: exit {report.returncode}: {_last_line(report.stderr)}")
    for f in failed:
        print(f"error: {f}", file=sys.stderr)
    return 1 if failed else 0


def main(argv: Sequence[str] | None = None) -> int:
    """The command line (module docstring); one-line errors, exit code 1 on any failure."""
    ap = argparse.ArgumentParser(
        prog="python -m experiments.sweep.side_by_side",
        description="Measure a sweep from a baseline commit and from this checkout, alternating rounds "
        "(ABBA), and report this side against the baseline.",
    )
    ap.add_argument(
        "commit",
        help="the baseline: a commit, branch or tag of this repository (of the plugin's with --plugin)",
    )
    ap.add_argument("overrides", nargs="*", help="the sweep's overrides, as `python run.py -m` takes them")
    ap.add_argument(
        "--rounds", type=int, default=DEFAULT_ROUNDS, help=f"rounds per side (default {DEFAULT_ROUNDS})"
    )
    ap.add_argument("--out", help="output folder (default outputs/side_by_side/<time>)")
    ap.add_argument(
        "--plugin",
        metavar="CHECKOUT",
        help="compare two commits of a plugin's git checkout (installed from it with pip install -e) "
        "instead of this repository's",
    )
    args = ap.parse_intermixed_args(argv)  # options before, between or after the overrides
    stamp = datetime.now(timezone.utc).strftime("%Y-%m-%d_%H-%M-%S")
    out = Path(args.out) if args.out else Path("outputs/side_by_side") / stamp
    try:
        plugin = Path(args.plugin).resolve() if args.plugin else None
        if plugin is not None and not plugin.is_dir():
            raise SideBySideError(f"--plugin {args.plugin}: no such folder")
        return run(args.commit, args.overrides, args.rounds, out.resolve(), plugin)
    except SideBySideError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())

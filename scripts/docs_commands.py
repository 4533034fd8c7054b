"""Run every shell command the documentation shows, as a new user would, and report what each did.

The commands are the lines of the fenced ``bash`` / ``sh`` / plain code blocks of ``README.md`` and
``docs/*.md`` that start with ``python``, ``pip``, ``.`` or ``MALLOC_`` (a line ending in ``\\`` is
joined with the next; other lines, such as the layout tree in docs/design.md, are not commands).
Each runs with bash in the checkout given by ``--root``, after activating its ``.venv`` when there is
one, with a wall-time cap: a command still running at the cap is stopped (its whole process group)
and counts as started when it had finished jobs and printed no ``error:`` job line and no traceback.

Placeholders a command cannot run with are filled in and the report says how: ``outputs/sweeps/<new>``
and ``<old>`` become the checkout's two newest sweep folders. The README's first command (a venv and
the quick sweep) runs with a longer cap; its second (unit tests and the regression benchmarks) is
skipped: CI runs it. ``PYTHONUNBUFFERED=1`` is set so that a stopped command's output is complete.

Output: a Markdown table (stdout and ``--out``) headed by the machine it ran on (host name and CPU
model), and, in ``logs/`` next to ``--out``, one log per command holding its header and its output's
tail (at most 4 KB). The exit status is 1 when any command it ran failed (its verdict ``FAILED``: a
non-zero exit, or an error job line or traceback before the cap), after the report, with one line on
stderr naming them; 1 too when every selected command was skipped.

    python scripts/docs_commands.py --root /tmp/clone --out results/cpu/docs_commands/RESULTS.md
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

from arg_types import output_file, positive_float

from experiments.records.environment import cpu_model

PREFIXES = ("python", "pip", ".", "MALLOC_")
SHELL_FENCES = {"", "bash", "sh"}
JOB_LINE = re.compile(r"\] (ok|unsupported|unavailable|error):")
STATUSES = ("ok", "unsupported", "unavailable", "error")
LOG_BYTES = 4096
README_LONG_CAP_S = 600.0  # the README's first command: a venv, then the whole quick sweep
README_SKIPPED = {1: "skipped: unit tests + regression benchmarks, long; CI runs them"}


@dataclass
class Command:
    """One command of the documentation: where it is, what it says, how it is to be run."""

    file: str
    line: int
    text: str
    cap_s: float
    skip: str = ""
    notes: list[str] = field(default_factory=list)

    @property
    def where(self) -> str:
        return f"{self.file}:{self.line}"


@dataclass
class Outcome:
    """What running one command gave."""

    exit: str
    wall_s: float
    jobs: dict[str, int]
    last_line: str
    verdict: str


def code_lines(path: Path) -> list[tuple[int, str]]:
    """(line number, text) of every line inside a shell or plain fenced block of ``path``."""
    found: list[tuple[int, str]] = []
    fence: str | None = None
    for number, line in enumerate(path.read_text().splitlines(), 1):
        stripped = line.strip()
        if stripped.startswith("```"):
            fence = stripped[3:].strip().lower() if fence is None else None
            continue
        if fence is not None and fence in SHELL_FENCES:
            found.append((number, line))
    return found


def extract(root: Path, cap_s: float) -> list[Command]:
    """The commands of README.md, then docs/*.md, continuation lines joined."""
    files = [root / "README.md", *sorted((root / "docs").glob("*.md"))]
    commands: list[Command] = []
    for path in files:
        rel = str(path.relative_to(root))
        start, parts = 0, []
        in_file = 0
        for number, line in code_lines(path):
            text = line.strip()
            if not parts:
                if not text.startswith(PREFIXES):
                    continue
                start = number
            parts.append(text.removesuffix("\\").strip())
            if text.endswith("\\"):
                continue
            command = Command(rel, start, " ".join(parts), cap_s)
            if rel == "README.md":
                if in_file == 0:
                    command.cap_s = max(cap_s, README_LONG_CAP_S)
                command.skip = README_SKIPPED.get(in_file, "")
            commands.append(command)
            parts, in_file = [], in_file + 1
    return commands


def fill_placeholders(command: Command, root: Path) -> None:
    """Replace ``<new>`` / ``<old>`` with the two newest sweep folders; skip other placeholders."""
    if "<new>" in command.text or "<old>" in command.text:
        sweeps = sorted(p.name for p in (root / "outputs" / "sweeps").glob("*") if p.is_dir())
        if len(sweeps) < 2:
            command.skip = "skipped: needs two sweep folders, the checkout has fewer"
            return
        for placeholder, name, which in (
            ("<new>", sweeps[-1], "the newest sweep folder"),
            ("<old>", sweeps[-2], "the sweep folder before it"),
        ):
            command.text = command.text.replace(f"outputs/sweeps/{placeholder}", f"outputs/sweeps/{name}")
            command.notes.append(f"`{placeholder}` = `{name}` ({which})")
    if left := re.findall(r"<[a-z_]+>", command.text):
        command.skip = f"skipped: placeholder {', '.join(left)} it cannot fill"


def stop(process: subprocess.Popen[bytes]) -> None:
    """End the command's process group: SIGTERM, then SIGKILL after a grace period."""
    for sig, grace in ((signal.SIGTERM, 15.0), (signal.SIGKILL, 10.0)):
        try:
            os.killpg(process.pid, sig)
        except ProcessLookupError:
            return
        try:
            process.wait(timeout=grace)
            return
        except subprocess.TimeoutExpired:
            continue


def run(command: Command, root: Path, log: Path) -> Outcome:
    """Run one command in ``root`` with bash, its venv active, up to its cap; write its log."""
    script = f"[ -f .venv/bin/activate ] && . .venv/bin/activate\n{command.text}\n"
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.pop("VIRTUAL_ENV", None)
    with tempfile.TemporaryFile() as output:
        began = time.monotonic()
        process = subprocess.Popen(
            ["bash", "-c", script],
            cwd=root,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=output,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            code: int | None = process.wait(timeout=command.cap_s)
        except subprocess.TimeoutExpired:
            stop(process)
            code = None
        wall = time.monotonic() - began
        output.seek(0)
        text = output.read().decode(errors="replace")
    lines = text.splitlines()
    jobs = {status: 0 for status in STATUSES}
    for line in lines:
        if match := JOB_LINE.search(line):
            jobs[match.group(1)] += 1
    failed = jobs["error"] > 0 or "Traceback" in text
    last = next((line.strip() for line in reversed(lines) if line.strip()), "")
    if code is None:
        exit_text = f"stopped at cap ({command.cap_s:.0f} s)"
        finished = sum(jobs.values())
        verdict = "FAILED (at cap)" if failed else f"started: {finished} jobs finished, none failed"
    else:
        exit_text = str(code)
        verdict = "ok" if code == 0 else f"FAILED (exit {code})"
    write_log(log, command, exit_text, wall, text)
    return Outcome(exit_text, wall, jobs, last, verdict)


def write_log(log: Path, command: Command, exit_text: str, wall: float, text: str) -> None:
    """The command, where it is from, how it ended, and its output's tail: at most LOG_BYTES."""
    notes = "".join(f"# note: {note}\n" for note in command.notes)
    head = f"# {command.where}\n$ {command.text}\n{notes}# exit: {exit_text}, wall {wall:.1f} s\n"
    head += "# output tail:\n"
    room = LOG_BYTES - len(head.encode())
    tail = text.encode()[-room:] if room > 0 else b""
    log.write_text(head + tail.decode(errors="ignore"))


def cell(text: str, width: int = 110) -> str:
    """A Markdown table cell: one line, pipes escaped, shortened."""
    text = " ".join(text.split()).replace("|", "\\|")
    return text if len(text) <= width else text[: width - 3] + "..."


def shown(command: str) -> str:
    """The command without its trailing comment, for the table."""
    return re.sub(r"\s+#[^'\"]*$", "", command)


def load() -> str:
    """The machine's load averages (1, 5, 15 min)."""
    return ", ".join(f"{x:.2f}" for x in os.getloadavg())


def machine() -> str:
    """The machine the commands ran on, as the other scripts name it: host name and CPU model."""
    return f"`{socket.gethostname()}` ({cpu_model()})"


def failures(rows: list[tuple[Command, Outcome | None]]) -> str:
    """One line naming the commands that ran and failed ("" when none did)."""
    failed = [
        f"#{number} {command.where} {outcome.verdict}"
        for number, (command, outcome) in enumerate(rows, 1)
        if outcome is not None and outcome.verdict.startswith("FAILED")
    ]
    if not failed:
        return ""
    ran = sum(outcome is not None for _, outcome in rows)
    return f"docs_commands.py: {len(failed)} of {ran} commands run failed: {', '.join(failed)}"


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    parser.add_argument("--root", type=Path, required=True, help="the checkout to run the commands in")
    parser.add_argument("--cap-s", type=positive_float, default=90.0, help="wall-time cap per command (s)")
    parser.add_argument(
        "--out", type=output_file, required=True, help="the Markdown report; logs/ goes beside it"
    )
    parser.add_argument("--only", default="", help="run only the commands containing this text")
    parser.add_argument("--list", action="store_true", help="list the commands, run nothing")
    args = parser.parse_args()
    args.out = Path(args.out)  # checked by output_file: a file, its folder made
    root = args.root.resolve()
    if not (root / "README.md").is_file():  # extract() reads it first: a bare FileNotFoundError otherwise
        parser.error(f"--root {args.root}: no README.md there (not a checkout of this project)")
    commands = [c for c in extract(root, args.cap_s) if args.only in c.text]
    if not commands:  # an empty report is no evidence: never a success
        parser.error(f"--only {args.only!r}: no command of the documentation contains it")
    if args.list:
        for c in commands:
            print(f"{c.where}\tcap {c.cap_s:.0f}\t{c.skip or '-'}\t{c.text}")
        return 0
    logs = args.out.parent / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    commit = subprocess.run(
        ["git", "-C", str(root), "log", "-1", "--format=%h %s"], capture_output=True, text=True
    ).stdout.strip()
    began = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    loads = [load()]
    rows = []
    for number, command in enumerate(commands, 1):
        fill_placeholders(command, root)
        if command.skip:
            rows.append((command, None))
            print(f"[{number}/{len(commands)}] {command.where} {command.skip}", file=sys.stderr)
            continue
        log = logs / f"{number:02d}_{Path(command.file).stem}_L{command.line}.log"
        outcome = run(command, root, log)
        loads.append(load())
        rows.append((command, outcome))
        print(
            f"[{number}/{len(commands)}] {command.where} {outcome.exit} {outcome.wall_s:.0f}s "
            f"{outcome.verdict} (load {loads[-1]})",
            file=sys.stderr,
        )
    if all(outcome is None for _, outcome in rows):  # a report of skips only is no evidence
        print(f"docs_commands.py: no command ran: all {len(rows)} selected were skipped", file=sys.stderr)
        return 1
    report = [
        "# The documentation's commands, run",
        "",
        f"Checkout `{root}` at `{commit}`, on {machine()}, {began}; cap {args.cap_s:.0f} s a command "
        f"(README's first: {max(args.cap_s, README_LONG_CAP_S):.0f} s); `scripts/docs_commands.py`. "
        "Jobs: the job lines ending `] ok:` / `] unsupported:` / `] unavailable:` / `] error:`. "
        "Logs (output tails): `logs/`.",
        "",
        "| # | command | where | exit / stop | wall s | jobs ok/unsupp/unavail/error | verdict | last line |",
        "|---:|---|---|---|---:|---|---|---|",
    ]
    notes = []
    for number, (command, outcome) in enumerate(rows, 1):
        where = command.where
        if outcome is None:
            skipped = f"| {number} | `{cell(shown(command.text))}` | {where} | - | - | - | {command.skip} | |"
            report.append(skipped)
            continue
        jobs = "/".join(str(outcome.jobs[s]) for s in STATUSES)
        report.append(
            f"| {number} | `{cell(shown(command.text))}` | {where} | {outcome.exit} | {outcome.wall_s:.0f} "
            f"| {jobs} | {outcome.verdict} | {cell(outcome.last_line, 90)} |"
        )
        notes += [f"- #{number} ({where}): {note}" for note in command.notes]
    report += ["", *(["Placeholders filled:", "", *notes, ""] if notes else [])]
    report.append(f"Load average (1/5/15 min) after each command: {'; '.join(loads)}.")
    text = "\n".join(report) + "\n"
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    print(text)
    if failed := failures(rows):  # the report is written first: it is the evidence of what failed
        print(failed, file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

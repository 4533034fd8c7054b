"""How far each gated timing ratio moves from run to run: the evidence behind the benchmark gates' limits.

Each run is a fresh process (as each CI run is) that measures every gated ratio once, exactly as its
gate's first measurement does:

- the pattern gates (``benchmarks/pattern_gates.py``): ``local_window`` and ``sparse`` forward over
  dense SDPA (gated), and over compiled flex with the same pattern (the goal, tracked);
- with ``--regression``, the regression gates' time ratios (``benchmarks/gates.py``): every case's
  ratio to the ``sdpa`` reference, and the call-path gate's ratios (the reference through
  ``AttentionVariant.forward`` over its bare torch call, per mode), each over its committed baseline
  ratio.

With ``--load`` the runs have a sweep of this suite and a CPU hog beside them (``busy_machine.py``).
Appends to ``--out``/runs.jsonl (one line per run) and writes ``--out``/summary.md: per gated figure,
the median, min and max over every run in that file, max / median, the gate's limit, how far the
largest run stayed below it and (the two-sided regression gates) how far the smallest stayed above
their low limit. Each run records its host, CPU model and commit (``+dirty``: the working tree); a
folder's runs must share host, CPU and ``--load`` (else refused, before any run).

    python scripts/gate_noise.py --runs 20 --load --out results/cpu/gate_noise/loaded
    python scripts/gate_noise.py --runs 20 --out results/cpu/gate_noise/quiet
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

from arg_types import output_dir, positive_int

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # the benchmarks package lives in the repository, not in site-packages


def measure_once(regression: bool) -> dict[str, float]:
    """Every gated figure, measured once in this process: ``{figure: value}``."""
    from benchmarks import gates, pattern_gates

    out: dict[str, float] = {}
    for name in pattern_gates.PAIRS:
        _, fn, dense, flex = pattern_gates.calls(name)
        out[f"pattern/{name}_vs_dense_sdpa"] = pattern_gates.ratio(fn, dense)["time_ratio"]
        out[f"pattern/{name}_vs_flex"] = pattern_gates.ratio(fn, flex)["time_ratio"]
    if regression:
        base = gates.load_baseline()["entries"]
        for case in gates.cases():
            b = base.get(case.key)
            if not b or b.get("status") != "ok":
                continue
            m = gates.measure_time(gates.build(case.name, dict(case.knobs)), case.mode)
            out[f"regression/{case.key}"] = m["time_ratio"] / b["time_ratio"]
        for key, mode in gates.call_path_keys().items():
            b = base.get(key)
            if not b or b.get("status") != "ok":
                continue
            # as test_call_path's first measurement: planned rounds, not the refresh's doubled ones
            out[f"regression/{key}"] = gates.measure_call_path(mode)["time_ratio"] / b["time_ratio"]
    return out


def limit_of(figure: str) -> float | None:
    """The gate's limit for a figure (pattern: the ratio; regression: the factor over the baseline, the
    call-path gate's own for its keys)."""
    from benchmarks import gates, pattern_gates

    kind, name = figure.split("/", 1)
    if kind == "pattern":  # the gate is against dense SDPA; flex is the goal, not gated
        variant, _, against = name.partition("_vs_")
        return pattern_gates.LIMIT[variant] if against == "dense_sdpa" else None
    return gates.time_factor(name)


def low_limit_of(figure: str) -> float | None:
    """The smallest value that passes (regression: 1 / the factor, as the ratio may fall by it too);
    None for the one-sided pattern gates."""
    lim = limit_of(figure)
    return 1 / lim if lim and figure.startswith("regression/") else None


def mix_of(runs: list[dict]) -> str | None:
    """What ``runs`` mix that one summary must not pool (hosts, CPU models, loaded and quiet runs), in one
    line; None when they are alike. Runs recorded before the host was kept are taken as any host."""
    mixed = []
    for key, label in (("host", "hosts"), ("cpu", "CPUs"), ("loaded", "'loaded' settings")):
        seen = sorted({str(r[key]) for r in runs if r.get(key) is not None})
        if len(seen) > 1:
            mixed.append(f"{label} {', '.join(seen)}")
    return "; ".join(mixed) or None


def summarize(runs: list[dict], title: str) -> str:
    """The Markdown table of ``summary.md``; ValueError when ``runs`` mix machines or load settings."""
    mixed = mix_of(runs)
    if mixed:
        raise ValueError(f"the runs mix {mixed}: summarize each in its own --out folder")
    figures = sorted({k for r in runs for k in r["figures"]})
    hosts = sorted({r["host"] for r in runs if r.get("host")})
    commits = sorted({r["commit"] for r in runs if r.get("commit")})
    lines = [
        f"# {title}",
        "",
        f"{len(runs)} runs, {runs[0]['started']} to {runs[-1]['started']} (UTC), each a fresh process; "
        f"host {', '.join(hosts) or '(not recorded)'} ({runs[0]['cpu']}), torch {runs[0]['torch']}, "
        f"commit {', '.join(commits) or '(not recorded)'}; load average over the runs "
        f"{min(r['load_avg'] for r in runs):.2f}-{max(r['load_avg'] for r in runs):.2f}.",
        "",
        "| gated figure | median | min | max | max / median | limit | limit / max | min / low limit |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for fig in figures:
        vals = [r["figures"][fig] for r in runs if fig in r["figures"]]
        med, lo, hi = statistics.median(vals), min(vals), max(vals)
        lim, low = limit_of(fig), low_limit_of(fig)
        lim_s = f"{lim:.2f}" if lim else "(goal, not gated)"
        room = f"{lim / hi:.2f}" if lim else ""
        low_room = f"{lo / low:.2f}" if low else ""
        cells = [fig, f"{med:.3f}", f"{lo:.3f}", f"{hi:.3f}", f"{hi / med:.3f}", lim_s, room, low_room]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    ap.add_argument(
        "--runs", type=positive_int, default=20, help="fresh processes, each measuring every gated ratio once"
    )
    ap.add_argument("--load", action="store_true", help="a sweep of this suite and a CPU hog beside the runs")
    ap.add_argument("--regression", action="store_true", help="also the regression gates' time ratios")
    ap.add_argument(
        "--out",
        type=output_dir,
        default=ROOT / "results" / "cpu" / "gate_noise",
        help="folder: runs.jsonl is appended to, summary.md rewritten",
    )
    ap.add_argument("--one", action="store_true", help=argparse.SUPPRESS)  # a single run, JSON on stdout
    args = ap.parse_args()
    if args.one:
        print(json.dumps(measure_once(args.regression)))
        return
    from busy_machine import busy_machine
    from ci_stress import git_commit

    from benchmarks import gates

    args.out.mkdir(parents=True, exist_ok=True)
    earlier = args.out / "runs.jsonl"
    if earlier.exists():  # refused before the runs, not after: the summary pools every run of the file
        here = {"host": socket.gethostname(), "cpu": gates.machine_info()["cpu_model"], "loaded": args.load}
        old = [json.loads(line) for line in earlier.read_text().splitlines() if line.strip()]
        mixed = mix_of([*old, here])
        if mixed:
            raise SystemExit(f"error: {earlier} holds runs of another machine or load setting: {mixed}")
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="1073741824", MALLOC_TRIM_THRESHOLD_="1099511627776")
    one = [sys.executable, __file__, "--one"] + (["--regression"] if args.regression else [])
    commit = git_commit()  # HEAD, +dirty when the working tree differs: what the runs measure
    runs = []
    with busy_machine() if args.load else contextlib.nullcontext():
        for i in range(args.runs):
            started = datetime.now(timezone.utc).isoformat(timespec="seconds")
            t0 = time.perf_counter()
            p = subprocess.run(one, cwd=ROOT, env=env, capture_output=True, text=True)
            if p.returncode != 0:
                raise SystemExit(f"error: run {i + 1} failed:\n{p.stderr[-2000:]}")
            info = gates.machine_info()
            run = {
                "started": started,
                "seconds": round(time.perf_counter() - t0, 1),
                "loaded": args.load,
                "load_avg": os.getloadavg()[0],
                "host": socket.gethostname(),
                "cpu": info["cpu_model"],
                "commit": commit,
                "torch": info["torch_version"],
                "figures": json.loads(p.stdout.strip().splitlines()[-1]),
            }
            runs.append(run)
            with open(args.out / "runs.jsonl", "a") as f:
                f.write(json.dumps(run) + "\n")
            shown = ", ".join(
                f"{k} {v:.2f}"
                for k, v in run["figures"].items()
                if k.startswith(("pattern/", "regression/" + gates.CALL_PATH))
            )
            head = f"run {i + 1}/{args.runs} ({run['seconds']} s, load {run['load_avg']:.1f})"
            print(f"{head}: {shown}", flush=True)
    # every run in the folder, this call's and earlier ones' (runs can be gathered over several calls)
    lines = (args.out / "runs.jsonl").read_text().splitlines()
    everything = [json.loads(line) for line in lines if line.strip()]
    if not everything:  # emptied by hand while the runs went on: no table to write, and not a success
        raise SystemExit(f"error: {args.out / 'runs.jsonl'} holds no runs; nothing to summarize")
    title = f"Gated timing ratios, {'loaded' if args.load else 'quiet'} machine"
    try:  # the folder's earlier runs must be of this machine and this load setting
        text = summarize(everything, title)
    except ValueError as exc:
        raise SystemExit(f"error: {args.out / 'runs.jsonl'}: {exc}") from None
    (args.out / "summary.md").write_text(text)
    print((args.out / "summary.md").read_text())


if __name__ == "__main__":
    main()

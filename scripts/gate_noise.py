"""How far each gated timing ratio moves from run to run: the evidence behind the benchmark gates' limits.

Each run is a fresh process (as each CI run is) that measures every gated ratio once, exactly as its
gate's first measurement does:

- the pattern gates (``benchmarks/pattern_gates.py``): ``local_window`` and ``sparse`` forward over
  dense SDPA (gated), and over compiled flex with the same pattern (the goal, tracked);
- with ``--regression``, the regression gates' time ratios (``benchmarks/gates.py``): every case's
  ratio to the ``sdpa`` reference, over its committed baseline ratio.

With ``--load`` the runs have a sweep of this suite and a CPU hog beside them (``busy_machine.py``).
Appends to ``--out``/runs.jsonl (one line per run) and writes ``--out``/summary.md: per gated figure,
the median, min and max over every run in that file, max / median, the gate's limit and how far the
largest run stayed below it.

    python scripts/gate_noise.py --runs 20 --load --out results/cpu/gate_noise/loaded
    python scripts/gate_noise.py --runs 20 --out results/cpu/gate_noise/quiet
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
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
    return out


def limit_of(figure: str) -> float | None:
    """The gate's limit for a figure (pattern: the ratio; regression: the factor over the baseline)."""
    from benchmarks import gates, pattern_gates

    kind, name = figure.split("/", 1)
    if kind == "pattern":  # the gate is against dense SDPA; flex is the goal, not gated
        variant, _, against = name.partition("_vs_")
        return pattern_gates.LIMIT[variant] if against == "dense_sdpa" else None
    return gates.TIME_FACTOR


def summarize(runs: list[dict], title: str) -> str:
    """The Markdown table of ``summary.md``."""
    figures = sorted({k for r in runs for k in r["figures"]})
    lines = [
        f"# {title}",
        "",
        f"{len(runs)} runs, {runs[0]['started']} to {runs[-1]['started']} (UTC), each a fresh process; "
        f"host {runs[0]['cpu']}, torch {runs[0]['torch']}; load average over the runs "
        f"{min(r['load_avg'] for r in runs):.2f}-{max(r['load_avg'] for r in runs):.2f}.",
        "",
        "| gated figure | median | min | max | max / median | limit | limit / max |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for fig in figures:
        vals = [r["figures"][fig] for r in runs if fig in r["figures"]]
        med, hi = statistics.median(vals), max(vals)
        lim = limit_of(fig)
        lim_s = f"{lim:.2f}" if lim else "(goal, not gated)"
        room = f"{lim / hi:.2f}" if lim else ""
        cells = [fig, f"{med:.3f}", f"{min(vals):.3f}", f"{hi:.3f}", f"{hi / med:.3f}", lim_s, room]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=positive_int, default=20)
    ap.add_argument("--load", action="store_true", help="a sweep of this suite and a CPU hog beside the runs")
    ap.add_argument("--regression", action="store_true", help="also the regression gates' time ratios")
    ap.add_argument("--out", type=output_dir, default=ROOT / "results" / "cpu" / "gate_noise")
    ap.add_argument("--one", action="store_true", help=argparse.SUPPRESS)  # a single run, JSON on stdout
    args = ap.parse_args()
    if args.one:
        print(json.dumps(measure_once(args.regression)))
        return
    from busy_machine import busy_machine

    from benchmarks import gates

    args.out.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="1073741824", MALLOC_TRIM_THRESHOLD_="1099511627776")
    one = [sys.executable, __file__, "--one"] + (["--regression"] if args.regression else [])
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
                "cpu": info["cpu_model"],
                "torch": info["torch_version"],
                "figures": json.loads(p.stdout.strip().splitlines()[-1]),
            }
            runs.append(run)
            with open(args.out / "runs.jsonl", "a") as f:
                f.write(json.dumps(run) + "\n")
            shown = ", ".join(f"{k} {v:.2f}" for k, v in run["figures"].items() if k.startswith("pattern/"))
            head = f"run {i + 1}/{args.runs} ({run['seconds']} s, load {run['load_avg']:.1f})"
            print(f"{head}: {shown}", flush=True)
    # every run in the folder, this call's and earlier ones' (runs can be gathered over several calls)
    lines = (args.out / "runs.jsonl").read_text().splitlines()
    everything = [json.loads(line) for line in lines if line.strip()]
    if not everything:  # emptied by hand while the runs went on: no table to write, and not a success
        raise SystemExit(f"error: {args.out / 'runs.jsonl'} holds no runs; nothing to summarize")
    title = f"Gated timing ratios, {'loaded' if args.load else 'quiet'} machine"
    (args.out / "summary.md").write_text(summarize(everything, title))
    print((args.out / "summary.md").read_text())


if __name__ == "__main__":
    main()

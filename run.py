"""Entry point: ``python run.py -m variant=naive,sdpa seq_len=512,1024 device=cpu``.

Thin glue: Hydra composes the config, :func:`experiments.sweep.runner.run_job` measures one job.
"""

import difflib
import sys

from experiments.sweep.cpu_server import start_early, stop_early
from experiments.sweep.fast_exit import exit_now, exit_status

if __name__ == "__main__":  # (a job forked from the server runs this file again, as __mp_main__)
    start_early(sys.argv[1:])  # the CPU jobs' fork server imports torch while this process does

import hydra  # noqa: E402
from hydra.core.hydra_config import HydraConfig  # noqa: E402
from hydra.types import RunMode  # noqa: E402
from omegaconf import DictConfig  # noqa: E402

from experiments.sweep.hydra_nodes import register_hydra_pieces  # noqa: E402
from experiments.sweep.preflight import preflight  # noqa: E402
from experiments.sweep.runner import objective, run_job  # noqa: E402

register_hydra_pieces()


@hydra.main(version_base="1.3", config_path="conf", config_name="config")
def main(cfg: DictConfig) -> float:
    """Measure one job; return its ``objective`` figure (for optimising sweepers such as Optuna)."""
    record, figure = run_job(cfg), cfg.get("objective")
    value = objective(record, figure)
    figures = (record or {}).get("figures") or {}
    if figure and record and record.get("status") == "ok" and figure not in figures:
        # a misspelt objective must not pass for a failed trial: one line; a single run, which has no
        # optimiser to hand a NaN to, fails (a sweep's end fails it too, once no record has the figure)
        near = difflib.get_close_matches(figure, list(figures), n=1)
        hint = f"; did you mean {near[0]}?" if near else ""
        if HydraConfig.get().mode == RunMode.RUN:
            print(f"error: objective={figure} is not a figure of this record{hint}", file=sys.stderr)
            sys.exit(1)
        print(
            f"warning: objective={figure} is not a figure of this record: NaN returned{hint}", file=sys.stderr
        )
    return value


if __name__ == "__main__":
    try:
        try:
            sys.argv = preflight(sys.argv)  # one-line errors for bad values before Hydra composes anything
        except SystemExit:
            stop_early()  # no job will run: the fork server need not finish importing torch
            raise
        main()
    except SystemExit as exc:
        if (status := exit_status(exc)) is None:
            raise
    else:
        status = 0
    exit_now(status)  # skips torch's module teardown (1.8 s here), not the atexit handlers

"""Entry point: ``python run.py -m variant=naive,sdpa seq_len=512,1024 device=cpu``.

Thin glue: Hydra composes the config, :func:`experiments.sweep.runner.run_job` measures one job.
"""

import sys

import hydra
from omegaconf import DictConfig

from experiments.sweep.hydra_nodes import register_hydra_pieces
from experiments.sweep.preflight import preflight
from experiments.sweep.runner import objective, run_job

register_hydra_pieces()


@hydra.main(version_base="1.3", config_path="conf", config_name="config")
def main(cfg: DictConfig) -> float:
    """Measure one job; return its ``objective`` figure (for optimising sweepers such as Optuna)."""
    record, figure = run_job(cfg), cfg.get("objective")
    value = objective(record, figure)
    if figure and record and record.get("status") == "ok" and figure not in (record.get("figures") or {}):
        # a misspelt objective must not pass for a failed trial: say so in one line
        print(f"warning: objective={figure} is not a figure of this record: NaN returned", file=sys.stderr)
    return value


if __name__ == "__main__":
    sys.argv = preflight(sys.argv)  # one-line errors for bad values before Hydra composes anything
    main()

"""Running jobs: the Hydra job (runner), its schema, isolation in a child process, the sweep's
callbacks and progress. Imports measure, records and report."""

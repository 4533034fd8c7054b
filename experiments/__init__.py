"""How things are measured: time, peak memory, FLOPs, numerical error; jobs, isolation and records."""

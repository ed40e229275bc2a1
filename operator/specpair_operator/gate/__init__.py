"""The gate: the Job's entry point (runner.py, its own program in the gate pod), its MLflow record,
and the pure judgments of its verdict and of a Job that ended without one."""

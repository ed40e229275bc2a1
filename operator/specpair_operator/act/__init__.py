"""The one place that writes: the reconciler runs a pass (observe -> plan -> act), compares desired
objects with live ones and writes them, records status and metrics."""

"""The thin I/O adapters: the Kubernetes API, the engine pods' probes, the MLflow registry.
Observe reads through them and act writes through them; nothing here decides."""

"""The engine server (gRPC, and OpenAI-compatible HTTP beside it): one pod serves one draft+target
pair version; docs/server.md describes it.

- requests.py  checks a GenerateRequest (pure functions: field + reason for every refusal)
- worker.py    the thread that owns the running batch (continuous batching, cancel, drain)
- service.py   the gRPC adapter (specpair.engine.v1.Engine on grpc.aio)
- metrics.py   Prometheus metrics, vLLM names with a specpair_ prefix
- app.py       EngineServer: ports, health, reflection, TLS, loading, warm-up, shutdown
- tls.py       TLS files; the control port's mutual TLS, re-read on rotation; peers' certificate names
- client.py    a small blocking client (CLI `engine generate`, load benchmark, tests)
- cli.py       `specpair engine serve` and `specpair engine generate`
"""

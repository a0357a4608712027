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
# One process per set of caps: never run several Headroom processes (or replicas) against
# the same GPUs; each would admit up to the full cap.

ARG PYTHON_IMAGE=python:3.11-slim

# --- builder: the project's wheel plus wheels of its dependencies --------------------------
FROM ${PYTHON_IMAGE} AS builder
# 1: the per-chunk modules compiled to C extensions with mypyc (proxy/speedups.py,
# docs/performance.md: about 12 % less CPU per relayed chunk); 0: a pure-Python wheel.
ARG HEADROOM_MYPYC=1
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_CACHE_DIR=1
WORKDIR /src
COPY pyproject.toml setup.py README.md ./
COPY proxy ./proxy
# mypyc type-checks what it compiles against the installed dependencies (hence the
# project installed first, and --no-build-isolation), and needs mypy and a C compiler.
RUN if [ "$HEADROOM_MYPYC" = "1" ]; then \
        apt-get update \
        && apt-get install -y --no-install-recommends gcc libc6-dev \
        && rm -rf /var/lib/apt/lists/* \
        && pip install 'mypy>=1.10' types-PyYAML '.[redis]'; \
    fi \
 && pip install 'setuptools>=68' wheel
# The redis extra: admission.backend: redis (several gateways sharing caps).
RUN HEADROOM_MYPYC="$HEADROOM_MYPYC" \
    pip wheel --no-build-isolation --wheel-dir /wheels '.[redis]'

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
# The wheels are bind-mounted from the builder, so they never land in a layer. A build
# that asked for the compiled modules fails here if it did not get them.
RUN --mount=type=bind,from=builder,source=/wheels,target=/wheels \
    pip install --no-cache-dir --no-index --find-links=/wheels 'headroom-proxy[redis]' \
 && if [ "$HEADROOM_MYPYC" = "1" ]; then python -m proxy.speedups --require-compiled; fi \
 && groupadd --system --gid 10001 headroom \
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
# python:slim has no curl; urlopen raises (exit 1) on a refused connection or non-2xx.
HEALTHCHECK --interval=10s --timeout=3s --start-period=10s --retries=3 \
    CMD ["python", "-c", "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:' + os.environ.get('HEADROOM_LISTEN__PORT', '8080') + '/healthz', timeout=2)"]

ENTRYPOINT ["headroom"]
CMD ["serve", "--config", "/etc/headroom/config.yaml"]

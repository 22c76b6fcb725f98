# batchqueue image: `docker compose up provider` builds and runs it.
# CPU by default. The CUDA variant is the same image with torch from a CUDA wheel index:
#   docker compose build --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu130 \
#     --build-arg TORCH_SPEC=torch==2.13.0
# (docker-compose.yml's trainer service builds it so). The wheels bring their CUDA libraries:
# the host needs only the NVIDIA driver and container toolkit.
# With podman, build with `--format docker`: the OCI format has no HEALTHCHECK and drops it.
# BASE_IMAGE: python:3.11-slim, or another Python 3.11 image whose `pip` installs (a mirror's
# copy; tests/test_image.py builds on a debootstrapped Debian with a venv on PATH).
ARG BASE_IMAGE=python:3.11-slim
FROM ${BASE_IMAGE}

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    GRPC_VERBOSITY=ERROR

# torch first, pinned, in its own layer: it is the big one and changes least. The CPU build
# (+cpu, on the CPU wheel index) keeps the image free of CUDA libraries that a CPU host never
# loads: PyPI's torch for Linux x86_64 is the CUDA build. TORCH_INDEX_URL="" drops the index
# (pip's own settings then, e.g. a mirror that has the +cpu wheel); where none has it, the
# build fails rather than install CUDA's gigabytes, unless TORCH_SPEC=torch==2.13.0 says so.
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ARG TORCH_SPEC="torch==2.13.0+cpu"
RUN pip install ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"} "${TORCH_SPEC}"

WORKDIR /app
COPY pyproject.toml README.md constraints.txt ./
COPY proto ./proto
COPY client ./client
COPY server ./server
COPY providers ./providers
# "remote" lets inputs be s3://, gs:// or https:// URLs (docs/providers/inputs.md); add "hf"
# for Hugging Face datasets and tiktoken (--build-arg EXTRAS=text,remote,hf). The compose
# file's `ray` profile builds with EXTRAS="text,remote,ray".
# Every version from constraints.txt, as `make setup` installs them, so a build today and one
# next month install the same packages; triton is left to torch (a CUDA build pins its own).
ARG EXTRAS="text,remote"
RUN grep -v '^triton==' constraints.txt > /tmp/constraints.txt \
    && pip install -c /tmp/constraints.txt ".[${EXTRAS}]" \
    && rm /tmp/constraints.txt

# /config holds the config file and the inputs it names (mounted from the host); /data is the
# data root (a named volume or a host directory).
# uid and gid 10001, which docker-compose.yml's `user:` names unless told otherwise.
RUN groupadd --gid 10001 batchqueue \
    && useradd --create-home --uid 10001 --gid 10001 batchqueue \
    && mkdir -p /data /config && chown batchqueue:batchqueue /data
USER batchqueue
VOLUME ["/data"]
EXPOSE 50051 50052

# Inside the container the server must listen on all interfaces for the published port to
# reach it; docker-compose.yml publishes it on the host's loopback only.
CMD ["queue-server", "--listen", "0.0.0.0:50051", "--metrics-listen", "0.0.0.0:50052", "--data-root", "/data"]
# The standard gRPC health service: SERVING once every dataset serves.
HEALTHCHECK --interval=10s --timeout=5s --start-period=60s --retries=3 \
    CMD ["python", "-m", "queue_server.healthcheck", "--address", "127.0.0.1:50051"]

# batchqueue server image: `docker compose up provider` builds and runs it.
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    GRPC_VERBOSITY=ERROR

# torch first, pinned, in its own layer: it is the big one and changes least.
ARG TORCH_SPEC="torch==2.13.0"
RUN pip install "${TORCH_SPEC}"

WORKDIR /app
COPY pyproject.toml README.md ./
COPY proto ./proto
COPY client ./client
COPY server ./server
COPY providers ./providers
RUN pip install ".[text]"

RUN useradd --create-home --uid 10001 batchqueue && mkdir -p /data && chown batchqueue /data
USER batchqueue
VOLUME ["/data"]
EXPOSE 50051 50052

# Inside the container the server must listen on all interfaces for the published port to
# reach it; docker-compose.yml publishes it on the host's loopback only.
CMD ["queue-server", "--listen", "0.0.0.0:50051", "--metrics-listen", "0.0.0.0:50052", "--data-root", "/data"]
HEALTHCHECK --interval=10s --timeout=5s --start-period=60s --retries=3 \
    CMD ["python", "-m", "queue_server.healthcheck", "--address", "127.0.0.1:50051"]

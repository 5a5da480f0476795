# replay-server in a container.
#   docker build -t replay-service .
#   docker run -d --name replay -p 127.0.0.1:8000:8000 -v replay-data:/data replay-service
# The buffer's checkpoints live in the /data volume; restarts restore the newest one.
# Kubernetes: configs/kubernetes/ runs this image as a StatefulSet (see docs/operations.md,
# "Kubernetes"); keep its args, ports (8000 Reverb, 9100 metrics) and /data mount in step with this file.
# Reverb's gRPC has no authentication: publish the port on loopback or a private network only.
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    TF_CPP_MIN_LOG_LEVEL=2

# dm-reverb wheels are manylinux x86_64 only; libgomp is needed by torch's CPU build.
RUN apt-get update \
    && apt-get install -y --no-install-recommends libgomp1 \
    && rm -rf /var/lib/apt/lists/*

WORKDIR /app
# Install the pinned dependencies first so code changes do not rebuild this layer.
# torch comes from the CPU index: the default index serves a multi-GB CUDA build.
COPY pyproject.toml README.md ./
COPY replay_service/__init__.py replay_service/__init__.py
# The "metrics" extra (prometheus-client) serves --metrics_port.
RUN pip install --extra-index-url https://download.pytorch.org/whl/cpu "torch==2.13.0" \
    && pip install ".[metrics]"
COPY replay_service replay_service
COPY configs configs
RUN pip install --no-deps --force-reinstall .

RUN useradd --create-home --uid 1000 replay \
    && mkdir -p /data \
    && chown replay:replay /data
USER replay
VOLUME ["/data"]
# 8000: Reverb gRPC; 9100: Prometheus metrics when started with --metrics_port=9100.
EXPOSE 8000 9100

# SIGTERM (docker stop) takes a final checkpoint before exiting: give it time with
# `docker stop -t 120` for large buffers.
STOPSIGNAL SIGTERM
ENTRYPOINT ["replay-server"]
CMD ["--config=/app/configs/default.toml", "--checkpoint_dir=/data/replay", "--port=8000", "--restore_if_exists"]

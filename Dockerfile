# draftfleet images. `cpu` (the default, last stage): enqueue, cloud workers, Flower, the
# reconciler, and GPU workers that attach to an SGLang server by --url. `gpu`: adds SGLang and
# torch (`.[gpu]`) for GPU workers that launch their own server with --gpu. Both hold the S3 client
# (`.[s3]`), so that any service opens a store in a bucket (compose.yaml's DRAFTFLEET_STORE).
#   docker build -t draftfleet:cpu .
#   docker build -t draftfleet:gpu --target gpu .
FROM python:3.11-slim AS base
ENV PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /app
COPY . .
RUN pip install ".[s3]" \
 && useradd --create-home --uid 1000 fleet \
 && mkdir /store && chown fleet /store
# /store belongs to `fleet`, so a named volume mounted there starts writable by the workers.

FROM base AS gpu
RUN pip install ".[gpu]"
USER fleet

FROM base AS cpu
USER fleet

# Three images from one file (docker-compose.yml builds each by target):
#   dashboard  rq-dashboard with the JSON serializer (harvest never pickles)
#   sglang     the pinned SGLang image with harvest installed, so its dump plugin loads
#              through the `sglang.srt.plugins` entry point (SGLANG_PLUGINS=harvest)
#   harvest    workers, collector, producer, status/metrics/janitor and the CPU reference engine
# `harvest` is the last stage, so a plain `docker build .` builds it.
ARG SGLANG_IMAGE=lmsysorg/sglang:v0.5.23

FROM python:3.11-slim AS dashboard
# rq must be the version the workers run (RQ's key layout changes between majors).
RUN pip install --no-cache-dir rq-dashboard==0.9.0 rq==3.0.0
ENV RQ_DASHBOARD_JSON_SERIALIZER=true
ENTRYPOINT ["rq-dashboard"]

FROM ${SGLANG_IMAGE} AS sglang
WORKDIR /opt/harvest
COPY pyproject.toml README.md ./
COPY harvest harvest
COPY producer producer
COPY workers workers
COPY engines engines
COPY collector collector
# --no-deps: SGLang's image already holds torch and safetensors; pulling harvest's pins would
# replace its CUDA build of torch.
RUN pip install --no-cache-dir --no-deps . \
    && python3 -c "from importlib.metadata import entry_points; \
assert any(e.name == 'harvest' for e in entry_points(group='sglang.srt.plugins')), 'plugin entry point missing'"

FROM python:3.11-slim AS harvest
RUN apt-get update && apt-get install -y --no-install-recommends redis-tools && rm -rf /var/lib/apt/lists/*
WORKDIR /app
ARG TORCH_SPEC="torch==2.13.0"
RUN pip install --no-cache-dir ${TORCH_SPEC}
COPY pyproject.toml README.md ./
COPY harvest harvest
COPY producer producer
COPY workers workers
COPY engines engines
COPY collector collector
RUN pip install --no-cache-dir .
ENTRYPOINT ["harvest"]

# Four images from one file (docker-compose.yml builds each by target):
#   redis      Debian's redis-server
#   dashboard  rq-dashboard with the JSON serializer (harvest never pickles)
#   sglang     the pinned SGLang image with harvest installed, so its dump plugin loads
#              through the `sglang.srt.plugins` entry point (SGLANG_PLUGINS=harvest)
#   harvest    workers, collector, producer, status/metrics/janitor and the CPU reference engine
# Build one with --target (compose does). `sglang` is last: the classic builder runs every stage
# above its target, and only GPU nodes can pull the SGLang image.
#
# BASE_IMAGE: every image but sglang builds from it. The default is what users pull; CI (no
# registry) passes a Debian base it bootstrapped itself (scripts/compose_ci.sh), which carries the
# machine's pip mirror and CA bundle. A bare Debian base gets Debian's python3 below.
ARG BASE_IMAGE=python:3.11-slim-bookworm
ARG SGLANG_IMAGE=lmsysorg/sglang:v0.5.23

FROM ${BASE_IMAGE} AS redis
RUN apt-get update && apt-get install -y --no-install-recommends redis-server \
    && rm -rf /var/lib/apt/lists/* && mkdir /data && chown redis:redis /data
WORKDIR /data
USER redis
CMD ["redis-server"]

# Python in /opt/venv on either base: python:*-slim brings its own, a bare Debian gets python3-venv.
FROM ${BASE_IMAGE} AS python
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN if ! python3 -c 'import ensurepip' 2>/dev/null; then \
        apt-get update && apt-get install -y --no-install-recommends python3 python3-venv \
        && rm -rf /var/lib/apt/lists/*; \
    fi \
    && python3 -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH

FROM python AS dashboard
# rq must be the version the workers run (RQ's key layout changes between majors).
RUN pip install rq-dashboard==0.9.0 rq==3.0.0
ENV RQ_DASHBOARD_JSON_SERIALIZER=true
# rq-dashboard's CLI, its Workers page reading jobs with that serializer (the file says why)
COPY deploy/dashboard/rq_dashboard_json.py /opt/rq_dashboard_json.py
ENTRYPOINT ["python3", "/opt/rq_dashboard_json.py"]

FROM python AS harvest
RUN apt-get update && apt-get install -y --no-install-recommends redis-tools && rm -rf /var/lib/apt/lists/*
WORKDIR /app
# The CPU build of torch: PyPI's default torch wheel is the multi-GB CUDA one.
ARG TORCH_SPEC="torch==2.13.0"
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
RUN pip install --index-url "${TORCH_INDEX_URL}" "${TORCH_SPEC}"
# Dependencies first, from pyproject.toml alone: a change to the code or the README then
# rebuilds only the last layer. EXTRA_PACKAGES: more requirements in the same image (CI adds
# moto[server] for its S3 stand-in).
COPY pyproject.toml ./
ARG EXTRA_PACKAGES=""
RUN python3 -c "import tomllib; print('\n'.join(tomllib.load(open('pyproject.toml', 'rb'))['project']['dependencies']))" \
        > /tmp/requirements.txt \
    && set -f && pip install -r /tmp/requirements.txt ${EXTRA_PACKAGES} && rm /tmp/requirements.txt
COPY README.md ./
COPY harvest harvest
COPY producer producer
COPY workers workers
COPY engines engines
COPY collector collector
RUN pip install --no-deps . && python3 -c "import harvest.cli, harvest.workers.worker, harvest.collector.collector, harvest.engines.reference"
ENTRYPOINT ["harvest"]

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

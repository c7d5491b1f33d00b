# harvest image for workers, collector, producer and the CPU reference engine.
# GPU nodes run SGLang from its own image with this package installed (see docker-compose.yml).
FROM python:3.11-slim
RUN apt-get update && apt-get install -y --no-install-recommends redis-tools && rm -rf /var/lib/apt/lists/*
WORKDIR /app
ARG TORCH_SPEC="torch==2.13.0"
RUN pip install --no-cache-dir ${TORCH_SPEC}
COPY pyproject.toml README.md ./
COPY harvest harvest
COPY producer producer
COPY workers workers
COPY collector collector
RUN pip install --no-cache-dir .
ENTRYPOINT ["harvest"]

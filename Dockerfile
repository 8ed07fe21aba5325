# CPU image of Gyre's services (the CUDA variant for SGLang/megatron cells comes with the
# deployment issue). Build: docker build -t gyre .
FROM python:3.11-slim AS build
WORKDIR /src
COPY requirements.txt ./
COPY requirements ./requirements
RUN python -m venv /opt/gyre && /opt/gyre/bin/pip install --no-cache-dir -r requirements.txt
COPY pyproject.toml README.md ./
COPY gyre ./gyre
COPY libs ./libs
COPY services ./services
RUN /opt/gyre/bin/pip install --no-cache-dir --no-deps .

FROM python:3.11-slim
RUN useradd --create-home --uid 10001 gyre
COPY --from=build /opt/gyre /opt/gyre
ENV PATH=/opt/gyre/bin:$PATH PYTHONUNBUFFERED=1
USER gyre
WORKDIR /home/gyre
ENTRYPOINT []
CMD ["gyre", "--help"]

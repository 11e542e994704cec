# gpu-dra driver image: both processes, one image.
#   controller:     gpu-dra-controller      (runs as the non-root user below)
#   kubelet plugin: gpu-dra-kubelet-plugin  (the DaemonSet sets runAsUser: 0; it needs root for
#                   the kubelet's plugin directories, CDI spec dirs and NVML)
# Build: docker build -t gpu-dra:dev .   (see docs/deployment.md)

FROM python:3.11.14-slim-bookworm AS build
WORKDIR /src
RUN pip install --no-cache-dir build==1.3.0
COPY pyproject.toml README.md ./
COPY driver driver
COPY controller controller
COPY kubelet-plugin kubelet-plugin
RUN python -m build --wheel --outdir /wheels . \
    && pip wheel --no-cache-dir --wheel-dir /wheels /wheels/gpu_dra-*.whl

FROM python:3.11.14-slim-bookworm
LABEL org.opencontainers.image.title="gpu-dra" \
      org.opencontainers.image.description="Kubernetes DRA driver for NVIDIA GPUs"
COPY --from=build /wheels /wheels
RUN pip install --no-cache-dir --no-index --find-links /wheels gpu-dra==0.1.0 \
    && rm -rf /wheels
COPY deviceclasses /etc/gpu-dra/deviceclasses
RUN useradd --system --uid 65532 --no-create-home --shell /usr/sbin/nologin gpu-dra
USER 65532
ENTRYPOINT ["gpu-dra-controller"]

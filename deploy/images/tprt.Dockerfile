# The `tprt:latest` image of deploy/tprt.yaml and deploy/tprt-multinode.yaml: tprt with its fleet
# extra (PostgreSQL, KV-cache events) and s3fs (an s3:// --artifacts store) over a CUDA build of
# torch. Build from the repository root:
#   docker build -f deploy/images/tprt.Dockerfile -t tprt:latest .
# BASE: any image with Python 3.10+ and a CUDA build of torch (tprt does not pin torch).
ARG BASE=pytorch/pytorch:2.7.1-cuda12.8-cudnn9-runtime
FROM ${BASE}
WORKDIR /opt/tprt
COPY pyproject.toml README.md ./
COPY tprt ./tprt
COPY convert ./convert
COPY serve ./serve
RUN pip install --no-cache-dir ".[fleet]" s3fs \
    && python -c "import tprt, serve.server, psycopg, zmq, msgpack, s3fs"
ENTRYPOINT ["tprt"]
CMD ["serve", "--help"]

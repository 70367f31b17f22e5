# The `sglang-router:0.3.2` image of deploy/router.yaml: SGLang's model gateway from PyPI, the
# version tests/test_fleet.py runs in front of tprt. Build:
#   docker build -f deploy/images/sglang-router.Dockerfile -t sglang-router:0.3.2 deploy/images
FROM python:3.12-slim
RUN pip install --no-cache-dir sglang-router==0.3.2
ENTRYPOINT ["python", "-m", "sglang_router.launch_router"]

"""The facts routers pick a replica by, under the names they read (issue 43).

Routers that sit in front of many model servers (the Kubernetes Gateway API Inference
Extension's endpoint picker and llm-d built on it, vLLM's production stack, SGLang's model
gateway) scrape each server's Prometheus endpoint for its queue, its running requests, its KV
cache use and its LoRA adapters, under vLLM's metric names (the extension's model-server
protocol, docs/proposals/003-model-server-protocol) or SGLang's. tprt keeps its own `tprt_`
series and exports these beside them, computed when scraped from one snapshot of the server:

    vllm:num_requests_waiting, sglang:num_queue_reqs     requests queued for the batch
    vllm:num_requests_running, sglang:num_running_reqs   requests in the running batch
    vllm:kv_cache_usage_perc (and the older              KV blocks held by sequences / all blocks
      vllm:gpu_cache_usage_perc), sglang:token_usage       (a fraction, 0 to 1)
    vllm:cache_config_info{block_size, num_gpu_blocks}   the prefix cache's block size and count
    vllm:lora_requests_info{max_lora,                    the adapters of running and of waiting
      running_lora_adapters, waiting_lora_adapters}        requests (comma-separated), the device
                                                           slots; its value is the time of the snapshot
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector


@dataclass(frozen=True)
class RouterFacts:
    waiting: int
    running: int
    kv_usage: float  # 0 .. 1
    block_size: int
    num_blocks: int
    max_lora: int
    running_adapters: tuple[str, ...]
    waiting_adapters: tuple[str, ...]


class RouterContract(Collector):
    """A Prometheus collector of `RouterFacts` under the routers' names (see the module docstring)."""

    def __init__(self, snapshot: Callable[[], RouterFacts], model_name: str) -> None:
        self.snapshot = snapshot
        self.model_name = model_name

    def _gauge(self, name: str, doc: str, value: float) -> GaugeMetricFamily:
        family = GaugeMetricFamily(name, doc, labels=["model_name"])
        family.add_metric([self.model_name], value)
        return family

    def collect(self) -> Iterator[GaugeMetricFamily]:
        f = self.snapshot()
        for name in ("vllm:num_requests_waiting", "sglang:num_queue_reqs"):
            yield self._gauge(name, "Requests queued for the batch (tprt_waiting_requests)", f.waiting)
        for name in ("vllm:num_requests_running", "sglang:num_running_reqs"):
            yield self._gauge(name, "Requests in the running batch (tprt_running_requests)", f.running)
        for name in ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc", "sglang:token_usage"):
            yield self._gauge(name, "KV cache blocks held by sequences / all blocks, 0 to 1 "
                                    "(tprt_kv_cache_usage_ratio)", f.kv_usage)
        config = GaugeMetricFamily("vllm:cache_config_info", "The KV cache's block size (tokens) and blocks",
                                   labels=["model_name", "block_size", "num_gpu_blocks"])
        config.add_metric([self.model_name, str(f.block_size), str(f.num_blocks)], 1.0)
        yield config
        lora = GaugeMetricFamily("vllm:lora_requests_info", "The adapters of running and waiting requests and "
                                 "the device's adapter slots; the value is the time of the snapshot",
                                 labels=["max_lora", "running_lora_adapters", "waiting_lora_adapters"])
        lora.add_metric([str(f.max_lora), ",".join(f.running_adapters), ",".join(f.waiting_adapters)], time.time())
        yield lora

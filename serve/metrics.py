"""Every Prometheus object of the server, in its own registry, served over HTTP at /metrics.

Names follow Prometheus conventions: the `tprt_` prefix, base units (seconds, tokens, ratios),
counters ending in `_total`. Latency histograms use token-latency buckets (milliseconds to
minutes). docs/grafana-dashboard.json plots them.
"""

from __future__ import annotations

import threading
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info, start_http_server

# Time to first token, end-to-end and queue time: 5 ms .. 2 min.
REQUEST_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
# Inter-token latency: 1 ms .. 2.5 s.
TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
ADAPTER_STEP_BUCKETS = (0, 1, 2, 4, 8, 16, 32)
JOB_STATES = ("queued", "running", "succeeded", "failed", "cancelled")


class Metrics:
    """The server's metrics. One instance per server; tests may make several (own registries)."""

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry(auto_describe=True)
        self.requests = Counter("tprt_requests", "Calls finished, by protocol (grpc, http), method (RPC name or HTTP "
                                "route) and outcome (the gRPC status code's name; HTTP errors map to one)",
                                ["protocol", "method", "outcome"], registry=r)
        self.prompt_tokens = Counter("tprt_prompt_tokens", "Prompt tokens of admitted requests", registry=r)
        self.cached_prompt_tokens = Counter("tprt_prompt_cached_tokens",
                                            "Prompt tokens reused from the prefix cache, counted when requests end",
                                            registry=r)
        self.generated_tokens = Counter("tprt_generated_tokens", "Tokens generated", registry=r)
        self.ttft = Histogram("tprt_time_to_first_token_seconds", "Arrival to first generated token",
                              buckets=REQUEST_BUCKETS, registry=r)
        self.itl = Histogram("tprt_inter_token_latency_seconds", "Time between consecutive tokens of a request",
                             buckets=TOKEN_BUCKETS, registry=r)
        self.e2e = Histogram("tprt_request_duration_seconds", "Arrival to last token of a generation request",
                             buckets=REQUEST_BUCKETS, registry=r)
        self.queue_time = Histogram("tprt_queue_time_seconds", "Arrival to joining the running batch",
                                    buckets=REQUEST_BUCKETS, registry=r)
        self.running = Gauge("tprt_running_requests", "Requests in the running batch", registry=r)
        self.waiting = Gauge("tprt_waiting_requests", "Requests queued for the batch", registry=r)
        self.batch_size = Histogram("tprt_batch_size", "Sequences in each engine step", buckets=BATCH_BUCKETS,
                                    registry=r)
        self.steps = Counter("tprt_engine_steps", "Engine steps run", registry=r)
        self.structured_requests = Counter("tprt_structured_requests", "Generation requests with an output "
                                           "constraint, by kind (json_schema, json_object, regex, choice, grammar)",
                                           ["kind"], registry=r)
        self.structured_compile = Histogram("tprt_structured_compile_seconds", "Compiling an output constraint "
                                            "(cache misses only)", buckets=TOKEN_BUCKETS, registry=r)
        self.structured_mask = Histogram("tprt_structured_mask_seconds", "Computing one constrained row's "
                                         "next-token mask", buckets=TOKEN_BUCKETS, registry=r)
        self.step_time = Histogram("tprt_engine_step_duration_seconds", "Wall time of one engine step",
                                   buckets=TOKEN_BUCKETS, registry=r)
        self.kv_usage = Gauge("tprt_kv_cache_usage_ratio", "KV cache blocks held by sequences / all blocks",
                              registry=r)
        self.kv_blocks = Gauge("tprt_kv_cache_blocks", "KV cache blocks by state: used (held by sequences, a "
                               "shared block once), cached (kept for prefix reuse), free", ["state"], registry=r)
        self.prefix_queries = Counter("tprt_prefix_cache_queried_tokens", "Tokens looked up in the prefix cache "
                                      "when sequences are admitted", registry=r)
        self.prefix_hits = Counter("tprt_prefix_cache_hit_tokens", "Of those, tokens found in shared KV blocks",
                                   registry=r)
        self.preemptions = Counter("tprt_preemptions", "Sequences preempted for KV blocks (recomputed later)",
                                   registry=r)
        # Speculative decoding (tprt.engine.speculative), counted as the engine reports.
        self.spec_drafted = Counter("tprt_spec_drafted_tokens", "Tokens drafted for verification", registry=r)
        self.spec_accepted = Counter("tprt_spec_accepted_tokens", "Drafted tokens kept", registry=r)
        self.spec_emitted = Counter("tprt_spec_emitted_tokens", "Tokens emitted by decode rows that carried a draft",
                                    registry=r)
        self.spec_acceptance = Gauge("tprt_spec_acceptance_ratio", "Drafted tokens kept / drafted, by draft "
                                     "position (0 = the first drafted token), since start", ["position"], registry=r)
        self.jobs = Gauge("tprt_finetune_jobs", "Fine-tuning jobs by state", ["state"], registry=r)
        self.ft_tokens = Counter("tprt_finetune_tokens", "Tokens trained on", registry=r)
        self.ft_steps = Counter("tprt_finetune_steps", "Fine-tuning optimizer steps", registry=r)
        self.ft_loss = Gauge("tprt_finetune_loss", "Training loss of the latest fine-tuning step", registry=r)
        self.ft_preference = Gauge("tprt_finetune_preference", "DPO jobs: the latest step's rewards_chosen, "
                                   "rewards_rejected, reward_accuracy and reward_margin (and eval_ ones)",
                                   ["metric"], registry=r)
        self.healthy = Gauge("tprt_serving", "1 while every rank is up and the server accepts requests",
                             registry=r)
        self.info = Info("tprt_model", "The served model", registry=r)
        # LoRA adapters (serve/adapters/pool.py). The per-adapter label set is bounded by the pool's
        # registry (adapters loaded or found under --data-dir, in any tier): an adapter's series
        # are removed when it is unloaded (forget_adapter).
        self.adapter_requests = Counter("tprt_adapter_requests", "Generation requests naming each adapter",
                                        ["adapter"], registry=r)
        self.adapter_tokens = Counter("tprt_adapter_generated_tokens", "Tokens generated with each adapter",
                                      ["adapter"], registry=r)
        self.adapters_resident = Gauge("tprt_adapters", "Adapters by tier: device (routable), host (host memory), "
                                       "disk (known, not loaded)", ["tier"], registry=r)
        self.adapter_loads = Counter("tprt_adapter_loads", "Adapters loaded from disk onto the device", registry=r)
        self.adapter_evictions = Counter("tprt_adapter_evictions", "Adapters evicted, by the tier they left "
                                         "(device: to host memory; host: dropped)", ["tier"], registry=r)
        self.adapters_per_step = Histogram("tprt_adapters_per_step", "Distinct adapters among the sequences of "
                                           "each engine step (0: base model only)", buckets=ADAPTER_STEP_BUCKETS,
                                           registry=r)
        for state in JOB_STATES:
            self.jobs.labels(state=state).set(0)
        self._http: Any = None
        self._lock = threading.Lock()

    def outcome(self, method: str, outcome: str, seconds: float, protocol: str = "grpc") -> None:
        """Counts a finished call (the gRPC error interceptor's callback; the HTTP app's)."""
        name = method.rsplit("/", 1)[-1] if protocol == "grpc" else method
        self.requests.labels(protocol=protocol, method=name, outcome=outcome).inc()

    def speculation(self, now: Any, last: Any) -> None:
        """Advances the speculative-decoding series from the engine's SpecStats `last` to `now`."""
        self.spec_drafted.inc(now.drafted - last.drafted)
        self.spec_accepted.inc(now.accepted - last.accepted)
        self.spec_emitted.inc(now.emitted - last.emitted)
        for i, (drafted, kept) in enumerate(zip(now.drafted_at, now.accepted_at)):
            if drafted:
                self.spec_acceptance.labels(position=str(i)).set(kept / drafted)

    def set_jobs(self, counts: dict[str, int]) -> None:
        """Sets the per-state job gauges from a {state: count} snapshot."""
        for state in JOB_STATES:
            self.jobs.labels(state=state).set(counts.get(state, 0))

    def forget_adapter(self, adapter_id: str) -> None:
        """Removes an adapter's per-adapter series (it was unloaded)."""
        for family in (self.adapter_requests, self.adapter_tokens):
            try:
                family.remove(adapter_id)
            except KeyError:
                pass

    def serve(self, host: str, port: int) -> int:
        """Starts the /metrics HTTP endpoint; returns the bound port (useful with port 0)."""
        with self._lock:
            server, _thread = start_http_server(port, addr=host, registry=self.registry)
            self._http = server
            return int(server.server_port)

    def close(self) -> None:
        with self._lock:
            if self._http is not None:
                self._http.shutdown()
                self._http.server_close()
                self._http = None

"""The `tgi_*` Prometheus metrics of TGIS, in one registry per app.

Names, kinds and labels are TGIS's (seed 001). Like TGIS's router, every counter is exposed
twice: under its TGIS name (`tgi_request_count`, what existing dashboards scrape) and with the
`_total` suffix Prometheus client libraries expect (`tgi_request_count_total`). Histogram
buckets are TGIS's too: durations grow by 1.5x from 0.15 ms, token counts follow the limits.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.utils import floatToGoString

from tgis.engine.types import Completion, FinishReason

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
DURATION_BUCKETS = tuple(0.0001 * 1.5 ** (k + 1) for k in range(35))
TOKENIZE_BUCKETS = tuple(float(1 << x) for x in range(6, 20))
# TGIS's `stop_reason` label values are its gRPC StopReason names.
STOP_REASONS = {
    FinishReason.LENGTH: "MAX_TOKENS",
    FinishReason.EOS_TOKEN: "EOS_TOKEN",
    FinishReason.STOP_SEQUENCE: "STOP_SEQUENCE",
    FinishReason.TIME_LIMIT: "TIME_LIMIT",
    FinishReason.CANCELLED: "CANCELLED",
}
# tgi_request_failure{err}: TGIS's values for the HTTP layer's error types.
FAILURE_LABELS = {
    "validation": "validation",
    "overloaded": "conc_limit",
    "generation": "generate",
    "incomplete_generation": "generate",
    "incomplete_generation_stream": "generate",
    "cancelled": "cancelled",
    "internal": "unknown",
}
MAKEUP = "single_only"  # TGIS's only batch make-up (no beam search)


def _linear(limit: int, count: int = 64) -> tuple[float, ...]:
    """`count` evenly spaced buckets up to `limit` (TGIS's token-count buckets)."""
    return tuple(limit / count * (i + 1) for i in range(count))


class Metrics:
    """The server's metrics. Also the engine's `EngineObserver` for the batch-level ones.

    Every method is cheap and thread-safe (prometheus_client locks each value): the engine
    thread calls the observer methods, the event loop the request methods.
    """

    def __init__(self, max_total_tokens: int = 4096, max_batch_size: int = 128) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        tokens = _linear(max_total_tokens)
        self.request_count = Counter(
            "tgi_request_count", "Count of generate requests", ["kind"], registry=r
        )
        self.request_input_count = Counter(
            "tgi_request_input_count", "Count of generate request inputs", registry=r
        )
        self.request_failure = Counter(
            "tgi_request_failure", "Count of failed requests, by error type", ["err"], registry=r
        )
        self.request_success = Counter(
            "tgi_request_success",
            "Count of successful requests",
            ["stop_reason", "kind"],
            registry=r,
        )
        hist = {
            "tgi_request_max_new_tokens": ("Value of the max_new_tokens parameter", tokens),
            "tgi_request_input_length": ("Request input length in tokens", tokens),
            "tgi_request_raw_input_length": (
                "Raw request input length in tokens (including too-long validation failures)",
                tokens,
            ),
            "tgi_request_mean_time_per_token_duration": (
                "Mean time per token, per request (seconds)",
                DURATION_BUCKETS,
            ),
            "tgi_request_validation_duration": (
                "Request validation time (seconds)",
                DURATION_BUCKETS,
            ),
            "tgi_request_queue_duration": (
                "Request time spent in queue (seconds)",
                DURATION_BUCKETS,
            ),
            "tgi_request_generated_tokens": ("Number of tokens generated for request", tokens),
            "tgi_request_total_tokens": ("Input tokens + generated tokens of request", tokens),
            "tgi_request_duration": (
                "End-to-end generate request duration (seconds)",
                DURATION_BUCKETS,
            ),
            "tgi_request_inference_duration": (
                "Duration of the inferencing portion of request (seconds)",
                DURATION_BUCKETS,
            ),
            "tgis_request_time_to_first_token_seconds": (
                "Time from a request's arrival to its first generated token (seconds)",
                DURATION_BUCKETS,
            ),
            "tgi_batch_next_tokens": ("Tokens in each prefill batch (including padding)", tokens),
            "tgi_tokenize_request_tokens": (
                "Tokenized tokens per tokenize request",
                TOKENIZE_BUCKETS,
            ),
            "tgi_tokenize_request_duration": (
                "Tokenize request duration (seconds)",
                DURATION_BUCKETS,
            ),
        }
        self.hist = {
            name: Histogram(name, doc, buckets=buckets, registry=r)
            for name, (doc, buckets) in hist.items()
        }
        self.batch_concatenation_count = Counter(
            "tgi_batch_concatenation_count",
            "Times the continuous batcher combined new sequences into the running batch",
            registry=r,
        )
        self.batch_inference_count = Counter(
            "tgi_batch_inference_count", "Count of forward-pass iterations", ["method"], registry=r
        )
        self.batch_inference_success = Counter(
            "tgi_batch_inference_success",
            "Successful forward-pass iterations",
            ["method"],
            registry=r,
        )
        self.batch_inference_failure = Counter(
            "tgi_batch_inference_failure",
            "Failed forward-pass iterations",
            ["method", "reason"],
            registry=r,
        )
        self.batch_inference_batch_size = Histogram(
            "tgi_batch_inference_batch_size",
            "Batch size of each forward-pass iteration",
            ["method"],
            buckets=tuple(float(i + 1) for i in range(max_batch_size)),
            registry=r,
        )
        step = {
            "tgi_batch_inference_duration": "Time of each forward-pass iteration (seconds)",
            "tgi_batch_inference_forward_duration": "Time of each model forward call (seconds)",
            "tgi_batch_inference_tokproc_duration": "Token-processing time per iteration (seconds)",
        }
        self.step_hist = {
            name: Histogram(name, doc, ["method", "makeup"], buckets=DURATION_BUCKETS, registry=r)
            for name, doc in step.items()
        }
        gauges = {
            "tgi_batch_current_size": "Current batch size",
            "tgi_batch_input_tokens": "Tokens held by the current batch, including padding",
            "tgi_batch_max_remaining_tokens": "Most tokens a sequence of the batch may still generate",
            "tgi_queue_size": "Current number of queued requests",
            "tgis_kv_cache_usage": "Share of the paged KV cache's blocks in use (0..1)",
        }
        self.gauges = {name: Gauge(name, doc, registry=r) for name, doc in gauges.items()}
        self.weight_bytes = Gauge(
            "tgis_weight_bytes",
            "Bytes the model's weights hold on the device, labelled with the quantization in "
            "force (none: the serving dtype)",
            ["quantization"],
            registry=r,
        )
        kv_counters = {
            "tgis_prefix_cache_queried_tokens": "Prompt tokens looked up in the prefix cache",
            "tgis_prefix_cache_hit_tokens": "Prompt tokens found in the prefix cache (not "
            "prefilled again)",
            "tgis_prefix_cache_evicted_blocks": "Cached KV blocks evicted to make room",
            "tgis_preemptions": "Sequences preempted when the KV cache ran out, to be recomputed",
        }
        speculation = {
            "tgis_speculative_draft_tokens": "Speculative tokens proposed and verified "
            "(--speculate)",
            "tgis_speculative_accepted_tokens": "Speculative tokens the model accepted (the "
            "acceptance rate is their ratio to tgis_speculative_draft_tokens)",
            "tgis_speculative_emitted_tokens": "Tokens emitted by verifying steps (accepted, "
            "plus one per sequence and step)",
        }
        self.speculation = {
            name: Counter(name, doc, registry=r) for name, doc in speculation.items()
        }
        self.images_encoded = Counter(
            "tgis_images_encoded",
            "Images of prompts run through the vision tower and projector",
            registry=r,
        )
        self.images_cached = Counter(
            "tgis_images_cached",
            "Images of prompts whose every row came from the prefix cache (not encoded again)",
            registry=r,
        )
        self.kv_counters = {
            name: Counter(name, doc, registry=r) for name, doc in kv_counters.items()
        }
        self._kv_totals: dict[str, int] = {}
        self._kv_lock = threading.Lock()
        self.tokenize_request_count = Counter(
            "tgi_tokenize_request_count", "Count of tokenize requests", registry=r
        )
        self.tokenize_request_input_count = Counter(
            "tgi_tokenize_request_input_count", "Count of tokenize request inputs", registry=r
        )

    # Request-level figures, observed by the routes.

    def request_received(self, kind: str, inputs: int = 1) -> None:
        """A generate request arrived; kind is "single", "batch" (gRPC Generate with several
        inputs) or "stream" (TGIS's labels)."""
        self.request_count.labels(kind=kind).inc()
        self.request_input_count.inc(inputs)

    def raw_input(self, tokens: int) -> None:
        """The prompt's length before truncation and validation."""
        self.hist["tgi_request_raw_input_length"].observe(tokens)

    def validated(self, input_length: int, max_new_tokens: int | None, seconds: float) -> None:
        """A request passed validation after `seconds` (tokenizing included)."""
        self.hist["tgi_request_input_length"].observe(input_length)
        if max_new_tokens is not None:
            self.hist["tgi_request_max_new_tokens"].observe(max_new_tokens)
        self.hist["tgi_request_validation_duration"].observe(seconds)

    def request_failed(self, error_type: str) -> None:
        """A request failed; error_type is the `error_type` sent to the client."""
        self.request_failure.labels(err=FAILURE_LABELS.get(error_type, error_type)).inc()

    def request_succeeded(
        self, kind: str, completion: Completion, seconds: float, stop_reason: str | None = None
    ) -> None:
        """A request finished normally `seconds` after it arrived (`stop_reason`: TGIS's name
        when the caller knows better, e.g. TOKEN_LIMIT)."""
        reason = stop_reason or STOP_REASONS.get(
            completion.finish_reason, completion.finish_reason.value
        )
        self.request_success.labels(stop_reason=reason, kind=kind).inc()
        h = self.hist
        h["tgi_request_duration"].observe(seconds)
        h["tgi_request_generated_tokens"].observe(completion.generated_tokens)
        h["tgi_request_total_tokens"].observe(completion.input_length + completion.generated_tokens)
        timings = completion.timings
        h["tgi_request_queue_duration"].observe(timings.queue)
        h["tgi_request_inference_duration"].observe(timings.inference)
        if completion.generated_tokens > 0:
            h["tgis_request_time_to_first_token_seconds"].observe(timings.first_token)
            per_token = timings.inference / completion.generated_tokens
            h["tgi_request_mean_time_per_token_duration"].observe(per_token)

    def pooled(self, kind: str, lengths: list[int], seconds: float) -> None:
        """A pooling request (`kind`: embed, rerank, classify) answered `seconds` after it
        arrived, its inputs of `lengths` tokens."""
        self.request_success.labels(stop_reason="pooled", kind=kind).inc()
        self.hist["tgi_request_duration"].observe(seconds)
        for length in lengths:
            self.hist["tgi_request_input_length"].observe(length)

    def tokenize_request(self, inputs: int, tokens: int, seconds: float) -> None:
        """A /tokenize request tokenized `inputs` texts into `tokens` tokens."""
        self.tokenize_request_count.inc()
        self.tokenize_request_input_count.inc(inputs)
        self.hist["tgi_tokenize_request_tokens"].observe(tokens)
        self.hist["tgi_tokenize_request_duration"].observe(seconds)

    # EngineObserver: step-level figures from the engine thread.

    def on_step(
        self, method: str, batch_size: int, tokens: int, duration: float, forward: float
    ) -> None:
        """A forward pass finished (see tgis.engine.types.EngineObserver)."""
        self.batch_inference_count.labels(method=method).inc()
        self.batch_inference_success.labels(method=method).inc()
        self.batch_inference_batch_size.labels(method=method).observe(batch_size)
        labels = {"method": method, "makeup": MAKEUP}
        self.step_hist["tgi_batch_inference_duration"].labels(**labels).observe(duration)
        self.step_hist["tgi_batch_inference_forward_duration"].labels(**labels).observe(forward)
        tokproc = max(duration - forward, 0.0)
        self.step_hist["tgi_batch_inference_tokproc_duration"].labels(**labels).observe(tokproc)
        if method == "prefill":
            self.hist["tgi_batch_next_tokens"].observe(tokens)

    def on_step_failure(self, method: str, reason: str) -> None:
        """A forward pass failed (reason "oom" or "error")."""
        self.batch_inference_count.labels(method=method).inc()
        self.batch_inference_failure.labels(method=method, reason=reason).inc()

    def on_concatenation(self) -> None:
        """New sequences joined the running batch."""
        self.batch_concatenation_count.inc()

    def on_batch_state(
        self, waiting: int, running: int, input_tokens: int, max_remaining: int
    ) -> None:
        """The queue and the running batch after a step."""
        self.gauges["tgi_queue_size"].set(waiting)
        self.gauges["tgi_batch_current_size"].set(running)
        self.gauges["tgi_batch_input_tokens"].set(input_tokens)
        self.gauges["tgi_batch_max_remaining_tokens"].set(max_remaining)

    def on_weights(self, quantization: str | None, weight_bytes: int) -> None:
        """The loaded model's weights: their quantization method (None: none) and bytes."""
        self.weight_bytes.labels(quantization=quantization or "none").set(weight_bytes)

    def on_kv_state(
        self,
        used_blocks: int,
        num_blocks: int,
        queried_tokens: int,
        hit_tokens: int,
        evicted_blocks: int,
        preemptions: int,
    ) -> None:
        """A paged KV pool after a step; the running totals become counter increments."""
        self.gauges["tgis_kv_cache_usage"].set(used_blocks / num_blocks if num_blocks else 0.0)
        totals = {
            "tgis_prefix_cache_queried_tokens": queried_tokens,
            "tgis_prefix_cache_hit_tokens": hit_tokens,
            "tgis_prefix_cache_evicted_blocks": evicted_blocks,
            "tgis_preemptions": preemptions,
        }
        with self._kv_lock:
            for name, total in totals.items():
                delta = total - self._kv_totals.get(name, 0)
                if delta > 0:
                    self.kv_counters[name].inc(delta)
                self._kv_totals[name] = total

    def on_speculation(self, draft_tokens: int, accepted_tokens: int, emitted_tokens: int) -> None:
        """A verify step's draft, accepted and emitted tokens (see EngineObserver)."""
        self.speculation["tgis_speculative_draft_tokens"].inc(draft_tokens)
        self.speculation["tgis_speculative_accepted_tokens"].inc(accepted_tokens)
        self.speculation["tgis_speculative_emitted_tokens"].inc(emitted_tokens)

    def on_images(self, encoded: int, cached: int) -> None:
        """A step's images encoded, and those found in the prefix cache (see EngineObserver)."""
        self.images_encoded.inc(encoded)
        self.images_cached.inc(cached)

    def render(self) -> bytes:
        """The Prometheus text exposition (format 0.0.4) of every metric."""
        return "".join(_render_families(self.registry)).encode()


def _render_families(registry: CollectorRegistry) -> Iterable[str]:
    for family in registry.collect():
        doc = family.documentation.replace("\\", r"\\").replace("\n", r"\n")
        if family.type == "counter":
            # prometheus_client names counter samples `<name>_total`; TGIS exposes both names.
            totals = [s for s in family.samples if s.name.endswith("_total")]
            for name in (family.name, family.name + "_total"):
                yield f"# HELP {name} {doc}\n# TYPE {name} counter\n"
                for s in totals:
                    yield _sample(name, s.labels, s.value)
            continue
        yield f"# HELP {family.name} {doc}\n# TYPE {family.name} {family.type}\n"
        for s in family.samples:
            if not s.name.endswith("_created"):
                yield _sample(s.name, s.labels, s.value)


def _sample(name: str, labels: dict[str, str], value: float) -> str:
    if not labels:
        return f"{name} {floatToGoString(value)}\n"
    escaped = ",".join(
        '{}="{}"'.format(k, v.replace("\\", r"\\").replace("\n", r"\n").replace('"', r"\""))
        for k, v in labels.items()
    )
    return f"{name}{{{escaped}}} {floatToGoString(value)}\n"

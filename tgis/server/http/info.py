"""What `GET /info` reports: the served model and the router's limits, in TGI's shape."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from tgis import __version__
from tgis.config import ServeConfig
from tgis.engine.scheduler import SchedulerLimits

# The device type TGI reports for each backend (`model_device_type`).
_DEVICE_TYPES = {"cpu": "cpu", "cuda": "cuda", "tpu": "xla", "neuron": "neuron", "gaudi": "hpu"}


@dataclass(frozen=True)
class ModelInfo:
    """The body of `GET /info`.

    Field names are TGI's: today's (`max_input_tokens`, `max_client_batch_size`, ...) and
    TGI 1.x's that TGIS users still read (`model_dtype`, `model_device_type`,
    `max_input_length`, `max_batch_total_tokens`, ...). `/info` also names the model for the
    OpenAI routes (`/v1/models`, the `model` of every response).
    """

    model_id: str
    max_concurrent_requests: int
    max_best_of: int
    max_stop_sequences: int
    max_top_n_tokens: int
    max_input_tokens: int
    max_total_tokens: int
    max_batch_prefill_tokens: int
    model_sha: str | None = None
    model_dtype: str = "float32"
    model_device_type: str = "cpu"
    model_pipeline_tag: str | None = "text-generation"
    # "decoder_only" or "encoder_decoder" (what TGIS's ModelInfo calls model_kind).
    model_kind: str = "decoder_only"
    backend: str = "cpu"
    max_batch_total_tokens: int | None = None
    max_batch_size: int | None = None
    max_waiting_tokens: int = 20
    waiting_served_ratio: float = 0.3
    # Requests carry one input each; the OpenAI completions route accepts this many prompts.
    max_client_batch_size: int = 4
    validation_workers: int = 1
    router: str = "tgis"
    version: str = __version__
    sha: str | None = None
    docker_label: str | None = None
    # How the backend runs (not TGI's): the engine, attention path, CUDA graphs, KV pool.
    runtime: dict[str, Any] | None = None
    # What prompts may hold: text, and images for a vision-language model.
    input_modalities: tuple[str, ...] = ("text",)

    @staticmethod
    def from_config(
        config: ServeConfig,
        *,
        model_sha: str | None = None,
        model_dtype: str | None = None,
        model_device_type: str | None = None,
        model_pipeline_tag: str | None = "text-generation",
        max_batch_total_tokens: int | None = None,
        sha: str | None = None,
        docker_label: str | None = None,
        encoder_decoder: bool = False,
        runtime: dict[str, Any] | None = None,
        limits: SchedulerLimits | None = None,
        images: bool = False,
    ) -> ModelInfo:
        """The info of a model served with `config`.

        `model_sha` is the resolved commit of the weights (a revision such as "main" is not
        one). `model_dtype` defaults to the configured dtype (float32 when unset), `model_device_type`
        to the backend's device, `max_batch_total_tokens` to the configured budget (pass the
        one measured at warmup on dynamic backends). `limits`: the engine's scheduler limits,
        whose admission policy is the one in force (without them, the slot engine's).
        `images`: prompts may hold images (TGI's pipeline tag is then image-text-to-text).
        """
        ratio, steps = (
            (limits.waiting_served_ratio, limits.max_waiting_tokens)
            if limits is not None
            else config.admission(paged=False)
        )
        return ModelInfo(
            model_id=config.model_id,
            model_sha=model_sha,
            model_dtype=model_dtype or config.dtype or "float32",
            model_device_type=model_device_type or _DEVICE_TYPES.get(config.backend, "cpu"),
            model_pipeline_tag="image-text-to-text" if images else model_pipeline_tag,
            model_kind="encoder_decoder" if encoder_decoder else "decoder_only",
            backend=config.backend,
            max_concurrent_requests=config.max_concurrent_requests,
            max_best_of=config.max_best_of,
            max_stop_sequences=config.max_stop_sequences,
            max_top_n_tokens=config.max_top_n_tokens,
            max_input_tokens=config.max_input_tokens,
            max_total_tokens=config.max_total_tokens,
            max_batch_prefill_tokens=config.max_batch_prefill_tokens,
            max_batch_total_tokens=max_batch_total_tokens or config.max_batch_total_tokens,
            max_batch_size=config.max_batch_size,
            max_waiting_tokens=steps,
            waiting_served_ratio=ratio,
            sha=sha,
            docker_label=docker_label,
            runtime=runtime,
            input_modalities=("text", "image") if images else ("text",),
        )

    @property
    def system_fingerprint(self) -> str:
        """The OpenAI `system_fingerprint` TGI sends: version and image label."""
        return f"{self.version}-{self.docker_label or 'native'}"

    def to_json(self) -> dict[str, Any]:
        """The `/info` body, with TGI 1.x's `max_input_length` alias of `max_input_tokens`."""
        body = asdict(self)
        body["max_input_length"] = self.max_input_tokens
        return body

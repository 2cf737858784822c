"""What a pooling model does, read from its files.

Sentence-transformers' layout, where present: `modules.json` lists the modules (a Transformer,
then `Pooling`, maybe `Normalize`); the Pooling module's `config.json` (`1_Pooling/` as a rule)
says which pooling modes are on, concatenated in sentence-transformers' order when several are;
`sentence_bert_config.json` gives the longest input. Without it, the architecture decides:
`*ForSequenceClassification` scores (one label: a cross-encoder reranker; more: a classifier),
an encoder's base model (`BertModel`, `XLMRobertaModel`, `ModernBertModel`, ...) embeds with its
CLS token, normalized, and a causal LM is a text generator, not a pooling model.
`matryoshka_dimensions` in config.json (as vLLM reads it) lists the sizes an embedding may be
cut to (`dimensions`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from tgis.errors import ConfigError

Task = Literal["embed", "rerank", "classify"]
# Sentence-transformers' pooling modes, in the order it concatenates them.
MODES = ("cls", "max", "mean", "mean_sqrt_len", "weightedmean", "lasttoken")
_MODE_KEYS = {
    "cls": "pooling_mode_cls_token",
    "max": "pooling_mode_max_tokens",
    "mean": "pooling_mode_mean_tokens",
    "mean_sqrt_len": "pooling_mode_mean_sqrt_len_tokens",
    "weightedmean": "pooling_mode_weightedmean_tokens",
    "lasttoken": "pooling_mode_lasttoken",
}
_ST_MODULE = "sentence_transformers.models."
# Modules of a sentence-transformers pipeline that tgis runs; others are refused by name.
_KNOWN_MODULES = ("Transformer", "Pooling", "Normalize")


@dataclass(frozen=True)
class PoolingSpec:
    """How a pooling model turns a batch's hidden states into its outputs."""

    task: Task
    # Embeddings: the pooling modes, concatenated in MODES' order.
    modes: tuple[str, ...] = ()
    normalize: bool = False
    # The longest input in tokens (None: the model's positions).
    max_length: int | None = None
    # Matryoshka sizes an embedding may be cut to (`dimensions`); () : only its own.
    dimensions: tuple[int, ...] = ()
    # Classifiers: each label's name, by index.
    labels: tuple[str, ...] = ()
    # Where it was read: "sentence-transformers" or "architecture".
    source: str = "architecture"


def read_pooling_spec(model_dir: Path, config: dict[str, Any]) -> PoolingSpec | None:
    """The pooling spec of the model in `model_dir` (its config.json as `config`); None for
    a text generator. A ConfigError names a sentence-transformers module tgis does not run."""
    dimensions = tuple(int(d) for d in config.get("matryoshka_dimensions") or ())
    modules = model_dir / "modules.json"
    if modules.is_file():
        return _from_sentence_transformers(model_dir, _json(modules), dimensions)
    architectures = [str(a) for a in config.get("architectures") or ()]
    if any(a.endswith("ForSequenceClassification") for a in architectures):
        labels = _labels(config)
        return PoolingSpec("rerank" if len(labels) == 1 else "classify", labels=labels)
    if any(a.endswith(("ForCausalLM", "ForConditionalGeneration")) for a in architectures):
        return None
    if any(a.endswith("Model") for a in architectures) and _is_encoder(config):
        return PoolingSpec("embed", ("cls",), normalize=True, dimensions=dimensions)
    return None


def _from_sentence_transformers(
    model_dir: Path, modules: Any, dimensions: tuple[int, ...]
) -> PoolingSpec:
    if not isinstance(modules, list):
        raise ConfigError(f"{model_dir}/modules.json is not a list of modules", _REFETCH)
    kinds = [(str(m.get("type", "")), str(m.get("path", ""))) for m in modules]
    for kind, _ in kinds:
        name = kind.removeprefix(_ST_MODULE)
        if not kind.startswith(_ST_MODULE) or name not in _KNOWN_MODULES:
            raise ConfigError(
                f"{model_dir}'s sentence-transformers pipeline has a {kind or 'nameless'} "
                f"module, which tgis does not run (it runs {', '.join(_KNOWN_MODULES)})",
                "serve a model whose modules.json lists only those modules",
            )
    pooling = [path for kind, path in kinds if kind.endswith(".Pooling")]
    if not pooling:
        raise ConfigError(f"{model_dir}/modules.json has no Pooling module", _REFETCH)
    settings = _json(model_dir / pooling[0] / "config.json")
    modes = tuple(mode for mode in MODES if settings.get(_MODE_KEYS[mode]))
    if not modes:
        raise ConfigError(
            f"{model_dir}/{pooling[0]}/config.json turns no pooling mode on", _REFETCH
        )
    bert = model_dir / "sentence_bert_config.json"
    max_length = _json(bert).get("max_seq_length") if bert.is_file() else None
    return PoolingSpec(
        "embed",
        modes,
        normalize=any(kind.endswith(".Normalize") for kind, _ in kinds),
        max_length=int(max_length) if max_length else None,
        dimensions=dimensions,
        source="sentence-transformers",
    )


def _labels(config: dict[str, Any]) -> tuple[str, ...]:
    id2label = config.get("id2label") or {}
    count = int(config.get("num_labels") or len(id2label) or 1)
    return tuple(str(id2label.get(str(i), id2label.get(i, f"LABEL_{i}"))) for i in range(count))


def _is_encoder(config: dict[str, Any]) -> bool:
    """Whether the model attends both ways (an encoder): not a decoder by its config."""
    return not config.get("is_decoder", False) and "num_key_value_heads" not in config


_REFETCH = "download the model again, or fix the file by hand"


def _json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"{path} is missing", _REFETCH) from None
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{path} is not valid JSON: {exc}", _REFETCH) from None

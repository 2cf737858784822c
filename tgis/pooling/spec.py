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

A causal LM that reranks by answering yes or no (Qwen3-Reranker style) says nothing of it in its
files: `--rerank-tokens yes,no` makes it a reranker scored by those two tokens' logits, and
`--rerank-template` gives the Jinja text each (query, document) pair is put in. A decoder the
paged forward runs (models/families.py) pools on its layers (`PoolingSpec.decoder`,
tgis.pooling.decoder); an encoder runs as transformers' model.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, replace
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
    # Where it was read: "sentence-transformers", "architecture" or "--rerank-tokens".
    source: str = "architecture"
    # Whether the model runs on the paged engine's decoder layers (tgis.pooling.decoder).
    decoder: bool = False
    # A yes/no reranker's two tokens (--rerank-tokens): the score is logit(yes) - logit(no).
    score_tokens: tuple[str, ...] = ()
    # The Jinja text a (query, document) pair is rendered into (--rerank-template).
    template: str | None = None
    # Sentence-transformers' named prompts (config_sentence_transformers.json): (name, text)
    # pairs, the one applied when a request names none, and whether the prompt's tokens are
    # pooled with the text's (the Pooling module's include_prompt).
    prompts: tuple[tuple[str, str], ...] = ()
    default_prompt: str | None = None
    include_prompt: bool = True


def read_pooling_spec(
    model_dir: Path,
    config: dict[str, Any],
    rerank_tokens: Sequence[str] = (),
    rerank_template: Path | None = None,
) -> PoolingSpec | None:
    """The pooling spec of the model in `model_dir` (its config.json as `config`); None for
    a text generator. `rerank_tokens` / `rerank_template`: --rerank-tokens and
    --rerank-template (module doc). A ConfigError names a sentence-transformers module tgis
    does not run, or a flag the model cannot take."""
    if rerank_tokens:
        return _yes_no_reranker(model_dir, config, tuple(rerank_tokens), rerank_template)
    if rerank_template is not None:
        raise ConfigError(
            "--rerank-template renders a decoder reranker's input, and --rerank-tokens is not "
            "given",
            "give --rerank-tokens too (Qwen3-Reranker: --rerank-tokens yes,no), or drop "
            "--rerank-template",
        )
    dimensions = tuple(int(d) for d in config.get("matryoshka_dimensions") or ())
    modules = model_dir / "modules.json"
    if modules.is_file():
        spec = _from_sentence_transformers(model_dir, _json(modules), dimensions)
        return replace(spec, decoder=runs_on_decoder_layers(config))
    architectures = [str(a) for a in config.get("architectures") or ()]
    if any(a.endswith("ForSequenceClassification") for a in architectures):
        labels = _labels(config)
        task: Task = "rerank" if len(labels) == 1 else "classify"
        return PoolingSpec(task, labels=labels, decoder=runs_on_decoder_layers(config))
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
    # A mode the file leaves out takes sentence-transformers' default: mean on, the rest off.
    modes = tuple(mode for mode in MODES if settings.get(_MODE_KEYS[mode], mode == "mean"))
    if not modes:
        raise ConfigError(
            f"{model_dir}/{pooling[0]}/config.json turns no pooling mode on", _REFETCH
        )
    bert = model_dir / "sentence_bert_config.json"
    max_length = _json(bert).get("max_seq_length") if bert.is_file() else None
    prompts, default = _prompts(model_dir / "config_sentence_transformers.json")
    return PoolingSpec(
        "embed",
        modes,
        normalize=any(kind.endswith(".Normalize") for kind, _ in kinds),
        max_length=int(max_length) if max_length else None,
        dimensions=dimensions,
        source="sentence-transformers",
        prompts=prompts,
        default_prompt=default,
        include_prompt=bool(settings.get("include_prompt", True)),
    )


def _prompts(path: Path) -> tuple[tuple[tuple[str, str], ...], str | None]:
    """The named prompts and the default prompt's name of config_sentence_transformers.json
    (none where the file is absent)."""
    if not path.is_file():
        return (), None
    settings = _json(path)
    prompts = settings.get("prompts") or {}
    if not isinstance(prompts, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in prompts.items()
    ):
        raise ConfigError(f"{path}'s `prompts` is not an object of names to texts", _REFETCH)
    default = settings.get("default_prompt_name")
    if default is not None and default not in prompts:
        raise ConfigError(
            f"{path}'s default_prompt_name {default!r} is not one of its prompts "
            f"({', '.join(prompts) or 'none'})",
            _REFETCH,
        )
    return tuple(prompts.items()), default


def runs_on_decoder_layers(config: dict[str, Any]) -> bool:
    """Whether the paged engine's decoder forward runs the model of `config`."""
    from tgis.backends.models.families import family_of, paged_unsupported_reason

    return (
        not _is_encoder(config)
        and family_of(config) is not None
        and paged_unsupported_reason(config) is None
    )


def _yes_no_reranker(
    model_dir: Path, config: dict[str, Any], tokens: tuple[str, ...], template: Path | None
) -> PoolingSpec:
    flag = f"--rerank-tokens {','.join(tokens)}"
    if len(tokens) != 2 or not all(tokens):
        raise ConfigError(
            f"{flag}: it takes two tokens, the answer scored and the one it is weighed against",
            "give them as YES,NO (Qwen3-Reranker: --rerank-tokens yes,no)",
        )
    architectures = [str(a) for a in config.get("architectures") or ()]
    if not any(a.endswith("ForCausalLM") for a in architectures):
        raise ConfigError(
            f"{flag} scores a causal LM's answer, and {model_dir} is "
            f"{', '.join(architectures) or 'no causal LM'}",
            "drop --rerank-tokens: a cross-encoder (*ForSequenceClassification) reranks as it is",
        )
    if not runs_on_decoder_layers(config):
        from tgis.backends.models.families import paged_unsupported_reason

        raise ConfigError(
            f"{flag}: {paged_unsupported_reason(config) or 'the model is not a decoder'}",
            "serve a decoder reranker of a family tgis runs (docs/models.md)",
        )
    text = None
    if template is not None:
        try:
            text = template.read_text()
        except OSError as exc:
            raise ConfigError(
                f"--rerank-template {template}: {exc.strerror or exc}",
                "give the path of a Jinja file that places {{ query }} and {{ document }}",
            ) from None
        compile_template(text, f"--rerank-template {template}")
    return PoolingSpec(
        "rerank", labels=(tokens[0],), source="--rerank-tokens", decoder=True,
        score_tokens=tokens, template=text,
    )  # fmt: skip


def compile_template(text: str, name: str = "the rerank template") -> Any:
    """A reranker's Jinja template, checked: it must render with a query and a document and
    place both; a ConfigError names what is wrong."""
    import jinja2

    fix = "write a Jinja text that places {{ query }} and {{ document }}"
    try:
        template = jinja2.Environment(undefined=jinja2.StrictUndefined).from_string(text)
        probe = template.render(query="\x00query\x00", document="\x00document\x00")
    except jinja2.TemplateError as exc:
        raise ConfigError(f"{name} does not render: {exc}", fix) from None
    for part in ("query", "document"):
        if f"\x00{part}\x00" not in probe:
            raise ConfigError(f"{name} never places the {part}", fix)
    return template


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

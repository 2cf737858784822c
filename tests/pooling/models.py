"""Tiny random pooling models on disk, in the layouts real ones ship in: a BERT encoder with
sentence-transformers' modules (a pooling mode, Normalize or not), a cross-encoder reranker
(`BertForSequenceClassification`, one label), a decoder embedder (Qwen2, last-token
pooling) and a decoder that reranks by a yes/no answer (Qwen2), each with the suite's tokenizer trained on the fly."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import torch

from tests.factories import SPECIAL_TOKENS, VOCAB_SIZE, tiny_config, tiny_tokenizer

PAD_ID = list(SPECIAL_TOKENS).index("pad")
TEXTS = [
    "def fibonacci(n):",
    "import os",
    "class Tree: left right",
    "the quick brown fox jumps over the lazy dog again and again",
    "x",
]


def _bert_config(**more: object) -> object:
    from transformers import BertConfig

    return BertConfig(
        vocab_size=VOCAB_SIZE, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=64, max_position_embeddings=128, pad_token_id=PAD_ID, **more,
    )  # fmt: skip


# Named prompts as embedding models ship them (config_sentence_transformers.json).
PROMPTS = {"query": "find code that does: ", "passage": "code: "}


def write_sentence_transformers(
    directory: Path,
    modes: Sequence[str],
    normalize: bool,
    dimension: int,
    prompts: dict[str, str] | None = None,
    default_prompt: str | None = None,
    include_prompt: bool = True,
) -> None:
    """modules.json, 1_Pooling/config.json (and 2_Normalize) as sentence-transformers saves,
    and config_sentence_transformers.json with `prompts`."""
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
    ]  # fmt: skip
    if normalize:
        modules.append(
            {"idx": 2, "name": "2", "path": "2_Normalize",
             "type": "sentence_transformers.models.Normalize"}
        )  # fmt: skip
        (directory / "2_Normalize").mkdir(exist_ok=True)
    (directory / "modules.json").write_text(json.dumps(modules))
    keys = {
        "cls": "pooling_mode_cls_token", "max": "pooling_mode_max_tokens",
        "mean": "pooling_mode_mean_tokens", "mean_sqrt_len": "pooling_mode_mean_sqrt_len_tokens",
        "weightedmean": "pooling_mode_weightedmean_tokens", "lasttoken": "pooling_mode_lasttoken",
    }  # fmt: skip
    if prompts is not None:
        (directory / "config_sentence_transformers.json").write_text(
            json.dumps({"prompts": prompts, "default_prompt_name": default_prompt,
                        "similarity_fn_name": "cosine"})
        )  # fmt: skip
    pooling = {"word_embedding_dimension": dimension, "include_prompt": include_prompt}
    pooling |= {key: mode in modes for mode, key in keys.items()}
    (directory / "1_Pooling").mkdir(exist_ok=True)
    (directory / "1_Pooling" / "config.json").write_text(json.dumps(pooling))
    (directory / "sentence_bert_config.json").write_text(
        json.dumps({"max_seq_length": 64, "do_lower_case": False})
    )


def bert_embedder(
    directory: Path,
    modes: Sequence[str] = ("mean",),
    normalize: bool = True,
    seed: int = 0,
    **prompts: object,
) -> Path:
    """`prompts`: write_sentence_transformers' prompts, default_prompt and include_prompt."""
    from transformers import BertModel

    torch.manual_seed(seed)
    BertModel(_bert_config()).eval().save_pretrained(directory)
    tiny_tokenizer().save_pretrained(directory)
    write_sentence_transformers(directory, modes, normalize, 32, **prompts)  # type: ignore[arg-type]
    return directory


def encoder_embedder(
    directory: Path, arch: str, modes: Sequence[str] = ("mean",), seed: int = 0
) -> Path:
    """An XLM-RoBERTa (positions offset past the padding id) or ModernBERT (alternating local
    and global attention) encoder with sentence-transformers' modules."""
    from transformers import ModernBertConfig, ModernBertModel, XLMRobertaConfig, XLMRobertaModel

    shape = {
        "vocab_size": VOCAB_SIZE, "hidden_size": 32, "num_hidden_layers": 2,
        "num_attention_heads": 4, "intermediate_size": 64, "pad_token_id": PAD_ID,
        "bos_token_id": 1, "eos_token_id": 2,
    }  # fmt: skip
    torch.manual_seed(seed)
    if arch == "xlm-roberta":  # its positions start after the padding id's
        model = XLMRobertaModel(XLMRobertaConfig(max_position_embeddings=130, **shape))
    elif arch == "modernbert":
        config = ModernBertConfig(
            max_position_embeddings=128, cls_token_id=1, sep_token_id=2, **shape
        )
        model = ModernBertModel(config)
    else:
        raise ValueError(f"no encoder {arch!r}")
    model.eval().save_pretrained(directory)
    tiny_tokenizer().save_pretrained(directory)
    write_sentence_transformers(directory, modes, True, 32)
    return directory


def cross_encoder(directory: Path, seed: int = 0) -> Path:
    from transformers import BertForSequenceClassification

    torch.manual_seed(seed)
    model = BertForSequenceClassification(_bert_config(num_labels=1)).eval()
    model.save_pretrained(directory)
    tiny_tokenizer().save_pretrained(directory)
    return directory


def decoder_embedder(
    directory: Path, modes: Sequence[str] = ("lasttoken",), normalize: bool = True, seed: int = 0
) -> Path:
    """A Qwen2 base model (Qwen3-Embedding's layout: no lm_head) with sentence-transformers'
    modules."""
    from transformers import AutoModel

    torch.manual_seed(seed)
    AutoModel.from_config(tiny_config("qwen2")).eval().save_pretrained(directory)
    tiny_tokenizer().save_pretrained(directory)
    write_sentence_transformers(directory, modes, normalize, 32)
    return directory


def decoder_cross_encoder(directory: Path, num_labels: int = 1, seed: int = 0) -> Path:
    """A Qwen2ForSequenceClassification (the layout of Qwen3-Reranker's "seq-cls" conversions):
    one label reranks, more classify."""
    from transformers import AutoModelForSequenceClassification

    torch.manual_seed(seed)
    config = tiny_config("qwen2", num_labels=num_labels, pad_token_id=PAD_ID)
    AutoModelForSequenceClassification.from_config(config).eval().save_pretrained(directory)
    tiny_tokenizer().save_pretrained(directory)
    return directory


# The two one-token words of the suite's tokenizer a yes/no reranker answers with.
YES, NO = "the", "a"


def yes_no_reranker(directory: Path, seed: int = 0) -> Path:
    """A Qwen2 causal LM (Qwen3-Reranker's layout) whose yes/no logits score a pair."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    config = tiny_config("qwen2", tie_word_embeddings=False)
    AutoModelForCausalLM.from_config(config).eval().save_pretrained(directory)
    tiny_tokenizer().save_pretrained(directory)
    return directory

"""Tiny random models for tests: complete model directories in a few milliseconds.

Every directory written here is a model transformers can load (`config.json`, weights in the
requested format, `generation_config.json`) plus, by default, a tiny trained tokenizer
(`tokenizer.json`, `tokenizer_config.json`, `special_tokens_map.json`).

    model_dir = make_model_dir(tmp_path / "llama", arch="llama", weights="sharded-bin")

Architectures: "llama" (tied input/output embeddings, grouped-query attention) and "gpt2"
(tied embeddings, fused attention). Shapes: hidden 32, 2 layers, vocab 128.
More causal LMs for the backend tests (same tiny shape, their own configs' defaults otherwise):
"mistral", "qwen2" (q/k/v biases, untied), "gpt_neox", "bloom" (alibi) and "falcon"
(multi-query, rotary; `new_decoder_architecture=True` and `alibi=True` as overrides); and the
encoder-decoder "t5" (flan-T5's gated-gelu layout) and "bart".
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    from transformers import PretrainedConfig, PreTrainedModel, PreTrainedTokenizerFast

Arch = Literal["llama", "gpt2", "mistral", "qwen2", "gpt_neox", "bloom", "falcon", "t5", "bart"]
WeightsFormat = Literal["bin", "sharded-bin", "safetensors", "sharded-safetensors"]

VOCAB_SIZE = 128
HIDDEN_SIZE = 32
NUM_LAYERS = 2
# Small enough that the tiny models above split into several shards (about 90 KB of weights).
SHARD_SIZE = "20KB"
CORPUS = (
    "The quick brown fox jumps over the lazy dog.",
    "A text generation server streams tokens to many clients at once.",
    "Weights are downloaded once, converted to safetensors and served offline.",
    "Continuous batching keeps the accelerator busy between requests.",
    "Hello world! Hello tokens, hello batches, hello models.",
)
SPECIAL_TOKENS = {"unk": "<unk>", "bos": "<s>", "eos": "</s>", "pad": "<pad>"}


def tiny_config(arch: Arch = "llama", **overrides: object) -> PretrainedConfig:
    """A transformers config of the tiny shape for `arch`; keyword arguments override fields.

    Both architectures tie their input and output embeddings (`tie_word_embeddings=True`), so
    their state dicts hold `lm_head.weight` as an alias of the embedding matrix.
    """
    from transformers import GPT2Config, LlamaConfig

    ids = {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 3}
    if arch == "llama":
        fields: dict[str, object] = {
            "vocab_size": VOCAB_SIZE,
            "hidden_size": HIDDEN_SIZE,
            "intermediate_size": 2 * HIDDEN_SIZE,
            "num_hidden_layers": NUM_LAYERS,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "max_position_embeddings": 256,
            "tie_word_embeddings": True,
            **ids,
        }
        return LlamaConfig(**{**fields, **overrides})
    if arch == "gpt2":
        fields = {
            "vocab_size": VOCAB_SIZE,
            "n_embd": HIDDEN_SIZE,
            "n_layer": NUM_LAYERS,
            "n_head": 4,
            "n_positions": 256,
            "tie_word_embeddings": True,
            **ids,
        }
        return GPT2Config(**{**fields, **overrides})
    extra = _more_tiny_fields(arch, ids)
    if extra is not None:
        config_class, fields = extra
        return config_class(**{**fields, **overrides})
    raise ValueError(
        f"unknown tiny architecture {arch!r}: use one of {('llama', 'gpt2', *MORE_ARCHS)}"
    )


MORE_ARCHS = ("mistral", "qwen2", "gpt_neox", "bloom", "falcon", "t5", "bart")


def _more_tiny_fields(arch: str, ids: dict[str, int]) -> tuple[type, dict[str, object]] | None:
    """Config class and tiny fields of the architectures beyond llama and gpt2 (None: unknown)."""
    from transformers import (
        BartConfig,
        BloomConfig,
        FalconConfig,
        GPTNeoXConfig,
        MistralConfig,
        Qwen2Config,
        T5Config,
    )

    heads = {"num_attention_heads": 4, "num_hidden_layers": NUM_LAYERS, "hidden_size": HIDDEN_SIZE}
    if arch in ("mistral", "qwen2"):
        kv = {"num_key_value_heads": 2, "intermediate_size": 2 * HIDDEN_SIZE}
        config_class = MistralConfig if arch == "mistral" else Qwen2Config
        return config_class, {
            "vocab_size": VOCAB_SIZE,
            "max_position_embeddings": 256,
            **heads,
            **kv,
            **ids,
        }
    if arch == "gpt_neox":
        return GPTNeoXConfig, {
            "vocab_size": VOCAB_SIZE,
            "intermediate_size": 4 * HIDDEN_SIZE,
            "max_position_embeddings": 256,
            **heads,
            **ids,
        }
    if arch == "bloom":
        return BloomConfig, {
            "vocab_size": VOCAB_SIZE,
            "hidden_size": HIDDEN_SIZE,
            "n_layer": NUM_LAYERS,
            "n_head": 4,
            **ids,
        }
    if arch == "t5":  # flan-T5's layout by default: gated-gelu, untied head
        return T5Config, {
            "vocab_size": VOCAB_SIZE,
            "d_model": HIDDEN_SIZE,
            "d_kv": 8,
            "d_ff": 2 * HIDDEN_SIZE,
            "num_layers": NUM_LAYERS,
            "num_decoder_layers": NUM_LAYERS,
            "num_heads": 4,
            "relative_attention_num_buckets": 8,
            "relative_attention_max_distance": 16,
            "feed_forward_proj": "gated-gelu",
            "tie_word_embeddings": False,
            "decoder_start_token_id": ids["pad_token_id"],
            **ids,
        }
    if arch == "bart":
        return BartConfig, {
            "vocab_size": VOCAB_SIZE,
            "d_model": HIDDEN_SIZE,
            "encoder_layers": NUM_LAYERS,
            "decoder_layers": NUM_LAYERS,
            "encoder_attention_heads": 4,
            "decoder_attention_heads": 4,
            "encoder_ffn_dim": 2 * HIDDEN_SIZE,
            "decoder_ffn_dim": 2 * HIDDEN_SIZE,
            "max_position_embeddings": 256,
            "decoder_start_token_id": ids["eos_token_id"],
            "forced_bos_token_id": None,
            "forced_eos_token_id": None,
            **ids,
        }
    if arch == "falcon":
        return FalconConfig, {
            "vocab_size": VOCAB_SIZE,
            "max_position_embeddings": 256,
            **heads,
            **ids,
        }
    return None


def tiny_model(arch: Arch = "llama", seed: int = 0, **overrides: object) -> PreTrainedModel:
    """A randomly initialised causal LM of the tiny shape, in eval mode, float32, on CPU.

    The same `seed` gives the same weights, so two calls build identical models.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoModelForSeq2SeqLM

    torch.manual_seed(seed)
    config = tiny_config(arch, **overrides)
    auto = AutoModelForSeq2SeqLM if config.is_encoder_decoder else AutoModelForCausalLM
    return auto.from_config(config).eval()


def tiny_tokenizer() -> PreTrainedTokenizerFast:
    """A BPE tokenizer trained on `CORPUS`, with <unk>=0 <s>=1 </s>=2 <pad>=3, under VOCAB_SIZE.

    Deterministic: the same corpus always trains the same vocabulary.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE(unk_token=SPECIAL_TOKENS["unk"]))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace()
    tokenizer.decoder = decoders.Metaspace()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE, special_tokens=list(SPECIAL_TOKENS.values()), show_progress=False
    )
    tokenizer.train_from_iterator(CORPUS, trainer=trainer)
    return _fast(tokenizer)


def _fast(tokenizer: Any) -> PreTrainedTokenizerFast:
    """A trained `tokenizers` tokenizer as transformers' fast tokenizer with SPECIAL_TOKENS."""
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        unk_token=SPECIAL_TOKENS["unk"],
        bos_token=SPECIAL_TOKENS["bos"],
        eos_token=SPECIAL_TOKENS["eos"],
        pad_token=SPECIAL_TOKENS["pad"],
        model_input_names=["input_ids", "attention_mask"],  # causal LMs take no token_type_ids
    )


# The byte-level tokenizer's vocabulary: the specials, the 256 bytes, and merges.
BYTE_VOCAB_SIZE = 384


def tiny_byte_level_tokenizer() -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer (GPT-2's alphabet: any text round-trips) trained on `CORPUS`,
    with <unk>=0 <s>=1 </s>=2 <pad>=3 and BYTE_VOCAB_SIZE tokens: the kind structured output
    (llguidance) can take, which `tiny_tokenizer`'s Metaspace is not."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=BYTE_VOCAB_SIZE, special_tokens=list(SPECIAL_TOKENS.values()),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )  # fmt: skip
    tokenizer.train_from_iterator(CORPUS, trainer=trainer)
    return _fast(tokenizer)


def save_model(
    model: PreTrainedModel,
    directory: Path,
    weights: WeightsFormat = "safetensors",
    with_tokenizer: bool = True,
) -> Path:
    """Write `model` to `directory` in the given weights format; return the directory.

    - "bin": one `pytorch_model.bin` (tied tensors stored once, shared by both names)
    - "sharded-bin": `pytorch_model-0000i-of-0000n.bin` + `pytorch_model.bin.index.json`
    - "safetensors": one `model.safetensors` (transformers drops the tied `lm_head.weight`)
    - "sharded-safetensors": `model-0000i-of-0000n.safetensors` + `model.safetensors.index.json`
    """
    directory.mkdir(parents=True, exist_ok=True)
    safe = weights in ("safetensors", "sharded-safetensors")
    shard = SHARD_SIZE if weights.startswith("sharded") else "10GB"
    model.save_pretrained(directory, safe_serialization=safe, max_shard_size=shard)
    if with_tokenizer:
        tiny_tokenizer().save_pretrained(directory)
    return directory


def make_model_dir(
    directory: Path,
    arch: Arch = "llama",
    weights: WeightsFormat = "safetensors",
    seed: int = 0,
    with_tokenizer: bool = True,
) -> Path:
    """Build a tiny random `arch` model and save it to `directory` (see `save_model`)."""
    return save_model(tiny_model(arch, seed), directory, weights, with_tokenizer)


def weight_files(directory: Path) -> list[str]:
    """Names of the weight files (.bin / .safetensors) directly in `directory`, sorted."""
    return sorted(
        p.name for p in directory.iterdir() if p.suffix in (".bin", ".safetensors") and p.is_file()
    )


def make_lora_adapter(
    base: PreTrainedModel,
    directory: Path,
    seed: int = 1,
    *,
    binary: bool = False,
    **config: Any,
) -> PreTrainedModel:
    """Save a PEFT LoRA adapter of `base` with random (non-zero) factors to `directory` and
    return a copy of `base` with it merged into the weights (the reference it must equal).
    `config`: LoraConfig's fields (default: rank 4 on every projection, lora_alpha 8)."""
    import copy

    import torch
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    settings: dict[str, Any] = {
        "r": 4,
        "lora_alpha": 8,
        "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                           "down_proj"],
        "init_lora_weights": False,
        **config,
    }  # fmt: skip
    peft_model = get_peft_model(copy.deepcopy(base), LoraConfig(**settings))
    peft_model.save_pretrained(directory, safe_serialization=not binary)
    return peft_model.merge_and_unload().eval()


VisionArch = Literal["llava_next", "idefics3", "qwen2_vl", "qwen2_5_vl", "gemma3"]
# What a tiny vision-language template writes: each image part is the image placeholder.
VISION_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}:"
    "{% for c in m['content'] %}{% if c['type'] == 'image' %}<image>"
    "{% else %}{{ c['text'] }}{% endif %}{% endfor %}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)


def make_vision_dir(
    directory: Path, arch: VisionArch = "llava_next", seed: int = 0, *, byte_level: bool = False
) -> Path:
    """A tiny random vision-language model of `arch` with its processor (the tiny tokenizer
    with the image token added, the family's image processor at 32-pixel tiles and a chat
    template whose image parts write `<image>`), saved to `directory`. Its weights are drawn
    wider than transformers' default so that images change the greedy text. `byte_level`:
    the tokenizer is `tiny_byte_level_tokenizer` instead (structured output can use it)."""
    import torch
    from transformers import AutoModelForImageTextToText

    if arch in ("qwen2_vl", "qwen2_5_vl"):
        return _make_qwen_vl_dir(directory, arch, seed, byte_level)
    if arch == "gemma3":
        return _make_gemma3_dir(directory, seed)
    tokenizer = tiny_byte_level_tokenizer() if byte_level else tiny_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": ["<image>"]})
    image_id = tokenizer.convert_tokens_to_ids("<image>")
    vocab = (BYTE_VOCAB_SIZE if byte_level else VOCAB_SIZE) + 8
    text = tiny_config(
        "llama", vocab_size=vocab, initializer_range=0.2, max_position_embeddings=1024
    ).to_dict()
    if arch == "llava_next":
        from transformers import (
            CLIPVisionConfig,
            LlavaNextConfig,
            LlavaNextImageProcessor,
            LlavaNextProcessor,
        )

        pinpoints = [[32, 32], [32, 64], [64, 32], [64, 64]]
        vision = CLIPVisionConfig(
            hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
            image_size=32, patch_size=8, projection_dim=16, initializer_range=0.2,
        )  # fmt: skip
        config: Any = LlavaNextConfig(
            vision_config=vision.to_dict(), text_config=text, image_token_index=image_id,
            image_grid_pinpoints=pinpoints, vision_feature_layer=-1,
        )  # fmt: skip
        processor: Any = LlavaNextProcessor(
            image_processor=LlavaNextImageProcessor(
                size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32},
                image_grid_pinpoints=pinpoints,
            ),
            tokenizer=tokenizer, patch_size=8, vision_feature_select_strategy="default",
            image_token="<image>", num_additional_image_tokens=1, chat_template=VISION_TEMPLATE,
        )  # fmt: skip
    else:
        from transformers import (
            Idefics3Config,
            Idefics3ImageProcessor,
            Idefics3Processor,
            Idefics3VisionConfig,
        )

        tokenizer.add_special_tokens(
            {
                "additional_special_tokens": [
                    "<image>", "<fake_token_around_image>", "<global-img>",
                    *(f"<row_{r}_col_{c}>" for r in range(1, 3) for c in range(1, 3)),
                ]
            }
        )  # fmt: skip
        vision = Idefics3VisionConfig(
            hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
            image_size=32, patch_size=8, initializer_range=0.2,
        )  # fmt: skip
        config = Idefics3Config(
            vision_config=vision.to_dict(), text_config=text, image_token_id=image_id,
            scale_factor=2,
        )  # fmt: skip
        processor = Idefics3Processor(
            image_processor=Idefics3ImageProcessor(
                size={"longest_edge": 64}, max_image_size={"longest_edge": 32},
            ),
            tokenizer=tokenizer, image_seq_len=4, chat_template=VISION_TEMPLATE,
        )  # fmt: skip
    torch.manual_seed(seed)
    model = AutoModelForImageTextToText.from_config(config).eval()
    model.save_pretrained(directory)
    processor.save_pretrained(directory)
    return directory


QWEN_VL_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")
# What a tiny Qwen2-VL template writes for an image part, as Qwen2-VL's own does.
QWEN_VL_IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"


def _make_qwen_vl_dir(directory: Path, arch: str, seed: int, byte_level: bool = False) -> Path:
    """A tiny random Qwen2-VL or Qwen2.5-VL: the tiny tokenizer (or the byte-level one) as a
    Qwen2 tokenizer with the vision tokens added, 4-pixel patches merged 2x2, two-section
    multimodal rope."""
    import torch
    from transformers import AutoModelForImageTextToText, Qwen2TokenizerFast, Qwen2VLImageProcessor

    plain = tiny_byte_level_tokenizer() if byte_level else tiny_tokenizer()
    tokenizer = Qwen2TokenizerFast(
        tokenizer_object=plain.backend_tokenizer, bos_token=plain.bos_token,
        eos_token=plain.eos_token, unk_token=plain.unk_token, pad_token=plain.pad_token,
    )  # fmt: skip
    tokenizer.add_special_tokens({"additional_special_tokens": list(QWEN_VL_TOKENS)})
    tokenizer.chat_template = VISION_TEMPLATE.replace("<image>", QWEN_VL_IMAGE)
    ids = dict(
        zip(QWEN_VL_TOKENS, tokenizer.convert_tokens_to_ids(list(QWEN_VL_TOKENS)), strict=True)
    )
    vocab = (BYTE_VOCAB_SIZE if byte_level else VOCAB_SIZE) + 8
    text = tiny_config(
        "qwen2", vocab_size=vocab, initializer_range=0.2, max_position_embeddings=1024
    ).to_dict()
    head_dim = text["hidden_size"] // text["num_attention_heads"]
    # Sections of the rotary frequencies: temporal, height, width.
    third = head_dim // 2 // 3
    text["rope_scaling"] = {
        "type": "mrope",
        "mrope_section": [head_dim // 2 - 2 * third, third, third],
    }
    tokens = {
        "image_token_id": ids["<|image_pad|>"], "video_token_id": ids["<|video_pad|>"],
        "vision_start_token_id": ids["<|vision_start|>"],
        "vision_end_token_id": ids["<|vision_end|>"],
    }  # fmt: skip
    if arch == "qwen2_vl":
        from transformers import Qwen2VLConfig

        vision = {
            "depth": 2, "embed_dim": 16, "hidden_size": text["hidden_size"], "num_heads": 2,
            "mlp_ratio": 2, "patch_size": 4, "spatial_merge_size": 2, "temporal_patch_size": 2,
            "initializer_range": 0.2,
        }  # fmt: skip
        config: Any = Qwen2VLConfig(text_config=text, vision_config=vision, **tokens)
    else:
        from transformers import Qwen2_5_VLConfig

        vision = {
            "depth": 2, "hidden_size": 16, "intermediate_size": 32, "num_heads": 2,
            "out_hidden_size": text["hidden_size"], "patch_size": 4, "spatial_merge_size": 2,
            "temporal_patch_size": 2, "window_size": 16, "fullatt_block_indexes": [1],
            "initializer_range": 0.2,
        }  # fmt: skip
        config = Qwen2_5_VLConfig(text_config=text, vision_config=vision, **tokens)
    image_processor = Qwen2VLImageProcessor(
        patch_size=4, merge_size=2, temporal_patch_size=2, min_pixels=8 * 8, max_pixels=64 * 64
    )
    torch.manual_seed(seed)
    model = AutoModelForImageTextToText.from_config(config).eval()
    model.save_pretrained(directory)
    image_processor.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


# What a tiny Gemma 3 template writes for an image part, as Gemma 3's own does.
GEMMA3_IMAGE = "<start_of_image>"


def _make_gemma3_dir(directory: Path, seed: int) -> Path:
    """A tiny random Gemma 3 vision-language model: the tiny tokenizer as a Gemma tokenizer
    with the image tokens, 32-pixel images pooled to 4 rows, a sliding layer and a global one."""
    import torch
    from transformers import (
        AutoModelForImageTextToText,
        Gemma3Config,
        Gemma3ImageProcessor,
        Gemma3Processor,
        GemmaTokenizerFast,
    )

    plain = tiny_tokenizer()
    names = {
        "boi_token": GEMMA3_IMAGE, "eoi_token": "<end_of_image>",
        "image_token": "<image_soft_token>",
    }  # fmt: skip
    tokenizer = GemmaTokenizerFast(
        tokenizer_object=plain.backend_tokenizer, bos_token=plain.bos_token,
        eos_token=plain.eos_token, unk_token=plain.unk_token, pad_token=plain.pad_token,
        extra_special_tokens=names,
    )  # fmt: skip
    tokenizer.add_special_tokens({"additional_special_tokens": list(names.values())})
    ids = tokenizer.convert_tokens_to_ids(list(names.values()))
    text = {
        "model_type": "gemma3_text", "vocab_size": VOCAB_SIZE + 8, "hidden_size": 32,
        "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 8, "sliding_window": 16,
        "layer_types": ["sliding_attention", "full_attention"], "initializer_range": 0.2,
        "max_position_embeddings": 1024, "rope_local_base_freq": 100.0,
        "query_pre_attn_scalar": 8, "tie_word_embeddings": False,
    }  # fmt: skip
    vision = {
        "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 2,
        "num_attention_heads": 2, "image_size": 32, "patch_size": 8,
    }  # fmt: skip
    config = Gemma3Config(
        text_config=text, vision_config=vision, mm_tokens_per_image=4,
        boi_token_index=ids[0], eoi_token_index=ids[1], image_token_index=ids[2],
    )  # fmt: skip
    processor = Gemma3Processor(
        image_processor=Gemma3ImageProcessor(size={"height": 32, "width": 32}),
        tokenizer=tokenizer, image_seq_length=4,
        chat_template=VISION_TEMPLATE.replace("<image>", GEMMA3_IMAGE),
    )  # fmt: skip
    torch.manual_seed(seed)
    model = AutoModelForImageTextToText.from_config(config).eval()
    with torch.no_grad():  # transformers starts the projection at zero: images would not count
        for param in model.model.multi_modal_projector.parameters():
            param.normal_(0.0, 0.5)
    model.save_pretrained(directory)
    processor.save_pretrained(directory)
    return directory


def qwen_vl_processor(model_dir: Path) -> Any:
    """transformers' own Qwen2VLProcessor over a tiny Qwen2-VL directory, without its video
    half (which needs torchvision): the oracle of what the served prompt's ids must be."""
    from transformers import AutoImageProcessor, AutoTokenizer, Qwen2VLProcessor

    processor = Qwen2VLProcessor.__new__(Qwen2VLProcessor)
    processor.image_processor = AutoImageProcessor.from_pretrained(model_dir)
    processor.tokenizer = AutoTokenizer.from_pretrained(model_dir)
    processor.video_processor = None
    processor.chat_template = processor.tokenizer.chat_template
    processor.image_token = "<|image_pad|>"
    processor.video_token = "<|video_pad|>"
    processor.image_token_id = processor.tokenizer.convert_tokens_to_ids("<|image_pad|>")
    processor.video_token_id = processor.tokenizer.convert_tokens_to_ids("<|video_pad|>")
    return processor


def random_image(height: int, width: int, seed: int = 0) -> Any:
    """An RGB PIL image of random pixels."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))

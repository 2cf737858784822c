"""Train the bundled demo model: a small Llama and its byte-level BPE tokenizer.

The corpus is the Python standard library's own source (every machine that runs
this script has it, offline). The run is seeded and single-process, so the same
Python, torch and tokenizers versions give the same weights.

    python scripts/train_demo_model.py --output tgis/assets/demo-model

Takes about 20 minutes on 2 CPU cores with the defaults.

With --draft-of MODEL it trains a draft model for speculative decoding (--draft-model) instead:
a smaller Llama with MODEL's tokenizer, distilled from MODEL (its loss is the KL divergence
from MODEL's next-token distribution on the same corpus), so its greedy guesses are MODEL's as
often as its size allows:

    python scripts/train_demo_model.py --draft-of tgis/assets/demo-model --output /tmp/demo-draft
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import platform
import sys
import sysconfig
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

EOS = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
# ChatML: lets the OpenAI chat route format conversations for this model.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


@dataclass(frozen=True)
class TrainSettings:
    vocab_size: int = 4096
    hidden_size: int = 256
    num_layers: int = 6
    num_heads: int = 8
    num_kv_heads: int = 4
    intermediate_size: int = 704
    context: int = 256
    max_positions: int = 1024
    batch_size: int = 16
    steps: int = 1000
    lr: float = 2e-3
    warmup: int = 40
    seed: int = 1234
    eval_every: int = 100


# The draft model's shape (--draft-of): a third of the demo model's layers at half its width.
DRAFT = {
    "hidden_size": 128,
    "num_layers": 2,
    "num_heads": 4,
    "num_kv_heads": 2,
    "intermediate_size": 352,
    "steps": 600,
    "lr": 3e-3,
}


def corpus_files() -> list[Path]:
    """Standard-library source files, tests and vendored packages left out, sorted."""
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = {"site-packages", "test", "tests", "idlelib", "lib2to3", "__pycache__"}
    files = [f for f in root.rglob("*.py") if not skip.intersection(f.relative_to(root).parts)]
    return sorted(files, key=lambda f: str(f.relative_to(root)))


def is_validation(path: Path) -> bool:
    """About 1 file in 20 is held out, chosen by a hash of its name."""
    return int(hashlib.sha1(path.name.encode()).hexdigest(), 16) % 20 == 0


def train_tokenizer(texts: list[str], vocab_size: int) -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS, IM_START, IM_END],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        min_frequency=2,
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=EOS,
        eos_token=EOS,
        unk_token=EOS,
        pad_token=EOS,
        additional_special_tokens=[IM_START, IM_END],
        model_max_length=1024,
        clean_up_tokenization_spaces=False,
        # A decoder-only model takes no token_type_ids.
        model_input_names=["input_ids", "attention_mask"],
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def encode(tokenizer: PreTrainedTokenizerFast, texts: list[str]) -> torch.Tensor:
    """All texts as one stream of ids [n_tokens], each file followed by EOS."""
    eos = tokenizer.eos_token_id
    ids: list[int] = []
    for batch_start in range(0, len(texts), 64):
        for enc in tokenizer(texts[batch_start : batch_start + 64])["input_ids"]:
            ids.extend(enc)
            ids.append(eos)
    return torch.tensor(ids, dtype=torch.long)


def batch(stream: torch.Tensor, size: int, context: int, gen: torch.Generator) -> torch.Tensor:
    starts = torch.randint(0, stream.numel() - context - 1, (size,), generator=gen)
    return torch.stack([stream[s : s + context + 1] for s in starts.tolist()])


def loss_of(
    model: LlamaForCausalLM, x: torch.Tensor, teacher: LlamaForCausalLM | None
) -> torch.Tensor:
    """Next-token cross-entropy on the window `x`; with a teacher, the KL divergence from the
    teacher's next-token distributions instead."""
    if teacher is None:
        # transformers shifts the labels itself: labels == input_ids.
        return model(input_ids=x, labels=x).loss
    with torch.no_grad():
        target = torch.log_softmax(teacher(input_ids=x).logits.float(), dim=-1)
    student = torch.log_softmax(model(input_ids=x).logits.float(), dim=-1)
    kl = torch.nn.functional.kl_div(student, target, log_target=True, reduction="none")
    return kl.sum(-1).mean()


@torch.no_grad()
def evaluate(
    model: LlamaForCausalLM,
    stream: torch.Tensor,
    context: int,
    teacher: LlamaForCausalLM | None = None,
) -> float:
    """Mean loss over consecutive windows of the held-out stream (at most 64)."""
    model.eval()
    losses = []
    n = min(64, (stream.numel() - 1) // context)
    for i in range(0, n, 16):
        rows = [stream[j * context : j * context + context + 1] for j in range(i, min(n, i + 16))]
        losses.append(loss_of(model, torch.stack(rows), teacher).item() * len(rows))
    model.train()
    return sum(losses) / n


def lr_at(step: int, s: TrainSettings) -> float:
    if step < s.warmup:
        return s.lr * (step + 1) / s.warmup
    progress = (step - s.warmup) / max(1, s.steps - s.warmup)
    return s.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


MODEL_CARD = """---
license: psf-2.0
library_name: transformers
pipeline_tag: text-generation
---

# {title}

{intro}

| | |
|---|---|
| architecture | Llama: {layers} layers, hidden {hidden}, {heads} heads ({kv_heads} KV heads, GQA), MLP {mlp}, RoPE, tied embeddings |
| parameters | {parameters:,} |
| context | trained on {context}-token windows; max_position_embeddings {max_pos} |
| tokenizer | byte-level BPE, {vocab} tokens, trained on the same corpus; specials `<|endoftext|>` (bos/eos/pad), `<|im_start|>`, `<|im_end|>`; ChatML chat template |
| corpus | the Python {python} standard library's `.py` sources ({files} files; tests, idlelib, lib2to3 and site-packages left out): {train_tokens:,} training and {validation_tokens:,} validation tokens (1 file in 20 held out by name hash) |
| training | {steps} steps of AdamW (lr {lr}, cosine to 10%, {warmup} warmup steps, batch {batch} windows of {context} + 1 tokens = {tokens_seen:,} tokens), seed {seed}, float32 on 2 CPU cores in {minutes} minutes, torch {torch} |
| final validation loss | {final_validation_loss} {loss_unit} |

Greedy completion of `def fibonacci(n):` (48 new tokens):

```python
{greedy_fibonacci}
```

Reproduce with {command}. The same Python,
torch and tokenizers versions give the same weights.

## License

The training corpus is the Python standard library, distributed under the Python Software
Foundation License Version 2; this model is derived from it and released under the same terms.
"""


DEMO_INTRO = """A small Llama-architecture causal LM bundled with tgis so that `tgis serve` runs with no
arguments and the tests have a real model with a real tokenizer. It completes Python code
(badly, but recognisably); it is not useful for anything else."""
DRAFT_INTRO = """A draft model for speculative decoding with the tgis demo model (`tgis serve --speculate 4
--draft-model DIR`): {layers} layers at hidden {hidden}, the demo model's tokenizer, distilled
from the demo model (the KL divergence from its next-token distribution) on its corpus. The
tokenizer row below is the demo model's."""


def write_model_card(out: Path, facts: dict) -> None:
    s = facts["settings"]
    draft = facts.get("draft_of") is not None
    intro = DRAFT_INTRO if draft else DEMO_INTRO
    card = MODEL_CARD.format(
        title="tgis demo draft model" if draft else "tgis demo model",
        intro=intro.format(layers=s["num_layers"], hidden=s["hidden_size"]),
        loss_unit="nats/token of KL divergence from the demo model" if draft else "nats/token",
        command=(
            f"`python scripts/train_demo_model.py --draft-of {facts['draft_of']} --output DIR`"
            if draft
            else "`make demo-model` (`python scripts/train_demo_model.py`)"
        ),
        layers=s["num_layers"],
        hidden=s["hidden_size"],
        heads=s["num_heads"],
        kv_heads=s["num_kv_heads"],
        mlp=s["intermediate_size"],
        max_pos=s["max_positions"],
        vocab=s["vocab_size"],
        context=s["context"],
        lr=s["lr"],
        warmup=s["warmup"],
        batch=s["batch_size"],
        seed=s["seed"],
        files=facts["corpus_files"],
        minutes=round(facts["training_seconds"] / 60),
        **{k: v for k, v in facts.items() if k != "settings"},
    )
    (out / "README.md").write_text(card)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", type=Path, default=Path("tgis/assets/demo-model"))
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument(
        "--draft-of", type=Path, default=None, help="train a draft model distilled from this one"
    )
    args = parser.parse_args()
    shape = DRAFT if args.draft_of is not None else {}
    s = TrainSettings(**{**shape, **({"steps": args.steps} if args.steps else {})})
    torch.manual_seed(s.seed)
    torch.set_num_threads(2)
    started = time.time()

    files = corpus_files()
    texts = {f: f.read_text(encoding="utf-8", errors="replace") for f in files}
    train_texts = [texts[f] for f in files if not is_validation(f)]
    val_texts = [texts[f] for f in files if is_validation(f)]
    teacher = None
    if args.draft_of is not None:
        tokenizer = PreTrainedTokenizerFast.from_pretrained(args.draft_of)
        teacher = LlamaForCausalLM.from_pretrained(args.draft_of).eval()
    else:
        tokenizer = train_tokenizer(train_texts, s.vocab_size)
    train_stream = encode(tokenizer, train_texts)
    val_stream = encode(tokenizer, val_texts)
    print(
        f"corpus: {len(files)} files, {train_stream.numel()} train / {val_stream.numel()} "
        f"validation tokens; tokenizer in {time.time() - started:.0f}s",
        flush=True,
    )

    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=s.hidden_size,
        intermediate_size=s.intermediate_size,
        num_hidden_layers=s.num_layers,
        num_attention_heads=s.num_heads,
        num_key_value_heads=s.num_kv_heads,
        max_position_embeddings=s.max_positions,
        rope_theta=10000.0,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        torch_dtype="float32",
    )
    model = LlamaForCausalLM(config)
    n_params = sum(p.numel() for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=s.lr, betas=(0.9, 0.95), weight_decay=0.1)
    gen = torch.Generator().manual_seed(s.seed)
    val_loss = float("nan")
    for step in range(s.steps):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, s)
        x = batch(train_stream, s.batch_size, s.context, gen)
        loss = loss_of(model, x, teacher)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if (step + 1) % s.eval_every == 0 or step + 1 == s.steps:
            val_loss = evaluate(model, val_stream, s.context, teacher)
            print(
                f"step {step + 1}/{s.steps} train {loss.item():.3f} val {val_loss:.3f} "
                f"({time.time() - started:.0f}s)",
                flush=True,
            )

    out: Path = args.output
    out.mkdir(parents=True, exist_ok=True)
    model.generation_config.max_new_tokens = 64
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    prompt = tokenizer("def fibonacci(n):", return_tensors="pt", return_token_type_ids=False)
    with torch.no_grad():
        sample = model.generate(**prompt, max_new_tokens=48, do_sample=False)
    completion = tokenizer.decode(sample[0], skip_special_tokens=True)
    facts = {
        "parameters": n_params,
        "corpus_files": len(files),
        "train_tokens": train_stream.numel(),
        "validation_tokens": val_stream.numel(),
        "steps": s.steps,
        "tokens_seen": s.steps * s.batch_size * (s.context + 1),
        "final_validation_loss": round(val_loss, 4),
        "training_seconds": round(time.time() - started),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "settings": s.__dict__,
        "greedy_fibonacci": completion,
        "draft_of": str(args.draft_of) if args.draft_of is not None else None,
    }
    (out / "training.json").write_text(json.dumps(facts, indent=2) + "\n")
    write_model_card(out, facts)
    print(json.dumps(facts, indent=2))


if __name__ == "__main__":
    sys.exit(main())

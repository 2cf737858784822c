"""A decoder embedder's forward three ways over the same texts of mixed lengths, on this machine:

- tgis: the paged engine's decoder layers over packed rows (tgis.pooling.decoder), what `tgis
  serve` runs for a Qwen3-Embedding-style model;
- tgis's earlier path: transformers' model over right-padded rows (`EncoderForward`);
- the peer: sentence-transformers' `encode` (which sorts its inputs by length before batching).

The model is a random Qwen3 in sentence-transformers' layout (last-token pooling, Normalize)
with the bundled demo model's tokenizer, of the shape given (no download). Each way embeds every
text `--rounds` times in batches of `--batch`; the best round counts. Printed: texts/s, tokens/s
and the ratio to the peer, and the lowest cosine between tgis's and the peer's embeddings.

    python scripts/bench_pooling.py --workdir /tmp/tgis-bench-pooling
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import time
from collections.abc import Callable
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def build(directory: Path, hidden: int, layers: int, heads: int, kv_heads: int) -> Path:
    from transformers import AutoTokenizer, Qwen3Config, Qwen3Model

    if (directory / "modules.json").is_file():
        return directory
    tokenizer = AutoTokenizer.from_pretrained(ROOT / "tgis" / "assets" / "demo-model")
    config = Qwen3Config(
        vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=hidden * 3,
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
        head_dim=hidden // heads, max_position_embeddings=2048, tie_word_embeddings=True,
    )  # fmt: skip
    torch.manual_seed(0)
    Qwen3Model(config).eval().save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"},
    ]  # fmt: skip
    (directory / "modules.json").write_text(json.dumps(modules))
    (directory / "1_Pooling").mkdir()
    (directory / "2_Normalize").mkdir()
    pooling = {"word_embedding_dimension": hidden, "pooling_mode_lasttoken": True}
    pooling["pooling_mode_mean_tokens"] = False  # on unless said (sentence-transformers)
    (directory / "1_Pooling" / "config.json").write_text(json.dumps(pooling))
    (directory / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 2048}))
    return directory


def texts_of(tokenizer: object, count: int, shortest: int, longest: int) -> list[str]:
    """`count` texts of lengths spread between `shortest` and `longest` tokens, cut from the
    Python sources of this repository."""
    words = " ".join(p.read_text() for p in sorted((ROOT / "tgis" / "pooling").glob("*.py")))
    ids = tokenizer(words, add_special_tokens=False)["input_ids"]  # type: ignore[operator]
    rng = random.Random(0)
    out = []
    for _ in range(count):
        n = rng.randint(shortest, longest)
        start = rng.randrange(0, len(ids) - n)
        # Stripped: sentence-transformers strips every text before it tokenizes it.
        out.append(tokenizer.decode(ids[start : start + n]).strip())  # type: ignore[attr-defined]
    return out


def best_of(rounds: int, run: Callable[[], torch.Tensor]) -> tuple[float, torch.Tensor]:
    best, out = float("inf"), torch.empty(0)
    for _ in range(rounds):
        start = time.perf_counter()
        out = run()
        best = min(best, time.perf_counter() - start)
    return best, out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/tgis-bench-pooling"))
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--texts", type=int, default=64)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--shortest", type=int, default=16)
    parser.add_argument("--longest", type=int, default=512)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()

    from sentence_transformers import SentenceTransformer
    from transformers import AutoModel

    from tgis.backends.common.device import cpu_threads
    from tgis.hub import read_model_config
    from tgis.pooling.model import EncoderForward, PoolingModel, finish_embedding
    from tgis.pooling.spec import read_pooling_spec

    torch.set_num_threads(cpu_threads())
    directory = build(
        args.workdir / "qwen3-embedder", args.hidden, args.layers, args.heads, args.kv_heads
    )
    spec = read_pooling_spec(directory, read_model_config(directory)[0])
    assert spec is not None and spec.decoder
    packed = PoolingModel.load(directory, spec, dtype=torch.float32)
    hf = AutoModel.from_pretrained(directory, dtype=torch.float32)
    padded = PoolingModel(
        EncoderForward(hf, packed.tokenizer.pad_token_id or 0),
        packed.tokenizer,
        spec,
        packed.config,
    )
    peer = SentenceTransformer(str(directory), device="cpu")
    texts = texts_of(packed.tokenizer, args.texts, args.shortest, args.longest)
    encoded = [packed.encode(t) for t in texts]
    tokens = sum(len(e["input_ids"]) for e in encoded)

    def ours(model: PoolingModel) -> Callable[[], torch.Tensor]:
        def run() -> torch.Tensor:
            rows = []
            for i in range(0, len(encoded), args.batch):
                rows += model.run(encoded[i : i + args.batch]).rows
            return torch.stack([finish_embedding(r, None, True) for r in rows])

        return run

    def theirs() -> torch.Tensor:
        return peer.encode(texts, batch_size=args.batch, convert_to_tensor=True).float()

    results = {}
    for name, run in (
        ("sentence-transformers encode", theirs),
        ("tgis packed (paged layers)", ours(packed)),
        ("tgis padded (transformers)", ours(padded)),
    ):
        seconds, out = best_of(args.rounds, run)
        results[name] = (seconds, out)
    peer_s, peer_out = results["sentence-transformers encode"]
    print(
        f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, torch {torch.__version__}"
    )
    print(f"Qwen3 hidden {args.hidden}, {args.layers} layers, {args.heads}/{args.kv_heads} heads, float32; "
          f"{args.texts} texts of {args.shortest}-{args.longest} tokens ({tokens} in all), batches of {args.batch}, best of {args.rounds}")  # fmt: skip
    print("| way | texts/s | tokens/s | vs encode | min cosine to encode |")
    print("|---|---|---|---|---|")
    for name, (seconds, out) in results.items():
        cosine = torch.nn.functional.cosine_similarity(out, peer_out, dim=1).min().item()
        print(
            f"| {name} | {args.texts / seconds:.1f} | {tokens / seconds:.0f} | {peer_s / seconds:.2f} | {cosine:.6f} |"
        )


if __name__ == "__main__":
    main()

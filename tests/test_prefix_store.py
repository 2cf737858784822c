"""The prompt-prefix store: formats, every refusal with TGIS's message, ids kept inside the
store, the byte-bounded LRU cache."""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from tgis.errors import InputValidationError
from tgis.prefix_store import PrefixStore

HIDDEN = 8


def store(root: Path, **kw: object) -> PrefixStore:
    options: dict[str, object] = {
        "hidden_size": HIDDEN,
        "max_length": 20,
        "dtype": torch.float32,
        "device": torch.device("cpu"),
        **kw,
    }
    return PrefixStore(root, **options)  # type: ignore[arg-type]


def save_decoder(root: Path, prefix_id: str, tensor: object) -> Path:
    directory = root / prefix_id
    directory.mkdir(parents=True, exist_ok=True)
    torch.save(tensor, directory / "decoder.pt")
    return directory


def save_peft(
    root: Path, prefix_id: str, tensor: torch.Tensor, *, binary: bool = False, **config: object
) -> Path:
    directory = root / prefix_id
    directory.mkdir(parents=True)
    settings = {"peft_type": "PROMPT_TUNING", "task_type": "CAUSAL_LM",
                "num_virtual_tokens": tensor.shape[0], **config}  # fmt: skip
    (directory / "adapter_config.json").write_text(json.dumps(settings))
    if binary:
        torch.save({"prompt_embeddings": tensor}, directory / "adapter_model.bin")
    else:
        save_file({"prompt_embeddings": tensor}, directory / "adapter_model.safetensors")
    return directory


def refusal(s: PrefixStore, prefix_id: str) -> str:
    with pytest.raises(InputValidationError) as info:
        s.get(prefix_id)
    message = str(info.value)
    assert message.startswith(f"can't retrieve prompt prefix with id '{prefix_id}': ")
    return message.split(": ", 1)[1]


def test_a_decoder_tensor_is_a_prefix_in_the_serving_dtype(tmp_path: Path) -> None:
    tensor = torch.randn(5, HIDDEN)
    save_decoder(tmp_path, "team/tuned-1", tensor)
    prefix = store(tmp_path, dtype=torch.bfloat16).get("team/tuned-1")
    assert prefix.prefix_id == "team/tuned-1" and prefix.length == 5
    assert prefix.embeddings.dtype == torch.bfloat16
    assert torch.equal(prefix.embeddings, tensor.to(torch.bfloat16))
    other = save_decoder(tmp_path, "other", tensor * 2)
    assert other.is_dir()
    assert store(tmp_path).get("other").key != store(tmp_path).get("team/tuned-1").key


@pytest.mark.parametrize("binary", [False, True], ids=["safetensors", "bin"])
def test_a_peft_prompt_tuning_adapter_is_a_prefix(tmp_path: Path, binary: bool) -> None:
    tensor = torch.randn(7, HIDDEN)
    save_peft(tmp_path, "peft", tensor, binary=binary)
    assert torch.equal(store(tmp_path).get("peft").embeddings, tensor)


def test_peft_adapters_of_other_kinds_or_incomplete_are_refused(tmp_path: Path) -> None:
    save_peft(tmp_path, "lora", torch.randn(3, HIDDEN), peft_type="LORA")
    s = store(tmp_path)
    assert "is 'LORA'; a prefix is a PROMPT_TUNING adapter" in refusal(s, "lora")
    save_peft(tmp_path, "count", torch.randn(3, HIDDEN), num_virtual_tokens=4)
    assert "num_virtual_tokens 4" in refusal(s, "count")
    (tmp_path / "bare").mkdir()
    (tmp_path / "bare" / "adapter_config.json").write_text('{"peft_type": "PROMPT_TUNING"}')
    assert "neither adapter_model.safetensors nor adapter_model.bin" in refusal(s, "bare")
    directory = save_peft(tmp_path, "renamed", torch.randn(3, HIDDEN))
    save_file({"other": torch.randn(3, HIDDEN)}, directory / "adapter_model.safetensors")
    assert "has no 'prompt_embeddings' tensor" in refusal(s, "renamed")


@pytest.mark.parametrize(
    "prefix_id",
    ["../outside", "a/../../outside", "a/..", "/etc", "with space", "semi;colon", "dots..x", ""],
)
def test_ids_outside_the_pattern_or_the_store_are_refused(tmp_path: Path, prefix_id: str) -> None:
    root = tmp_path / "store"
    root.mkdir()
    save_decoder(tmp_path, "outside", torch.randn(2, HIDDEN))  # beside the store
    reason = refusal(store(root), prefix_id)
    assert "letters, digits" in reason or "outside the prefix store" in reason


def test_a_link_out_of_the_store_is_refused(tmp_path: Path) -> None:
    root = tmp_path / "store"
    root.mkdir()
    save_decoder(tmp_path, "secret", torch.randn(2, HIDDEN))
    (root / "escape").symlink_to(tmp_path / "secret")
    assert refusal(store(root), "escape") == "the id resolves outside the prefix store"


@pytest.mark.parametrize(
    ("tensor", "reason"),
    [
        (torch.randn(HIDDEN), "has 1 dimensions; a prefix is [virtual tokens, hidden size]"),
        (torch.randn(2, 3, HIDDEN), "has 3 dimensions"),
        (torch.randn(4, HIDDEN + 1), f"is {HIDDEN + 1} wide; this model's hidden size is {HIDDEN}"),
        (torch.randn(0, HIDDEN), "has 0 virtual tokens; a prefix has 1 to 20"),
        (torch.randn(21, HIDDEN), "has 21 virtual tokens; a prefix has 1 to 20"),
        (torch.full((2, HIDDEN), float("nan")), "values that are not finite numbers"),
        (torch.full((2, HIDDEN), float("inf")), "values that are not finite numbers"),
        (torch.ones(2, HIDDEN, dtype=torch.long), "values that are not finite numbers"),
        ({"embeddings": torch.randn(2, HIDDEN)}, "holds a dict, not a tensor"),
    ],
)
def test_bad_tensors_are_refused(tmp_path: Path, tensor: object, reason: str) -> None:
    save_decoder(tmp_path, "bad", tensor)
    assert reason in refusal(store(tmp_path), "bad")


def test_values_beyond_the_serving_dtype_are_refused(tmp_path: Path) -> None:
    save_decoder(tmp_path, "wide", torch.full((2, HIDDEN), 1e5))  # fp16's largest is 65504
    assert torch.isfinite(store(tmp_path).get("wide").embeddings).all()
    reason = refusal(store(tmp_path, dtype=torch.float16), "wide")
    assert reason == "decoder.pt has values beyond the range of torch.float16"


def test_files_are_read_as_tensors_only(tmp_path: Path) -> None:
    """A pickle that would run code on load is refused, and nothing runs."""
    directory = tmp_path / "evil"
    directory.mkdir()
    marker = tmp_path / "ran"

    class Payload:
        def __reduce__(self) -> tuple[object, tuple[str]]:
            return (marker.touch, ())  # type: ignore[return-value]

    (directory / "decoder.pt").write_bytes(pickle.dumps(Payload()))
    assert "cannot read decoder.pt as tensors only" in refusal(store(tmp_path), "evil")
    assert not marker.exists()


def test_missing_directories_and_files_are_named(tmp_path: Path) -> None:
    s = store(tmp_path)
    assert refusal(s, "absent") == "no directory 'absent' in the prefix store"
    (tmp_path / "empty").mkdir()
    assert "neither decoder.pt nor a PEFT prompt-tuning adapter" in refusal(s, "empty")


def test_the_cache_keeps_the_most_recent_prefixes_within_its_bytes(tmp_path: Path) -> None:
    for name in ("a", "b", "c"):
        save_decoder(tmp_path, name, torch.randn(4, HIDDEN))  # 128 bytes each in float32
    s = store(tmp_path, capacity_bytes=300)
    first = s.get("a")
    assert s.get("a") is first  # cached
    s.get("b")
    s.get("a")  # a is now the most recent
    s.get("c")  # evicts b
    assert s.cached_bytes == 256
    assert s.get("a") is first
    (tmp_path / "b" / "decoder.pt").unlink()
    assert "neither decoder.pt" in refusal(s, "b")  # b was evicted: read again


def test_encoder_decoder_prefixes_hold_encoder_and_or_decoder_rows(tmp_path: Path) -> None:
    s = store(tmp_path, encoder_decoder=True)
    both = save_decoder(tmp_path, "both", torch.randn(2, HIDDEN))
    torch.save(torch.randn(3, HIDDEN), both / "encoder.pt")
    prefix = s.get("both")
    assert prefix.length == 2 and prefix.encoder is not None and prefix.encoder.shape[0] == 3
    assert prefix.tokens == 5
    only = tmp_path / "encoder-only"
    only.mkdir()
    torch.save(torch.randn(4, HIDDEN), only / "encoder.pt")
    prefix = s.get("encoder-only")
    assert prefix.length == 0 and prefix.tokens == 4
    save_peft(tmp_path, "peft", torch.randn(3, HIDDEN))
    assert "neither encoder.pt nor decoder.pt" in refusal(s, "peft")
    big = tmp_path / "big"
    big.mkdir()
    torch.save(torch.randn(12, HIDDEN), big / "encoder.pt")
    torch.save(torch.randn(12, HIDDEN), big / "decoder.pt")
    assert "more than 20 virtual tokens" in refusal(s, "big")
    wide = tmp_path / "wide"
    wide.mkdir()
    torch.save(torch.randn(2, HIDDEN + 2), wide / "encoder.pt")
    assert f"encoder.pt is {HIDDEN + 2} wide" in refusal(s, "wide")

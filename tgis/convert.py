"""Convert PyTorch `.bin` checkpoints to safetensors: verified, atomic, aliases written once.

Input: `pytorch_model.bin`, or shards listed by `pytorch_model.bin.index.json`. Output, in the
same directory: `model.safetensors`, or `model-0000i-of-0000n.safetensors` (one per .bin shard,
same tensor -> file structure) plus `model.safetensors.index.json`.

Tensors that share storage (tied embeddings: `lm_head.weight` is `model.embed_tokens.weight`)
are written once; safetensors forbids shared storage. The dropped name is recorded as an alias,
`{"lm_head.weight": "model.embed_tokens.weight"}`, under the `tgis_aliases` key of the
safetensors metadata (a JSON string) and of the index's `metadata`. The stored name is the one
transformers loads (it re-ties the output head on load), so `from_pretrained` still works.

Every file is written to a hidden temp file in the same directory, reloaded and compared tensor
by tensor with the `.bin` (bit-exact), and only then moved into place with `os.replace` (index
last). A failure at any point leaves the directory as it was.
"""

from __future__ import annotations

import json
import os
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tgis.errors import ConversionError

if TYPE_CHECKING:
    import torch

SINGLE_BIN = "pytorch_model.bin"
BIN_INDEX = "pytorch_model.bin.index.json"
SINGLE_SAFETENSORS = "model.safetensors"
SAFETENSORS_INDEX = "model.safetensors.index.json"
ALIASES_KEY = "tgis_aliases"
# Names of output projections tied to the input embeddings across common architectures
# (llama/mistral/gpt2: lm_head, gpt-neox: embed_out, some ports: output). When a tied pair is
# found, these are the names dropped, because transformers re-ties them from the embeddings.
_OUTPUT_HEADS = ("lm_head.weight", "embed_out.weight", "output.weight")


@dataclass(frozen=True)
class ConversionReport:
    """What `convert_to_safetensors` did. File names are relative to `model_dir`."""

    model_dir: Path
    source_files: tuple[str, ...]
    written_files: tuple[str, ...]  # shards first, the index (if any) last
    tensors: int  # tensors stored, aliases excluded
    aliases: tuple[tuple[str, str], ...]  # (dropped name, stored name), sorted
    bytes_written: int
    index_file: str | None

    @property
    def sharded(self) -> bool:
        """Whether the output is sharded (an index file was written)."""
        return self.index_file is not None


def conversion_targets(model_dir: Path) -> tuple[Path, ...]:
    """The files `convert_to_safetensors(model_dir)` would write (ConversionError if no .bin)."""
    jobs, index = _plan(Path(model_dir))
    names = [target for _, target in jobs] + ([SAFETENSORS_INDEX] if index is not None else [])
    return tuple(Path(model_dir) / name for name in names)


def convert_to_safetensors(model_dir: Path, force: bool = False) -> ConversionReport:
    """Convert the `.bin` weights in `model_dir` to verified `.safetensors` next to them.

    Raises ConversionError when there is nothing to convert, when an output exists and `force`
    is false, when a `.bin` cannot be loaded safely (`weights_only=True`), or when the written
    file does not reload to exactly the original tensors.
    """
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise ConversionError(
            f"{model_dir} is not a directory", hint="give a model directory holding .bin weights"
        )
    jobs, bin_index = _plan(model_dir)
    targets = [target for _, target in jobs] + ([SAFETENSORS_INDEX] if bin_index else [])
    if not force:
        for name in targets:
            if (model_dir / name).exists():
                raise ConversionError(
                    f"{model_dir / name} already exists", hint="pass --force to overwrite it"
                )
    config = _read_config(model_dir)
    # A checkpoint whose config unties the embeddings must keep both names, or transformers
    # would leave the missing head randomly initialised instead of re-tying it.
    collapse = config.get("tie_word_embeddings", True) is not False
    droppable = _droppable_names(config) if collapse else None
    temps: dict[str, Path] = {}
    weight_map: dict[str, str] = {}
    aliases: dict[str, str] = {}
    total_size = 0
    try:
        for source, target in jobs:
            state = _load_bin(model_dir / source)
            stored, shard_aliases = dedupe_shared(state, droppable)
            temps[target] = _temp_path(model_dir, target)
            metadata = {"format": "pt"}
            if shard_aliases:
                metadata[ALIASES_KEY] = json.dumps(shard_aliases, sort_keys=True)
            _save_file(stored, temps[target], metadata)
            verify_safetensors(state, shard_aliases, temps[target], label=f"{source} -> {target}")
            weight_map.update(dict.fromkeys(stored, target))
            aliases.update(shard_aliases)
            total_size += sum(t.numel() * t.element_size() for t in stored.values())
        if bin_index is not None:
            index = {
                "metadata": {"total_size": total_size, ALIASES_KEY: dict(sorted(aliases.items()))},
                "weight_map": dict(sorted(weight_map.items())),
            }
            temps[SAFETENSORS_INDEX] = _temp_path(model_dir, SAFETENSORS_INDEX)
            temps[SAFETENSORS_INDEX].write_text(json.dumps(index, indent=2) + "\n")
        # Everything verified: move into place, shards before the index, so that no reader
        # ever sees an index naming a shard that is not there yet.
        for name in targets:
            os.replace(temps.pop(name), model_dir / name)
        if force:
            _remove_stale_outputs(model_dir, set(targets))
    except OSError as exc:
        raise ConversionError(
            f"could not write safetensors files in {model_dir}: {exc}",
            hint="check free disk space and write permission; nothing was left half-written",
        ) from exc
    finally:
        for leftover in temps.values():
            leftover.unlink(missing_ok=True)
    return ConversionReport(
        model_dir=model_dir,
        source_files=tuple(source for source, _ in jobs),
        written_files=tuple(targets),
        tensors=len(weight_map),
        aliases=tuple(sorted(aliases.items())),
        bytes_written=sum((model_dir / name).stat().st_size for name in targets),
        index_file=SAFETENSORS_INDEX if bin_index is not None else None,
    )


def dedupe_shared(
    state: Mapping[str, torch.Tensor], droppable: Callable[[str], bool] | None
) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Make `state` storable by safetensors: one name per identical view, no shared storage.

    Names that are the same view of the same storage (tied weights) collapse to one stored name;
    the others become aliases (returned as {alias: stored}). The stored name is the first one
    `droppable` rejects, else the first in order. With `droppable=None` nothing is collapsed
    (every name is stored, as a copy). Tensors that overlap other tensors in a different way, or
    are non-contiguous views, are copied into standalone contiguous tensors.
    """
    views: dict[tuple[Any, ...], list[str]] = {}
    for name, tensor in state.items():
        views.setdefault(_view_key(name, tensor, collapse=droppable is not None), []).append(name)
    per_storage = Counter(key[0] for key in views)
    stored: dict[str, torch.Tensor] = {}
    aliases: dict[str, str] = {}
    for key, names in views.items():
        candidates = [n for n in names if droppable is None or not droppable(n)] or names
        kept = candidates[0]
        aliases.update({n: kept for n in names if n != kept})
        stored[kept] = _standalone(state[kept], shared=per_storage[key[0]] > 1)
    order = {name: i for i, name in enumerate(state)}
    return dict(sorted(stored.items(), key=lambda item: order[item[0]])), aliases


def verify_safetensors(
    original: Mapping[str, torch.Tensor], aliases: Mapping[str, str], path: Path, label: str
) -> None:
    """Check that `path` holds exactly `original` (bit for bit), aliases resolved; else raise."""
    from safetensors import safe_open

    with safe_open(str(path), framework="pt", device="cpu") as handle:
        written = set(handle.keys())
        expected = set(original) - set(aliases)
        missing, unexpected = sorted(expected - written), sorted(written - expected)
        if missing or unexpected:
            what = f"{missing[0]!r} is missing" if missing else f"unexpected {unexpected[0]!r}"
            raise ConversionError(
                f"verification failed ({label}): {what}",
                hint="the file was not kept; rerun with TGIS_DEBUG=1 and report it",
            )
        for name, tensor in original.items():
            stored_as = aliases.get(name, name)
            if stored_as not in written:
                raise ConversionError(
                    f"verification failed ({label}): alias {name!r} points at missing {stored_as!r}"
                )
            if not same_tensor(tensor, handle.get_tensor(stored_as)):
                raise ConversionError(
                    f"verification failed ({label}): tensor {name!r} differs after conversion",
                    hint="the file was not kept; check the disk and the source weights",
                )


def same_tensor(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-exact equality of dtype, shape and bytes (NaN == NaN, unlike torch.equal)."""
    import torch

    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    # reshape(-1): a 0-dim tensor cannot be viewed as bytes.
    return torch.equal(
        a.reshape(-1).contiguous().view(torch.uint8), b.reshape(-1).contiguous().view(torch.uint8)
    )


def _plan(model_dir: Path) -> tuple[list[tuple[str, str]], dict[str, Any] | None]:
    """(.bin file, .safetensors file) pairs to convert, and the .bin index if sharded."""
    index_path = model_dir / BIN_INDEX
    if index_path.is_file():
        index = _read_json(index_path)
        weight_map = index.get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ConversionError(f"{index_path} has no weight_map", hint="the index is corrupt")
        shards = sorted(set(weight_map.values()))
        for shard in shards:
            if not (model_dir / shard).is_file():
                raise ConversionError(
                    f"{model_dir / shard} is listed in {BIN_INDEX} but missing",
                    hint="download the weights again: tgis download-weights MODEL --extension .bin",
                )
        n = len(shards)
        jobs = [(s, f"model-{i:05d}-of-{n:05d}.safetensors") for i, s in enumerate(shards, 1)]
        return jobs, index
    if (model_dir / SINGLE_BIN).is_file():
        return [(SINGLE_BIN, SINGLE_SAFETENSORS)], None
    raise ConversionError(
        f"no PyTorch weights to convert in {model_dir}: neither {SINGLE_BIN} nor {BIN_INDEX}",
        hint="download them with `tgis download-weights MODEL --extension .bin`",
    )


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ConversionError(f"cannot read {path}: {exc}", hint="the file is corrupt") from exc
    if not isinstance(data, dict):
        raise ConversionError(f"{path} is not a JSON object", hint="the file is corrupt")
    return data


def _read_config(model_dir: Path) -> dict[str, Any]:
    path = model_dir / "config.json"
    return _read_json(path) if path.is_file() else {}


def _droppable_names(config: Mapping[str, Any]) -> Callable[[str], bool]:
    """Which name of a tied pair to drop: the output head transformers re-ties on load."""
    tied = set(_OUTPUT_HEADS)
    for arch in config.get("architectures") or []:
        try:  # the model class knows its tied keys; an unknown or broken class is no error here
            import transformers

            keys = getattr(getattr(transformers, arch), "_tied_weights_keys", None) or []
            tied.update(keys.keys() if isinstance(keys, dict) else keys)
        except Exception:
            continue
    suffixes = tuple(f".{head}" for head in _OUTPUT_HEADS)
    return lambda name: name in tied or name.endswith(suffixes)


def _load_bin(path: Path) -> dict[str, torch.Tensor]:
    """Load a .bin state dict without running pickled code (weights_only=True)."""
    import torch

    try:
        state = torch.load(path, weights_only=True, map_location="cpu")
    except Exception as exc:  # pickle, zip and EOF errors all mean the same to the user
        raise ConversionError(
            f"cannot load {path} safely (torch.load weights_only=True): {exc}".splitlines()[0],
            hint="the file is corrupt or holds objects other than tensors",
        ) from exc
    if not isinstance(state, dict):
        raise ConversionError(f"{path} holds a {type(state).__name__}, not a state dict")
    for name, value in state.items():
        if not isinstance(value, torch.Tensor):
            raise ConversionError(
                f"{path} entry {name!r} is a {type(value).__name__}, not a tensor",
                hint="only plain state dicts (name -> tensor) can be converted",
            )
    return state


def _view_key(name: str, tensor: torch.Tensor, collapse: bool) -> tuple[Any, ...]:
    """Identical views of one storage share a key; empty tensors never share."""
    if tensor.numel() == 0 or not collapse:
        ptr = tensor.untyped_storage().data_ptr() if tensor.numel() else None
        return (ptr, name)
    return (
        tensor.untyped_storage().data_ptr(),
        tensor.storage_offset(),
        tuple(tensor.shape),
        tuple(tensor.stride()),
        tensor.dtype,
    )


def _standalone(tensor: torch.Tensor, shared: bool) -> torch.Tensor:
    """A tensor safetensors can store: contiguous, owning exactly its bytes, sharing nothing."""
    import torch

    owns_storage = tensor.untyped_storage().nbytes() == tensor.numel() * tensor.element_size()
    if shared or not tensor.is_contiguous() or not owns_storage or tensor.storage_offset():
        return tensor.clone(memory_format=torch.contiguous_format)
    return tensor


def _remove_stale_outputs(model_dir: Path, keep: set[str]) -> None:
    """Drop safetensors of an earlier conversion with another shard layout: a leftover
    model.safetensors would be loaded instead of the new sharded index."""
    for path in model_dir.glob("model*.safetensors*"):
        if path.name not in keep and (
            path.suffix == ".safetensors" or path.name == SAFETENSORS_INDEX
        ):
            path.unlink()


def _temp_path(model_dir: Path, name: str) -> Path:
    # Same directory as the target, so os.replace is an atomic rename on one filesystem.
    return model_dir / f".{name}.{os.getpid()}.tmp"


def _save_file(tensors: dict[str, torch.Tensor], path: Path, metadata: dict[str, str]) -> None:
    """Write one safetensors file (a seam: tests replace it to simulate crashes/corruption)."""
    from safetensors.torch import save_file

    save_file(tensors, str(path), metadata=metadata)

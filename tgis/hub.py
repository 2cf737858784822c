"""Locate and download model weights in the standard Hugging Face cache.

A model is a local directory or a Hub id. `resolve_model_dir` maps a Hub id to its snapshot in
the HF cache (HF_HUB_CACHE, else HF_HOME/hub) without the network. `tgis download-weights`
fills the cache with TGIS semantics: root-level safetensors first; if the repo has none, its
`.bin` weights, converted to safetensors inside the snapshot; always the small config and
tokenizer files a server needs. `tgis serve` and `tgis warmup` fetch a model missing from the
cache the same way (`serving_model_dir`) unless HF_HUB_OFFLINE=1 or --no-download.

Cache layout (huggingface_hub's): `models--ORG--NAME/{blobs,refs/REVISION,snapshots/COMMIT}`;
snapshot files are symlinks into `blobs/`, and converted safetensors are plain files next to them.
"""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tgis.config.checkpoint_quant import AUTOGPTQ_CONFIG, declared_quantization
from tgis.errors import HubError, ModelNotCachedError, ModelNotFoundError, TgisError

if TYPE_CHECKING:
    from rich.console import Console
    from rich.progress import Progress, TaskID

    from tgis.config import ModelFacts

# The small files a server needs besides the weights (config, generation defaults, tokenizer).
SERVING_FILES = frozenset(
    {
        "config.json",
        "generation_config.json",
        "neuron_config.json",
        "special_tokens_map.json",
        "added_tokens.json",
        "tokenizer.model",
        "spiece.model",
        "sentencepiece.bpe.model",
        "vocab.json",
        "vocab.txt",
        "merges.txt",
        "chat_template.jinja",
        "chat_template.json",
        AUTOGPTQ_CONFIG,
    }
)
# Root-level files with a weight extension that are not model weights (TGI skips these too).
_NOT_WEIGHTS = ("training_args", "optimizer", "scheduler", "rng_state", "arguments", "args")
# A dropped connection is retried this many times, each attempt resuming the partial file.
RESUME_ATTEMPTS = 3


@dataclass(frozen=True)
class DownloadPlan:
    """Which root-level files to fetch from a repo, and whether to convert .bin afterwards."""

    files: tuple[str, ...]
    convert: bool


@dataclass(frozen=True)
class DownloadReport:
    """What `fetch_weights` did; file names are relative to `snapshot_dir`."""

    model_id: str
    commit: str
    snapshot_dir: Path
    downloaded: tuple[str, ...]
    skipped: tuple[str, ...]  # already in the cache
    converted: tuple[str, ...]  # safetensors files written by the .bin conversion
    bytes_downloaded: int


def resolve_model_dir(model_id: str, revision: str | None = None) -> Path:
    """The directory holding `model_id`: itself if a local directory, else its cached snapshot.

    Never uses the network. Raises ModelNotFoundError when the model is neither a directory nor
    in the HF cache (its hint says to run `tgis download-weights` first).
    """
    local = Path(model_id).expanduser()
    if local.is_dir():
        return local.resolve()
    if model_id.startswith((".", "/", "~")) or model_id.count("/") > 1:
        raise ModelNotFoundError(
            f"model directory {model_id} does not exist",
            hint="give an existing directory or a Hub model id such as org/name",
        )
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError

    try:
        folder = snapshot_download(model_id, revision=revision, local_files_only=True)
    except HFValidationError as exc:
        raise ModelNotFoundError(
            f"{model_id!r} is neither a local directory nor a valid Hub model id",
            hint="use an existing directory or a Hub id such as org/name",
        ) from exc
    except LocalEntryNotFoundError as exc:
        at = f" at revision {revision}" if revision else ""
        flag = f" --revision {revision}" if revision else ""
        raise ModelNotCachedError(
            f"model {model_id}{at} is not in the Hugging Face cache ({constants.HF_HUB_CACHE})",
            hint=f"run `tgis download-weights {model_id}{flag}` first, with the same HF_HUB_CACHE",
        ) from exc
    return Path(folder)


def serving_model_dir(
    model_id: str,
    revision: str | None = None,
    download: bool = True,
    console: Console | None = None,
) -> Path:
    """`resolve_model_dir`, but a Hub model missing from the cache is fetched into it as
    `tgis download-weights` does (safetensors first, a progress bar), unless `download` is
    False (--no-download) or huggingface_hub is offline (HF_HUB_OFFLINE=1): then the
    ModelNotCachedError says which of the two kept it from downloading."""
    try:
        return resolve_model_dir(model_id, revision)
    except ModelNotCachedError as missing:
        from huggingface_hub import constants

        flag = f" --revision {revision}" if revision else ""
        fetch = f"run `tgis download-weights {model_id}{flag}` where the Hub is reachable"
        if not download:
            raise ModelNotCachedError(
                f"{missing.message}, and --no-download keeps the server from fetching it",
                hint=f"{fetch}, with the same HF_HUB_CACHE, or drop --no-download",
            ) from missing
        if constants.HF_HUB_OFFLINE:
            raise ModelNotCachedError(
                f"{missing.message}, and HF_HUB_OFFLINE=1 keeps the server from fetching it",
                hint=f"{fetch}, with the same HF_HUB_CACHE, or unset HF_HUB_OFFLINE",
            ) from missing
    from rich.console import Console

    console = console or Console(stderr=True, highlight=False)
    console.print(f"{model_id} is not in the Hugging Face cache: downloading it")
    return fetch_weights(model_id, revision, console=console).snapshot_dir


def read_model_config(model_dir: Path) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """`config.json` of `model_dir`, and optimum-neuron's `neuron_config.json` if present."""
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise ModelNotFoundError(
            f"{model_dir} has no config.json, so it is not a transformers model directory",
            hint="point at the directory holding config.json, or download it again",
        )
    config = _read_json_object(path)
    quantization = declared_quantization(Path(model_dir), config)
    if quantization is not None:
        config["quantization_config"] = quantization
    neuron_path = Path(model_dir) / "neuron_config.json"
    return config, _read_json_object(neuron_path) if neuron_path.is_file() else None


def read_model_facts(model_dir: Path) -> ModelFacts:
    """What the validation core and the backend chooser read of the model in `model_dir`."""
    from dataclasses import replace

    from tgis.config import ModelFacts
    from tgis.pooling.spec import read_pooling_spec

    config, neuron = read_model_config(model_dir)
    facts = ModelFacts.from_config(config, neuron)
    return replace(facts, pooling=read_pooling_spec(Path(model_dir), config) is not None)


def download_weights(
    model_id: str,
    revision: str | None = None,
    extensions: Sequence[str] | None = None,
    auto_convert: bool = True,
    console: Console | None = None,
) -> Path:
    """Download `model_id` into the HF cache (see `fetch_weights`); return the snapshot dir."""
    return fetch_weights(model_id, revision, extensions, auto_convert, console).snapshot_dir


def fetch_weights(
    model_id: str,
    revision: str | None = None,
    extensions: Sequence[str] | None = None,
    auto_convert: bool = True,
    console: Console | None = None,
) -> DownloadReport:
    """Download the weights and serving files of `model_id` at `revision` into the HF cache.

    Default selection: root-level `*.safetensors`; if there are none, root-level `*.bin`,
    converted to safetensors in the snapshot when `auto_convert`. `extensions` (".json", ...)
    selects root-level files by extension instead; a single extension also brings the serving
    files (TGIS semantics). Files already cached are skipped. Hub failures raise HubError or
    ModelNotFoundError with one clear line.
    """
    from rich.console import Console

    if Path(model_id).expanduser().is_dir():
        raise HubError(
            f"{model_id} is a local directory: there is nothing to download",
            hint="serve it directly, or run `tgis convert-to-safetensors DIR` for .bin weights",
        )
    console = console or Console(stderr=True, highlight=False)
    from huggingface_hub import HfApi, constants
    from huggingface_hub.file_download import repo_folder_name

    with _hub_errors(model_id, revision):
        api = HfApi()
        info = api.model_info(model_id, revision=revision, files_metadata=True)
        entries = _root_entries(api, model_id, info)
        plan = plan_downloads(list(entries), extensions, auto_convert, model_id)
        storage = Path(constants.HF_HUB_CACHE) / repo_folder_name(
            repo_id=model_id, repo_type="model"
        )
        commit = str(info.sha)
        downloaded, skipped, nbytes = _fetch_files(
            model_id, commit, plan.files, entries, storage, console
        )
        # Only now: a branch name must not resolve offline to a half-downloaded snapshot.
        _write_ref(storage, revision or constants.DEFAULT_REVISION, commit)
    snapshot = storage / "snapshots" / commit
    converted = _convert_snapshot(snapshot, console) if plan.convert else ()
    return DownloadReport(model_id, commit, snapshot, downloaded, skipped, converted, nbytes)


def plan_downloads(
    repo_files: Sequence[str],
    extensions: Sequence[str] | None,
    auto_convert: bool,
    model_id: str = "the repository",
) -> DownloadPlan:
    """Choose the files to fetch from a repo's file list (only root-level files count)."""
    root = sorted(f for f in repo_files if "/" not in f)
    serving = [f for f in root if _is_serving_file(f)]
    wanted = [e if e.startswith(".") else f".{e}" for e in (extensions or []) if e]
    if wanted and wanted != [".safetensors"]:
        files = [f for f in root if f.endswith(tuple(wanted))]
        if not files:
            raise HubError(
                f"{model_id} has no root-level files with extension {', '.join(wanted)}",
                hint="pick other extensions with --extension, e.g. .safetensors or .bin",
            )
        files += serving if len(wanted) == 1 else []
        return DownloadPlan(tuple(sorted(set(files))), convert=False)
    safetensors, bins = _weights(root, ".safetensors"), _weights(root, ".bin")
    if safetensors:
        return DownloadPlan(tuple(sorted(set(safetensors + serving))), convert=False)
    if bins:
        return DownloadPlan(tuple(sorted(set(bins + serving))), convert=auto_convert)
    raise HubError(
        f"{model_id} has no model weights at its root (no .safetensors or .bin files)",
        hint="check the model id and --revision, or pick files with --extension",
    )


def _weights(root: Sequence[str], extension: str) -> list[str]:
    names = [f for f in root if f.endswith(extension) and not f.startswith(_NOT_WEIGHTS)]
    # Mistral-style repos ship consolidated.safetensors beside model*.safetensors: the same
    # weights twice, in another naming scheme that transformers does not read.
    preferred = [f for f in names if not f.startswith("consolidated")]
    return preferred or names


def _is_serving_file(name: str) -> bool:
    return (
        name in SERVING_FILES
        or name.endswith(".index.json")
        or (name.startswith("tokenizer") and name.endswith(".json"))
    )


def _root_entries(api: Any, model_id: str, info: Any) -> dict[str, tuple[int | None, str | None]]:
    """Root-level file -> (size, blob ETag); from model_info, else from the repo tree."""
    entries: dict[str, tuple[int | None, str | None]] = {}
    for sibling in info.siblings or []:
        if "/" not in sibling.rfilename:
            etag = sibling.lfs.sha256 if sibling.lfs else sibling.blob_id
            entries[sibling.rfilename] = (sibling.size, etag)
    if not info.siblings:  # very large repos come without siblings: list the root instead
        from huggingface_hub.hf_api import RepoFile

        for item in api.list_repo_tree(model_id, revision=info.sha):
            if isinstance(item, RepoFile):
                entries[item.path] = (item.size, item.lfs.sha256 if item.lfs else item.blob_id)
    return entries


def _write_ref(storage: Path, revision: str, commit: str) -> None:
    """Record revision -> commit as huggingface_hub does, so offline lookups by branch work."""
    if revision == commit:
        return
    ref = storage / "refs" / revision
    ref.parent.mkdir(parents=True, exist_ok=True)
    ref.write_text(commit)


def _fetch_files(
    model_id: str,
    commit: str,
    files: Sequence[str],
    entries: dict[str, tuple[int | None, str | None]],
    storage: Path,
    console: Console,
) -> tuple[tuple[str, ...], tuple[str, ...], int]:
    """Download `files` one by one with rich progress; skip cached ones. -> (done, skipped, bytes)"""
    from huggingface_hub import try_to_load_from_cache
    from huggingface_hub.utils import (
        are_progress_bars_disabled,
        disable_progress_bars,
        enable_progress_bars,
    )
    from rich.progress import (
        BarColumn,
        DownloadColumn,
        Progress,
        TextColumn,
        TimeRemainingColumn,
        TransferSpeedColumn,
    )

    skipped = [
        f for f in files if isinstance(try_to_load_from_cache(model_id, f, revision=commit), str)
    ]
    todo = [f for f in files if f not in skipped]
    for name in skipped:
        console.print(f"  cached      {name}", markup=False, highlight=False)
    total = sum(entries.get(f, (0, None))[0] or 0 for f in todo)
    columns = (TextColumn("{task.description}"), BarColumn(), DownloadColumn())
    columns += (TransferSpeedColumn(), TimeRemainingColumn())
    hf_bars_were_off = are_progress_bars_disabled()
    disable_progress_bars()  # ours replace huggingface_hub's tqdm bars
    try:
        with Progress(*columns, console=console, transient=True, disable=not todo) as progress:
            overall = progress.add_task(f"{model_id} ({len(todo)} files)", total=total)
            done = 0
            for name in todo:
                size, etag = entries.get(name, (None, None))
                _fetch_one(model_id, commit, name, size, storage, etag, progress, overall, done)
                done += size or 0
                line = f"  downloaded  {name} ({_human(size or 0)})"
                progress.console.print(line, markup=False, highlight=False)
    finally:
        if not hf_bars_were_off:
            enable_progress_bars()
    return tuple(todo), tuple(skipped), total


def _fetch_one(
    model_id: str,
    commit: str,
    name: str,
    size: int | None,
    storage: Path,
    etag: str | None,
    progress: Progress,
    overall: TaskID,
    done_before: int,
) -> None:
    """hf_hub_download one file; a poller turns the growing `.incomplete` blob into progress."""
    import requests
    from huggingface_hub import constants, hf_hub_download

    task = progress.add_task(f"  {name}", total=size)
    partial = storage / "blobs" / f"{etag}.incomplete" if etag else None
    stop = threading.Event()

    def poll() -> None:
        while not stop.wait(0.1):
            current = partial.stat().st_size if partial is not None and partial.exists() else 0
            progress.update(task, completed=current)
            progress.update(overall, completed=done_before + current)

    poller = threading.Thread(target=poll, daemon=True)
    poller.start()
    try:
        for attempt in range(1, RESUME_ATTEMPTS + 2):
            try:
                hf_hub_download(model_id, name, revision=commit)
                break
            except (requests.exceptions.ChunkedEncodingError, requests.ConnectionError) as exc:
                if attempt > RESUME_ATTEMPTS:
                    raise HubError(
                        f"downloading {name} from {constants.ENDPOINT} failed {attempt} times: "
                        f"{_reason(exc)}",
                        hint="check the network and run the command again: it resumes",
                    ) from exc
                line = f"  connection dropped during {name}; resuming"
                progress.console.print(line, markup=False, highlight=False)
    finally:
        stop.set()
        poller.join()
        progress.remove_task(task)
    progress.update(overall, completed=done_before + (size or 0))


def _convert_snapshot(snapshot: Path, console: Console) -> tuple[str, ...]:
    """Convert the snapshot's .bin weights in place, unless an earlier run already did."""
    from tgis.convert import conversion_targets, convert_to_safetensors

    targets = conversion_targets(snapshot)
    if all(t.exists() for t in targets):
        console.print("  converted   earlier: safetensors already next to the .bin weights")
        return ()
    console.print("  converting  .bin weights to safetensors")
    report = convert_to_safetensors(snapshot, force=True)
    for name in report.written_files:
        console.print(f"  converted   {name}", markup=False, highlight=False)
    return report.written_files


@contextmanager
def _hub_errors(model_id: str, revision: str | None) -> Iterator[None]:
    """Turn huggingface_hub / requests failures into one-line TgisErrors."""
    import requests
    from huggingface_hub import constants
    from huggingface_hub import errors as hf

    endpoint = constants.ENDPOINT
    token_hint = "set HF_TOKEN to a token with access to it"
    try:
        yield
    except TgisError:
        raise
    except hf.GatedRepoError as exc:
        raise HubError(
            f"{model_id} is a gated or private repository and {endpoint} refused access "
            f"({_status(exc)})",
            hint=f"accept its terms on the Hub, then {token_hint}",
        ) from exc
    except hf.RevisionNotFoundError as exc:
        raise HubError(
            f"revision {revision or 'main'!r} not found in {model_id}",
            hint="check --revision: a branch, tag or commit of the repository",
        ) from exc
    except hf.RepositoryNotFoundError as exc:
        private = " (or it is private)" if _status(exc) == "HTTP 401" else ""
        raise ModelNotFoundError(
            f"model repository {model_id} not found on {endpoint}{private}",
            hint=f"check the model id and --revision; for a private repo {token_hint}",
        ) from exc
    except hf.OfflineModeIsEnabled as exc:
        raise HubError(
            f"cannot download {model_id}: offline mode is on (HF_HUB_OFFLINE=1)",
            hint="unset HF_HUB_OFFLINE (and TRANSFORMERS_OFFLINE) to download",
        ) from exc
    # LocalEntryNotFoundError: a HEAD failed and the file is not cached (network down).
    except (hf.LocalEntryNotFoundError, requests.ConnectionError, requests.Timeout) as exc:
        raise HubError(
            f"cannot reach the Hub at {endpoint} (HF_ENDPOINT): {_reason(exc)}",
            hint="check the network or proxy, or point HF_ENDPOINT at a reachable mirror",
        ) from exc
    except hf.EntryNotFoundError as exc:
        raise HubError(
            f"a file listed by {model_id} is missing on {endpoint}: {_reason(exc)}",
            hint="the repository changed during the download; run the command again",
        ) from exc
    except hf.HFValidationError as exc:
        raise ModelNotFoundError(
            f"{model_id!r} is not a valid Hub model id", hint="use the form org/name"
        ) from exc
    except hf.HfHubHTTPError as exc:
        raise HubError(
            f"the Hub at {endpoint} failed for {model_id} ({_status(exc)}): {_reason(exc)}",
            hint="try again later; for a private repo " + token_hint,
        ) from exc


def _status(exc: Any) -> str:
    response = getattr(exc, "response", None)
    return f"HTTP {response.status_code}" if response is not None else "no response"


def _reason(exc: BaseException) -> str:
    """A one-line cause: a socket error's errno text, else the first line of the root cause."""
    chain: list[BaseException] = [exc]
    while len(chain) < 6 and (chain[-1].__cause__ or chain[-1].__context__) is not None:
        chain.append(chain[-1].__cause__ or chain[-1].__context__)  # type: ignore[arg-type]
    for error in chain:
        match = re.search(r"\[Errno -?\d+\] [^'\")]+", str(error))
        if match:
            return match.group(0).strip()
    for error in (exc, *reversed(chain)):
        lines = [line.strip() for line in str(error).splitlines() if line.strip()]
        if lines:
            return lines[0]
    return type(exc).__name__


def _read_json_object(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise TgisError(
            f"{path} is not valid JSON: {exc}", hint="download the model again"
        ) from exc
    if not isinstance(data, dict):
        raise TgisError(f"{path} is not a JSON object", hint="download the model again")
    return data


def _human(nbytes: int) -> str:
    size = float(nbytes)
    for unit in ("B", "kB", "MB", "GB"):
        if size < 1000 or unit == "GB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1000
    return f"{size:.1f} TB"

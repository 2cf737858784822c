"""`tgis benchmark` end to end: every kind through both APIs against a live FakeEngine server,
results files that validate, PNG plots, --compare, and the one-line errors."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from tests.benchmark.conftest import engine_results
from tests.benchmark.test_results import results
from tests.conftest import run_tgis
from tests.server.conftest import live_server, make_config
from tests.server.fakes import FakeEngine
from tgis.benchmark.images import ImageSpec
from tgis.benchmark.profiles import Profile
from tgis.benchmark.results import validate_results, write_results
from tgis.cli import app
from tgis.errors import ConfigError, TgisError
from tgis.server import ModelInfo, create_app

PNG = b"\x89PNG\r\n\x1a\n"
# Steps end on a request count (the 60 s only bound them): a busy machine measures the same
# requests, later. Two warmup requests go first.
SHORT = ["--duration", "60", "--warmup", "0", "--max-requests", "6", "--warmup-requests", "2",
         "--requests", "4", "--seed", "1"]  # fmt: skip
SMALL = ["--profile", "fixed-length", "--prompt-tokens", "10", "--decode-tokens", "4"]
runner = CliRunner()


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory, tokenizer: Any) -> Path:
    path = tmp_path_factory.mktemp("tokenizer")
    tokenizer.save_pretrained(path)
    return path


def serve(tokenizer: Any, model_id: str, eos_after: int | None = None) -> Any:
    config = make_config(model_id=model_id)
    app_ = create_app(
        engine=FakeEngine(tokenizer, delay=0.002, eos_after=eos_after),
        tokenizer=tokenizer,
        config=config,
        model_info=ModelInfo.from_config(config),
    )
    return live_server(app_, shutdown_grace_s=1.0)


@pytest.fixture
def local_url(tokenizer: Any, tokenizer_dir: Path) -> Iterator[str]:
    """A server whose model_id is the tokenizer's directory (the default --tokenizer works)."""
    with serve(tokenizer, str(tokenizer_dir)) as (url, _):
        yield url


def bench(*args: str) -> Any:
    result = runner.invoke(app, ["benchmark", *args], env={"COLUMNS": "200"})
    assert result.exit_code == 0, (result.output, result.exception)
    return result


@pytest.mark.parametrize(
    ("kind", "api", "extra"),
    [
        ("throughput", None, ["--max-vus", "3"]),
        ("rate", "openai-chat", ["--rates", "20,40"]),
        ("sweep", "tgi", ["--max-vus", "2", "--num-rates", "1", "--slo", "ttft=500ms,itl=50ms"]),
        ("throughput", "openai-completions", ["--max-vus", "2"]),
    ],
)
def test_each_kind_writes_valid_results_and_a_png(
    kind: str, api: str | None, extra: list[str], local_url: str, tmp_path: Path
) -> None:
    out, png = tmp_path / "r.json", tmp_path / "r.png"
    api_args = ["--api", api] if api else []
    result = bench(
        "--url", local_url, "--kind", kind, *api_args, *SMALL, *SHORT, *extra,
        "--output", str(out), "--plot", str(png),
    )  # fmt: skip
    data = json.loads(out.read_text())
    validate_results(data)
    assert data["config"]["api"] == (api or "tgi")  # /info answers: detected as TGI
    assert data["config"]["kind"] == kind
    expected = {"throughput": 1, "rate": 2, "sweep": 2}[kind]
    assert len(data["steps"]) == expected
    assert data["config"]["max_requests"] == 6 and data["config"]["warmup_requests"] == 2
    for s in data["steps"]:  # every user's session is one request: exactly the counts
        assert s["requests"]["ok"] == 6 and s["requests"]["warmup"] == 2, s
        assert not s["errors"], s
    if "--slo" in extra:
        assert all(s["goodput"]["slos_s"] == {"ttft": 0.5, "itl": 0.05} for s in data["steps"])
    else:
        assert all(s["goodput"] is None for s in data["steps"])
    assert png.read_bytes().startswith(PNG)
    assert "TTFT p50" in result.output and "output tok/s" in result.output
    for step in data["steps"]:
        # FakeEngine streams one token per event, cut at --decode-tokens 4.
        ok = step["requests"]["ok"]
        assert step["token_check"] == {
            "requests": ok,
            "stream_tokens": 4 * ok,
            "tokenizer_tokens": 4 * ok,
            "agreeing_requests": ok,
            "ratio": 1.0,
        }
    assert "warning" not in result.output


@pytest.mark.parametrize("api", ["tgi", "openai-chat", "openai-completions"])
def test_token_check_agrees_on_answers_ending_with_eos(
    api: str, tokenizer: Any, tokenizer_dir: Path, tmp_path: Path
) -> None:
    """Two tokens, then the EOS: TGI streams it as a special token, OpenAI's usage counts it."""
    out = tmp_path / "r.json"
    with serve(tokenizer, str(tokenizer_dir), eos_after=2) as (url, _):
        result = bench("--url", url, "--api", api, "--kind", "throughput", "--max-vus", "2",
                       *SMALL, *SHORT, "--output", str(out))  # fmt: skip
    step = json.loads(out.read_text())["steps"][0]
    ok = step["requests"]["ok"]
    assert ok == 6 and step["output_tokens"] == 3 * ok  # the stream's count includes the EOS
    assert step["token_check"] == {
        "requests": ok,
        "stream_tokens": 2 * ok,
        "tokenizer_tokens": 2 * ok,
        "agreeing_requests": ok,
        "ratio": 1.0,
    }
    assert "counts the answers' tokens differently" not in result.output
    # Three tokens of the four asked: every answer is short, and the run says so.
    assert step["output_lengths"] == {
        "requests": ok,
        "short_requests": ok,
        "tokens": {"min": 3, "p50": 3.0, "mean": 3.0, "max": 3},
        "asked": {"min": 4, "mean": 4.0, "max": 4},
    }
    warning = " ".join(result.output[result.output.index("warning:") :].split())
    assert f"(step 1: {ok} of {ok} requests, mean 3.0 and min 3 tokens against 4 asked)" in warning
    assert "--ignore-eos runs every answer to its length" in warning


@pytest.mark.parametrize("api", ["tgi", "openai-chat", "openai-completions"])
def test_ignore_eos_runs_every_answer_to_its_length(
    api: str, tokenizer: Any, tokenizer_dir: Path, tmp_path: Path
) -> None:
    """The same EOS after two tokens, sent with --ignore-eos: in TGI's `parameters` or at the
    top of the OpenAI body, every answer runs to its 4 tokens, with no short-answer warning."""
    engine = FakeEngine(tokenizer, delay=0.002, eos_after=2)
    config = make_config(model_id=str(tokenizer_dir))
    app_ = create_app(engine, tokenizer, config, ModelInfo.from_config(config))
    out = tmp_path / "r.json"
    with live_server(app_, shutdown_grace_s=1.0) as (url, _):
        result = bench("--url", url, "--api", api, "--kind", "throughput", "--max-vus", "2",
                       "--ignore-eos", *SMALL, *SHORT, "--output", str(out))  # fmt: skip
    data = json.loads(out.read_text())
    validate_results(data)
    assert data["config"]["ignore_eos"] is True
    assert engine.requests and all(r.params.ignore_eos for r in engine.requests)
    step = data["steps"][0]
    ok = step["requests"]["ok"]
    assert ok == 6 and step["output_tokens"] == 4 * ok  # the EOS among them, and one token past it
    assert step["output_lengths"] == {
        "requests": ok,
        "short_requests": 0,
        "tokens": {"min": 4, "p50": 4.0, "mean": 4.0, "max": 4},
        "asked": {"min": 4, "mean": 4.0, "max": 4},
    }
    assert "shorter than asked" not in result.output
    output = " ".join(result.output.split())
    if api == "tgi":  # the EOS is a special token of the stream: left out of the check
        assert step["token_check"]["ratio"] == 1.0 and "warning" not in output
    else:  # OpenAI's usage counts the EOS, whose text is nothing: the warning says why
        assert step["token_check"]["ratio"] == 0.75
        assert "the EOS tokens it sampled, which have no text" in output


def test_ignore_eos_and_a_json_schema_are_one_clear_error(tmp_path: Path) -> None:
    schema = tmp_path / "schema.json"
    schema.write_text('{"type": "object"}')
    result = runner.invoke(
        app,
        ["benchmark", "--url", "http://127.0.0.1:9", "--ignore-eos", "--json-schema", str(schema)],
    )
    assert isinstance(result.exception, ConfigError), (result.output, result.exception)
    text = str(result.exception)
    assert "\n" not in text
    assert text.startswith("--ignore-eos cannot be combined with --json-schema")
    assert "drop one of them" in text  # before any request: port 9 was never reached


def test_a_token_count_mismatch_prints_a_warning(
    local_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A tokenizer that counts every answer twice over: warned about, and still written."""
    from tgis.benchmark import cli_helpers

    count = cli_helpers.token_counter
    monkeypatch.setattr(cli_helpers, "token_counter", lambda tok: lambda t: 2 * count(tok)(t))
    out = tmp_path / "r.json"
    result = bench("--url", local_url, "--kind", "throughput", "--max-vus", "2", *SMALL,
                   *SHORT, "--output", str(out))  # fmt: skip
    assert json.loads(out.read_text())["steps"][0]["token_check"]["ratio"] == 2.0
    warning = result.output[result.output.index("warning:") :].split("results:")[0]
    assert "(step 1 2.00x)" in warning and "--tokenizer" in warning


def test_openai_only_server_is_detected_as_openai_chat(
    tokenizer: Any, tokenizer_dir: Path, tmp_path: Path
) -> None:
    """A server answering /v1/models but not /info (here: /info made to fail) -> openai-chat."""
    config = make_config(model_id="tiny-llama")
    app_ = create_app(
        engine=FakeEngine(tokenizer),
        tokenizer=tokenizer,
        config=config,
        model_info=ModelInfo.from_config(config),
    )
    app_.router.routes = [r for r in app_.router.routes if getattr(r, "path", "") != "/info"]
    with live_server(app_, shutdown_grace_s=1.0) as (url, _):
        out = tmp_path / "r.json"
        bench("--url", url, "--kind", "throughput", "--max-vus", "2", "--tokenizer",
              str(tokenizer_dir), *SMALL, *SHORT, "--output", str(out))  # fmt: skip
    data = json.loads(out.read_text())
    assert data["config"]["api"] == "openai-chat"
    assert data["config"]["model"] == "tiny-llama"
    assert data["steps"][0]["requests"]["ok"] > 0


def test_compare_prints_ratios_and_plots_both(local_url: str, tmp_path: Path) -> None:
    paths = []
    for users in ("1", "3"):
        paths.append(tmp_path / f"u{users}.json")
        bench("--url", local_url, "--kind", "throughput", "--max-vus", users, *SMALL, *SHORT,
              "--output", str(paths[-1]))  # fmt: skip
    png = tmp_path / "cmp.png"
    result = bench("--compare", str(paths[0]), str(paths[1]), "--plot", str(png))
    assert "u3.json / u1.json" in result.output
    assert "1 users → 3 users" in result.output
    assert "x)" in result.output  # "(1.23x)" ratios
    assert png.read_bytes().startswith(PNG)


def test_compare_engine_runs_per_batch_size_and_plots_both(tmp_path: Path) -> None:
    a, b = tmp_path / "cpu.json", tmp_path / "gpu.json"
    write_results(a, engine_results({1: (0.010, 0.002), 4: (0.030, 0.003)}))
    write_results(b, engine_results({1: (0.002, 0.001), 4: (0.006, 0.0015)}))
    png = tmp_path / "cmp.png"
    result = bench("--compare", str(a), str(b), "--plot", str(png))
    assert "gpu.json / cpu.json" in result.output and "decode tok/s" in result.output
    rows = [line for line in result.output.splitlines() if "→" in line]
    assert len(rows) == 2
    assert "10.0 → 2.0 (0.20x)" in rows[0] and "500.0 → 1000.0 (2.00x)" in rows[0]
    assert "30.0 → 6.0 (0.20x)" in rows[1] and "17066.7 → 85333.3 (5.00x)" in rows[1]
    assert png.read_bytes().startswith(PNG)


def test_compare_an_engine_run_with_a_load_test_is_one_line(tmp_path: Path) -> None:
    engine, http = tmp_path / "engine.json", tmp_path / "http.json"
    write_results(engine, engine_results({1: (0.01, 0.001)}))
    write_results(http, results())
    result = run_tgis("benchmark", "--compare", str(engine), str(http), "--plot",
                      str(tmp_path / "never.png"))  # fmt: skip
    assert result.returncode == 1
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith(f"error: --compare: {engine} is an --engine (in-process) run")
    assert f"but {http} is an HTTP load test" in lines[0]
    assert not (tmp_path / "never.png").exists()
    reverse = runner.invoke(app, ["benchmark", "--compare", str(http), str(engine)])
    assert isinstance(reverse.exception, TgisError)
    assert f"{http} is an HTTP load test but {engine} is an --engine" in str(reverse.exception)


def test_a_bad_tokenizer_is_one_clear_line(local_url: str, tmp_path: Path) -> None:
    missing = str(tmp_path / "no-such-tokenizer")
    result = runner.invoke(app, ["benchmark", "--url", local_url, "--tokenizer", missing])
    assert isinstance(result.exception, TgisError)
    text = str(result.exception)
    assert "\n" not in text and "--tokenizer" in text and missing in text


def test_an_unknown_model_id_asks_for_tokenizer(tokenizer: Any) -> None:
    with serve(tokenizer, "nobody/not-cached-model") as (url, _):
        result = runner.invoke(app, ["benchmark", "--url", url])
    assert isinstance(result.exception, TgisError)
    assert "nobody/not-cached-model" in str(result.exception)
    assert "--tokenizer" in str(result.exception)


def test_an_unreachable_url_is_one_line_on_stderr() -> None:
    result = run_tgis("benchmark", "--url", "http://127.0.0.1:9", "--kind", "throughput")
    assert result.returncode == 1
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("error: cannot reach the server at http://127.0.0.1:9")
    assert "--url" in lines[0]


def test_rate_kind_needs_rates(local_url: str) -> None:
    result = runner.invoke(app, ["benchmark", "--url", local_url, "--kind", "rate"])
    assert isinstance(result.exception, TgisError)
    assert "--rates" in str(result.exception)


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--max-requests", "0"], "--max-requests 0 must be at least 1"),
        (["--warmup-requests", "-2"], "--warmup-requests -2 must be >= 0"),
    ],
)
def test_bad_request_counts_are_one_clear_error(flags: list[str], message: str) -> None:
    result = runner.invoke(app, ["benchmark", *UNREACHABLE, *flags])
    assert isinstance(result.exception, ConfigError), (result.output, result.exception)
    assert str(result.exception).startswith(message)  # before any request: port 9 unreached


def test_ctrl_c_mid_run_still_writes_valid_results_and_exits_130(
    local_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """KeyboardInterrupt raised from the runner's per-record hook after a few records."""
    from tgis.benchmark import runner as runner_module

    original = runner_module._Current.add

    def add(self: Any, record: Any) -> None:
        original(self, record)
        if len(self.records) >= 3:
            raise KeyboardInterrupt

    monkeypatch.setattr(runner_module._Current, "add", add)
    out = tmp_path / "r.json"
    result = runner.invoke(
        app,
        ["benchmark", "--url", local_url, "--kind", "throughput", "--max-vus", "1", *SMALL,
         "--duration", "5", "--warmup", "0", "--requests", "4", "--output", str(out)],
    )  # fmt: skip
    assert result.exit_code == 130, (result.output, result.exception)
    data = json.loads(out.read_text())
    validate_results(data)
    assert data["config"]["interrupted"] is True
    assert len(data["steps"]) == 1 and data["steps"][0]["requests"]["ok"] >= 1


UNREACHABLE = ["--url", "http://127.0.0.1:9"]  # image flags are checked before any request


@pytest.mark.parametrize(
    ("args", "message", "hint"),
    [
        (["--images-per-prompt", "-1"], "--images-per-prompt -1 must be 0 to 64",
         "e.g. --images-per-prompt 4"),
        (["--images-per-prompt", "65"], "--images-per-prompt 65 must be 0 to 64",
         "--max-images-per-request"),
        (["--profile", "vision", "--image-size", "0x10"],
         "--image-size 0x10: each side must be 1 to 8192 pixels", "e.g. --image-size 512x512"),
        (["--profile", "vision", "--image-size", "640x-2"], "each side must be 1 to 8192",
         "512x512"),
        (["--profile", "vision", "--image-size", "9000x10"], "each side must be 1 to 8192",
         "512x512"),
        (["--profile", "vision", "--image-size", "640"],
         "--image-size: '640' is not WIDTHxHEIGHT in pixels", "e.g. --image-size 512x512"),
        (["--profile", "vision", "--image-format", "gif"], "unknown --image-format 'gif'",
         "choose one of png, jpeg"),
        (["--image-size", "64x64"],
         "--image-size shapes the prompts' images, and this profile sends none",
         "add --images-per-prompt N or use --profile vision, or drop --image-size"),
        (["--profile", "vision", "--images-per-prompt", "0", "--repeat-images"],
         "--unique-images/--repeat-images shapes the prompts' images, and "
         "--images-per-prompt 0 sends none", "drop --unique-images/--repeat-images"),
        (["--image-format", "png", "--unique-images"], "--image-format shapes",
         "drop --image-format and --unique-images/--repeat-images"),
        (["--images-per-prompt", "8", "--image-size", "4096x4096", "--requests", "4"],
         "32 distinct images of 4096x4096 (1536 MiB of pixels) are more than the 768 MiB",
         "lower --requests, --images-per-prompt or --image-size, or send the same images in "
         "every request with --repeat-images"),
    ],
)  # fmt: skip
def test_bad_image_flags_are_one_clear_error(args: list[str], message: str, hint: str) -> None:
    result = runner.invoke(app, ["benchmark", *UNREACHABLE, *args])
    assert isinstance(result.exception, ConfigError), (result.output, result.exception)
    assert message in str(result.exception) and hint in str(result.exception)
    assert "\n" not in str(result.exception)


class Stop(Exception):
    """Raised in place of reaching the server, once the workload's profile is chosen."""


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["--profile", "vision"], ImageSpec(1, 512, 512, "jpeg", unique=True)),
        (["--profile", "chat"], None),
        (["--profile", "vision", "--images-per-prompt", "0"], None),
        (["--profile", "chat", "--images-per-prompt", "3"], ImageSpec(3, 512, 512, "jpeg")),
        (["--profile", "vision", "--images-per-prompt", "2", "--image-size", "640x480",
          "--image-format", "png", "--repeat-images"], ImageSpec(2, 640, 480, "png", False)),
        (["--profile", "fixed-length", "--images-per-prompt", "1", "--unique-images"],
         ImageSpec(1, 512, 512, "jpeg", unique=True)),
    ],
)  # fmt: skip
def test_image_flags_shape_the_profile(
    args: list[str], expected: ImageSpec | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tgis.benchmark import cli_helpers, target

    chosen: list[Profile] = []
    choose = cli_helpers.choose_profile

    def capture(*a: Any, **k: Any) -> Profile:
        chosen.append(choose(*a, **k))
        return chosen[-1]

    def stop(*a: Any, **k: Any) -> None:
        raise Stop

    monkeypatch.setattr(cli_helpers, "choose_profile", capture)
    monkeypatch.setattr(target, "detect_target", stop)
    result = runner.invoke(app, ["benchmark", *args])
    assert isinstance(result.exception, Stop), (result.output, result.exception)
    (profile,) = chosen
    assert profile.images == expected and profile.name == args[1]


def test_the_completions_api_refuses_images_naming_the_flags(local_url: str) -> None:
    args = ["benchmark", "--url", local_url, "--api", "openai-completions", "--profile", "vision"]
    result = runner.invoke(app, args)
    assert isinstance(result.exception, ConfigError), (result.output, result.exception)
    text = str(result.exception)
    assert text.startswith("OpenAI's completions API takes text only, and the prompts carry "
                           "images (1 image 512x512 jpeg per request, unique)")  # fmt: skip
    assert "use --api openai-chat or --api tgi, or --images-per-prompt 0" in text


@pytest.mark.parametrize(
    ("args", "flag"),
    [
        (["--images-per-prompt", "1"], "--images-per-prompt"),
        (["--image-size", "8x8"], "--image-size"),
        (["--image-format", "png"], "--image-format"),
        (["--repeat-images"], "--unique-images/--repeat-images"),
    ],
)
def test_engine_mode_refuses_image_flags(args: list[str], flag: str) -> None:
    result = runner.invoke(app, ["benchmark", "--engine", "--model-id", "x", *args])
    assert isinstance(result.exception, ConfigError), (result.output, result.exception)
    assert str(result.exception).startswith(f"{flag} applies to a load test of a server")
    assert f"drop {flag}, or load-test a server (--url)" in str(result.exception)

"""`tgis benchmark`: load-test a server speaking TGI's or OpenAI's API (see docs/benchmarking.md)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer

TARGET = "Target"
WORKLOAD = "Workload"
LOAD = "Load"
OUTPUT = "Output"
ENGINE = "In-process (--engine)"
ENGINE_PROMPT_TOKENS = 128
ENGINE_DECODE_TOKENS = 16


def command(
    url: Annotated[
        str, typer.Option("--url", help="Base URL of the server.", rich_help_panel=TARGET)
    ] = "http://127.0.0.1:3000",
    api: Annotated[
        str | None,
        typer.Option(
            "--api",
            help="tgi, openai-chat, openai-completions or embeddings (OpenAI's /v1/embeddings: "
            "requests/s and latency; --decode-tokens does not apply).",
            rich_help_panel=TARGET,
            show_default="detected: /info -> tgi (embeddings for an embedding model), else "
            "/v1/models -> openai-chat",
        ),
    ] = None,
    api_key: Annotated[
        str | None,
        typer.Option(
            "--api-key", help="Sent as `Authorization: Bearer KEY`.", rich_help_panel=TARGET
        ),
    ] = None,
    tokenizer: Annotated[
        str | None,
        typer.Option(
            "--tokenizer",
            help="Tokenizer directory or cached model id to cut prompts with (never downloaded).",
            rich_help_panel=TARGET,
            show_default="the model_id of /info",
        ),
    ] = None,
    profile: Annotated[
        str,
        typer.Option(
            "--profile",
            help="chat, code-generation, code-editing, classification, fixed-length or vision "
            "(prompts with images).",
            rich_help_panel=WORKLOAD,
        ),
    ] = "chat",
    prompt_tokens: Annotated[
        int | None,
        typer.Option(
            "--prompt-tokens",
            help="Fixed prompt length (tokens per turn) instead of the profile's.",
            rich_help_panel=WORKLOAD,
        ),
    ] = None,
    decode_tokens: Annotated[
        int | None,
        typer.Option(
            "--decode-tokens",
            help="Fixed answer length (max_new_tokens) instead of the profile's.",
            rich_help_panel=WORKLOAD,
        ),
    ] = None,
    images_per_prompt: Annotated[
        int | None,
        typer.Option(
            "--images-per-prompt",
            help="Images in every request, before the prompt's text (0: text only), with any "
            "profile: OpenAI chat's image_url parts, TGI's markdown images.",
            rich_help_panel=WORKLOAD,
            show_default="vision: 1, other profiles: 0",
        ),
    ] = None,
    image_size: Annotated[
        str | None,
        typer.Option(
            "--image-size",
            help="WIDTHxHEIGHT of the images, in pixels (each side 1 to 8192).",
            rich_help_panel=WORKLOAD,
            show_default="512x512",
        ),
    ] = None,
    image_format: Annotated[
        str | None,
        typer.Option(
            "--image-format",
            help="png or jpeg: how the images are encoded.",
            rich_help_panel=WORKLOAD,
            show_default="jpeg",
        ),
    ] = None,
    unique_images: Annotated[
        bool | None,
        typer.Option(
            "--unique-images/--repeat-images",
            help="New images for every session (the server decodes and encodes each), or the "
            "same ones in every request (the server's prefix cache may hold them).",
            rich_help_panel=WORKLOAD,
            show_default="unique",
        ),
    ] = None,
    requests: Annotated[
        int,
        typer.Option(
            "--requests", help="Sessions to prebuild (reused in turn).", rich_help_panel=WORKLOAD
        ),
    ] = 64,
    json_schema: Annotated[
        Path | None,
        typer.Option(
            "--json-schema",
            help="A JSON schema file every answer must match (TGI's grammar, OpenAI chat's "
            "response_format): the cost of structured output.",
            rich_help_panel=WORKLOAD,
            show_default=False,
        ),
    ] = None,
    ignore_eos: Annotated[
        bool,
        typer.Option(
            "--ignore-eos",
            help="Send ignore_eos with every request (TGI's parameters.ignore_eos, OpenAI's "
            "top-level field, as vLLM takes it): answers run to their length instead of ending "
            "at EOS, which random-weight models pick early.",
            rich_help_panel=WORKLOAD,
        ),
    ] = False,
    adapters: Annotated[
        str | None,
        typer.Option(
            "--adapters",
            help="LoRA adapters the requests go through in turn, separated by commas (TGI's "
            "adapter_id, OpenAI's model; an empty name is the base model: ',a,b').",
            rich_help_panel=WORKLOAD,
            show_default=False,
        ),
    ] = None,
    seed: Annotated[
        int,
        typer.Option(
            "--seed", help="Fixes prompts, images, lengths and arrivals.", rich_help_panel=WORKLOAD
        ),
    ] = 0,
    kind: Annotated[
        str,
        typer.Option(
            "--kind",
            help="throughput (--max-vus closed-loop users), rate (--rates open-loop steps) or "
            "sweep (throughput, then --num-rates rate steps up to it).",
            rich_help_panel=LOAD,
        ),
    ] = "sweep",
    duration: Annotated[
        float,
        typer.Option(
            "--duration",
            help="Measured seconds per step (at most, with --max-requests).",
            rich_help_panel=LOAD,
        ),
    ] = 30.0,
    warmup: Annotated[
        float,
        typer.Option("--warmup", help="Unmeasured seconds before each step.", rich_help_panel=LOAD),
    ] = 5.0,
    max_requests: Annotated[
        int | None,
        typer.Option(
            "--max-requests",
            help="Measured requests per step: the step stops starting requests after this many "
            "(or after --duration, whichever comes first), so a slow or busy machine measures "
            "the same requests.",
            rich_help_panel=LOAD,
            show_default=False,
        ),
    ] = None,
    warmup_requests: Annotated[
        int,
        typer.Option(
            "--warmup-requests",
            help="Unmeasured requests before each step; the warmup lasts until both these and "
            "--warmup seconds are done.",
            rich_help_panel=LOAD,
        ),
    ] = 0,
    max_vus: Annotated[
        int,
        typer.Option("--max-vus", help="Virtual users of throughput steps.", rich_help_panel=LOAD),
    ] = 32,
    rates: Annotated[
        str | None,
        typer.Option(
            "--rates", help="Sessions per second of rate steps, e.g. 1,2,4.", rich_help_panel=LOAD
        ),
    ] = None,
    num_rates: Annotated[
        int, typer.Option("--num-rates", help="Rate steps of a sweep.", rich_help_panel=LOAD)
    ] = 5,
    slo: Annotated[
        str | None,
        typer.Option(
            "--slo",
            help="Goodput SLOs, e.g. ttft=500ms,itl=50ms (ttft, itl, tpot, e2e).",
            rich_help_panel=LOAD,
        ),
    ] = None,
    output: Annotated[
        Path | None,
        typer.Option("--output", "-o", help="Write the results JSON here.", rich_help_panel=OUTPUT),
    ] = None,
    plot: Annotated[
        Path | None,
        typer.Option(
            "--plot", help="Write a PNG plot of the results here.", rich_help_panel=OUTPUT
        ),
    ] = None,
    engine: Annotated[
        bool,
        typer.Option(
            "--engine",
            help="Drive the backend in-process (no server): prefill and decode per batch size.",
            rich_help_panel=ENGINE,
        ),
    ] = False,
    model_id: Annotated[
        str | None,
        typer.Option(
            "--model-id", help="Model directory or cached id of --engine.", rich_help_panel=ENGINE
        ),
    ] = None,
    batch_sizes: Annotated[
        str,
        typer.Option("--batch-sizes", help="Batch sizes of --engine.", rich_help_panel=ENGINE),
    ] = "1,2,4,8",
    runs: Annotated[
        int,
        typer.Option(
            "--runs", help="Measured runs per batch size of --engine.", rich_help_panel=ENGINE
        ),
    ] = 5,
    dtype: Annotated[
        str | None,
        typer.Option(
            "--dtype",
            help="float32, float16 or bfloat16 for --engine.",
            rich_help_panel=ENGINE,
            show_default="the model's (float32 on CPUs without bf16)",
        ),
    ] = None,
    compile: Annotated[
        bool,
        typer.Option(
            "--compile",
            help="--engine: run decode through torch.compile (compiled before measuring).",
            rich_help_panel=ENGINE,
        ),
    ] = False,
    model_impl: Annotated[
        str,
        typer.Option(
            "--model-impl",
            help="--engine: whose forward runs the model, as `tgis serve --model-impl` takes it "
            "(auto, tgis, transformers).",
            rich_help_panel=ENGINE,
        ),
    ] = "auto",
    quantize: Annotated[
        str | None,
        typer.Option(
            "--quantize",
            help="--engine: quantize the weights at load, as `tgis serve --quantize` takes it "
            "(int8, int4, fp8, bitsandbytes, bitsandbytes-nf4, bitsandbytes-fp4).",
            rich_help_panel=ENGINE,
        ),
    ] = None,
    kv_cache_dtype: Annotated[
        str | None,
        typer.Option(
            "--kv-cache-dtype",
            help="--engine: the KV cache's dtype, as `tgis serve --kv-cache-dtype` takes it "
            "(auto, fp8_e4m3fn, fp8_e5m2).",
            rich_help_panel=ENGINE,
        ),
    ] = None,
    num_shard: Annotated[
        int,
        typer.Option(
            "--num-shard",
            help="--engine: shard the model over this many processes (tensor parallelism).",
            rich_help_panel=ENGINE,
            min=1,
        ),
    ] = 1,
    async_scheduling: Annotated[
        bool | None,
        typer.Option(
            "--async-scheduling/--no-async-scheduling",
            help="--engine: the serving loop plans each step while the device runs the one "
            "before (as `tgis serve --async-scheduling`).",
            rich_help_panel=ENGINE,
            show_default="on with --simulated-device-ms, else off",
        ),
    ] = None,
    sampling: Annotated[
        str | None,
        typer.Option(
            "--sampling",
            help="--engine: how the serving loop's requests sample: greedy, or mixed (greedy, "
            "temperature/top-p, repetition penalty and stop strings in turns).",
            rich_help_panel=ENGINE,
            show_default="greedy",
        ),
    ] = None,
    simulated_device_ms: Annotated[
        float | None,
        typer.Option(
            "--simulated-device-ms",
            help="--engine: replace the model's forward by a timer whose steps take MS on a "
            "simulated device of their own (the model's vocabulary and tokenizer kept): the "
            "engine's host work against an accelerator's step time, on any machine.",
            rich_help_panel=ENGINE,
            show_default=False,
        ),
    ] = None,
    compare: Annotated[
        tuple[Path, Path] | None,
        typer.Option(
            "--compare",
            help="Compare two results files (A B) instead of running; with --plot, plot both.",
            rich_help_panel=OUTPUT,
            show_default=False,
        ),
    ] = None,
) -> None:
    """Load-test a running server through TGI's or OpenAI's streaming API and report
    throughput, TTFT, ITL, end-to-end latency and goodput per step.

    Prompts are cut from a fixed corpus with the server's own tokenizer, so their token counts
    are exact; output tokens are counted from the stream and checked against that tokenizer.
    A live display shows each step; Ctrl-C stops and still writes what was measured. --compare
    matches load-test steps by kind and position, --engine runs by batch size.

    [bold]Example[/]

      tgis benchmark --url http://127.0.0.1:3000 --profile chat --kind sweep --duration 60 \\
          --slo ttft=500ms,itl=50ms --output results.json --plot results.png
      tgis benchmark --url http://127.0.0.1:3000 --profile vision --images-per-prompt 2 \\
          --image-size 640x480 --kind throughput --output vision.json
      tgis benchmark --compare before.json after.json --plot compare.png
      tgis benchmark --engine --model-id MODEL --batch-sizes 1,2,4,8 --prompt-tokens 128 \\
          --decode-tokens 16 --runs 5 --output engine.json --plot engine.png
    """
    import asyncio

    from rich.console import Console

    from tgis.benchmark.cli_helpers import (
        adapter_list,
        build_workload,
        check_images_api,
        check_options,
        choose_profile,
        ignore_eos_fields,
        load_compared,
        read_json_schema,
        save,
        step_window,
        structured_output,
        token_counter,
    )
    from tgis.benchmark.client import BenchmarkClient
    from tgis.benchmark.metrics import summarize
    from tgis.benchmark.report import (
        compare_table,
        engine_compare_table,
        is_engine,
        results_table,
        short_output_warning,
        token_check_warning,
    )
    from tgis.benchmark.results import build_results
    from tgis.benchmark.runner import BenchmarkRun
    from tgis.benchmark.target import auth_headers, detect_target, load_tokenizer

    console = Console()
    if compare is not None:
        (name_a, a), (name_b, b) = load_compared(compare)
        table = engine_compare_table if is_engine(a) else compare_table
        console.print(table(a, b, (name_a, name_b)))
        if plot is not None:
            save(console, None, plot, [(name_a, a), (name_b, b)])
        return
    if engine:
        for given, flag in (
            (json_schema is not None, "--json-schema"),
            (ignore_eos, "--ignore-eos"),
            (adapters, "--adapters"),
            (images_per_prompt is not None, "--images-per-prompt"),
            (image_size is not None, "--image-size"),
            (image_format is not None, "--image-format"),
            (unique_images is not None, "--unique-images/--repeat-images"),
        ):
            if given:
                from tgis.errors import ConfigError

                raise ConfigError(
                    f"{flag} applies to a load test of a server; --engine times the backend's "
                    "steps on fixed prompts",
                    f"drop {flag}, or load-test a server (--url)",
                )
        _engine(
            console, output, plot, model_id, batch_sizes, prompt_tokens, decode_tokens, runs,
            dtype, seed, compile, num_shard, model_impl, quantize, kv_cache_dtype,
            simulated_device_ms, async_scheduling, sampling or "greedy",
        )  # fmt: skip
        return
    from tgis.benchmark.engine_mode import forward_flags

    given = ["--simulated-device-ms"] if simulated_device_ms is not None else []
    given += ["--async-scheduling"] if async_scheduling is not None else []
    given += ["--sampling"] if sampling is not None else []
    given += forward_flags(compile, num_shard, model_impl, quantize, kv_cache_dtype)
    if given:
        from tgis.errors import ConfigError

        raise ConfigError(
            f"{given[0]} applies to --engine (the backend in this process); a load test "
            "measures the server as it was started",
            f"add --engine, or drop {given[0]}",
        )
    rate_list, slos = check_options(
        kind, rates, slo, duration, warmup, max_vus, num_rates, requests
    )
    window = step_window(duration, warmup, max_requests, warmup_requests)
    chosen = choose_profile(
        profile, prompt_tokens, decode_tokens, requests,
        images_per_prompt, image_size, image_format, unique_images,
    )  # fmt: skip
    # Flags that cannot go together stop the command before the server is asked anything.
    schema = read_json_schema(json_schema)
    eos_fields = ignore_eos_fields(ignore_eos, schema)
    target = detect_target(url, api, api_key)
    check_images_api(target.api, chosen.images)
    tok, tokenizer_name = load_tokenizer(tokenizer, target.model_id)
    sessions = build_workload(chosen, tok, requests, seed)
    client = BenchmarkClient(
        target.url,
        api=target.api,  # type: ignore[arg-type]
        model=target.model_id or "tgi",
        headers=auth_headers(api_key),
        extra_parameters={
            **structured_output(target.api, schema),
            **eos_fields,
        },
        adapters=adapter_list(adapters),
    )
    run = BenchmarkRun(client, sessions, kind, window, max_vus, rate_list, num_rates, seed)

    async def main() -> None:
        try:
            await run.execute(Console(stderr=True))
        finally:
            await client.aclose()

    interrupted = False
    try:
        asyncio.run(main())
    except KeyboardInterrupt:
        interrupted = True
    config = {
        "url": target.url,
        "api": target.api,
        "kind": kind,
        "profile": chosen.to_dict(),
        "seed": seed,
        "model": target.model_id,
        "tokenizer": tokenizer_name,
        "duration_s": duration,
        "warmup_s": warmup,
        "max_requests": max_requests,
        "warmup_requests": warmup_requests,
        "max_vus": max_vus,
        "rates": rate_list,
        "num_rates": num_rates,
        "requests": requests,
        "json_schema": schema,
        "ignore_eos": ignore_eos,
        "adapters": list(adapter_list(adapters)),
        "slos_s": slos,
        "interrupted": interrupted,
    }
    count_tokens = token_counter(tok)
    data = build_results(config, [summarize(step, slos, count_tokens) for step in run.steps()])
    console.print(results_table(data))
    for warning in (token_check_warning(data), short_output_warning(data)):
        if warning is not None:
            console.print(warning)
    save(console, output, plot, [("run", data)], data)
    if interrupted:
        console.print("[yellow]interrupted[/]: the results cover the steps measured so far")
        raise typer.Exit(130)


def _engine(
    console: Any,
    output: Path | None,
    plot: Path | None,
    model_id: str | None,
    batch_sizes: str,
    prompt_tokens: int | None,
    decode_tokens: int | None,
    runs: int,
    dtype: str | None,
    seed: int,
    compile: bool = False,
    num_shard: int = 1,
    model_impl: str = "auto",
    quantize: str | None = None,
    kv_cache_dtype: str | None = None,
    simulated_device_ms: float | None = None,
    async_scheduling: bool | None = None,
    sampling: str = "greedy",
) -> None:
    """`--engine`: measure the backend in-process, print the table, write --output/--plot."""
    from rich.console import Console

    from tgis.benchmark.cli_helpers import save
    from tgis.benchmark.engine_mode import parse_batch_sizes, run_engine
    from tgis.benchmark.report import engine_table
    from tgis.errors import ConfigError

    if not model_id:
        raise ConfigError("--engine needs --model-id", "e.g. --engine --model-id ./my-model")
    data, interrupted = run_engine(
        model_id,
        parse_batch_sizes(batch_sizes),
        prompt_tokens or ENGINE_PROMPT_TOKENS,
        decode_tokens or ENGINE_DECODE_TOKENS,
        runs,
        dtype,
        seed,
        Console(stderr=True),
        compile,
        num_shard,
        model_impl,
        quantize,
        kv_cache_dtype,
        simulated_device_ms,
        async_scheduling,
        sampling,
    )
    console.print(engine_table(data))
    save(console, output, plot, [("engine", data)], data)
    if interrupted:
        console.print("[yellow]interrupted[/]: the results cover the batch sizes measured so far")
        raise typer.Exit(130)

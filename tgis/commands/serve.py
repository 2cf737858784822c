"""`tgis serve`: resolve and validate the launcher configuration, then serve the model."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Annotated, Any

import typer

from tgis.commands.launcher_options import (
    NoDownload,
    launcher_options,
    resolve_launcher_config,
)

if TYPE_CHECKING:
    from pathlib import Path

    from rich.console import Console

    from tgis.config import ServeConfig
    from tgis.pooling.spec import PoolingSpec
    from tgis.server.http.lifecycle import GracefulServer


@launcher_options()
def command(
    shutdown_grace: Annotated[
        float,
        typer.Option(
            "--shutdown-grace",
            help="Seconds in-flight requests get to finish after SIGTERM.",
            rich_help_panel="Server",
        ),
    ] = 30.0,
    check: Annotated[
        bool,
        typer.Option("--check", help="Validate and print the resolved configuration, then exit."),
    ] = False,
    no_download: NoDownload = False,
    **launcher: Any,
) -> None:
    """Serve a model over HTTP: TGI's routes (/generate, /generate_stream, ...) and OpenAI's
    (/v1/completions, /v1/chat/completions), and over gRPC: TGIS's fmaas.GenerationService
    (port 8033), all on one engine with continuous batching.

    Every flag falls back to the environment variable of TGI's launcher (MODEL_ID,
    MAX_TOTAL_TOKENS, ...), and TGIS's names work too (MODEL_NAME, MAX_SEQUENCE_LENGTH, ...); accelerator variables (HF_BATCH_SIZE, HF_SEQUENCE_LENGTH,
    BATCH_BUCKET_SIZE, ...) are read too. Unset limits are derived from the model and the
    backend's shape rules. A Hub model missing from the Hugging Face cache is downloaded first, as
    `tgis download-weights` does (not with --no-download or HF_HUB_OFFLINE=1).

    [bold]Examples[/]

      tgis serve                       # the bundled demo model, port 3000
      tgis serve --model-id bigscience/bloom-560m --max-total-tokens 2048 --port 8080
      tgis serve --check --backend tpu --max-batch-size 4 --max-total-tokens 1024

      # one model over two hosts' GPUs: node 0 serves, node 1 runs its shards
      tgis serve --model-id MODEL --num-shard 16 --nnodes 2 --node-rank 0 --master-addr 10.0.0.1
      tgis serve --model-id MODEL --num-shard 16 --nnodes 2 --node-rank 1 --master-addr 10.0.0.1
    """
    import logging
    from pathlib import Path

    from rich.console import Console

    from tgis.backends.choose import choose_backend
    from tgis.commands.show_config import render_config
    from tgis.launch import build_service, service_info
    from tgis.pooling.spec import read_pooling_spec
    from tgis.server import Metrics, create_app, serve
    from tgis.server.http.lifecycle import ServerThread

    config, model_dir, facts = resolve_launcher_config(launcher, download=not no_download)
    console = Console()
    template = Path(config.rerank_template) if config.rerank_template else None
    spec = read_pooling_spec(model_dir, dict(facts.config), config.rerank_tokens, template)
    if spec is not None:
        _serve_pooling(console, config, model_dir, spec, check, shutdown_grace)
        return
    choice = choose_backend(config, facts)
    render_config(console, config, choice)
    if check:
        return
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    if config.node_rank > 0:
        from tgis.backends.paged.tensor_parallel import ShardSettings, serve_node

        settings = ShardSettings.of(config, model_dir)
        ranks = settings.layout.describe(config.node_rank)
        console.print(
            f"[green]Running[/] {ranks} of {config.model_id} over {config.nnodes} nodes; "
            f"node 0 at {config.master_addr}:{config.master_port} serves"
        )
        serve_node(settings, shutdown_grace)
        return
    metrics = Metrics(config.max_total_tokens, config.batch_slots)
    # The model loads, warms up and runs on this thread: torch keeps one OpenMP team.
    service = build_service(config, model_dir, observer=metrics, start_engine=False, choice=choice)
    try:
        info = service_info(service)
        app = create_app(service.engine, service.tokenizer, config, info, metrics=metrics,
                         api_key=config.api_key, cors_origins=config.cors_allow_origins,
                         prefixes=service.prefixes, adapters=service.adapters,
                         vision=service.vision,
                         prompt_logprobs=service.backend.capacity.prompt_logprobs)  # fmt: skip
        scheme = "https" if config.tls else "http"
        console.print(
            f"[green]Serving[/] {config.model_id} on {scheme}://{config.hostname}:{config.port}"
            + (f", gRPC on port {config.grpc_port}" if config.grpc_port else "")
        )

        async def run(server_ready: Callable[[GracefulServer], None]) -> None:
            companions = []
            if config.grpc_port:
                from tgis.fmaas.server import GrpcServer

                state = app.state.tgis
                companions.append(GrpcServer(state, config.hostname, config.grpc_port, config.tls))
            await serve(
                app,
                config.hostname,
                config.port,
                shutdown_grace_s=shutdown_grace,
                server_ready=server_ready,
                tls=config.tls,
                companions=companions,
                header_timeout_s=config.header_timeout_s,
                body_timeout_s=config.body_timeout_s,
                keep_alive_timeout_s=config.keep_alive_timeout_s,
            )

        http = ServerThread(run, on_exit=service.engine.stop)
        http.start()
        # Until the HTTP server has drained and stopped it (or it fails: on_fatal then ends
        # the process non-zero).
        service.engine.run()
        http.join()
    finally:
        service.stop()
    if http.failure is not None:
        raise typer.Exit(1)


def _serve_pooling(
    console: Console,
    config: ServeConfig,
    model_dir: Path,
    spec: PoolingSpec,
    check: bool,
    shutdown_grace: float,
) -> None:
    """Serve a pooling model (embeddings, rerank, classify: tgis.pooling) over HTTP: its
    runner's loop on this thread, as the engine's is for generation. TGIS's gRPC API
    generates text, so no gRPC server starts."""
    import logging

    from tgis.pooling.service import load_pooling_service
    from tgis.server import Metrics, serve
    from tgis.server.http.app import create_pooling_app
    from tgis.server.http.lifecycle import ServerThread

    modes = f" ({'+'.join(spec.modes)} pooling)" if spec.modes else ""
    console.print(
        f"{config.model_id} serves {spec.task}{modes}, as its {spec.source} says, on "
        f"{config.backend}"
    )
    if check:
        return
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    service = load_pooling_service(config, model_dir, spec)
    metrics = Metrics(config.max_total_tokens, config.batch_slots)
    app = create_pooling_app(
        service.model, service.runner, config, metrics, config.api_key, config.cors_allow_origins
    )
    scheme = "https" if config.tls else "http"
    console.print(
        f"[green]Serving[/] {config.model_id} on {scheme}://{config.hostname}:{config.port}"
    )

    async def run(server_ready: Callable[[GracefulServer], None]) -> None:
        await serve(
            app, config.hostname, config.port, shutdown_grace_s=shutdown_grace,
            server_ready=server_ready, tls=config.tls, header_timeout_s=config.header_timeout_s,
            body_timeout_s=config.body_timeout_s, keep_alive_timeout_s=config.keep_alive_timeout_s,
        )  # fmt: skip

    http = ServerThread(run, on_exit=service.runner.stop)
    service.runner.open()  # requests that come before the loop runs wait for it
    http.start()
    service.runner.run_loop()
    http.join()
    if http.failure is not None:
        raise typer.Exit(1)

"""The HTTP layer: TGI's REST API, OpenAI's API, Prometheus metrics, OpenAPI docs.

app = create_app(engine, tokenizer, config, ModelInfo.from_config(config))
await serve(app, config.hostname, config.port, shutdown_grace_s=30)
"""

from tgis.server.http.app import create_app
from tgis.server.http.info import ModelInfo
from tgis.server.http.lifecycle import GracefulServer, Lifecycle, serve
from tgis.server.http.metrics import Metrics

__all__ = ["GracefulServer", "Lifecycle", "Metrics", "ModelInfo", "create_app", "serve"]

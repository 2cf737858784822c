"""Load generation against servers speaking TGI's or OpenAI's API: profiles, prompts built
offline with the target's tokenizer, streaming clients, load kinds, metrics, results files.

    sessions = build_sessions(get_profile("chat"), tokenizer, count=64, seed=0)
    # or prompts with images: get_profile("vision"), or any profile .with_images(ImageSpec(...))
    client = BenchmarkClient(url, api="openai-chat", model="tgi")
    step = await run_throughput(client, sessions, users=8, window=StepWindow(60, warmup=10))
    data = build_results(config, [summarize(step, parse_slos("ttft=500ms,itl=50ms"))])
"""

from tgis.benchmark.client import APIS, BenchmarkClient, RequestRecord
from tgis.benchmark.images import ImageSpec, image_sets
from tgis.benchmark.load import StepResult, StepWindow, run_rate, run_sweep, run_throughput
from tgis.benchmark.metrics import parse_slos, percentile, summarize
from tgis.benchmark.profiles import PROFILES, LengthDistribution, Profile, get_profile
from tgis.benchmark.prompts import Session, Turn, build_sessions, make_prompt
from tgis.benchmark.results import (
    RESULTS_SCHEMA,
    SCHEMA_VERSION,
    build_results,
    read_results,
    system_info,
    validate_results,
    write_results,
)

__all__ = [
    "APIS",
    "PROFILES",
    "RESULTS_SCHEMA",
    "SCHEMA_VERSION",
    "BenchmarkClient",
    "ImageSpec",
    "LengthDistribution",
    "Profile",
    "RequestRecord",
    "Session",
    "StepResult",
    "StepWindow",
    "Turn",
    "build_results",
    "build_sessions",
    "get_profile",
    "image_sets",
    "make_prompt",
    "parse_slos",
    "percentile",
    "read_results",
    "run_rate",
    "run_sweep",
    "run_throughput",
    "summarize",
    "system_info",
    "validate_results",
    "write_results",
]

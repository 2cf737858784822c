"""tgis.backends.registry: `--backend auto` picks the device this machine has."""

from __future__ import annotations

import pytest

from tgis.backends import registry
from tgis.config import LauncherArgs, ModelFacts, NeuronExport, build_serve_config

NEURON_MODEL = ModelFacts("llama", 4096, NeuronExport(1, 2048, 2, "bf16"))


@pytest.fixture
def present(monkeypatch: pytest.MonkeyPatch) -> set[str]:
    """The modules has_module reports (torch always: CUDA availability decides for it)."""
    modules: set[str] = set()
    monkeypatch.setattr(registry, "has_module", lambda name: name in modules)
    return modules


def test_neuron_model_runs_on_neuron(present: set[str]) -> None:
    present.update({"torch_xla", "habana_frameworks"})
    assert registry.detect_backend(NEURON_MODEL, "TPU") == "neuron"


def test_tpu_needs_pjrt_device_and_torch_xla(present: set[str]) -> None:
    present.add("torch_xla")
    assert registry.detect_backend(ModelFacts(), "tpu") == "tpu"
    assert registry.detect_backend(ModelFacts(), "CPU") == "cpu"  # XLA:CPU only when asked
    assert registry.detect_backend(ModelFacts(), None) == "cpu"
    present.clear()
    assert registry.detect_backend(ModelFacts(), "TPU") == "cpu"


def test_gaudi_when_habana_frameworks_is_installed(present: set[str]) -> None:
    present.add("habana_frameworks")
    assert registry.detect_backend(ModelFacts(), None) == "gaudi"


def test_validation_core_passes_pjrt_device_from_the_environment(present: set[str]) -> None:
    present.add("torch_xla")
    config = build_serve_config(
        LauncherArgs(), ModelFacts("llama", 2048), {"PJRT_DEVICE": "TPU"}, registry.detect_backend
    )
    assert config.backend == "tpu"
    config = build_serve_config(
        LauncherArgs(), ModelFacts("llama", 2048), {}, registry.detect_backend
    )
    assert config.backend == "cpu"

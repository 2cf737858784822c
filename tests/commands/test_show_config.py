"""tgis.commands.show_config: the resolved configuration as `serve --check` prints it."""

from __future__ import annotations

from rich.console import Console

from tgis.commands.show_config import LONG_VALUE, render_config
from tgis.config import LauncherArgs, ModelFacts, build_serve_config

GPT2 = ModelFacts("gpt2", 1024)


def rendered(width: int, **flags: object) -> str:
    console = Console(record=True, width=width)
    render_config(console, build_serve_config(LauncherArgs(**flags), GPT2, {}))
    return console.export_text()


def test_a_long_value_is_printed_whole_below_the_table() -> None:
    model = "/" + "/".join(["a-rather-deep-checkout"] * 6) + "/tgis/assets/demo-model"
    assert len(model) > 80
    for width in (60, 80, 200):
        text = rendered(width, model_id=model, max_total_tokens=512)
        assert f"model_id: {model}" in text.splitlines(), width
        row = next(line for line in text.splitlines() if line.startswith("│ model_id"))
        assert "(below)" in row
        assert "…" not in text  # nothing is cut
        # Short values stay in the table.
        assert any("max_total_tokens" in line and "512" in line for line in text.splitlines())


def test_short_values_stay_in_the_table() -> None:
    text = rendered(200, model_id="gpt2")
    row = next(line for line in text.splitlines() if line.startswith("│ model_id"))
    assert "gpt2" in row and len("gpt2") <= LONG_VALUE
    assert "model_id:" not in text


def test_the_compiled_decode_by_default_is_said_where_it_applies() -> None:
    """Unset --compile: the paged engine on one CPU compiles its decode, and --check says so;
    --no-compile, or a design that does not compile by default, says nothing of it."""
    from tgis.backends.choose import choose_backend

    llama = ModelFacts(
        "llama", 2048, config={"model_type": "llama", "architectures": ["LlamaForCausalLM"]}
    )

    def text(**flags: object) -> str:
        config = build_serve_config(LauncherArgs(backend="cpu", **flags), llama, {})
        console = Console(record=True, width=200)
        render_config(console, config, choose_backend(config, llama))
        return console.export_text()

    assert "decode: compiled (the default here" in text()
    assert "decode:" not in text(compile=False)
    assert "decode:" not in text(compile=True)  # asked for: the table says so
    assert "decode:" not in text(model_impl="transformers")

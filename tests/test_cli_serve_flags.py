"""``python -m minivllm serve`` with the vLLM flags scripts copy from a ``vllm serve`` line:
each is accepted; those that mean something here reach the engine, the server or uvicorn,
the others log one warning naming themselves. And ``python -m minivllm chat`` sizes torch's
threads as the server's engine process does.
"""

from __future__ import annotations

import io
import logging
import os
import subprocess
import sys
from typing import Any

import pytest

from minivllm.__main__ import _check_vllm_flags, _engine_options, _parser
from minivllm.__main__ import main as cli_main
from minivllm.sampling import MAX_LOGPROBS

FIXTURE = os.path.join(os.path.dirname(__file__), "..", "fixtures", "tiny-qwen3")
SMALL = ["--device", "cpu", "--max-model-len", "64", "--num-blocks", "16"]


def serve_args(*flags: str) -> Any:
    return _parser().parse_args(["serve", FIXTURE, *flags])


# ---- vLLM's serve flags ----------------------------------------------------------------

def test_prefix_caching_flags_reach_the_engine_options() -> None:
    assert "enable_prefix_caching" not in _engine_options(serve_args())  # the engine's default: on
    assert "enable_prefix_caching" not in _engine_options(serve_args("--enable-prefix-caching"))
    assert _engine_options(serve_args("--no-enable-prefix-caching"))["enable_prefix_caching"] is False
    assert _engine_options(serve_args("--no-enable-prefix-caching", "--enable-prefix-caching")) == {}


def test_speculative_config_reaches_the_engine_options(capsys) -> None:
    spec = '{"method": "ngram", "num_speculative_tokens": 3}'
    assert _engine_options(serve_args("--speculative-config", spec))["speculative_config"] == {
        "method": "ngram", "num_speculative_tokens": 3}
    for bad, words in (("{", "not JSON"), ("[1]", "JSON object")):
        with pytest.raises(ValueError, match=words):
            _engine_options(serve_args("--speculative-config", bad))
    assert cli_main(["generate", "--model", FIXTURE, *SMALL, "--speculative-config", '{"method": "x"}', "1"]) == 2
    assert "speculative_config.method" in capsys.readouterr().err


@pytest.mark.parametrize("flags, warned", [
    (["--max-logprobs", "5"], "--max-logprobs"),
    (["--generation-config", "auto"], "--generation-config"),
    (["--generation-config", "vllm"], "--generation-config"),
    (["--tokenizer", "Qwen/Qwen3-0.6B"], "--tokenizer"),
    (["--trust-remote-code"], "--trust-remote-code"),
    (["--disable-log-requests"], "--disable-log-requests"),
    # Honoured as they are: no warning.
    ([], None),
    (["--max-logprobs", str(MAX_LOGPROBS)], None),
    (["--tokenizer", FIXTURE], None),
    (["--enable-auto-tool-choice", "--tool-call-parser", "hermes"], None),
    (["--uvicorn-log-level", "debug", "--enable-prefix-caching"], None),
])
def test_a_flag_without_effect_logs_one_warning_naming_it(flags: list[str], warned: str | None,
                                                          caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING):
        _check_vllm_flags(serve_args(*flags))
    messages = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    if warned is None:
        assert messages == []
    else:
        assert len(messages) == 1 and messages[0].startswith(warned + " has no effect here"), messages


def test_every_ineffective_flag_at_once_warns_once_each(caplog: pytest.LogCaptureFixture) -> None:
    flags = ["--max-logprobs", "5", "--generation-config", "auto", "--tokenizer", "other",
             "--trust-remote-code", "--disable-log-requests"]
    with caplog.at_level(logging.WARNING):
        _check_vllm_flags(serve_args(*flags))
    named = sorted(r.getMessage().split()[0] for r in caplog.records)
    assert named == sorted(f for f in flags if f.startswith("--"))


def test_auto_tool_choice_without_a_parser_is_refused_as_vllm_does(capsys) -> None:
    with pytest.raises(ValueError, match="--enable-auto-tool-choice requires --tool-call-parser"):
        _check_vllm_flags(serve_args("--enable-auto-tool-choice"))
    assert cli_main(["serve", FIXTURE, "--enable-auto-tool-choice"]) == 2  # before any model loads
    assert "--enable-auto-tool-choice requires --tool-call-parser" in capsys.readouterr().err


def test_serve_wires_log_level_prefix_caching_and_the_metrics_model_name(monkeypatch) -> None:
    """Through ``main``, up to uvicorn: ``serve`` (replaced here) gets the app and the level."""
    pytest.importorskip("fastapi")
    from prometheus_client.parser import text_string_to_metric_families

    import minivllm.server.app as app_module

    seen: dict[str, Any] = {}

    def fake_serve(app: Any, host: str, port: int, log_level: str = "info") -> int:
        server = app.state.server
        seen.update(log_level=log_level, model_name=server.model_name,
                    caching=server.llm.engine.cache_config.enable_prefix_caching,
                    metrics=server.metrics.exposition().decode())
        return 0

    monkeypatch.setattr(app_module, "serve", fake_serve)
    assert cli_main(["serve", FIXTURE, *SMALL, "--no-engine-process", "--served-model-name", "served/x",
                     "--uvicorn-log-level", "warning", "--no-enable-prefix-caching",
                     "--enable-auto-tool-choice", "--tool-call-parser", "hermes"]) == 0
    assert (seen["log_level"], seen["model_name"], seen["caching"]) == ("warning", "served/x", False)
    labels = {s.labels.get("model_name") for family in text_string_to_metric_families(seen["metrics"])
              for s in family.samples if s.name.startswith("vllm:")}
    assert labels == {"served/x"}


# ---- chat's threads --------------------------------------------------------------------

@pytest.fixture
def torch_threads() -> Any:
    """torch, with its thread count put back after the test."""
    torch = pytest.importorskip("torch")
    before = torch.get_num_threads()
    yield torch
    torch.set_num_threads(before)


def chat_once(monkeypatch, capsys) -> str:
    monkeypatch.setattr(sys, "stdin", io.StringIO("12+34=\n"))
    assert cli_main(["chat", FIXTURE, *SMALL, "--max-tokens", "4"]) == 0
    return capsys.readouterr().out


def test_chat_sizes_torch_threads_as_the_engine_process(torch_threads, monkeypatch, capsys) -> None:
    from minivllm.server.engine_process import _usable_cpus, engine_num_threads

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    default = len(_usable_cpus()) + 1  # more than sizing ever gives
    torch_threads.set_num_threads(default)
    assert chat_once(monkeypatch, capsys) == "46\n"
    assert torch_threads.get_num_threads() == engine_num_threads(_usable_cpus(), default)


def test_chat_keeps_the_threads_omp_num_threads_chose(torch_threads, monkeypatch, capsys) -> None:
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    torch_threads.set_num_threads(3)
    assert chat_once(monkeypatch, capsys) == "46\n"
    assert torch_threads.get_num_threads() == 3


def test_chat_needs_no_serve_extra() -> None:
    """The chat command imports the engine process's thread sizing: that module must not
    import the server's dependencies."""
    code = ("import sys\n"
            "for m in ('prometheus_client', 'fastapi', 'uvicorn', 'pydantic', 'httpx'): sys.modules[m] = None\n"
            "from minivllm.server.engine_process import size_torch_threads\n")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_chat_template_is_a_file_or_the_templates_text(tmp_path) -> None:
    from minivllm.__main__ import _chat_template
    path = tmp_path / "t.jinja"
    path.write_text("{{ messages[0].content }}")
    assert _chat_template(str(path)) == "{{ messages[0].content }}"
    assert _chat_template("{% for m in messages %}{{ m.content }}{% endfor %}").startswith("{% for")
    assert _chat_template(None) is None
    with pytest.raises(ValueError, match="no file"):
        _chat_template(str(tmp_path / "missing.jinja"))

"""One precedence for the serve commands' settings: a flag given > $SPECSPLIT_<FLAG> > the default."""

from __future__ import annotations

import pytest

from specsplit.cli import build_parser, main
from specsplit.options import resolve_env

SERVE = {"target": ["target", "serve"], "drafter": ["drafter", "serve"]}


def parse(monkeypatch, argv: list[str], **env):
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    args = build_parser().parse_args(argv)
    resolve_env(args)
    return args


def test_a_flag_beats_its_variable_which_beats_the_default(monkeypatch):
    base = SERVE["target"] + ["--listen", "unix:/x"]
    assert parse(monkeypatch, base).max_batch == 16
    assert parse(monkeypatch, base, SPECSPLIT_MAX_BATCH="7").max_batch == 7
    assert parse(monkeypatch, base + ["--max-batch", "3"], SPECSPLIT_MAX_BATCH="7").max_batch == 3


@pytest.mark.parametrize("command", list(SERVE))
def test_every_option_of_a_serve_command_reads_its_variable(monkeypatch, command):
    args = parse(monkeypatch, SERVE[command], SPECSPLIT_LISTEN="unix:/a, 127.0.0.1:5", SPECSPLIT_LOG_FORMAT="json",
                 SPECSPLIT_METRICS_PORT="9090", SPECSPLIT_METRICS_HOST="0.0.0.0", SPECSPLIT_DRAIN_SECONDS="2.5",
                 SPECSPLIT_DTYPE="bfloat16")
    assert args.listen == ["unix:/a", "127.0.0.1:5"]  # --listen is required: the variable satisfies it
    assert (args.log_format, args.metrics_port, args.metrics_host) == ("json", 9090, "0.0.0.0")
    assert (args.drain_seconds, args.dtype) == (2.5, "bfloat16")


def test_a_repeatable_flag_replaces_the_variables_list_instead_of_extending_it(monkeypatch):
    args = parse(monkeypatch, SERVE["drafter"] + ["--listen", "unix:/mine", "--listen", "unix:/also"],
                 SPECSPLIT_LISTEN="unix:/from-env")
    assert args.listen == ["unix:/mine", "unix:/also"]


@pytest.mark.parametrize("word, expected", [("0", False), ("off", False), ("No", False), ("true", True), ("1", True)])
def test_a_switch_reads_yes_and_no(monkeypatch, word, expected):
    args = parse(monkeypatch, SERVE["target"] + ["--listen", "unix:/x"], SPECSPLIT_CUDA_GRAPHS=word)
    assert args.cuda_graphs is expected
    assert parse(monkeypatch, SERVE["target"] + ["--listen", "unix:/x", "--cuda-graphs"]).cuda_graphs is True


@pytest.mark.parametrize("variable, value, message", [
    ("SPECSPLIT_MAX_BATCH", "lots", "$SPECSPLIT_MAX_BATCH='lots': not a valid int (for --max-batch)"),
    ("SPECSPLIT_LOG_FORMAT", "xml", "$SPECSPLIT_LOG_FORMAT='xml': expected one of text, json"),
    ("SPECSPLIT_CUDA_GRAPHS", "maybe", "$SPECSPLIT_CUDA_GRAPHS='maybe': expected one of"),
])
def test_a_bad_variable_is_a_clear_error_naming_it(monkeypatch, capsys, variable, value, message):
    monkeypatch.setenv(variable, value)
    assert main(SERVE["target"] + ["--listen", "unix:/x"]) == 2  # refused before anything starts
    assert message in capsys.readouterr().err


def test_help_shows_a_default_taken_from_the_environment(monkeypatch):
    monkeypatch.setenv("SPECSPLIT_KV_BLOCKS", "512")
    parser = build_parser()
    serve = parser._subparsers._group_actions[0].choices["target"]._subparsers._group_actions[0].choices["serve"]
    text = " ".join(serve.format_help().split())
    assert "(default: 512 from $SPECSPLIT_KV_BLOCKS)" in text and "$SPECSPLIT_NAME_OF_OPTION" in text


def test_other_commands_ignore_the_variables(monkeypatch):
    monkeypatch.setenv("SPECSPLIT_MAX_TOKENS", "5")
    args = build_parser().parse_args(["generate", "--local", "--prompt", "x"])
    assert args.max_tokens == 64

"""The command line explains itself: defaults in every help text, help for a bare command, refused flags, clean text."""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import subprocess
import sys

import pytest

from specsplit.cli import build_parser, main
from specsplit.pair import ServiceSpec, spawn
from specsplit.shared import logs
from specsplit.shared.tokenizer import TextStream, Tokenizer

# Flags (store_true) and required options have no default to show; one of --local/--server is required.
NO_DEFAULT = {"--server"}

BLOCK_PYTEST = """
import sys

class NoPytest:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("pytest", "_pytest"):
            raise ModuleNotFoundError(f"No module named {name!r} (blocked)", name=name)
        return None

sys.meta_path.insert(0, NoPytest())
"""


def run_python(code: str, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, **kw)


def test_entry_points_import_without_pytest():
    ok = run_python(BLOCK_PYTEST + "import specsplit.pair, specsplit.cli, specsplit.demo\n"
                    "specsplit.cli.build_parser()\n")
    assert ok.returncode == 0, ok.stderr
    blocked = run_python(BLOCK_PYTEST + "import specsplit.harness\n")  # the blocker does block
    assert blocked.returncode != 0 and "No module named 'pytest'" in blocked.stderr


def all_parsers(parser: argparse.ArgumentParser, name: str = "specsplit"):
    yield name, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub_name, sub in action.choices.items():
                yield from all_parsers(sub, f"{name} {sub_name}")


def option_entries(help_text: str) -> dict[str, str]:
    """Each option's entry in a help text, its wrapped lines joined: {"--max-tokens": "... (default: 64)"}."""
    entries: dict[str, str] = {}
    current = None
    for line in help_text.splitlines():
        match = re.match(r"^  (--?[\w-]+)", line)
        if match:
            current = match.group(1)
            entries[current] = line
        elif current and line.startswith("    "):
            entries[current] += " " + line.strip()
        else:
            current = None
    return {flag: " ".join(text.split()) for flag, text in entries.items()}


def test_every_option_of_every_command_shows_its_default():
    checked = 0
    for name, parser in all_parsers(build_parser()):
        entries = option_entries(parser.format_help())
        for action in parser._actions:
            flag = action.option_strings[0] if action.option_strings else None
            if flag is None or action.nargs == 0 or action.required or flag in NO_DEFAULT:
                continue
            assert "(default" in entries[flag], f"{name} {flag}: {entries[flag]}"
            checked += 1
    assert checked > 60


@pytest.mark.parametrize("command, flag, unit", [
    ("target serve", "--drafter-timeout", "seconds"), ("target serve", "--drain-seconds", "seconds"),
    ("drafter serve", "--drain-seconds", "seconds"), ("target serve", "--kv-blocks", "blocks of 16 tokens"),
    ("target serve", "--max-batch", "sequences"), ("target serve", "--num-drafts", "draft tokens"),
    ("target serve", "--device", "cuda:N"), ("demo", "--seed", "(default: 0)"),
    ("init-drafter", "--block-size", "(default: 16)"), ("train-drafter", "--pool-gb", "GiB"),
])
def test_help_names_units(command, flag, unit):
    parser = dict(all_parsers(build_parser()))[f"specsplit {command}"]
    assert unit in option_entries(parser.format_help())[flag]


def test_top_level_help_says_what_it_does_and_documents_the_cache():
    text = build_parser().format_help()
    assert "speculative decoding" in text and "specsplit demo" in text
    assert "SPECSPLIT_CACHE" in text and "~/.cache/specsplit" in text


def test_version(capsys):
    from importlib.metadata import version

    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0
    assert capsys.readouterr().out.strip() == f"specsplit {version('specsplit')}"


@pytest.mark.parametrize("argv, usage", [(["drafter"], "usage: specsplit drafter"),
                                         (["target"], "usage: specsplit target"), ([], "usage: specsplit")])
def test_a_command_without_its_subcommand_prints_its_help(argv, usage, capsys):
    assert main(argv) == 2
    out, err = capsys.readouterr()
    assert out.startswith(usage) and "serve" in out and "required" not in out + err


@pytest.mark.parametrize("flag, value", [("--target", "default"), ("--drafter", "dflash"), ("--device", "cpu"),
                                         ("--dtype", "float32"), ("--dev", "cuda"), ("--draft-tree", "15")])
def test_generate_server_refuses_what_the_server_chose(flag, value, capsys):
    argv = ["generate", "--server", "unix:/nonexistent/target.sock", "--prompt", "Hi", flag, value]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "cannot be used with --server" in err and "the target service chose" in err
    assert (flag if flag != "--dev" else "--device") in err


@pytest.mark.parametrize("extra", [["--drafter", "mtp"], ["--drafter", "none"],
                                   ["--drafter", "dflash", "--no-speculation"],
                                   ["--drafter", "dflash", "--temperature", "0.7"],
                                   ["--drafter", "dflash", "--draft-tree", "64"]])
def test_generate_local_refuses_draft_trees_it_cannot_verify(extra, capsys):
    assert main(["generate", "--local", "--prompt", "Hi", "--draft-tree", "15", *extra]) == 2
    err = capsys.readouterr().err
    assert "--draft-tree verifies" in err or "draft_tree" in err


@pytest.mark.parametrize("extra, nodes", [(["--drafter", "dflash", "--device", "cuda"], 15),
                                          (["--drafter", "dflash", "--device", "cuda:1", "--draft-tree", "7"], 7),
                                          (["--drafter", "dflash"], 0),
                                          (["--drafter", "mtp", "--device", "cuda"], 0),
                                          (["--drafter", "dflash", "--device", "cuda", "--no-speculation"], 0),
                                          (["--drafter", "dflash", "--device", "cuda", "--temperature", "0.5"], 0),
                                          (["--drafter", "dflash", "--device", "cuda", "--draft-tree", "0"], 0)])
def test_generate_local_draft_trees_by_default_where_they_pay(extra, nodes, monkeypatch):
    """`--draft-tree auto` (the default): trees of 15 nodes for greedy DFlash decoding on a GPU, chains elsewhere."""
    import specsplit.local

    seen = []

    def load_local(setup, config):
        seen.append(config.draft_tree)
        raise SystemExit(0)

    monkeypatch.setattr(specsplit.local, "load_local", load_local)
    with pytest.raises(SystemExit):
        main(["generate", "--local", "--prompt", "Hi", *extra])
    assert seen == [nodes]


DRAFTER = ("--drafter", "unix:/nonexistent/d.sock")


@pytest.mark.parametrize("extra, want", [(DRAFTER, (0, 8, None)),
                                         ((*DRAFTER, "--draft-tree", "15"), (15, 8, 8)),
                                         ((*DRAFTER, "--draft-tree", "15", "--draft-tree-batch", "2"), (15, 8, 2)),
                                         ((*DRAFTER, "--draft-tree", "15", "--max-batch", "2"), (15, 8, 2)),
                                         ((*DRAFTER, "--device", "cuda"), (15, 8, 8)),
                                         ((*DRAFTER, "--device", "cuda:1", "--draft-tree-batch", "2"), (15, 8, 2)),
                                         ((*DRAFTER, "--device", "cuda", "--draft-tree", "0"), (0, 8, None)),
                                         ((*DRAFTER, "--device", "cuda", "--num-drafts", "7"), (0, 8, None)),
                                         ((*DRAFTER, "--device", "cuda", "--num-drafts", "auto"), (0, 8, None)),
                                         ((*DRAFTER, "--device", "cuda", "--drafts-by-batch", "8:7"), (0, 8, None)),
                                         ((*DRAFTER, "--device", "cuda", "--drafts-by-batch", "2:7,4:0"), (0, 8, None)),
                                         # (speculation off from 9 sequences on, as `specsplit up` gives on a GPU)
                                         ((*DRAFTER, "--device", "cuda", "--drafts-by-batch", "9:0"), (15, 8, 8)),
                                         ((*DRAFTER, "--device", "cuda", "--drafts-by-batch", "4:0"), (15, 8, 8)),
                                         (("--device", "cuda"), (0, 8, None)),
                                         ((*DRAFTER, "--draft-tree", "31", "--trees-by-batch", "2:15,3:0"),
                                          (31, 8, 8, ((2, 15), (3, 0)))),
                                         ((*DRAFTER, "--draft-tree", "0", "--trees-by-batch", "2:15"), (0, 8, None))])
def test_target_serve_passes_its_draft_tree_options_to_the_engine(extra, want, monkeypatch):
    """`target serve --draft-tree N|auto [--draft-tree-batch B] [--trees-by-batch N:M]`: the engine's trees (B at
    most --max-batch; M nodes from N sequences on), of the 8 candidates a row the drafter serves. auto (the
    default): trees of 15 nodes on a GPU with a drafter at its own draft length (where it drafts at all); chains on
    the CPU, at a draft length given or learned, or with no drafter."""
    engine = target_serve_settings(extra, monkeypatch).engine
    assert (engine.draft_tree, engine.draft_tree_keep, engine.draft_tree_batch) \
        + ((engine.trees_by_batch,) if engine.trees_by_batch else ()) == want


@pytest.mark.parametrize("extra, want", [((), True), (("--tree-regroup",), True), (("--no-tree-regroup",), False)])
def test_target_serve_passes_tree_regroup_to_the_engine(extra, want, monkeypatch):
    """`target serve --[no-]tree-regroup`: whether a tree step whose batch changed takes candidates sent ahead
    (EngineConfig.tree_regroup; on by default)."""
    settings = target_serve_settings((*DRAFTER, "--draft-tree", "15", "--trees-ahead", *extra), monkeypatch)
    assert settings.engine.tree_regroup is want and settings.trees_ahead


@pytest.mark.parametrize("extra, want", [((), False), (("--stream-attach",), True), (("--no-stream-attach",), False)])
def test_target_serve_passes_stream_attach_to_the_engine(extra, want, monkeypatch):
    """`target serve --[no-]stream-attach`: whether a request's attach rides the next Step (EngineConfig.stream_attach;
    off by default)."""
    settings = target_serve_settings((*DRAFTER, "--draft-tree", "15", "--trees-ahead", *extra), monkeypatch)
    assert settings.engine.stream_attach is want


def test_target_serve_warns_of_tree_regroup_that_changes_nothing(monkeypatch, caplog):
    """--tree-regroup without --trees-ahead (or without trees) has no candidates sent ahead to take: it says so
    when asked for, not when it is only the default."""
    with caplog.at_level(logging.WARNING):
        target_serve_settings((*DRAFTER, "--draft-tree", "15", "--tree-regroup"), monkeypatch)
    assert "changes nothing" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        settings = target_serve_settings((*DRAFTER, "--draft-tree", "15"), monkeypatch)
    assert "changes nothing" not in caplog.text and settings.engine.tree_regroup
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        target_serve_settings((*DRAFTER, "--draft-tree", "15", "--trees-ahead", "--tree-regroup"), monkeypatch)
    assert "changes nothing" not in caplog.text


def target_serve_settings(extra, monkeypatch):
    """The TargetSettings `target serve --listen ... *extra` starts its target with (nothing started)."""
    import specsplit.services

    monkeypatch.setattr(logs, "configure", lambda *args, **kwargs: None)  # (the root logger outlives the test)
    seen = []

    def start_target(settings):
        seen.append(settings)
        raise SystemExit(0)

    monkeypatch.setattr(specsplit.services, "start_target", start_target)
    with pytest.raises(SystemExit):
        main(["target", "serve", "--listen", "unix:/nonexistent/t.sock", *extra])
    assert len(seen) == 1
    return seen[0]


@pytest.mark.parametrize("extra, want", [((), False), (("--device", "cuda"), True), (("--device", "cuda:1"), True),
                                         (("--device", "cuda", "--no-engine-process"), False),
                                         (("--engine-process",), True)])
def test_target_serve_runs_its_engine_in_a_process_of_its_own_on_a_gpu(extra, want, monkeypatch):
    """`target serve --[no-]engine-process`: by default on with a CUDA device, off on the CPU."""
    assert target_serve_settings(extra, monkeypatch).engine_process is want


def test_drafter_serve_passes_chain_capture_after_to_its_settings(monkeypatch):
    """`drafter serve --chain-capture-after N` (default 8, the session's CHAIN_CAPTURE_AFTER)."""
    import specsplit.services
    from specsplit.drafter_service.session import CHAIN_CAPTURE_AFTER

    monkeypatch.setattr(logs, "configure", lambda *args, **kwargs: None)  # (the root logger outlives the test)
    seen = []

    def start_drafter(settings):
        seen.append(settings.chain_capture_after)
        raise SystemExit(0)

    monkeypatch.setattr(specsplit.services, "start_drafter", start_drafter)
    for extra in ((), ("--chain-capture-after", "2")):
        with pytest.raises(SystemExit):
            main(["drafter", "serve", "--listen", "unix:/nonexistent/d.sock", "--device", "cpu", *extra])
    assert seen == [CHAIN_CAPTURE_AFTER, 2] and CHAIN_CAPTURE_AFTER == 8


@pytest.mark.parametrize("extra, says", [(("--draft-tree", "64"), "draft_tree"),
                                         (("--draft-tree", "15", "--draft-tree-batch", "0"), "draft_tree_batch"),
                                         (("--draft-tree", "15", "--trees-by-batch", "2:64"), "trees_by_batch"),
                                         (("--draft-tree", "15", "--trees-by-batch", "0:7"), "N:K with N >= 1"),
                                         (("--draft-tree", "15", "--trees-by-batch", "2"), "K >= 0 nodes")])
def test_target_serve_refuses_draft_trees_it_cannot_build(extra, says, capsys, monkeypatch):
    monkeypatch.setattr(logs, "configure", lambda *args, **kwargs: None)  # (the root logger outlives the test)
    try:
        rc = main(["target", "serve", "--listen", "unix:/nonexistent/t.sock", *extra])
    except SystemExit as exit:  # (argparse's own refusals)
        rc = exit.code
    assert rc == 2
    assert says in capsys.readouterr().err


def test_draft_tree_takes_a_number_or_auto(capsys):
    with pytest.raises(SystemExit):
        main(["generate", "--local", "--prompt", "Hi", "--draft-tree", "many"])
    assert "is not a number of nodes or auto" in capsys.readouterr().err


@pytest.mark.slow
def test_generate_local_with_draft_trees_is_the_targets_output_in_fewer_steps(capsys):
    argv = ["--local", "--drafter", "dflash", "--max-tokens", "24", "--ignore-eos"]
    chains = generate_json(argv, capsys)
    trees = generate_json([*argv, "--draft-tree", "15"], capsys)
    alone = generate_json(["--local", "--max-tokens", "24", "--ignore-eos"], capsys)
    assert trees["token_ids"] == chains["token_ids"] == alone["token_ids"]
    assert trees["stats"]["steps"] < chains["stats"]["steps"]


def test_draft_lengths_are_parsed_and_bad_values_are_refused(capsys):
    from specsplit.cli import build_parser

    args = build_parser().parse_args(["target", "serve", "--listen", "unix:/x", "--drafts-by-batch", "8:7, 32:3"])
    assert args.drafts_by_batch == ((8, 7), (32, 3))
    for bad in ("8", "0:3", "8:-1", "a:b", "8:7,32"):
        with pytest.raises(SystemExit):
            build_parser().parse_args(["target", "serve", "--listen", "unix:/x", "--drafts-by-batch", bad])
        assert "is not N:K" in capsys.readouterr().err
    serve = ["target", "serve", "--listen", "unix:/x", "--num-drafts"]
    assert build_parser().parse_args(serve + ["auto"]).num_drafts == "auto"
    assert build_parser().parse_args(serve + ["3"]).num_drafts == 3
    for bad in ("-1", "many"):
        with pytest.raises(SystemExit):
            build_parser().parse_args(serve + [bad])
        assert "nor 'auto'" in capsys.readouterr().err


def test_sampled_continuations_by_kind_are_parsed_and_bad_values_are_refused(capsys):
    from specsplit.cli import build_parser

    train = ["train-drafter", "--kind", "dflash", "--out", "/tmp/x", "--sampled-by-kind"]
    assert build_parser().parse_args(train + ["chat=1, code=0.25"]).sampled_by_kind == (("chat", 1.0), ("code", 0.25))
    for bad in ("chat", "chat=", "=1", "chat=many", "chat=nan", "code=inf"):
        with pytest.raises(SystemExit):
            build_parser().parse_args(train + [bad])
        assert "is not KIND=N" in capsys.readouterr().err
    # a kind that does not exist, or a count out of range: the command's own error (exit 2 through main)
    assert main(train + ["poetry=1"]) == 2
    assert "sampled_by_kind names each of chat, code, math" in capsys.readouterr().err
    assert main(train + ["chat=1", "--refine", "1"]) == 2  # a refining pass is scored by the held-out eval
    assert "give --eval-tokens too" in capsys.readouterr().err


@pytest.mark.parametrize("native", [True, False])
def test_output_stream_leaves_special_tokens_out_of_the_text(smollm2_dir, native):
    tokenizer = Tokenizer.from_dir(smollm2_dir)
    ids = tokenizer.encode("Hi <|im_end|>\n<|im_start|>assistant\nÜnïcödé 🤖 done<|im_end|>")
    stream = TextStream(tokenizer, skip_special_tokens=True, native=native)
    text = "".join(stream.push(i) for i in ids) + stream.flush()
    assert text == tokenizer.decode(ids, skip_special_tokens=True) == "Hi \nassistant\nÜnïcödé 🤖 done"
    assert tokenizer.output_stream().skip_special_tokens


def generate_json(argv: list[str], capsys) -> dict:
    assert main(["generate", "--chat", "--prompt", "Say hello.", "--max-tokens", "48", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


@pytest.mark.slow
def test_generated_text_has_no_special_tokens_but_token_ids_keep_them(smollm2_dir, tmp_path, capsys):
    tokenizer = Tokenizer.from_dir(smollm2_dir)
    local = generate_json(["--local"], capsys)
    with spawn(ServiceSpec(drafter="none"), tmp_path) as services:
        remote = generate_json(["--server", services.target_address], capsys)
    for result in (local, remote):
        assert result["token_ids"][-1] in tokenizer.eos_token_ids  # the model ended its turn
        assert result["text"] == tokenizer.decode(result["token_ids"], skip_special_tokens=True)
        assert "<|" not in result["text"] and result["text"]
    assert local["token_ids"] == remote["token_ids"]


@pytest.mark.slow
def test_first_conversion_reports_progress_on_stderr(tmp_path):
    env = dict(os.environ, SPECSPLIT_CACHE=str(tmp_path))
    done = subprocess.run([sys.executable, "-m", "specsplit", "convert-default"], capture_output=True, text=True,
                          env=env, timeout=600)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == str(tmp_path / "smollm2-135m-instruct")
    assert "converting" in done.stderr and "converted in" in done.stderr
    counts = re.findall(r"tensors dequantized (\d+)/(\d+)", done.stderr)
    assert 5 <= len(counts) <= 12 and counts[-1][0] == counts[-1][1]

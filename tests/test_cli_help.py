"""`trainguard --help`, `--version` and every subcommand's help: what a new user reads first."""

from __future__ import annotations

import argparse
from importlib.metadata import version

import pytest

from trainguard.cli import build_parser


def _subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


def test_version_is_the_installed_package_version(capsys):
    with pytest.raises(SystemExit) as done:
        build_parser().parse_args(["--version"])
    assert done.value.code == 0
    assert capsys.readouterr().out.strip() == f"trainguard {version('trainguard')}"


def test_the_top_level_help_is_whole_sentences_and_lists_every_command():
    parser = build_parser()
    text = parser.format_help()
    assert parser.description.rstrip().endswith(".") and "trainguard demo" in text
    for name in _subcommands(parser):
        assert name in text


@pytest.mark.parametrize("name", sorted(_subcommands(build_parser())))
def test_every_subcommand_says_what_it_does_and_every_option_has_help(name):
    sub = _subcommands(build_parser())[name]
    assert sub.description and sub.description.rstrip().endswith("."), f"{name}: no description"
    undocumented = [a.dest for a in sub._actions
                    if a.dest not in ("help", "rest") and not (a.help and a.help.strip())]
    assert not undocumented, f"trainguard {name}: options without help: {undocumented}"


def test_the_worker_prometheus_and_tail_json_flags_parse():
    args = build_parser().parse_args(["worker", "--prometheus-port", "9464", "--prometheus-addr", "0.0.0.0"])
    assert (args.prometheus_port, args.prometheus_addr) == (9464, "0.0.0.0")
    assert build_parser().parse_args(["tail", "--json"]).json is True

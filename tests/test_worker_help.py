"""``draftfleet worker KIND --help`` shows that kind's own options, and every ``draftfleet worker``
line the repo shows a user still parses."""

from __future__ import annotations

import contextlib
import io
import re

import pytest

from draftfleet.cli import build_parser

from .conftest import REPO, parse_cli
from .test_ops_docs import shell_commands

OWN = {
    "gpu": {"--engine", "--url", "--gpu", "--inflight", "--dataset", "--name"},
    "cloud": {"--backend", "--concurrency", "--dataset", "--name"},
    "capture": {"--url", "--gpu", "--inflight", "--dataset", "--name"},
    "reconciler": {"--interval", "--metrics-port", "--metrics-address"},
}
EVERY = set().union(*OWN.values())


def help_text(*argv: str) -> str:
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf), pytest.raises(SystemExit):
        build_parser().parse_args([*argv, "--help"])
    return buf.getvalue()


@pytest.mark.parametrize("kind", sorted(OWN))
def test_each_kind_has_its_own_help(kind):
    text = help_text("worker", kind)
    shown = set(re.findall(r"(?<![\w-])--[a-z][a-z-]+", text))
    assert OWN[kind] <= shown, OWN[kind] - shown
    assert not (EVERY - OWN[kind]) & shown, (EVERY - OWN[kind]) & shown
    assert {"--config", "--redis-url", "--store", "--loglevel"} <= shown


def test_worker_help_lists_the_kinds():
    text = help_text("worker")
    for kind in OWN:
        assert kind in text
    assert "worker KIND --help" in text


def test_an_option_of_another_kind_is_refused():
    with contextlib.redirect_stderr(io.StringIO()) as err, pytest.raises(SystemExit):
        build_parser().parse_args(["worker", "cloud", "--gpu", "0"])
    assert "unrecognized arguments: --gpu 0" in err.getvalue()


def test_every_worker_line_of_the_readme_parses():
    commands = [c for c in shell_commands((REPO / "README.md").read_text()) if c[:2] == ["draftfleet", "worker"]]
    assert len(commands) >= 6
    for command in commands:
        args = parse_cli(command)
        assert args.kind == command[2]

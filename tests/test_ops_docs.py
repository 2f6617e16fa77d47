"""The runbooks in ops/ name only commands that exist: every ``draftfleet`` line in their shell
blocks parses with the real CLI parser, every ``docker compose`` line names real services.
"""

from __future__ import annotations

import re
import shlex

import pytest
import yaml

from .conftest import REPO, parse_cli

DOCS = sorted((REPO / "ops").glob("*.md"))
BLOCK = re.compile(r"^[ \t]*```(?:bash|sh|shell|console)\n(.*?)^[ \t]*```", re.M | re.S)
ENV_ASSIGNMENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")


def shell_commands(text: str) -> list[list[str]]:
    """Each command line of the shell blocks, split like a shell would, leading VAR=value dropped."""
    commands = []
    for block in BLOCK.findall(text):
        for line in block.replace("\\\n", " ").splitlines():
            words = shlex.split(line, comments=True)
            while words and ENV_ASSIGNMENT.match(words[0]):
                words.pop(0)
            if words:
                commands.append(words)
    return commands


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_every_draftfleet_command_exists(doc):
    commands = [c for c in shell_commands(doc.read_text()) if c[0] == "draftfleet"]
    assert commands, f"{doc.name} shows no draftfleet command"
    for command in commands:
        parse_cli(command)


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_every_compose_service_exists(doc):
    services = set(yaml.safe_load((REPO / "compose.yaml").read_text())["services"])
    for command in shell_commands(doc.read_text()):
        if command[:2] != ["docker", "compose"]:
            continue
        named = [w for w in command[3:] if not w.startswith("-") and "=" not in w]
        scaled = [w.split("=")[0] for w in command if re.fullmatch(r"[a-z0-9-]+=\d+", w)]
        assert set(named) | set(scaled) <= services, f"{doc.name}: {' '.join(command)}"


def test_scaling_doc_covers_the_commands_it_promises():
    commands = [" ".join(c) for c in shell_commands((REPO / "ops" / "scaling.md").read_text())]
    for expected in ("draftfleet worker gpu --gpu 0", "draftfleet worker gpu --url", "draftfleet worker cloud",
                     "draftfleet flower", "draftfleet status", "draftfleet worker reconciler"):
        assert any(c.startswith(expected) for c in commands), expected

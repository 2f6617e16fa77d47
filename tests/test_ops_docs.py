"""The runbooks in ops/ name only commands that exist: every ``draftfleet`` line in their shell
blocks parses with the real CLI parser, every ``docker compose`` line names real services.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
import yaml

from .conftest import REPO, parse_cli

DOCS = sorted((REPO / "ops").glob("*.md"))
BLOCK = re.compile(r"^[ \t]*```(?:bash|sh|shell|console)\n(.*?)^[ \t]*```", re.M | re.S)
ENV_ASSIGNMENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")
REDIRECT = re.compile(r"^\d?>")


def shell_commands(text: str) -> list[list[str]]:
    """Each command line of the shell blocks, split like a shell would, leading VAR=value dropped."""
    commands = []
    for block in BLOCK.findall(text):
        for line in block.replace("\\\n", " ").splitlines():
            words = shlex.split(line, comments=True)
            while words and ENV_ASSIGNMENT.match(words[0]):
                words.pop(0)
            # the command ends where a redirection or `&` begins (`... > gpu.log 2>&1 &`)
            ends = [i for i, w in enumerate(words) if w in ("&", "|", "&&", ";") or REDIRECT.match(w)]
            words = words[:ends[0]] if ends else words
            if words:
                commands.append(words)
    return commands


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_every_draftfleet_command_exists(doc):
    commands = [c for c in shell_commands(doc.read_text()) if c[0] == "draftfleet"]
    assert commands, f"{doc.name} shows no draftfleet command"
    for command in commands:
        parse_cli(command)


COMPOSE_GLOBAL_OPTIONS = {"--profile", "-f", "--file", "-p", "--project-name", "--env-file"}  # each takes a value


def compose_invocation(command: list[str]) -> tuple[dict[str, list[str]], list[str]]:
    """``docker compose [global options] SUBCOMMAND ARGS`` as (global options, [SUBCOMMAND, *ARGS])."""
    words, options = command[2:], {}
    while words and words[0] in COMPOSE_GLOBAL_OPTIONS:
        options.setdefault(words[0], []).append(words[1])
        words = words[2:]
    return options, words


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_every_compose_service_exists(doc):
    compose = yaml.safe_load((REPO / "compose.yaml").read_text())
    services = set(compose["services"])
    profiles = {p for svc in compose["services"].values() for p in svc.get("profiles", [])}
    for command in shell_commands(doc.read_text()):
        if command[:2] != ["docker", "compose"]:
            continue
        options, words = compose_invocation(command)
        assert set(options.get("--profile", [])) <= profiles, f"{doc.name}: {' '.join(command)}"
        named = [w for w in words[1:] if not w.startswith("-") and "=" not in w]
        scaled = [w.split("=")[0] for w in command if re.fullmatch(r"[a-z0-9-]+=\d+", w)]
        assert set(named) | set(scaled) <= services, f"{doc.name}: {' '.join(command)}"


def test_scaling_doc_covers_the_commands_it_promises():
    commands = [" ".join(c) for c in shell_commands((REPO / "ops" / "scaling.md").read_text())]
    for expected in ("draftfleet worker gpu --gpu 0", "draftfleet worker gpu --url", "draftfleet worker cloud",
                     "draftfleet flower", "draftfleet status", "draftfleet worker reconciler"):
        assert any(c.startswith(expected) for c in commands), expected


# Pages a user is sent to: the user-facing files, and every mention of ENGINES.md anywhere.
USER_FACING = ["README.md", "RELIABILITY.md", "BENCHMARKS.md", "compose.yaml", "Dockerfile", "ops", "examples"]
PAGE = re.compile(r"(?<![\w/.:-])([\w./-]*[\w-]\.md)\b")


def _texts():
    for name in USER_FACING:
        path = REPO / name
        for p in ([path] if path.is_file() else sorted(q for q in path.rglob("*") if q.is_file())):
            if p.suffix in (".md", ".sh", ".toml", ".yaml", "") or p.name == "Dockerfile":
                yield p
    for p in sorted(REPO.rglob("*.py")):
        if p != Path(__file__) and not {".venv", ".git"} & set(p.relative_to(REPO).parts) and "ENGINES.md" in p.read_text():
            yield p


def test_every_page_a_user_is_sent_to_exists():
    missing = []
    for path in _texts():
        text = path.read_text(errors="replace")
        for page in PAGE.findall(text):
            if path.suffix == ".py" and not page.endswith("ENGINES.md"):
                continue
            if not ((path.parent / page).exists() or (REPO / page).exists()):
                missing.append(f"{path.relative_to(REPO)}: {page}")
    assert not missing, missing
    assert "Facts: ENGINES.md" in (REPO / "ops" / "vllm-cpu-env.sh").read_text()  # the page beside the script
    assert (REPO / "ops" / "ENGINES.md").exists()


def _section(text: str, heading: str) -> str:
    start = text.index(heading)
    end = text.find("\n## ", start + len(heading))
    return text[start:] if end < 0 else text[start:end]


def test_bucket_section_matches_compose_and_cli():
    """ops/scaling.md's bucket section: its commands run, the .env it shows names what compose.yaml
    reads, and the variables it tells users to set reach every fleet service."""
    section = _section((REPO / "ops" / "scaling.md").read_text(), "## 3. Or one store in a bucket")
    commands = shell_commands(section)
    stores = [parse_cli(c).store for c in commands if c[0] == "draftfleet"]
    assert any(s.startswith("s3://") for s in stores), stores
    compose_lines = [" ".join(c) for c in commands if c[:2] == ["docker", "compose"]]
    assert "docker compose --profile s3 up -d" in compose_lines
    compose_text = (REPO / "compose.yaml").read_text()
    (env_block,) = re.findall(r"In `\.env`[^\n]*\n\n```\n(.*?)```", section, re.S)
    names = [line.split("=", 1)[0] for line in env_block.splitlines() if line.strip()]
    assert names and all("${" + n in compose_text for n in names), names
    fleet = yaml.safe_load(compose_text)["services"]["cloud"]["environment"]
    for var in ("AWS_ENDPOINT_URL", "AWS_REGION", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        assert f"`{var}`" in section and var in fleet, var


def test_bucket_section_names_the_real_settings():
    """The section's `[store.s3]` keys are the config's, its extra is pyproject's, and the refusal it
    quotes is the store's own line."""
    import tomllib

    from draftfleet.schemas.config import StoreS3Section

    section = re.sub(r"\s+", " ", _section((REPO / "ops" / "scaling.md").read_text(), "## 3. Or one store in a bucket"))
    named = set(re.findall(r"`\[store\.s3\]` \((`\w+`(?:, `\w+`)*)\)", section)[0].replace("`", "").split(", "))
    named |= set(re.findall(r"`\[store\.s3\] (\w+)`", section))
    assert named == set(StoreS3Section.__struct_fields__), named
    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    (extra,) = re.findall(r"pip install 'draftfleet\[(\w+)\]'", section)
    assert any(d.startswith("boto3") for d in extras[extra]), extras[extra]
    (refusal,) = re.findall(r"\(`(the bucket ignores If-None-Match) \.\.\.`\)", section)
    assert refusal in (REPO / "draftfleet" / "store" / "bucket.py").read_text()

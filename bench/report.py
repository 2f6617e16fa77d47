"""Render benchmark sections as ``BENCHMARKS.md``: the headline table first, then each section."""

from __future__ import annotations

import time
from pathlib import Path

from .env import Figure, Section

NOTES = Path(__file__).with_name("NOTES.md")


def _num(value: float, unit: str) -> str:
    if unit == "s":
        return f"{value:.3g} s" if value < 10 else f"{value:.1f} s"
    if unit == "ms":
        return f"{value:.2f} ms"
    return f"{value:,.0f} {unit}" if value >= 100 else f"{value:.3g} {unit}"


def _ratio(f: Figure) -> str:
    mark = "" if f.met is None else (" ✅" if f.met else " ❌")
    text = f"{f.ratio:,.0f}" if f.ratio >= 100 else f"{f.ratio:#.3g}"
    return f"{text}×{mark}"


def _figure_table(figures: list[Figure], with_bench: bool) -> list[str]:
    head = ["benchmark"] if with_bench else []
    lines = ["| " + " | ".join([*head, "figure", "value", "reference (same run)", "reference value", "ratio", "target"]) + " |",
             "| " + " | ".join(["---"] * (len(head) + 3) + ["---:", "---:", "---"]) + " |"]
    for f in figures:
        cells = [f"[{f.bench}](#{f.bench})"] if with_bench else []
        cells += [f.name, _num(f.value, f.unit), f.reference, _num(f.reference_value, f.unit), _ratio(f), f.target or "–"]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def render(sections: list[Section], machine: dict[str, str], command: str) -> str:
    out = [
        "# Benchmarks",
        "",
        f"Written by `{command}` on {time.strftime('%Y-%m-%d')}, on {machine['cpu']} ({machine['cores']} cores, "
        f"{machine['memory']}), {machine['python']}.",
        "",
        "Absolute times on a shared 2-core machine are noise; ratios hold. Every figure is therefore given beside a "
        "reference measured in the same run on the same machine, and the ratio is what to read: above 1 is better "
        "than the reference (for times, the reference's time over ours). Each section gives the command that reruns it.",
        "",
        "## Headline",
        "",
        *_figure_table([f for s in sections for f in s.figures if f.headline], with_bench=True),
        "",
        "## Machine",
        "",
        *[f"- {k}: {v}" for k, v in machine.items()],
        "",
    ]
    for s in sections:
        out += [
            f'<a id="{s.bench}"></a>',
            f"## {s.title}",
            "",
            f"Command: `{s.command}` ({s.seconds:.0f} s). Machine: {machine['cpu']}, {machine['cores']} cores, {machine['python']}.",
            "",
            *_figure_table(s.figures, with_bench=False),
            "",
            *s.details,
            "",
        ]
    if NOTES.exists():
        out += [NOTES.read_text().rstrip(), ""]
    return "\n".join(out)

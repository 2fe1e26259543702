"""docs/figures/ holds only what the docs name, and stays small (issue 56).

Every file in docs/figures/ must be named, by its exact file name, in README.md or a Markdown file under docs/: a
plot or a small summary a doc cites. Raw dumps are written by the command that makes them (a bench's `--out`) and
are not committed; a doc cites that command instead. The folder stays under 1 MB: a plot regenerated at full size can
be saved with fewer colours (e.g. PIL's `quantize(256)`) without changing what it shows.

A pure file test: it reads the folder and the docs, nothing else.
"""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FIGURES = ROOT / "docs" / "figures"
LIMIT_BYTES = 1_000_000


def _figure_files() -> list[Path]:
    return sorted(p for p in FIGURES.iterdir() if p.is_file())


def _doc_text() -> str:
    docs = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    return "\n".join(p.read_text(encoding="utf-8") for p in docs if p.is_file())


def test_every_figure_is_named_by_a_doc():
    text = _doc_text()
    unnamed = [p.name for p in _figure_files() if p.name not in text]
    assert not unnamed, (
        f"docs/figures/ holds {len(unnamed)} file(s) that no doc names (README.md, docs/**/*.md): {unnamed}. Name each "
        "in the doc that cites it, or delete it (a raw dump: cite the command that writes it instead)"
    )


def test_figures_stay_under_one_megabyte():
    sizes = {p.name: p.stat().st_size for p in _figure_files()}
    total = sum(sizes.values())
    largest = sorted(sizes.items(), key=lambda kv: -kv[1])[:5]
    assert total < LIMIT_BYTES, (
        f"docs/figures/ holds {total:,} bytes, over the {LIMIT_BYTES:,}-byte limit; the largest: {largest}. Delete raw "
        "dumps (cite the command that writes them) or save plots with fewer colours"
    )

"""A head or a format is asked for by its interface, never by name (docs/architecture.md, "Add
a head"): the variant and format predicates appear only inside the head modules
(dflash_lab/heads/) and the format modules (export/formats/)."""

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
#: The predicates that branch on a head, a feature or a format (issue 44's list, plus any
#: comparison of a variant name).
PREDICATE = re.compile(r"is_dspark|is_dflash2|is_muse\(|is_laguna\(|has_draft_vocab|"
                       r"laguna_features|variant\"?\)? ?(==|!=|in \()")
ALLOWED = ("dflash_lab/heads/", "export/formats/")
#: Not yet behind the interface (issue 44 is open): the exporter's files the format registry
#: has still to absorb. This list only shrinks.
PENDING = frozenset()


def predicate_sites() -> dict[str, list[int]]:
    sites: dict[str, list[int]] = {}
    for top in ("dflash_lab", "export"):
        for path in sorted((REPO / top).rglob("*.py")):
            rel = path.relative_to(REPO).as_posix()
            if rel.startswith(ALLOWED):
                continue
            lines = [n for n, line in enumerate(path.read_text().splitlines(), 1)
                     if PREDICATE.search(line.split("#")[0])]
            if lines:
                sites[rel] = lines
    return sites


def test_no_head_or_format_predicate_outside_their_modules():
    sites = {f: lines for f, lines in predicate_sites().items() if f not in PENDING}
    assert not sites, ("branches on a head or a format outside dflash_lab/heads/ and "
                       f"export/formats/ (ask the interface instead): {sites}")


def test_the_pattern_finds_what_it_names():
    for line in ('if config.is_dspark:', 'if settings.get("variant") == "dflash2":',
                 'if cfg.variant in ("a", "b"):', 'x = is_muse(d)', 'config.laguna_features'):
        assert PREDICATE.search(line), line
    assert not PREDICATE.search('head = config.head')

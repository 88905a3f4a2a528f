"""A head or a format is asked for by its interface, never by name (docs/architecture.md, "Add
a head"): the variant and format predicates appear only inside the head modules
(dflash_lab/heads/) and the format modules (export/formats/)."""

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
#: The predicates that branch on a head, a feature or a format (issue 44's list, plus any
#: comparison of a variant name).
PREDICATE = re.compile(r"is_dspark|is_dflash2|is_muse\(|is_laguna\(|has_draft_vocab|"
                       r"laguna_features|variant[\"']?\]?\)? ?(==|!=|in\b)")
ALLOWED = ("dflash_lab/heads/", "export/formats/")


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
    sites = predicate_sites()
    assert not sites, ("branches on a head or a format outside dflash_lab/heads/ and "
                       f"export/formats/ (ask the interface instead): {sites}")


def test_the_pattern_finds_what_it_names():
    for line in ('if config.is_dspark:', 'if settings.get("variant") == "dflash2":',
                 'if cfg.variant in ("a", "b"):', 'if variant in KNOWN:', 'x = is_muse(d)',
                 'config.laguna_features', 'fields["variant"] != name'):
        assert PREDICATE.search(line), line
    assert not PREDICATE.search('head = config.head')

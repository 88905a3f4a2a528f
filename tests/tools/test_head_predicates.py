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
#: A head's own modules, read as a drafter's attribute or named by class: only its head (and its
#: format) may (the core asks the head's hooks: draft, walk_metrics, probe_outputs, ...).
HEAD_MODULE = re.compile(r"\.(candidate_selector|markov_head|confidence_head)\b|"
                         r"GroupedDynamicCausalConv")


def predicate_sites(pattern: re.Pattern = PREDICATE) -> dict[str, list[int]]:
    sites: dict[str, list[int]] = {}
    for top in ("dflash_lab", "export"):
        for path in sorted((REPO / top).rglob("*.py")):
            rel = path.relative_to(REPO).as_posix()
            if rel.startswith(ALLOWED):
                continue
            lines = [n for n, line in enumerate(path.read_text().splitlines(), 1)
                     if pattern.search(line.split("#")[0])]
            if lines:
                sites[rel] = lines
    return sites


def test_no_head_or_format_predicate_outside_their_modules():
    sites = predicate_sites()
    assert not sites, ("branches on a head or a format outside dflash_lab/heads/ and "
                       f"export/formats/ (ask the interface instead): {sites}")


def test_no_head_module_named_outside_its_head():
    sites = predicate_sites(HEAD_MODULE)
    assert not sites, ("a head's modules named outside dflash_lab/heads/ and export/formats/ "
                       f"(ask the head's hooks instead): {sites}")


def test_the_pattern_finds_what_it_names():
    for line in ('if config.is_dspark:', 'if settings.get("variant") == "dflash2":',
                 'if cfg.variant in ("a", "b"):', 'if variant in KNOWN:', 'x = is_muse(d)',
                 'config.laguna_features', 'fields["variant"] != name'):
        assert PREDICATE.search(line), line
    assert not PREDICATE.search('head = config.head')
    for line in ("if drafter.candidate_selector is None:", "drafter.markov_head.walk(",
                 "self.confidence_head = None", "isinstance(m, GroupedDynamicCausalConv)"):
        assert HEAD_MODULE.search(line), line
    assert not HEAD_MODULE.search("confidence_head_alpha: float = 1.0")

"""Which format or variant a drafter is, is asked only inside the format modules (issue 44):
the exporter's core, eval's loader and the warm start call the registry's interface."""

import re

from dflash_lab.paths import REPO_ROOT

FORMAT_MODULES = "export/formats/"
PREDICATES = re.compile(r"is_dspark|is_dflash2|is_muse\(|is_laguna\(|has_draft_vocab|"
                        r"laguna_features|\.variant ==|\.variant !=|\.variant in")
CORE = [*sorted((REPO_ROOT / "export").rglob("*.py")),
        REPO_ROOT / "dflash_lab" / "eval" / "loading.py",
        REPO_ROOT / "dflash_lab" / "train" / "warm_start.py"]


def test_no_format_or_variant_predicate_outside_the_format_modules():
    hits = [f"{path.relative_to(REPO_ROOT)}:{n}: {line.strip()}"
            for path in CORE if not str(path.relative_to(REPO_ROOT)).startswith(FORMAT_MODULES)
            for n, line in enumerate(path.read_text().splitlines(), 1) if PREDICATES.search(line)]
    assert len(CORE) > 20 and not hits, "\n".join(hits)

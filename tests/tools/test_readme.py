"""README.md stays true: every command it names parses and every link and image resolves; every
docs page opens with what it is for and a command, cites no issue number in a heading, links true.

A command is an inline code span or a line of a fenced block that starts with ``make``,
``dflash-*`` or ``python -m``; ``&&`` splits it. ``make`` targets must be Makefile targets;
``dflash-*`` must be console scripts of pyproject.toml, and their arguments must parse the way
the entry point parses them: Hydra entry points compose (every group option and key exists, a
recipe is a file of recipes/), ``dflash-lab run`` goes through the pipeline's own parser and its
recipe and train overrides compose, ``dflash-export`` through its argparse parser. Upper-case
words (``DIR``, ``OUT``) are placeholders: they stay values, and ``recipe=NAME`` composes the demo
recipe in their place. ``python -m MODULE`` must name an importable module.
"""

from __future__ import annotations

import importlib.util
import re
import shlex

import pytest
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra

from dflash_lab.paths import REPO_ROOT

README = REPO_ROOT / "README.md"
CONF_DIR = REPO_ROOT / "conf"
HYDRA_ENTRIES = {"dflash-train": "train", "dflash-capture": "capture", "dflash-eval": "eval",
                 "dflash-regenerate": "regenerate", "dflash-taps": "taps"}
PLACEHOLDER = re.compile(r"^[A-Z][A-Z0-9_]*$")


def readme_commands(text: str) -> list[str]:
    """Every command the README names, in order, without duplicates."""
    spans = re.findall(r"`([^`\n]+)`", re.sub(r"```.*?```", "", text, flags=re.S))
    for block in re.findall(r"```[a-z]*\n(.*?)```", text, flags=re.S):
        spans += [line.split(" #")[0] for line in block.replace("\\\n", " ").splitlines()]
    commands = []
    for span in spans:
        for part in span.split("&&"):
            part = part.strip()
            if re.match(r"(make |dflash-[a-z]+( |$)|python -m )", part) and part not in commands:
                commands.append(part)
    return commands


def makefile_targets() -> set[str]:
    text = (REPO_ROOT / "Makefile").read_text()
    return {m.group(1) for m in re.finditer(r"^([A-Za-z0-9_.-]+)\s*:(?!=)", text, flags=re.M)}


def console_scripts() -> set[str]:
    """The names of pyproject.toml's [project.scripts] (read as text: no tomllib on 3.10)."""
    section = (REPO_ROOT / "pyproject.toml").read_text().split("[project.scripts]", 1)[1]
    return set(re.findall(r'^([\w-]+)\s*=\s*"', section.split("\n[", 1)[0], flags=re.M))


def _compose(config: str, overrides: list[str]) -> None:
    overrides = ["recipe=tiny_cpu" if o.startswith("recipe=") and PLACEHOLDER.match(o[7:]) else o
                 for o in overrides]
    recipe = next((o[7:] for o in overrides if o.startswith("recipe=")), None)
    if recipe and not (REPO_ROOT / "recipes" / f"{recipe}.yaml").is_file():
        pytest.fail(f"README.md names recipe={recipe}, but recipes/{recipe}.yaml does not exist")
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        compose(config_name=config, overrides=overrides)


def check_command(command: str) -> None:
    """Fail naming what in ``command`` does not exist or does not parse."""
    program, *args = shlex.split(command)
    if program == "make":
        missing = [a for a in args if "=" not in a and a not in makefile_targets()]
        assert not missing, f"README.md: make target(s) {missing} not in the Makefile"
    elif program == "python":
        module = args[1]
        assert importlib.util.find_spec(module), f"README.md: python -m {module}: no such module"
    else:
        assert program in console_scripts(), f"README.md: {program} is not in [project.scripts]"
        if program in HYDRA_ENTRIES:
            _compose(HYDRA_ENTRIES[program], args)
        elif program == "dflash-lab" and args:
            from dflash_lab.pipeline import parse_args
            request = parse_args(args)
            _compose("train", [f"recipe={request.recipe}", *request.stage_args["train"]])
        elif program == "dflash-export" and args:
            from dflash_lab.export.cli import build_parser
            build_parser().parse_args(args)  # SystemExit(2) on an unknown option


COMMANDS = readme_commands(README.read_text())


def test_the_readme_names_the_quick_start_commands():
    for command in ("make demo", "make test", "make test-all",
                    "dflash-lab run recipe=smollm2_10min"):
        assert any(command in c for c in COMMANDS), f"README.md lost `{command}`"


@pytest.mark.parametrize("command", COMMANDS)
def test_every_readme_command_parses(command):
    check_command(command)


def test_a_wrong_command_is_caught():
    """The checks can fail: a missing target, script, recipe, key and option each do."""
    for bad in ("make no-such-target", "dflash-nothing x=1", "python -m dflash_lab.no_such",
                "dflash-train no_such_key=1", "dflash-export A B --no-such-option",
                "dflash-train recipe=tiny_cpu data=no_such_option",
                "dflash-lab run recipe=no_such_recipe"):
        with pytest.raises(BaseException) as err:
            check_command(bad)
        assert err.type is not pytest.skip.Exception, bad


def _anchor(heading: str) -> str:
    """GitHub's anchor of a markdown heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_every_readme_link_and_image_resolves():
    text = README.read_text()
    links = re.findall(r"\]\(([^)\s]+)\)", text)
    assert links, "README.md has no links"
    bad = []
    for link in links:
        if link.startswith(("http://", "https://")):
            continue
        path, _, anchor = link.partition("#")
        target = (README.parent / path).resolve()
        if not target.exists():
            bad.append(f"{link}: {target} does not exist")
        elif anchor and anchor not in {_anchor(h) for h in
                                       re.findall(r"^#+ (.+)$", target.read_text(), re.M)}:
            bad.append(f"{link}: no heading with anchor #{anchor} in {path}")
    images = re.findall(r"!\[[^\]]*\]\(([^)\s]+)\)", text)
    assert images, "README.md has no picture"
    bad += [f"{i}: not a PNG" for i in images
            if (README.parent / i).read_bytes()[:8] != b"\x89PNG\r\n\x1a\n"]
    assert not bad, "README.md: " + "; ".join(bad)


def test_the_readme_stays_short():
    lines = README.read_text().count("\n")
    assert lines <= 150, f"README.md has {lines} lines; move detail to the docs/ page that owns it"


DOCS_PAGES = sorted((REPO_ROOT / "docs").rglob("*.md"))


@pytest.mark.parametrize("page", DOCS_PAGES, ids=lambda p: str(p.relative_to(REPO_ROOT)))
def test_every_docs_page_says_what_it_is_for_and_links_true(page):
    """Title + first paragraph name a command (in backticks); no heading cites an issue number
    (say what the section is); every relative link resolves."""
    text = page.read_text()
    title, _, rest = text.partition("\n\n")
    assert title.startswith("# ") and "`" in title + rest.split("\n\n", 1)[0], (
        f"{page}: open with a line saying what the page is for and the one command a reader needs")
    prose = re.sub(r"```.*?```", "", text, flags=re.S)
    headings = re.findall(r"^#+ .*$", prose, flags=re.M)
    cited = [h for h in headings if re.search(r"issue \d", h, re.I)]
    assert not cited, f"{page}: headings cite issue numbers: {cited}"
    broken = [link for link in re.findall(r"\]\(([^)\s#][^)\s]*)\)", prose)
              if not link.startswith(("http://", "https://"))
              and not (page.parent / link.split("#")[0]).exists()]
    assert not broken, f"{page}: links that do not resolve: {broken}"

"""``dflash-export``'s options are the Hydra export section's keys (issue 28 item 5): one table
(export/options.py) that conf/train.yaml, the CLI and dflash-train's end-of-run export
agree with key for key; the former spellings still work with a one-line note; and
``--recipe NAME`` (or ``recipe=NAME``) takes a recipe's export section, which options on the
command line override."""

from __future__ import annotations

import inspect
from pathlib import Path
from types import SimpleNamespace

import pytest
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from omegaconf import OmegaConf

from dflash_lab.export import cli
from dflash_lab.export.api import export_drafter
from dflash_lab.export.cli import EXIT_OK, EXIT_REFUSED, EXIT_USAGE, build_parser, main
from dflash_lab.export.options import (
    EXPORT_OPTIONS,
    TRAIN_ONLY_KEYS,
    check_section,
    export_kwargs,
    recipe_export_section,
)
from dflash_lab.paths import CONF_DIR
from tests.export_doubles import make_config, random_state, write_checkpoint

KEYS = [o.key for o in EXPORT_OPTIONS]


def _compose_train(*overrides):
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose(config_name="train", overrides=list(overrides))


def test_the_train_export_section_is_the_option_table_key_for_key():
    section = OmegaConf.to_container(_compose_train().export, resolve=False)
    assert sorted(section) == sorted([*KEYS, *TRAIN_ONLY_KEYS])
    for option in EXPORT_OPTIONS:  # null: the option's default (the SGLang release's one home)
        value = option.default if section[option.key] is None else section[option.key]
        assert str(value) == str(option.default), option.key


def test_every_option_is_a_cli_option_of_its_key_and_an_export_drafter_argument():
    parser_options = {s for a in build_parser()._actions for s in a.option_strings}
    params = inspect.signature(export_drafter).parameters
    for option in EXPORT_OPTIONS:
        assert f"--{option.key}" in parser_options, option.key
        assert params[option.kwarg].default == option.default, option.key


def test_the_format_help_names_every_format():
    """--help once listed only ours and muse-glimmer after laguna joined FORMATS."""
    (option,) = [o for o in EXPORT_OPTIONS if o.key == "format"]
    for name in option.choices:
        assert name in option.help, name


@pytest.fixture
def calls(monkeypatch, tmp_path):
    """export_drafter's keyword arguments, recorded instead of exporting."""
    seen = []

    def fake(source, out_dir, **kw):
        seen.append(kw)
        return SimpleNamespace(findings=[], out_dir=Path(out_dir))

    monkeypatch.setattr(cli, "export_drafter", fake)
    return seen


def _run(calls, tmp_path, *args):
    assert main([str(tmp_path / "src.ckpt"), str(tmp_path / "out"), *args]) == EXIT_OK
    return calls[-1]


def test_without_a_recipe_the_table_defaults_apply(calls, tmp_path):
    kw = _run(calls, tmp_path)
    assert {k: kw[k] for k in export_kwargs({})} == export_kwargs({})
    assert kw["engine"] == "both" and kw["self_check"] is True and kw["allow_lossy"] is False


@pytest.mark.parametrize(("old", "new", "kwarg", "value"), [
    (["--sglang-version", "#34524"], "--sglang_version", "sglang_version", "#34524"),
    (["--sglang-attention-backend", "fa3"], "--sglang_attention_backend", "sglang_backend",
     "fa3"),
    (["--allow-lossy"], "--allow_lossy", "allow_lossy", True),
    (["--no-self-check"], "--no-self_check", "self_check", False),
])
def test_former_spellings_still_work_with_a_one_line_note(calls, tmp_path, capsys, old, new,
                                                          kwarg, value):
    assert _run(calls, tmp_path, *old)[kwarg] == value
    err = [line for line in capsys.readouterr().err.splitlines() if "deprecated" in line]
    assert err == [f"dflash-export: {old[0]} is deprecated, use {new} (the Hydra export "
                   "section's key)"]
    new_args = [new, *old[1:]]
    assert _run(calls, tmp_path, *new_args)[kwarg] == value
    assert "deprecated" not in capsys.readouterr().err


def test_a_recipe_export_section_drives_the_cli_and_options_override_it(calls, tmp_path):
    assert recipe_export_section("tiny_cpu")["dtype"] == "float32"
    assert recipe_export_section("mimo_swa_sinks")["engine"] == "vllm"
    kw = _run(calls, tmp_path, "--recipe", "tiny_cpu")
    assert kw["dtype"] == "float32" and kw["engine"] == "both"
    assert _run(calls, tmp_path, "recipe=mimo_swa_sinks")["engine"] == "vllm"
    kw = _run(calls, tmp_path, "--recipe", "mimo_swa_sinks", "--engine", "sglang",
              "--dtype", "float16")
    assert kw["engine"] == "sglang" and kw["dtype"] == "float16"
    kw = _run(calls, tmp_path, "--recipe", "tiny_cpu", "--no-self_check")
    assert kw["dtype"] == "float32" and kw["self_check"] is False


def test_an_unknown_recipe_is_refused_naming_the_recipes(calls, tmp_path, capsys):
    assert main([str(tmp_path / "s"), str(tmp_path / "o"), "--recipe", "tiny_cpuu"]) == EXIT_USAGE
    err = capsys.readouterr().err
    assert "--recipe tiny_cpuu: no such recipe" in err and "'tiny_cpu'" in err and not calls


def test_a_mimo_drafter_exports_as_its_recipe_says(tmp_path):
    """For real: the default (both engines) refuses this layout; mimo_swa_sinks's export
    section (engine vllm) exports it; --engine both on top refuses again."""
    config = make_config("mimo")
    ckpt = write_checkpoint(tmp_path / "m.ckpt", config, random_state(config))
    assert main([str(ckpt), str(tmp_path / "a")]) == EXIT_REFUSED
    assert main([str(ckpt), str(tmp_path / "b"), "--recipe", "mimo_swa_sinks", "--engine",
                 "both"]) == EXIT_REFUSED
    assert main([str(ckpt), str(tmp_path / "c"), "--recipe", "mimo_swa_sinks", "--dtype",
                 "float32"]) == EXIT_OK
    report = (tmp_path / "c" / "EXPORT_REPORT.md").read_text()
    assert "- engines targeted: vllm\n" in report and "--recipe mimo_swa_sinks" in report


@pytest.mark.parametrize(("section", "message"), [
    ({"engin": "vllm"}, r"export.engin is no export setting; the keys are \['engine'"),
    ({"engine": "trt"}, r"export.engine='trt' is not one of \['both', 'vllm', 'sglang'\]"),
    ({"self_check": "no"}, r"export.self_check='no' must be true or false"),
])
def test_a_bad_export_section_is_refused_naming_key_and_choices(section, message):
    with pytest.raises(ValueError, match=message):
        check_section(section, "recipes/x.yaml")


def test_train_refuses_a_misspelt_export_key_at_start_up():
    from dflash_lab.train.checks import check_export

    with pytest.raises(ValueError, match="export.engin is no export setting"):
        check_export(_compose_train("+export.engin=vllm"))


def test_the_end_of_run_export_takes_every_option_of_the_section(monkeypatch, tmp_path):
    import dflash_lab.export as export_pkg
    from dflash_lab.train.run import export_run

    seen = {}

    def fake(source, out_dir, **kw):
        seen.update(kw, out_dir=out_dir)
        return SimpleNamespace(out_dir=Path(out_dir))

    monkeypatch.setattr(export_pkg, "export_drafter", fake)
    cfg = _compose_train(f"paths.output_dir={tmp_path}", "export.format=muse-glimmer",
                         "export.allow_lossy=true", "export.self_check=false",
                         "export.sglang_attention_backend=fa3", "export.dtype=float32")
    export_run(cfg, tmp_path)
    assert seen["format"] == "muse-glimmer" and seen["allow_lossy"] is True
    assert seen["self_check"] is False and seen["sglang_backend"] == "fa3"
    assert seen["dtype"] == "float32" and seen["force"] is True
    assert seen["out_dir"] == f"{tmp_path}/export"


def test_the_start_up_export_plan_follows_allow_lossy_and_format():
    """dflash-train's start-up check applies the section as the end-of-run export will: a
    lossy refusal passes with export.allow_lossy=true; export.format=muse-glimmer refuses what
    that layout cannot carry (the mimo layout's sinks) before training."""
    from dflash_lab.train.run import check_export_plan

    drafter = SimpleNamespace(config=make_config("mimo"))
    target = SimpleNamespace(identity=lambda: {"architecture": None})
    with pytest.raises(ValueError, match="end-of-run export"):
        check_export_plan(_compose_train(), drafter, target)
    check_export_plan(_compose_train("export.allow_lossy=true"), drafter, target)
    with pytest.raises(ValueError, match="export.format=muse-glimmer.*cannot be exported"):
        check_export_plan(_compose_train("export.format=muse-glimmer", "export.engine=vllm"),
                          drafter, target)
    check_export_plan(_compose_train("export.engine=vllm"), drafter, target)

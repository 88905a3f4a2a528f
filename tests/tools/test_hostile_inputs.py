"""Hostile inputs at the entry points (issue 47): each is one ``error:`` line naming the value,
the file and the fix, exit 2, no traceback, and leaves nothing behind that was not there."""

import json

import pytest

from dflash_lab.commands import export


@pytest.mark.parametrize("content", [{"a": 1}, [], "x"])
def test_inspect_of_a_config_that_is_no_drafter_config_is_one_line(tmp_path, capsys, content):
    (tmp_path / "config.json").write_text(json.dumps(content))
    assert export(["--inspect", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "error:" in err and "Traceback" not in err
    assert f"{tmp_path / 'config.json'} is not a drafter config" in err
    assert "num_hidden_layers" in err  # what a drafter config needs

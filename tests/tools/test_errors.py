"""User errors at the entry points (dflash_lab/errors.py): one line, exit 2, no traceback; a
ValueError Hydra's instantiate wrapped (a target setting refused while it is built) too."""

import pytest
from hydra.errors import InstantiationException

from dflash_lab.errors import USER_ERROR_EXIT, user_errors
from dflash_lab.serving.completions import ServerError


def _wrapped(message: str) -> InstantiationException:
    try:
        try:
            raise ValueError(message)
        except ValueError as inner:
            raise InstantiationException("Error in call to target 'load_target'") from inner
    except InstantiationException as outer:
        return outer


@pytest.mark.parametrize("raised", [ValueError("target.name_or_path=/x does not exist"),
                                    _wrapped("target.name_or_path=/x does not exist")])
def test_a_user_error_is_one_line_and_exit_2(raised, capsys, monkeypatch):
    monkeypatch.delenv("DFLASH_DEBUG", raising=False)
    monkeypatch.delenv("HYDRA_FULL_ERROR", raising=False)
    with pytest.raises(SystemExit) as done, user_errors():
        raise raised
    assert done.value.code == USER_ERROR_EXIT
    err = capsys.readouterr().err
    assert err.startswith("error: target.name_or_path=/x does not exist\n")
    assert "InstantiationException" not in err and "Traceback" not in err


def test_debugging_and_other_errors_keep_their_traceback(monkeypatch):
    monkeypatch.setenv("DFLASH_DEBUG", "1")
    with pytest.raises(InstantiationException), user_errors():
        raise _wrapped("bad")
    monkeypatch.delenv("DFLASH_DEBUG")
    with pytest.raises(InstantiationException), user_errors():  # not a user error behind it
        raise InstantiationException("Error locating target 'nowhere.Thing'")
    with pytest.raises(KeyError), user_errors():
        raise KeyError("a bug")


def test_an_unreachable_server_is_one_line_and_exit_2(capsys, monkeypatch):
    monkeypatch.delenv("DFLASH_DEBUG", raising=False)
    monkeypatch.delenv("HYDRA_FULL_ERROR", raising=False)
    with pytest.raises(SystemExit) as done, user_errors():
        raise ServerError("http://localhost:9/v1/models failed 4 times. Is the server up?")
    assert done.value.code == USER_ERROR_EXIT
    err = capsys.readouterr().err
    assert err.startswith("error: http://localhost:9/v1/models failed 4 times.")
    assert "Traceback" not in err

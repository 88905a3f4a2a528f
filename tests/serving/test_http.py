"""The HTTP pieces both clients of a served model use (dflash_lab.serving.http)."""

from __future__ import annotations

import json

import pytest

from dflash_lab.serving.http import json_request, pick_served_model

MODELS = [{"id": "target", "root": "/models/t", "max_model_len": 4096},
          {"id": "other", "root": "/models/o"}]


def test_the_only_served_model_is_picked_when_none_is_named():
    assert pick_served_model(MODELS[:1], None, "http://h/v1", "server.model", ValueError) \
        == MODELS[0]
    assert pick_served_model(MODELS, "other", "http://h/v1", "server.model", ValueError) \
        == MODELS[1]


def test_an_unpicked_or_unserved_model_raises_naming_the_setting():
    class Refused(RuntimeError):
        pass

    with pytest.raises(Refused, match=r"http://h/v1 serves \['target', 'other'\]: set "
                                      r"server.model to one of them"):
        pick_served_model(MODELS, None, "http://h/v1", "server.model", Refused)
    with pytest.raises(Refused, match=r"does not serve server.model='nope'; it serves"):
        pick_served_model(MODELS, "nope", "http://h/v1", "server.model", Refused)
    with pytest.raises(Refused, match=r"serves \[\]"):
        pick_served_model([], None, "http://h/v1", "server.model", Refused)


def test_a_request_is_a_get_without_body_or_a_json_post_with_the_bearer_token(monkeypatch):
    get = json_request("http://h/v1/models")
    assert get.get_method() == "GET" and get.data is None
    assert get.get_header("Authorization") is None
    monkeypatch.setenv("DFLASH_TEST_TOKEN", "s3cret")
    post = json_request("http://h/v1/completions", {"prompt": [1, 2]}, "DFLASH_TEST_TOKEN")
    assert post.get_method() == "POST" and json.loads(post.data) == {"prompt": [1, 2]}
    assert post.get_header("Authorization") == "Bearer s3cret"
    assert post.get_header("Content-type") == "application/json"

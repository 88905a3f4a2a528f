"""Sharded serving directories (``model.safetensors.index.json`` + shards, as HF writes large
drafters): the importer, ``--inspect`` and the weight readers see every tensor exactly as from one
``model.safetensors``; a missing shard, a shard outside the directory, a tensor in two shards or
an index that disagrees with its shards is a clear error, never a partial read."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from dflash_lab.export import import_drafter, inspect_dir
from dflash_lab.export.cli import EXIT_OK, main
from dflash_lab.export.engines.common import NO_ARTIFACTS
from dflash_lab.export.formats import ZLAB, format_at
from dflash_lab.export.formats.base import resolve_third_party
from dflash_lab.export.weights import (
    WEIGHTS_FILE,
    WEIGHTS_INDEX,
    expected_shapes,
    has_weights,
    weight_files,
    weight_shapes,
)
from tests.export_doubles import random_state, write_zlab_dir, zlab_config

SHARD = "model-{:05d}-of-{:05d}.safetensors"


def _zlab_dir(path: Path) -> Path:
    """A z-lab style serving directory with one model.safetensors."""
    d = zlab_config("qwen3_8b")
    config = resolve_third_party(d, Path("z-lab"), NO_ARTIFACTS, "vllm-main-v2", ZLAB)[0]
    return write_zlab_dir(path, d, {k: v for k, v in random_state(config).items()
                                    if k in expected_shapes(config)})


def _shard(path: Path, parts: int = 3) -> dict[str, str]:
    """Split path/model.safetensors into ``parts`` shards plus an HF index; returns its map."""
    state = load_file(str(path / WEIGHTS_FILE))
    names, weight_map = sorted(state), {}
    for i in range(parts):
        part = {k: state[k] for k in names[i::parts]}
        save_file(part, str(path / SHARD.format(i + 1, parts)))
        weight_map.update(dict.fromkeys(part, SHARD.format(i + 1, parts)))
    (path / WEIGHTS_FILE).unlink()
    (path / WEIGHTS_INDEX).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return weight_map


def test_sharded_directory_imports_and_inspects_as_the_single_file(tmp_path, capsys):
    path = _zlab_dir(tmp_path / "z")
    single, single_text = import_drafter(path), inspect_dir(path, "vllm").text
    shapes = weight_shapes(path)
    _shard(path)
    assert len(weight_files(path)) == 3 and has_weights(path) and format_at(path) is ZLAB
    assert weight_shapes(path) == shapes
    sharded = import_drafter(path)
    assert sharded.config == single.config
    assert set(sharded.state_dict) == set(single.state_dict)
    for name, tensor in single.state_dict.items():
        assert torch.equal(sharded.state_dict[name], tensor), name
    result = inspect_dir(path, "vllm")
    assert result.unchecked == [] and result.text.splitlines()[-1] == single_text.splitlines()[-1]
    assert result.text.splitlines()[-1].startswith("OK")
    assert main(["--inspect", str(path), "--engine", "vllm"]) == EXIT_OK
    capsys.readouterr()


def test_missing_shard_is_an_error_naming_it(tmp_path):
    path = _zlab_dir(tmp_path / "z")
    _shard(path)
    (path / SHARD.format(2, 3)).unlink()
    with pytest.raises(ValueError, match=r"names 1 shard\(s\) that are not in .*00002-of-00003"):
        import_drafter(path)
    with pytest.raises(ValueError, match="00002-of-00003"):
        inspect_dir(path, "vllm")


def test_shard_outside_the_directory_is_refused(tmp_path):
    path = _zlab_dir(tmp_path / "z")
    weight_map = _shard(path)
    (tmp_path / "elsewhere.safetensors").write_bytes((path / SHARD.format(1, 3)).read_bytes())
    index = {"weight_map": {k: ("../elsewhere.safetensors" if v == SHARD.format(1, 3) else v)
                            for k, v in weight_map.items()}}
    (path / WEIGHTS_INDEX).write_text(json.dumps(index))
    with pytest.raises(ValueError, match="outside"):
        weight_files(path)


def test_index_that_disagrees_with_its_shards_is_refused(tmp_path):
    path = _zlab_dir(tmp_path / "z")
    weight_map = _shard(path)
    dropped = sorted(weight_map)[0]
    del weight_map[dropped]  # the shard still holds it: the index lies about the directory
    (path / WEIGHTS_INDEX).write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(ValueError, match=f"disagree.*only in the shards.*{dropped}"):
        import_drafter(path)


def test_tensor_in_two_shards_is_refused(tmp_path):
    path = _zlab_dir(tmp_path / "z")
    weight_map = _shard(path)
    first = sorted(weight_map)[0]
    other = next(s for s in sorted(set(weight_map.values())) if s != weight_map[first])
    extra = load_file(str(path / other))
    extra[first] = load_file(str(path / weight_map[first]))[first]
    save_file(extra, str(path / other))
    with pytest.raises(ValueError, match=f"{first} is in two weight shards"):
        weight_shapes(path)


@pytest.mark.parametrize("text", ["not json", '{"metadata": {}}', '{"weight_map": [1, 2]}'])
def test_broken_index_is_an_error_naming_the_file(tmp_path, text):
    path = _zlab_dir(tmp_path / "z")
    _shard(path)
    (path / WEIGHTS_INDEX).write_text(text)
    with pytest.raises(ValueError, match=f"{WEIGHTS_INDEX}: not a safetensors index"):
        weight_files(path)

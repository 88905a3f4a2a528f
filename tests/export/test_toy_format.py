"""The test-only toy format (tests/export/toy_format.py) works end to end once registered: the
exporter writes it (and self-checks it), the registry detects it, ``--inspect`` reads it, the
importer and eval's loader read it back bit-equal, and what it cannot carry is refused by the
round trip, by name, before anything is written."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from dflash_lab.eval.loading import load_drafter
from dflash_lab.export import export_drafter, formats, import_drafter, inspect_dir
from tests.doubles import tiny_drafter_config
from tests.export.toy_format import MODEL_TYPE, TOY
from tests.export_doubles import random_state, write_checkpoint


@pytest.fixture
def toy():
    formats.register(TOY)
    yield TOY
    formats.unregister(TOY)


@pytest.fixture
def checkpoint(tmp_path):
    config = tiny_drafter_config()
    state = random_state(config)
    return write_checkpoint(tmp_path / "c.ckpt", config, state), config, state


def test_unregistered_it_is_no_format(checkpoint, tmp_path):
    with pytest.raises(ValueError, match="format 'toy' is not one of"):
        export_drafter(checkpoint[0], tmp_path / "out", format="toy")


def test_writes_detects_inspects_and_reads_back(toy, checkpoint, tmp_path):
    ckpt, config, state = checkpoint
    out = tmp_path / "toy"
    result = export_drafter(ckpt, out, format="toy", engine="vllm", dtype="float32")
    assert result.self_check and all(r.ok for r in result.self_check)
    raw = json.loads((out / "config.json").read_text())
    assert raw["model_type"] == MODEL_TYPE and formats.format_of(raw) is toy
    assert formats.format_at(out) is toy
    assert "toy_fc.weight" in load_file(str(out / "model.safetensors"))
    assert "format: toy (tests/export/toy_format.py)" in (out / "EXPORT_REPORT.md").read_text()
    inspected = inspect_dir(out, engine="vllm")
    assert inspected.ok, inspected.problems
    assert "Toy format notes:" in inspected.text
    imported = import_drafter(out)
    assert imported.config == config
    assert all(torch.equal(imported.state_dict[k], v) for k, v in state.items())
    loaded = load_drafter(out)
    assert loaded.description.startswith("toy directory")
    assert torch.equal(loaded.drafter.state_dict()["fc.weight"], state["fc.weight"])


def test_what_it_cannot_carry_is_refused_by_name(toy, tmp_path):
    config = tiny_drafter_config(attention_sink_bias=True, output_multiplier=0.5)
    ckpt = write_checkpoint(tmp_path / "c.ckpt", config, random_state(config))
    with pytest.raises(ValueError, match=r"--format toy.*the fields "
                                         r"\['attention_sink_bias', 'output_multiplier'\]"):
        export_drafter(ckpt, tmp_path / "out", format="toy", engine="vllm")
    assert not (tmp_path / "out").exists()

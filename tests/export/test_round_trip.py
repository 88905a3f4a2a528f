"""What a format refuses is derived by a write -> detect -> read round trip (issue 44 item 2).

(a) Every shipped recipe's drafter x every writable format: the export either writes a file the
registry detects and reads back to the same config (every dataclass field), or is refused with a
message naming exactly the fields that do not survive. (b) A field a DrafterConfig subclass adds
is refused by every format, none of which declares it, with no line written for it.
"""

from __future__ import annotations

import ast
import dataclasses
import re

import pytest

from dflash_lab.export import formats
from dflash_lab.export.engines.common import Artifacts
from dflash_lab.model.config import DrafterConfig
from tests.doubles import tiny_drafter_config
from tests.export.test_golden import RECIPES, _recipe_config

WRITABLE = [f.name for f in formats.REGISTRY if f.writable]


def test_the_writable_formats_are_the_four_we_write():
    assert sorted(WRITABLE) == ["dflash-lab", "dspark", "laguna", "muse-glimmer"]


def flat(config: DrafterConfig) -> dict:
    """``asdict`` with a head's fields (``head_options``) each under its own name."""
    out = dataclasses.asdict(config)
    return {**out.pop("head_options"), **out}


def survivors_differ(config: DrafterConfig, fmt: formats.Format) -> set[str]:
    """The fields whose value differs after fmt's write and the registry's read (computed
    from ``asdict`` of both, the layout compared as resolved per-layer specs)."""
    raw = fmt.write_config(config, "float32", None, vocab_known=True)
    artifacts = Artifacts(mask_embedding_file=config.learned_mask_embedding,
                          sink_weights=config.attention_sink_bias)
    try:
        back = formats.format_of(raw).read_back(raw, artifacts)
    except ValueError:
        return {f.name for f in dataclasses.fields(config) if f.compare} - {"head_options"} \
            | set(config.head_options)
    ours, theirs = flat(config), flat(back)
    defaults = {f.name: f.default for f in dataclasses.fields(config)}  # a reader without it
    layout = {"layer_types", "sliding_window", "is_causal"}
    same_layout = back.layer_specs() == config.layer_specs()
    return {k for k in ours if k != "_source" and not (same_layout and k in layout)
            and theirs.get(k, defaults.get(k)) != ours[k]}


def named_fields(message: str) -> set[str]:
    match = re.search(r"the fields (\[[^\]]*\])", message)
    return set(ast.literal_eval(match.group(1))) if match else set()


def check_round_trip(config: DrafterConfig, name: str) -> str:
    """'kept', 'refused' or 'not its variant'; asserts the refusal names exactly the lost
    fields and a written config reads back unchanged."""
    try:
        fmt = formats.get(name).writer_for(config)
    except ValueError as err:  # e.g. a DSpark drafter has one layout; DSpark carries DSpark only
        assert "DSpark" in str(err)
        return "not its variant"
    lost = survivors_differ(config, fmt)
    try:
        formats.write_config(name, config, "float32", None, vocab_known=True)
    except ValueError as err:
        assert named_fields(str(err)) == lost, str(err)
        return "refused"
    assert not lost, f"{name} wrote {config._source} but loses {sorted(lost)}"
    return "kept"


@pytest.mark.parametrize("recipe", RECIPES)
def test_every_recipe_survives_or_is_refused_naming_the_lost_fields(recipe, tmp_path,
                                                                    tiny_target_dir):
    config, _ = _recipe_config(recipe, tmp_path, tiny_target_dir)
    results = {name: check_round_trip(config, name) for name in WRITABLE}
    # each recipe's drafter is written by our format or, for DSpark, the layout it writes
    assert results[formats.OURS] == "kept", results


@dataclasses.dataclass
class WithExtraField(DrafterConfig):
    """A drafter with one field no format declares (what a new head would add)."""

    extra_knob: int = 0


def with_extra(config: DrafterConfig, value: int) -> WithExtraField:
    fields = {f.name: getattr(config, f.name) for f in dataclasses.fields(config) if f.init}
    return WithExtraField(**fields, extra_knob=value)


@pytest.mark.parametrize("name", WRITABLE)
def test_a_field_no_format_declares_is_refused_by_every_format(name):
    base = {"dspark": tiny_drafter_config(variant="dspark", markov_rank=4,
                                          markov_head_type="vanilla",
                                          enable_confidence_head=False,
                                          confidence_head_with_markov=False),
            "laguna": tiny_drafter_config(aux_hidden_norms=True, context_input_norm=True,
                                          is_causal=False),
            "muse-glimmer": tiny_drafter_config(is_causal=False)}.get(name, tiny_drafter_config())
    assert check_round_trip(with_extra(base, 0), name) == "kept"  # at its default: nothing lost
    config = with_extra(base, 3)
    with pytest.raises(ValueError, match=f"--format {name}") as err:
        formats.write_config(name, config, "float32", None, vocab_known=True)
    assert "extra_knob" in named_fields(str(err.value))
    assert check_round_trip(config, name) == "refused"

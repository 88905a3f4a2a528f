"""One name per concept in every command (issue 28): the former names are refused with the new
one, and the new names mean what the old ones did (dflash_lab/entry.py RENAMED_KEYS)."""

import subprocess
import sys

import pytest

from dflash_lab.entry import RENAMED_KEYS, check_renamed_keys
from dflash_lab.model.config import build_target_layer_ids, resolve_target_layer_ids


@pytest.mark.parametrize("arg", ["data.conversations=conv.jsonl", "data.num_samples=3",
                                 "capture.num_layers=5", "+data.num_samples=3"])
def test_a_former_key_on_the_command_line_names_the_new_one(arg):
    key = arg.lstrip("+").split("=")[0]
    with pytest.raises(ValueError) as err:
        check_renamed_keys(["target=tiny", arg])
    new = RENAMED_KEYS[key].split(" ")[0]
    assert key in str(err.value) and new in str(err.value) and arg in str(err.value)


def test_current_keys_pass():
    check_renamed_keys(["data.path=conv.jsonl", "data.limit=3", "capture.target_layer_ids=5",
                        "drafter.target_layer_ids=[1,3,5]"])


@pytest.mark.parametrize("module, arg, new", [
    ("dflash_lab.train.cli", "data.conversations=demo", "data.path"),
    ("dflash_lab.capture", "capture.num_layers=3", "capture.target_layer_ids=N"),
    ("dflash_lab.eval.cli", "data.num_samples=2", "data.limit"),
])
def test_each_command_refuses_a_former_key_with_exit_2(module, arg, new, tmp_path):
    """Before Hydra runs: exit 2, one line naming the key and its new name, nothing written."""
    out = subprocess.run([sys.executable, "-m", module, arg], capture_output=True, text=True,
                         cwd=tmp_path, timeout=300)
    assert out.returncode == 2, out.stderr
    assert arg.split("=")[0] in out.stderr and new in out.stderr
    assert not any(tmp_path.iterdir())


def test_a_recipe_with_a_former_data_key_is_refused_by_the_online_module(tiny_target):
    from dflash_lab.data.module import OnlineDataModule

    with pytest.raises(ValueError, match=r"data\.conversations .*use data\.path"):
        OnlineDataModule("demo", tiny_target, [1, 3], conversations="demo", batch_size=2)


def test_target_layer_ids_spell_the_same_in_capture_and_drafter():
    assert resolve_target_layer_ids(5, 36, "capture.target_layer_ids") == \
        build_target_layer_ids(36, 5) == [1, 9, 17, 25, 33]
    assert resolve_target_layer_ids([2, 4], 36, "k") == [2, 4]
    for bad in (None, "5", True):
        with pytest.raises(ValueError, match="capture.target_layer_ids"):
            resolve_target_layer_ids(bad, 36, "capture.target_layer_ids")


def test_capture_reads_an_int_as_evenly_spread_ids(tiny_target):
    """conf/capture.yaml's default (5) and an int on the command line give the drafter's rule."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from dflash_lab.capture import _settings
    from dflash_lab.paths import CONF_DIR

    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        base = ["target=tiny", "capture.out_dir=unused"]
        cfg = compose(config_name="capture", overrides=[*base, "capture.target_layer_ids=3"])
        default = compose(config_name="capture", overrides=base)
    layers = tiny_target.num_hidden_layers
    assert _settings(cfg, tiny_target).target_layer_ids == build_target_layer_ids(layers, 3)
    assert _settings(default, tiny_target).target_layer_ids == build_target_layer_ids(layers, 5)


@pytest.mark.parametrize(("arg", "fix"), [("drafter.variant=dspark", "drafter=dspark"),
                                          ("drafter.variant=dflash1", "drafter=default"),
                                          ("drafter.variant=nope", "one of ['default'")])
def test_a_head_chosen_by_its_key_is_refused_naming_its_group(arg, fix):
    """Hydra refuses ``drafter.variant=X`` in six lines; ours names the config group."""
    with pytest.raises(ValueError, match="a head is chosen with its config group") as err:
        check_renamed_keys(["target=tiny", arg])
    assert fix in str(err.value) and arg in str(err.value)

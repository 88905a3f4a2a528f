"""GGUF targets by documentation alone (docs/capture.md "GGUF targets").

The GGUF files are written here from the built-in tiny target (tests/targets/gguf_writer.py), one
with and one without a chat template. The commands are the documented ones, run through the console
entry points (``sys.argv`` + ``main()``): capture -> train -> export -> eval from the GGUF path
alone, online training, the start-up error of a GGUF without a template, and the target
identity a capture and a training run compare.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("gguf", reason="the gguf package (dev extra) is not installed: "
                    "pip install -c constraints.txt gguf accelerate")
pytest.importorskip("accelerate", reason="transformers needs accelerate to load a GGUF file: "
                    "pip install -c constraints.txt accelerate")

from hydra import compose, initialize_config_dir  # noqa: E402
from hydra.core.global_hydra import GlobalHydra  # noqa: E402

from dflash_lab.paths import CONF_DIR  # noqa: E402
from dflash_lab.targets.demo_corpus import demo_conversations  # noqa: E402
from dflash_lab.targets.loader import load_target  # noqa: E402
from tests.targets.gguf_writer import write_qwen3_gguf  # noqa: E402

FAST = ["target.dtype=float32", "target.device=cpu"]


@pytest.fixture(scope="module")
def ggufs(tmp_path_factory, tiny_target_dir):
    """``with``/``plain``: the tiny target as GGUF files with / without a chat template."""
    root = tmp_path_factory.mktemp("gguf")
    return {"with": write_qwen3_gguf(tiny_target_dir, root / "tiny.gguf"),
            "plain": write_qwen3_gguf(tiny_target_dir, root / "tiny-notemplate.gguf",
                                      chat_template=False)}


@pytest.fixture(scope="module")
def conversations(tmp_path_factory):
    path = tmp_path_factory.mktemp("conv") / "conv.jsonl"
    rows = [{"messages": c} for c in demo_conversations(24, seed=5)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture(scope="module")
def template_file(tmp_path_factory, tiny_target_dir):
    """The user path for a custom template: the model's Jinja text in a file."""
    path = tmp_path_factory.mktemp("template") / "tiny.jinja"
    shutil.copy(tiny_target_dir / "chat_template.jinja", path)
    return path


def run(main, name: str, args: list[str], monkeypatch) -> None:
    """Run a console entry point as the shell would: ``name args...``."""
    monkeypatch.setattr(sys, "argv", [name, *args])
    GlobalHydra.instance().clear()
    main()


def compose_capture(overrides: list[str]):
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose(config_name="capture", overrides=overrides)


def capture_args(gguf: Path, conv: Path, out: Path, *extra: str) -> list[str]:
    return ["target=hf", f"target.name_or_path={gguf}", *extra, f"data.path={conv}",
            f"capture.out_dir={out}", "capture.max_length=128", "capture.progress=false",
            *FAST]


def train_args(gguf: Path, run_dir: Path, *extra: str) -> list[str]:
    return ["target=hf", f"target.name_or_path={gguf}", *extra, "drafter.num_hidden_layers=1",
            "drafter.block_size=4", "+trainer.limit_train_batches=3", "trainer.max_epochs=1",
            "data.batch_size=4", "data.val_fraction=0.25", "data.num_workers=0",
            "module.num_anchors=8", "logger=none", f"paths.output_dir={run_dir}", *FAST]


# ------------------------------------------------------------------ the written GGUF itself
def test_the_written_gguf_is_the_tiny_target(ggufs, tiny_target_dir):
    """transformers reads the GGUF back as the same model (F32: equal logits), tokenizer (same
    ids) and template; head_dim (32, not Qwen3's default 128) comes from the file."""
    ref = load_target(str(tiny_target_dir), dtype="float32", device="cpu")
    got = load_target(str(ggufs["with"]), dtype="float32", device="cpu")
    assert got.model.config.head_dim == ref.model.config.head_dim == 32
    assert got.tokenizer.chat_template == ref.tokenizer.chat_template
    texts = ["What is 12 + 30? (think first)", "  spaces\n\nand\ttabs, 1234 apples.",
             ref.tokenizer.apply_chat_template(demo_conversations(2, seed=9)[1], tokenize=False)]
    for text in texts:
        ids = ref.tokenizer(text)["input_ids"]
        assert got.tokenizer(text)["input_ids"] == ids, text
        with torch.no_grad():
            want = ref.model(torch.tensor([ids])).logits
            have = got.model(torch.tensor([ids])).logits
        torch.testing.assert_close(have, want, rtol=0, atol=1e-5)
    plain = load_target(str(ggufs["plain"]), dtype="float32", device="cpu")
    assert not plain.tokenizer.chat_template
    assert plain.identity()["chat_template_hash"] is None


def test_a_quantised_gguf_dequantises_to_the_requested_dtype(tiny_target_dir, tmp_path):
    """Q8_0 matrices come back as the gguf package dequantises them, cast to target.dtype."""
    import gguf
    from safetensors.numpy import load_file

    path = write_qwen3_gguf(tiny_target_dir, tmp_path / "tiny.Q8_0.gguf", quant="Q8_0")
    got = load_target(str(path), dtype="bfloat16", device="cpu")
    weight = load_file(str(tiny_target_dir / "model.safetensors"))[
        "model.layers.0.self_attn.q_proj.weight"]
    q8 = gguf.GGMLQuantizationType.Q8_0
    want = torch.from_numpy(gguf.dequantize(gguf.quantize(weight, q8), q8)).to(torch.bfloat16)
    have = got.model.model.layers[0].self_attn.q_proj.weight
    assert have.dtype == torch.bfloat16 and torch.equal(have, want)
    assert not torch.equal(want, torch.from_numpy(weight).to(torch.bfloat16))  # really lossy


def test_a_gguf_in_a_hub_repo_loads_from_the_offline_cache(ggufs, offline_hf_cache, tmp_path):
    """target.name_or_path=Org/Repo target.gguf_file=NAME, as GGUF repos on the hub are laid
    out, read from the HF cache with HF_HUB_OFFLINE=1."""
    from tests.stand_ins import publish_to_hf_cache

    repo = tmp_path / "repo"
    repo.mkdir()
    shutil.copy(ggufs["plain"], repo / "tiny-F32.gguf")
    publish_to_hf_cache(repo, "example-org/tiny-GGUF", offline_hf_cache)
    got = load_target("example-org/tiny-GGUF", gguf_file="tiny-F32.gguf", dtype="float32",
                      device="cpu", chat_template="chatml")
    assert got.model.config.head_dim == 32
    assert got.identity()["gguf_file"] == "tiny-F32.gguf"


def test_a_gguf_with_tensors_transformers_cannot_map_is_refused(tiny_target_dir, tmp_path):
    """transformers would initialise the missing weight at random with a warning."""
    path = write_qwen3_gguf(tiny_target_dir, tmp_path / "broken.gguf",
                            skip_tensors=("blk.0.ffn_up.weight",))
    with pytest.raises(ValueError, match=r"left 1 weights unloaded.*layers\.0\.mlp\.up_proj"):
        load_target(str(path), dtype="float32", device="cpu")


# ------------------------------------------------------------------------- the chat template
def test_capture_from_a_gguf_without_a_template_stops_at_start_up(ggufs, conversations,
                                                                   tmp_path, monkeypatch):
    """One line naming target.chat_template, before any shard; the same command with
    target.chat_template=chatml then captures into the same directory."""
    from dflash_lab.capture import capture, main

    out = tmp_path / "cap"
    with pytest.raises(ValueError, match=r"no chat template; set target\.chat_template=") as err:
        capture(compose_capture(capture_args(ggufs["plain"], conversations, out)))
    assert "\n" not in str(err.value)
    assert not list(out.glob("shard-*"))
    run(main, "dflash-capture",
        capture_args(ggufs["plain"], conversations, out, "target.chat_template=chatml"),
        monkeypatch)
    assert json.loads((out / "manifest.json").read_text())["num_loss_tokens"] > 0


def test_eval_from_a_gguf_without_a_template_says_what_to_set(ggufs):
    from dflash_lab.eval.prompts import encode_prompt

    plain = load_target(str(ggufs["plain"]), dtype="float32", device="cpu")
    with pytest.raises(ValueError, match=r"data\.chat_template=true.*target\.chat_template="):
        encode_prompt(plain.tokenizer, [{"role": "user", "content": "hi"}])


def test_the_template_override_is_part_of_the_identity(ggufs, conversations, template_file,
                                                      tiny_target_dir, tmp_path, monkeypatch):
    """target.chat_template changes chat_template_hash (a built-in name and a file alike; the
    built-in chatml renders the tiny target's conversations as its own template does), a
    capture rerun with another template is refused, and a capture's manifest records the
    identity the same GGUF + template gives at training."""
    from dflash_lab.capture import capture, main
    from dflash_lab.data.shards import ShardDataset

    plain = str(ggufs["plain"])
    chatml = load_target(plain, dtype="float32", device="cpu", chat_template="chatml")
    custom = load_target(plain, dtype="float32", device="cpu", chat_template=str(template_file))
    with_template = load_target(str(ggufs["with"]), dtype="float32", device="cpu")
    hashes = {t.identity()["chat_template_hash"] for t in (chatml, custom)}
    assert None not in hashes and len(hashes) == 2
    assert custom.identity()["chat_template_hash"] == \
        with_template.identity()["chat_template_hash"]
    for conv in demo_conversations(4, seed=3):  # chatml fits the tiny target's own format
        assert chatml.tokenizer.apply_chat_template(conv, tokenize=False) == \
            custom.tokenizer.apply_chat_template(conv, tokenize=False)

    out = tmp_path / "cap"
    run(main, "dflash-capture",
        capture_args(ggufs["plain"], conversations, out, "target.chat_template=chatml"),
        monkeypatch)
    assert json.loads((out / "manifest.json").read_text())["target"] == chatml.identity()
    with pytest.raises(ValueError, match="chat_template_hash"):
        capture(compose_capture(capture_args(ggufs["plain"], conversations, out,
                                             f"target.chat_template={template_file}")))
    # Training compares config and tokenizer hashes, not the template (the capture's token ids
    # are the data); the HF directory of the same model has other hashes than its GGUF.
    assert len(ShardDataset(out, target=custom.identity())) > 0
    hf_dir = load_target(str(tiny_target_dir), dtype="float32", device="cpu")
    with pytest.raises(ValueError, match=r"target\.config_hash"):
        ShardDataset(out, target=hf_dir.identity())


# ------------------------------------------------------------------------ the documented path
@pytest.mark.slow
@pytest.mark.parametrize("variant", ["no template + template file", "template in the GGUF"])
def test_capture_train_export_eval_from_the_gguf_path_alone(variant, ggufs, conversations,
                                                           template_file, tmp_path,
                                                           monkeypatch):
    """docs/capture.md "GGUF targets", command by command."""
    from dflash_lab.capture import main as capture_main
    from dflash_lab.eval.cli import main as eval_main
    from dflash_lab.export.cli import main as export_main
    from dflash_lab.train.cli import main as train_main

    if variant == "template in the GGUF":
        gguf, template = ggufs["with"], []
    else:
        gguf, template = ggufs["plain"], [f"target.chat_template={template_file}"]
    cap, run_dir, export, report = (tmp_path / n for n in ("cap", "run", "export", "eval"))
    run(capture_main, "dflash-capture", capture_args(gguf, conversations, cap, *template),
        monkeypatch)
    run(train_main, "dflash-train",
        train_args(gguf, run_dir, *template, "data=offline", f"data.path={cap}"), monkeypatch)
    assert json.loads((run_dir / "checkpoints" / "best.json").read_text())
    assert export_main([str(run_dir), str(export), "--dtype", "float32",
                        "--target", str(gguf)]) == 0
    assert "no --target given" not in (export / "EXPORT_REPORT.md").read_text()
    run(eval_main, "dflash-eval",
        ["target=hf", f"target.name_or_path={gguf}", *template, f"drafter.path={export}",
         f"data.path={conversations}", f"output_dir={report}", "num_prompts=2",
         "max_new_tokens=16", "progress=false", *FAST], monkeypatch)
    result = json.loads((report / "report.json").read_text())
    assert result["lossless"] is True and len(result["outputs"]) == 2


def test_online_training_from_a_gguf(ggufs, conversations, tmp_path, monkeypatch):
    """Without a template it stops at start-up naming target.chat_template; with one it
    trains."""
    from dflash_lab.train.cli import main as train_main
    from dflash_lab.train.run import train

    run_dir = tmp_path / "run"
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose(config_name="train", overrides=train_args(
            ggufs["plain"], run_dir, "data=online", f"data.path={conversations}"))
    with pytest.raises(ValueError, match=r"no chat template; set target\.chat_template="):
        train(cfg)
    run(train_main, "dflash-train",
        train_args(ggufs["plain"], run_dir, "target.chat_template=chatml", "data=online",
                   f"data.path={conversations}", "data.max_length=128"), monkeypatch)
    assert (run_dir / "checkpoints" / "last.ckpt").is_file()

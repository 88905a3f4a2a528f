"""The knobs of the comparison pipeline (scripts/compare_speculators.py) as a user sets them: the
serve stage refuses DFlash 2 with the reason. (The SmolLM2 end-to-end pipeline is a recipe now,
``dflash-lab run recipe=smollm2_sharegpt_cpu``: tests/tools/test_pipeline.py and
tests/recipes/test_recipes_run.py.)"""

from tests.tools.compare_driver import run_driver


def test_serve_refuses_dflash2_saying_why(tmp_path):
    done = run_driver(tmp_path / "out", "serve", variant="dflash2")
    assert done.returncode != 0
    assert "cannot serve DFlash 2" in done.stdout
    assert not (tmp_path / "out" / "done").exists()

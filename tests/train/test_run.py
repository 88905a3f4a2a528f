"""dflash_lab/train/run.py: the run summary's checkpoint line."""

from dflash_lab.train.run import summary


def test_the_summary_names_the_best_checkpoint_or_says_there_is_none():
    best = "/r/checkpoints/epoch=0.ckpt"
    lines = summary({"best_checkpoint": best, "output_dir": "/r"}, "t", []).splitlines()
    assert f"best checkpoint: {best}" in lines
    # trainer.max_steps below the first validation: no best checkpoint; the line says so
    lines = summary({"best_checkpoint": "", "output_dir": "/r"}, "t", []).splitlines()
    assert ("best checkpoint: none (no validation before the last step; last.ckpt is used)"
            in lines)

"""dflash_lab/train/run.py: the run summary's checkpoint line."""

from dflash_lab.train.run import best_line


def test_the_summary_names_the_best_checkpoint_or_says_there_is_none():
    best = "/r/checkpoints/epoch=0.ckpt"
    assert best_line(best) == f"best checkpoint: {best}"
    # trainer.max_steps below the first validation: no best checkpoint; the line says so
    assert best_line("") == ("best checkpoint: none (no validation before the last step; "
                             "last.ckpt is used)")

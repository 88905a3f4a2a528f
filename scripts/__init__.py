"""Experiment drivers and peer harnesses: not product, never imported by ``dflash_lab``.

Those that import the repository's own modules (``benchmarks``, ``scripts``, or ``dflash_lab``
from a venv where it is not installed) run as modules from the repository root, e.g.
``.venv-dflash/bin/python -m scripts.zlab_parity DIR``: ``python -m`` puts the current folder on
the import path, so nothing here edits it.
"""

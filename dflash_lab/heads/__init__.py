"""The drafter heads (``drafter.variant``) and the features every head may switch on.

One module per head or feature, each defining and registering a ``Head`` (the interface and the
registry: dflash_lab/model/heads.py). The registry imports these modules on first use; nothing
else in the package imports them.
"""

"""The checkpoint formats, one module each, in :data:`REGISTRY`'s match order; the interface,
default reader and registry functions are export/formats/base.py's, re-exported here
(docs/architecture.md, "Add a format").
"""

from __future__ import annotations

from dflash_lab.export.formats.base import (
    REGISTRY,
    Format,
    check_writable,
    format_at,
    format_of,
    get,
    import_drafter,
    load_serving_dir,
    load_source,
    options,
    read_all,
    register,
    unregister,
    write_config,
)
from dflash_lab.export.formats.dspark import DSPARK_FORMAT
from dflash_lab.export.formats.laguna import LAGUNA, features_lines
from dflash_lab.export.formats.lightning import LIGHTNING
from dflash_lab.export.formats.muse_glimmer import MUSE_GLIMMER
from dflash_lab.export.formats.ours import OURS, OURS_FORMAT, ZLAB
from dflash_lab.export.formats.specforge import SPECFORGE
from dflash_lab.export.formats.speculators import SPECULATORS

REGISTRY[:] = [SPECFORGE, DSPARK_FORMAT, SPECULATORS, OURS_FORMAT, LAGUNA, MUSE_GLIMMER, ZLAB,
               LIGHTNING]

__all__ = ["OURS", "REGISTRY", "ZLAB", "Format", "check_writable", "features_lines",
           "format_at", "format_of", "get", "import_drafter", "load_serving_dir", "load_source",
           "options", "read_all", "register", "unregister", "write_config"]

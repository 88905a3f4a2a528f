"""DFlash drafter exporter: checkpoint -> serving directory for vLLM and SGLang.

Importable without Lightning or Hydra (torch, safetensors and ``dflash_lab.model.config`` only;
transformers optionally, for the self-check), so it also runs inside a serving environment.
"""

from dflash_lab.export.api import (
    ExportRefused,
    ExportResult,
    InspectResult,
    SelfCheckFailed,
    export_drafter,
    inspect_dir,
    plan_export,
    serving_config,
)
from dflash_lab.export.engines import RULE_SETS, Artifacts, EngineReading, LayerReading
from dflash_lab.export.formats import import_drafter, load_serving_dir, load_source, read_all
from dflash_lab.export.formats.base import ImportedDrafter
from dflash_lab.export.weights import Source

__all__ = [
    "Artifacts", "EngineReading", "ExportRefused", "ExportResult", "ImportedDrafter",
    "InspectResult", "LayerReading", "RULE_SETS", "SelfCheckFailed", "Source", "export_drafter",
    "import_drafter", "inspect_dir", "load_serving_dir", "load_source", "plan_export",
    "read_all", "serving_config",
]

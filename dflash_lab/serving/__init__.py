"""A served model (vLLM or SGLang): what dflash-regenerate and dflash-eval need to use one, one
module per job (settings, launch, http, completions, engine; docs/architecture.md, "Layout").
"""

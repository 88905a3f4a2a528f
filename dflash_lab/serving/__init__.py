"""A served model (vLLM or SGLang) as dflash-regenerate, dflash-capture and dflash-eval use it,
one module per job (docs/architecture.md, "Layout")."""

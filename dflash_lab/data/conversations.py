"""Load conversation datasets (local JSONL/JSON/parquet or hub ids) with ``datasets``."""

from __future__ import annotations

from pathlib import Path

_LOCAL_BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}
_CONVERSATION_COLUMNS = ("messages", "conversations")


def _looks_local(path: str) -> bool:
    return Path(path).suffix in _LOCAL_BUILDERS or path.startswith((".", "/")) or "\\" in path


def load_conversations(path: str, *, split: str = "train", limit: int | None = None,
                       shuffle_seed: int | None = None):
    """A ``datasets.Dataset`` of conversation rows, shuffled (if a seed is given) then limited.

    Local files: ``.jsonl``/``.json`` (one row per line or a JSON list) and ``.parquet``; anything
    else is treated as a hub dataset id (needs network). Rows must carry ``messages`` (OpenAI) or
    ``conversations`` (ShareGPT). Raises ValueError for a missing file, an unknown format, an
    empty dataset or missing conversation columns.
    """
    import datasets

    if _looks_local(path):
        p = Path(path)
        if not p.is_file():
            raise ValueError(f"data file {path!r} does not exist; pass a local .jsonl/.json/"
                             ".parquet file or a hub dataset id")
        builder = _LOCAL_BUILDERS.get(p.suffix)
        if builder is None:
            raise ValueError(f"data file {path!r}: unknown format {p.suffix!r}; use one of "
                             f"{sorted(_LOCAL_BUILDERS)}")
        if not p.read_bytes()[:4096].strip():
            raise ValueError(f"data file {path!r} is empty; nothing to capture")
        try:
            ds = datasets.load_dataset(builder, data_files=str(p), split="train")
        except Exception as err:  # datasets/pyarrow raise many error types for bad files
            raise ValueError(f"data file {path!r} could not be read as {builder} ({err!r}); "
                             "check the file format") from err
    else:
        ds = datasets.load_dataset(path, split=split)
    if len(ds) == 0:
        raise ValueError(f"data {path!r} is empty; nothing to capture")
    if not any(c in ds.column_names for c in _CONVERSATION_COLUMNS):
        raise ValueError(f"data {path!r} has columns {ds.column_names}; expected one of "
                         f"{list(_CONVERSATION_COLUMNS)} (OpenAI messages or ShareGPT format)")
    if shuffle_seed is not None:
        ds = ds.shuffle(seed=shuffle_seed)
    if limit is not None:
        ds = ds.select(range(min(int(limit), len(ds))))
    return ds

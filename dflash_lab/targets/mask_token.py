"""The MASK token id of a drafter, chosen and checked against the target's tokenizer. It fills
block slots 1..B-1 at training and serving (dflash.md section 1), so it must be a token the data
never produces: the tokenizer's declared mask token, another special/added token, or an embedding
row past the tokenizer's vocabulary (Qwen3: 151669, a row of the 151936-row table no text encodes
to). An ordinary vocabulary id would confuse "MASK" with real text, so it is refused.
"""

from __future__ import annotations

import logging

log = logging.getLogger(__name__)

#: Substrings that mark special tokens worth suggesting as a MASK id.
_HINTS = ("mask", "reserved", "unused")


def _added_tokens(tokenizer) -> dict[int, str]:
    """Special and added tokens of ``tokenizer``: id -> text."""
    found = {int(i): str(t) for i, t in getattr(tokenizer, "added_tokens_decoder", {}).items()}
    for text in getattr(tokenizer, "all_special_tokens", []):
        tid = tokenizer.convert_tokens_to_ids(text)
        if tid is not None:
            found.setdefault(int(tid), text)
    return found


def declared_mask_token_id(tokenizer) -> int | None:
    """The tokenizer's ``mask_token`` id, else the one special/added token named like a mask
    (e.g. ``<|mask|>``); None when there is neither (or several candidates)."""
    mask = getattr(tokenizer, "mask_token", None)
    if mask:
        tid = tokenizer.convert_tokens_to_ids(str(mask))
        if tid is not None and tid != tokenizer.unk_token_id:
            return int(tid)
    named = [i for i, t in _added_tokens(tokenizer).items() if "mask" in t.lower()]
    return named[0] if len(named) == 1 else None


def mask_candidates(tokenizer, vocab_size: int, limit: int = 8) -> str:
    """Human-readable MASK id candidates of this tokenizer (never another family's ids)."""
    hints = [f"{i} ({t})" for i, t in sorted(_added_tokens(tokenizer).items())
             if any(h in t.lower() for h in _HINTS)][:limit]
    n = len(tokenizer)
    if n < vocab_size:
        hints.append(f"any id in [{n}, {vocab_size}) (embedding rows no text encodes to)")
    return "; ".join(hints) if hints else "none found: add a special token to the tokenizer"


def resolve_mask_token_id(tokenizer, mask_token_id: int | None, *, vocab_size: int,
                          where: str) -> int:
    """``mask_token_id`` checked, or the tokenizer's declared one when it is None. ``tokenizer``
    None (a config-only stand-in) only range-checks an explicit id; ``where`` names the target.
    ValueError names the value, the target and candidates."""
    if mask_token_id is None:
        found = declared_mask_token_id(tokenizer) if tokenizer is not None else None
        if found is None:
            cands = mask_candidates(tokenizer, vocab_size) if tokenizer is not None else "n/a"
            raise ValueError(f"drafter.mask_token_id is not set and the tokenizer of {where} "
                             f"declares no mask token; set drafter.mask_token_id to a token the "
                             f"data never produces. Candidates: {cands}")
        log.info("MASK token id %d (declared by the tokenizer of %s)", found, where)
        return found
    tid = int(mask_token_id)
    if not 0 <= tid < vocab_size:
        raise ValueError(f"drafter.mask_token_id={tid} is outside the target vocabulary "
                         f"[0, {vocab_size}) of {where}")
    if tokenizer is None or tid >= len(tokenizer) or tid in _added_tokens(tokenizer):
        return tid
    text = tokenizer.convert_ids_to_tokens(tid)
    raise ValueError(f"drafter.mask_token_id={tid} is the ordinary token {text!r} of {where}, "
                     "which the data can produce; use a special/added token or an unused "
                     f"embedding row. Candidates: {mask_candidates(tokenizer, vocab_size)}")

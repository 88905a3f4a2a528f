"""A faithful stand-in for a speculators 0.9.0 offline dataset, written from the tiny target.

What speculators writes, and where it is read from (their venv: /work/main/.venv-speculators):

- the rows: ``speculators prepare-data`` -> ``speculators/data_generation/preprocessing.py``
  ``build_speculator_training_dataset`` / ``_append_row`` (columns ``input_ids`` and
  ``loss_mask`` as int64 lists, ``seq_len`` int64, torch format) saved by
  ``speculators/cli/prepare_data.py`` ``prepare_data`` with ``Dataset.save_to_disk``. The test
  that has their venv runs their CLI itself (``run_their_prepare_data``); :func:`write_rows`
  writes the same columns for the fast tests.
- the states: ``speculators/cli/generate_offline_data.py`` ``_worker`` moves the file vLLM's
  ``ExampleHiddenStatesConnector`` wrote to ``hidden_states/hs_{row}.safetensors``: tensors
  ``hidden_states`` [S, n, H] and ``token_ids`` [S] int64 (their reader:
  ``speculators/train/data.py`` ``ArrowDataset._get_raw_data``; ``hs_connectors/transfer.py``
  ``FileTransfer``). vLLM is not installed here (neither venv has it), so
  :func:`vllm_convention_states` computes those states from the HF target by vLLM's rule, not by
  HF's ``hidden_states`` indexing: id k < L is the residual stream *entering* decoder layer k
  (vLLM's decoder loop appends ``hidden_states + residual`` before layer k), id L the last
  decoder layer's output before the final norm (appended after the loop, before ``self.norm``;
  added by ``scripts/launch_vllm.py --include-last-layer``), in ascending id order.
- FP8: ``hs_connectors/fp8_hidden_states_connector.py`` stores ``hidden_states`` as
  float8_e4m3fn and ``hidden_states_scales`` [S, 1, 1] float32 (``fp8_utils``: scale = amax/448).
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import save_file

from dflash_lab.data.speculators_data import HIDDEN_STATES_DIR, hs_file


def token_rows(target, num: int, seed: int = 3, max_length: int = 64) -> list[dict]:
    """``num`` demo conversations tokenised with the target's chat template: speculator-format
    rows ``{"input_ids": [...], "loss_mask": [0/1, ...]}`` (what prepare-data passes through)."""
    from dflash_lab.targets.chat import tokenize_conversation
    from dflash_lab.targets.demo_corpus import demo_conversations

    rows = []
    for messages in demo_conversations(num, seed=seed):
        tc = tokenize_conversation(target.tokenizer, messages, max_length=max_length)
        rows.append({"input_ids": tc.input_ids.tolist(),
                     "loss_mask": tc.loss_mask.long().tolist()})
    return rows


def write_rows(out_dir: Path, rows: list[dict]) -> None:
    """prepare-data's output directory for ``rows`` (same columns, dtypes and format)."""
    from datasets import Dataset

    table = Dataset.from_dict({"input_ids": [r["input_ids"] for r in rows],
                               "loss_mask": [r["loss_mask"] for r in rows],
                               "seq_len": [len(r["input_ids"]) for r in rows]})
    table.set_format(type="torch")
    table.save_to_disk(str(out_dir))


@torch.no_grad()
def vllm_convention_states(model, input_ids: list[int], their_ids: list[int]) -> torch.Tensor:
    """[S, n, H] in the target's dtype: vLLM's states at ``their_ids`` (sorted) for one row."""
    layers = model.base_model.layers
    L, captured = len(layers), {}

    def entering(k):
        def hook(_module, args, kwargs):
            captured[k] = args[0] if args else kwargs["hidden_states"]
        return hook

    def leaving(_module, _args, output):
        captured[L] = output[0] if isinstance(output, tuple) else output

    handles = [layers[k].register_forward_pre_hook(entering(k), with_kwargs=True)
               for k in their_ids if k < L]
    if L in their_ids:
        handles.append(layers[L - 1].register_forward_hook(leaving))
    try:
        model.base_model(input_ids=torch.tensor([input_ids]), use_cache=False)
    finally:
        for h in handles:
            h.remove()
    return torch.stack([captured[k][0] for k in sorted(their_ids)], dim=1)


def write_states(out_dir: Path, model, rows: list[dict], their_ids: list[int],
                 skip: tuple[int, ...] = (), fp8: bool = False) -> Path:
    """``hidden_states/hs_{row}.safetensors`` for every row not in ``skip``; returns the dir."""
    states_dir = out_dir / HIDDEN_STATES_DIR
    states_dir.mkdir(parents=True, exist_ok=True)
    for i, row in enumerate(rows):
        if i in skip:
            continue
        states = vllm_convention_states(model, row["input_ids"], their_ids)
        tensors = {"hidden_states": states.contiguous(),
                   "token_ids": torch.tensor(row["input_ids"], dtype=torch.int64)}
        if fp8:
            scale = (states.float().abs().amax(dim=(1, 2), keepdim=True) / 448.0).clamp(min=1e-12)
            tensors = {**tensors, "hidden_states": (states.float() / scale).to(
                torch.float8_e4m3fn), "hidden_states_scales": scale}
        save_file(tensors, str(states_dir / hs_file(i)))
    return states_dir


def write_dataset(out_dir: Path, target, their_ids: list[int], num: int = 12,
                  **states_kw) -> list[dict]:
    """A whole speculators directory (rows + states) at ``out_dir``; returns the rows."""
    rows = token_rows(target, num)
    write_rows(out_dir, rows)
    write_states(out_dir, target.model, rows, their_ids, **states_kw)
    return rows

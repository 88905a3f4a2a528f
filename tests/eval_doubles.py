"""Test doubles and fixtures for the speculative loop (no downloads, deterministic).

- :class:`OracleProposer`: drafts the target's own greedy continuation (optionally wrong at
  chosen slots), the upper bound tau == B and a way to force any acceptance pattern.
- :class:`RecordingProposer`: wraps a real proposer, records every round's context length,
  anchor and logits, and can return another proposer's logits instead (real cache, chosen
  acceptance).
- :class:`MarkovTarget` / :class:`MarkovProposer`: a toy target and drafter over a tiny vocab with
  known distributions, for statistical tests of the sampling rules through the real loop.
- :func:`tiny_drafter_for`, :func:`write_serving_dir`, :func:`write_checkpoint`: drafters for the
  built-in tiny target in every format the eval accepts.

Shape legend: n positions, F features, B block size, V vocab.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import torch
from torch import Tensor

from dflash_lab.model.config import DrafterConfig, build_target_layer_ids
from dflash_lab.model.drafter import DFlashDrafter

_BIG = 30.0  # logit margin of the oracle's chosen token


class _ContextCounter:
    """Proposer bookkeeping of test doubles: they only need the context length."""

    _length = 0

    @property
    def context_length(self) -> int:
        return self._length

    def start(self, features_nf: Tensor) -> None:
        self._length = features_nf.shape[1]

    def extend(self, features_nf: Tensor) -> None:
        self._length += features_nf.shape[1]


class OracleProposer(_ContextCounter):
    """Proposes ``sequence[C + t]`` at slot t (``sequence`` = prompt + the target's greedy
    continuation, long enough to cover every block). ``wrong(C, t)`` True makes that slot miss."""

    def __init__(self, sequence: list[int], block_size: int, vocab_size: int,
                 wrong: Callable[[int, int], bool] | None = None):
        self.sequence = list(sequence)
        self.block_size = block_size
        self.vocab_size = vocab_size
        self.wrong = wrong
        self._length = 0


    def propose(self, anchor_id: int) -> Tensor:
        c = self._length
        logits = torch.zeros(self.block_size - 1, self.vocab_size)
        for t in range(1, self.block_size):
            tok = self.sequence[c + t] if c + t < len(self.sequence) else 0
            if self.wrong is not None and self.wrong(c, t):
                tok = (tok + 1) % self.vocab_size
            logits[t - 1, tok] = _BIG
        return logits


class RecordingProposer:
    """Delegates to ``inner``; records (context length, anchor, inner logits) per round and
    returns ``steer``'s logits instead when given (``steer`` sees the same start/extend calls)."""

    def __init__(self, inner, steer=None):
        self.inner = inner
        self.steer = steer
        self.block_size = inner.block_size
        self.num_draft_tokens = getattr(inner, "num_draft_tokens", inner.block_size - 1)
        self.rounds: list[tuple[int, int, Tensor]] = []

    @property
    def context_length(self) -> int:
        return self.inner.context_length

    def start(self, features_nf: Tensor) -> None:
        self.inner.start(features_nf)
        if self.steer is not None:
            self.steer.start(features_nf)

    def extend(self, features_nf: Tensor) -> None:
        self.inner.extend(features_nf)
        if self.steer is not None:
            self.steer.extend(features_nf)

    def propose(self, anchor_id: int) -> Tensor:
        logits = self.inner.propose(anchor_id)
        self.rounds.append((self.inner.context_length, anchor_id, logits))
        return logits if self.steer is None else self.steer.propose(anchor_id)


class MarkovTarget:
    """A toy target: next-token logits depend only on the current token (``log_probs_vv``
    [V, V], row = current token). Implements the TargetRunner interface; features are zeros."""

    def __init__(self, log_probs_vv: Tensor):
        self.table = log_probs_vv
        self.device = torch.device("cpu")
        self.ids: list[int] = []

    @property
    def length(self) -> int:
        return len(self.ids)

    def reset(self) -> None:
        self.ids = []

    def forward(self, ids_n: Tensor, last_only: bool = False):
        from dflash_lab.eval.target_runner import StepOutput

        new = ids_n.view(-1).tolist()
        self.ids.extend(new)
        logits = self.table[torch.tensor(new[-1:] if last_only else new)]
        return StepOutput(logits, torch.zeros(1, len(new), 1))

    def crop(self, length: int) -> None:
        self.ids = self.ids[:length]


class MarkovProposer(_ContextCounter):
    """A toy drafter: slot t's logits are ``tables[t-1][anchor]`` ([B-1, V, V] log-probs)."""

    def __init__(self, tables_kvv: Tensor):
        self.tables = tables_kvv
        self.block_size = tables_kvv.shape[0] + 1
        self._length = 0


    def propose(self, anchor_id: int) -> Tensor:
        return self.tables[:, anchor_id]


def tiny_drafter_for(target, *, block_size: int = 8, num_layers: int = 2, num_inputs: int = 3,
                     seed: int = 0, **overrides) -> DFlashDrafter:
    """An untrained drafter shaped for ``target`` (a loaded Target), MASK = the tiny target's."""
    from dflash_lab.targets.target import text_config
    from dflash_lab.targets.tiny import MASK_TOKEN

    cfg = text_config(target.model.config)
    kwargs = dict(
        hidden_size=cfg.hidden_size, num_hidden_layers=num_layers,
        num_attention_heads=cfg.num_attention_heads, num_key_value_heads=cfg.num_key_value_heads,
        intermediate_size=2 * cfg.hidden_size, vocab_size=cfg.vocab_size,
        mask_token_id=target.token_id(MASK_TOKEN), num_target_layers=cfg.num_hidden_layers,
        target_layer_ids=build_target_layer_ids(cfg.num_hidden_layers, num_inputs),
        block_size=block_size,
    )
    kwargs.update(overrides)
    torch.manual_seed(seed)
    return DFlashDrafter(DrafterConfig.create(source="tiny_drafter_for", **kwargs)).eval()


def write_serving_dir(drafter: DFlashDrafter, path: str | Path, *, zlab_style: bool = False,
                      ) -> Path:
    """config.json + model.safetensors (+ mask_embedding.pt). ``zlab_style`` writes the
    third-party form: no training spec, no ``layer_types``/``is_causal``, implicit causality."""
    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    config = drafter.config.to_dict()
    if zlab_style:
        from dflash_lab.model.config import TRAINING_SPEC_KEY

        for key in (TRAINING_SPEC_KEY, "layer_types", "is_causal", "use_sliding_window",
                    "sliding_window", "max_window_layers"):
            config.pop(key, None)
        config["dflash_config"].pop("causal", None)
    (path / "config.json").write_text(json.dumps(config, indent=2))
    state = {k: v.detach().contiguous() for k, v in drafter.state_dict().items()}
    mask = state.pop("mask_embedding", None)
    save_file(state, str(path / "model.safetensors"))
    if mask is not None:
        torch.save({"embedding": mask, "mask_token_id": drafter.config.mask_token_id},
                   path / "mask_embedding.pt")
    return path


def write_checkpoint(drafter: DFlashDrafter, path: str | Path) -> Path:
    """A Lightning-style ``.ckpt`` as the training module saves it."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    state = {f"drafter.{k}": v.detach().clone() for k, v in drafter.state_dict().items()}
    torch.save({"state_dict": state,
                "hyper_parameters": {"drafter_config": drafter.config.to_dict()}}, path)
    return path


def demo_prompts(path: Path, n: int = 2, seed: int = 21) -> Path:
    """``n`` demo conversations (seed ``seed``) written to ``path`` as a prompts JSONL, one
    ``{"messages": ...}`` row a line, for :func:`cli_eval_report`; returns ``path``."""
    from dflash_lab.targets.demo_corpus import demo_conversations

    path.write_text("".join(json.dumps({"messages": c}) + "\n"
                            for c in demo_conversations(n, seed=seed)))
    return path


def cli_eval_report(monkeypatch, target_dir: str | Path, drafter_dir: str | Path,
                    prompts: str | Path, out: str | Path, *extra: str) -> dict:
    """``dflash-eval`` (the CLI entry point, in process) of ``drafter_dir`` on the first two
    ``prompts`` with the hf target at ``target_dir``, 12 new tokens each (``extra``: more
    overrides): its report.json."""
    import sys

    from dflash_lab.eval import cli

    monkeypatch.setattr(sys, "argv", [
        "dflash-eval", "target=hf", f"target.name_or_path={target_dir}",
        f"drafter.path={drafter_dir}", f"data.path={prompts}", f"output_dir={out}",
        "num_prompts=2", "max_new_tokens=12", "target.device=cpu", "progress=false", *extra])
    cli.main()
    return json.loads((Path(out) / "report.json").read_text())


def assert_lossless_greedy(target, proposer, layers, prompts, max_new_tokens: int,
                           most: int) -> None:
    """Speculative greedy decoding equals the target's own on every prompt, every round keeping
    between 1 and ``most`` tokens."""
    from dflash_lab.eval.loop import DecodeSettings, baseline_generate, speculative_generate
    from dflash_lab.eval.target_runner import TargetRunner

    settings = DecodeSettings(max_new_tokens=max_new_tokens)
    for prompt in prompts:
        spec = speculative_generate(TargetRunner(target.model, layers), proposer, prompt,
                                    settings)
        base = baseline_generate(TargetRunner(target.model), prompt, settings)
        assert spec.output_ids == base.output_ids
        assert all(1 <= n <= most for n in spec.acceptance_lengths)


def proposer_for(target, drafter: DFlashDrafter):
    """The drafter's proposer over the target's own embedding and LM head."""
    from dflash_lab.eval.proposer import DFlashProposer

    pieces = target.pieces()
    return DFlashProposer(drafter, pieces.embed_tokens, pieces.lm_head)


def head_proposer(target, drafter: DFlashDrafter, block: int):
    """A head's drafter in the decode loop: greedy decoding of two demo prompts is lossless
    (:func:`assert_lossless_greedy`); returns its proposer for the head's own checks."""
    from dflash_lab.eval.prompts import encode_prompt
    from dflash_lab.targets.demo_corpus import demo_conversations

    proposer = proposer_for(target, drafter)
    prompts = [encode_prompt(target.tokenizer, c[:1]) for c in demo_conversations(2, seed=5)]
    assert_lossless_greedy(target, proposer, drafter.config.target_layer_ids, prompts, 20, block)
    return proposer


def sampled_draft(target, drafter: DFlashDrafter, block: int):
    """A head's drafter decoding at T = 1 (rejection sampling): 24 tokens, each round keeping
    1..B; returns one block drafted at T = 1 (``tokens`` [B-1], ``probs`` q [B-1, V])."""
    from dflash_lab.eval.loop import DecodeSettings, speculative_generate
    from dflash_lab.eval.prompts import encode_prompt
    from dflash_lab.eval.target_runner import TargetRunner
    from dflash_lab.targets.demo_corpus import demo_conversations

    proposer = proposer_for(target, drafter)
    prompt = encode_prompt(target.tokenizer, demo_conversations(1, seed=7)[0][:1])
    gen = speculative_generate(TargetRunner(target.model, drafter.config.target_layer_ids),
                               proposer, prompt, DecodeSettings(max_new_tokens=24, temperature=1.0),
                               torch.Generator().manual_seed(0))
    assert len(gen.output_ids) >= 24
    assert all(1 <= n <= block for n in gen.acceptance_lengths)
    return proposer.draft(5, block - 1, 1.0, "rejection", torch.Generator().manual_seed(0))


def export_decodes_losslessly(export_dir: Path, target) -> DFlashDrafter:
    """The drafter eval loads from ``export_dir`` decodes [1, 2, 3] greedily exactly as the
    target alone does (24 tokens); returns it for the format's own checks."""
    from dflash_lab.eval.loading import load_drafter

    drafter = load_drafter(export_dir).drafter
    assert_lossless_greedy(target, proposer_for(target, drafter),
                           drafter.config.target_layer_ids, [[1, 2, 3]], 24,
                           drafter.config.block_size)
    return drafter


def refused_then_served(source, out: Path, refused: tuple[str, ...], served: str, dtype: str,
                        match: str) -> Path:
    """Export ``source``: each engine of ``refused`` raises ExportRefused matching ``match``
    before anything is written; then ``served`` writes it. Returns ``out``."""
    import pytest

    from dflash_lab.export.api import ExportRefused, export_drafter

    for engine in refused:
        with pytest.raises(ExportRefused, match=match):
            export_drafter(source, out, engine=engine, dtype=dtype)
        assert not out.exists()  # refused before anything was written
    export_drafter(source, out, engine=served, dtype=dtype)
    return out

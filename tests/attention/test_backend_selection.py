"""The attention backend is chosen by layout, once: packed layouts (training, validation,
features-mode eval) never get flash; the one-block inference layout gets it when available.

On CPU the selection is told it runs on CUDA (``base._is_cuda``) and flash-attn is made
"available" with the emulated kernel (pure torch, flash-attn's documented window semantics)."""

import ast
from functools import partial
from pathlib import Path

import lightning as L
import pytest
import torch

from dflash_lab.attention import base
from dflash_lab.attention import flash as flash_module
from dflash_lab.attention.base import resolve_backend_name
from dflash_lab.attention.flash import FlashBackend
from dflash_lab.attention.flex import FlexBackend
from dflash_lab.attention.sdpa import SdpaBackend
from tests.doubles import emulated_flash_attn_func


def test_resolution_table(monkeypatch):
    assert resolve_backend_name("auto", "cpu", packed=True) == "sdpa"
    assert resolve_backend_name("auto", "cpu", packed=False) == "sdpa"
    monkeypatch.setattr(base, "_is_cuda", lambda device: True)
    monkeypatch.setattr(flash_module, "flash_attn_available", lambda: True)
    assert resolve_backend_name("auto", "cuda", packed=True) == "flex"
    assert resolve_backend_name("auto", "cuda", packed=False) == "flash"
    monkeypatch.setattr(flash_module, "flash_attn_available", lambda: False)
    assert resolve_backend_name("auto", "cuda", packed=False) == "flex"
    assert resolve_backend_name("sdpa", "cuda", packed=True) == "sdpa"
    with pytest.raises(ValueError, match="inference layout only.*backend 'auto'"):
        resolve_backend_name("flash", "cuda", packed=True)


@pytest.fixture
def pretend_cuda_with_flash(monkeypatch):
    """Selection sees CUDA + flash-attn; every backend's prepare() records its name."""
    monkeypatch.setattr(base, "_is_cuda", lambda device: True)
    monkeypatch.setattr(flash_module, "flash_attn_available", lambda: True)
    monkeypatch.setattr(flash_module, "_flash_attn_func", emulated_flash_attn_func)
    used: list[str] = []
    for cls in (SdpaBackend, FlexBackend, FlashBackend):
        original = cls.prepare

        def spy(self, layout, spec, _original=original):
            used.append(self.name)
            return _original(self, layout, spec)

        monkeypatch.setattr(cls, "prepare", spy)
    return used


def _drafter(tiny_target, backend):
    from dflash_lab.train.factory import build_drafter

    torch.manual_seed(0)
    return build_drafter(tiny_target, backend=backend, num_hidden_layers=1, block_size=4,
                         target_layer_ids=[1, 3]).eval()


def _batch(drafter, generator):
    cfg = drafter.config
    s = 24
    ids = torch.randint(cfg.vocab_size - 10, (2, s), generator=generator)
    return {"hidden": torch.randn(2, s, len(cfg.target_layer_ids) * cfg.hidden_size,
                                  generator=generator),
            "input_ids": ids, "loss_mask": torch.ones(2, s, dtype=torch.long),
            "target_argmax": ids.roll(-1, dims=1)}


def test_lightning_validation_with_auto_never_uses_flash(pretend_cuda_with_flash, tiny_target):
    from dflash_lab.train.module import DFlashModule

    module = DFlashModule(_drafter(tiny_target, "auto"), tiny_target.pieces(),
                          partial(torch.optim.AdamW, lr=1e-3), num_anchors=4)
    batches = [_batch(module.drafter, torch.Generator().manual_seed(i)) for i in range(2)]
    trainer = L.Trainer(accelerator="cpu", logger=False, enable_progress_bar=False,
                        enable_checkpointing=False, enable_model_summary=False)
    loader = torch.utils.data.DataLoader(batches, batch_size=None)
    metrics = trainer.validate(module, dataloaders=loader, verbose=False)[0]
    assert metrics["val/tau"] >= 1.0
    assert pretend_cuda_with_flash and set(pretend_cuda_with_flash) == {"flex"}


def test_eval_loop_with_auto_uses_flash_and_matches_sdpa(pretend_cuda_with_flash, tiny_target):
    from dflash_lab.eval.loop import DecodeSettings, speculative_generate
    from dflash_lab.eval.proposer import DFlashProposer
    from dflash_lab.eval.target_runner import TargetRunner

    pieces = tiny_target.pieces()
    prompt = tiny_target.tokenizer("<|im_start|>user\nadd 3 and 4<|im_end|>\n")["input_ids"]
    outputs = {}
    for name in ("auto", "sdpa"):
        pretend_cuda_with_flash.clear()
        drafter = _drafter(tiny_target, name)
        proposer = DFlashProposer(drafter, pieces.embed_tokens, pieces.lm_head)
        runner = TargetRunner(tiny_target.model, drafter.config.target_layer_ids)
        gen = speculative_generate(runner, proposer, prompt, DecodeSettings(max_new_tokens=10))
        outputs[name] = (gen.output_ids, gen.acceptance_lengths)
        assert set(pretend_cuda_with_flash) == {"flash" if name == "auto" else "sdpa"}
    assert outputs["auto"] == outputs["sdpa"]


def test_attention_imports_nothing_from_model():
    """Dependency direction (architecture.md): attention -> model -> train."""
    root = Path(base.__file__).parent
    for path in root.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                assert not node.module.startswith("dflash_lab.model"), (path.name, node.module)

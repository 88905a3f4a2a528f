"""A speculators 0.9.0 XPress checkpoint, written by speculators itself (.venv-speculators), warm
starts our XPress drafter: its ``refiner_head.*`` renamed to vLLM's ``xpress_head.*``
(docs/design/new_heads.md XPress (b)), and our refiner's bias on its weights equals speculators'
own ``XPressRefinerHead.block_bias`` on the same inputs."""

import pytest
import torch
from safetensors.torch import load_file, save_file

from export.formats.speculators import XPRESS_NAMES
from tests.train.test_warm_start import SPEC_PYTHON, qwen3_shape, run_peer_script, warm

_WRITER = """
from safetensors.torch import load_file, save_file
from transformers import Qwen3Config
from speculators.config import SpeculatorsConfig, VerifierConfig
from speculators.proposals.greedy import GreedyTokenProposalConfig
from speculators.models.xpress import XPressDraftModel, XPressSpeculatorConfig
shape, extra = args
spec = SpeculatorsConfig(algorithm="xpress", default_proposal_method="greedy",
    proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=extra["block_size"] - 1)],
    verifier=VerifierConfig(name_or_path="tiny", architectures=["Qwen3ForCausalLM"]))
cfg = XPressSpeculatorConfig(transformer_layer_config=Qwen3Config(**shape),
                             draft_vocab_size=shape["vocab_size"], speculators_config=spec, **extra)
model = XPressDraftModel(cfg)
save_random(model, f"{out}/xpress")
case = load_file(f"{out}/case.safetensors")
with torch.no_grad():
    bias = model.refiner_head.block_bias(case["prev"], hidden_states=case["hidden"])
save_file({"bias": bias.contiguous()}, f"{out}/bias.safetensors")
"""


@pytest.mark.skipif(not SPEC_PYTHON.exists(),
                    reason="needs .venv-speculators (make speculators-venv): speculators 0.9.0")
@pytest.mark.slow
def test_a_speculators_xpress_checkpoint_warm_starts_ours(tiny_target, tmp_path):
    mask = tiny_target.token_id("<|mask|>")
    extra = {"block_size": 4, "mask_token_id": mask, "aux_hidden_state_layer_ids": [2, 4, 6],
             "xpress_rank": 8, "xpress_mlp_ratio": 2, "num_jacobi_passes": 3}
    g = torch.Generator().manual_seed(0)
    case = {"hidden": torch.randn(3, 4, 64, generator=g),
            "prev": torch.randint(0, 768, (3, 4), generator=g)}
    save_file(case, str(tmp_path / "case.safetensors"))
    run_peer_script(SPEC_PYTHON, _WRITER, tmp_path, qwen3_shape(tiny_target), extra)
    saved = load_file(str(tmp_path / "xpress" / "model.safetensors"))
    drafter = warm(tiny_target, tmp_path / "xpress", variant="xpress", xpress_rank=8,
                   xpress_mlp_hidden=16, xpress_num_passes=3)
    c = drafter.config
    assert (c.variant, c.xpress_rank, c.xpress_mlp_hidden, c.xpress_num_passes) == (
        "xpress", 8, 16, 3)
    ours = drafter.state_dict()
    refiner = {k: v for k, v in saved.items() if k.startswith("refiner_head.")}
    assert len(refiner) == 9
    for name, t in refiner.items():
        sub = name[len("refiner_head."):]
        assert torch.equal(ours[f"xpress_head.{XPRESS_NAMES.get(sub, sub)}"], t), name
    with torch.no_grad():
        head = drafter.xpress_head
        bias = head.w2(head.latent(case["prev"], head.hidden_cache(case["hidden"])))
    theirs = load_file(str(tmp_path / "bias.safetensors"))["bias"]
    torch.testing.assert_close(bias, theirs, rtol=1e-5, atol=1e-5 * theirs.abs().max().item())

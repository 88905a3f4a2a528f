"""Smoke tests: every benchmark runs end to end at toy size and reports its ratios.

No timing is asserted (figures come from the benchmark commands, docs/benchmarks.md); these only
keep the scripts working. The peer comparison needs the speculators venv and skips without it.
"""

import json

import pytest

from benchmarks import (
    attention,
    capture,
    draft_latency,
    loss_memory,
    peer_speculators,
    regenerate,
    train_step,
    vllm_server,
)


def _run(module, tmp_path, *extra):
    out = tmp_path / f"{module.__name__}.json"
    record = module.main(["--device", "cpu", "--size", "toy", "--repeats", "1",
                          "--json", str(out), *extra])
    assert json.loads(out.read_text())["benchmark"] == record["benchmark"]
    return record


def test_attention_benchmark(tmp_path):
    rec = _run(attention, tmp_path)
    assert rec["ratios"]["full_bidir"]["dense_mask_bytes / blockmask_bytes"] > 1


def test_loss_memory_benchmark(tmp_path):
    rec = _run(loss_memory, tmp_path)
    assert all(r["max_grad_diff"] < 1e-4 for r in rec["rows"])


def test_train_step_benchmark(tmp_path):
    rec = _run(train_step, tmp_path)
    assert rec["rows"][0]["GFLOP/step"] > 0 and rec["rows"][0]["MFU"] > 0


@pytest.mark.slow
def test_draft_latency_and_capture_benchmarks(tmp_path, tiny_target_dir):
    rec = _run(draft_latency, tmp_path, "--tiny-target", str(tiny_target_dir), "--prompts", "1",
               "--max-new-tokens", "6")
    assert all(r["max_abs_diff"] < 1e-4 for r in rec["draft"])
    assert 0 <= rec["loop"]["overhead_share"] < 1
    rec = _run(capture, tmp_path, "--tiny-target", str(tiny_target_dir))
    assert 1.9 < rec["ratios"]["disk bytes/token float32 / bfloat16"] < 2.1


@pytest.mark.slow
@pytest.mark.skipif(not peer_speculators.SPEC_PYTHON.exists(),
                    reason="needs the speculators venv (make speculators-venv)")
def test_peer_benchmark(tmp_path):
    rec = _run(peer_speculators, tmp_path)
    assert rec["rows"][0]["trainable_params"] == rec["rows"][1]["trainable_params"]


@pytest.mark.slow
@pytest.mark.skipif(not vllm_server.VLLM_PYTHON.exists(),
                    reason="needs the vLLM venv (make vllm-venv; make check-serving covers the "
                           "server backend in CI)")
def test_regenerate_benchmark(tmp_path):
    out = tmp_path / "regenerate.json"
    rec = regenerate.main(["--size", "toy", "--rows", "4", "--max-new-tokens", "16",
                           "--kv-cache-gib", "1", "--json", str(out)])
    assert json.loads(out.read_text())["benchmark"] == "regenerate"
    assert rec["identical"] == rec["conversations"] == 4
    assert all(r["tokens"] > 0 for r in rec["results"])

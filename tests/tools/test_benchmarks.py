"""Smoke tests: every benchmark runs end to end at toy size and reports its ratios.

No timing is asserted (figures come from the benchmark commands, docs/benchmarks.md); these only
keep the scripts working. The peer comparison needs the speculators venv and skips without it.
"""

import json

import pytest
import torch

from benchmarks import (
    attention,
    capture,
    capture_server,
    draft_latency,
    draft_vocab,
    long_rows,
    loss_cost,
    loss_memory,
    packing,
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


def test_loss_cost_benchmark_times_every_loss_against_ce(tmp_path):
    rec = _run(loss_cost, tmp_path, "--losses", "kl", "kl_top64", "accept", "floor")
    rows = {r["loss"]: r for r in rec["rows"]}
    assert set(rows) == {"ce", "kl", "kl_top64", "accept", "floor"}
    assert rows["ce"]["time_vs_ce"] == 1.0 and rows["ce"]["peak_vs_ce"] == 1.0
    assert all(r["step_ms"] > 0 and r["peak_mib"] >= 0 for r in rows.values())


def test_draft_vocab_benchmark_times_each_draft_vocabulary_against_the_full_one(tmp_path):
    rec = _run(draft_vocab, tmp_path, "--vocabs", "smollm2")
    rows = {r["draft_vocab"]: r for r in rec["rows"]}
    assert set(rows) == {"64", "128", "256", "full"}
    assert rows["full"]["draft_vs_full"] == 1.0 and rows["full"]["train_vs_full"] == 1.0
    assert all(r["draft_ms"] > 0 and r["train_ms"] > 0 for r in rows.values())


def test_train_step_benchmark_times_dflash1_and_dflash2_interleaved(tmp_path):
    rec = _run(train_step, tmp_path)
    by = {r["variant"]: r for r in rec["rows"]}
    assert set(by) == {"eager/sdpa/dflash1", "eager/sdpa/dflash2"}
    assert all(r["GFLOP/step"] > 0 and r["MFU"] > 0 for r in rec["rows"])
    # the DFlash 2 row trains the conv and the selector (codebooks), not a DFlash 1 drafter
    two, one = by["eager/sdpa/dflash2"], by["eager/sdpa/dflash1"]
    assert two["trainable_params"] > one["trainable_params"]
    assert rec["ratios"]["dflash2 / dflash1 step, median of paired steps (eager/sdpa)"] > 0
    assert len(rec["step_s"]["eager/sdpa"]["dflash2"]) == 1


def test_train_step_benchmark_times_every_head_against_dflash1(tmp_path):
    from benchmarks.common import head_fields, head_names

    heads = head_names()
    assert {"dflash1", "dflash2", "dspark", "domino", "lilicorr", "lilicorr_conv",
            "xpress"} <= set(heads) and "laguna" not in heads  # laguna: no head, features
    rec = _run(train_step, tmp_path, "--variant", "all", "--no-peak")
    by = {r["variant"].rsplit("/", 1)[1]: r for r in rec["rows"]}
    assert set(by) == set(heads) and all(r["step_ms"] > 0 for r in by.values())
    for h in heads[1:]:  # every head's ratio, and a drafter that is not DFlash 1's
        assert rec["ratios"][f"{h} / dflash1 step, median of paired steps (eager/sdpa)"] > 0
        assert by[h]["trainable_params"] != by["dflash1"]["trainable_params"], h
        assert rec["heads"][h] == head_fields(h)
    # the fields come from conf/drafter/NAME.yaml (LiLiCorr's nulls from its tiny recipe)
    assert head_fields("xpress")["xpress_rank"] == 256
    assert head_fields("lilicorr_conv")["variant"] == "lilicorr"
    assert head_fields("lilicorr_conv")["conv_kernel_size"] == 2
    assert head_fields("lilicorr")["lilicorr_candidate_topk"] == 4


def test_train_step_benchmark_refuses_an_unknown_head(capsys):
    with pytest.raises(SystemExit) as exit_:
        train_step.main(["--device", "cpu", "--size", "toy", "--heads", "dflash3"])
    assert exit_.value.code == 2
    assert "error: head 'dflash3'" in capsys.readouterr().err


def test_packing_benchmark_reports_padding_and_throughput_side_by_side(tmp_path):
    rec = _run(packing, tmp_path, "--lengths", "lognormal", "--limit", "40",
                "--median", "16")
    by = {r["layout"]: r for r in rec["rows"]}
    assert set(by) == {"padded", "packed"} and all(r["tokens/s"] > 0 for r in by.values())
    assert by["packed"]["padding_share"] < by["padded"]["padding_share"]
    assert by["packed"]["batches/epoch"] < by["padded"]["batches/epoch"]
    assert rec["ratios"]["packed / padded tokens/s"] > 0


def test_long_rows_benchmark_measures_each_point_in_its_own_process(tmp_path):
    rec = _run(long_rows, tmp_path, "--lengths", "256,512", "--window", "64")
    by = {(r["layers"], r["tokens"]): r for r in rec["rows"]}
    assert set(by) == {(layers, n) for layers in ("full", "sliding") for n in (256, 512)}
    assert all("error" not in r and r["step_s"] > 0 for r in rec["rows"]), rec["rows"]
    assert by[("sliding", 512)]["queries"] == 2 * by[("sliding", 256)]["queries"]
    assert by[("full", 512)]["peak_x"] > 0 and "peak_x" not in by[("full", 256)]


def test_train_step_dflash2_step_trains_the_selector():
    from benchmarks.train_step import build, make_step

    module, opt, batch = build("toy", torch.device("cpu"), "sdpa", variant="dflash2")
    before = module.drafter.candidate_selector.successor_codebook.detach().clone()
    make_step(module, opt, batch)()
    assert not torch.equal(before, module.drafter.candidate_selector.successor_codebook)


@pytest.mark.slow
def test_draft_latency_and_capture_benchmarks(tmp_path, tiny_target_dir):
    rec = _run(draft_latency, tmp_path, "--tiny-target", str(tiny_target_dir), "--prompts", "1",
               "--max-new-tokens", "6")
    assert all(r["max_abs_diff"] < 1e-4 for r in rec["draft"])
    loops = {r["variant"]: r for r in rec["loops"]}
    assert set(loops) == {"dflash1", "dflash2"}
    assert all(0 <= r["overhead_share"] < 1 and r["drafter_s"] > 0 for r in loops.values())
    assert 0 < loops["dflash2"]["selector_s"] < loops["dflash2"]["drafter_s"]
    assert rec["selector"]["walk_ms"] > 0
    heads = {r["head"]: r for r in rec["heads"]}  # Part A: every head's draft round
    assert set(heads) == set(rec["head_fields"]) and "xpress" in heads
    assert heads["dflash1"]["round / dflash1"] == 1.0
    assert all(r["round_ms"] > 0 for r in heads.values())
    assert heads["dspark"]["drafts"] == heads["dflash1"]["drafts"] + 1  # sample_from_anchor
    rec = _run(capture, tmp_path, "--tiny-target", str(tiny_target_dir))
    assert 1.9 < rec["ratios"]["disk bytes/token float32 / bfloat16"] < 2.1


@pytest.mark.slow
@pytest.mark.skipif(not peer_speculators.SPEC_PYTHON.exists(),
                    reason="needs the speculators venv (make speculators-venv)")
@pytest.mark.parametrize("variant", ["dflash1", "dflash2"])
def test_peer_benchmark(tmp_path, variant):
    rec = _run(peer_speculators, tmp_path, "--variant", variant)
    assert rec["variant"] == variant
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


@pytest.mark.slow
@pytest.mark.skipif(not vllm_server.VLLM_PYTHON.exists(),
                    reason="needs the vLLM venv .venv-vllm (make vllm-venv)")
def test_capture_server_benchmark(tmp_path):
    out = tmp_path / "capture_server.json"
    rec = capture_server.main(["--size", "toy", "--rows", "4", "--max-length", "256",
                               "--kv-cache-gib", "1", "--json", str(out)])
    assert json.loads(out.read_text())["benchmark"] == "capture_server"
    assert rec["argmax_equal"] == rec["tokens"] > 0 and rec["max_abs_diff"] <= 1e-4
    assert all(r["tokens"] == rec["tokens"] for r in rec["results"])

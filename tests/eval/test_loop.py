"""The speculative loop on the tiny target: losslessness, oracle tau, cache bookkeeping."""

from __future__ import annotations

import pytest
import torch

from dflash_lab.eval.loop import DecodeSettings, baseline_generate, speculative_generate
from dflash_lab.eval.prompts import encode_prompt
from dflash_lab.eval.proposer import DFlashProposer
from dflash_lab.eval.report import generation_report
from dflash_lab.eval.target_runner import TargetRunner
from dflash_lab.targets.demo_corpus import demo_conversations
from dflash_lab.targets.features import extract_features
from tests.eval_doubles import OracleProposer, RecordingProposer, tiny_drafter_for

B = 6




@pytest.fixture(scope="module")
def prompts(tiny_target):
    convs = demo_conversations(3, seed=11)
    return [encode_prompt(tiny_target.tokenizer, c[:1]) for c in convs]


@pytest.fixture(scope="module")
def drafter(tiny_target):
    return tiny_drafter_for(tiny_target, block_size=B)


@pytest.fixture(scope="module")
def proposer(tiny_target, drafter):
    pieces = tiny_target.pieces()
    return DFlashProposer(drafter, pieces.embed_tokens, pieces.lm_head)


def runner(tiny_target, drafter):
    return TargetRunner(tiny_target.model, drafter.config.target_layer_ids)


def greedy_sequence(tiny_target, prompt: list[int], n: int) -> list[int]:
    """prompt + the target's first n greedy tokens (no stop tokens)."""
    out = baseline_generate(TargetRunner(tiny_target.model), prompt, DecodeSettings(n))
    return prompt + out.output_ids


@pytest.mark.parametrize("stop", [False, True], ids=["no_stop", "eos_stop"])
def test_untrained_drafter_is_lossless(tiny_target, drafter, proposer, prompts, stop):
    eos = (tiny_target.tokenizer.eos_token_id,) if stop else ()
    settings = DecodeSettings(max_new_tokens=30, stop_token_ids=eos)
    target = runner(tiny_target, drafter)
    for prompt in prompts:
        spec = speculative_generate(target, proposer, prompt, settings)
        base = baseline_generate(TargetRunner(tiny_target.model), prompt, settings)
        assert spec.output_ids == base.output_ids
        assert len(spec.output_ids) == 1 + sum(spec.acceptance_lengths)
        assert all(1 <= n <= B for n in spec.acceptance_lengths)
        assert len(spec.draft_seconds) == len(spec.verify_seconds) == len(spec.acceptance_lengths)
        if not stop:
            assert len(spec.output_ids) == 30


def test_oracle_reaches_block_size(tiny_target, drafter, prompts):
    rounds = 4
    prompt = prompts[0]
    seq = greedy_sequence(tiny_target, prompt, 1 + rounds * B + B)
    oracle = OracleProposer(seq, B, tiny_target.vocab_size)
    settings = DecodeSettings(max_new_tokens=1 + rounds * B)
    spec = speculative_generate(runner(tiny_target, drafter), oracle, prompt, settings)
    assert spec.acceptance_lengths == [B] * rounds
    assert spec.output_ids == seq[len(prompt):len(prompt) + 1 + rounds * B]


def _wrong(c: int, t: int) -> bool:
    """A fixed, varied miss pattern: every acceptance length 1..B occurs."""
    return (c * 7 + t * 3) % 11 == 0 or t == 1 + c % B


def test_partial_oracle_acceptance_and_output(tiny_target, drafter, prompts):
    prompt = prompts[1]
    seq = greedy_sequence(tiny_target, prompt, 60 + B)
    oracle = OracleProposer(seq, B, tiny_target.vocab_size, wrong=_wrong)
    recorder = RecordingProposer(oracle)
    spec = speculative_generate(runner(tiny_target, drafter), recorder, prompt,
                                DecodeSettings(max_new_tokens=60))
    assert spec.output_ids == seq[len(prompt):len(prompt) + 60]
    for (c, anchor, _), n in zip(recorder.rounds[:-1], spec.acceptance_lengths):
        expected = 1 + next((t - 1 for t in range(1, B) if _wrong(c, t)), B - 1)
        assert anchor == seq[c]
        assert n == expected
    assert len(set(spec.acceptance_lengths)) >= 3  # the caches were cropped to varied lengths


def test_caches_equal_recomputing_from_scratch(tiny_target, drafter, proposer, prompts):
    """Real drafter cache + target KV cache across many rounds of varied acceptance (steered by
    a partial oracle) vs features recomputed from scratch for every round's context."""
    prompt = prompts[2]
    seq = greedy_sequence(tiny_target, prompt, 48 + B)
    steer = OracleProposer(seq, B, tiny_target.vocab_size, wrong=_wrong)
    recorder = RecordingProposer(proposer, steer=steer)
    target = runner(tiny_target, drafter)
    spec = speculative_generate(target, recorder, prompt, DecodeSettings(max_new_tokens=48))
    assert spec.output_ids == seq[len(prompt):len(prompt) + 48]
    assert len(recorder.rounds) >= 10
    ids = drafter.config.target_layer_ids
    full = extract_features(tiny_target.model, torch.tensor([seq]), ids).hidden_bsf
    for c, anchor, logits in recorder.rounds:
        fresh = drafter.new_cache()
        drafter.extend_context(fresh, full[:, :c])
        hidden = drafter.draft(fresh, torch.tensor([anchor]), proposer.embed_tokens)[0, 1:]
        torch.testing.assert_close(logits, proposer.lm_head(hidden).float(), atol=1e-4, rtol=1e-4)
    # the target's KV cache after the last crop equals a fresh prefill of the same tokens
    fresh = TargetRunner(tiny_target.model)
    fresh.forward(torch.tensor(seq[:target.length]))
    for got, want in zip(target.cache.layers, fresh.cache.layers):
        torch.testing.assert_close(got.keys, want.keys, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(got.values, want.values, atol=1e-5, rtol=1e-5)


def test_smaller_block_size(tiny_target, drafter, prompts):
    pieces = tiny_target.pieces()
    small = DFlashProposer(drafter, pieces.embed_tokens, pieces.lm_head, block_size=3)
    assert small.block_size == 3 and small.drafter.config.block_size == 3
    settings = DecodeSettings(max_new_tokens=20)
    spec = speculative_generate(runner(tiny_target, drafter), small, prompts[0], settings)
    base = baseline_generate(TargetRunner(tiny_target.model), prompts[0], settings)
    assert spec.output_ids == base.output_ids
    with pytest.raises(ValueError, match="block_size=7"):
        DFlashProposer(drafter, pieces.embed_tokens, pieces.lm_head, block_size=B + 1)


@pytest.mark.parametrize("mode", ["exact_match", "rejection"])
def test_sampling_on_tiny_target_is_seeded(tiny_target, drafter, proposer, prompts, mode):
    settings = DecodeSettings(max_new_tokens=16, temperature=0.8, sampling=mode)
    target = runner(tiny_target, drafter)
    runs = [speculative_generate(target, proposer, prompts[0], settings,
                                 torch.Generator().manual_seed(3)) for _ in range(2)]
    assert runs[0].output_ids == runs[1].output_ids
    assert len(runs[0].output_ids) == 1 + sum(runs[0].acceptance_lengths) == 16


def test_generation_report_fields(tiny_target, drafter, proposer, prompts):
    settings = DecodeSettings(max_new_tokens=12)
    target = runner(tiny_target, drafter)
    spec = [speculative_generate(target, proposer, p, settings) for p in prompts[:2]]
    base = [baseline_generate(TargetRunner(tiny_target.model), p, settings) for p in prompts[:2]]
    spec[1].acceptance_lengths = [1, 3, B]  # known values for the pooled metrics
    report = generation_report(spec, base, prompts[:2], B, {"temperature": 0.0, "block_size": B})
    for key in ("tau_mean", "tau_per_prompt", "acceptance_lengths", "per_position_acceptance",
                "lossless", "tokens_per_second", "baseline_tokens_per_second", "speedup",
                "draft_ms_per_round", "verify_ms_per_round", "prompt_ids", "outputs",
                "settings"):
        assert key in report
    pooled = spec[0].acceptance_lengths + [1, 3, B]
    assert report["tau_mean"] == pytest.approx(sum(pooled) / len(pooled))
    assert report["tau_per_prompt"][1] == pytest.approx((1 + 3 + B) / 3)
    assert report["per_position_acceptance"][0] == pytest.approx(2 / len(pooled))
    assert report["per_position_acceptance"][B - 2] == pytest.approx(1 / len(pooled))
    assert report["lossless"] is True and report["prompt_ids"] == prompts[:2]
    assert report["speedup"] == pytest.approx(
        report["tokens_per_second"] / report["baseline_tokens_per_second"])
    base[0].output_ids = base[0].output_ids[:-1] + [base[0].output_ids[-1] + 1]
    report = generation_report(spec, base, prompts[:2], B, {"temperature": 0.0, "block_size": B})
    assert report["lossless"] is False and report["mismatched_prompts"] == [0]


# ------------------------------------------------------------- issue 47: honest timing
def test_baseline_and_speculative_runs_alternate_per_prompt(tiny_target, drafter, proposer,
                                                           prompts, monkeypatch):
    """Interleaved per prompt, and which runs first alternates, so neither side always gets
    the warmer caches or the quieter moment; the outputs are unchanged (still lossless)."""
    from dflash_lab.eval import evaluate

    calls = []
    for name in ("speculative_generate", "baseline_generate"):
        real = getattr(evaluate, name)
        monkeypatch.setattr(evaluate, name, lambda *a, _r=real, _n=name[:4], **k:
                            calls.append(_n) or _r(*a, **k))
    spec, base = evaluate.evaluate_prompts(tiny_target.model, proposer,
                                           drafter.config.target_layer_ids, prompts,
                                           DecodeSettings(12), progress=False)
    assert calls == ["spec", "base", "base", "spec", "spec", "base"]
    assert [s.output_ids for s in spec] == [b.output_ids for b in base]


def test_the_thread_count_is_chosen_deliberately(monkeypatch):
    """threads=auto is torch's default (physical cores or OMP_NUM_THREADS) capped at 4 and at
    the idle CPUs (1 on a busy machine); an int is taken as it is; anything else is refused
    naming the value."""
    import os

    from dflash_lab.eval.loop import MAX_AUTO_THREADS, TORCH_DEFAULT_THREADS, set_threads

    before = torch.get_num_threads()
    try:
        monkeypatch.setattr(os, "getloadavg", lambda: (0.0, 0.0, 0.0))
        idle = min(TORCH_DEFAULT_THREADS, MAX_AUTO_THREADS, os.cpu_count())
        assert set_threads("auto") == torch.get_num_threads() == idle
        monkeypatch.setattr(os, "getloadavg", lambda: (os.cpu_count() + 2.0, 1.0, 1.0))
        assert set_threads("auto") == 1
        assert set_threads(3) == torch.get_num_threads() == 3
        for bad in (0, "many", True, 1.5):
            with pytest.raises(ValueError, match=f"threads={bad!r}: use auto or an int"):
                set_threads(bad)
    finally:
        torch.set_num_threads(before)


def test_a_loaded_machine_is_recorded_and_warned_about(monkeypatch):
    """Issue 47: 2 busy cores made one eval 12x slower and changed its speedup without a word.
    The load average before and after the timed loops is recorded; above the CPU count, a
    warning says the timings are unreliable."""
    import os

    from dflash_lab.eval.loop import machine_load

    cpus = os.cpu_count()
    monkeypatch.setattr(os, "getloadavg", lambda: (0.5, 0.4, 0.3))
    quiet = machine_load(machine_load({"threads": 2}))
    assert quiet["load_average"] == [[0.5, 0.4, 0.3]] * 2 and "warning" not in quiet
    assert (quiet["threads"], quiet["cpus"]) == (2, cpus)
    monkeypatch.setattr(os, "getloadavg", lambda: (cpus + 3.0, 1.0, 1.0))
    busy = machine_load(quiet)
    assert busy["warning"].startswith(f"load average {cpus + 3.0} > {cpus} CPUs")
    assert "unreliable" in busy["warning"]

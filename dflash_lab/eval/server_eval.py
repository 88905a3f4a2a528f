"""``dflash-eval backend=server``: the configured dataset(s) through a serving engine, response
by response as the local loop runs them (:func:`~dflash_lab.eval.suite.answer_every_prompt`),
into the same records and report fields plus the engine's own curves. The client, what each
engine reports and the tokens-per-round convention: :mod:`dflash_lab.serving.engine`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hydra.utils import instantiate

from dflash_lab.eval.records import ResponseRecord, context_buckets, mean_of
from dflash_lab.eval.report import records_report
from dflash_lab.eval.suite import (
    answer_every_prompt,
    budget,
    data_configs,
    dataset_name,
    items_before_target,
    items_with_target,
)
from dflash_lab.serving.engine import (
    EngineClient,
    Sampling,
    ServerResponse,
)
from dflash_lab.serving.launch import client_of
from dflash_lab.serving.settings import server_settings
from dflash_lab.targets.chat import target_stop_ids


def _engine_curves(responses: list[ServerResponse], block_size: int) -> dict[str, Any]:
    """Histogram (rounds by acceptance length 1..B) and per-position acceptance from the engine's
    own counts over ``responses``; n/a and zeros unless every response with rounds brought them."""
    counted = [r for r in responses if r.rounds]
    row: dict[str, Any] = {"engine_tau_mean": mean_of([r.engine_tau for r in counted])}
    if not counted or any(r.accepted_histogram is None for r in counted):
        return {**row, "acceptance_histogram": [0] * block_size,
                "per_position_acceptance": [None] * (block_size - 1),
                "acceptance_histogram_from_engine": False}
    hist = [sum(r.accepted_histogram[j] for r in counted if j < len(r.accepted_histogram))
            for j in range(block_size)]
    rounds = sum(hist)
    return {**row, "acceptance_histogram": hist,
            "per_position_acceptance": [sum(hist[t:]) / rounds if rounds else None
                                        for t in range(1, block_size)],
            "acceptance_histogram_from_engine": True}


def server_report(responses: list[ServerResponse], records: list[ResponseRecord],
                  prompt_ids: list[list[int]], block_size: int,
                  settings: dict[str, Any]) -> dict[str, Any]:
    """report.json for ``backend=server`` from each response (every dataset, every turn): the
    offline report's fields from the records (:func:`records_report`; ``tau_mean`` = the pooled
    tau, as offline), the engine's own curves and tau."""
    report: dict[str, Any] = {"mode": "server", **records_report(
        records, block_size, settings.get("context_buckets"))}
    report["tau_mean"] = report["tau_pooled"]
    report.update(_engine_curves(responses, block_size))
    for name, row in report["datasets"].items():
        row.update(_engine_curves([r for r, rec in zip(responses, records)
                                   if rec.dataset == name], block_size))
    seconds = sum(r.seconds for r in responses)
    outputs = sum(r.num_output_tokens for r in responses)
    report.update({
        "num_rounds": sum(r.rounds for r in responses),
        "tokens_per_second": outputs / seconds if seconds > 0 else None,
        "num_prompts": len(responses), "num_output_tokens": outputs,
        "engine_responses": [r.engine_fields() for r in responses],
        "prompt_ids": prompt_ids, "outputs": [r.output_ids for r in responses],
        "settings": settings})
    return report


@dataclass
class EngineResponder:
    """A serving engine's client as a :class:`~dflash_lab.eval.suite.Responder`: each prompt
    is one request with the local eval's settings; a later turn follows the engine's answer."""

    client: EngineClient
    tokenizer: Any
    cfg: Any
    stops: tuple[int, ...]
    on_prompt: Any = None
    responses: list[ServerResponse] = field(default_factory=list)

    def warm(self, ids: list[int], max_new: int) -> None:
        # untimed; its rounds fall outside every measured counter delta
        self.client.generate(ids, self._sampling(0, 8))

    def _sampling(self, n: int, max_tokens: int) -> Sampling:
        """Response n's request: the local eval's settings; T > 0 seeds with seed + n."""
        return Sampling(max_tokens, float(self.cfg.temperature), tuple(self.stops),
                        ignore_eos=not self.cfg.stop_on_eos,
                        seed=self.cfg.seed + n if self.cfg.temperature > 0 else None)

    def respond(self, ids: list[int], max_new: int, where) -> tuple[ResponseRecord, str]:
        resp = self.client.generate(ids, self._sampling(len(self.responses), max_new))
        if self.on_prompt is not None:
            self.on_prompt(len(self.responses), resp)
        self.responses.append(resp)
        text = (self.tokenizer.decode(resp.output_ids, skip_special_tokens=True)
                if resp.output_ids is not None else resp.text or "")
        # totals only (engines give no per-round lengths); round tokens = output tokens - 1 (the
        # first is the prefill's), tau :attr:`ServerResponse.tau`
        record = ResponseRecord(
            dataset=where.dataset, index=where.index, turn=where.turn, prompt_tokens=len(ids),
            num_output_tokens=resp.num_output_tokens, num_rounds=resp.rounds,
            num_round_tokens=max(resp.num_output_tokens - 1, 0) if resp.rounds else 0,
            ttft_s=resp.ttft_s, tpot_s=resp.tpot_s)
        return record, text


def run_server(cfg, on_prompt=None) -> dict[str, Any]:
    """``dflash-eval backend=server``: the configured dataset(s) through the engine -> report.
    ``on_prompt(n, response)`` is called after each response (the logger's per-prompt tau)."""
    settings = server_settings(cfg.get("server"))
    configs = data_configs(cfg)
    budgets = [budget(cfg, d) for d in configs]
    items = items_before_target(configs, cfg.num_prompts)  # a bad file: before the engine
    target = instantiate(cfg.target)  # tokenizer, chat template and stop ids of the local eval
    items = items_with_target(configs, items, cfg.num_prompts, target, budgets)
    stops = tuple(target_stop_ids(target)) if cfg.stop_on_eos else ()
    with client_of(settings, Path(cfg.output_dir) / "server.log", EngineClient) as client:
        info = client.connect()
        responder = EngineResponder(client, target.tokenizer, cfg, stops, on_prompt)
        records, asked = answer_every_prompt(responder, target.tokenizer, configs, items,
                                             budgets, warm=bool(cfg.warmup),
                                             progress=cfg.progress, label="dflash-eval server")
    names = [dataset_name(d) for d in configs]
    record = {"backend": "server", "engine": settings.engine, "url": settings.url,
              "served_model": info["model"], "served_root": info["root"],
              "launch": settings.launch, "stream": settings.stream,
              "target": target.name_or_path, "block_size": info["block_size"],
              "suite": cfg.get("suite"), "datasets": names,
              "data": [str(d.get("path") or d.get("hub_id")) for d in configs],
              "max_new_tokens": dict(zip(names, budgets)), "num_prompts": cfg.num_prompts,
              "temperature": cfg.temperature, "seed": cfg.seed,
              "sampling": "engine" if cfg.temperature > 0 else "greedy",
              "chat_template": configs[0].chat_template,
              "enable_thinking": configs[0].get("enable_thinking"),
              "stop_token_ids": list(stops), "context_buckets": context_buckets(cfg)}
    return server_report(responder.responses, records, asked, info["block_size"], record)

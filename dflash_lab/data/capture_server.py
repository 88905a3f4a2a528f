"""Capture features from a serving engine (``capture.backend=server``): the served aux layers
(:func:`~dflash_lab.serving.hidden_states.server_layer_ids`) become exactly what
:func:`~dflash_lab.targets.features.extract_features` produces in process, labels from the target's
final norm and LM head on the last layer (docs/capture.md, "Capture from a serving engine").
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch

from dflash_lab.data import shards
from dflash_lab.serving.hidden_states import (
    open_hidden_states_server,
    server_args,
    server_layer_ids,
)
from dflash_lab.serving.settings import ServerSettings, server_settings
from dflash_lab.targets.features import (
    TargetFeatures,
    check_target_layer_ids,
    chunked_argmax,
    chunked_topk,
)

log = logging.getLogger(__name__)
#: capture.backend values: the target runs here, or a vLLM server gives the hidden states.
BACKENDS = ("local", "server")


def served_features(states_tkh: torch.Tensor, aux_layer_ids: list[int],
                    target_layer_ids: list[int], pieces, topk: int = 0) -> TargetFeatures:
    """One sequence's features (no batch axis) from ``states_tkh`` [T, k, H], the served states of
    ``aux_layer_ids`` (vLLM ids, ascending; the last, ``num_hidden_layers``, is the final state
    before the norm), with the target's ``pieces`` (TargetPieces): ``hidden_bsf`` [T, nL*H] in
    ``target_layer_ids`` order (z-lab id i = vLLM id i + 1), ``argmax_bs`` [T], final-normed
    ``last_bsh`` [T, H] and, with ``topk``, the top-k ids and log-probabilities [T, k]."""
    where = {vllm_id: n for n, vllm_id in enumerate(aux_layer_ids)}
    hidden = torch.cat([states_tkh[:, where[int(i) + 1]] for i in target_layer_ids], dim=-1)
    head = pieces.lm_head.weight
    last = states_tkh[:, where[max(aux_layer_ids)]].to(head.device, head.dtype)
    with torch.no_grad():
        normed = pieces.norm(last)
    argmax = chunked_argmax(pieces.lm_head, normed)
    top = (chunked_topk(pieces.lm_head, normed, topk, pieces.logit_softcap) if topk
           else (None, None))
    return TargetFeatures(hidden, argmax, normed, *top)


def server_capture_batch(server, pieces, batch, settings) -> list[shards.CapturedSample]:
    """:func:`~dflash_lab.data.capture_loop._capture_batch` through a server: ``batch`` [(row id,
    TokenizedConversation)] goes out as concurrent requests, each answer a sample. The engine's
    greedy token after each prompt is checked against the label computed here
    (``server.argmax_checks``): a server extracting other layers or serving another model fails."""
    answers = server.hidden_states_many([tc.input_ids.tolist() for _, tc in batch])
    dtype = shards.HIDDEN_DTYPES[settings.hidden_dtype]
    topk = settings.distribution_topk if "topk" in settings.distribution else 0
    keep_last = "last_hidden" in settings.distribution
    out = []
    for (row_id, tc), answer in zip(batch, answers):
        f = served_features(answer.hidden_states, server.aux_layer_ids,
                            settings.target_layer_ids, pieces, topk)
        count_argmax_check(server, int(f.argmax_bs[-1]), answer.next_token, row_id)
        out.append(shards.CapturedSample(
            row_id, tc.input_ids, tc.loss_mask, f.hidden_bsf.to(dtype), f.argmax_bs,
            f.last_bsh.to(dtype) if keep_last else None, f.top_ids_bsk, f.top_logprobs_bsk))
    return out


def count_argmax_check(server, ours: int, engine: int | None, row_id: int) -> None:
    """Count (on ``server.argmax_checks``: [checked, differing]) whether the label computed
    here for the last prompt position equals the engine's greedy token there. A difference is
    logged: in float32 it means another layer or model; in bf16 it can be a near tie."""
    checks = server.argmax_checks
    if engine is None:
        return
    checks[0] += 1
    if ours != engine:
        checks[1] += 1
        log.warning("row %d: the label at the last position is %d here but the engine's own "
                    "greedy token is %d (a near tie in low precision, or the server serves "
                    "another model or layers)", row_id, ours, engine)


# -- the run: settings, server, start-up check -------------------------------------------------
def make_server_settings(cfg) -> ServerSettings | None:
    """The ``server`` group for ``capture.backend=server``, None for ``local``."""
    backend = cfg.capture.get("backend", "local")
    if backend not in BACKENDS:
        raise ValueError(f"capture.backend={backend!r}: use local (the target runs here) or "
                         "server (a vLLM server gives the hidden states: server.url or "
                         "server.launch, conf/server/default.yaml)")
    return None if backend == "local" else server_settings(cfg.server)


def open_capture_server(settings: ServerSettings, target, capture, world_size: int = 1):
    """:func:`~dflash_lab.serving.hidden_states.open_hidden_states_server` for this capture: its aux
    layers, the connector's files in ``OUT/server_hidden_states``, output in ``OUT/server.log``."""
    out = Path(capture.out_dir)
    check_target_layer_ids(capture.target_layer_ids, target.num_hidden_layers)
    width = capture.target_hidden_size
    if width is not None and int(width) != target.hidden_size:
        raise ValueError(f"capture.target_hidden_size={width}: capture.backend=server gives "
                         f"each layer's state {target.hidden_size} wide (the engine's stream "
                         "mean on a multi-stream target); use capture.target_hidden_size=null "
                         "or capture.backend=local for the flattened streams")
    aux = server_layer_ids(capture.target_layer_ids, target.num_hidden_layers)
    return open_hidden_states_server(settings, aux, target.hidden_size,
                                     out / "server_hidden_states", out / "server.log",
                                     world_size)


#: Probe prompt for the start-up check (any text: only its ids and the engine's answer matter).
PROBE_TEXT = "The capital of France is Paris. The capital of Italy is"


def check_server(server, target, max_length: int) -> dict[str, Any]:
    """Before any shard: one served model fits ``max_length`` + 1 tokens (a request generates
    one), returns hidden states of the expected shape, and its greedy token after a probe is among
    the 5 likeliest labels computed here from its last layer (another model or layer count fails;
    vLLM reports no layer ids, so a wrong set of the right size may pass). Returns engine,
    engine_version, engine_model, engine_dtype (the states' dtype) for the plan."""
    card = server.connect(max_length, "capture.max_length")
    if card["max_model_len"] is not None and max_length >= card["max_model_len"]:
        # vLLM refuses a prompt that leaves no room for the one token each request generates
        raise ValueError(f"capture.max_length={max_length} needs a server with max_model_len >= "
                         f"{max_length + 1} (the prompt plus the one token a request generates); "
                         f"it has {card['max_model_len']}: lower capture.max_length or restart "
                         f"the server with --max-model-len {max_length + 1}")
    ids = target.tokenizer(PROBE_TEXT, add_special_tokens=True)["input_ids"]
    answer = server.hidden_states(ids)
    f = served_features(answer.hidden_states, server.aux_layer_ids,
                        [server.aux_layer_ids[0] - 1], target.pieces(), topk=5)  # z-lab id
    top5 = [int(t) for t in f.top_ids_bsk[-1]]
    if answer.next_token is not None and answer.next_token not in top5:
        raise ValueError(
            f"{server.base}: the engine's greedy token after the probe is {answer.next_token} "
            f"but the labels from its last served layer (aux id {max(server.aux_layer_ids)}) "
            f"rank {top5} first: the server extracts other layers, or serves another model "
            f"than target.name_or_path={target.name_or_path!r}; serve that model with "
            f"{server_args(server.aux_layer_ids, 'DIR')}")
    version = server.version()
    log.info("capture.backend=server: %s serves %s (vLLM %s, hidden states %s, aux layers %s)",
             server.base, card["model"], version, answer.hidden_states.dtype,
             server.aux_layer_ids)
    return {"engine": "vllm", "engine_version": version, "engine_model": card["model"],
            "engine_dtype": str(answer.hidden_states.dtype).removeprefix("torch.")}


def log_argmax_checks(server) -> None:
    """The run's count of labels that equal the engine's own greedy token at the last position."""
    checked, differing = server.argmax_checks
    log.info("labels vs the engine's own greedy token (last position of each prompt): %d of %d "
             "equal", checked - differing, checked)

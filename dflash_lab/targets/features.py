"""Target feature extraction: THE function used by offline capture, online training and eval.
Layer id i (z-lab convention) is the OUTPUT of decoder layer i = HF ``hidden_states[i + 1]``; a
multi-stream target's layer feature is :func:`layer_features`: the stream mean (T = H, what the
engines feed) or the flattened streams (T = n*H) (docs/targets.md, "Multi-stream targets").

Shape legend: Bt batch, S sequence length, H target hidden size, n streams (``hc_mult``), T the
per-layer feature width (``target_hidden_size``), nL = len(target_layer_ids), F = nL*T, V vocab.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from dflash_lab.targets.target import logit_softcap, text_config


class TargetFeatures(NamedTuple):
    """``hidden_bsf`` [Bt, S, F = nL*H] (target dtype, ``target_layer_ids`` order), ``argmax_bs``
    [Bt, S] int64 (the greedy next token), and for the distribution losses (docs/capture.md)
    ``last_bsh`` [Bt, S, H] (final-normed last state), optionally top-k ``top_ids_bsk`` [Bt, S, k]
    int64 and ``top_logprobs_bsk`` [Bt, S, k] fp32 (full-vocabulary, best first)."""

    hidden_bsf: torch.Tensor
    argmax_bs: torch.Tensor
    last_bsh: torch.Tensor | None = None
    top_ids_bsk: torch.Tensor | None = None
    top_logprobs_bsk: torch.Tensor | None = None


@torch.no_grad()
def chunked_topk(lm_head: torch.nn.Module, normed_bsh: torch.Tensor, k: int,
                 softcap: float | None = None,
                 chunk_tokens: int = 512) -> tuple[torch.Tensor, torch.Tensor]:
    """The top-k ids [Bt, S, k] and log-probabilities [Bt, S, k] (fp32, over the whole
    vocabulary, softcap applied) of the target's next token, in chunks of positions."""
    flat = normed_bsh.reshape(-1, normed_bsh.shape[-1])
    ids = torch.empty(flat.shape[0], k, dtype=torch.long, device=flat.device)
    logprobs = torch.empty(flat.shape[0], k, dtype=torch.float32, device=flat.device)
    for start in range(0, flat.shape[0], chunk_tokens):
        logits = lm_head(flat[start:start + chunk_tokens]).float()
        if softcap is not None:
            logits = torch.tanh(logits / softcap) * softcap
        values, top = logits.log_softmax(-1).topk(k, dim=-1)
        ids[start:start + chunk_tokens], logprobs[start:start + chunk_tokens] = top, values
    shape = (*normed_bsh.shape[:-1], k)
    return ids.view(shape), logprobs.view(shape)


def num_streams(config) -> int:
    """n residual streams of a multi-stream target (``hc_mult``, Qwen4-exp ``hc_count``), else 1."""
    text = text_config(config)
    return int(getattr(text, "hc_mult", None) or getattr(text, "hc_count", None) or 1)


def stream_widths(config) -> tuple[int, ...]:
    """The per-layer feature widths a drafter of this target can read: (H,) for an ordinary
    target; (H, n*H) for a multi-stream one (stream mean, flattened streams)."""
    hidden, n = int(text_config(config).hidden_size), num_streams(config)
    return (hidden,) if n == 1 else (hidden, n * hidden)


def check_feature_width(config, target_hidden_size: int | None, where: str) -> int:
    """``target_hidden_size`` (None = H) if the target gives it, else ValueError naming widths."""
    widths = stream_widths(config)
    width = widths[0] if target_hidden_size is None else int(target_hidden_size)
    if width not in widths:
        fix = (f"{widths[0]}, the target's hidden_size (leave it unset: null is that width)"
               if len(widths) == 1 else
               f"{widths[0]} (the mean of its {num_streams(config)} streams, what vLLM and "
               f"SGLang feed a drafter) or {widths[1]} (the flattened streams)")
        raise ValueError(f"{where}={width}: the target gives features {list(widths)} wide per "
                         f"layer; use {fix}")
    return width


def check_layer_ids_for_streams(config, target_layer_ids: list[int]) -> None:
    """Refuse the last layer's id on a multi-stream target: transformers ties ``hidden_states[L]``
    to the collapsed, normed final state (hc_head), not the streams the engines average."""
    last = int(text_config(config).num_hidden_layers) - 1
    if num_streams(config) > 1 and last in [int(i) for i in target_layer_ids]:
        raise ValueError(f"target_layer_ids={list(target_layer_ids)}: id {last} (the last "
                         "layer) of a multi-stream target has no stream output in transformers "
                         "(hidden_states[-1] is the collapsed final state); pick ids below it")


def layer_features(state: torch.Tensor, width: int) -> torch.Tensor:
    """One target layer's output as a drafter reads it: [Bt, S, T = width]. ``state``: HF
    ``hidden_states[i + 1]``, [Bt, S, H] or, multi-stream, [Bt, S, n, H]; width H takes the
    streams' mean (vLLM's and SGLang's feed), width n*H the flattened streams."""
    if state.dim() == 3:
        if state.shape[-1] != width:
            raise ValueError(f"target layer output is {state.shape[-1]} wide, the drafter reads "
                             f"{width} (target_hidden_size): set it to {state.shape[-1]}")
        return state
    n, hidden = state.shape[-2], state.shape[-1]
    if width == hidden:
        return state.mean(dim=-2)
    if width == n * hidden:
        return state.flatten(-2)
    raise ValueError(f"target layer output has {n} streams of {hidden}; the drafter reads "
                     f"{width} (target_hidden_size): use {hidden} (stream mean) or {n * hidden} "
                     "(flattened streams)")


def hf_hidden_state_indices(target_layer_ids: list[int]) -> list[int]:
    """z-lab layer ids -> indices into HF ``output_hidden_states`` (= vLLM aux-layer ids)."""
    return [int(i) + 1 for i in target_layer_ids]


def check_target_layer_ids(target_layer_ids: list[int], num_hidden_layers: int) -> None:
    """ValueError unless the ids are distinct and inside [0, num_hidden_layers)."""
    ids = list(target_layer_ids)
    bad = [i for i in ids if not 0 <= int(i) < num_hidden_layers]
    if not ids or bad or len(set(ids)) != len(ids):
        raise ValueError(
            f"target_layer_ids={ids} invalid for a target with {num_hidden_layers} layers: need "
            f"distinct ids in [0, {num_hidden_layers}) (id i = output of decoder layer i); "
            "use build_target_layer_ids(num_layers, n)"
        )


@torch.no_grad()
def chunked_argmax(lm_head: torch.nn.Module, normed_bsh: torch.Tensor,
                   chunk_tokens: int = 2048) -> torch.Tensor:
    """argmax over the vocab of ``lm_head(normed_bsh)`` [Bt, S, H] -> [Bt, S] int64, computed in
    chunks of positions so the [tokens, V] logits never exist for the whole batch at once."""
    flat = normed_bsh.reshape(-1, normed_bsh.shape[-1])
    out = torch.empty(flat.shape[0], dtype=torch.long, device=flat.device)
    for start in range(0, flat.shape[0], chunk_tokens):
        out[start:start + chunk_tokens] = lm_head(flat[start:start + chunk_tokens]).argmax(-1)
    return out.view(normed_bsh.shape[:-1])


@torch.no_grad()
def extract_features(model, input_ids_bs: torch.Tensor, target_layer_ids: list[int],
                     attention_mask_bs: torch.Tensor | None = None,
                     out_device: torch.device | str | None = None,
                     topk: int = 0, target_hidden_size: int | None = None) -> TargetFeatures:
    """Run the frozen target once; its features at every position. ``attention_mask_bs`` [Bt, S]:
    1 = real token (right pads change no real position). argmax: ``last_bsh`` through the LM head
    without [Bt, S, V]; ``topk`` > 0 adds the top-k. ``out_device``: the ids' by default (a
    ``device_map`` target's gathered there); ``target_hidden_size``: see :func:`layer_features`."""
    check_target_layer_ids(target_layer_ids, int(text_config(model.config).num_hidden_layers))
    check_layer_ids_for_streams(model.config, target_layer_ids)
    width = check_feature_width(model.config, target_hidden_size, "target_hidden_size")
    embed_device = model.get_input_embeddings().weight.device
    out_device = torch.device(out_device) if out_device is not None else input_ids_bs.device
    if attention_mask_bs is not None:
        attention_mask_bs = attention_mask_bs.to(embed_device)
    base_out = model.base_model(input_ids=input_ids_bs.to(embed_device),
                                attention_mask=attention_mask_bs, output_hidden_states=True,
                                use_cache=False)
    states = base_out.hidden_states
    hidden_bsf = torch.cat(
        [layer_features(states[i], width).to(out_device)
         for i in hf_hidden_state_indices(target_layer_ids)], dim=-1)
    lm_head = model.get_output_embeddings()
    last_bsh = base_out.last_hidden_state.to(lm_head.weight.device)
    argmax_bs = chunked_argmax(lm_head, last_bsh).to(out_device)
    top = (tuple(t.to(out_device) for t in chunked_topk(
        lm_head, last_bsh, topk, logit_softcap(model.config))) if topk else (None, None))
    return TargetFeatures(hidden_bsf, argmax_bs, last_bsh.to(out_device), *top)


class OnlineFeatures:
    """The frozen target as an online batch's feature source: ``__call__`` ``input_ids_bs`` [Bt, S]
    -> :class:`TargetFeatures` on the ids' device (moved there on first use, unless
    ``device_map``). no_grad, outside autocast (``bf16-mixed`` never re-rounds the target); right
    pads need no mask (causal). Not an ``nn.Module``: the target is never a Lightning parameter."""

    def __init__(self, model, target_layer_ids: list[int],
                 target_hidden_size: int | None = None):
        self.model, self.target_layer_ids = model, list(target_layer_ids)
        self.target_hidden_size = target_hidden_size  #: per-layer width (None = H)

    def __call__(self, input_ids_bs: torch.Tensor,
                 document_ids_bs: torch.Tensor | None = None) -> TargetFeatures:
        """Features of a batch; packed rows (``document_ids_bs`` [Bt, S], -1 on padding) run
        the target on each document alone (:func:`per_document_features`)."""
        device = input_ids_bs.device
        if self.model.device != device and getattr(self.model, "hf_device_map", None) is None:
            self.model.to(device)
        with torch.autocast(device.type, enabled=False):
            if document_ids_bs is None:
                return extract_features(self.model, input_ids_bs, self.target_layer_ids,
                                        target_hidden_size=self.target_hidden_size)
            return per_document_features(self.model, input_ids_bs, document_ids_bs,
                                         self.target_layer_ids, self.target_hidden_size)


@torch.no_grad()
def per_document_features(model, input_ids_bs: torch.Tensor, document_ids_bs: torch.Tensor,
                          target_layer_ids: list[int],
                          target_hidden_size: int | None = None) -> TargetFeatures:
    """Target features of packed rows, each document computed ALONE (cut out, one right-padded row
    each, :func:`extract_features`, put back): a causal run over the packed row would let it see
    the documents before it. Padding positions get zeros."""
    spans = []  # (row, start, length) of every document
    for row in range(input_ids_bs.shape[0]):
        ids, counts = torch.unique_consecutive(document_ids_bs[row], return_counts=True)
        start = 0
        for doc, count in zip(ids.tolist(), counts.tolist()):
            if doc >= 0:
                spans.append((row, start, count))
            start += count
    longest = max(length for _, _, length in spans)
    docs_dl = input_ids_bs.new_zeros(len(spans), longest)
    for i, (row, start, length) in enumerate(spans):
        docs_dl[i, :length] = input_ids_bs[row, start:start + length]
    alone = extract_features(model, docs_dl, target_layer_ids,
                             target_hidden_size=target_hidden_size)

    def place(per_doc: torch.Tensor | None) -> torch.Tensor | None:
        if per_doc is None:
            return None
        out = per_doc.new_zeros(*input_ids_bs.shape, *per_doc.shape[2:])
        for i, (row, start, length) in enumerate(spans):
            out[row, start:start + length] = per_doc[i, :length]
        return out

    return TargetFeatures(*(place(t) for t in alone))

"""Lightning data modules: batches of target features for DFlash training. A batch holds
``input_ids``, ``loss_mask``, ``attention_mask`` [Bt, S], offline also ``hidden`` [Bt, S, F] and
``target_argmax`` [Bt, S] (online: from ``feature_source()`` in the step), packed rows also
``document_ids`` [Bt, S]. :class:`OnlineDataModule` tokenises conversations,
:class:`OfflineDataModule` reads captured shards; both hold out a deterministic validation split
and shuffle per epoch, so a resumed run sees the same batches (docs/data.md).
"""

from __future__ import annotations

import functools
import logging
import warnings
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, ClassVar

import lightning as L
import torch
from torch import Tensor
from torch.utils.data import DataLoader, Dataset, Sampler, Subset

from dflash_lab.data import packing
from dflash_lab.data.conversations import check_bad_rows_mode, open_conversations, tokenize_rows
from dflash_lab.data.shards import ShardDataset, distribution_of, read_manifest
from dflash_lab.data.speculators_data import SpeculatorsDataset, detect_format, read_layer_ids
from dflash_lab.errors import RENAMED_KEYS, renamed_key_error
from dflash_lab.targets.chat import find_turn_end, target_stop_ids
from dflash_lab.targets.features import OnlineFeatures

log = logging.getLogger(__name__)

PAD_VALUES = {"input_ids": 0, "loss_mask": False, "hidden": 0.0, "target_argmax": 0,
              "target_last_hidden": 0.0, "target_top_ids": 0, "target_top_logprobs": 0.0,
              "document_ids": -1}


def pad_collate(samples: Sequence[dict[str, Tensor]],
                pad_to_multiple_of: int = 1) -> dict[str, Tensor]:
    """Right-pad PAD_VALUES' keys ([S] or [S, F]) to the longest sample rounded up to
    ``pad_to_multiple_of`` (fewer shapes to recompile for), add ``attention_mask`` [Bt, S] (True
    on real tokens), drop other keys. Pads carry no loss and no anchor; no block sees them."""
    real = max(s["input_ids"].shape[0] for s in samples)
    longest = -(-real // pad_to_multiple_of) * pad_to_multiple_of
    batch: dict[str, Tensor] = {}
    for key, value in PAD_VALUES.items():
        if key not in samples[0]:
            continue
        first = samples[0][key]
        batch[key] = first.new_full((len(samples), longest, *first.shape[1:]), value)
        for b, s in enumerate(samples):
            batch[key][b, :s[key].shape[0]] = s[key]
    batch["loss_mask"] = batch["loss_mask"].bool()
    lengths = torch.tensor([s["input_ids"].shape[0] for s in samples])
    batch["attention_mask"] = torch.arange(longest)[None] < lengths[:, None]
    return batch


def split_indices(num: int, val_fraction: float, seed: int,
                  max_val: int | None = None) -> tuple[list[int], list[int]]:
    """Deterministic (train, val) index split; val gets at least one sample when num > 1."""
    if num < 2:
        raise ValueError(f"need at least 2 samples to hold out a validation split, got {num}")
    if not 0 < val_fraction < 1:
        raise ValueError(f"data.val_fraction={val_fraction}: must be in (0, 1)")
    order = torch.randperm(num, generator=torch.Generator().manual_seed(seed)).tolist()
    n_val = max(1, int(round(num * val_fraction)))
    if max_val is not None:
        n_val = max(1, min(n_val, max_val))
    return sorted(order[n_val:]), sorted(order[:n_val])


# Lightning warns that a mid-epoch resume with a loader lacking state_dict/load_state_dict is
# unreliable; the data module's state (BlockDataModule.state_dict) makes it exact here
# (tests/data/test_resume.py), so that warning would only mislead.
warnings.filterwarnings("ignore", message="You're resuming from a checkpoint that ended before "
                        "the epoch ended")


class EpochShuffleSampler(Sampler[int]):
    """This rank's share of a permutation fixed by (seed, epoch), split as torch's
    DistributedSampler (head repeated to a multiple of the world size, rank r takes every
    world-th index from r; trainer configs set ``use_distributed_sampler: false``).
    :meth:`resume_at` skips the first ``samples_done`` indices all ranks consumed (same length)."""

    def __init__(self, num: int, seed: int, world: int | None = None, rank: int | None = None):
        self.num, self.seed, self.epoch = num, seed, 0
        self.world, self.rank = world, rank
        self._resume: tuple[int, int] | None = None

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def resume_at(self, epoch: int, samples_done: int) -> None:
        self._resume = (epoch, samples_done)

    def _ranks(self) -> tuple[int, int]:
        if self.world is not None:
            return self.world, self.rank or 0
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            return torch.distributed.get_world_size(), torch.distributed.get_rank()
        return 1, 0

    def __iter__(self) -> Iterator[int]:
        world, rank = self._ranks()
        epoch, done = self._resume or (self.epoch, 0)
        self._resume = None
        g = torch.Generator().manual_seed(self.seed * 100_003 + epoch)
        order = torch.randperm(self.num, generator=g).tolist()
        order += order[:len(self) * world - self.num]
        return iter(order[rank::world][done // world:])

    def __len__(self) -> int:
        return -(-self.num // self._ranks()[0])


class BlockDataModule(L.LightningDataModule):
    """Split, collate and loaders shared by the online and offline modules, and what
    ``dflash-train`` asks the configured class instead of matching its name (:attr:`runs_target`,
    :meth:`drafter_inputs`, :meth:`check_config`, :meth:`sequence_limit`). ``pack``: packed rows of
    whole documents (docs/data.md, "Packed rows"); ``train_set``/``val_set`` stay the documents,
    ``train_rows``/``val_rows`` are what the loaders serve (the same sets when unpacked)."""

    #: The module computes features with the whole in-process target (online data), so the
    #: run cannot load only the target's head (``target.head_only=true``).
    runs_target: ClassVar[bool] = False

    @classmethod
    def drafter_inputs(cls, drafter_config: Any) -> dict[str, Any]:
        """Constructor arguments taken from the drafter's config (a ``DrafterConfig``), besides
        ``target``: what the data is built for or checked against."""
        return {"target_layer_ids": list(drafter_config.target_layer_ids)}

    @classmethod
    def check_config(cls, data_cfg: Any) -> None:
        """Start-up check of ``data.*`` before any load (ValueError naming key and fix); none."""

    @classmethod
    def sequence_limit(cls, data_cfg: Any) -> tuple[int | None, str]:
        """(longest sequence this data gives, the setting that bounds it) from the ``data.*``
        config, before instantiation; ``(None, "")`` when not known."""
        return None, ""

    def __init__(self, batch_size: int = 8, val_fraction: float = 0.05,
                 max_val_samples: int | None = 256, seed: int = 0, num_workers: int = 0,
                 pad_to_multiple_of: int = 1, pack: bool = False,
                 max_tokens_per_row: int | None = None):
        super().__init__()
        if batch_size < 1:
            raise ValueError(f"data.batch_size={batch_size}: must be >= 1")
        if pad_to_multiple_of < 1:
            raise ValueError(f"data.pad_to_multiple_of={pad_to_multiple_of}: must be >= 1 "
                             "(1 = pad to the longest sample of each batch)")
        if not isinstance(pack, bool):
            raise ValueError(f"data.pack={pack!r}: must be true or false")
        if pack and (max_tokens_per_row is None or int(max_tokens_per_row) < 2):
            raise ValueError(f"data.pack=true needs data.max_tokens_per_row (tokens per packed "
                             f"row, >= 2; got {max_tokens_per_row!r}): e.g. the capture's "
                             "max_length or a multiple of it")
        self.pack = pack
        self.max_tokens_per_row = int(max_tokens_per_row) if pack else max_tokens_per_row
        self.batch_size, self.val_fraction, self.max_val = batch_size, val_fraction, max_val_samples
        self.seed, self.num_workers, self.pad_to_multiple_of = seed, num_workers, pad_to_multiple_of
        self._resume: dict[str, int] | None = None
        self.train_set = self.val_set = self.train_rows = self.val_rows = None  # Datasets: setup()

    def load_samples(self) -> Dataset:
        """All samples (dicts of per-sample tensors); subclasses implement it."""
        raise NotImplementedError

    def feature_source(self):
        """What computes ``hidden`` / ``target_argmax`` for a batch that lacks them: None here
        (captured batches carry their features); the online module returns the target."""
        return None

    def target_distribution(self) -> dict[str, Any]:
        """What of the target's next-token distribution the batches will carry, for the
        distribution losses: ``{"last_hidden": bool, "topk": k}`` (after :meth:`setup`)."""
        return {"last_hidden": False, "topk": 0}

    def describe(self) -> str:
        """Where the samples come from, for messages."""
        return "the training data"

    def setup(self, stage: str | None = None) -> None:
        if self.train_set is not None:
            return
        samples = self.load_samples()
        train_idx, val_idx = split_indices(len(samples), self.val_fraction, self.seed,
                                           self.max_val)
        self.train_set, self.val_set = Subset(samples, train_idx), Subset(samples, val_idx)
        self.train_rows, self.val_rows = self.train_set, self.val_set
        if self.pack:
            where = self.describe()
            self.train_rows = packing.pack(self.train_set, self.max_tokens_per_row, PAD_VALUES,
                                           where, self.seed)
            self.val_rows = packing.pack(self.val_set, self.max_tokens_per_row, PAD_VALUES, where,
                                         None)
            log.info("packed %d training documents into %d rows of <= %d tokens (%.1f%% of "
                     "their tokens real); %d validation documents into %d rows",
                     len(self.train_set), len(self.train_rows), self.max_tokens_per_row,
                     100.0 * self.train_rows.num_tokens()
                     / (len(self.train_rows) * self.max_tokens_per_row),
                     len(self.val_set), len(self.val_rows))

    def _loader(self, dataset: Dataset, sampler: Sampler | None) -> DataLoader:
        return DataLoader(dataset, batch_size=self.batch_size, sampler=sampler,
                          collate_fn=functools.partial(
                              pad_collate, pad_to_multiple_of=self.pad_to_multiple_of),
                          num_workers=self.num_workers,
                          persistent_workers=self.num_workers > 0)

    def train_dataloader(self) -> DataLoader:
        trainer = self.trainer
        if (trainer is not None and trainer.world_size > 1
                and trainer._accelerator_connector.use_distributed_sampler):
            raise ValueError(
                f"{trainer.world_size} processes with Lightning's distributed sampler: the data "
                "module's sampler already gives each rank its share (and resumes inside an "
                "epoch); set trainer.use_distributed_sampler=false (trainer=ddp, ddp_cpu and "
                "fsdp do)")
        sampler = EpochShuffleSampler(len(self.train_rows), self.seed)
        if self._resume:
            sampler.resume_at(self._resume["epoch"], self._resume["samples_done"])
            self._resume = None
        return self._loader(self.train_rows, sampler)

    # Mid-epoch resume. Lightning restores the loop counters from a checkpoint but restarts the
    # loader at the top of its epoch, which would serve the epoch's first batches again (and,
    # with loader workers, index the sampler before set_epoch). The checkpoint therefore keeps
    # where the training data stands, read when it is written (in on_train_batch_end or at
    # validation, when the counters are consistent), and the next loader continues from there.
    # The data module's state, not the loader's: Lightning restores it before configure_optimizers
    # (whose estimated_stepping_batches builds the train loader), loader states only after.
    def state_dict(self) -> dict[str, int]:
        """{"epoch", "samples_done"} of the training data: samples (packed rows with ``pack``)
        of that epoch's order that all ranks together have consumed; empty outside a fit."""
        trainer = self.trainer
        if trainer is None or trainer.state.fn != "fit":
            return {}
        batches = trainer.fit_loop.epoch_loop.batch_progress.current.processed
        epoch = trainer.current_epoch
        if batches >= trainer.num_training_batches:  # the epoch is over: the next one starts
            epoch, batches = epoch + 1, 0
        return {"epoch": epoch, "samples_done": batches * self.batch_size * trainer.world_size}

    def load_state_dict(self, state_dict: dict[str, int]) -> None:
        self._resume = dict(state_dict) if state_dict else None

    def val_dataloader(self) -> DataLoader:
        return self._loader(self.val_rows, None)


class OnlineDataModule(BlockDataModule):
    """Conversations -> chat template + loss mask -> features of the in-process frozen ``target`` (a
    ``Target``), computed in the training step (:meth:`feature_source`: no_grad, the capture's
    function); ``bad_rows``: as ``capture.bad_rows``."""

    runs_target: ClassVar[bool] = True

    @classmethod
    def drafter_inputs(cls, drafter_config: Any) -> dict[str, Any]:
        """The features are made for the drafter's layer ids and per-layer width."""
        return {**super().drafter_inputs(drafter_config),
                "target_hidden_size": drafter_config.target_hidden_size}

    @classmethod
    def sequence_limit(cls, data_cfg: Any) -> tuple[int | None, str]:
        """Conversations are cut to ``data.max_length`` tokens."""
        limit = data_cfg.get("max_length")
        return (int(limit) if limit is not None else None), "data.max_length"

    def __init__(self, path: str, target: Any, target_layer_ids: Sequence[int], *,
                 max_length: int = 2048, split: str = "train", limit: int | None = None,
                 shuffle_seed: int | None = 0, last_turn_only: bool = False,
                 enable_thinking: bool | None = None, demo_rows: int = 512, demo_seed: int = 1,
                 demo_file: str = "outputs/demo/train_conversations.jsonl",
                 bad_rows: str = "skip", target_hidden_size: int | None = None, **kw: Any):
        """``path``, ``split``, ``limit``, ``shuffle_seed``, ``demo_*``: the conversations as
        dflash-capture and dflash-regenerate name them (one reader: ``open_conversations``).
        ``target_hidden_size``: the drafter's per-layer width (None = the target's hidden size)."""
        for old in (k for k in kw if f"data.{k}" in RENAMED_KEYS):
            raise renamed_key_error(f"data.{old}", "the data config of the recipe or command")
        super().__init__(**kw)
        self.bad_rows = check_bad_rows_mode(bad_rows, "data.bad_rows")
        self.opening = dict(path=path, split=split, limit=limit, shuffle_seed=shuffle_seed,
                            demo_rows=demo_rows, demo_seed=demo_seed, demo_file=demo_file)
        self.conversations, self.target = str(path), target
        self.target_layer_ids = list(target_layer_ids)
        self.target_hidden_size, self.max_length = target_hidden_size, max_length
        self.last_turn_only, self.enable_thinking = last_turn_only, enable_thinking

    def load_samples(self) -> list[dict[str, Tensor]]:
        opened = open_conversations(**self.opening)  # path=demo: written to demo_file first
        rows, self.conversations = opened.dataset, opened.source["path"]
        turn_end = find_turn_end(self.target.tokenizer, target_stop_ids(self.target),
                                 self.enable_thinking)
        done = tokenize_rows(self.target.tokenizer, rows, 0, source=self.conversations,
                             bad_rows=self.bad_rows, setting="data.bad_rows",
                             max_length=self.max_length, last_turn_only=self.last_turn_only,
                             enable_thinking=self.enable_thinking, turn_end=turn_end)
        items = [{"input_ids": tc.input_ids, "loss_mask": tc.loss_mask}
                 for _, tc in done.samples if tc.loss_mask.sum() >= 2]  # >= 1 anchor
        loss = [int(it["loss_mask"].sum()) for it in items]
        self.report = {"num_rows": len(rows), "num_samples": len(items),  # logged, and kept
                       "loss_tokens_per_sample": {"min": min(loss, default=0),
                                                  "mean": sum(loss) / max(len(loss), 1),
                                                  "max": max(loss, default=0)},
                       "bad_rows": done.bad_rows, "zero_loss_rows": done.zero_loss_rows,
                       "num_dropped": len(rows) - len(items)}
        log.info("online data %s: %d of %d rows kept; loss tokens per sample min %d, mean "
                 "%.1f, max %d; %d bad rows skipped", self.conversations, len(items), len(rows),
                 *self.report["loss_tokens_per_sample"].values(), len(done.bad_rows))
        if len(items) < 2:
            raise ValueError(f"{self.conversations}: fewer than 2 usable conversations "
                             "(each needs >= 2 assistant tokens within max_length; "
                             f"{len(done.bad_rows)} bad rows were skipped)")
        return items  # in memory: a list serves as the dataset (packing reads its lengths)

    def feature_source(self):
        """The frozen target, the training step's feature source (batches carry ids and masks)."""
        return OnlineFeatures(self.target.model, self.target_layer_ids, self.target_hidden_size)

    def target_distribution(self) -> dict[str, Any]:
        """The in-process target gives its final-normed last hidden state with every batch."""
        return {"last_hidden": True, "topk": 0}

    def describe(self) -> str:
        return f"the conversations {self.conversations} (online)"


class OfflineDataModule(BlockDataModule):
    """Captured shards, checked at start-up against the drafter (``target_layer_ids``,
    ``hidden_size``, ``vocab_size``) and an optional ``target`` (config, tokenizer, weights;
    ``allow_other_target_weights``: another checkpoint of the same config), each refusal naming
    both values. ``format``: ``auto`` (by the files), ``dflash_lab`` or ``speculators`` (with
    ``speculators_layer_ids``, ``hidden_states_path``: docs/data.md, "speculators data")."""

    @classmethod
    def drafter_inputs(cls, drafter_config: Any) -> dict[str, Any]:
        """Checked against the drafter's layer ids, hidden size, per-layer width, vocab size."""
        return {**super().drafter_inputs(drafter_config),
                "hidden_size": drafter_config.hidden_size,
                "target_hidden_size": drafter_config.target_hidden_size,
                "vocab_size": drafter_config.vocab_size}

    @classmethod
    def check_config(cls, data_cfg: Any) -> None:
        """``data.path`` is set (``???`` in conf/data/offline.yaml)."""
        if not data_cfg.get("path"):
            raise ValueError("data.path is not set: data=offline reads a capture directory; "
                             "pass data.path=DIR (the dflash-capture out_dir holding "
                             "manifest.json)")

    @classmethod
    def sequence_limit(cls, data_cfg: Any) -> tuple[int | None, str]:
        """The capture's ``max_length``, read from its manifest (speculators data: its longest
        row, from the prepare-data ``seq_len`` column)."""
        if detect_format(data_cfg.path, data_cfg.get("format", "auto")) == "speculators":
            from datasets import load_from_disk

            lengths = load_from_disk(str(data_cfg.path)).with_format(None)["seq_len"]
            return max(lengths, default=0), f"the longest row of {data_cfg.path} (seq_len)"
        return read_manifest(data_cfg.path).get("max_length"), (
            f"{data_cfg.path}/manifest.json max_length (the capture's capture.max_length)")

    def __init__(self, path: str, *, target_layer_ids: Sequence[int] | None = None,
                 hidden_size: int | None = None, vocab_size: int | None = None,
                 target_hidden_size: int | None = None,
                 target: Any = None, verify_checksums: bool | str = "first_use",
                 allow_other_target_weights: bool = False, format: str = "auto",
                 speculators_layer_ids: Sequence[int] | None = None,
                 hidden_states_path: str | None = None, **kw: Any):
        if not path or not isinstance(path, (str, Path)):
            raise ValueError(f"data.path={path!r}: data=offline reads a capture directory; set "
                             "data.path=DIR (the dflash-capture out_dir holding manifest.json)")
        super().__init__(**kw)
        self.path = path
        self.expect = {"target_layer_ids": list(target_layer_ids) if target_layer_ids else None,
                       "hidden_size": hidden_size, "vocab_size": vocab_size,
                       "target_hidden_size": target_hidden_size,
                       "target": target.identity() if target is not None else None,
                       "allow_other_weights": allow_other_target_weights}
        self.verify_checksums, self.format, self.target = verify_checksums, format, target
        self.speculators = {"layer_ids": speculators_layer_ids,
                            "hidden_states_path": hidden_states_path}

    def load_samples(self) -> Dataset:
        if detect_format(self.path, self.format) == "speculators":
            self.samples = SpeculatorsDataset(
                self.path, target=self.target, target_layer_ids=self.expect["target_layer_ids"],
                layer_ids=read_layer_ids(self.speculators["layer_ids"]),
                hidden_states_path=self.speculators["hidden_states_path"],
                hidden_size=self.expect["hidden_size"], vocab_size=self.expect["vocab_size"],
                target_hidden_size=self.expect["target_hidden_size"])
        else:
            self.samples = ShardDataset(self.path, verify_checksums=self.verify_checksums,
                                        **self.expect)
        return self.samples

    def target_distribution(self) -> dict[str, Any]:
        """What the capture kept (its manifest's ``distribution``; none before the option)."""
        return distribution_of(self.samples.manifest)

    def describe(self) -> str:
        return f"the capture {self.path}"

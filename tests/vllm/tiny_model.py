"""A small random Llama that vLLM loads offline, for the end-to-end P/D tests and bench.

The model is written with ``transformers`` (``LlamaConfig`` + ``LlamaForCausalLM``, fixed seed,
bf16) and its tokenizer is a byte-level BPE trained with the ``tokenizers`` library on text that
ships with Python itself (the docstrings of standard-library modules), so nothing is downloaded.
The directory holds everything ``vllm.LLM(model=path)`` / ``vllm serve path`` needs:
``config.json``, ``generation_config.json``, ``model.safetensors``, ``tokenizer.json``,
``tokenizer_config.json`` and ``special_tokens_map.json``.

Usage::

    python -m tests.vllm.tiny_model /tmp/tiny-llama     # or
    from tests.vllm.tiny_model import build_tiny_llama; build_tiny_llama(path)
"""

from __future__ import annotations

import hashlib
import importlib
import inspect
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

#: Shape of the model. GQA (4 query heads share 2 KV heads), head_dim 64, bf16.
TINY_LLAMA: dict[str, Any] = {
    "vocab_size": 768,
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    # A wider init than the default 0.02 makes the random model's logits peaked, so greedy
    # decoding is not decided by bf16 rounding noise (P/D vs. single-instance comparisons).
    "initializer_range": 0.08,
    "tie_word_embeddings": False,
}
SEED = 1234
SPECIAL_TOKENS = ["<unk>", "<s>", "</s>"]
#: Bumped when the recipe changes; part of the marker that makes ``build_tiny_llama`` idempotent.
RECIPE_VERSION = 1

#: Standard-library modules whose docstrings form the tokenizer's training text.
_CORPUS_MODULES = [
    "abc",
    "argparse",
    "ast",
    "asyncio",
    "base64",
    "bisect",
    "calendar",
    "collections",
    "contextlib",
    "copy",
    "csv",
    "dataclasses",
    "datetime",
    "decimal",
    "difflib",
    "email",
    "enum",
    "fractions",
    "functools",
    "glob",
    "hashlib",
    "heapq",
    "hmac",
    "http.client",
    "inspect",
    "io",
    "ipaddress",
    "itertools",
    "json",
    "logging",
    "math",
    "operator",
    "os",
    "pathlib",
    "pickle",
    "pprint",
    "queue",
    "random",
    "re",
    "shlex",
    "shutil",
    "socket",
    "statistics",
    "string",
    "struct",
    "subprocess",
    "tarfile",
    "tempfile",
    "textwrap",
    "threading",
    "time",
    "timeit",
    "typing",
    "unittest",
    "urllib.parse",
    "uuid",
    "warnings",
    "weakref",
    "zipfile",
]


def corpus_lines() -> list[str]:
    """Docstrings of a fixed set of standard-library modules and their public members, in order."""
    seen: set[str] = set()
    out: list[str] = []
    for name in _CORPUS_MODULES:
        try:
            mod = importlib.import_module(name)
        except ImportError:  # pragma: no cover - all are stdlib
            continue
        objs: list[Any] = [mod]
        objs += [getattr(mod, a) for a in sorted(dir(mod)) if not a.startswith("_")]
        for obj in objs:
            doc = inspect.getdoc(obj) if not isinstance(obj, (str, int, float, bytes)) else None
            if not doc or doc in seen:
                continue
            seen.add(doc)
            out.extend(line.strip() for line in doc.splitlines() if line.strip())
    return out


def _fingerprint() -> str:
    """Identifies the recipe (shape, seed, version, Python's docstrings) of a built model."""
    blob = json.dumps(
        {"cfg": TINY_LLAMA, "seed": SEED, "v": RECIPE_VERSION, "py": sys.version_info[:2]}, sort_keys=True
    )
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def _train_tokenizer(lines: list[str], vocab_size: int) -> Any:
    """Train a byte-level BPE tokenizer and wrap it as a ``PreTrainedTokenizerFast``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(lines, trainer=trainer)
    bos = tok.token_to_id("<s>")
    # Prepend BOS like Llama does; no EOS on encode.
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", bos)]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        model_max_length=TINY_LLAMA["max_position_embeddings"],
        clean_up_tokenization_spaces=False,
    )


def build_tiny_llama(path: str | os.PathLike[str]) -> Path:
    """Write the tiny random Llama and its tokenizer to ``path`` (idempotent) and return it.

    If ``path`` already holds a model built by the same recipe, nothing is done. The directory is
    built in a sibling temporary directory and renamed into place, so concurrent callers and
    interrupted builds never leave a half-written model behind.
    """
    dest = Path(path).resolve()
    marker = dest / "kvxfer_tiny_model.json"
    fp = _fingerprint()
    if marker.exists():
        try:
            if json.loads(marker.read_text()).get("fingerprint") == fp:
                return dest
        except (OSError, ValueError):
            pass
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.", dir=dest.parent))
    tmp.chmod(0o755)
    try:
        tokenizer = _train_tokenizer(corpus_lines(), TINY_LLAMA["vocab_size"])
        cfg = LlamaConfig(
            **TINY_LLAMA,
            bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=None,
            dtype="bfloat16",
        )
        torch.manual_seed(SEED)
        model = LlamaForCausalLM(cfg).to(torch.bfloat16).eval()
        model.generation_config = GenerationConfig(
            bos_token_id=cfg.bos_token_id, eos_token_id=cfg.eos_token_id, do_sample=False
        )
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        (tmp / "kvxfer_tiny_model.json").write_text(
            json.dumps({"fingerprint": fp, "config": TINY_LLAMA, "seed": SEED}, indent=2)
        )
        if dest.exists():
            shutil.rmtree(dest)
        os.replace(tmp, dest)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return dest


if __name__ == "__main__":
    out = build_tiny_llama(sys.argv[1] if len(sys.argv) > 1 else "/tmp/kvxfer-tiny-llama")
    print(out)

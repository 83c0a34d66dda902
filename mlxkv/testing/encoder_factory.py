"""Small BERT encoder models with random weights, built offline for tests: what an embedding
model such as bge or gte is, in miniature.

Owns: writing a BERT directory in Hugging Face layout (`config.json`, `model.safetensors`, the
factory's tokenizer) that `mlx_embeddings.load` and `mlxkv.Runner.load` read like a downloaded
model. Weights come from mlx-embeddings' own BERT class (its parameter names are what its
loader reads). Does not own loading (`mlxkv.models.encoder`), nor decoder models (`factory`).

Imports mlx-embeddings (the `embeddings` extra).
"""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten

from mlxkv.testing.factory import CHAT_TEMPLATE, _write_tokenizer

# BERT's [CLS] and [SEP], played by the factory tokenizer's own special tokens.
_CLS, _SEP = "<|im_start|>", "<|im_end|>"


def build_encoder_model(out_dir: str | Path, *, seed: int = 0, vocab_size: int = 300) -> Path:
    """Writes a tiny BERT (2 layers, hidden size 32) to `out_dir` once; returns the path."""
    from mlx_embeddings.models.bert import Model, ModelArgs

    out = Path(out_dir)
    if (out / "model.safetensors").exists():
        return out
    out.mkdir(parents=True, exist_ok=True)
    ids = _write_tokenizer(out, vocab_size, CHAT_TEMPLATE, ())
    _mark_sequences(out)
    config = {
        "architectures": ["BertModel"],
        "model_type": "bert",
        "hidden_size": 32,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "intermediate_size": 64,
        "max_position_embeddings": 128,
        "type_vocab_size": 2,
        "layer_norm_eps": 1e-12,
        "vocab_size": ids["vocab_size"],
        "pad_token_id": ids["bos_token_id"],
    }
    (out / "config.json").write_text(json.dumps(config, indent=2))
    mx.random.seed(seed)
    model = Model(ModelArgs.from_dict(config))
    weights = dict(tree_flatten(model.parameters()))
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "mlx"})
    return out


def _mark_sequences(out: Path) -> None:
    """Each encoded text between a CLS and a SEP token, as BERT's tokenizer adds them."""
    from tokenizers import Tokenizer, processors

    tokenizer = Tokenizer.from_file(str(out / "tokenizer.json"))
    cls_id, sep_id = tokenizer.token_to_id(_CLS), tokenizer.token_to_id(_SEP)
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{_CLS} $A {_SEP}", special_tokens=[(_CLS, cls_id), (_SEP, sep_id)]
    )
    tokenizer.save(str(out / "tokenizer.json"))

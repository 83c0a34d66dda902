"""GGUF round trip: a factory llama written in llama.cpp's conventions loads back through the
GGUF path with the same logits and the same tokenization."""

import json

import mlx.core as mx
import numpy as np
import pytest

from mlxkv import UnsupportedFormatError
from mlxkv.models.gguf.convert import convert_gguf
from mlxkv.models.loading import load_model
from tests.factories import tiny_model_dir

_NAMES = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
}


def _llama_cpp_permute(w: mx.array, heads: int) -> mx.array:
    """What llama.cpp's convert script does to q/k rows (HF half-split -> interleaved)."""
    rows, cols = w.shape
    return w.reshape(heads, 2, rows // heads // 2, cols).swapaxes(1, 2).reshape(rows, cols)


def llama_cpp_tensors(model_dir) -> dict[str, mx.array]:
    """The factory model's weights under llama.cpp's names, q/k rows permuted as its convert
    script does, in the model's own dtype."""
    config = json.loads((model_dir / "config.json").read_text())
    tensors = {}
    for name, w in mx.load(str(model_dir / "model.safetensors")).items():
        if name == "model.embed_tokens.weight":
            key = "token_embd.weight"
        elif name == "model.norm.weight":
            key = "output_norm.weight"
        elif name == "lm_head.weight":
            key = "output.weight"
        else:
            _, _, layer, rest = name.split(".", 3)
            module = rest.rsplit(".", 1)[0]
            key = f"blk.{layer}.{_NAMES[module]}.weight"
            if module == "self_attn.q_proj":
                w = _llama_cpp_permute(w, config["num_attention_heads"])
            elif module == "self_attn.k_proj":
                w = _llama_cpp_permute(w, config["num_key_value_heads"])
        tensors[key] = w
    return tensors


def llama_cpp_metadata(model_dir, *, architecture="llama", file_type=1) -> dict:
    """The factory model's config and tokenizer as llama.cpp's GGUF metadata keys."""
    config = json.loads((model_dir / "config.json").read_text())
    tok = json.loads((model_dir / "tokenizer.json").read_text())
    vocab = sorted(tok["model"]["vocab"].items(), key=lambda kv: kv[1])
    specials = {t["content"] for t in tok["added_tokens"]}
    merges = [m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]]
    tok_config = json.loads((model_dir / "tokenizer_config.json").read_text())
    u32 = lambda v: mx.array(v, dtype=mx.uint32)  # noqa: E731
    return {
        "general.architecture": architecture,
        "general.file_type": u32(file_type),
        "llama.embedding_length": u32(config["hidden_size"]),
        "llama.block_count": u32(config["num_hidden_layers"]),
        "llama.feed_forward_length": u32(config["intermediate_size"]),
        "llama.attention.head_count": u32(config["num_attention_heads"]),
        "llama.attention.head_count_kv": u32(config["num_key_value_heads"]),
        "llama.attention.key_length": u32(config["head_dim"]),
        "llama.attention.layer_norm_rms_epsilon": mx.array(config["rms_norm_eps"]),
        "llama.rope.freq_base": mx.array(config["rope_theta"]),
        "llama.context_length": u32(config["max_position_embeddings"]),
        "llama.vocab_size": u32(config["vocab_size"]),
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "default",
        "tokenizer.ggml.tokens": [t for t, _ in vocab],
        "tokenizer.ggml.token_type": mx.array(
            [3 if t in specials else 1 for t, _ in vocab], dtype=mx.int32
        ),
        "tokenizer.ggml.merges": merges,
        "tokenizer.ggml.eos_token_id": u32(config["eos_token_id"]),
        "tokenizer.ggml.bos_token_id": u32(config["bos_token_id"]),
        "tokenizer.chat_template": tok_config["chat_template"],
    }


def write_gguf(model_dir, out_path, *, architecture="llama", dtype=mx.float16, **overrides):
    tensors = {
        key: w.astype(dtype) if w.ndim == 2 else w
        for key, w in llama_cpp_tensors(model_dir).items()
    }
    metadata = llama_cpp_metadata(model_dir, architecture=architecture)
    metadata.update(overrides)
    mx.save_gguf(str(out_path), tensors, metadata)
    return out_path


@pytest.fixture(scope="module")
def gguf_file(model_root, tmp_path_factory):
    path = tmp_path_factory.mktemp("gguf") / "tiny-llama.F16.gguf"
    return write_gguf(tiny_model_dir("llama", model_root), path)


def test_logits_match_the_original_model(gguf_file, model_root, tmp_path, monkeypatch):
    monkeypatch.setenv("MLXKV_CACHE_DIR", str(tmp_path))
    original = load_model(tiny_model_dir("llama", model_root))
    converted = load_model(gguf_file)
    assert converted.path.parent.parent == tmp_path  # cached under the content hash
    ids = original.tokenizer.encode("The quick brown fox jumps over the lazy dog")
    want = original.model(mx.array(ids)[None])
    got = converted.model(mx.array(ids)[None])
    # Weights stored as float16 (2^-11 relative rounding each): measured 0.4% of the logits'
    # scale on the factory llama.
    diff, scale = mx.abs(got - want).max().item(), mx.abs(want).max().item()
    assert diff < 1e-2 * scale, f"max |diff| {diff:.3g} at logits up to {scale:.3g}"
    assert (mx.argmax(got, axis=-1) == mx.argmax(want, axis=-1)).all().item()
    assert got.dtype == mx.float32
    # q/k rows back in Hugging Face order: equal up to float16 rounding.
    for name in ("q_proj", "k_proj"):
        a = getattr(original.model.layers[0].self_attn, name).weight
        b = getattr(converted.model.layers[0].self_attn, name).weight
        assert mx.allclose(a.astype(mx.float16).astype(mx.float32), b, atol=0).item(), name


def test_tokenizer_and_chat_template_survive(gguf_file, model_root, tmp_path, monkeypatch):
    monkeypatch.setenv("MLXKV_CACHE_DIR", str(tmp_path))
    original = load_model(tiny_model_dir("llama", model_root)).tokenizer
    converted = load_model(gguf_file).tokenizer
    text = "Hello, how are you? 1000 <|im_start|>user\nParis!<|im_end|>"
    assert converted.encode(text) == original.encode(text)
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    assert converted.apply_chat_template(
        messages, add_generation_prompt=True
    ) == original.apply_chat_template(messages, add_generation_prompt=True)
    assert converted.eos_token_ids == original.eos_token_ids


def test_second_load_reuses_the_conversion(gguf_file, tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("MLXKV_CACHE_DIR", str(tmp_path))
    load_model(gguf_file)
    with caplog.at_level("INFO", logger="mlxkv"):
        load_model(gguf_file)
    assert any("reusing conversion" in r.getMessage() for r in caplog.records)


def test_unsupported_architecture_is_named(model_root, tmp_path):
    path = write_gguf(tiny_model_dir("llama", model_root), tmp_path / "x.gguf", architecture="rwkv")
    with pytest.raises(UnsupportedFormatError, match="'rwkv'"):
        convert_gguf(path, tmp_path / "out")


def test_unpermute_inverts_llama_cpp_permutation():
    from mlxkv.models.gguf.convert import _unpermute_rows

    w = mx.array(np.arange(8 * 16 * 3, dtype=np.float32).reshape(8 * 16, 3))
    assert mx.array_equal(_unpermute_rows(_llama_cpp_permute(w, 8), 8), w)
